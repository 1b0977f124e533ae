"""The adapter interface: how the harness drives an FSDP implementation, and what a rank hands it.

[Note: Adapter protocol]
An adapter is a subclass of `Adapter`. Two things are required:
- `name`: a unique identifier ([A-Za-z0-9_]+); it keys the cells, reports and baselines, so two
  `--impls` of one name are refused before any rank starts;
- `wrap(model, wrap_paths, ctx)`: shard the model (it already holds the reference initial state)
  and return the module to train. `wrap_paths` are the case's sub-modules to make units of, in
  order, before the root; `ctx` is the rank's `RankContext` (rank, world size, process group,
  device, the case's `features`, planted `faults`).
Training one step needs nothing more: the defaults below run it the way a plain PyTorch loop does
(`make_optimizer`, `forward_backward`, `optimizer_step`), and full parameters and gradients come
from the harness (`full_params`, `full_grads`: DTensor `full_tensor()` for FSDP2,
`summon_full_params` for FSDP1, the inner module of DDP, or the plain module). Override a hook
only where the implementation differs:
- `unsupported(features)`: why the adapter cannot run a case's features (the cell is skipped
  with that reason) or None. The default accepts only plain cases and names every feature it
  does not map, so a minimal adapter is never handed a feature it would silently ignore.
- `make_optimizer(model, spec, features)`: for libraries that own the optimizer (ZeRO-1,
  DeepSpeed's engine). A spec with parameter groups (`OptimizerSpec.param_groups`) reaches it only
  when the adapter sets `builds_param_groups` and assigns the groups itself (`spec.build_grouped`
  over the plain model's named parameters, before the engine renames or partitions them);
  otherwise the harness builds that optimizer, each wrapped parameter in the group of the plain
  parameters its `layouts()` say it holds. `forward_backward(...)` and `optimizer_step(...)`: for
  libraries that own the step (an engine's `backward`/`step`); the harness snapshots gradients
  between the two. A batch's inputs reach the model through `cases.data.call_model` (a dict as
  keyword arguments, a tuple as positional ones, a tensor as the one argument), the losses through
  `harness.adapters.features.floating_output`; an adapter's own forward does the same.
- `set_gradient_sync(model, enabled)`, `clip_grad_norm(model, max_norm, norm_type)`,
  `materialize(model, init_state, device)` (meta-device init), `reshard_checkpoint(...)`.
- `layouts(model)` and `raw_shards(model)`: optional evidence of the sharding itself. When an
  adapter gives them they are validated ([Note: Layout validation] in harness/judge/layouts.py):
  every parameter's layout must reproduce its full tensor from the ranks' raw shards, bitwise, and
  no padding interval may cover a parameter's element; a wrong layout is an error naming the
  parameter. A "flat" layout (a parameter at an offset of a padded flat buffer) is checked against
  the raw shards it names, so it needs `raw_shards` (without them the cell is an error saying so);
  "dim0" and "replicated" layouts need none, and raw shards without layouts have their padding
  checked by the intervals they carry. `param_padding` / `grad_padding` declare what the padding
  of raw shards holds: `Padding.ZERO` (checked exactly) or `Padding.UNSPECIFIED` (any value, NaN
  included, never judged). Torch FSDP1, for instance, fills its alignment padding with 42 on purpose.

Ten lines that pass the standard matrix for torch FSDP2 (`--impls my_fsdp2.py:MyFSDP2`):

    from torch.distributed.fsdp import fully_shard
    from harness.adapters import Adapter

    class MyFSDP2(Adapter):
        name = "my_fsdp2"

        def wrap(self, model, wrap_paths, ctx):
            for path in wrap_paths:
                fully_shard(model.get_submodule(path))
            return fully_shard(model)

A library that owns the step (make_optimizer / forward_backward / optimizer_step), sketched:

    from cases.data import call_model
    from harness.adapters import Adapter
    from harness.adapters.features import floating_output

    class Engine(Adapter):
        name = "engine"
        builds_param_groups = True                        # the harness hands it every spec

        def wrap(self, model, wrap_paths, ctx):
            return model                                  # the engine is built with the optimizer

        def make_optimizer(self, model, spec, features):
            optimizer = spec.build_grouped(((n,), p) for n, p in model.named_parameters())
            self.engine = lib.initialize(model, optimizer=optimizer)
            return optimizer                              # a torch optimizer: the LR scheduler's

        def forward_backward(self, model, loss_fn, inputs, targets, num_micro):
            outputs = call_model(self.engine, inputs)     # cases/data.py: dict, tuple or tensor
            loss = loss_fn(floating_output(outputs), targets)
            self.engine.backward(loss)
            return loss.detach()

        def optimizer_step(self, model, optim, features):
            self.engine.step()

Built in (one module each): `ours` (impl/), `fsdp2` (torch fully_shard), `fsdp1`
(FullyShardedDataParallel, a variant per sharding strategy), `deepspeed_zero1/2/3` (optional
extra), `ddp`, `single` (the plain module, no process group: the reference);
harness/adapters/registry.py resolves `--impls` names, and a user's adapter needs no edit here:
`--impls my_pkg.my_mod:MyAdapter` or `--impls path/to/file.py:MyAdapter`.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field, fields
from typing import Callable, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn

from cases.features import PLAIN, Features

NAME_PATTERN = re.compile(r"[A-Za-z0-9_]+")
# Prefixes torch's wrappers insert into parameter names (FSDP1's FlatParameter owner, activation
# checkpointing's wrapper); the harness compares under the plain model's names.
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    group: dist.ProcessGroup | None  # None: no process group (W = 1, impl=single)
    device: torch.device = torch.device("cpu")
    features: Features = PLAIN  # what the case turns on (cases/features.py)
    faults: frozenset[str] = field(default_factory=frozenset)  # planted faults (impl=ours only)


def takes_after_clip(adapter) -> bool:
    """Whether the adapter's optimizer_step takes `after_clip` (the base class's does; an override
    may not, and then gives no clipped gradients)."""
    import inspect

    try:
        return "after_clip" in inspect.signature(adapter.optimizer_step).parameters
    except (TypeError, ValueError):
        return False


def norm_value(norm) -> float | None:
    """A clip norm as a float: a tensor's value (a DTensor's whole value), None as None."""
    if norm is None:
        return None
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm.detach().cpu().item()) if isinstance(norm, torch.Tensor) else float(norm)


class Padding(enum.Enum):
    """What an implementation's raw shards hold in their padding."""

    ZERO = "zero"  # exactly zero, always: the padding check compares every element with 0
    UNSPECIFIED = "unspecified"  # any value (a fill pattern, uninitialised memory): not judged


@dataclass(frozen=True)
class RawShard:
    """One rank's raw shard of one flat parameter, padding included (for the padding check)."""

    key: str  # '<unit fqn>/<flat param name>'
    data: torch.Tensor  # (shard_numel,)
    grad: torch.Tensor | None  # (shard_numel,) or None
    padding_intervals: tuple[tuple[int, int], ...]  # every padding run, shard-local [start, end)


class Adapter:
    """Base class of every implementation under test: [Note: Adapter protocol] above."""

    name: ClassVar[str] = ""
    needs_process_group: ClassVar[bool] = True
    # Wrapping parameters tied across units raises (the `tied_embeddings` case checks the message).
    refuses_cross_unit_ties: ClassVar[bool] = False
    # False: wrapping a 0-d parameter raises (torch FSDP2, DeepSpeed); the fuzzer then draws models
    # without one, rather than drawing models the implementation refuses.
    shards_scalar_params: ClassVar[bool] = True
    # Features.checkpoint_reshard_at: reshard_checkpoint() reloads the model over fewer ranks. The
    # reference (single) leaves it False: a plain model trains on unchanged.
    reshards_checkpoints: ClassVar[bool] = False
    # True: make_optimizer is handed specs with parameter groups too and assigns them itself (an
    # engine built around the optimizer; before it no layout exists). False: the harness builds
    # a grouped optimizer from the wrapped parameters and layouts() ([Note: Adapter protocol]).
    builds_param_groups: ClassVar[bool] = False
    param_padding: ClassVar[Padding] = Padding.ZERO
    grad_padding: ClassVar[Padding] = Padding.ZERO
    # True when the library keeps process-wide state across process groups: its cells then run in
    # fresh processes per world size instead of sharing the run's one launch ([Note: One launch,
    # every world size] in harness/run/orchestrate.py).
    process_per_world: ClassVar[bool] = False
    # The contracts of harness/judge/contracts.py this implementation keeps: the cells where their
    # feature is on are held to them ([Note: Contracts]). None by default: an adapter whose
    # collectives the seam cannot see, or that reduces on a schedule of its own, declares none.
    contracts: ClassVar[frozenset[str]] = frozenset()
    # True: runs on simulated ranks (`--backend simulated`, harness/run/simulated.py), whose process
    # groups implement torch.distributed's Python collectives only. An implementation that reaches
    # a group from C++ (DDP's reducer, DTensor's functional collectives: torch FSDP2, FSDP1, DeepSpeed)
    # needs real ranks.
    simulated_ranks: ClassVar[bool] = False

    # -- required ---------------------------------------------------------------------------------

    def wrap(self, model: nn.Module, wrap_paths: tuple[str, ...], ctx: RankContext) -> nn.Module:
        raise NotImplementedError(f"adapter {type(self).__name__} must implement wrap(model, wrap_paths, ctx)")

    # -- what it can run ----------------------------------------------------------------------------

    def unsupported(self, features: Features) -> str | None:
        """None when this adapter maps every feature of a case, else why not (the cell is skipped)."""
        unmapped = feature_fields(features)
        if not unmapped:
            return None
        return (f"adapter {self.name!r} maps none of the case's features ({', '.join(unmapped)}); "
                f"override Adapter.unsupported to accept the ones wrap() handles")

    # -- training one step ----------------------------------------------------------------------------

    def make_optimizer(self, model: nn.Module, spec, features: Features) -> torch.optim.Optimizer:
        return spec.build(model.parameters())

    def local_optimizer_state_elements(self, optim) -> int:
        """The elements of the elementwise optimizer state this rank holds (the `sharded_state`
        contract, [Note: Contracts]): every tensor of `optim.state` but 0-d ones (step counts), a
        DTensor by its local part."""
        from torch.distributed.tensor import DTensor

        return sum((t.to_local() if isinstance(t, DTensor) else t).numel()
                   for st in optim.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0)

    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        """Gradient accumulation: called before every micro-batch, enabled on the last only."""
        model.set_requires_gradient_sync(enabled)  # ours and FSDP2

    def forward_backward(self, model: nn.Module, loss_fn, inputs: torch.Tensor, targets: torch.Tensor,
                         num_micro: int) -> torch.Tensor:
        """One step's forward and backward over `num_micro` micro-batches; returns the local loss."""
        from harness.adapters.local_step import forward_backward

        before = (lambda i: self.set_gradient_sync(model, i == num_micro - 1)) if num_micro > 1 else None
        return forward_backward(model, loss_fn, inputs, targets, num_micro, before_micro=before)

    def clip_grad_norm(self, model: nn.Module, max_norm: float, norm_type: float) -> float | None:
        """Clip the gradients by their global norm; return the norm the implementation computed
        (before clipping; None: not known). The judge checks it against the exact gradients' norm
        and replays the step with the coefficient it implies ([Note: Clipping judged with the
        cell's norm] in harness/judge/diff.py)."""
        return norm_value(torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm, norm_type))

    def optimizer_step(self, model: nn.Module, optim: torch.optim.Optimizer, features: Features,
                       after_clip: Callable[[], None] | None = None) -> float | None:
        """Clip (when the case clips) and step; returns `clip_grad_norm`'s norm, or None.
        `after_clip()`, when given, runs between the clipping and the step (the harness takes the
        clipped gradients there; an override without the argument gives no such evidence)."""
        norm = None
        if features.clip_norm_type is not None:
            norm = self.clip_grad_norm(model, features.clip_max_norm, features.clip_norm_type)
            if after_clip is not None:
                after_clip()
        optim.step()
        return norm

    def zero_grad(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        optim.zero_grad(set_to_none=True)

    def materialize(self, model: nn.Module, init_state: dict[str, torch.Tensor], device: torch.device) -> None:
        """Meta-device init (Features.meta_init): give the wrapped model the reference state."""
        raise NotImplementedError(f"adapter {self.name!r} has no materialize(); it cannot run meta_init cases")

    def reshard_checkpoint(self, model, optim, spec, ctx, features, directory, shard_size, wrap_paths, build_model):
        """With `reshards_checkpoints`: save sharded, reload over `shard_size` ranks; (model, optim)."""
        raise NotImplementedError(f"adapter {self.name!r} has no reshard_checkpoint()")

    def full_state_roundtrip(self, model, build_model, wrap_paths, ctx, directory) -> None:
        """With `reshards_checkpoints`, after the last step: a full state dict reloads bitwise."""
        raise NotImplementedError(f"adapter {self.name!r} has no full_state_roundtrip()")

    # -- evidence -----------------------------------------------------------------------------------

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full parameters under the plain model's names (a collective: every rank calls it)."""
        return full_tensors(model, grads=False)

    def full_grads(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full averaged gradients under the plain model's names (after backward; a collective)."""
        return full_tensors(model, grads=True)

    def full_buffers(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """This rank's module buffers (BatchNorm running statistics, RoPE tables, masks) under the
        plain model's names, persistent or not. Implementations keep buffers whole on every rank;
        a DTensor buffer is gathered (a collective: every rank calls this)."""
        return module_buffers(model)

    def layouts(self, model: nn.Module) -> dict[str, dict]:
        """Per parameter name, how its elements map to ranks (harness/run/snapshot.py, 'layouts');
        {} when the adapter gives none (owning ranks are then not named)."""
        return {}

    def raw_shards(self, model: nn.Module) -> list[RawShard]:
        """This rank's raw padded shards (no collective); [] when the impl exposes none."""
        return []

    # -- before any rank starts -------------------------------------------------------------------

    def shared_tensors(self, model: nn.Module, wrap_paths: tuple[str, ...],
                       features: Features) -> list[tuple[str, tuple[str, ...]]]:
        """(unit, the plain model's parameter names) of every tensor the optimizer will hold that
        carries several parameters (a flat parameter), computed in the parent on a plain `model`
        of its own with no process group; [] when every parameter stays a tensor of its own. Such
        a tensor has one learning rate and weight decay, so the plan refuses parameter groups
        that split it (harness/run/plan.py) before any rank starts."""
        return []


def feature_fields(features: Features) -> list[str]:
    """'name=value' of every feature that differs from a plain case (refused_wrap aside: it
    asks nothing of a wrap that ties nothing across units)."""
    return [f"{f.name}={getattr(features, f.name)!r}" for f in fields(Features)
            if f.name != "refused_wrap" and getattr(features, f.name) != getattr(PLAIN, f.name)]


def plain_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def full_tensors(model: nn.Module, grads: bool) -> dict[str, torch.Tensor]:
    """Full parameters (or gradients) of a wrapped model, under the plain model's names: DTensors
    through full_tensor(), FSDP1 inside summon_full_params, DDP's inner module, a plain module as is."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        model = model.module
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        with FullyShardedDataParallel.summon_full_params(model, writeback=False, with_grads=grads):
            return _named_full(model, grads)
    return _named_full(model, grads)


def module_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer of a (wrapped) model under the plain model's names, copied to the CPU; DDP's
    inner module; DTensors through full_tensor()."""
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        model = model.module
    out = {}
    for name, b in model.named_buffers():
        if isinstance(b, DTensor):
            b = b.full_tensor()
        out[plain_name(name)] = b.detach().to("cpu", copy=True)
    return out


def _named_full(model: nn.Module, grads: bool) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor | None] = {}
    batches: dict[tuple, list[tuple[str, DTensor]]] = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        if t is None:
            continue
        key = _dim0_batch_key(t) if isinstance(t, DTensor) else None
        if key is not None:
            out[plain_name(name)] = None  # filled below, in the model's order
            batches.setdefault(key, []).append((plain_name(name), t))
            continue
        if isinstance(t, DTensor):
            t = t.full_tensor()
        out[plain_name(name)] = t.detach().clone()
    for batch in batches.values():
        out.update(_gather_dim0(batch))
    return out


def _dim0_batch_key(t) -> tuple | None:
    """DTensors sharded on dim 0 over one mesh dimension (and replicated over the others: FSDP2,
    HSDP) are gathered together, one all-gather per (mesh, placements, dtype) instead of one per
    tensor; anything else (0-d, strided or other-dim shards, partial) goes through full_tensor()."""
    from torch.distributed.tensor import Replicate, Shard

    shard_dims = [i for i, pl in enumerate(t.placements) if type(pl) is Shard and pl.dim == 0]
    others_replicated = all(type(pl) is Replicate for i, pl in enumerate(t.placements) if i not in shard_dims)
    if t.ndim == 0 or len(shard_dims) != 1 or not others_replicated:
        return None
    return (id(t.device_mesh), tuple(t.placements), t.dtype, t.device)


def _gather_dim0(batch: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """[Note: Batched evidence gathers] The full tensors of dim-0-sharded DTensors of one mesh from
    one all-gather: each rank's local rows, padded to the chunk size ceil(rows / W) of torch.chunk
    (DTensor's and FSDP2's split), are concatenated; the gathered buffer holds rank r's block at
    r * L, and each tensor is its ranks' real rows in rank order. A copy of every element, no
    arithmetic: bitwise full_tensor() (tests/harness/adapters/test_adapters_gather.py), at one collective per step and kind."""
    from torch.distributed.tensor import Shard

    mesh = batch[0][1].device_mesh
    mesh_dim = next(i for i, pl in enumerate(batch[0][1].placements) if type(pl) is Shard)
    world = mesh.size(mesh_dim)
    pieces, spans = [], []
    for name, t in batch:
        rows, row_numel = t.shape[0], math.prod(t.shape[1:])
        chunk = -(-rows // world)
        local = t.to_local().detach().reshape(-1)
        padded = local.new_zeros(chunk * row_numel)
        padded[:local.numel()] = local
        pieces.append(padded)
        spans.append((name, t.shape, rows, chunk, row_numel))
    send = torch.cat(pieces)
    gathered = send.new_empty(world * send.numel())
    dist.all_gather_into_tensor(gathered, send, group=mesh.get_group(mesh_dim))
    blocks = gathered.view(world, send.numel())
    out, offset = {}, 0
    for name, shape, rows, chunk, row_numel in spans:
        parts = [blocks[r, offset:offset + max(0, min(chunk, rows - r * chunk)) * row_numel] for r in range(world)]
        out[name] = torch.cat(parts).view(shape).clone()
        offset += chunk * row_numel
    return out


def set_prefetch(model: nn.Module, wrap_paths: tuple[str, ...]) -> None:
    """Each wrapped unit prefetches the next one in forward and the previous one in backward."""
    units = [model.get_submodule(p) for p in wrap_paths]
    for prev, nxt in zip(units, units[1:]):
        prev.set_modules_to_forward_prefetch([nxt])
        nxt.set_modules_to_backward_prefetch([prev])
