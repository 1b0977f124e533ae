"""The padding check knows every padding run of a shard, alignment gaps included (fast tier).

At W = 1 a shard has no uniform tail, so every padding element it holds is an alignment gap
([Note: Alignment] in impl/_flat_param.py): a check that knew only the tail would see nothing.
"""

from __future__ import annotations

import pytest
import torch

from harness.fuzz.check import assemble_snapshot
from harness.judge.diff import check_snapshot
from harness.fuzz.spec import BlockSpec, ModelSpec, as_case, init_state
from harness.fuzz.strategies import OPTIMIZERS
from harness.fuzz.worker import run_example
from harness.run.snapshot import decode, encode
from harness.adapters import RankContext, RawShard
from harness.run.worker import StepParts, gather_evidence, steps_per_gather

# A unit holding a 0-d gain, a 3-element aux parameter and a Linear: three alignment gaps.
_SPEC = ModelSpec(1, 3, 2, (BlockSpec(width=2, gain=True, aux_numel=3),), OPTIMIZERS[0])
_KEY = "blocks.0/_flat_param"


def _replies() -> tuple[list[dict], dict]:
    init = init_state(_SPEC)
    reply = run_example(_SPEC, frozenset(), init, RankContext(0, 1, None))
    return [decode(encode(reply))], init


def _check(replies: list[dict], init: dict):
    snap = assemble_snapshot(_SPEC, (), replies, init)
    return snap, check_snapshot(snap, {n: init[n] for n in snap["init"]["params"]}, None, case=as_case(_SPEC))


def test_every_alignment_gap_is_reported_as_padding():
    replies, init = _replies()
    snap, result = _check(replies, init)
    assert result.violations == [], [v.describe("t") for v in result.violations]
    intervals = snap["steps"][0]["padding_intervals"]
    gaps = {key: per_rank[0] for key, per_rank in intervals.items()}
    assert len(gaps[_KEY]) == 3, gaps  # aux | gap | gain | gap | weight | gap | bias
    assert all(b > a for ivs in gaps.values() for a, b in ivs)


def test_garbage_in_an_interior_gap_of_a_gradient_is_caught_there():
    replies, init = _replies()
    snap, _ = _check(replies, init)
    (start, end), *_ = snap["steps"][0]["padding_intervals"][_KEY][0]
    assert start > 0, "the first gap follows the first slot"
    replies[0]["grads"][0][_KEY][start] = 1.0
    _, result = _check(replies, init)
    padding = [v for v in result.violations if v.check == "padding"]
    assert [(v.name, v.step, v.index, v.rank) for v in padding] == [(_KEY + " (grad)", 1, start, 0)]


def test_a_changed_parameter_element_is_not_mistaken_for_padding():
    replies, init = _replies()
    snap, _ = _check(replies, init)
    (start, end), *_ = snap["steps"][0]["padding_intervals"][_KEY][0]
    replies[0]["grads"][0][_KEY][end] += 1.0  # first element of the next slot
    _, result = _check(replies, init)
    assert result.violations and not [v for v in result.violations if v.check == "padding"]
    assert {v.check for v in result.violations} <= {"grad", "param"}


def test_step_evidence_carries_a_different_number_of_intervals_per_shard():
    raws = [
        RawShard("a/_flat_param", torch.arange(6.0), None, ()),
        RawShard("b/_flat_param", torch.zeros(4), torch.ones(4), ((0, 1),)),
        RawShard("c/_flat_param", torch.zeros(9), None, ((1, 3), (4, 5), (8, 9))),
    ]
    digests = [(1 << 52) - 1, 7]  # the largest digest survives the float64 trip exactly
    (ev,) = gather_evidence([StepParts.take(torch.tensor(2.5), raws, digests)], RankContext(0, 1, None))
    assert ev.losses.tolist() == [2.5] and ev.digests.tolist() == [digests]
    assert ev.padding_intervals == {"a/_flat_param": [[]], "b/_flat_param": [[[0, 1]]],
                                    "c/_flat_param": [[[1, 3], [4, 5], [8, 9]]]}
    assert torch.equal(ev.shards["a/_flat_param"], torch.arange(6.0).unsqueeze(0))
    assert torch.equal(ev.shard_grads["b/_flat_param"], torch.ones(1, 4)) and set(ev.shard_grads) == {"b/_flat_param"}


@pytest.mark.parametrize("one_by_one", [False, True])
def test_steps_gathered_together_come_back_each_as_it_was_taken(monkeypatch, one_by_one):
    """Several steps in one gather: each step's values, dtypes and intervals as they were when
    taken, although the shard changed in place after (as an implementation's live shard does);
    the same whether the shards go in one gather per dtype or, as a big model's do, one by one."""
    import harness.run.worker as worker
    monkeypatch.setattr(worker, "GATHER_ONE_BY_ONE_FROM", 0 if one_by_one else 1 << 40)
    live = torch.arange(4, dtype=torch.float64)  # float64: a conversion to float64 alone would not copy it
    low = torch.arange(3, dtype=torch.bfloat16)
    grad = torch.full((4,), 0.5, dtype=torch.float16)
    parts = [StepParts.take(torch.tensor(1.0), [RawShard("u/_flat_param", live, None, ((3, 4),)),
                                                RawShard("v/_flat_param", low, None, ())], [11])]
    live.add_(10)  # the next step moves the live shards
    low.add_(10)
    parts.append(StepParts.take(torch.tensor(2.0, dtype=torch.float64),
                                [RawShard("u/_flat_param", live, grad, ((2, 3), (3, 4))),
                                 RawShard("v/_flat_param", low, None, ())], [22]))
    first, second = gather_evidence(parts, RankContext(0, 1, None))
    assert torch.equal(first.shards["u/_flat_param"], torch.arange(4, dtype=torch.float64).unsqueeze(0))
    assert torch.equal(second.shards["u/_flat_param"], (torch.arange(4) + 10).double().unsqueeze(0))
    assert torch.equal(first.shards["v/_flat_param"], torch.arange(3, dtype=torch.bfloat16).unsqueeze(0))
    assert torch.equal(second.shards["v/_flat_param"], (torch.arange(3) + 10).to(torch.bfloat16).unsqueeze(0))
    assert first.shard_grads == {} and torch.equal(second.shard_grads["u/_flat_param"], grad.unsqueeze(0))
    assert second.shard_grads["u/_flat_param"].dtype == torch.float16
    assert (first.losses.dtype, second.losses.dtype) == (torch.float32, torch.float64)
    assert first.losses.tolist() == [1.0] and second.losses.tolist() == [2.0]
    assert first.digests.tolist() == [[11]] and second.digests.tolist() == [[22]]
    assert all(t.is_contiguous() for ev in (first, second) for t in [*ev.shards.values(), *ev.shard_grads.values()])
    assert first.padding_intervals == {"u/_flat_param": [[[3, 4]]], "v/_flat_param": [[]]}
    assert second.padding_intervals == {"u/_flat_param": [[[2, 3], [3, 4]]], "v/_flat_param": [[]]}


def test_a_batch_of_steps_is_bounded_by_the_gathered_bytes():
    assert steps_per_gather(1000) > 100  # a test model: every step in one gather
    assert steps_per_gather(10**9) == 1  # a large model: one step per gather, as before batching
    assert steps_per_gather(0) >= 1
