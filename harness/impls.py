"""Implementations under test, behind one adapter interface.

Built in: `ours` (impl/), `fsdp2` (torch.distributed.fsdp.fully_shard), `ddp`
(DistributedDataParallel) and `single` (the plain module, no process group: the reference).
A user's implementation needs no edit here: pass `--impls my_pkg.my_mod:MyAdapter` or
`--impls path/to/file.py:MyAdapter`, naming a class (or instance) that satisfies `Adapter`.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn as nn

from cases.features import DTYPES, PLAIN, Features
from harness.features import CastCompute, all_reduce_mean_copy, make_mesh


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    group: dist.ProcessGroup | None  # None: no process group (W = 1, impl=single)
    device: torch.device = torch.device("cpu")


@dataclass(frozen=True)
class RawShard:
    """One rank's raw shard of one flat parameter, padding included (for the padding check)."""

    key: str  # '<unit fqn>/<flat param name>'
    data: torch.Tensor  # (shard_numel,)
    grad: torch.Tensor | None  # (shard_numel,) or None
    padding_intervals: tuple[tuple[int, int], ...]  # every padding run, shard-local [start, end)


@runtime_checkable
class Adapter(Protocol):
    name: str
    needs_process_group: bool

    def wrap(self, model: nn.Module, wrap_paths: tuple[str, ...], ctx: RankContext,
             faults: frozenset[str]) -> nn.Module:
        """Shard/wrap `model` (already holding the reference initial state) for training."""

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full parameters under the plain model's names (a collective; every rank calls it)."""

    def full_grads(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full averaged gradients under the plain model's names (after backward, a collective)."""

    def layouts(self, model: nn.Module) -> dict[str, dict]:
        """Per parameter name, how its elements map to ranks (see snapshot.py, 'layouts')."""

    def raw_shards(self, model: nn.Module) -> list[RawShard]:
        """This rank's raw padded shards (no collective); [] when the impl exposes none."""


class Ours:
    name = "ours"
    needs_process_group = True
    refuses_cross_unit_ties = True  # tied parameters across units raise at fully_shard

    def unsupported(self, features: Features) -> str | None:
        return None

    def wrap(self, model, wrap_paths, ctx, faults, features: Features = PLAIN):
        import impl

        if features.zero1:
            return model  # replicated parameters; the optimizer shards its state
        kwargs = {"_faults": faults, "reshard_after_forward": features.reshard_after_forward}
        if features.mesh == "shard":
            kwargs["process_group"] = ctx.group
        else:
            kwargs["mesh"] = make_mesh(features, ctx.world_size, ctx.device.type)
        if features.mixed_precision:
            kwargs["mp_policy"] = impl.MixedPrecisionPolicy(
                DTYPES[features.param_dtype], DTYPES[features.reduce_dtype] if features.reduce_dtype else None)
        if features.auto_wrap is not None:
            wrapped = impl.auto_wrap(model, _auto_wrap_policy(features), **kwargs)
            if features.expected_units and tuple(wrapped) != features.expected_units:
                raise RuntimeError(f"rank {ctx.rank}: auto_wrap({features.auto_wrap}) wrapped {wrapped}, "
                                   f"expected {list(features.expected_units)}")
        else:
            for path in wrap_paths:
                impl.fully_shard(model.get_submodule(path), **kwargs)
            impl.fully_shard(model, **kwargs)
        if features.prefetch:
            _set_prefetch(model, wrap_paths)
        return model

    def materialize(self, model, init_state, device: torch.device = torch.device("cpu")):
        import impl

        impl.init_meta_module(model, device)
        impl.load_full_state_dict(model, init_state)

    def build_optimizer(self, model, spec, features: Features):
        import impl

        if not features.zero1:
            return spec.build(model.parameters())
        return impl.ZeroRedundancyOptimizer(model.parameters(), spec.build)

    def clip_grad_norm(self, model, max_norm, norm_type):
        import impl

        return impl.clip_grad_norm_(model, max_norm, norm_type)

    def reshard_checkpoint(self, model, optim, spec, ctx, features, directory, shard_size, wrap_paths, build_model):
        """Save a sharded checkpoint, then load it into a fresh model sharded over `shard_size`
        ranks (a (W / shard_size, shard_size) mesh); returns the new (model, optimizer)."""
        import impl
        from torch.distributed.device_mesh import init_device_mesh

        impl.save_sharded_checkpoint(model, optim, directory)
        fresh = build_model().to(ctx.device)
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size // shard_size, shard_size),
                                mesh_dim_names=("replicate", "shard"))
        for path in wrap_paths:
            impl.fully_shard(fresh.get_submodule(path), mesh=mesh)
        impl.fully_shard(fresh, mesh=mesh)
        fresh_optim = spec.build(fresh.parameters())
        impl.load_sharded_checkpoint(fresh, fresh_optim, directory)
        return fresh, fresh_optim

    def full_params(self, model):
        from impl import full_state_dict, units

        if not units(model):  # zero1: replicated plain parameters
            return {n: p.detach().clone() for n, p in model.named_parameters()}
        return full_state_dict(model)

    def full_grads(self, model):
        from impl import full_grad_dict, units

        if not units(model):  # zero1: the optimizer averages inside step(); observe the same mean
            group = dist.group.WORLD if dist.is_initialized() else None
            return all_reduce_mean_copy({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, group)
        return full_grad_dict(model)

    def layouts(self, model):
        from impl import local_shards

        out = {}
        for shard in local_shards(model):
            layout = shard.layout
            for slot in layout.slots:
                for fqn in slot.fqns:
                    name = f"{shard.unit_fqn}.{fqn}" if shard.unit_fqn else fqn
                    out[name] = {
                        "kind": "flat",
                        "unit": shard.unit_fqn or "<root>",
                        "flat_key": _flat_key(shard),
                        "offset": slot.offset,  # in the padded flat buffer, alignment padding included
                        "shard_numel": layout.shard_numel,
                        "aligned_numel": layout.aligned_numel,
                        "world_size": layout.world_size,
                    }
        return out

    def raw_shards(self, model):
        from impl import local_shards

        return [
            RawShard(key=_flat_key(s), data=s.data, grad=s.grad, padding_intervals=s.padding_intervals)
            for s in local_shards(model)
        ]


class FSDP2:
    name = "fsdp2"
    needs_process_group = True

    def unsupported(self, features: Features) -> str | None:
        for field_name, reason in (
            ("auto_wrap", "torch FSDP2 has no auto-wrap policies (FSDP1 had them)"),
            ("zero1", "torch FSDP2 has no optimizer-state-only sharding (ZeRO-1)"),
            ("checkpoint_reshard_at", "not mapped: FSDP2 reshards checkpoints through torch.distributed.checkpoint"),
        ):
            if getattr(features, field_name):
                return reason
        return None

    def wrap(self, model, wrap_paths, ctx, faults, features: Features = PLAIN):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if features.mesh == "shard":
            mesh = DeviceMesh.from_group(ctx.group, ctx.device.type)
        else:
            mesh = make_mesh(features, ctx.world_size, ctx.device.type)
        kwargs = {"mesh": mesh, "reshard_after_forward": features.reshard_after_forward}
        if features.mixed_precision:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                DTYPES[features.param_dtype], DTYPES[features.reduce_dtype] if features.reduce_dtype else None)
        for path in wrap_paths:
            fully_shard(model.get_submodule(path), **kwargs)
        fully_shard(model, **kwargs)
        if features.prefetch:
            _set_prefetch(model, wrap_paths)
        return model

    def materialize(self, model, init_state, device: torch.device = torch.device("cpu")):
        from torch.distributed.tensor import distribute_tensor

        model.to_empty(device=device)
        with torch.no_grad():  # every rank holds the full reference state: keep this rank's shard
            for name, param in model.named_parameters():
                param.copy_(distribute_tensor(init_state[name], param.device_mesh, param.placements))

    def full_params(self, model):
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}

    def full_grads(self, model):
        return {n: p.grad.full_tensor().detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    def layouts(self, model):
        out = {}
        for name, p in model.named_parameters():
            rows = p.size(0) if p.dim() else 1
            world_size = p.device_mesh.size()
            out[name] = {"kind": "dim0", "rows": rows, "chunk_rows": math.ceil(rows / world_size),
                         "world_size": world_size}
        return out

    def raw_shards(self, model):
        return []


class DDP:
    name = "ddp"
    needs_process_group = True

    def unsupported(self, features: Features) -> str | None:
        if features not in (PLAIN, Features(refused_wrap=features.refused_wrap)):
            return "the ddp adapter maps no FSDP features"
        return None

    def wrap(self, model, wrap_paths, ctx, faults, features: Features = PLAIN):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, process_group=ctx.group)

    def full_params(self, model):
        return {n: p.detach().clone() for n, p in model.module.named_parameters()}

    def full_grads(self, model):
        return {n: p.grad.detach().clone() for n, p in model.module.named_parameters() if p.grad is not None}

    def layouts(self, model):
        return {n: {"kind": "replicated"} for n, _ in model.module.named_parameters()}

    def raw_shards(self, model):
        return []


class Single:
    name = "single"
    needs_process_group = False

    def unsupported(self, features: Features) -> str | None:
        return None

    def wrap(self, model, wrap_paths, ctx, faults, features: Features = PLAIN):
        if features.mixed_precision:
            return CastCompute(model, features.compute_dtype)
        return model

    def materialize(self, model, init_state, device: torch.device = torch.device("cpu")):
        model.to_empty(device=device)
        model.load_state_dict(init_state)

    def full_params(self, model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    def full_grads(self, model):
        return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    def layouts(self, model):
        return {n: {"kind": "replicated"} for n, _ in model.named_parameters()}

    def raw_shards(self, model):
        return []


def _flat_key(shard) -> str:
    """'<unit fqn>/<flat param name>': a RawShard's key, named by every parameter's layout."""
    return f"{shard.unit_fqn or '<root>'}/{shard.param_name}"


def _set_prefetch(model: nn.Module, wrap_paths: tuple[str, ...]) -> None:
    """Each wrapped unit prefetches the next one in forward and the previous one in backward."""
    units = [model.get_submodule(p) for p in wrap_paths]
    for prev, nxt in zip(units, units[1:]):
        prev.set_modules_to_forward_prefetch([nxt])
        nxt.set_modules_to_backward_prefetch([prev])


def _auto_wrap_policy(features: Features):
    import impl
    from cases.catalog import LAYER_CLASSES

    if features.auto_wrap == "layer_class":
        return impl.ModuleClassPolicy(tuple(LAYER_CLASSES.values()))
    return impl.SizePolicy(features.auto_wrap_min_params)


BUILTIN_IMPLS: dict[str, type] = {"ours": Ours, "fsdp2": FSDP2, "ddp": DDP, "single": Single}


def resolve_impl(spec: str) -> Adapter:
    """A built-in name, or 'module.path:attr' / 'path/to/file.py:attr' naming an Adapter."""
    if spec in BUILTIN_IMPLS:
        return BUILTIN_IMPLS[spec]()
    if ":" not in spec:
        raise ValueError(
            f"unknown impl {spec!r}; built-in: {sorted(BUILTIN_IMPLS)}, or give 'module:Class' / 'file.py:Class'"
        )
    target, attr = spec.rsplit(":", 1)
    try:
        if target.endswith(".py"):
            path = Path(target).resolve()
            if not path.is_file():
                raise ValueError(f"impl {spec!r}: no file {path}")
            mod_name = "harness_user_impl_" + "".join(c if c.isalnum() else "_" for c in str(path))
            module_spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ImportError as e:
        raise ValueError(f"impl {spec!r}: cannot import {target!r}: {e}") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise ValueError(f"impl {spec!r}: {target!r} has no attribute {attr!r}")
    adapter = obj() if isinstance(obj, type) else obj
    if not isinstance(adapter, Adapter):
        missing = [m for m in ("name", "needs_process_group", "wrap", "full_params", "full_grads", "layouts",
                               "raw_shards") if not hasattr(adapter, m)]
        raise ValueError(f"impl {spec!r} does not satisfy harness.impls.Adapter; missing {missing}")
    return adapter
