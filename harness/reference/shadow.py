"""The unsharded replay of a sharded step.

The replay runs a rank's local computation with the one forward/backward every rank runs
(harness/adapters/local_step.py `forward_backward`), so it replays each rank's local loss and
gradient terms with the same operations on the same shapes.

`Shadow.step` takes the cell's own parameters of the previous step and replays, with the plain
model, every rank's local forward/backward on that rank's local batch (W ranks x M micro-batches,
one pass when the data is identical on every rank). What it returns is the reference of the error
model (docs/error_model.md): each rank's exact local loss, the exact mean of the K local gradient
terms (float64), sum |term| / W (float32 rounded up: [Note: Bounds kept in float32, rounded up]), and the plain optimizer's step from the mean rounded to
the parameter dtype, with the hyperparameters each parameter stepped with (its group's, at this
step's learning rate). `perturbed_step` is one step of a perturbed reference run (the trajectory
envelope), with noise of the amplitude `noise_amplitude` measures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn as nn

from cases.case import GROUP_HYPERPARAMETERS, Case, OptimizerSpec
from cases.data import Batch, batch_size, local_batch, map_tensors
from cases.features import DTYPES
from harness.adapters.features import CastCompute
from harness.adapters.local_step import forward_backward
from harness.reference.tolerance import (REORDER_FACTOR, ReductionModel, accumulate_in_chunks, clip_coefficient,
                                         elementwise_in_chunks, promoted_sum_in_chunks, round_up_to_float32,
                                         underflow_error, unit_roundoff)


# [Note: Reordered accumulation]
# An honest implementation may sum the gradient contributions of a tensor with several consumers
# in another order than the plain model's autograd does: FSDP2 and DeepSpeed put identity autograd
# functions or hooks on module inputs, so x -> (q, k, v, residual) is summed as (q + k + v) + r
# instead of ((r + q) + k) + v; recomputation does the same. Such a sum of k contributions differs
# by at most gamma_{k-1} sum |c_i| from any other order, and the difference travels through the
# rest of the backward to the parameter gradients, where it can dwarf a parameter gradient that is
# itself a small result of cancellation. No closed form bounds that propagation for an arbitrary
# model, so the replay measures it: it runs the same local backward again (REORDER_DRAWS times on
# the graph of the forward the exact terms came from, kept for them: no second forward, and the
# same bits, tests/harness/reference/test_reordered_replays.py) with every contribution into a
# tensor of k >= 2 consumers multiplied
# by 1 + (k - 1) u r, r ~ U(-1, 1) per element, and the deviation of the resulting gradients from
# the clean replay is this model's sensitivity to a reordering (docs/error_model.md, "Reordered
# accumulation"). A tensor with one consumer has nothing to reorder and is left alone.
REORDER_DRAWS = 2


def _accumulating_edges(loss: torch.Tensor) -> dict:
    """{node: [(index of its output gradient, k) ...]}: every backward node's output that is one of
    k >= 2 contributions summed into the same input of the graph (found by walking the graph of
    `loss` once and counting the edges into each (node, input))."""
    consumers: dict[tuple, int] = {}
    edges: list[tuple] = []  # (node, i, key)
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for i, (nxt, nr) in enumerate(node.next_functions):
            if nxt is None:
                continue
            key = (nxt, nr)
            consumers[key] = consumers.get(key, 0) + 1
            edges.append((node, i, key))
            stack.append(nxt)
    out: dict = {}
    for node, i, key in edges:
        if consumers[key] >= 2:
            out.setdefault(node, []).append((i, consumers[key]))
    return out


def _jitter_hooks(loss: torch.Tensor, u: float, state: dict) -> list:
    """Register the perturbing hooks of [Note: Reordered accumulation] on the graph of `loss`; they
    act only while state["generator"] is set. Returns the handles."""
    handles = []
    for node, outputs in _accumulating_edges(loss).items():
        def hook(grad_inputs, grad_outputs, outputs=outputs):
            generator = state.get("generator")
            if generator is None:
                return None
            new = list(grad_inputs)
            for i, k in outputs:
                g = new[i]
                if g is None or not g.is_floating_point():
                    continue
                r = torch.rand(g.shape, generator=generator, dtype=torch.float32).to(g.device) * 2 - 1
                new[i] = (g.float() * (1 + (k - 1) * u * r)).to(g.dtype)
            return tuple(new)
        handles.append(node.register_hook(hook))
    return handles


def load_nonpersistent_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Copy the buffers a state_dict leaves out (registered with persistent=False) from `buffers`,
    the reference model's as built (harness/run/snapshot.py `load_init`)."""
    persistent = set(model.state_dict())
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name not in persistent and name in buffers:
                b.copy_(buffers[name])


# [Note: Replay models from the meta device]
# A replay model (the shadow, each perturbed run) holds the initial state it is given, so the
# random initialisation of a real build is thrown away: for a 124M-parameter GPT-2, 1.5 s of one
# CPU thread and 500 MB per copy, six copies per reference cell (measured on an H200 machine,
# where training the cell took less). So the model is built on the meta device and its parameters
# and buffers get empty storage on the replay's device, one tensor per tensor object (tied
# parameters stay tied), before the state is loaded: the same parameters, buffers and modules as a
# real build followed by the load, bit for bit. It is built for real instead where the meta build
# raises, where a parameter or buffer is of another type (a lazy or subclassed parameter), where a
# non-persistent buffer's value is not given, or where anything else of a module is left on the
# meta device (a tensor attribute, a device captured at construction): tests/harness/reference/test_replay_model.py.


def _left_on_meta(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_meta
    if isinstance(value, torch.device):
        return value.type == "meta"
    if isinstance(value, (list, tuple)):
        return any(_left_on_meta(v) for v in value)
    if isinstance(value, dict):
        return any(_left_on_meta(v) for v in value.values())
    return False


def _meta_built(case: Case, device: torch.device, given_buffers: set[str]) -> nn.Module | None:
    """The case's model with empty storage on `device`, or None where it must be built for real
    ([Note: Replay models from the meta device])."""
    try:
        with torch.device("meta"):
            model = case.build_model()
    except Exception:
        return None
    persistent = set(model.state_dict())
    if any(name not in persistent and name not in given_buffers for name, _ in model.named_buffers()):
        return None
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (meta tensor, kept alive; its storage)
    for module in model.modules():
        for slots in (module._parameters, module._buffers):
            for key, t in slots.items():
                if t is None:
                    continue
                if type(t) not in (torch.Tensor, nn.Parameter):
                    return None
                if id(t) not in made:
                    empty = torch.empty_like(t, device=device)
                    made[id(t)] = (t, nn.Parameter(empty, requires_grad=t.requires_grad)
                                   if isinstance(t, nn.Parameter) else empty)
                slots[key] = made[id(t)][1]
    if any(_left_on_meta(v) for m in model.modules() for k, v in vars(m).items()
           if k not in ("_parameters", "_buffers", "_modules")):
        return None
    return model


def replay_model(case: Case, init_state: dict[str, torch.Tensor], init_buffers: dict[str, torch.Tensor] | None,
                 device: torch.device) -> nn.Module:
    """The case's plain model on `device` holding `init_state` and the non-persistent buffers of
    `init_buffers` ([Note: Replay models from the meta device])."""
    model = _meta_built(case, device, set(init_buffers or ()))
    if model is None:
        model = case.build_model()
    model.load_state_dict(init_state)
    load_nonpersistent_buffers(model, init_buffers or {})
    return model.to(device)


# [Note: Sums by rank]
# The exact mean of a step's K = W x M local gradient terms is summed in float64 rank by rank: each
# rank's own terms first (its micro-batches, each use of a tied parameter, in the order the backward
# gives them: the partial sum, a float32 term itself where the rank has one), then the W partials
# added in rank order (`fold_partial`). A rank can thus sum its own terms where it computed them and
# send one partial, and whoever adds the partials in rank order gets the same bits as this one process
# does (tests/harness/reference/test_sums_by_rank.py). A float32 term is exact in float64, so with
# one term per rank and parameter (no gradient accumulation, no tied use) the sum is the plain
# sequential sum of the terms, as before this order was chosen; with several, the partials
# associate the terms per rank first, which can move the mean in its last float64 bits only where
# the terms' magnitudes span more than about 2^28 (a float64 sum of a few float32 terms within such
# a span needs at most 24 + 28 + log2(K) <= 53 bits: exact in any order): on every catalog case without Hugging Face models, identical and
# split at W = 1, 2, 4, the replay's sums, absolute sums and reordered deviations came out bitwise
# the ones of the sequential sum (compared against the commit before).
def _added(total: torch.Tensor, term: torch.Tensor, absolute: bool = False) -> torch.Tensor:
    """`total` + `term` (+ |`term`| with `absolute`) in float64 (a float32 total, one term so far,
    promoted exactly first), in place on a float64 total, a chunk at a time (`accumulate_in_chunks`)."""
    if total.dtype != torch.float64:
        return promoted_sum_in_chunks(total, term, absolute)
    return accumulate_in_chunks(total, term, absolute)


def fold_partial(totals: dict[str, torch.Tensor], partial: dict[str, torch.Tensor]) -> None:
    """Add one rank's partial sums into `totals`, the next rank in order ([Note: Sums by rank]);
    a parameter the rank has no term for is left as it is. A parameter's first partial is taken as
    it is: one float32 term stays float32 (exact: the sum of one term), promoted to float64 when a
    second rank's partial is added to it."""
    for name in list(partial):
        p = partial.pop(name)
        totals[name] = _added(totals[name], p) if name in totals else p


# [Note: An absolute sum of one term is not held]
# Beside each sum of terms the replay needs the sum of their absolute values (the reduction bound's
# input). Where a sum is still one term, that is |sum| exactly, so it is not held: a rank's harvest,
# and the running totals of the rank order, hold an absolute sum only from a parameter's second term
# (or second partial) on, computed then from the sum it still is, before that is added to. A
# model's worth of float32 |term| is then never held beside the terms while the next rank's pass
# runs (64 MiB of the noise's split pass for GPT-2 d384); the bits are the same (|x| is exact, and
# |x| then widened is x widened then |.|).
def fold_rank(sums: dict[str, torch.Tensor], abs_sums: dict[str, torch.Tensor] | None,
              partial: dict[str, torch.Tensor], abs_of_several: dict[str, torch.Tensor]) -> None:
    """Fold one rank's partial sums (and, where a partial is of several terms, its absolute sums:
    `abs_of_several`) into the running totals, the next rank in order ([Note: Sums by rank]), a
    parameter at a time, consuming them; no absolute sums with `abs_sums` None. An absolute total is
    held from a parameter's second partial on ([Note: An absolute sum of one term is not held]):
    `with_abs_of_one` completes them."""
    for name in list(partial):
        p, several = partial.pop(name), abs_of_several.pop(name, None)
        if abs_sums is not None:
            if name in sums:
                total = abs_sums[name] if name in abs_sums else sums[name].abs()
                abs_sums[name] = _added(total, p, absolute=True) if several is None else _added(total, several)
            elif several is not None:
                abs_sums[name] = several
        sums[name] = _added(sums[name], p) if name in sums else p


def with_abs_of_one(sums: dict[str, torch.Tensor], abs_sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`abs_sums` with |sum| where a sum is of one term and none is held, in the order of `sums`."""
    return {n: abs_sums[n] if n in abs_sums else t.abs() for n, t in sums.items()}


def exact_sums(totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`totals` in float64 (a float32 one, the sum of one term, promoted exactly), in place."""
    for name, t in totals.items():
        if t.dtype != torch.float64:
            totals[name] = t.double()
    return totals


def _kept_up(abs_sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A bound's inputs held until they are read (sum |term| / W until the judge reads it, the
    reordered replays' deviation through the noise's split passes), as float32 rounded up ([Note:
    Bounds kept in float32, rounded up] in harness/reference/tolerance.py), a tensor at a time."""
    for name, a in abs_sums.items():
        if a.dtype == torch.float64:  # a float32 one is exact already (one term's |term|)
            abs_sums[name] = elementwise_in_chunks(lambda x: (round_up_to_float32(x),), a)[0]
    return abs_sums


def _abs_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in float64 (exact promotions, one rounding), a chunk at a time: no model-sized
    temporaries beside the result."""
    return elementwise_in_chunks(lambda x, y: ((x.double() - y.double()).abs_(),), a, b)[0]


def _allowance(reordered: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per gradient tensor, REORDER_FACTOR x the reordered replays' largest deviation."""
    return {n: REORDER_FACTOR * d.amax().cpu() if d.numel() else torch.zeros((), dtype=torch.float64)
            for n, d in reordered.items()}


# [Note: The replay's optimizer by runs of parameters]
# The replay steps the plain optimizer with its float64 means rounded to float32 gradients: a
# model's worth of copies beside the means, alive through the step (64 MiB of rank 0's heap peak
# for GPT-2 d384, memray). The case's optimizers (torch.optim.SGD and AdamW, built with
# foreach=False: cases/case.py) step each parameter on its own, from its own gradient and state
# (the single-tensor loop; the state's step count is per parameter, and a parameter without a
# gradient is skipped untouched). So the replay sets the gradients of a run of parameters of at
# most OPTIMIZER_RUN_ELEMENTS elements (a bigger tensor alone), steps, drops them, and goes on:
# every parameter is stepped once, by the same code on the same values, the same bits as one step
# over all (tests/harness/reference/test_optimizer_runs.py), with one run's copies alive at a time.
# A case that clips needs every gradient at once (the norm is over all of them), and an optimizer
# that is not one of those two, or steps its tensors together (foreach), is stepped whole.
OPTIMIZER_RUN_ELEMENTS = 1 << 20


def _per_parameter(optim: torch.optim.Optimizer) -> bool:
    """Whether `optim` steps each parameter on its own ([Note: The replay's optimizer by runs of
    parameters]): torch's SGD or AdamW, every group without foreach or fused kernels."""
    return (type(optim) in (torch.optim.SGD, torch.optim.AdamW)
            and all(g.get("foreach") is False and not g.get("fused") for g in optim.param_groups))


def _runs_of(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> list[list[str]]:
    """The names of `params` with a gradient in `grads`, in runs of at most OPTIMIZER_RUN_ELEMENTS
    elements (a bigger tensor a run of its own)."""
    runs: list[list[str]] = []
    size = 0
    for name in params:
        if name not in grads:
            continue
        n = params[name].numel()
        if not runs or size + n > OPTIMIZER_RUN_ELEMENTS:
            runs.append([])
            size = 0
        runs[-1].append(name)
        size += n
    return runs


def _harvest_into(uses: dict[str, list[torch.Tensor]], sums: dict[str, torch.Tensor],
                  absolute: dict[str, torch.Tensor] | None) -> Callable[[int], None]:
    """A harvest of each micro-batch's terms (the gradients of every use of each parameter) into
    one rank's partial sums ([Note: Sums by rank]), and the sums of their absolute values into
    `absolute` where a parameter has several terms ([Note: An absolute sum of one term is not held])."""
    def harvest(_: int) -> None:
        for name, leaves in uses.items():
            for leaf in leaves:
                if leaf.grad is None:
                    continue
                g = leaf.grad.detach()
                if name in sums:
                    if absolute is not None:  # from the second term on ([Note: An absolute sum of one term is not held])
                        absolute[name] = _added(absolute[name] if name in absolute else sums[name].abs(), g,
                                                absolute=True)
                    sums[name] = _added(sums[name], g)
                else:  # the term itself (its leaf lets it go below): exact, no copy; its |.| not held
                    sums[name] = g if g.dtype != torch.float64 else g.clone()  # added to in place
                leaf.grad = None
    return harvest


# [Note: Each rank's term replayed on it]
# The replay of a W-rank split step computes every rank's local term (harness/run/worker.py runs it
# on the cell's rank 0, beside the judge): W forward and backward passes on one rank while the
# others wait for its judge. A rank of the cell holds what its own term needs (the cell's full
# parameters and buffers before the step, the batch), so a judged cell's rank r >= 1 builds a
# replay model too, computes its term with the same code (`Shadow.rank_term`: the pass `_terms`
# makes for rank r, from the same values, in a process of the same settings: the same bits) and
# sends it; rank 0 folds it in rank order as if it had computed it, receiving it a parameter at a
# time as it folds (`RankTerm.fold_into`; harness/run/worker.py `ReceivedTerm`). Sent: the partial
# sum of each parameter's terms (one float32 term as it is), and the absolute sum only where it is
# not the partial's |.| (several micro-batches or uses; |x| is exact). Reordered replays (a judge's
# `reorder_later`) are still computed on rank 0, from every rank's pass. So that rank 1, which also
# trains the lock-step reference and compares the cell with it, does not become the rank everyone
# waits for, it steps that reference after the step's evidence is gathered, while rank 0 judges,
# and rank 0's judge asks for the comparison only once the replay's checks are done (it is needed
# by the trajectory check alone: harness/judge/diff.py `CellJudge.step`).
@dataclass
class RankTerm:
    """One rank's local loss and partial sums of a replayed step ([Note: Each rank's term replayed on it])."""

    loss: torch.Tensor
    sums: dict[str, torch.Tensor]
    # sum |term| where a partial is of several terms; else |sums[name]|, not held
    abs_of_several: dict[str, torch.Tensor]

    def parts(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
        """Each parameter's partial sum and its absolute sum where that is not |sum| (else None),
        in the order of `sums`; each let go once read."""
        for name in list(self.sums):
            yield name, self.sums.pop(name), self.abs_of_several.pop(name, None)

    def fold_into(self, sums: dict[str, torch.Tensor], abs_sums: dict[str, torch.Tensor] | None) -> None:
        """Fold this rank's partials into the running totals (`fold_rank`), a parameter at a time,
        so that one parameter's are held at once (a received term arrives so: harness/run/worker.py
        `TermFeed`); the term is consumed."""
        for name, partial, several in self.parts():
            fold_rank(sums, abs_sums, {name: partial}, {} if several is None else {name: several})


# [Note: The finest split served]
# The noise's reduction part is sized from the absolute values of a split's terms (docs/error_model.md,
# "Trajectories"). Every sample its own term bounds every split of the batch: a term of any split is
# a sum of per-sample gradients, so sum |term| over a split's terms is at most sum |g_b| (the
# triangle inequality), and a fold of W x M <= B terms makes fewer roundings than one of B. The same
# argument holds for any split whose terms every served cell's terms are unions of: the split of
# the largest world size served, W_max ranks of M micro-batches, when every served world size
# divides W_max (a rank's rows are contiguous, so a W-rank cell's micro-batch is a union of W_max / W
# of its blocks, and so is an identical-data micro-batch). Its pass is one backward per term where
# the per-sample pass is one per sample: for a GPT-2 of 124M parameters at W = 2, 2 backward passes
# of 4 sequences instead of 8 of one, about 40 s of the reference cell's 150 on this VM. Where the
# served sizes do not nest (2 and 3), or W_max x M is the batch itself, the per-sample split is the
# finest, as before.


def finest_split(num_samples: int, world_sizes: Sequence[int], num_micro: int) -> tuple[int, int]:
    """(world size, micro-batches) of the finest split a reference serving `world_sizes` must bound
    ([Note: The finest split served]): (W_max, M) where every served size divides W_max and the
    batch splits into W_max x M terms of more than one sample, else (B, 1), every sample its own term."""
    largest = max(world_sizes)
    terms = largest * num_micro
    if terms < num_samples and num_samples % terms == 0 and all(largest % w == 0 for w in world_sizes):
        return largest, num_micro
    return num_samples, 1


class Shadow:
    """The plain model and optimizer, stepped each step from the cell's own previous parameters."""

    def __init__(self, case: Case, spec: OptimizerSpec, init_state: dict[str, torch.Tensor],
                 device: torch.device = torch.device("cpu"), num_micro: int | None = None,
                 init_buffers: dict[str, torch.Tensor] | None = None,
                 record_device: torch.device = torch.device("cpu"), world_sizes: Sequence[int] = ()) -> None:
        self.case = case
        # The world sizes of the cells this shadow's noise must cover (`_amplitude`): the noise is
        # not measured without them (the case's declared sizes, to 1024 in the catalog, would make
        # it far looser than the cells judged need).
        self.world_sizes = tuple(world_sizes)
        features = case.features
        plain = replay_model(case, init_state, init_buffers, device)
        self.params = dict(plain.named_parameters())
        self.plain = plain
        # Tied parameters: every use beyond the first, by name. Their gradient is a sum over uses
        # that an implementation may associate differently (across micro-batches, say), so each
        # use is a term of its own (see _untied).
        first: dict[int, str] = {}
        self.aliases: dict[str, list[str]] = {}
        for name, p in plain.named_parameters(remove_duplicate=False):
            if id(p) in first:
                self.aliases.setdefault(first[id(p)], []).append(name)
            else:
                first[id(p)] = name
        # Mixed precision: the shadow computes the way the policy does (harness/adapters/features.py).
        self.model = CastCompute(plain, features.compute_dtype) if features.mixed_precision else plain
        self.optim = spec.build_grouped(((name,), p) for name, p in self.params.items())
        self.scheduler = spec.build_scheduler(self.optim)
        self.clip = (features.clip_max_norm, features.clip_norm_type) if features.clip_norm_type else None
        self.num_micro = features.grad_accum if num_micro is None else num_micro
        self.device = device
        # Where its records go: the CPU for a snapshot; the device itself for a judge that
        # computes there ([Note: Judged on the evidence's device], harness/run/judged.py).
        self.record_device = record_device
        self._reorder_seed = 0  # the step's seed of the reordered replays (reproducible verdicts)

    def _terms(self, batch: Batch, data_mode: str, world_size: int, num_micro: int, reorder: bool = True,
               absolute: bool = True, given: Callable[[int], RankTerm | None] | None = None):
        """Every rank's local loss, the float64 sum and absolute sum of the local gradient terms (one
        per rank and micro-batch), and the largest deviation of the reordered replays from that sum
        ([Note: Reordered accumulation]; empty when `reorder` is off); sums divided by W under split.
        `given(rank)`, where it returns one, is that rank's term computed on the rank itself
        ([Note: Each rank's term replayed on it]), folded in its turn instead of computed here."""
        ranks = range(1) if data_mode == "identical" else range(world_size)
        grad_sum: dict[str, torch.Tensor] = {}
        abs_sum: dict[str, torch.Tensor] = {}
        uses = self._untie()
        losses = []
        draws: list[dict[str, torch.Tensor]] = [{} for _ in range(REORDER_DRAWS if reorder else 0)]
        # Each rank's forward starts from the buffers as they were before the step (a rank updates
        # its own running statistics); rank 0's are what the model holds afterwards.
        before = {n: b.detach().clone() for n, b in self.buffers.items()} if len(ranks) > 1 else {}
        after_rank0: dict[str, torch.Tensor] = {}
        try:
            for rank in ranks:
                term = None if given is None or draws else given(rank)
                if term is not None:
                    losses.append(term.loss)
                    term.fold_into(grad_sum, abs_sum if absolute else None)
                    continue
                if rank > 0:
                    self._set_buffers(before)
                partials: list[dict[str, torch.Tensor]] = [{} for _ in draws]
                loss, partial, partial_abs = self._rank_pass(uses, batch, data_mode, world_size, rank, num_micro,
                                                             absolute, partials)
                losses.append(loss)
                fold_rank(grad_sum, abs_sum if absolute else None, partial, partial_abs or {})
                for d, p in zip(draws, partials):
                    fold_partial(d, p)
                del partial, partial_abs, partials
                if rank == 0 and before:
                    after_rank0 = {n: b.detach().clone() for n, b in self.buffers.items()}
        finally:
            self._retie()
        if after_rank0:
            self._set_buffers(after_rank0)
        deviation = {}
        for name, exact in grad_sum.items():
            for d in draws:  # the largest over the draws, one draw at a time (NaN kept, as amax keeps it)
                if name in d:
                    # in float64: exact promotions, one rounding; a chunk at a time (no model-sized temporaries)
                    dev = _abs_difference(d.pop(name), exact)
                    deviation[name] = dev if name not in deviation else torch.maximum(deviation[name], dev,
                                                                                      out=deviation[name])
        if absolute:
            abs_sum = with_abs_of_one(grad_sum, abs_sum)
        if data_mode == "identical":
            # Every rank computed this same local term: their mean is it, sum |term| / W is |it|. A
            # sum of one float32 term is returned as that float32 tensor (the same value as its
            # float64 copy, half the memory).
            return torch.stack(losses * world_size), grad_sum, _kept_up(abs_sum), deviation
        for sums in (grad_sum, abs_sum, deviation):  # in place: this function's own float64 sums
            for t in exact_sums(sums).values():
                t.div_(world_size)
        return torch.stack(losses), grad_sum, _kept_up(abs_sum), deviation

    def _rank_pass(self, uses: dict[str, list[torch.Tensor]], batch: Batch, data_mode: str, world_size: int,
                   rank: int, num_micro: int, absolute: bool, draws: list[dict[str, torch.Tensor]]
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """One rank's forward and backward on its local batch from the model's parameters and
        buffers now: its loss, its partial sum of terms ([Note: Sums by rank]) and, with `absolute`,
        the absolute sum where a parameter has several terms ([Note: An absolute sum of one term is
        not held]; None without), and with `draws` each draw's reordered partial added to it."""
        inputs, targets = map_tensors(lambda t: t.to(self.device), local_batch(batch, data_mode, rank, world_size))
        for leaves in uses.values():
            for leaf in leaves:
                leaf.grad = None
        partial: dict[str, torch.Tensor] = {}
        partial_abs: dict[str, torch.Tensor] | None = {} if absolute else None
        exact = _harvest_into(uses, partial, partial_abs)
        # with draws, the reordered replays backward through the same forward, after the exact terms
        loss = forward_backward(self.model, self.case.loss_fn, inputs, targets, num_micro,
                                after_micro=None if draws else exact,
                                backward=self._reordered(uses, exact, draws, rank) if draws else None)
        return loss, partial, partial_abs

    def rank_term(self, params_before: dict[str, torch.Tensor], batch: Batch, data_mode: str, world_size: int,
                  rank: int, buffers_before: dict[str, torch.Tensor] | None = None) -> RankTerm:
        """Rank `rank`'s term of a `step` with these arguments, computed here as that step computes
        it (the same pass from the same parameters and buffers: the same bits), for the rank
        replaying the step ([Note: Each rank's term replayed on it])."""
        self._load(params_before, buffers_before)
        uses = self._untie()
        try:
            loss, partial, partial_abs = self._rank_pass(uses, batch, data_mode, world_size, rank, self.num_micro,
                                                         True, [])
        finally:
            self._retie()
        return RankTerm(loss.detach(), partial, partial_abs)  # absolute sums of several terms only

    def _reordered(self, uses: dict[str, list[torch.Tensor]], exact: Callable[[int], None], draws: list[dict],
                   rank: int) -> Callable[[torch.Tensor, int], None]:
        """The backward of one rank's micro-batch that harvests its exact terms (`exact`), then
        adds to each of `draws` its terms under perturbed accumulation ([Note: Reordered
        accumulation]): one forward per micro-batch, its graph kept for one backward per draw
        after the exact one. The forward is the one the exact terms came from, so the draws
        perturb the same values a second forward would compute, without computing them again."""
        u = unit_roundoff(self.case.features.compute_dtype)
        state: dict = {}

        def backward(loss: torch.Tensor, i: int) -> None:
            loss.backward(retain_graph=True)
            exact(i)
            handles = _jitter_hooks(loss, u, state)
            try:
                for d, sums in enumerate(draws):
                    state["generator"] = torch.Generator().manual_seed(
                        (self._reorder_seed * 1_000_003 + rank * 1009 + i * 31 + d) % (2 ** 63))
                    loss.backward(retain_graph=d < len(draws) - 1)
                    _harvest_into(uses, sums, None)(i)
            finally:
                state.clear()
                for h in handles:
                    h.remove()
        return backward

    def _load(self, params_before: dict[str, torch.Tensor],
              buffers_before: dict[str, torch.Tensor] | None = None) -> None:
        """The plain model's parameters (and buffers, when given) set to these values, in place."""
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(params_before[name])
        if buffers_before is not None:
            self._set_buffers(buffers_before)

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The plain model's buffers now (read afresh: a forward may assign a new tensor to one)."""
        return dict(self.plain.named_buffers())

    def _set_buffers(self, values: dict[str, torch.Tensor]) -> None:
        missing = sorted(set(self.buffers) - set(values))
        if missing:
            raise ValueError(f"buffers {missing[:4]} of the plain model are missing from the cell's buffers")
        with torch.no_grad():
            for name, b in self.buffers.items():
                b.copy_(values[name])  # in place: a buffer the forward reassigned is the module's now

    def _untie(self) -> dict[str, list[torch.Tensor]]:
        """Give every extra use of a tied parameter a leaf of its own (same values, so the same
        forward bits); returns each parameter name's leaves, its own first."""
        uses = {name: [p] for name, p in self.params.items()}
        for name, aliases in self.aliases.items():
            for alias in aliases:
                path, _, attr = alias.rpartition(".")
                module = self.plain.get_submodule(path)
                leaf = nn.Parameter(self.params[name].detach().clone(), requires_grad=self.params[name].requires_grad)
                setattr(module, attr, leaf)
                uses[name].append(leaf)
        return uses

    def _retie(self) -> None:
        for name, aliases in self.aliases.items():
            for alias in aliases:
                path, _, attr = alias.rpartition(".")
                setattr(self.plain.get_submodule(path), attr, self.params[name])

    def num_terms(self, world_size: int) -> dict[str, int]:
        """Local gradient terms per parameter: ranks x micro-batches x uses."""
        return {name: world_size * self.num_micro * (1 + len(self.aliases.get(name, ())))
                for name in self.params}

    def step(self, params_before: dict[str, torch.Tensor], batch: Batch, data_mode: str, world_size: int,
             buffers_before: dict[str, torch.Tensor] | None = None, reorder: bool = True,
             clip_norm: float | None = None, borrow: bool = False,
             given: Callable[[int], RankTerm | None] | None = None) -> dict:
        """One step replayed from the cell's parameters (and buffers, when given; else the shadow's
        own) before it; "buffers" in the result are rank 0's after its forward passes.

        With `borrow` the record's parameters and optimizer state are the shadow's own tensors,
        and "reorder_later" holds `params_before` itself: a record valid until the next step (or
        `params_before` changes), for a judge that takes each step before the next is replayed
        (harness/run/judged.py), instead of copies of the model kept for a snapshot.

        With `reorder` off the reordered replays are not run: "reorder" is empty and
        "reorder_later" computes it when a judge needs it (`reorder_allowance`). With `clip_norm`
        (the norm the cell's clipping computed, finite) the step clips with the coefficient that
        norm gives, as the cell did ([Note: Clipping judged with the cell's norm], judge/diff.py).
        `given(rank)` is rank `rank`'s term where that rank computed it ([Note: Each rank's term
        replayed on it]); None: computed here."""
        self._load(params_before, buffers_before)
        self._reorder_seed += 1
        seed = self._reorder_seed
        losses, grads, abs_grads, reordered = self._terms(batch, data_mode, world_size, self.num_micro, reorder,
                                                          given=given)
        buffers = {n: b.detach().to(self.record_device).clone() for n, b in self.buffers.items()}
        hyper = self._optimizer_step(grads, clip_norm)
        out = {
            "loss": losses.detach().to(self.record_device),
            "grads": {n: g.to(self.record_device) for n, g in grads.items()},
            "abs_grads": {n: a.to(self.record_device) for n, a in abs_grads.items()},
            "num_terms": {n: k for n, k in self.num_terms(world_size).items() if n in grads},
            # Per gradient tensor, the allowance for a reordered accumulation of the local backward.
            "reorder": _allowance(reordered),
            "params": {n: self._recorded(p, borrow) for n, p in self.params.items()},
            "buffers": buffers,
            "hyper": hyper,
            "state": {
                n: {k: self._recorded(v, borrow) for k, v in self.optim.state[p].items() if isinstance(v, torch.Tensor)}
                for n, p in self.params.items()
            },
        }
        if not reorder:
            before = {n: t.detach() if borrow else t.detach().clone() for n, t in params_before.items()}
            buffers = None if buffers_before is None else {n: b.detach().clone() for n, b in buffers_before.items()}
            out["reorder_later"] = lambda: self.reorder_allowance(before, batch, data_mode, world_size, buffers, seed)
        return out

    def _recorded(self, t: torch.Tensor, borrow: bool) -> torch.Tensor:
        """`t` as a record holds it: a copy on the record's device, or `t` itself when borrowed there."""
        t = t.detach()
        out = t.to(self.record_device)
        return out if borrow and out is t else out.clone() if out is t else out

    def _optimizer_step(self, grads: dict[str, torch.Tensor], clip_norm: float | None) -> dict[str, dict]:
        """Step the plain optimizer (and scheduler) with `grads` rounded to the parameter dtype,
        clipped as the case clips (with the cell's norm, when given and finite); returns the
        hyperparameters the step used. Without clipping, a run of parameters at a time
        ([Note: The replay's optimizer by runs of parameters])."""
        hyper = self.hyperparameters()  # this step's, before the scheduler moves the learning rate
        for p in self.params.values():
            p.grad = None  # a step reads no other gradient (the backward passes may have left some)
        by_runs = self.clip is None and _per_parameter(self.optim)
        for run in _runs_of(self.params, grads) if by_runs else [[n for n in self.params if n in grads]]:
            for name in run:
                # a copy: clipping scales it in place, and a float32 mean is the record's own tensor
                self.params[name].grad = grads[name].to(self.params[name].dtype, copy=True)
            if self.clip is not None and clip_norm is not None and math.isfinite(clip_norm):
                grads_now = [self.params[name].grad for name in run]
                if grads_now:
                    coef = clip_coefficient(clip_norm, self.clip[0], grads_now[0].dtype)
                    torch._foreach_mul_(grads_now, coef.to(grads_now[0].device))
            elif self.clip is not None:
                torch.nn.utils.clip_grad_norm_(list(self.params.values()), *self.clip)
            self.optim.step()
            for name in run:
                self.params[name].grad = None  # stepped: the copies go before the next run's are made
        if self.scheduler is not None:
            self.scheduler.step()
        return hyper

    def perturbed_step(self, params_before: dict[str, torch.Tensor], batch: Batch,
                       noise: dict[str, torch.Tensor], subtract: bool = False,
                       borrow: bool = False) -> dict[str, torch.Tensor]:
        """One step of a perturbed reference run (harness/run/worker.py PerturbedRuns): the whole
        batch's exact gradient at `params_before` plus `noise` (float64 per gradient: a sign times
        `noise_amplitude`; minus it with `subtract`, the antithetic run), clipped as the case clips
        and stepped; returns the parameters after it."""
        self._load(params_before)
        _, grads, _, _ = self._terms(batch, "identical", 1, self.num_micro, reorder=False, absolute=False)
        for name, g in grads.items():
            if name in noise:
                grads[name] = g - noise[name].to(g.device) if subtract else g + noise[name].to(g.device)
        self._optimizer_step(grads, None)
        return {n: self._recorded(p, borrow) for n, p in self.params.items()}

    def reorder_allowance(self, params_before: dict[str, torch.Tensor], batch: Batch, data_mode: str, world_size: int,
                          buffers_before: dict[str, torch.Tensor] | None, seed: int) -> dict[str, torch.Tensor]:
        """The "reorder" of a `step(..., reorder=False)` taken with these arguments: the same
        replays from the same state and seed, so the same bits. It leaves the plain model's
        parameters and buffers at that step's (the next `step` sets them from its own arguments)."""
        self._load(params_before, buffers_before)
        current, self._reorder_seed = self._reorder_seed, seed
        try:
            return _allowance(self._terms(batch, data_mode, world_size, self.num_micro)[3])
        finally:
            self._reorder_seed = current

    def hyperparameters(self) -> dict[str, dict]:
        """Per parameter name, the hyperparameters of its optimizer group now (the error model's
        inputs: a scheduler changes lr from step to step, groups differ from each other)."""
        group_of = {id(p): g for g in self.optim.param_groups for p in g["params"]}
        return {name: {k: group_of[id(p)][k] for k in GROUP_HYPERPARAMETERS if k in group_of[id(p)]}
                for name, p in self.params.items()}

    def noise_amplitude(self, params_before: dict[str, torch.Tensor], batch: Batch) -> dict[str, torch.Tensor]:
        """Per gradient (float64), the amplitude of a perturbed reference run's noise at this step,
        measured at `params_before` (the reference's parameters before the step): the size of the
        largest honest reduction error of every split of this batch a served cell computes (the
        finest split served bounds them all: [Note: The finest split served]) and of identical data
        at the largest W served (K = W x M),
        plus the measured difference between the whole-batch
        gradient and the mean of the per-sample ones and of every split a cell computes (the local
        computation on another batch size), plus the reordering allowance (docs/error_model.md,
        "Trajectories"). Every perturbed run of the step adds a random sign times it."""
        self._load(params_before)
        self._reorder_seed += 1
        _, grads, _, reordered = self._terms(batch, "identical", 1, self.num_micro, absolute=False)
        # held through the split passes below: as float32 rounded up, an upper bound of half the
        # memory ([Note: Bounds kept in float32, rounded up] in harness/reference/tolerance.py)
        reordered = _kept_up(reordered)
        buffers = {n: b.detach().clone() for n, b in self.buffers.items()}
        try:
            return self._amplitude(grads, batch, reordered)
        finally:
            self._set_buffers(buffers)  # the per-sample passes moved them

    def _amplitude(self, grads: dict[str, torch.Tensor], batch: Batch,
                   reordered: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """(bound of the per-sample reduction + the largest local-shape difference) + the reordering
        allowance, per gradient. Consumes `grads` and `reordered`; every intermediate is folded
        into one tensor per gradient as soon as it is measured (the split means into one float64
        maximum; the finest split's sum |term| / W kept as the replay keeps it, float32 rounded up, and
        turned into its bound at the end), so the passes hold about three and a half model-sized
        float64 dicts at a time, not six."""
        num_samples = batch_size(batch)
        features = self.case.features
        precision = ReductionModel.for_cell(1, self.num_micro, features.compute_dtype,
                                            DTYPES[features.reduce_dtype] if features.reduce_dtype else None)
        # The reference computes its local forward/backward on another batch size than a cell's
        # ranks, so beyond the reduction their gradients differ by the compute dtype's rounding.
        u = max(precision.u, unit_roundoff(features.compute_dtype))
        # The finest split served (at the finest, every sample its own term) bounds every served
        # split of the batch ([Note: The finest split served]). Identical data is no split: each of
        # a cell's W x M terms is a gradient of the whole batch (or of a micro-batch of it), whose
        # mean |term| is at most the finest split's mean |term|, and the honest fold of W x M of
        # them makes W x M - 1 roundings, more than K = B allows once W x M > B (a W = 256 cell of
        # a batch of 8).
        if not self.world_sizes:
            raise ValueError("Shadow: the noise's amplitude needs the world sizes of the cells it covers "
                             "(world_sizes=...); none were given")
        identical_terms = max(self.world_sizes) * self.num_micro if "identical" in self.case.data_modes else 0
        finest = finest_split(num_samples, self.world_sizes, self.num_micro)
        model = ReductionModel(max(finest[0] * finest[1], identical_terms), u, precision.casts,
                               max(precision.eta, underflow_error(features.compute_dtype)))
        # Per gradient, what the reduction bound is computed from at the end: sum |term| / K of the
        # per-sample terms (float32, rounded up), or |g| itself; kept instead of the float64 bound.
        bound_of: dict[str, torch.Tensor] = {}
        shape: dict[str, torch.Tensor] = {}  # the largest |whole-batch gradient - a split's mean| so far
        if "split" in self.case.data_modes:
            # The finest split's terms ([Note: The finest split served]): their sum |term| / K bounds
            # every served split's, and their mean is one more local computation to cover.
            _, finest_mean, bound_of, _ = self._terms(batch, "split", *finest, reorder=False)
            for name, g in grads.items():
                # A sample's gradient is itself a sum over its rows (a sequence's tokens), which a
                # batched backward sums in another order than a per-sample one; where those rows
                # cancel (an attention key bias, whose exact gradient is zero) this difference
                # dwarfs the reduction bound of the per-sample terms.
                shape[name] = _abs_difference(g, finest_mean.pop(name))
            # The local computation on each batch size a cell of this case runs (B / W samples per
            # rank, in M micro-batches) differs from the whole batch's in its own bits: the noise
            # covers each, so a cell's step-1 deviation is never larger than the noise's amplitude.
            for w in sorted(set(self.world_sizes) - {1, finest[0]}):
                if num_samples % (w * self.num_micro) == 0 and w * self.num_micro < num_samples:
                    _, split_mean, _, _ = self._terms(batch, "split", w, self.num_micro, reorder=False, absolute=False)
                    for n, g in grads.items():
                        if n in split_mean:  # the max is exact: its order is free
                            shape[n] = torch.maximum(_abs_difference(g, split_mean.pop(n)), shape[n], out=shape[n])
                    del split_mean
        else:
            # Identical data only (a model coupling its samples, as BatchNorm does, where a sample
            # alone is no term of the batch's gradient): every rank computes the whole batch, so
            # the honest error is the reduction of equal terms (bounded as K of them, above).
            for name, g in grads.items():
                bound_of[name] = g.abs()
                shape[name] = (g - g).abs()  # the whole batch is its own mean (NaN where g is not finite)
        amplitudes = {}
        for name in list(grads):
            del grads[name]
            amplitudes[name] = elementwise_in_chunks(
                lambda b, s, r: (model.grad_bound(b) + s + (0 if r is None else r),),
                bound_of.pop(name), shape.pop(name), reordered.pop(name, None))[0].cpu()
        return amplitudes
