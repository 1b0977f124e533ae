"""The batched judge ([Note: Batched checks], harness/judge/segments.py) returns what the judge
returned one tensor at a time (tests/support/judge_reference.py): the same violations in the same order
(element, ratio, num_violating), margins, check summaries, per-step worst elements, losses and
trajectory statistics, or the same exception (fast tier, one process), with its segmented reductions
batched and per tensor.

Evidence: real W = 1 runs through impl=ours of catalog cases that between them have padding,
frozen parameters, tied parameters, clipping (2-norm and inf-norm) and bf16 parameters, under both
optimizers; then values planted at random (NaN, +-inf, -0.0, one-ulp and larger shifts, whole
tensors scaled or shifted, zeroed, non-zero padding, replica digests that differ, empty tensors),
each judged with and without the reference.
"""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

import tests.support.judge_reference as judge_reference
from cases.catalog import get_case
from harness.adapters import RankContext
from harness.judge.diff import check_snapshot
from harness.judge import segments
from harness.judge.segments import Segments, judge_segments
from harness.run.orchestrate import write_init_states
from harness.run.plan import build_plan
from harness.run.snapshot import load_init
from harness.run.worker import run_cell

CASES = (("mlp", "sgd"), ("frozen_params", "adamw"), ("tied_embeddings", "sgd"), ("clip_grad_norm", "adamw"),
         ("clip_grad_norm_inf", "sgd"), ("mixed_precision", "adamw"))
STEPS = 3


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def evidence(request, tmp_path_factory):
    case_name, optimizer = request.param
    out = tmp_path_factory.mktemp("judge-batched") / "out"
    plan = build_plan(cases=(case_name,), impls=("ours",), world_sizes=(1,), data_modes=("identical",), steps=STEPS,
                      out_dir=out)
    write_init_states(plan)
    init, _ = load_init(plan.init_dir / f"{case_name}.pt", plan.run_id)
    spec = get_case(case_name).optimizer(optimizer)
    (ref_cell,), (cell,) = plan.references, plan.cells
    ctx = RankContext(0, 1, None)
    ref = run_cell(ref_cell, spec, init, ctx, out / "scratch")
    snap = run_cell(cell, spec, init, ctx, out / "scratch")
    return snap, ref, init


@pytest.fixture(autouse=True, params=("batched", "per_tensor"))
def reductions(request, monkeypatch):
    """Every test with the segmented reductions in both forms (harness/judge/segments.py
    PER_TENSOR_FROM): batched as for the catalog's small models, per tensor as for a large one."""
    if request.param == "per_tensor":
        monkeypatch.setattr(segments, "PER_TENSOR_FROM", 0)
    return request.param


def _outcome(judge, snap, init, ref) -> str:
    """Everything a judge returns, as text (NaN fields compare equal as text, not as floats)."""
    try:
        r = judge(snap, {n: init[n] for n in snap["init"]["params"]}, ref)
    except Exception as e:  # the same evidence must raise the same exception
        return f"raised {type(e).__name__}: {e}"
    return repr((r.violations, r.margins, r.checks, r.step_checks, r.per_step, r.losses, r.trajectory, r.error,
                 r.stopped_after))


def _same(snap, init, ref) -> None:
    for reference in (ref, None):
        old = _outcome(judge_reference.check_snapshot, copy.deepcopy(snap), init, reference)
        new = _outcome(check_snapshot, copy.deepcopy(snap), init, reference)
        assert new == old


VALUES = (math.nan, math.inf, -math.inf, -0.0, 0.0, "ulp", "1e-3", "1e2")


def _plant(rng: random.Random, t: torch.Tensor) -> None:
    """One element of `t` (in place) set to a planted value, or the whole tensor shifted."""
    if t.numel() == 0:
        return
    flat = t.view(-1)
    i = rng.randrange(t.numel())
    value = rng.choice(VALUES + ("scale", "shift"))
    if value == "ulp":
        flat[i] = torch.nextafter(flat[i], torch.tensor(math.inf, dtype=t.dtype))
    elif value == "1e-3":
        flat[i] = flat[i] * (1 + 1e-3) + 1e-6
    elif value == "1e2":
        flat[i] = flat[i] + 1e2
    elif value == "scale":
        t.mul_(1 + 1e-6)
    elif value == "shift":
        t.add_(torch.finfo(t.dtype).eps * t.abs().max())
    else:
        flat[i] = value


def _damage(rng: random.Random, snap: dict, ref: dict) -> None:
    steps = snap["steps"]
    for _ in range(rng.randint(1, 3)):
        where = rng.choice(("grads", "params", "init", "loss", "shards", "shard_grads", "padding", "replicas",
                            "ref_params", "perturbed", "shadow_grads"))
        rec = rng.choice(steps)
        if where in ("grads", "params"):
            _plant(rng, rec[where][rng.choice(list(rec[where]))])
        elif where == "init":
            params = snap["init"]["params"]
            _plant(rng, params[rng.choice(list(params))])
        elif where == "loss":
            _plant(rng, rec["loss"])
        elif where in ("shards", "shard_grads") and rec[where]:
            _plant(rng, rec[where][rng.choice(list(rec[where]))])
        elif where == "padding" and rec["shards"]:
            key = rng.choice(list(rec["shards"]))
            intervals = [iv for iv in rec["padding_intervals"][key][0] if iv[1] > iv[0]]
            if intervals:
                start, end = rng.choice(intervals)
                rec["shards"][key][0, rng.randrange(start, end)] = rng.choice((1.0, math.nan, -0.0))
        elif where == "replicas":
            names = list(rec["params"])
            digests = torch.arange(3 * len(names), dtype=torch.int64).reshape(1, -1)[:, :len(names)].repeat(3, 1)
            digests[rng.randrange(3), rng.randrange(len(names))] += 1
            rec["replicas"] = {"names": names, "digests": digests}
        elif where == "ref_params":
            ref_rec = ref["steps"][steps.index(rec)]
            _plant(rng, ref_rec["params"][rng.choice(list(ref_rec["params"]))])
        elif where == "perturbed":
            run = rng.choice(ref["perturbed"])[steps.index(rec)]
            _plant(rng, run[rng.choice(list(run))])
        elif where == "shadow_grads":
            grads = rec["shadow"]["grads"]
            _plant(rng, grads[rng.choice(list(grads))])


def test_honest_evidence_judged_the_same(evidence):
    snap, ref, init = evidence
    _same(snap, init, ref)


@pytest.mark.parametrize("seed", range(8))
def test_planted_values_judged_the_same(evidence, seed):
    snap, ref, init = evidence
    snap, ref = copy.deepcopy(snap), copy.deepcopy(ref)
    _damage(random.Random(seed), snap, ref)
    _same(snap, init, ref)


def test_an_empty_parameter_is_judged_the_same(evidence):
    """An empty tensor in every place a parameter appears (with and without a failing neighbour)."""
    snap, ref, init = evidence
    snap, ref, init = copy.deepcopy(snap), copy.deepcopy(ref), dict(init)
    empty = torch.zeros(0)
    init["empty"] = empty
    snap["init"]["params"]["empty"] = empty.clone()
    for rec in snap["steps"]:
        for group in (rec["grads"], rec["params"], rec["shadow"]["grads"], rec["shadow"]["abs_grads"],
                      rec["shadow"]["params"]):
            group["empty"] = empty.clone()
        rec["shadow"]["num_terms"]["empty"] = next(iter(rec["shadow"]["num_terms"].values()))
        rec["shadow"]["hyper"]["empty"] = next(iter(rec["shadow"]["hyper"].values()))
        rec["shadow"]["reorder"]["empty"] = torch.zeros((), dtype=torch.float64)
        if rec.get("clipped_grads") is not None:
            rec["clipped_grads"]["empty"] = empty.clone()
    _same(snap, init, None)
    _same(snap, init, ref)  # the trajectory's envelope of an empty tensor raises, as it did
    first = next(iter(snap["steps"][0]["grads"]))
    snap["steps"][0]["grads"][first].view(-1)[0] = math.nan
    _same(snap, init, None)


def test_segments_pick_the_first_maximum_and_nan_first():
    """Segments.argmax and judge_segments against Tensor.argmax and one-tensor judging."""
    rng = torch.Generator().manual_seed(0)
    sizes = [torch.Size(s) for s in ((3, 4), (0,), (5,), (1,), (2, 0), (7,))]
    seg = Segments(sizes)
    x = torch.randint(0, 3, (seg.total,), generator=rng).double()
    x[seg.offsets[2] + 1] = math.nan
    x[seg.offsets[2] + 3] = math.nan
    at = seg.argmax(x).tolist()
    for s, n in enumerate(seg.numels):
        if n:
            assert at[s] - seg.offsets[s] == int(x[seg.offsets[s]:seg.offsets[s + 1]].argmax())
    actual = x.clone()
    expected = torch.zeros_like(x)
    tol = torch.full_like(x, 1.5)
    batched = judge_segments(seg, actual, expected, tol)
    for s, size in enumerate(sizes):
        part = slice(seg.offsets[s], seg.offsets[s + 1])
        alone = judge_segments(Segments([size]), actual[part], expected[part], tol[part])[0]
        assert repr(batched[s]) == repr(alone)


@pytest.mark.parametrize("scale", (0.0, 0.5, 2.0))
def test_a_reordered_local_backward_is_judged_the_same(evidence, scale):
    """Every gradient off the exact mean by `scale` x a reordering allowance planted on the replay:
    inside it (0.5: the bias check stops, named in the checks), beyond it (2.0: the grad check fails
    and the bias check stays on), or nowhere (0.0)."""
    snap, ref, init = evidence
    snap = copy.deepcopy(snap)
    for rec in snap["steps"]:
        # The clipped gradients and norms are the unplanted ones: judged without them (as for an
        # adapter that reports no clip norm), the planted gradients meet the worst-case clip bound.
        rec.pop("clip_norm", None)
        rec.pop("clipped_grads", None)
        for name, g in rec["grads"].items():
            allowance = 1e-4 * g.abs().max().double()
            rec["shadow"]["reorder"][name] = allowance
            g.add_((scale * allowance).float())
    _same(snap, init, ref)
    result = check_snapshot(copy.deepcopy(snap), {n: init[n] for n in snap["init"]["params"]}, ref)
    off = result.checks["bias"].get("not_applied_from")
    assert (off is not None) == (scale == 0.5), off
    assert bool(result.violations) == (scale == 2.0), result.violations[:1]
