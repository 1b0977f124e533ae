"""`ours`: the FSDP of impl/, the only module of the harness that imports impl."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from cases.features import DTYPES, PLAIN, Features
from harness.adapters.base import Adapter, RawShard, norm_value, set_prefetch
from harness.adapters.features import all_reduce_mean_copy, make_mesh


class Ours(Adapter):
    name = "ours"
    contracts = frozenset({"gradient_sync_off", "no_gather_in_backward", "unsharded", "shard_group", "sharded_state"})
    refuses_cross_unit_ties = True  # tied parameters across units raise at the root's first forward
    reshards_checkpoints = True
    simulated_ranks = True  # impl/_collectives.py: torch.distributed's Python collectives only

    def unsupported(self, features: Features) -> str | None:
        return None

    def wrap(self, model, wrap_paths, ctx):
        import impl

        features = ctx.features
        if features.zero1:
            self._zero1_faults = ctx.faults  # make_optimizer builds the ZeRO-1 optimizer
            return model  # replicated parameters; the optimizer shards its state
        kwargs = {"_faults": ctx.faults, "reshard_after_forward": features.reshard_after_forward}
        if features.mesh == "shard":
            kwargs["process_group"] = ctx.group
        else:
            kwargs["mesh"] = make_mesh(features, ctx.world_size, ctx.device.type)
        if features.cpu_offload:
            kwargs["offload_policy"] = impl.CPUOffloadPolicy(compute_device=ctx.device)
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
            for group in features.wrap_groups:
                members = [model.get_submodule(path) for path in group]
                impl.fully_shard(members, **kwargs)
                if len({id(m.__dict__.get("_fsdp_unit")) for m in members}) != 1:
                    raise RuntimeError(f"rank {ctx.rank}: fully_shard({list(group)}) left its members in several units")
            impl.fully_shard(model, **kwargs)
        if features.prefetch:
            set_prefetch(model, wrap_paths)
        return model

    def materialize(self, model, init_state, device: torch.device = torch.device("cpu")):
        import impl

        impl.init_meta_module(model, device)
        impl.load_full_state_dict(model, init_state)

    def make_optimizer(self, model, spec, features: Features):
        import impl

        if not features.zero1:
            return spec.build(model.parameters())
        return impl.ZeroRedundancyOptimizer(model.parameters(), spec.build,
                                            _faults=getattr(self, "_zero1_faults", frozenset()))

    def set_gradient_sync(self, model, enabled):
        from impl import units

        if units(model):  # zero1: plain replicated parameters, averaged inside the optimizer's step
            model.set_requires_gradient_sync(enabled)

    def clip_grad_norm(self, model, max_norm, norm_type):
        import impl

        return norm_value(impl.clip_grad_norm_(model, max_norm, norm_type))

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

    def full_state_roundtrip(self, model, build_model, wrap_paths, ctx, directory: Path) -> None:
        """A full state dict saved by rank 0 and loaded on every rank reproduces the parameters."""
        import impl

        full = impl.full_state_dict(model)
        path = directory / "full_state.pt"
        if ctx.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            torch.save(full, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").replace(path)
        dist.barrier()
        fresh = self.wrap(build_model(), wrap_paths, replace(ctx, features=PLAIN, faults=frozenset()))
        impl.load_full_state_dict(fresh, torch.load(path, weights_only=True))
        reloaded = impl.full_state_dict(fresh)
        bad = [n for n in full if not torch.equal(full[n], reloaded[n])]
        if bad:
            raise RuntimeError(f"rank {ctx.rank}: full state dict saved on rank 0 reloads different values for {bad}")

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
            for slot, names in zip(layout.slots, shard.names):
                for name in names:
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


def _flat_key(shard) -> str:
    """'<unit fqn>/<flat param name>': a RawShard's key, named by every parameter's layout."""
    return f"{shard.unit_fqn or '<root>'}/{shard.param_name}"


def _auto_wrap_policy(features: Features):
    import impl
    from cases.catalog import LAYER_CLASSES

    if features.auto_wrap == "layer_class":
        return impl.ModuleClassPolicy(tuple(LAYER_CLASSES.values()))
    return impl.SizePolicy(features.auto_wrap_min_params)


def planted_faults() -> tuple[str, ...]:
    """The names of the faults impl/ can plant (its seams, impl/_faults.py SEAMS); what each plants
    is in the harness's fault catalog (harness/faults.py)."""
    import impl

    return impl.FAULTS

