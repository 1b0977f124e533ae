"""The padding check knows every padding run of a shard, alignment gaps included (fast tier).

At W = 1 a shard has no uniform tail, so every padding element it holds is an alignment gap
([Note: Alignment] in impl/_flat_param.py): a check that knew only the tail would see nothing.
"""

from __future__ import annotations

import torch

from harness.fuzz.check import assemble_snapshot
from harness.judge.diff import check_snapshot
from harness.fuzz.spec import BlockSpec, ModelSpec, as_case, init_state
from harness.fuzz.main import OPTIMIZERS
from harness.fuzz.worker import run_example
from harness.run.snapshot import decode, encode
from harness.adapters import RankContext, RawShard
from harness.run.worker import _gather_step_evidence

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
    losses, replica_digests, shards, grads, intervals = _gather_step_evidence(
        torch.tensor(2.5), raws, digests, RankContext(0, 1, None))
    assert losses.tolist() == [2.5] and replica_digests.tolist() == [digests]
    assert intervals == {"a/_flat_param": [[]], "b/_flat_param": [[[0, 1]]],
                         "c/_flat_param": [[[1, 3], [4, 5], [8, 9]]]}
    assert torch.equal(shards["a/_flat_param"], torch.arange(6.0).unsqueeze(0))
    assert torch.equal(grads["b/_flat_param"], torch.ones(1, 4)) and set(grads) == {"b/_flat_param"}
