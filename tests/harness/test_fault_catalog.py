"""Fast tier: the one fault catalog (harness/faults.py) names every fault the harness can plant,
and each layer's seam plants exactly the catalog's faults of that layer: impl/'s hook objects
(impl/_faults.py SEAMS) the "impl" faults, the collective seam (harness/run/dist_faults.py) the
"collective" ones, the loop the "loop" ones; the cases a fault runs on are catalog cases and the
feature it needs is one the mutants can look for. Planted mismatches are each found."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cases.catalog import CASES
from harness.adapters.ours import planted_faults
from harness.ci.mutants import ACTS_ON, fault_cannot_act
from harness.faults import CATALOG, FAULTS, LAYERS, Fault, check_faults, of_layer, split_faults
from harness.run.dist_faults import PLANTS as COLLECTIVE_SEAM
from harness.run.dist_faults import CollectiveFaults, scheduler_steps


def catalog_problems(catalog: tuple[Fault, ...], impl_seams: tuple[str, ...]) -> list[str]:
    out = []
    impl_names = {f.name for f in catalog if f.layer == "impl"}
    out += [f"{n}: in the catalog, no seam in impl/" for n in sorted(impl_names - set(impl_seams))]
    out += [f"{n}: a seam in impl/, not in the catalog" for n in sorted(set(impl_seams) - impl_names)]
    for f in catalog:
        out += [f"{f.name}: runs on {c}, which is no catalog case" for c in f.cases if c not in CASES]
        if f.layer == "collective" and f.name not in COLLECTIVE_SEAM:
            out.append(f"{f.name}: the collective seam refuses it (it plants {sorted(COLLECTIVE_SEAM)})")
        if f.needs is not None and f.name not in ACTS_ON:
            out.append(f"{f.name}: needs {f.needs!r}, which the mutants cannot look for")
    return out


def test_the_catalog_and_the_seams_name_the_same_faults():
    assert catalog_problems(CATALOG, planted_faults()) == []
    assert {f.layer for f in CATALOG} == set(LAYERS) and len(FAULTS) == len(CATALOG)


def test_the_collective_seam_refuses_a_collective_fault_it_does_not_plant():
    assert set(of_layer("collective")) == COLLECTIVE_SEAM
    CollectiveFaults(frozenset(COLLECTIVE_SEAM))


def test_every_need_the_mutants_look_for_is_a_catalog_fault_s():
    assert set(ACTS_ON) == {f.name for f in CATALOG if f.needs is not None}
    assert fault_cannot_act("clip_twice", "mlp") == f"n/a: needs {FAULTS['clip_twice'].needs}"
    assert fault_cannot_act("clip_twice", "clip_grad_norm") is None


def test_the_loop_fault_acts_through_the_loop_seam():
    (loop,) = of_layer("loop")
    assert scheduler_steps((loop,), object(), "x") == 2 and scheduler_steps((), None, "x") == 1


PLANTED = [
    (lambda c: c + (Fault("grad_scale_2", "impl", "a seamless fault"),), "no seam in impl/"),
    (lambda c: tuple(f for f in c if f.name != "no_grad_average"), "not in the catalog"),
    (lambda c: (replace(FAULTS["clip_twice"], cases=("no_such_case",)),), "no catalog case"),
    (lambda c: (Fault("dist_scale_2", "collective", "a collective fault no seam plants"),), "refuses it"),
    (lambda c: (replace(FAULTS["no_grad_average"], needs="a feature nobody looks for"),), "cannot look for"),
]


@pytest.mark.parametrize("plant, found", PLANTED, ids=[p[1] for p in PLANTED])
def test_a_planted_mismatch_is_found(plant, found):
    problems = catalog_problems(plant(CATALOG), planted_faults())
    assert any(found in p for p in problems), problems


def test_names_are_validated_and_split_by_layer_once():
    assert split_faults(("no_grad_average", "dist_scale_1e-5", "lr_scheduler_stepped_twice")) == (
        frozenset({"no_grad_average"}), frozenset({"dist_scale_1e-5"}))
    check_faults(("dist_scale_1e-5",), ("fsdp2",))
    from harness.errors import PlanError
    with pytest.raises(PlanError, match="unknown fault"):
        check_faults(("no_such_fault",), ("ours",))
    with pytest.raises(PlanError, match="ours only"):
        check_faults(("no_grad_average",), ("fsdp2",))
    with pytest.raises(PlanError, match="training loop"):
        check_faults(("lr_scheduler_stepped_twice",), ("ours",), loop=False)
    with pytest.raises(ValueError, match="layer"):
        Fault("x", "kernel", "nothing")
