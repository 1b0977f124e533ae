"""One fuzz example end to end: request the pool, rebuild full tensors from the ranks' raw shards,
step the single-process shadow reference, and judge with the harness's own checks.

The snapshot assembled here has the format of `harness.run.snapshot` (minus the trajectory
reference), so `harness.judge.diff.check_snapshot` applies the same error model, padding and
rank-agreement checks to a drawn model as to a catalog case.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from harness.adapters.ours import Ours
from harness.adapters.registry import resolve_impl
from harness.judge.diff import check_snapshot
from harness.judge.result import Judgement, Verdict
from harness.judge.layouts import assemble_flat, same_bits
from harness.fuzz.pool import ExampleError, RankPool
from harness.fuzz.spec import ModelSpec, as_case, init_state
from harness.run.plan import Cell
from harness.run.snapshot import Buffers, Snapshot, StepRecord
from harness.reference.shadow import Shadow


@dataclass
class ExampleResult(Judgement):
    """The judgement of one drawn model's run (error: a rank raised, died or hung)."""

    spec: ModelSpec
    faults: tuple[str, ...]
    refused: str | None = None  # the implementation refused the model with a clear ValueError at wrap
    rank_s: float = 0.0  # the slowest rank's time on the example (training and snapshots)
    ranks_cpu_s: float = 0.0  # the CPU time of every rank on the example, summed (all their threads)
    aligned_numels: dict[str, int] = field(default_factory=dict)  # flat key -> numel the sharding divides

    @property
    def ok(self) -> bool:
        """Judged and passed: an example that errored or that the implementation refused is not."""
        return self.verdict is Verdict.PASS and self.refused is None

    def summary(self) -> str:
        if self.error is not None:
            return "error: " + self.error.strip().splitlines()[-1]
        first = self.first_divergence
        return "pass" if first is None else first.describe("fuzz")


def _full(stacked: dict[str, torch.Tensor], name_layouts: dict, sizes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """{key: (W, shard_numel)} raw shards -> full tensors under the plain model's names, sliced at
    the offsets the impl reported (its padded buffer is the shards concatenated in rank order)."""
    out = {}
    for name, layout in name_layouts.items():
        rows = stacked.get(layout["flat_key"])
        if rows is not None and name in sizes:
            out[name] = assemble_flat(layout, rows, sizes[name]).clone()
    return out


class _Reference:
    """The shadow of one example, built while the ranks train it.

    The shadow steps from the ranks' own previous parameters, so only its first step can run
    before the replies: it is computed from the reference initial state (`start`) and kept when
    the ranks' initial parameters are that state bit for bit; otherwise it is recomputed from
    theirs, as every later step is. The verdict is the same either way."""

    def __init__(self, spec: ModelSpec, init: dict[str, torch.Tensor]) -> None:
        self.spec = spec
        self.init = init
        self.case = as_case(spec)
        self.shadow = self._new_shadow()
        self.sizes = {n: p.shape for n, p in self.shadow.params.items()}  # the plain model's parameters
        self._first: dict | None = None

    def _new_shadow(self) -> Shadow:
        return Shadow(self.case, self.spec.optimizer, self.init, num_micro=self.spec.accumulation)

    def start(self) -> None:
        self._first = self._step(0, self.init)

    def step(self, t: int, params_before: dict[str, torch.Tensor]) -> dict:
        """The shadow of step t + 1 from the ranks' parameters after step t (their init at t = 0)."""
        first, self._first = self._first, None
        if t == 0 and first is not None:
            if all(n in params_before and same_bits(params_before[n], self.init[n]) for n in self.sizes):
                return first
            self.shadow = self._new_shadow()  # the first step moved its optimizer state
        return self._step(t, params_before)

    def _step(self, t: int, params_before: dict[str, torch.Tensor]) -> dict:
        batch = self.case.make_batch(self.case.seed, t + 1, self.case.global_batch)
        return self.shadow.step(params_before, batch, self.spec.data_mode, self.spec.world_size)


def _no_buffers(reference: _Reference, world_size: int) -> Buffers:
    """The buffers evidence of a drawn model, which has none (harness/fuzz/spec.py builds only
    parameters); a model with buffers would need the ranks to report them."""
    if reference.shadow.buffers:
        raise ValueError(f"drawn model has buffers {sorted(reference.shadow.buffers)[:4]}: the fuzz worker does not "
                         f"report buffers")
    return Buffers.none(world_size)


def _replicas(replies: list[dict], t: int) -> dict:
    """Step t's replicas evidence: every rank's digests of its own full parameters and gradients
    (rank 0's tensors are the ones judged; the other ranks' must be the same bits)."""
    names = replies[0]["replicas"][t]["names"]
    for rank, reply in enumerate(replies):
        if reply["replicas"][t]["names"] != names:
            raise ValueError(f"step {t + 1}: rank {rank}'s full tensors are {reply['replicas'][t]['names'][:4]}..., "
                             f"rank 0's {names[:4]}...")
    return {"names": names, "digests": torch.tensor([r["replicas"][t]["digests"] for r in replies], dtype=torch.long)}


def assemble_full_snapshot(spec: ModelSpec, impl: str, replies: list[dict], init: dict[str, torch.Tensor],
                           reference: _Reference | None = None) -> dict:
    """The snapshot of an adapter's run from rank 0's full tensors and every rank's digests of its
    own (no raw shards, no layouts)."""
    reference = reference or _Reference(spec, init)
    buffers = _no_buffers(reference, spec.world_size)
    adapter = resolve_impl(impl)
    # The gradients of the plain model's trainable parameters, as the matrix worker picks them: a
    # frozen parameter has none (torch FSDP1's summon_full_params(with_grads=True) hands one a
    # zero view of its flat gradient); a frozen parameter the optimizer moved fails the param check.
    trainable = {n for n, p in reference.shadow.params.items() if p.requires_grad}
    steps, params_before, rank0 = [], replies[0]["init"], replies[0]
    for t in range(spec.steps):
        grads = {n: g for n, g in rank0["grads"][t].items() if n in trainable}
        steps.append(StepRecord(t + 1, torch.stack([r["loss"][t] for r in replies]), grads,
                                rank0["data"][t], buffers, reference.step(t, params_before),
                                replicas=_replicas(replies, t)))
        params_before = rank0["data"][t]
    cell = Cell("fuzz", impl, spec.world_size, spec.data_mode, spec.steps, impl_name=adapter.name)
    return Snapshot(cell.to_json(), spec.optimizer.kind, spec.world_size, {},
                    {"params": adapter.param_padding.value, "grads": adapter.grad_padding.value},
                    rank0["init"], buffers, steps).to_dict()


def assemble_snapshot(spec: ModelSpec, faults: tuple[str, ...], replies: list[dict],
                      init: dict[str, torch.Tensor], reference: _Reference | None = None) -> dict:
    reference = reference or _Reference(spec, init)
    buffers = _no_buffers(reference, spec.world_size)
    rank_layouts = [json.loads(r["layouts"]) for r in replies]
    name_layouts = rank_layouts[0]["names"]

    def stack(per_rank: list[dict]) -> dict[str, torch.Tensor]:
        return {key: torch.stack([r[key] for r in per_rank]) for key in per_rank[0]}

    def full(stacked: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return _full(stacked, name_layouts, reference.sizes)

    # Each rank's own padding intervals: a rank with a wrong layout shows up in the padding check.
    padding_intervals = {key: [lay["padding_intervals"][key] for lay in rank_layouts]
                         for key in rank_layouts[0]["padding_intervals"]}

    init_params = full(stack([r["init"] for r in replies]))
    steps, params_before = [], init_params
    for t in range(spec.steps):
        shards = stack([r["data"][t] for r in replies])
        shard_grads = stack([r["grads"][t] for r in replies]) if replies[0]["grads"][t] else {}
        params = full(shards)
        # Full tensors are assembled from one set of shards here: no replicas to compare.
        steps.append(StepRecord(t + 1, torch.stack([r["loss"][t] for r in replies]), full(shard_grads), params,
                                buffers, reference.step(t, params_before), shards, shard_grads, padding_intervals))
        params_before = params
    cell = Cell("fuzz", "ours", spec.world_size, spec.data_mode, spec.steps, faults=tuple(sorted(faults)))
    return Snapshot(cell.to_json(), spec.optimizer.kind, spec.world_size, name_layouts,
                    {"params": Ours.param_padding.value, "grads": Ours.grad_padding.value},
                    init_params, buffers, steps).to_dict()


@dataclass
class Submitted:
    """An example the ranks are training (`start_example`); `finish_example` judges it."""

    pool: RankPool
    spec: ModelSpec
    faults: tuple[str, ...]
    impl: str
    init: dict[str, torch.Tensor]
    ticket: object = None  # the pool's handle on the request
    error: str | None = None  # the request never reached the ranks (a pool that could not start)


def start_example(pool: RankPool, spec: ModelSpec, faults: tuple[str, ...] = (), impl: str = "ours") -> Submitted:
    """Hand the example to the pool and return while its ranks train."""
    init = init_state(spec)
    try:
        ticket = pool.submit({"spec": spec.to_json(), "faults": list(faults), "init": init, "impl": impl})
    except ExampleError as e:
        return Submitted(pool, spec, faults, impl, init, error=str(e))
    return Submitted(pool, spec, faults, impl, init, ticket)


def run_example(pool: RankPool, spec: ModelSpec, faults: tuple[str, ...] = (), impl: str = "ours") -> ExampleResult:
    return finish_example(start_example(pool, spec, faults, impl))


def finish_example(submitted: Submitted) -> ExampleResult:
    """The reference (built here while the ranks train), the ranks' replies and the judgement."""
    pool, spec, faults, impl, init = submitted.pool, submitted.spec, submitted.faults, submitted.impl, submitted.init
    if submitted.error is not None:
        return ExampleResult(spec, faults, error=submitted.error)
    try:
        reference = _Reference(spec, init)
        reference.start()
        replies = pool.collect(submitted.ticket)
    except ExampleError as e:
        return ExampleResult(spec, faults, error=str(e))
    refusals = {r["refused"] for r in replies if "refused" in r}
    if refusals:
        if len(refusals) != 1 or any("refused" not in r for r in replies):
            return ExampleResult(spec, faults, error=f"ranks disagree on refusing the model: {sorted(refusals)}")
        return ExampleResult(spec, faults, refused=refusals.pop())
    try:
        if replies[0].get("full"):
            snap = assemble_full_snapshot(spec, impl, replies, init, reference)
        else:
            snap = assemble_snapshot(spec, faults, replies, init, reference)
        names = snap["init"]["params"]
        result = check_snapshot(snap, {n: init[n] for n in names}, None, case=reference.case)
    except ValueError as e:  # evidence that contradicts itself (ReferenceDiverged included): no verdict
        return ExampleResult(spec, faults, error=f"the checks raised (no verdict): {type(e).__name__}: {e}")
    missing = sorted(set(reference.sizes) - set(names))
    out = ExampleResult(spec, faults, violations=result.violations, margins=result.margins, checks=result.checks,
                        rank_s=max(float(r.get("rank_s", 0.0)) for r in replies),
                        ranks_cpu_s=sum(float(r.get("rank_cpu_s", 0.0)) for r in replies),
                        aligned_numels={lay["flat_key"]: lay["aligned_numel"] for lay in snap["layouts"].values()})
    if missing:  # a parameter the shards never mention is evidence lost, not a pass
        out.error = f"parameters missing from every rank's shards: {missing}"
    return out
