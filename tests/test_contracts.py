"""The contract check ([Note: Contracts] in harness/judge/contracts.py, [Note: Collective ledger] in
harness/run/collectives.py): a configured feature silently not applied, while every number stays
legal, fails naming its contract; honest runs of ours and torch FSDP2 keep every contract.

One launch: the three feature cases at W = 2 (gradient accumulation over 2 micro-batches,
reshard_after_forward=False, NO_SHARD), honest for ours and fsdp2, and ours with each planted
fault of impl/ that undoes one feature (every fault runs on every case: it acts only on its own)."""

from __future__ import annotations

import pytest
import torch

from cases.catalog import get_case
from harness.judge.contracts import CONTRACTS, LedgerStep, active_contracts, contract_violations
from harness.judge.verdict import evaluate
from harness.run.orchestrate import run_plan
from harness.run.plan import build_plan

# case -> (its contract, the planted fault that breaks only it)
FEATURES = {"grad_accumulation": ("gradient_sync_off", "grad_sync_every_micro"),
            "reshard_after_forward_false": ("no_gather_in_backward", "reshard_after_forward_ignored"),
            "no_shard": ("unsharded", "mesh_dims_swapped")}


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    plan = build_plan(cases=tuple(FEATURES), impls=("ours", "fsdp2"), world_sizes=(2,), data_modes=None, steps=2,
                      out_dir=tmp_path_factory.mktemp("contracts"),
                      fault_copies=tuple(fault for _, fault in FEATURES.values()))
    torch.set_num_threads(1)
    cells, _, _ = evaluate(plan, run_plan(plan))
    return {r.cell.cell_id: r for r in cells}


@pytest.mark.slow
@pytest.mark.core
def test_honest_runs_keep_every_contract_of_their_features(judged):
    honest = [r for r in judged.values() if not r.cell.faults]
    assert len(honest) == len(FEATURES) * 2 * 2  # cases x (ours, fsdp2) x data modes
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
            assert {v.step for v in r.violations} == {1, 2} and {v.rank for v in r.violations} == {0, 1}
            assert "the feature was not applied as configured" in r.violations[0].describe(r.cell.cell_id)
    # a fault that undoes another case's feature changes nothing here
    for case in FEATURES:
        for _, fault in FEATURES.values():
            if fault != FEATURES[case][1]:
                r = judged[f"{case}.ours.w2.identical.{fault}"]
                assert str(r.verdict) == "pass", (r.cell.cell_id, r.violations[:2])


def test_each_contract_breaks_exactly_at_its_limit():
    trainable = 100
    kept = LedgerStep(backward_passes=2, reduced_before_last_pass=trainable - 1, gathers_in_backward=0,
                      sharded_collectives=0)
    broken = LedgerStep(backward_passes=2, reduced_before_last_pass=trainable, gathers_in_backward=1,
                        sharded_collectives=1)
    names = tuple(CONTRACTS)
    assert contract_violations("sgd", 1, names, [kept.to_row()], trainable) == []
    violations = contract_violations("sgd", 3, names, [kept.to_row(), broken.to_row()], trainable)
    assert [(v.name, v.rank, v.step, v.actual, v.expected) for v in violations] == [
        ("gradient_sync_off", 1, 3, 100.0, 100.0), ("no_gather_in_backward", 1, 3, 1.0, 0.0),
        ("unsharded", 1, 3, 1.0, 0.0)]


def test_a_contract_applies_where_its_feature_is_on_and_its_adapter_keeps_it():
    every = frozenset(CONTRACTS)
    for case, (contract, _) in FEATURES.items():
        features = get_case(case).features
        assert active_contracts(features, 2, every) == (contract,)
        assert active_contracts(features, 1, every) == ()  # one rank: nothing to show
        assert active_contracts(features, 2, frozenset()) == ()  # an adapter that declares none
    assert active_contracts(get_case("transformer").features, 4, every) == ()
