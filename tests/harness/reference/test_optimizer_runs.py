"""The replay's optimizer stepped a run of parameters at a time gives the bits of one step over
all ([Note: The replay's optimizer by runs of parameters] in harness/reference/shadow.py):
parameters, optimizer state and hyperparameters after several steps, for SGD with momentum and
weight decay and for AdamW, with a learning-rate schedule, a parameter without a gradient and
stale gradients left on the parameters (the backward passes leave some). Planted: a run skipped
-> the parameters differ."""

from __future__ import annotations

import pytest
import torch

from cases.case import OptimizerSpec
from cases.catalog import get_case
from harness.reference import shadow as shadow_module
from harness.reference.shadow import Shadow
from harness.run.snapshot import build_init

SPECS = [OptimizerSpec("sgd", lr=0.05, momentum=0.9, weight_decay=0.01),
         OptimizerSpec("adamw", lr=1e-3, weight_decay=0.01,
                       lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))]


def _stepped(spec: OptimizerSpec, monkeypatch, run_elements: int | None, skip_run: int | None = None
             ) -> tuple[dict, list, list]:
    """The transformer's replay stepped 3 times with the same random float64 gradients (one
    parameter left without): its parameters, optimizer state and hyperparameters per step.
    `run_elements` None: stepped whole (as an optimizer that is not stepped by runs)."""
    case = get_case("transformer")
    init_state, init_buffers = build_init(case)
    with monkeypatch.context() as m:
        if run_elements is None:
            m.setattr(shadow_module, "_per_parameter", lambda optim: False)
        else:
            m.setattr(shadow_module, "OPTIMIZER_RUN_ELEMENTS", run_elements)
        if skip_run is not None:
            runs_of = shadow_module._runs_of
            m.setattr(shadow_module, "_runs_of", lambda *a: [r for i, r in enumerate(runs_of(*a)) if i != skip_run])
        shadow = Shadow(case, spec, init_state, init_buffers=init_buffers)
        g = torch.Generator().manual_seed(0)
        names = list(shadow.params)
        hypers = []
        for _ in range(3):
            grads = {n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in shadow.params.items()
                     if n != names[1]}
            for p in shadow.params.values():  # stale, as a backward pass leaves them
                p.grad = torch.full_like(p, 7.0)
            hypers.append(shadow._optimizer_step(grads, None))
        params = {n: p.detach().clone() for n, p in shadow.params.items()}
        state = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in shadow.optim.state[p].items()}
                 for p in shadow.params.values()]
    return params, state, hypers


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_runs_of_parameters_step_as_one(spec, monkeypatch):
    whole_params, whole_state, whole_hyper = _stepped(spec, monkeypatch, None)
    assert len(shadow_module._runs_of({n: t for n, t in whole_params.items()}, whole_params)) == 1  # the default: one run here
    for elements in (1 << 20, 64, 1):
        params, state, hyper = _stepped(spec, monkeypatch, elements)
        assert _same(params, whole_params), elements
        assert len(state) == len(whole_state) and all(_same(a, b) for a, b in zip(state, whole_state)), elements
        assert hyper == whole_hyper
    assert not whole_state[1], "the parameter without a gradient was stepped"


def test_a_run_left_out_is_seen(monkeypatch):
    whole_params, *_ = _stepped(SPECS[1], monkeypatch, None)
    params, *_ = _stepped(SPECS[1], monkeypatch, 64, skip_run=2)
    assert not _same(params, whole_params)
