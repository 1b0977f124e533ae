"""Inside every rank: pin threads, then for each Cell of this launch and each optimizer of its
case build the model from the reference initial state, wrap it through the adapter, train,
and snapshot (rank 0 writes). Run as `python -m torch.distributed.run ... -m harness.run.worker PLAN`
(on CPUs `python -m harness.run.prefork ...`, the same arguments: [Note: Forked ranks]).

The only configuration a rank reads is the launch plan file (the Cells); the environment
variables it reads are torchrun's own (RANK, WORLD_SIZE, MASTER_*).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import os
import pickle
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from cases.catalog import Case, OptimizerSpec, get_case
from cases.data import call_model, local_batch, map_tensors
from cases.features import PLAIN
from harness.adapters.features import apply_activation_checkpointing
from harness.adapters.base import Adapter, RankContext, RawShard, plain_name
from harness.adapters.registry import resolve_impl
from harness.faults import of_layer
from harness.run import dist_faults, simulated
from harness.judge.diff import PARAM_UNIT_ROUNDOFF, ReferenceComparison, compare_with_reference, trajectory_envelope
from harness.judge.contracts import active_contracts
from harness.judge.layouts import parameter_names
from harness.judge.shards import GRAD_SUFFIX, ShardSummary, flat_slices, layouts_digest, summarize_row
from harness.run.collectives import CollectiveLedger
from harness.run.judged import RankJudge, on_device, record_on
from harness.run.nodes import record_rank
from harness.run.plan import REFERENCE_IMPL, Cell
from harness.run.rank import (pick_evidence, pick_grads, rank_epilogue, rank_prologue, release_freed_memory,
                              replica_digests, train_step)
from harness.reference.shadow import RankTerm, Shadow, load_nonpersistent_buffers
from harness.run.snapshot import (Buffers, Snapshot, StepRecord, build_init, complete_path, decode, digest, encode,
                                  judged_path, load_init, state_digest,
                                  save_judged, save_snapshot, snapshot_path, started_path, write_atomic_text)
from harness.reference.tolerance import perturbed_run_count


def _pick(tensors: dict[str, torch.Tensor], names: list[str], what: str, ctx: RankContext, cell: Cell) -> dict:
    return pick_evidence(tensors, names, f"rank {ctx.rank}: impl={cell.impl} {what}")


def _all_gather_rows(t: torch.Tensor, ctx: RankContext) -> torch.Tensor:
    """(n,) on every rank -> (W, n) in rank order."""
    t = t.detach().reshape(-1).contiguous()
    if ctx.group is None:
        return t.unsqueeze(0).clone()
    out = t.new_empty(ctx.world_size * t.numel())
    dist.all_gather_into_tensor(out, t, group=ctx.group)
    return out.view(ctx.world_size, -1)


def _gather_rows(t: torch.Tensor, ctx: RankContext) -> torch.Tensor | None:
    """(n,) on every rank -> (W, n) in rank order on the team's rank 0, None on the others."""
    t = t.detach().reshape(-1).contiguous()
    if ctx.group is None:
        return t.unsqueeze(0).clone()
    out = t.new_empty((ctx.world_size, t.numel())) if ctx.rank == 0 else None  # received in place, row by row
    dist.gather(t, list(out.unbind(0)) if out is not None else None, dst=dist.get_global_rank(ctx.group, 0),
                group=ctx.group)
    return out


@dataclass(frozen=True)
class StepParts:
    """One step's evidence on this rank, copied when taken (an implementation's shards change in
    place under it), gathered with the other steps of its batch (`gather_evidence`)."""

    loss: torch.Tensor  # 0-d
    digests: list[int]
    raws: tuple[RawShard, ...]  # summarised: their keys and padding intervals only (data and grad None)
    clip_norm: float | None = None  # the norm this rank's clipping computed
    collectives: tuple[float, ...] = ()  # this rank's LedgerStep row, where contracts apply
    # Judged where they live: per raw shard, the summaries of its data and gradient (None: no
    # gradient), and the digest of the layouts they were read by ([Note: Shards judged where they live]).
    summaries: tuple[tuple[ShardSummary, ShardSummary | None], ...] | None = None
    layouts_digest: str | None = None

    @classmethod
    def take(cls, loss: torch.Tensor, raws: list[RawShard], digests: list[int],
             clip_norm: float | None = None, collectives: tuple[float, ...] = (),
             summarized: ShardReader | None = None) -> StepParts:
        """This step's parts, the raw shards copied, or with `summarized` summarised where they are
        (no copy: the summaries are all that is gathered)."""
        def copy(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().clone()

        if summarized is not None:
            return cls(copy(loss), list(digests),
                       tuple(RawShard(raw.key, None, None, tuple(raw.padding_intervals)) for raw in raws),
                       clip_norm, tuple(collectives), summarized.summaries(raws), summarized.digest)
        return cls(copy(loss), list(digests),
                   tuple(RawShard(raw.key, copy(raw.data), copy(raw.grad), tuple(raw.padding_intervals)) for raw in raws),
                   clip_norm, tuple(collectives))


@dataclass(frozen=True)
class ShardReader:
    """How a rank summarises its raw shards at a step ([Note: Shards judged where they live] in
    harness/judge/shards.py): its rank, the step's layouts (and their digest), its own full
    parameters, the tied names' aliases and the adapter's padding conventions."""

    rank: int
    layouts: dict
    params: dict[str, torch.Tensor]
    aliases: dict[str, str]
    padding: dict[str, str]  # {"params": Padding value, "grads": ...}
    digest: str = ""

    def summaries(self, raws: list[RawShard]) -> tuple[tuple[ShardSummary, ShardSummary | None], ...]:
        zero_data, zero_grads = self.padding["params"] == "zero", self.padding["grads"] == "zero"
        return tuple((summarize_row(raw.data, self.rank, raw.padding_intervals, zero_data,
                                    flat_slices(self.layouts, raw.key, self.params, self.aliases)),
                      None if raw.grad is None else summarize_row(raw.grad, self.rank, raw.padding_intervals, zero_grads))
                     for raw in raws)


@dataclass(frozen=True)
class StepEvidence:
    """One step's evidence of every rank, rows in rank order."""

    losses: torch.Tensor  # (W,) in the loss's dtype
    digests: torch.Tensor  # (W, len(digests)) int64
    clip_norms: torch.Tensor  # (W,) float64, NaN where a rank reported none
    shards: dict[str, torch.Tensor]  # key -> (W, shard_numel); on the team's rank 0 only (empty elsewhere)
    shard_grads: dict[str, torch.Tensor]  # keys whose gradient every rank has (rank 0 only, as shards)
    padding_intervals: dict[str, list]  # key -> per rank [[start, end), ...]; empty where the shards are not (team rank > 0)
    collectives: torch.Tensor | None = None  # (W, fields of LedgerStep): every rank's, where counted
    # Summarised where they live (no shards gathered): key (GRAD_SUFFIX for a gradient every rank
    # has) -> per rank; and each rank's layouts digest. On the team's rank 0 only.
    shard_summaries: dict[str, list[ShardSummary]] | None = None
    layout_digests: list[str] | None = None


# Evidence is gathered once per batch of steps: with 8 ranks on 2 cores a gloo collective costs
# milliseconds (harness/bench), two per step were a tenth of a cell's time. A batch holds the
# steps whose gathered rows (data and gradient in float64, every rank) fit in this many bytes,
# counted from the plain model's size, the same on every rank (each rank must enter the same gathers).
EVIDENCE_BATCH_BYTES = 64 << 20
# From this many raw shard elements per rank in a batch, each raw shard is gathered on its own
# (`gather_evidence`).
GATHER_ONE_BY_ONE_FROM = 1 << 20


def steps_per_gather(num_plain_elements: int) -> int:
    return max(1, EVIDENCE_BATCH_BYTES // max(1, 2 * 8 * num_plain_elements))


def gather_evidence(parts: list[StepParts], ctx: RankContext) -> list[StepEvidence]:
    """Every rank's loss, digests and raw shards (data, grad, padding intervals) of `parts`' steps:
    the raw shards' values on the team's rank 0 only (empty elsewhere), the rest on every rank.

    A shard's number of padding intervals differs between ranks (alignment gaps fall into some
    shards only), so a first small all-gather agrees on each key's maximum count; each rank then
    sends that many intervals per key, the missing ones as empty [0, 0), which are dropped.
    The same all-gather agrees on which shard gradients every rank has: torch FSDP1 leaves the
    gradient of a shard that is all padding None, so such a key records no shard gradients.
    """
    summarized = bool(parts) and parts[0].summaries is not None  # the same on every rank (run_cell's choice)

    def has_grads(p: StepParts) -> list[bool]:
        return [g is not None for _, g in p.summaries] if summarized else [raw.grad is not None for raw in p.raws]

    counts = [float(c) for p in parts for c in [len(raw.padding_intervals) for raw in p.raws] + has_grads(p)]
    device = parts[0].loss.device
    agreed = (_all_gather_rows(torch.tensor(counts, dtype=torch.float64, device=device), ctx).cpu() if counts
              else torch.zeros(1, 0))
    layout, at = [], 0  # per step: (per shard: intervals capacity, every rank has its grad)
    for p in parts:
        num = len(p.raws)
        capacity = agreed[:, at : at + num].amax(dim=0).long().tolist()
        every_grad = agreed[:, at + num : at + 2 * num].amin(dim=0).bool().tolist()
        layout.append(list(zip(capacity, every_grad)))
        at += 2 * num
    # The losses, clip norms, digests and padding intervals to every rank; the raw shards, the
    # model's size, to the team's rank 0 alone, which records them (the others would only hold
    # them), in their own dtypes (one gather per dtype), each shard's rows copied out of them.
    # fp32, bf16 and fp16 values are exact in fp64.
    small: list[torch.Tensor] = []
    big: dict[torch.dtype, list[torch.Tensor]] = {}
    big_at: dict[torch.dtype, int] = {}
    for p, shape in zip(parts, layout):
        small += [p.loss.double().reshape(1), torch.tensor([math.nan if p.clip_norm is None else p.clip_norm],
                                                           dtype=torch.float64, device=device),
                  torch.tensor(p.digests, dtype=torch.float64, device=device),
                  torch.tensor(p.collectives, dtype=torch.float64, device=device)]
        for raw, (cap, has_grad) in zip(p.raws, shape):
            intervals = list(raw.padding_intervals) + [(0, 0)] * (cap - len(raw.padding_intervals))
            small.append(torch.tensor(intervals, dtype=torch.float64, device=device).reshape(-1))
            if summarized:
                continue
            big.setdefault(raw.data.dtype, []).append(raw.data.reshape(-1))
            if has_grad:
                big.setdefault(raw.grad.dtype, []).append(raw.grad.reshape(-1))
    rows = _all_gather_rows(torch.cat(small), ctx).cpu()  # (W, n)
    # Per dtype, each raw tensor's (W, n) rows in the order taken, contiguous (the judge reads a row's
    # bytes); None on the team's other ranks. Many small shards go in one gather per dtype, cut into
    # copies; a model's worth of them one gather each, received in place: a big model's shards are
    # then held once on rank 0, not twice (issue 31), and each gather is large enough that its
    # latency does not count. Shards have the same sizes on every rank: each rank makes the same choice.
    one_by_one = sum(t.numel() for ts in big.values() for t in ts) >= GATHER_ONE_BY_ONE_FROM
    big_rows: dict[torch.dtype, list[torch.Tensor]] | None = {}
    for dtype in sorted(big, key=str):  # the same order on every rank: each enters the same gathers
        tensors = big.pop(dtype)
        for t in tensors if one_by_one else [torch.cat(tensors)]:
            gathered = _gather_rows(t, ctx)
            if gathered is None:
                big_rows = None
            elif big_rows is not None and one_by_one:
                big_rows.setdefault(dtype, []).append(gathered.cpu())
            elif big_rows is not None:
                gathered, at = gathered.cpu(), 0
                for piece in tensors:
                    big_rows.setdefault(dtype, []).append(gathered[:, at : at + piece.numel()].contiguous())
                    at += piece.numel()
                if at != gathered.shape[1]:
                    raise RuntimeError(f"rank {ctx.rank}: gathered {gathered.shape[1]} {dtype} shard values, cut {at}")
            del gathered
        big_at[dtype] = 0
    summaries = None  # per rank, per step: (layouts digest, the step's summaries); on the team's rank 0
    if summarized:
        mine = [(p.layouts_digest, p.summaries) for p in parts]
        if ctx.group is None:
            summaries = [mine]
        else:
            summaries = [None] * ctx.world_size if ctx.rank == 0 else None
            dist.gather_object(mine, summaries, dst=dist.get_global_rank(ctx.group, 0), group=ctx.group)
        big_rows = {} if ctx.rank == 0 else None
    out, at = [], 0
    for i, (p, shape) in enumerate(zip(parts, layout)):
        losses = rows[:, at].to(p.loss.dtype)
        clip_norms = rows[:, at + 1].clone()
        digests = rows[:, at + 2 : at + 2 + len(p.digests)].long()
        at += 2 + len(p.digests)
        collectives = rows[:, at : at + len(p.collectives)].clone() if p.collectives else None
        at += len(p.collectives)
        shards, shard_grads, padding_intervals = {}, {}, {}
        for raw, (cap, has_grad) in zip(p.raws, shape):
            if big_rows is not None:  # read with the shards, where they are judged: W lists on one rank, not on W
                per_rank = rows[:, at : at + 2 * cap].long().view(ctx.world_size, cap, 2).tolist()
                padding_intervals[raw.key] = [[[a, b] for a, b in ivs if b > a] for ivs in per_rank]
            at += 2 * cap
            for into, t in ((shards, raw.data), (shard_grads, raw.grad if has_grad else None)):
                if t is None:
                    continue
                if big_rows is not None:  # (W, n), contiguous: the judge reads a row's bytes
                    into[raw.key] = big_rows[t.dtype][big_at[t.dtype]]
                    if into[raw.key].shape[1] != t.numel():
                        raise RuntimeError(f"rank {ctx.rank}: gathered {into[raw.key].shape[1]} values of shard "
                                           f"{raw.key!r} per rank, took {t.numel()}")
                big_at[t.dtype] += 1
        shard_summaries = layout_digests = None
        if summaries is not None:
            per_rank = [rank_parts[i] for rank_parts in summaries]
            layout_digests = [digest for digest, _ in per_rank]
            shard_summaries = {raw.key: [theirs[j][0] for _, theirs in per_rank] for j, raw in enumerate(p.raws)}
            shard_summaries.update((raw.key + GRAD_SUFFIX, [theirs[j][1] for _, theirs in per_rank])
                                   for j, (raw, (_, has_grad)) in enumerate(zip(p.raws, shape)) if has_grad)
        out.append(StepEvidence(losses, digests, clip_norms, shards, shard_grads, padding_intervals, collectives,
                                shard_summaries, layout_digests))
    if at != rows.shape[1] or (big_rows is not None and any(big_at[d] != len(r) for d, r in big_rows.items())):
        raise RuntimeError(f"rank {ctx.rank}: gathered {rows.shape[1]} evidence values and "
                           f"{[len(r) for r in big_rows.values()] if big_rows is not None else '?'} shards per "
                           f"rank, read {at} and {list(big_at.values())}")
    return out


def _check_refused_wrap(case: Case, adapter: Adapter, ctx: RankContext) -> None:
    """Wrapping the case's refused paths as separate units must raise a clear ValueError, at the
    wrap or at the first forward (FSDP2's time: the root's lazy initialisation, before any
    collective, so every rank raises alike)."""
    model = case.build_model()
    try:
        wrapped = adapter.wrap(model, case.features.refused_wrap, replace(ctx, features=PLAIN, faults=frozenset()))
        inputs, _ = local_batch(case.make_batch(case.seed, 1, case.global_batch), "identical", ctx.rank, ctx.world_size)
        call_model(wrapped, map_tensors(lambda t: t.to(ctx.device), inputs))
    except ValueError as e:
        if "fully_shard" not in str(e):
            raise RuntimeError(f"rank {ctx.rank}: refusal of {case.features.refused_wrap} lacks a clear message: {e}")
        return
    raise RuntimeError(f"rank {ctx.rank}: case={case.name}: wrapping {list(case.features.refused_wrap)} as separate "
                       f"units was accepted and ran forward; a parameter tied across units must be refused")


def _build_wrapped(case: Case, adapter: Adapter, ctx: RankContext, init_state, init_buffers,
                   wrap_paths: tuple[str, ...]) -> nn.Module:
    features = case.features
    if features.meta_init:  # buffers too are the implementation's to materialise
        with torch.device("meta"):
            model = case.build_model()
    else:
        model = case.build_model()
        model.load_state_dict(init_state)
        load_nonpersistent_buffers(model, init_buffers)
        model.to(ctx.device)
    apply_activation_checkpointing(model, features.activation_checkpointing)
    wrapped = adapter.wrap(model, wrap_paths, ctx)
    if features.meta_init:
        adapter.materialize(wrapped, init_state, ctx.device)
        _load_nonpersistent_after_meta(wrapped, init_state, init_buffers)
    if features.cpu_offload:
        _check_offloaded(adapter, wrapped, ctx)
    if features.wrap_groups:
        _check_grouped(adapter, wrapped, ctx)
    return wrapped


def _check_grouped(adapter: Adapter, wrapped: nn.Module, ctx: RankContext) -> None:
    """A case wrapping modules as one unit (Features.wrap_groups) is judged only where its layouts
    put every parameter of a group in one unit: a wrap that skips the group trains the same numbers
    and would pass a check of values alone. Layouts that name no unit (one per parameter, as
    FSDP2's) leave it to the adapter's own wrap."""
    layouts = adapter.layouts(wrapped)
    names = [name for name, _ in wrapped.named_parameters(remove_duplicate=False) if name in layouts]
    for group in ctx.features.wrap_groups:
        inside = {name for name in names if any(name.startswith(f"{path}.") for path in group)}
        units = {layouts[name].get("unit") for name in inside}
        if None in units:
            continue
        shared = sorted(name for name in names if name not in inside and layouts[name].get("unit") in units)
        if len(units) != 1 or shared:
            raise RuntimeError(f"rank {ctx.rank}: impl={adapter.name} was asked to wrap {list(group)} as one unit "
                               f"(case feature wrap_groups) but its layouts put their parameters in units "
                               f"{sorted(units)}{f' with {shared[:3]}' if shared else ''}: the group was not applied")


def _check_offloaded(adapter: Adapter, wrapped: nn.Module, ctx: RankContext) -> None:
    """A case asking for CPU offload is judged only where the sharded state is on the CPU: an
    implementation that ignores the policy trains correctly on the device, and would pass a check
    of values alone (on a CPU rank there is nothing to tell apart)."""
    shards = adapter.raw_shards(wrapped)
    elsewhere = sorted({str(s.data.device) for s in shards if s.data.device.type != "cpu"})
    if not shards or elsewhere:
        raise RuntimeError(f"rank {ctx.rank}: impl={adapter.name} was asked for CPU offload (case feature "
                           f"cpu_offload) but its sharded parameters are on {elsewhere or 'no shard it reports'}: "
                           f"the policy was not applied")


def _load_nonpersistent_after_meta(wrapped: nn.Module, init_state: dict[str, torch.Tensor],
                                   init_buffers: dict[str, torch.Tensor]) -> None:
    """The reference initial state is the state dict and the buffers a state dict leaves out, as
    the eager path above loads them. to_empty() leaves every buffer uninitialised, and no state
    dict an implementation loads holds the non-persistent ones (a RoPE table, a constant scale):
    they are copied from the reference model as built, as a user's own meta-device init sets them."""
    with torch.no_grad():
        for name, b in wrapped.named_buffers():
            name = plain_name(name)
            if name in init_buffers and name not in init_state:
                b.copy_(init_buffers[name])


def _params_with_plain_names(wrapped: nn.Module, adapter: Adapter, plain_names: set[str], ctx: RankContext,
                             cell: Cell) -> list[tuple[tuple[str, ...], nn.Parameter]]:
    """Each parameter of the wrapped model with the plain model's parameter names it holds: its own
    name when the implementation keeps per-parameter tensors (fsdp2), the names its layout maps
    onto a flat parameter '<unit>/<flat name>' otherwise (ours)."""
    by_flat_key: dict[str, list[str]] = {}
    for name, layout in adapter.layouts(wrapped).items():
        if layout.get("kind") == "flat":
            by_flat_key.setdefault(layout["flat_key"], []).append(name)
    out = []
    for wrapped_name, param in wrapped.named_parameters():
        wrapped_name = plain_name(wrapped_name)
        if wrapped_name in plain_names:
            out.append(((wrapped_name,), param))
            continue
        unit, _, flat_name = wrapped_name.rpartition(".")
        held = by_flat_key.get(f"{unit or '<root>'}/{flat_name}")
        if not held:
            raise RuntimeError(f"rank {ctx.rank}: impl={cell.impl} parameter {wrapped_name!r} holds no parameter of the "
                               f"plain model by its layouts; param groups cannot be assigned to it")
        out.append((tuple(held), param))
    return out


def _make_optimizer(adapter: Adapter, wrapped: nn.Module, spec: OptimizerSpec, case: Case, ctx: RankContext,
                    cell: Cell, plain_names: set[str]) -> torch.optim.Optimizer:
    """The adapter's optimizer; with parameter groups the harness builds it, each of the wrapped
    model's parameters in the group of the plain parameters it holds, unless the adapter assigns
    them itself (`builds_param_groups`: an engine, which has no layouts before it is built)."""
    if not spec.param_groups or adapter.builds_param_groups:
        return adapter.make_optimizer(wrapped, spec, case.features)
    try:
        return spec.build_grouped(_params_with_plain_names(wrapped, adapter, plain_names, ctx, cell))
    except ValueError as e:  # a flat parameter across groups: this implementation cannot run the case
        raise RuntimeError(f"rank {ctx.rank}: impl={cell.impl} case={case.name}: {e}") from None


class LockStepReference:
    """The reference cell's run (impl=single at W = 1 on the global batch, no fault), trained step
    by step beside a cell whose rank 0 judges its own evidence ([Note: Judged where the evidence
    lives] in harness/run/judged.py): the code `run_cell` runs for the reference cell, in the same
    process settings, so its steps are the reference cell's, bit for bit."""

    def __init__(self, cell: Cell, spec: OptimizerSpec, init_state: dict[str, torch.Tensor],
                 init_buffers: dict[str, torch.Tensor], device: torch.device) -> None:
        case = get_case(cell.case)
        self.case, self.cell = case, replace(cell, impl=REFERENCE_IMPL, world_size=1, data_mode="identical",
                                             faults=(), is_reference=True, impl_name="")
        self.adapter: Adapter = dist_faults.planted(resolve_impl(REFERENCE_IMPL), ())
        self.ctx = replace(RankContext(0, 1, None, device), features=case.features, faults=frozenset())
        plain = case.build_shapes()  # names and structure
        self.names = [n for n, _ in plain.named_parameters()]
        self.grad_names = [n for n, p in plain.named_parameters() if p.requires_grad]
        self.known_names = {n for n, _ in plain.named_parameters(remove_duplicate=False)}
        self.wrapped = _build_wrapped(case, self.adapter, self.ctx, init_state, init_buffers, case.wrap_paths(plain))
        self.optim = _make_optimizer(self.adapter, self.wrapped, spec, case, self.ctx, self.cell, set(self.names))
        self.scheduler = spec.build_scheduler(self.optim)

    def step(self, step: int) -> dict:
        case, ctx, adapter, wrapped = self.case, self.ctx, self.adapter, self.wrapped
        batch = case.make_batch(case.seed, step, case.global_batch)
        inputs, targets = map_tensors(lambda t: t.to(ctx.device), local_batch(batch, "identical", 0, 1))
        loss, grads, *_ = train_step(adapter, wrapped, self.optim, case.loss_fn, inputs, targets, case.features.grad_accum,
                                 case.features,
                                 lambda: pick_grads(adapter.full_grads(wrapped), self.grad_names, self.known_names,
                                                    f"impl={REFERENCE_IMPL} full_grads"))
        if self.scheduler is not None:
            self.scheduler.step()
        params = _pick(adapter.full_params(wrapped), self.names, "full_params", ctx, self.cell)
        return {"step": step, "loss": loss.detach().reshape(1), "grads": _detached(grads), "params": _detached(params)}


def _detached(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach() for n, t in tensors.items()}


def run_cell(cell: Cell, spec: OptimizerSpec, init_state: dict[str, torch.Tensor], world: RankContext,
             scratch_dir: Path, init_buffers: dict[str, torch.Tensor] | None = None,
             judge_here: bool = False, run_id: str = "", init_digest: str | None = None,
             team_size: int = 1, hand_over: bool = False) -> dict | None:
    """Train one (cell, optimizer) and return rank 0's snapshot (None on the other ranks), or with
    `judge_here` its judged record ([Note: Judged where the evidence lives] in harness/run/judged.py).
    A reference cell judged here steps the perturbed runs of its seeds (`perturbed_seeds`, its
    team of `team_size` ranks shares them); the other ranks' envelopes are merged in by the caller.
    With `hand_over` (judged here) the caller gives up `init_state`: it is emptied once every
    consumer holds its own copy ([Note: The initial state handed over])."""
    case = get_case(cell.case)
    features = case.features
    adapter: Adapter = dist_faults.planted(resolve_impl(cell.impl), cell.faults)  # collective faults, if any
    ctx = world if adapter.needs_process_group else RankContext(0, 1, None, world.device)
    ctx = replace(ctx, features=features, faults=frozenset(cell.faults) - of_layer("loop").keys())
    if features.refused_wrap and adapter.refuses_cross_unit_ties:
        _check_refused_wrap(case, adapter, ctx)
    # names and structure; the values of the buffers, where they are not given
    plain = case.build_shapes() if init_buffers is not None else case.build_model()
    names = [n for n, _ in plain.named_parameters()]
    aliases = parameter_names(plain)[1]  # tied name -> the name its evidence is under
    grad_names = [n for n, p in plain.named_parameters() if p.requires_grad]
    known_names = {n for n, _ in plain.named_parameters(remove_duplicate=False)}
    buffer_names = [n for n, _ in plain.named_buffers()]
    init_buffers = init_buffers if init_buffers is not None else dict(plain.named_buffers())
    wrap_paths = case.wrap_paths(plain)
    wrapped: nn.Module = _build_wrapped(case, adapter, ctx, init_state, init_buffers, wrap_paths)
    optim = _make_optimizer(adapter, wrapped, spec, case, ctx, cell, set(names))
    scheduler = spec.build_scheduler(optim)
    scheduler_steps = dist_faults.scheduler_steps(cell.faults, scheduler, f"cell {cell.cell_id}")
    is_writer = world.rank == 0
    contracts = active_contracts(features, ctx.world_size, adapter.contracts)
    ledger = CollectiveLedger(features.shard_group(ctx.world_size, ctx.rank)) if contracts else None
    shadow = (Shadow(case, spec, init_state, ctx.device, init_buffers=init_buffers,
                     record_device=ctx.device if judge_here else torch.device("cpu")) if is_writer else None)
    reshard_steps = features.checkpoint_reshard_at if adapter.reshards_checkpoints else ()

    layouts = adapter.layouts(wrapped)  # after make_optimizer: an engine may shard only then
    header = {"cell": cell.to_json(), "optimizer": spec.kind, "world_size": ctx.world_size, "layouts": layouts,
              "padding": {"params": adapter.param_padding.value, "grads": adapter.grad_padding.value},
              "init_order": names, "init_digest": init_digest, "contracts": list(contracts)}
    judge = None
    # A cell judged here trains its lock-step reference on the team's rank 1, beside rank 0's
    # replay, and compares the cell's steps with it there (rank 1 holds the cell's full parameters
    # and gradients too): rank 0 receives each gathered step's comparison, a few numbers per
    # parameter ([Note: Judged where the evidence lives], harness/run/judged.py).
    reference_rank = 1 if judge_here and not cell.is_reference and ctx.world_size > 1 and ctx.group else 0
    references: dict[int, ReferenceComparison] = {}
    received_through = [0]  # on rank 0: the last step whose comparison arrived

    def receive_comparisons() -> None:
        """One gather's comparisons from the reference's rank (sent once it compared them)."""
        box = [None]
        dist.recv_object_list(box, src=reference_rank, group=ctx.group)
        references.update((c.step, c) for c in box[0])
        received_through[0] = max(c.step for c in box[0])
    to_compare: dict[int, dict] = {}  # on rank 1: step -> the cell's record
    helper = (LockStepReference(cell, spec, init_state, init_buffers, ctx.device)
              if reference_rank and ctx.rank == reference_rank else None)
    # A reference cell judged by a team: the ranks stepping its perturbed runs get its parameters
    # from here, step by step, instead of training the reference again.
    num_runs = perturbed_runs_of(plain) if cell.is_reference else 0
    feed = (ReferenceFeed([r for r in range(1, team_size) if perturbed_seeds(r, team_size, num_runs)])
            if is_writer and judge_here and cell.is_reference and team_size > 1 else None)
    if is_writer and judge_here:
        reference = perturbed = None
        if cell.is_reference:
            seeds = perturbed_seeds(0, team_size, num_runs)  # none here: the team's other ranks step them all
            runs = (PerturbedRuns(case, spec, init_state, seeds, ctx.device, init_buffers, ctx.device, borrow=True,
                                  world_sizes=cell.serves) if seeds else None)
            def perturbed(step, before, runs=runs):
                return runs.step(step, before) if runs is not None else []
        elif reference_rank:
            def reference(step: int) -> ReferenceComparison:
                """The comparison of `step`, received from the reference's rank when the judge asks."""
                if step not in references:
                    receive_comparisons()
                return references.pop(step)
        else:
            reference = LockStepReference(cell, spec, init_state, init_buffers, ctx.device).step
        judge = RankJudge(cell, spec, case, header, plain, init_state, init_buffers, reference, perturbed, ctx.device)
    # [Note: Each rank's term replayed on it]: a judged split cell's other ranks replay their own terms
    terms_on_ranks = (judge_here and not cell.is_reference and cell.data_mode == "split" and ctx.world_size > 1
                      and ctx.group is not None)
    term_shadow = (Shadow(case, spec, init_state, ctx.device, init_buffers=init_buffers)
                   if terms_on_ranks and ctx.rank > 0 else None)
    term_feed = TermFeed(ctx.device) if term_shadow is not None else None
    if hand_over and judge is None:
        init_state.clear()  # built into the model, the replay and the reference: no one reads it again
    init_params = _pick(adapter.full_params(wrapped), names, "full_params", ctx, cell)
    # Buffers are whole on every rank: rank 0's recorded, every rank's digested ([Note: Buffers]).
    init_bufs = _pick(adapter.full_buffers(wrapped), buffer_names, "full_buffers", ctx, cell)
    pending_digests = [digest(init_bufs[n]) for n in buffer_names]  # gathered with step 1's evidence
    # the digests of the parameters and buffers the step starts from, where ranks replay their own terms
    before_digests = [digest(t) for t in init_params.values()] + pending_digests if terms_on_ranks else None
    steps, params_before, buffers_before = [], init_params, init_bufs
    if not is_writer:
        init_params = None  # read again by rank 0 only (the judge's start, a snapshot); step 1 starts from them
    init_buffer_digests = None  # (W, buffers): set from step 1's gather
    per_gather = steps_per_gather(sum(p.numel() for p in plain.parameters()))
    # Steps taken, not gathered yet: (step, this rank's parts, number of replica digests, rank 0's record).
    pending: list[tuple[int, StepParts, int, dict]] = []
    # A judge that takes each step before the next is replayed reads the replay's own tensors.
    borrow = judge is not None and per_gather == 1
    for step in range(1, cell.steps + 1):
        if feed is not None:
            feed.wait()  # the last step's parameters received: the rank stepping the runs goes on with them
        batch = case.make_batch(case.seed, step, case.global_batch)
        inputs, targets = map_tensors(lambda t: t.to(ctx.device),
                                      local_batch(batch, cell.data_mode, ctx.rank, ctx.world_size))
        def full_grads(wrapped=wrapped):
            return pick_grads(adapter.full_grads(wrapped), grad_names, known_names,
                              f"rank {ctx.rank}: impl={cell.impl} full_grads")

        with ledger.step() if ledger is not None else contextlib.nullcontext():
            loss, grads, clip_norm, clipped_grads = train_step(adapter, wrapped, optim, case.loss_fn, inputs, targets,
                                                               features.grad_accum, features, full_grads,
                                                               clipped_evidence=full_grads, ledger=ledger)
        for _ in range(scheduler_steps if scheduler is not None else 0):
            scheduler.step()
        params = _pick(adapter.full_params(wrapped), names, "full_params", ctx, cell)
        buffers = _pick(adapter.full_buffers(wrapped), buffer_names, "full_buffers", ctx, cell)
        if feed is not None:
            feed.send([params[n] for n in names])
        # Every rank's full parameters and gradients, digested: replicas must agree bitwise; and
        # every rank's buffers (before step 1 too), judged against the replay.
        replicas = replica_digests(params, grads, grad_names)
        buffer_digests = [digest(buffers[n]) for n in buffer_names]
        digests = replicas["digests"] + buffer_digests + pending_digests
        pending_digests = []
        record = {}
        if term_feed is not None:  # this rank's term, first: rank 0's replay waits for it
            term_feed.send(term_shadow.rank_term(params_before, batch, cell.data_mode, ctx.world_size, ctx.rank,
                                                 buffers_before), before_digests)
            release_freed_memory()
        if shadow is not None:
            given = ((lambda rank, before=before_digests: TermFeed.receive(rank, before, ctx.device) if rank else None)
                     if terms_on_ranks else None)
            record = {"grads": grads, "clipped_grads": clipped_grads, "params": params, "buffers": buffers,
                      "replica_names": replicas["names"],
                      # judged here: the reordered replays only where the judge needs them
                      "shadow": shadow.step(params_before, batch, cell.data_mode, ctx.world_size,
                                            buffers_before=buffers_before, reorder=judge is None,
                                            clip_norm=clip_norm, borrow=borrow, given=given),
                      "layouts": adapter.layouts(wrapped)}
            release_freed_memory()
        if helper is not None:  # its reference's step after the gather, while rank 0 judges
            to_compare[step] = {"step": step, "grads": _detached(grads), "params": _detached(params)}
        if ledger is not None:
            ledger.taken = replace(ledger.taken, optimizer_state_elements=adapter.local_optimizer_state_elements(optim))
        reader = None
        if judge_here:  # the raw shards judged where they are ([Note: Shards judged where they live])
            step_layouts = record["layouts"] if record else adapter.layouts(wrapped)
            reader = ShardReader(ctx.rank, step_layouts, params, aliases, header["padding"], layouts_digest(step_layouts))
        pending.append((step, StepParts.take(loss, adapter.raw_shards(wrapped), digests, clip_norm,
                                             ledger.taken.to_row() if ledger is not None else (), reader),
                        len(replicas["names"]), record))
        grads = clipped_grads = record = None  # held by the pending step's record until it is judged
        params_before, buffers_before = params, buffers
        if before_digests is not None:
            before_digests = replicas["digests"][:len(params)] + buffer_digests
        if len(pending) == per_gather or step == cell.steps:
            gathered = gather_evidence([parts for _, parts, _, _ in pending], ctx)
            if term_feed is not None:
                # rank 0 received this rank's terms before it entered the gather: done, and let go
                # before the lock-step reference's step
                term_feed.wait()
            if helper is not None:
                comparisons = []
                for (taken, *_), ev in zip(pending, gathered):
                    cell_rec = to_compare.pop(taken)
                    ref_rec = record_on(helper.step(taken), ctx.device)
                    release_freed_memory()
                    with on_device(ctx.device):
                        comparison = compare_with_reference({**cell_rec, "loss": ev.losses.to(ctx.device)}, ref_rec,
                                                            PARAM_UNIT_ROUNDOFF, cell.data_mode == "split", names)
                    comparisons.append(comparison.to(torch.device("cpu")))  # sent as bytes
                    # the cell's and the reference's step let go here, not when the next gather
                    # rebinds these names: they would outlive the next step's training and replay
                    del cell_rec, ref_rec, comparison
                dist.send_object_list([comparisons], dst=0, group=ctx.group)
                del comparisons
            # Each step's record is let go as soon as it is judged: popped, so that nothing of this
            # loop (its replay's float64 sums, the cell's gradients) outlives it into the next step's
            # training, where it would add to the rank's peak (the memory release below returns it).
            for ev in gathered:
                taken, _, num_replicas, record = pending.pop(0)
                buffer_digests = ev.digests[:, num_replicas:num_replicas + len(buffer_names)]
                if taken == 1:
                    init_buffer_digests = ev.digests[:, num_replicas + len(buffer_names):]
                    if judge is not None:
                        judge.start({"params": _detached(init_params),
                                     "buffers": Buffers(_detached(init_bufs), init_buffer_digests).to_dict()})
                        init_params = None  # judged: only a snapshot needs them again
                        if hand_over:
                            init_state.clear()
                if record:
                    rec = StepRecord(
                        taken, ev.losses, record["grads"], record["params"], Buffers(record["buffers"], buffer_digests),
                        record["shadow"], ev.shards, ev.shard_grads, ev.padding_intervals,
                        {"names": record["replica_names"], "digests": ev.digests[:, :num_replicas]},
                        record["layouts"], ev.clip_norms if features.clip_norm_type is not None else None,
                        record["clipped_grads"], ev.collectives, ev.shard_summaries, ev.layout_digests)
                    if judge is None:
                        steps.append(rec)
                    else:  # judged now, and let go
                        judge.take(rec.to_dict())
                        del rec, record
                        release_freed_memory()
            if judge is not None and reference_rank and received_through[0] < taken:
                receive_comparisons()  # a judge that did not ask (it stopped, or raised): taken all the same
            references.clear()  # what the judge did not ask for, it never will
            pending, gathered = [], []
            record = ev = None
        if step in reshard_steps:
            shard_size = max(1, ctx.world_size // 2 ** (reshard_steps.index(step) + 1))
            directory = scratch_dir / f"{cell.cell_id}.{spec.kind}.step{step}"
            wrapped, optim = adapter.reshard_checkpoint(wrapped, optim, spec, ctx, features, directory, shard_size,
                                                        wrap_paths, case.build_model)
    if feed is not None:
        feed.wait()
    if term_feed is not None:
        term_feed.wait()
    dist_faults.check_acted(adapter, f"rank {ctx.rank}: cell {cell.cell_id}")
    if reshard_steps:
        adapter.full_state_roundtrip(wrapped, case.build_model, wrap_paths, ctx,
                                     scratch_dir / f"{cell.cell_id}.{spec.kind}")
    if not is_writer:
        return None
    if judge is not None:
        return judge.record(run_id)
    perturbed = (perturbed_runs(case, spec, init_state, [init_params] + [rec.params for rec in steps[:-1]],
                                list(range(1, num_runs + 1)), ctx.device, init_buffers, cell.serves)
                 if cell.is_reference else None)
    return Snapshot(cell.to_json(), spec.kind, ctx.world_size, layouts,
                    {"params": adapter.param_padding.value, "grads": adapter.grad_padding.value},
                    init_params, Buffers(init_bufs, init_buffer_digests), steps, perturbed,
                    contracts=contracts).to_dict()


def perturbed_runs_of(model: nn.Module) -> int:
    """How many perturbed runs a reference cell of `model`'s case steps (`perturbed_run_count` of
    its trainable tensors' sizes: more for a model with tensors of a few elements); `model` may be
    on the meta device."""
    return perturbed_run_count(p.numel() for p in model.parameters() if p.requires_grad)


def perturbed_seeds(rank: int, team_size: int, num_runs: int) -> list[int]:
    """The perturbed runs (seeds 1..num_runs) rank `rank` of a reference cell's team steps when
    the cell is judged on the ranks. A pair of antithetic runs shares its noise (`PerturbedRuns`),
    so pairs stay whole: round the team's ranks from 1, beside rank 0's training, replay and judge;
    all on rank 0 in a team of one."""
    helpers = range(1, team_size) if team_size > 1 else range(1)
    return [seed for seed in range(1, num_runs + 1)
            if helpers[((seed + 1) // 2 - 1) % len(helpers)] == rank]


# A replayed term's messages (rank r -> the team's rank 0) have a tag of their own: the same pair of
# ranks exchanges the reference's comparisons (tag 0) in the same steps.
TERM_TAG = 31


class TermFeed:
    """[Note: Each rank's term replayed on it] (harness/reference/shadow.py): a judged split cell's
    rank r >= 1 sends the team's rank 0 its replayed term with the digests of the parameters and
    buffers it computed it from. Rank 0 folds it where those are its own (the same values, so the
    same bits as computing it there) and computes the term itself where they are not (replicas that
    disagree, which the replicas check judges). Sent without blocking; a step's tensors stay alive
    until the next step's are sent."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.device, self.pending = device, []  # NCCL sends device tensors only: the header goes there too

    def send(self, term: RankTerm, before: list[int]) -> None:
        self.wait()
        tensors, fields = [], []
        for name, t in term.sums.items():
            several = term.abs_of_several.get(name)
            fields.append((name, t.dtype, tuple(t.shape), None if several is None else several.dtype))
            tensors += [t] if several is None else [t, several]
        header = torch.frombuffer(bytearray(pickle.dumps((before, term.loss.detach().cpu(), fields))), dtype=torch.uint8)
        self.pending = [dist.isend(t.detach().contiguous(), dst=0, tag=TERM_TAG)
                        for t in [torch.tensor([header.numel()]).to(self.device), header.to(self.device), *tensors]]

    def wait(self) -> None:
        for work in self.pending:
            work.wait()
        self.pending = []

    @staticmethod
    def receive(rank: int, before: list[int], device: torch.device) -> RankTerm | None:
        """Rank `rank`'s term, or None where it was computed from other parameters or buffers than
        `before`'s (its tensors received and dropped). The term's tensors are received as they are
        read (`ReceivedTerm`): rank 0 holds one parameter's of them at a time, not the model's."""
        header = _received_from(rank, (int(_received_from(rank, (1,), torch.int64, device)),), torch.uint8, device)
        theirs, loss, fields = pickle.loads(header.cpu().numpy().tobytes())
        term = ReceivedTerm(loss.to(device), rank, fields, device)
        if theirs == before:
            return term
        for _ in term.parts():
            pass
        return None


def _received_from(rank: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(t, src=rank, tag=TERM_TAG)
    return t


class ReceivedTerm(RankTerm):
    """A RankTerm sent by `TermFeed` whose tensors are received from `rank` as `parts` reads them,
    in the order they were sent. Once reading began, every part is received, read or not (a fold that
    stops on an error), so the next term's messages are never taken for this one's."""

    def __init__(self, loss: torch.Tensor, rank: int, fields: list, device: torch.device) -> None:
        super().__init__(loss, {}, {})
        self.rank, self.fields, self.device = rank, fields, device

    def parts(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
        fields, self.fields = self.fields, []
        at = 0
        try:
            for at, (name, dtype, shape, abs_dtype) in enumerate(fields, start=1):
                partial = _received_from(self.rank, shape, dtype, self.device)
                several = None if abs_dtype is None else _received_from(self.rank, shape, abs_dtype, self.device)
                yield name, partial, several
        finally:
            for name, dtype, shape, abs_dtype in fields[at:]:
                _received_from(self.rank, shape, dtype, self.device)
                if abs_dtype is not None:
                    _received_from(self.rank, shape, abs_dtype, self.device)


class ReferenceFeed:
    """The reference cell's parameters after each step, sent from its team's rank 0 (which trains
    it) to the team's ranks that step its perturbed runs (`perturbed_envelopes`): they need the
    reference before and after every step, and receive it instead of training it a second time.
    Sent without blocking the training; a step's tensors stay alive until the next step begins."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks, self.pending = ranks, []

    def send(self, tensors: list[torch.Tensor]) -> None:
        self.pending = [dist.isend(t.detach().contiguous(), dst=r) for r in self.ranks for t in tensors]

    def wait(self) -> None:
        for work in self.pending:
            work.wait()
        self.pending = []

    @staticmethod
    def receive(into: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One step's parameters from the team's rank 0, received into `into`'s tensors (in the
        order of the names rank 0 sends); returns `into`."""
        for t in into.values():
            dist.recv(t, src=0)
        return into


def perturbed_envelopes(cell: Cell, spec: OptimizerSpec, init_state: dict[str, torch.Tensor],
                        init_buffers: dict[str, torch.Tensor], device: torch.device,
                        seeds: list[int], hand_over: bool = False) -> list[dict[str, torch.Tensor]]:
    """Per step, the envelope of the perturbed runs of `seeds` around the reference (impl=single,
    W = 1, trained by the team's rank 0, whose parameters after each step arrive here through its
    ReferenceFeed), as a reference cell's rank 0 computes it for its own seeds; the max of the two
    is the envelope of all. With `hand_over`, `init_state` is emptied after step 1 (`run_cell`)."""
    case = get_case(cell.case)
    names = [n for n, _ in case.build_shapes().named_parameters()]
    runs = PerturbedRuns(case, spec, init_state, seeds, device, init_buffers, device, borrow=True,
                         world_sizes=cell.serves)
    # The reference's parameters after a step are received into the noise's measure model: the
    # envelope reads them there, and the next step's noise is measured at them, in that model
    # (its passes leave its parameters as they are); no copy of the model beside it. A parameter
    # the model holds otherwise than the reference sends it (another dtype, not contiguous) is
    # received into a tensor of its own, which the measure loads.
    measured = runs.measure.params

    def receiver(n: str) -> torch.Tensor:
        own, sent = measured[n].detach(), init_state[n]
        if own.shape == sent.shape and own.dtype == sent.dtype and own.is_contiguous():
            return own
        return torch.empty(sent.shape, dtype=sent.dtype, device=device)
    into = {n: receiver(n) for n in names}
    envelopes, before = [], init_state
    for step in range(1, cell.steps + 1):
        runs_params = record_on(runs.step(step, before), device)  # the case's code: out of on_device
        if hand_over:
            init_state.clear()  # the runs hold their own copies; the reference's parameters come next
        params = ReferenceFeed.receive(into)
        with on_device(device):
            envelope = trajectory_envelope(params, runs_params)
        envelopes.append({n: e.cpu() for n, e in envelope.items()})  # sent as bytes
        before = params
    return envelopes


def merge_envelopes(mine: list[dict[str, torch.Tensor]], theirs: list[dict[str, torch.Tensor]]
                    ) -> list[dict[str, torch.Tensor]]:
    """The elementwise max of two teams' envelopes, step by step (NaN kept, as the max over the runs
    of one process keeps it)."""
    if len(mine) != len(theirs) or any(a and b and set(a) != set(b) for a, b in zip(mine, theirs)):
        raise RuntimeError(f"perturbed envelopes of {len(theirs)} steps from another rank, {len(mine)} here")
    # An empty step: that rank stepped no runs.
    return [{n: torch.maximum(a[n], b[n]) for n in a} if a and b else a or b for a, b in zip(mine, theirs)]


class PerturbedRuns:
    """Perturbed copies of the reference run, stepped together one step at a time: each adds
    honest-sized noise to every step's exact gradient, and their deviation from the reference is
    the envelope the trajectory check scales (docs/error_model.md, "Trajectories").

    The noise's amplitude is measured once per step, at the reference's parameters before the step
    (Shadow.noise_amplitude: per-sample and per-split passes, the reordered replays), and shared by
    every run: it is a property of the step's batch and model, not of a run's own bits. Runs come in
    antithetic pairs (seeds 2k - 1, 2k): the pair draws one random sign per element and step, run
    2k - 1 adds sign x amplitude and run 2k its opposite, so at every element one run of the pair is
    pushed the full amplitude in the direction an honest cell may have gone."""

    def __init__(self, case: Case, spec: OptimizerSpec, init_state: dict[str, torch.Tensor], seeds: list[int],
                 device: torch.device, init_buffers: dict[str, torch.Tensor] | None = None,
                 record_device: torch.device = torch.device("cpu"), borrow: bool = False,
                 world_sizes: Sequence[int] = ()) -> None:
        # `borrow`: each step's parameters are the runs' own tensors, valid until the next step (an
        # envelope taken at once, as on the ranks), not copies kept for a snapshot.
        self.case, self.seeds, self.borrow = case, list(seeds), borrow
        # `world_sizes`: those of the cells judged against these runs (the noise covers each).
        self.measure = Shadow(case, spec, init_state, device, init_buffers=init_buffers, world_sizes=world_sizes)
        self.shadows = [Shadow(case, spec, init_state, device, init_buffers=init_buffers, record_device=record_device)
                        for _ in self.seeds]
        self.generators = {pair: torch.Generator().manual_seed(pair) for pair in {(s + 1) // 2 for s in self.seeds}}
        initial = {n: p.detach().to(record_device).clone() for n, p in self.measure.params.items()}
        self.params = [initial] * len(self.seeds)
        self.steps = 0

    def step(self, step: int, reference_before: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Every run's parameters after `step` (steps are taken in order, from 1), the noise
        measured at `reference_before`, the reference's parameters before the step."""
        if step != self.steps + 1:
            raise RuntimeError(f"perturbed runs {self.seeds}: step {step} after step {self.steps}")
        case = self.case
        batch = case.make_batch(case.seed, step, case.global_batch)
        amplitude = self.measure.noise_amplitude(reference_before, batch)
        release_freed_memory()
        # A random sign at the full amplitude (not a uniform draw below it): with the antithetic
        # run's opposite sign, some run is pushed at least as far as an honest cell in either
        # direction, so at step 1 the envelope holds element by element for any optimizer whose
        # update is monotone in the gradient (AdamW's first step is nearly lr * sign(g)).
        noise = {pair: {n: torch.randint(0, 2, a.shape, generator=g, dtype=torch.float64).mul_(2).sub_(1).mul_(a)
                        for n, a in amplitude.items()}  # in place: the same operations, one tensor each
                 for pair, g in sorted(self.generators.items())}
        del amplitude
        self.params = [shadow.perturbed_step(params, batch, noise[(seed + 1) // 2], subtract=seed % 2 == 0,
                                             borrow=self.borrow)
                       for seed, shadow, params in zip(self.seeds, self.shadows, self.params)]
        self.steps = step
        return self.params


def perturbed_runs(case: Case, spec: OptimizerSpec, init_state: dict[str, torch.Tensor],
                   references_before: list[dict[str, torch.Tensor]], seeds: list[int], device: torch.device,
                   init_buffers: dict[str, torch.Tensor] | None = None,
                   world_sizes: Sequence[int] = ()) -> list[list[dict[str, torch.Tensor]]]:
    """Per seed, every step's parameters of the PerturbedRuns of `seeds` around a reference whose
    parameters before each step are `references_before` (noise for cells of `world_sizes`)."""
    runs = PerturbedRuns(case, spec, init_state, seeds, device, init_buffers, world_sizes=world_sizes)
    steps = [runs.step(step, before) for step, before in enumerate(references_before, start=1)]
    return [[params[i] for params in steps] for i in range(len(seeds))]


# A rank waits this long for the other ranks of its next world size: the ranks below it may train
# the smaller world sizes for many minutes first. A hang is ended by the parent's --timeout per
# world size (harness/run/orchestrate.py), not by this.
SEGMENT_WAIT = timedelta(hours=24)


def _store_wait(store: dist.Store, keys: list[str]) -> None:
    """store.wait(keys), a simulated rank's slot handed on while it waits (`simulated.blocking`)."""
    with simulated.blocking():
        store.wait(keys, SEGMENT_WAIT)


def _launch_store() -> dist.Store:
    """The launch's store: torchrun's (`_torchrun_store`), or a simulated launch's, which its ranks
    share in one process (harness/run/simulated.py)."""
    sim = simulated.current()
    return sim[0].store if sim is not None else _torchrun_store()


@functools.cache
def _torchrun_store() -> dist.Store:
    """This rank's one client of the launch's own store (torchrun's rendezvous store, on every
    node). One, not one per use: a connection costs the client a reverse lookup of the store's
    address, and where the resolver asks a DNS server that drops some queries (this host's drops
    about one in 25), one of them stalls its rank for the resolver's 5 s timeout."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=SEGMENT_WAIT)


@contextlib.contextmanager
def _cell_record(store: dist.Store, index: int, ctx: RankContext):
    """Around the record of cell `index`: entered once every rank of `ctx` has finished the cell,
    yielding True on rank 0 (which writes the record), and left once the record is written.

    Keys in the launch's store instead of two barriers: a gloo barrier costs an all-reduce, 16 ms
    at W = 8 on 2 cores, a store request a fraction of one. A rank that dies instead ends the launch
    (torchrun stops the others), as it would in a barrier. Simulated ranks meet in barriers: one
    rendezvous each, where W threads waiting on one store are each woken by every other's set
    (one condition for all its keys: W^2 wakeups a cell, load averages above 100 at W = 1024)."""
    if simulated.current() is not None and ctx.group is not None:
        dist.barrier(group=ctx.group)
        yield ctx.rank == 0
        dist.barrier(group=ctx.group)
        return
    store.set(f"{index}/done/{ctx.rank}", "1")
    if ctx.rank == 0:
        _store_wait(store, [f"{index}/done/{r}" for r in range(ctx.world_size)])
        yield True
        store.set(f"{index}/recorded", "1")
    else:
        yield False
        _store_wait(store, [f"{index}/recorded"])


def num_teams(launch_world_size: int, world_size: int, max_teams: int) -> int:
    """Teams of `world_size` ranks that run cells side by side: team t is launch ranks
    t*world_size .. (t+1)*world_size - 1; the ranks above the last team sit the world size out."""
    return max(1, min(launch_world_size // world_size, max_teams))


def _join_world(world: RankContext, world_size: int, segment: int, backend: str,
                max_teams: int) -> tuple[RankContext | None, int]:
    """[Note: One launch, every world size] (this rank's context in a fresh default process group
    of its team, the team's index), or (None, -1) when this rank sits this world size out. Every
    rank of the launch arrives first, so no rank still runs the previous world size's cells."""
    if dist.is_initialized():
        dist.destroy_process_group()
    store = dist.PrefixStore(f"harness/segment{segment}", _launch_store())
    store.set(f"arrived/{world.rank}", "1")
    _store_wait(store, [f"arrived/{r}" for r in range(world.world_size)])
    team = world.rank // world_size
    if team >= num_teams(world.world_size, world_size, max_teams):
        return None, -1
    rank = world.rank - team * world_size
    # What a launch of `world_size` ranks would have set (torchrun's variables, read by some engines);
    # simulated ranks share one process's environment, and run no engine that reads it.
    if simulated.current() is None:
        for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE"):
            os.environ[var] = str(world_size)
        os.environ["RANK"] = str(rank)
    # init_process_group wraps sys.excepthook to prefix tracebacks with the group's rank; the
    # launch's own group already prefixes them with the launch rank, which the logs are named by.
    hook = sys.excepthook
    dist.init_process_group(backend, store=dist.PrefixStore(f"pg/team{team}", store), rank=rank, world_size=world_size)
    sys.excepthook = hook
    return RankContext(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, world.device), team


def _claims(segment: int, team: int, ctx: RankContext, num_cells: int):
    """The indices of the segment's cells this team runs, in the order it claims them: the team's
    rank 0 takes the next unclaimed one from a counter in the launch's store (a team that finishes
    early takes more) and tells its other ranks under a key of its own."""
    store = dist.PrefixStore(f"harness/claims{segment}", _launch_store())
    for j in itertools.count():
        key = f"team{team}/{j}"
        if ctx.rank == 0:
            store.set(key, str(store.add("next", 1) - 1))
        _store_wait(store, [key])
        k = int(store.get(key))
        if k >= num_cells:
            return
        yield k


def _import_dynamo_in_turn(world: RankContext, sizes: list[int], max_teams: int) -> None:
    """The first optimizer of a process imports torch._dynamo (torch.optim's constructors are
    wrapped by torch._compile._disable_dynamo): seconds of CPU per rank. A forked rank has it
    from its launcher ([Note: Forked ranks]); a rank torchrun's command line started (GPUs)
    imports it here, in turns: the
    ranks of the first world size at once; a rank that first trains at world size W once every
    rank of the world size before W has (it imports while those ranks train, which leaves CPU
    idle waiting on each other's collectives, instead of competing with rank 0's own import)."""
    # the first world size this rank trains at
    first = next((w for w in sizes if w * num_teams(world.world_size, w, max_teams) > world.rank), sizes[-1])
    before = max((w for w in sizes if w < first), default=0)
    store = dist.PrefixStore("harness/dynamo", _launch_store())
    if before:
        _store_wait(store, [f"imported/{r}" for r in range(before)])
    import torch._dynamo  # noqa: F401

    store.set(f"imported/{world.rank}", "1")


def _same_init_everywhere(case: Case, digest_hex: str, ctx: RankContext) -> None:
    """Raise on every rank of the team unless every rank built the same initial state."""
    mine = torch.tensor([int(digest_hex[i:i + 12], 16) for i in range(0, 24, 12)], dtype=torch.float64,
                        device=ctx.device)
    rows = _all_gather_rows(mine, ctx).cpu()
    differ = [r for r in range(rows.shape[0]) if not torch.equal(rows[r], rows[0])]
    if differ:
        raise RuntimeError(f"case={case.name}: build_model() gave rank(s) {differ} another initial state than rank 0; "
                           f"a case must build the same model in every process (seed it, or give its weights)")


_shared_inits: dict[Path, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
_shared_inits_lock = threading.Lock()


def _load_init(path: Path, run_id: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The case's initial state (snapshot.py `load_init`). Simulated ranks share one process: the
    file is read once for all of them, each rank given its own copies (W = 1024 reads of it were
    most of a small cell's set-up)."""
    if simulated.current() is None:
        return load_init(path, run_id)
    with simulated.blocking(), _shared_inits_lock:  # the first rank reads; the others wait without a slot
        if path not in _shared_inits:
            _shared_inits[path] = load_init(path, run_id)
        state, buffers = _shared_inits[path]
    return {n: t.clone() for n, t in state.items()}, {n: t.clone() for n, t in buffers.items()}


# [Note: The initial state handed over]
# A cell judged on its ranks builds the case's initial state (`build_init`) and gives it to each
# optimizer's run, which copies it into what it trains (the implementation's model, the replay,
# the lock-step reference, the perturbed runs) and judges the implementation's initial parameters
# against it at step 1. Nothing reads it after that, but a reference held through the steps is a
# model's worth of memory at every rank's peak (GPT-2 d384: 92 MiB of rank 0's 1.3 GB heap peak,
# memray). So the run is handed the state and empties the dict once every consumer holds its own
# copy (after the judge's start on the judging rank, before the first step elsewhere); a case with
# several optimizers hands each run but the last a copy (`_handed`). Emptying a dict frees
# nothing anyone else still holds: a consumer that kept the tensors themselves keeps them.


def _handed(init_state: dict[str, torch.Tensor], k: int, runs: int) -> dict[str, torch.Tensor]:
    """The initial state for run `k` of `runs` that each empty theirs ([Note: The initial state
    handed over]): the last gets `init_state` itself, the others a copy."""
    return init_state if k == runs - 1 else {n: t.clone() for n, t in init_state.items()}


def _run_claimed(i: int, cell: Cell, num_cells: int, ctx: RankContext, world: RankContext, cells_store: dist.Store,
                 init_dir: Path, snapshot_dir: Path, run_id: str, judge_here: bool = False) -> None:
    """Cell `i` of the launch in this rank's team: its started record, every optimizer's run and
    snapshot, its completion record."""
    if ctx.rank == 0:
        first = world.rank
        write_atomic_text(started_path(snapshot_dir, cell.cell_id),
                          json.dumps({"run_id": run_id, "cell_id": cell.cell_id,
                                      "launch_ranks": list(range(first, first + ctx.world_size))}) + "\n")
    case = get_case(cell.case)
    init_digest = None
    if judge_here:  # built here, the same in every rank, or no cell runs ([Note: Judged where the evidence lives])
        init_state, init_buffers = build_init(case)
        init_digest = state_digest(init_state, init_buffers)
        _same_init_everywhere(case, init_digest, ctx)
    else:
        init_state, init_buffers = _load_init(init_dir / f"{case.name}.pt", run_id)
    start = time.perf_counter()
    # a single-process cell (the reference) runs on its team's rank 0 alone; judged on the ranks,
    # the team's other ranks step its perturbed runs beside it
    runs_here = resolve_impl(cell.impl).needs_process_group or ctx.rank == 0
    shares = judge_here and cell.is_reference
    perturbed_store = dist.PrefixStore(f"harness/perturbed/{cell.cell_id}", _launch_store()) if shares else None
    num_runs = perturbed_runs_of(case.build_shapes()) if shares else 0
    if shares and not runs_here and perturbed_seeds(ctx.rank, ctx.world_size, num_runs):
        for k, spec in enumerate(case.optimizers):
            envelopes = perturbed_envelopes(cell, spec, _handed(init_state, k, len(case.optimizers)), init_buffers,
                                            ctx.device, perturbed_seeds(ctx.rank, ctx.world_size, num_runs),
                                            hand_over=True)
            perturbed_store.set(f"{spec.kind}/{ctx.rank}", encode(envelopes))
            release_freed_memory()
    for k, spec in enumerate(case.optimizers if runs_here else ()):
        state = _handed(init_state, k, len(case.optimizers)) if judge_here else init_state
        snapshot = run_cell(cell, spec, state, ctx, snapshot_dir / "scratch", init_buffers, judge_here, run_id,
                            init_digest, ctx.world_size if shares else 1, hand_over=judge_here)
        if snapshot is not None and shares and snapshot["envelopes"] is not None and snapshot["error"] is None:
            for rank in range(1, ctx.world_size):
                if perturbed_seeds(rank, ctx.world_size, num_runs):
                    _store_wait(perturbed_store, [f"{spec.kind}/{rank}"])
                    theirs = decode(perturbed_store.get(f"{spec.kind}/{rank}"))
                    snapshot["envelopes"] = merge_envelopes(snapshot["envelopes"], theirs)
        if snapshot is not None and judge_here:
            save_judged(judged_path(snapshot_dir, cell.cell_id, spec.kind), snapshot)
        elif snapshot is not None:
            snapshot["run_id"] = run_id
            save_snapshot(snapshot_path(snapshot_dir, cell.cell_id, spec.kind), snapshot)
        snapshot = None
        release_freed_memory()
    # Every rank finished this cell (a failure later in the launch is not its); rank 0 writes its
    # record (wall_s: the cell's time in the ranks, its JUnit test case's time), and no rank goes
    # on (and may fail at exit) before the record exists.
    with _cell_record(cells_store, i, ctx) as record_it:
        if record_it:
            write_atomic_text(complete_path(snapshot_dir, cell.cell_id),
                              json.dumps({"run_id": run_id, "cell_id": cell.cell_id,
                                          "wall_s": round(time.perf_counter() - start, 3)}) + "\n")
    if ctx.rank == 0:
        print(f"[harness] W={ctx.world_size} cell {i + 1}/{num_cells} {cell.cell_id} (launch ranks "
              f"{world.rank}-{world.rank + ctx.world_size - 1}) {time.perf_counter() - start:.2f}s", flush=True)


def main(argv: list[str]) -> int:
    record_rank()  # across nodes: which node this rank runs on (harness/run/nodes.py)
    plan = json.loads(Path(argv[1]).read_text())
    backend = plan.get("backend", "gloo")
    world = rank_prologue(plan["threads"], backend, plan.get("device", "cpu"))
    if world.world_size != plan["world_size"]:
        raise RuntimeError(f"rank {world.rank}: WORLD_SIZE={world.world_size} but the plan is for {plan['world_size']}")
    cells = [Cell.from_json(c) for c in plan["cells"]]
    sizes = [c.world_size for c in cells if not c.is_reference]
    if sizes != sorted(sizes) or (sizes and sizes[-1] != world.world_size):
        raise RuntimeError(f"rank {world.rank}: the plan's cells run at world sizes {sizes}: they must ascend and "
                           f"end at this launch's {world.world_size} ranks")
    init_dir, snapshot_dir, run_id = Path(plan["init_dir"]), Path(plan["snapshot_dir"]), plan["run_id"]
    max_teams = int(plan.get("max_teams", 1))
    judged_on_ranks = set(plan.get("judged_on_ranks", ()))  # cases ([Note: Judged where the evidence lives])
    _import_dynamo_in_turn(world, sorted(set(sizes)) or [world.world_size], max_teams)
    cells_store = dist.PrefixStore("harness/cells", _launch_store())
    segments: list[tuple[int, list[tuple[int, Cell]]]] = []  # (world size, [(index in the plan, cell)])
    for i, cell in enumerate(cells):
        world_size = cell.world_size if not cell.is_reference else (sizes[0] if sizes else world.world_size)
        if not segments or segments[-1][0] != world_size:
            segments.append((world_size, []))
        segments[-1][1].append((i, cell))
    for segment, (world_size, members) in enumerate(segments):
        if world_size == world.world_size and segment == 0:
            ctx, team = world, 0  # a launch of one world size: the launch's own group
        else:
            ctx, team = _join_world(world, world_size, segment, backend, max_teams)
        if ctx is None:
            continue  # this rank sits this world size out
        for k in _claims(segment, team, ctx, len(members)):
            i, cell = members[k]
            _run_claimed(i, cell, len(cells), ctx, world, cells_store, init_dir, snapshot_dir, run_id,
                         cell.case in judged_on_ranks)
    rank_epilogue()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
