"""The contract check ([Note: Contracts] in harness/judge/contracts.py, [Note: Collective ledger] in
harness/run/collectives.py): a configured feature silently not applied, while every number stays
legal, fails naming its contract; honest runs of ours and torch FSDP2 keep every contract.

One launch: the four feature cases at W = 2 (gradient accumulation over 2 micro-batches,
reshard_after_forward=False, NO_SHARD, ZeRO-1), honest for ours and fsdp2 (which has no ZeRO-1),
and ours with each planted fault of impl/ that undoes one feature (every fault runs on every case:
it acts only on its own). Every honest cell of ours and fsdp2 at W = 2 is also held to
`sharded_state` (its optimizer state sharded) except under NO_SHARD."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cases.catalog import get_case
from harness.judge.contracts import CONTRACTS, LedgerStep, ModelSize, active_contracts, contract_violations
from harness.judge.verdict import evaluate
from harness.run.orchestrate import run_plan
from harness.run.plan import build_plan

# case -> (its contract, the planted fault that breaks only it)
FEATURES = {"grad_accumulation": ("gradient_sync_off", "grad_sync_every_micro"),
            "reshard_after_forward_false": ("no_gather_in_backward", "reshard_after_forward_ignored"),
            "no_shard": ("unsharded", "mesh_dims_swapped"),
            "zero1": ("sharded_state", "zero1_state_replicated")}


def _judge(out_dir, **plan_args) -> dict:
    """Every cell's result of one plan (ours and fsdp2, 2 steps), by cell id."""
    plan = build_plan(impls=("ours", "fsdp2"), steps=2, out_dir=out_dir, **plan_args)
    torch.set_num_threads(1)
    cells, _, _ = evaluate(plan, run_plan(plan))
    return {r.cell.cell_id: r for r in cells}


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    return _judge(tmp_path_factory.mktemp("contracts"), cases=tuple(FEATURES), world_sizes=(2,), data_modes=None,
                  fault_copies=tuple(fault for _, fault in FEATURES.values()))


@pytest.mark.slow
@pytest.mark.core
def test_honest_runs_keep_every_contract_of_their_features(judged):
    honest = [r for r in judged.values() if not r.cell.faults]
    assert len(honest) == (len(FEATURES) * 2 - 1) * 2  # cases x (ours, fsdp2; no fsdp2 ZeRO-1) x data modes
    for r in honest:
        assert str(r.verdict) == "pass", (r.cell.cell_id, r.error, r.violations[:2])
        for o in r.optimizers.values():
            assert o.checks["contract"]["elements"] > 0, r.cell.cell_id  # held to it, at every step
            assert o.margins["contract"] == 0.0


@pytest.mark.slow
@pytest.mark.core
def test_a_feature_not_applied_fails_its_contract_and_nothing_else(judged):
    for case, (contract, fault) in FEATURES.items():
        for data in ("identical", "split"):
            r = judged[f"{case}.ours.w2.{data}.{fault}"]
            assert str(r.verdict) == "fail", (r.cell.cell_id, r.error)
            # every violation is the contract's: without the contract check the cell passes
            assert {(v.check, v.name) for v in r.violations} == {("contract", contract)}, r.cell.cell_id
            ranks = {None} if contract == "sharded_state" else {0, 1}  # a sum over the ranks, or each rank
            assert {v.step for v in r.violations} == {1, 2} and {v.rank for v in r.violations} == ranks
            assert "the feature was not applied as configured" in r.violations[0].describe(r.cell.cell_id)
    # a fault that undoes another case's feature changes nothing here
    for case in FEATURES:
        for _, fault in FEATURES.values():
            if fault != FEATURES[case][1]:
                r = judged[f"{case}.ours.w2.identical.{fault}"]
                assert str(r.verdict) == "pass", (r.cell.cell_id, r.violations[:2])


def test_each_contract_breaks_exactly_at_its_limit():
    size = ModelSize(trainable=100, state=200, replicas=1)
    kept = LedgerStep(backward_passes=2, reduced_before_last_pass=99, gathers_in_backward=0, sharded_collectives=0,
                      optimizer_state_elements=199)
    broken = LedgerStep(backward_passes=2, reduced_before_last_pass=100, gathers_in_backward=1, sharded_collectives=1,
                        optimizer_state_elements=201)
    names = tuple(CONTRACTS)
    assert contract_violations("sgd", 1, names, [kept.to_row(), kept.to_row()], size) == ([], 10)  # 398 < 400
    broken = dataclasses.replace(broken, sharded_off_group=2)
    violations, judged = contract_violations("sgd", 3, names, [kept.to_row(), broken.to_row()], size)
    assert judged == 10 and [(v.name, v.rank, v.step, v.actual, v.expected) for v in violations] == [
        ("gradient_sync_off", 1, 3, 100.0, 100.0), ("no_gather_in_backward", 1, 3, 1.0, 0.0),
        ("unsharded", 1, 3, 1.0, 0.0), ("shard_group", 1, 3, 2.0, 0.0), ("sharded_state", None, 3, 400.0, 400.0)]
    # two replicas of the sharded state (HSDP) hold it twice: that is the mesh, not a breach
    hsdp = [kept.to_row()] * 4
    assert contract_violations("sgd", 1, ("sharded_state",), hsdp, ModelSize(100, 200, replicas=2)) == ([], 4)
    # an optimizer without elementwise state (plain SGD) gives the contract nothing to judge
    assert contract_violations("sgd", 1, ("sharded_state",), [broken.to_row()] * 2, ModelSize(100, 0, 1)) == ([], 0)


def test_a_contract_applies_where_its_feature_is_on_and_its_adapter_keeps_it():
    every = frozenset(CONTRACTS)
    for case, (contract, _) in FEATURES.items():
        features = get_case(case).features
        want = {"unsharded": ("unsharded",), "sharded_state": ("shard_group", "sharded_state")}.get(
            contract, (contract, "shard_group", "sharded_state"))
        assert active_contracts(features, 2, every) == want
        assert active_contracts(features, 1, every) == ()  # one rank: nothing to show
        assert active_contracts(features, 2, frozenset()) == ()  # an adapter that declares none
    assert active_contracts(get_case("transformer").features, 4, every) == ("shard_group", "sharded_state")
    # resharded to fewer ranks mid-run by design (4 -> 2 -> 1 shards): no fixed promise to hold
    assert active_contracts(get_case("state_dict_reshard").features, 4, every) == ()


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """HSDP at W = 4 (2 replicas x 2 shards), judged on the ranks: honest ours and fsdp2, and ours
    with its mesh read as (shard, replicate)."""
    return _judge(tmp_path_factory.mktemp("contracts_hsdp"), cases=("hybrid_shard",), world_sizes=(4,),
                  data_modes=("identical",), fault_copies=("mesh_dims_swapped",), judge_on="ranks")


@pytest.mark.slow
@pytest.mark.core
def test_hsdp_sharded_over_the_wrong_ranks_fails_its_contract_not_the_adapter(hybrid):
    """The swapped mesh shards over the replicate group: the adapter's layouts (the configured
    mesh's) then contradict the raw shards, which used to make the cell an error blaming the
    adapter. The broken contract explains it: the cell fails naming `shard_group` on every rank."""
    for impl in ("ours", "fsdp2"):
        r = hybrid[f"hybrid_shard.{impl}.w4.identical"]
        assert str(r.verdict) == "pass", (r.cell.cell_id, r.error, r.violations[:2])
        assert all(o.checks["contract"]["elements"] > 0 for o in r.optimizers.values())
    r = hybrid["hybrid_shard.ours.w4.identical.mesh_dims_swapped"]
    assert str(r.verdict) == "fail" and r.error is None, (r.error or "")[:300]
    assert {(v.check, v.name) for v in r.violations} == {("contract", "shard_group")}
    assert {v.rank for v in r.violations} == {0, 1, 2, 3}
