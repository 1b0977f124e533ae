"""One flat parameter's sharded/unsharded lifecycle: all-gather, views, reduce-scatter.

The sharded flat parameter (1-D, `shard_numel` elements, padding included) is this rank's shard
of the padded flat buffer; the module registers, and the optimizer updates, one slice of it per
original parameter ([Note: Per-parameter shards]). The unsharded buffer is a separate tensor whose
storage exists only between unshard() and reshard(); the original parameters are views into it
(see [Note: Views into the unsharded buffer]).

[Note: Per-parameter shards]
The optimizer must see each original parameter as a tensor of its own: torch's optimizers skip a
parameter whose .grad is None (no weight decay, no moment update, and AdamW's step count, which
sets its bias correction, stays behind), and a parameter no loss term reached this step has no
gradient in the plain model. One flat tensor per unit would be stepped whole, moving every
parameter of the unit with it. So each original parameter's elements in this rank's shard (its
"piece", `local_slot_bounds`) are an nn.Parameter viewing the shard's storage, registered under
the parameter's own name on each of its owners: `model.named_parameters()` are the plain model's
names, each a 1-D local piece (empty on a rank that holds none of it), and every optimizer state
is per parameter. The padding belongs to no piece, so no optimizer ever writes it. A piece's
gradient is the same slice of the reduced shard gradient, or None when the parameter had no
gradient on any rank ([Note: Gradients with their used flags]). At W = 1 without a cast the
pieces are the whole parameters and the forward views them directly: autograd accumulates into
each piece as into the plain model's parameter. Whatever replaces the pieces' storage (to_empty(),
.to()) is undone at the next forward: the shard is rebuilt from the pieces and they view it again.

[Note: Gradients with their used flags]
Whether a parameter has a gradient must be decided alike on every rank: with split data an
expert no token of rank 0's batch chose may get tokens on rank 1, and then the plain model over
the global batch gives it a gradient. Each rank therefore sends, with its shard of the
reduce-scatter input, one flag per slot (1 where any view of the slot got a gradient from
autograd on this rank, in any micro-batch since the last reduction), and the sum comes back with
its gradient shard: a slot is used when any rank's flag is set (HSDP adds the replicas' flags in
the same all-reduce as their gradients). No collective is added, and every rank reduces every
unit whose views were handed out with gradients enabled, zeros where none came, so that the
collectives stay in step. When the reduction comes is [Note: Rank-consistent reductions] in
impl/_unit.py.

[Note: Views into the unsharded buffer]
Each forward hands every owner of every parameter its own view of the unsharded buffer, made an
autograd leaf (the buffer itself takes no part in autograd). A view's gradient is taken from
autograd as soon as it is accumulated (a post-accumulate-grad hook): the first one of a slot is
kept as it is (autograd's own tensor, no copy), later ones (a tied parameter's other uses) are
added into it and dropped at once, so a tied embedding and output head (two owners, two views)
never hold two gradients nor a third tensor for their sum. When every view handed out has
reported, the unit reshards; once the unit's backward is over on every rank ([Note:
Rank-consistent reductions] in impl/_unit.py), the slot gradients are packed into one padded
gradient (each freed once copied) and reduce-scattered; views that get no gradient (unused
parameters) contribute zeros and an unset flag ([Note: Gradients with their used flags]).
Nothing padded is allocated before the unit's last gradient: a root whose tied head gets its
gradient at the start of backward holds that gradient alone, not a padded buffer beside it,
until its embedding's gradient arrives at the end.

[Note: Overlapped gradient reduction]
A unit's reduce-scatter starts once its backward is over, at the first point every rank agrees
on (the pre-backward of a unit whose forward ended before this one's began, or the end of
backward: [Note: Rank-consistent reductions] in impl/_unit.py), and is waited on when the next
unit starts its own, or at the end of backward (the root's callback): the backend communicates
while autograd computes the next unit's backward. At most one is in flight (shared through the
root's GradReducer), so besides the unsharded gradient being accumulated a rank holds at most
one more waiting for the network. The collective and its input are those of a blocking
reduce-scatter, so the result is bitwise the same; averaging, padding and the add into .grad
follow the wait.

[Note: Releasing unsharded parameters]
A unit's unsharded parameters are needed in backward only by ops that saved them in forward.
Autograd saves a parameter either as itself (LayerNorm's weight: one more reference to the view)
or as another tensor on the buffer's storage (a Linear's transposed weight; the detached copies
activation checkpointing keeps after recomputing: one more reference to the storage). Right
after the views are handed out both counts are recorded; at each view's gradient hook (a point
where no backward op of this unit is mid-flight) counts back at that level, plus the one
reference each view's AccumulateGrad node holds while the graph lives, mean no op left needs the
parameters, and the unit reshards before all its gradients are in. A root that owns a tied
embedding and output head thus frees its parameters after the head's and the final norm's
backward (an embedding's backward needs only indices) instead of holding them through every
block's backward. Each iteration gathers into a fresh buffer, so views of earlier iterations
that an old graph still holds never count; anything else holding a view (a user's reference)
only keeps the parameters longer.

Whether a rank releases is its own answer, and ranks may differ: a reference one rank holds, or
a collective's bookkeeping that lets go of the buffer later on one rank than on another. Nothing
that communicates may depend on it. Whether the question was asked (`release_checked`) depends
only on the graph, and that is what a recomputation below goes by.

Activation checkpointing inside a unit recomputes in backward, and the tensors it saves are
invisible until recomputed: every sub-module owning the unit's parameters gets a forward
pre-hook that, inside backward, marks the unit as recomputing (no early release for the rest of
this backward) and re-gathers once a release was possible, on every rank, released or not (a
rank that kept its parameters gathers the same values into the same storage). A unit whose
module owns parameters itself (its own forward, which a checkpoint may recompute without hooks,
reads them) never releases early. A parameter read outside its owner's forward inside a checkpointed region
of the same unit, recomputed after a release, would find the storage empty and raise.

When a unit reshards after forward, the buffer's storage is resized to zero; the pre-backward hook
resizes it back and all-gathers into the same storage, so tensors that autograd saved in forward
(views of that storage) see the re-gathered values. Writes go through `.data`, an alias with its
own version counter, so autograd does not mistake the re-gather for an in-place change of a saved
tensor.

At W = 1 with no dtype cast and no replication, the buffer *is* the sharded parameter and the
views are one `torch.split` of it: no copy, no collective, and gradients accumulate into it
(through SplitBackward) exactly as into the plain model's parameters.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from impl._faults import Seams
from impl._collectives import CommStats, all_gather_into, all_reduce_sum, reduce_scatter_sum
from impl._flat_param import FlatLayout, flatten_padded, unflatten_views, zero_padding_


# [Note: Resharding to a smaller group]
# reshard_after_forward=N (FSDP2's int, N a divisor of the shard group's size S, 1 < N < S): after
# forward a rank keeps the k-th of N equal chunks of the unsharded padded buffer (k = its shard rank
# mod N), in the compute dtype, and frees the rest; backward all-gathers the chunks back within its
# group of N consecutive ranks of the shard group (the rows of the mesh's ranks viewed as (-1, N),
# as FSDP2 builds its post-forward mesh: on GPUs, the ranks of one node). The N ranks of a group
# hold the N distinct chunks, so the gathered buffer is the forward's, bit for bit; memory after
# forward is 1/N of the unit instead of 1/S (True) or all of it (False). A chunk serves one backward:
# reshard(), reset_iter_state() and the root's next forward drop it (the optimizer steps the shard).


class HandleState(Enum):
    SHARDED = auto()
    UNSHARDED = auto()


@dataclass(frozen=True)
class ShardGroups:
    """Whom a flat parameter is sharded over and replicated across (HSDP), and where this rank is."""

    shard_group: dist.ProcessGroup | None  # None: W_shard = 1
    replicate_group: dist.ProcessGroup | None  # None: no replication (HSDP / NO_SHARD only)
    shard_rank: int
    shard_world_size: int
    replicate_world_size: int
    # reshard_after_forward=N (FSDP2's int): after forward a rank keeps one N-th of the unsharded
    # flat parameter, and backward all-gathers it back within this group of N consecutive ranks of
    # the shard group ([Note: Resharding to a smaller group]). None: the whole shard group.
    post_forward_group: dist.ProcessGroup | None = None
    post_forward_size: int = 0

    @property
    def data_parallel_size(self) -> int:
        return self.shard_world_size * self.replicate_world_size


@dataclass(frozen=True)
class Precision:
    """The dtypes a flat parameter computes and reduces in (None: its own)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class CommConfig:
    """How one flat parameter communicates, by concern. Built by fully_shard, shared by a unit's
    handles."""

    groups: ShardGroups
    precision: Precision = Precision()
    compute_device: torch.device | None = None  # set by CPU offload: shards live on the CPU
    stats: CommStats | None = None  # collective counts and bytes, when the caller asked for them
    seams: Seams = field(default_factory=Seams)  # planted faults' hook objects (impl/_faults.py)


class FlatParamHandle:
    def __init__(
        self,
        module: nn.Module,
        param_name: str,
        layout: FlatLayout,
        slot_owners: list[list[tuple[nn.Module, str]]],
        comm: CommConfig,
        requires_grad: bool,
        sharded: torch.Tensor,
        slot_members: list[tuple[int, ...]] | None = None,
    ) -> None:
        self.module = module
        # Per slot, the unit member each of its names is relative to ([Note: Module groups] in
        # impl/_unit.py): all 0 for a unit of one module.
        self.slot_members = slot_members or [(0,) * len(s.fqns) for s in layout.slots]
        self.param_name = param_name  # the flat parameter's name (raw shards, checkpoints); not registered
        self.layout = layout
        self.slot_owners = slot_owners
        self.comm = comm
        self.requires_grad = requires_grad
        self.state = HandleState.SHARDED
        self._leaf: torch.Tensor | None = None  # the unsharded buffer (padded_numel,)
        self._views: list[torch.Tensor] = []  # one per (owner, slot), in _owner_slots order
        self._views_track = False  # whether the views are gradient-tracking leaves
        # Released before all gradients are in only when every owner is a sub-module, whose
        # forward hook re-gathers for a recomputation ([Note: Releasing unsharded parameters]).
        self.release_early = all(sub is not module for owners in slot_owners for sub, _ in owners)
        self.recomputing = False  # a recomputation ran in this backward: no early release
        self.release_checked = False  # this backward asked whether to release (every rank alike)
        self._idle_refs: tuple[int, list[int]] | None = None  # reference counts with nothing saved
        self._refs_before_gather: int | None = None  # the fresh buffer's storage, before its gather
        self._owner_slots = [(module, attr, i) for i, owners in enumerate(slot_owners) for module, attr in owners]
        self._slot_grads: list[torch.Tensor | None] = []  # unsharded gradient per slot, until reduced
        self._num_views_pending = 0  # gradient-tracking views handed out since the last reduce
        # The views whose gradient arrived, by identity: a view gets one per backward it takes part
        # in, and a forward followed by several backwards through parts of it (a chunked loss
        # calling the head alone) must not count one view twice and free what another still needs.
        self._views_done: set[int] = set()
        self._pending: tuple | None = None  # (work, input) of an all-gather in flight
        # [Note: Resharding to a smaller group]: this rank's N-th of the unsharded buffer, from
        # the post-forward reshard until backward gathers it back.
        self._post_forward: torch.Tensor | None = None
        self.use_post_forward_group = True  # False once set_reshard_after_forward(bool) replaced the int
        self.reducer = GradReducer()  # the root's, shared by every unit under it, after its first forward
        self.sync_grads = True  # False: keep accumulating the unsharded gradient (no_sync)
        # False: the unsharded parameters outlive backward, so the next forward gathers nothing
        # (FSDPModule.set_reshard_after_backward: accumulation, no optimizer step in between).
        self.reshard_after_backward = True
        self.divide_factor: float | None = None  # the reduced sum's divisor, if not the data-parallel size
        # FSDPModule.set_all_reduce_hook: (hook, stream) called on the averaged shard gradient.
        self.all_reduce_hook: tuple[Callable[[torch.Tensor], None], Any] | None = None
        # HSDP: False keeps each reduce-scattered sum here, unaveraged, until a reduction with True
        # all-reduces them all at once (FSDPModule.set_requires_all_reduce).
        self.requires_all_reduce = True
        self.partial_reduced: torch.Tensor | None = None
        # Gradient-tracking views were handed out, or gradients came, since the last reduction: the
        # unit reduces at its next rank-consistent point ([Note: Rank-consistent reductions]).
        self.reduce_due = False
        # [Note: Per-parameter shards]: this rank's shard (shard_numel,) and, per slot, the piece of
        # it the optimizer steps, registered under the parameter's names by fully_shard.
        self._sharded = sharded
        self.local_bounds = layout.local_slot_bounds(comm.groups.shard_rank)
        self.pieces = [nn.Parameter(sharded[a:b], requires_grad=requires_grad) for a, b in self.local_bounds]
        self._sharded_grad: torch.Tensor | None = None  # the shard gradient the pieces' gradients slice

    # -- layout -------------------------------------------------------------------------------
    @property
    def sharded(self) -> torch.Tensor:
        """This rank's padded shard (shard_numel,); the pieces view it ([Note: Per-parameter shards])."""
        return self._sharded

    def bind_pieces(self) -> None:
        """Make every piece a view of the shard again where something replaced them or their
        storage (to_empty() off the meta device registers new Parameter objects, one per owner even
        for a tied parameter; .to() gives each its own storage): the pieces are read back from
        their first owners and registered on every owner, and the shard is rebuilt on their device
        and dtype from their values, padding zero. A no-op while they view it."""
        pieces = [owners[0][0]._parameters[owners[0][1]] for owners in self.slot_owners]
        flat = self._sharded
        if all(p is q for p, q in zip(pieces, self.pieces)) and all(
                _is_slice(p.data, flat, a) for p, (a, _) in zip(pieces, self.local_bounds)):
            return
        ref = pieces[0].data
        flat = torch.zeros(self.layout.shard_numel, dtype=ref.dtype, device=ref.device)
        with torch.no_grad():
            for piece, owners, (a, b) in zip(pieces, self.slot_owners, self.local_bounds):
                if not ref.is_meta:
                    flat[a:b].copy_(piece.data)
                piece.data = flat[a:b]
                for module, attr in owners:
                    module._parameters[attr] = piece
        self._sharded, self.pieces = flat, pieces

    @property
    def sharded_grad(self) -> torch.Tensor | None:
        """This rank's padded shard gradient (shard_numel,), whose slices are the pieces' gradients
        (zeros where a piece has none, and in the padding); None when no piece has one. Gradients set
        elsewhere (autograd's own at W = 1 without a cast, a user's) are copied into one buffer
        first and the pieces pointed at it, so its slices and theirs stay the same tensors."""
        grads = [p.grad for p in self.pieces]
        if all(g is None for g in grads):
            return None
        flat = self._sharded_grad
        if flat is not None and all(g is None or _is_slice(g, flat, a) for g, (a, _) in zip(grads, self.local_bounds)):
            return flat
        ref = next(g for g in grads if g is not None)
        flat = torch.zeros(self.layout.shard_numel, dtype=ref.dtype, device=ref.device)
        for p, g, (a, b) in zip(self.pieces, grads, self.local_bounds):
            if g is not None:
                flat[a:b].copy_(g)
                p.grad = flat[a:b]
        self._sharded_grad = flat
        return flat

    def slot_names(self, prefixes: list[str | None]) -> list[list[str]]:
        """Per slot, its names in a model whose unit members have these name prefixes
        (`units_with_prefixes` in impl/_unit.py; a member outside the model names nothing)."""
        return [[prefixes[j] + fqn for fqn, j in zip(slot.fqns, members) if prefixes[j] is not None]
                for slot, members in zip(self.layout.slots, self.slot_members)]

    @property
    def fqns(self) -> list[str]:
        return [s.fqn for s in self.layout.slots]

    @property
    def _aliased(self) -> bool:
        c = self.comm
        return (
            c.groups.shard_world_size == 1
            and c.groups.replicate_group is None
            and c.compute_device in (None, self.sharded.device)
            and c.precision.param_dtype in (None, self.sharded.dtype)
            and c.precision.reduce_dtype in (None, self.sharded.dtype)
        )

    @property
    def unsharded_buffer(self) -> torch.Tensor | None:
        """The padded unsharded buffer of this iteration (its storage is empty while sharded);
        None at W = 1 without a cast, where the sharded parameter itself is computed with."""
        return None if self._aliased else self._leaf

    @property
    def gather_started(self) -> bool:
        """Unsharded, or its all-gather in flight (a prefetch)."""
        return self._pending is not None or self.state == HandleState.UNSHARDED

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.comm.precision.param_dtype or self.sharded.dtype

    def assert_state(self, *allowed: HandleState) -> None:
        assert self.state in allowed, f"{self.fqns}: state {self.state} not in {allowed}"

    def init_sharded_from(self, full_tensors: list[torch.Tensor]) -> torch.Tensor:
        """The local shard (a fresh tensor, padding zero) of the given full parameters."""
        return self.shard_of_padded(flatten_padded(full_tensors, self.layout))

    def shard_of_padded(self, padded: torch.Tensor, fresh: bool = True) -> torch.Tensor:
        """This rank's shard of a padded unsharded buffer whose padding is zero: a fresh tensor,
        or (fresh=False, for a caller that copies it at once) a view when nothing alters it."""
        seams = self.comm.seams
        (start, end), padded = seams.shard_bounds((self.layout.shard_bounds(self.comm.groups.shard_rank), padded))
        if not fresh and not seams.planted:
            return padded[start:end]
        local = padded[start:end].clone()
        fill = seams.init_padding_value(0.0)
        if fill != 0.0:
            for pad_start, pad_end in self.layout.local_padding_intervals(self.comm.groups.shard_rank):
                local[pad_start:pad_end] = fill
        return local

    def check_materialized(self, unit_name: str, is_root: bool = True) -> None:
        """Raise if the unit's parameters are still on the meta device (named from the root, in
        which a non-root unit's name is its path)."""
        self.bind_pieces()
        if self.sharded.is_meta:
            prefix = "" if is_root else f"{unit_name}."
            raise RuntimeError(
                f"FSDP parameters should be materialized from meta device before training, but the "
                f"following were still on meta device: {[prefix + fqn for fqn in self.fqns]} (unit "
                f"'{unit_name}', rank {dist.get_rank() if dist.is_initialized() else 0}). Fix: call "
                f"impl.init_meta_module(model, device) (to_empty() plus each module's reset_parameters()) "
                f"or load a state dict before the first forward."
            )

    # -- unshard / reshard ----------------------------------------------------------------------
    def _ensure_leaf(self) -> torch.Tensor:
        sharded = self.sharded
        if self._aliased:
            return sharded
        leaf = self._leaf
        device = self.comm.compute_device or sharded.device
        if leaf is None or leaf.device != device or leaf.dtype != self.compute_dtype:
            leaf = torch.empty(self.layout.padded_numel, dtype=self.compute_dtype, device=device)
            self._leaf = leaf
        return leaf

    def unshard(self, async_op: bool = False) -> None:
        """All-gather the padded flat parameter into the unsharded leaf (no-op if unsharded).

        async_op=True starts the all-gather and returns (a prefetch); the next unshard() waits.
        """
        if self.state == HandleState.UNSHARDED:
            return
        if self._pending is not None:
            if not async_op:
                self._finish_unshard()
            return
        fresh = not self._views and not self._aliased
        if fresh:
            # A fresh buffer per iteration: views an old graph still holds keep the old (empty)
            # storage, so this storage's reference count sees only this iteration's tensors.
            self._leaf = None
        leaf = self._ensure_leaf()
        work, sharded = None, None
        if leaf is not self.sharded:
            storage = leaf.untyped_storage()
            nbytes = leaf.numel() * leaf.element_size()
            if storage.size() != nbytes:
                storage.resize_(nbytes)
            del storage
            self._refs_before_gather = _storage_refs(leaf) if fresh else None
            group = self.comm.groups.shard_group
            if self._post_forward is not None:  # [Note: Resharding to a smaller group]
                sharded, self._post_forward = self._post_forward, None
                group = self.comm.groups.post_forward_group
            else:
                sharded = self.sharded.detach()
                if sharded.dtype != leaf.dtype or sharded.device != leaf.device:
                    sharded = self.comm.seams.cast_for_gather(sharded.to(device=leaf.device, dtype=leaf.dtype),
                                                              self.sharded)
            work = all_gather_into(leaf.data, sharded, group, self.comm.stats, async_op)
        self._pending = (work, sharded)  # keeps the input alive until the gather completes
        if not (async_op and work is not None):
            self._finish_unshard()

    def _finish_unshard(self) -> None:
        work, _ = self._pending
        if work is not None:
            work.wait()
        self._pending = None
        if self.comm.groups.shard_world_size > 1:
            self.comm.seams.gathered(self._leaf.data, self.comm.groups.shard_world_size)
        self.state = HandleState.UNSHARDED

    def use_views(self) -> None:
        """Point every original parameter name at a view of the unsharded buffer."""
        self.assert_state(HandleState.UNSHARDED)
        if self._aliased:
            # The pieces are the whole parameters: autograd accumulates into them directly.
            views = [piece.view(slot.size) for piece, slot in zip(self.pieces, self.layout.slots)]
            for view, owners in zip(views, self.slot_owners):
                for module, attr in owners:
                    module.__dict__[attr] = view
            return
        track = self.requires_grad and torch.is_grad_enabled()
        # Reused until their gradients are in (a second call of the unit, a recompute); made
        # afresh after backward, or when grad mode changed since (an eval forward in between).
        fresh = not self._views or self._views_track != track
        if fresh:
            self._views, self._views_track = self._make_views(track), track
        for (module, attr, _), view in zip(self._owner_slots, self._views):
            module.__dict__[attr] = view
        if fresh:
            # Counted, not measured, for the storage: a collective's bookkeeping may still hold
            # the gathered tensor for a while. Right before the gather, plus the views and the
            # one alias they were cut from, is the count with nothing saved.
            before_gather, self._refs_before_gather = self._refs_before_gather, None
            self._idle_refs = None if before_gather is None else (
                before_gather + len(self._views) + 1, [v._use_count() for v in self._views])

    def _make_views(self, track: bool) -> list[torch.Tensor]:
        """One view per (owner, slot), a gradient-tracking leaf when gradients will flow."""
        buffer = self._ensure_leaf().data
        views = []
        for _, _, slot_index in self._owner_slots:
            slot = self.layout.slots[slot_index]
            view = buffer[slot.offset : slot.end].view(slot.size)
            if track:
                view.requires_grad_(True)
                view.register_post_accumulate_grad_hook(functools.partial(self._view_grad_ready, slot_index))
            views.append(view)
        self._num_views_pending += len(views) if track else 0
        self.reduce_due |= track
        return views

    def _params_still_saved(self) -> bool:
        """Whether a saved tensor of a pending backward op still holds the unsharded parameters
        ([Note: Releasing unsharded parameters])."""
        if self._idle_refs is None:
            return True  # views not made right after a fresh gather: nothing to compare with
        idle_storage_refs, idle_view_refs = self._idle_refs
        if _storage_refs(self._leaf) > idle_storage_refs:
            return True  # a saved tensor derived from a view (a transpose, a recomputed copy)
        # +1 per view for its AccumulateGrad node while the graph lives; more is a saved view.
        return any(v._use_count() > idle + 1 for v, idle in zip(self._views, idle_view_refs))

    def graph_holds_views(self) -> bool:
        """Whether views handed out for gradients are still saved by a graph no backward has run
        ([Note: Backwards through part of the model] in impl/_unit.py): known only where the views
        were made right after a fresh gather (else False: the unit is finished as before)."""
        if not (self._views and self._views_track) or self._aliased or self._idle_refs is None:
            return False
        return self._params_still_saved()

    def reshard(self, *, for_backward_regather: bool = False) -> None:
        """Free the unsharded storage; views keep their (now empty) storage until re-gathered."""
        if self._pending is not None:
            self._finish_unshard()
        if self.state == HandleState.SHARDED:
            if not for_backward_regather:
                self.drop_post_forward()  # a reshard() between forward and backward: the whole group gathers
            return
        leaf = self._leaf
        if leaf is not None and not self._aliased:
            if for_backward_regather and not self.comm.seams.regathers_for_backward(True):
                leaf.data.zero_()
                return  # stays "unsharded": backward will use the zeroed buffer
            groups = self.comm.groups
            if for_backward_regather and groups.post_forward_group is not None and self.use_post_forward_group:
                # [Note: Resharding to a smaller group]: keep this rank's N-th for backward.
                size = self.layout.padded_numel // groups.post_forward_size
                k = groups.shard_rank % groups.post_forward_size
                self._post_forward = leaf.data[k * size:(k + 1) * size].clone()
            leaf.untyped_storage().resize_(0)
        self.state = HandleState.SHARDED

    # -- gradients -----------------------------------------------------------------------------
    def _view_grad_ready(self, slot_index: int, view: torch.Tensor) -> None:
        """Keep one view's gradient as its slot's, or add it into the slot's, and drop it."""
        grad, view.grad = view.grad, None  # autograd holds no other reference to it
        if not self._slot_grads:
            self._slot_grads = [None] * len(self.layout.slots)
        kept = self._slot_grads[slot_index]
        if kept is None:
            self._slot_grads[slot_index] = grad
        else:
            kept.add_(grad)
        del grad, kept  # freed before the reduce-scatter allocates
        self.reduce_due = True
        self._views_done.add(id(view))
        if len(self._views_done) == self._num_views_pending:
            self.finish_backward()
            if self.comm.seams.reduce_at_last_gradient(False):
                self.reduce_gradients()
        elif self.release_early and not self.recomputing:
            # Every rank gets here alike; whether it releases is its own count's answer.
            self.release_checked = True
            if self.state == HandleState.UNSHARDED and self.reshard_after_backward and not self._params_still_saved():
                self.reshard()  # no backward op left needs the unsharded parameters

    def finish_backward(self) -> None:
        """Reshard and forget the views handed out: called when every view has its gradient (no
        backward op needs the unsharded parameters any more, so they are freed before the
        reduce-scatter allocates: [Note: Overlapped gradient reduction]) and, for views some of
        which got no gradient on this rank, when the unit's reduction is due. Idempotent."""
        self._views = []  # the next forward hands out fresh leaves
        self._num_views_pending = 0
        self._views_done = set()
        self.recomputing = self.release_checked = False
        if self.reshard_after_backward:
            self.reshard()

    def drop_post_forward(self) -> None:
        """Forget the post-forward N-th ([Note: Resharding to a smaller group]): the next gather is
        the whole shard group's, from the shard the optimizer steps."""
        self._post_forward = None

    def reset_iteration(self) -> None:
        """Forget an iteration an exception cut short (FSDPModule.reset_iter_state): finish an
        all-gather in flight, drop the gradients not yet reduced and the views handed out, reshard."""
        if self._pending is not None:
            self._finish_unshard()
        self.drop_post_forward()
        self._slot_grads = []
        self._views = []
        self._num_views_pending = 0
        self._views_done = set()
        self.recomputing = self.release_checked = False
        self.reduce_due = False
        self.partial_reduced = None
        self.reshard()

    def reduce_gradients(self) -> None:
        """Finish this backward and, when syncing, start reducing the slot gradients and their used
        flags; a no-op unless views were handed out with gradients enabled or gradients came since
        the last reduction. The caller picks the moment: [Note: Rank-consistent reductions]."""
        self.finish_backward()
        if self._aliased:
            # Nothing to reduce: autograd gave the pieces their gradients (None where none came).
            has_grad = [piece.grad is not None for piece in self.pieces]
            used = self.comm.seams.used_slots(has_grad) if self.requires_grad else has_grad
            for piece, had, u in zip(self.pieces, has_grad, used):
                if u and not had:
                    piece.grad = torch.zeros_like(piece)
            return
        if not (self.sync_grads and self.reduce_due):
            return
        self.reduce_due = False
        self.reducer.wait()  # before packing: two padded gradients never live side by side
        self.reducer.start(self, self._pack_reduce_input())

    def _pack_reduce_input(self) -> torch.Tensor:
        """The reduce-scatter's input, (W * (shard_numel + num_slots),): row r is rank r's shard of
        the padded unsharded gradient (zeros where no gradient came, and in the padding), then one
        flag per slot, 1 where this rank has a gradient for it ([Note: Gradients with their used
        flags]); each slot gradient is freed once copied."""
        layout, world = self.layout, self.comm.groups.shard_world_size
        shard_numel, num_slots = layout.shard_numel, len(layout.slots)
        slot_grads = self._slot_grads or [None] * num_slots
        self._slot_grads = []
        device = self.comm.compute_device or self.sharded.device
        rows = torch.empty(world, shard_numel + num_slots, dtype=self.compute_dtype, device=device)
        rows[:, shard_numel:] = torch.tensor([g is not None for g in slot_grads], dtype=rows.dtype, device=device)
        body = rows[:, :shard_numel]
        for start, end in layout.padding_intervals():
            for r0, r1, lo, hi, _ in _row_blocks(shard_numel, start, end):
                body[r0:r1, lo:hi].zero_()
        for i, slot in enumerate(layout.slots):
            grad, slot_grads[i] = slot_grads[i], None
            flat = None if grad is None else grad.reshape(-1)
            for r0, r1, lo, hi, at in _row_blocks(shard_numel, slot.offset, slot.end):
                if flat is None:
                    body[r0:r1, lo:hi].zero_()
                else:
                    body[r0:r1, lo:hi].copy_(flat[at:at + (r1 - r0) * (hi - lo)].view(r1 - r0, hi - lo))
            del grad, flat
        return rows.view(-1)

    def start_reduce(self, reduce_input: torch.Tensor) -> PendingReduce:
        """Start the reduce-scatter (sum) of `_pack_reduce_input`'s rows; finish_reduce() completes it."""
        c = self.comm
        grad = c.seams.before_reduce(reduce_input, c.groups.data_parallel_size)
        if c.precision.reduce_dtype is not None and grad.dtype != c.precision.reduce_dtype:
            grad = grad.to(c.precision.reduce_dtype)
        reduced = grad.new_empty(self.layout.shard_numel + len(self.layout.slots))
        work = reduce_scatter_sum(reduced, grad, c.groups.shard_group, c.stats, async_op=True)
        return PendingReduce(self, work, grad, reduced)

    def finish_reduce(self, reduced: torch.Tensor) -> None:
        """Average the reduce-scattered gradient sum and add it into the gradients of the pieces of
        the slots some rank had a gradient for; the others keep theirs (None: no gradient)."""
        c = self.comm
        if c.groups.replicate_group is not None:
            if self.partial_reduced is not None:  # reduce-scattered earlier, not all-reduced yet
                reduced.add_(self.partial_reduced)
                self.partial_reduced = None
            if not self.requires_all_reduce:  # FSDPModule.set_requires_all_reduce(False): accumulate it here
                self.partial_reduced = reduced
                return
            all_reduce_sum(reduced, c.groups.replicate_group, c.stats)
        sharded_grad, flags = reduced[:self.layout.shard_numel], reduced[self.layout.shard_numel:]
        used = c.seams.used_slots((flags != 0).tolist())
        divisor = c.seams.average_divisor(c.groups.data_parallel_size)
        if self.divide_factor is not None:  # FSDPModule.set_gradient_divide_factor
            sharded_grad.div_(self.divide_factor)
        elif divisor > 1:
            sharded_grad.div_(divisor)
        c.seams.averaged(sharded_grad, self, c)
        if self.all_reduce_hook is not None:
            hook, stream = self.all_reduce_hook
            module = None if stream is None else torch.get_device_module(stream.device.type)
            with contextlib.nullcontext() if module is None else module.stream(stream):
                hook(sharded_grad)
        padding = self.layout.local_padding_intervals(c.groups.shard_rank)
        fill = c.seams.gradient_padding_value(0.0)
        if fill == 0.0:
            zero_padding_(sharded_grad, padding)
        else:
            for pad_start, pad_end in padding:
                sharded_grad[pad_start:pad_end] = fill
        self.accumulate_sharded_grad(sharded_grad.to(device=self.sharded.device, dtype=self.sharded.dtype), used)

    def accumulate_sharded_grad(self, sharded_grad: torch.Tensor, used: list[bool]) -> None:
        """Add a reduced shard gradient into the pieces' gradients, slot by slot where `used`: the
        first one since the optimizer cleared them becomes the shard gradient the pieces slice."""
        current = self.sharded_grad
        overwrite = not self.comm.seams.accumulates(True)
        if current is None or overwrite:
            self._sharded_grad = sharded_grad
            for piece, (a, b), u in zip(self.pieces, self.local_bounds, used):
                piece.grad = sharded_grad[a:b] if u or (overwrite and piece.grad is not None) else None
            return
        for pad_start, pad_end in self.layout.local_padding_intervals(self.comm.groups.shard_rank):
            current[pad_start:pad_end] += sharded_grad[pad_start:pad_end]
        for piece, (a, b), u in zip(self.pieces, self.local_bounds, used):
            if not u:
                continue
            if piece.grad is None:
                current[a:b].copy_(sharded_grad[a:b])
                piece.grad = current[a:b]
            else:
                piece.grad += sharded_grad[a:b]  # a slice of `current`

    def zero_sharded_padding_(self) -> None:
        if self.comm.seams.init_padding_value(0.0) != 0.0:
            return
        # Through .data: at W = 1 the pieces are autograd leaves viewing the shard, whose views an
        # earlier forward of this unit may have saved; padding is never read by a view, and
        # writing it must not bump their version counter.
        zero_padding_(self.sharded.data, self.layout.local_padding_intervals(self.comm.groups.shard_rank))

    # -- full tensors ----------------------------------------------------------------------------
    def gather_full(self, sharded: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Full (unpadded) tensors of every slot from this rank's shard of the flat parameter
        (or of `sharded`, e.g. its gradient), in the sharded dtype; a collective."""
        return gather_full_many([(self, self.sharded.detach() if sharded is None else sharded)])[0]


GATHER_BUCKET_BYTES = 64 * 2**20  # most bytes one rank sends in one all-gather of gather_full_many


def gather_full_many(pairs: list[tuple[FlatParamHandle, torch.Tensor]]) -> list[list[torch.Tensor]]:
    """`handle.gather_full(sharded)` for every (handle, sharded) pair, with one all-gather per
    bucket of pairs that share a shard group, dtype and device instead of one per pair (a
    collective; every rank passes the same handles in the same order).

    With uniform padding every rank's shard of a flat parameter has shard_numel elements, so the
    gathered (W, bucket numel) buffer holds each rank's shards of the bucket side by side: a flat
    parameter's columns, read rank after rank, are its padded unsharded buffer. A copy of every
    element, no arithmetic: bitwise the gather of each flat parameter on its own."""
    out: list[list[torch.Tensor] | None] = [None] * len(pairs)
    buckets: dict[tuple, list[list[int]]] = {}
    filled: dict[tuple, int] = {}  # bytes in each key's last bucket
    for i, (handle, sharded) in enumerate(pairs):
        if sharded.numel() != handle.layout.shard_numel:
            raise ValueError(f"gather_full of {handle.param_name}: {sharded.numel()} elements, the shard has "
                             f"{handle.layout.shard_numel}")
        key = (id(handle.comm.groups.shard_group), sharded.dtype, sharded.device)
        nbytes = sharded.numel() * sharded.element_size()
        if key not in buckets or filled[key] + nbytes > GATHER_BUCKET_BYTES:
            buckets.setdefault(key, []).append([])
            filled[key] = 0
        buckets[key][-1].append(i)
        filled[key] += nbytes
    for runs in buckets.values():
        for run in runs:
            comm = pairs[run[0]][0].comm
            send = torch.cat([pairs[i][1].detach().reshape(-1) for i in run])
            gathered = send.new_empty(comm.groups.shard_world_size * send.numel())
            all_gather_into(gathered, send, comm.groups.shard_group)
            blocks, at = comm.seams.gathered_blocks(gathered.view(comm.groups.shard_world_size, send.numel())), 0
            for i in run:
                handle, numel = pairs[i][0], pairs[i][1].numel()
                # Rank after rank, copied into a buffer of its own: a view could keep the gathered
                # row stride, which a one-element slot's clone would inherit.
                padded = blocks[:, at:at + numel].contiguous().view(-1)
                at += numel
                out[i] = [v.clone() for v in unflatten_views(padded, handle.layout)]
    return out


@dataclass
class PendingReduce:
    """A gradient reduce-scatter in flight and the tensors it needs until it completes."""

    handle: FlatParamHandle
    work: dist.Work | None  # None: nothing communicated (W_shard = 1), the output is ready
    padded_grad: torch.Tensor | None  # the input, alive until the work completes
    sharded_grad: torch.Tensor  # the output: the shard gradient, then the slots' used flags

    def finish(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.padded_grad = None  # freed before the averaging below allocates
        self.handle.finish_reduce(self.sharded_grad)


class GradReducer:
    """At most one gradient reduce-scatter in flight ([Note: Overlapped gradient reduction])."""

    def __init__(self) -> None:
        self._in_flight: PendingReduce | None = None

    def start(self, handle: FlatParamHandle, padded_grad: torch.Tensor) -> None:
        self.wait()
        self._in_flight = handle.start_reduce(padded_grad)

    @property
    def in_flight(self) -> FlatParamHandle | None:
        """The handle whose reduce-scatter is in flight, if any."""
        return None if self._in_flight is None else self._in_flight.handle

    def wait(self) -> None:
        pending, self._in_flight = self._in_flight, None
        if pending is not None:
            pending.finish()

    def drop(self) -> None:
        """Finish the collective in flight (every rank issued it) without using its result."""
        pending, self._in_flight = self._in_flight, None
        if pending is not None and pending.work is not None:
            pending.work.wait()


def _storage_refs(tensor: torch.Tensor) -> int:
    """How many tensors (and storage handles) reference `tensor`'s storage."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def _row_blocks(row_numel: int, start: int, end: int):
    """(first row, row after the last, start in row, end in row, offset from `start`) of the blocks
    of a (W, row_numel) view of a padded buffer that [start, end) of the buffer touches: a partial
    first row, the whole rows after it as one block, a partial last row. A parameter spanning many
    ranks' rows (W above its numel: shards of one element) costs three copies, not one per rank."""
    at = start
    while at < end:
        row, lo = divmod(at, row_numel)
        if lo == 0 and end - at >= row_numel:
            rows = (end - at) // row_numel
            yield row, row + rows, 0, row_numel, at - start
            at += rows * row_numel
        else:
            hi = min(row_numel, lo + end - at)
            yield row, row + 1, lo, hi, at - start
            at += hi - lo


def _is_slice(t: torch.Tensor, flat: torch.Tensor, start: int) -> bool:
    """Whether `t` is the slice of `flat` that starts at element `start` (an empty `t` anywhere on
    its device and dtype)."""
    if t.device != flat.device or t.dtype != flat.dtype:
        return False
    if t.is_meta:
        return True  # no storage to tell by; to_empty() moves it off the meta device first
    return t.numel() == 0 or t.data_ptr() == flat.data_ptr() + start * flat.element_size()
