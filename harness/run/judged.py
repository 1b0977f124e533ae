"""A (cell, optimizer) judged by its own rank 0 as the evidence is taken: the parent receives a
result, never a copy of the model.

[Note: Judged where the evidence lives]
A snapshot holds, per step, the full gradients and parameters, the raw shards of every rank, the
replay's gradients, parameters and optimizer state, and for a reference cell its perturbed runs:
parameters x steps x copies, 22 copies of the model per step for a transformer (issue 31: 3 GB of
output and 7.7 GB in the parent for a 16.8M-parameter GPT-2). Every one of those tensors is in the
memory of the cell's rank 0 at the step it is taken (the replay runs there), so rank 0 judges the
step there and then, with the judge the parent runs on a snapshot (harness/judge/diff.py
CellJudge, the same code), and lets the tensors go:
- the evidence checks (names, shapes, every step present) and the layouts check run per step on
  the same records the snapshot would hold (harness/run/evidence.py, harness/judge/layouts.py);
- the trajectory check needs the free-running reference's parameters at every step. They are
  the reference cell's (impl=single, W = 1), which a snapshot carried from that cell to every
  other; here the cell's team trains that reference itself, step by step beside the cell, with the
  same code and settings (harness/run/worker.py LockStepReference): the same bits, at the price of
  one more plain-model training per cell instead of parameters x steps on disk. In a team of two
  or more it runs on rank 1, which holds the cell's full parameters and gradients too, and compares
  the two there (harness/judge/diff.py compare_with_reference: the deviation per parameter, the
  per-step table's rows, the reference's loss, the matrices' distance); rank 0 receives those few
  numbers per parameter and step, not the reference's tensors. What the check then needs from the
  reference cell is its envelope, one number per parameter and step (trajectory_envelope), which
  the reference cell's team computes from its perturbed runs, stepped beside it
  (harness/run/worker.py PerturbedRuns); the parent judges the cell's deviations
  (TrajectoryDeviation) against it (complete_trajectory), in the order a snapshot's judge does;
- the W x W matrices compare cells by their whole trajectories: the cell's distance from the
  reference is computed here exactly; two cells whose trajectories have the same digest are 0
  apart (NaN when either is not finite, as a subtraction gives), and a cell with the reference's
  digest is as far from any other as the reference; any other pair is not known (shown as such).
So a verdict is the snapshot's verdict, bit for bit: tests/harness/run/test_judged_on_ranks.py judges the same
cells both ways and compares every margin, violation and per-step figure.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import traceback
from dataclasses import asdict
from typing import Callable

import torch

from cases.case import Case, OptimizerSpec
from harness.judge.diff import (CellJudge, ReferenceComparison, ReferenceDiverged, compare_with_reference,
                                result_to_record, trajectory_envelope, trajectory_row_parts)
from harness.judge.contracts import broken_at
from harness.judge.layouts import LayoutError, check_step_layouts, parameter_names
from harness.judge.segments import all_finite
from harness.run.evidence import EvidenceError, check_init_evidence, check_step_evidence
from harness.run.plan import Cell
from harness.run.snapshot import JUDGED_FORMAT, row_major_bytes


# [Note: Judged on the evidence's device]
# A rank judges on its own device: the replay's records, the cell's gathered parameters and
# gradients, the lock-step reference and the perturbed runs stay where they were computed, and the
# judge's tensors are made there too (`on_device`: torch's default device for the judge's
# factories). On a GPU the judge's float64 passes over the model then cost what the training's
# passes cost, instead of running on one pinned CPU thread after a copy of every tensor (a
# 124M-parameter GPT-2 on an H200: training takes seconds, a CPU judge did not finish in 200 s).
# What leaves the rank (the comparison rank 1 sends, the envelopes, the record for the parent)
# goes as CPU tensors: a few numbers per parameter. Code of the case's (its batches, its model in
# the lock-step reference, the perturbed runs and the replay's reordered passes) runs under the
# rank's own default device, as in training (`outside`): a case's CPU generator, say, stays valid.
# On the CPU nothing moves and nothing changes.


def on_device(device: torch.device):
    """The context a judge computes in on `device`: factories without a device make their tensors
    there ([Note: Judged on the evidence's device]); nothing on the CPU."""
    return contextlib.nullcontext() if device.type == "cpu" else torch.device(device)


def outside(fn: Callable | None, device: torch.device) -> Callable | None:
    """`fn` called under the rank's default device of now, out of a judge's `on_device`: the
    case's code runs as it runs in training ([Note: Judged on the evidence's device])."""
    if fn is None or device.type == "cpu":
        return fn
    default = torch.get_default_device()

    def call(*args, **kwargs):
        with torch.device(default):
            return fn(*args, **kwargs)
    return call


def record_on(obj, device: torch.device):
    """`obj`'s tensors on `device` (containers rebuilt, values kept)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device)
    if isinstance(obj, dict):
        return {k: record_on(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [record_on(v, device) for v in obj]
    return obj


class RankJudge:
    """Rank 0's judge of one (cell, optimizer): `start` with the initial evidence, `take` each
    step's record as the snapshot would hold it, then `record()` for the parent.

    `reference(step)` gives, for a cell under test, the reference's record of that step ({"step",
    "loss", "grads", "params"}: compared here) or its comparison with the cell's step taken where
    the reference was trained (harness/judge/diff.py compare_with_reference); `perturbed(step,
    params_before)` the perturbed runs' parameters at that step for a reference cell, given its
    parameters before the step. A check that raises ends the judging (the cell is an error, with
    the message the parent would give) while training goes on: the other ranks are in its
    collectives."""

    def __init__(self, cell: Cell, spec: OptimizerSpec, case: Case, header: dict, plain: torch.nn.Module,
                 init_state: dict[str, torch.Tensor], init_buffers: dict[str, torch.Tensor],
                 reference: Callable[[int], dict | ReferenceComparison] | None = None,
                 perturbed: Callable[[int, dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]] | None = None,
                 device: torch.device = torch.device("cpu")) -> None:
        self.cell, self.kind = cell, spec.kind
        self.device = device  # where the evidence is, and the judge computes
        self.header = header
        self.contracts, self.features = tuple(header.get("contracts", ())), case.features
        params = list(plain.named_parameters())
        self.sizes = {n: p.shape for n, p in params}
        self.grad_names = [n for n, p in params if p.requires_grad]
        self.buffer_sizes = {n: b.shape for n, b in plain.named_buffers()}
        self.layout_sizes, self.aliases = parameter_names(plain)
        with on_device(device):
            self.judge = CellJudge(header, record_on({n: init_state[n] for n in self.sizes}, device), case,
                                   record_on(init_buffers, device))
        self.reference, self.perturbed = outside(reference, device), outside(perturbed, device)
        self.error: str | None = None
        self.steps: list[int] = []
        self.envelopes: list[dict[str, torch.Tensor]] = []
        self.mismatches: list[dict] = []
        self.stopped = False
        self._before: dict[str, torch.Tensor] | None = None  # the cell's parameters before the next step
        self.vs_reference = torch.zeros((), dtype=torch.float64)
        self.finite = True
        self._digest = hashlib.blake2b(digest_size=8)

    def _guard(self, what: Callable[[], None]) -> None:
        if self.error is not None:
            return
        try:
            with on_device(self.device):
                what()
        except EvidenceError as e:
            self.error = f"incomplete evidence: optimizer={self.kind}: {e}"
        except LayoutError as e:  # [Note: Layout validation]
            self.error = f"the adapter's layouts contradict its raw shards: optimizer={self.kind}: {e}"
        except ReferenceDiverged as e:
            self.error = f"optimizer={self.kind}: {e}"
        except Exception:
            self.error = f"the checks of optimizer={self.kind} raised (no verdict):\n{traceback.format_exc()}"

    def start(self, init: dict) -> None:
        init = record_on(init, self.device)

        def run() -> None:
            check_init_evidence(init, self.sizes, self.buffer_sizes, self.cell.world_size)
            self.judge.start(init)
            self._before = init["params"]
        self._guard(run)
        self.judge.init_state = None  # read by the start only (which may have raised): let go

    def take(self, rec: dict) -> None:
        """One step's record: checked, judged, its trajectory figures kept; then it may go."""
        rec = record_on(rec, self.device)  # the raw shards were gathered to the CPU
        if rec.get("shadow", {}).get("reorder_later") is not None:
            rec["shadow"]["reorder_later"] = outside(rec["shadow"]["reorder_later"], self.device)

        def run() -> None:
            step = rec["step"]
            if step != len(self.steps) + 1:
                raise EvidenceError(f"step {step} recorded after steps {self.steps[-1:] or 'none'}")
            check_step_evidence(rec, self.cell, self.sizes, self.grad_names, self.buffer_sizes)
            if not broken_at(self.contracts, rec, self.features, self.cell.world_size):  # [Note: Contracts]
                for m in check_step_layouts(rec, self.header["layouts"], self.layout_sizes, self.cell.world_size,
                                            self.aliases):
                    self.mismatches.append(asdict(m))
            order = self.header["init_order"]
            split = self.cell.data_mode == "split"
            @functools.cache
            def comparison():
                """The reference's comparison of this step, asked for once (by the judge after the
                replay's checks: the rank that computes it works meanwhile, [Note: Each rank's term
                replayed on it] in harness/reference/shadow.py)."""
                ref = self.reference(step) if self.reference is not None else None
                if isinstance(ref, dict):  # the reference's record, trained here: compared here
                    ref = compare_with_reference(rec, record_on(ref, self.device), self.judge.step_bounds.u_param,
                                                 split, order)
                return ref
            if self.perturbed is not None:  # the cell is the reference: its parameters before the step are
                runs = record_on(self.perturbed(step, self._before), self.device)  # none: the team's other ranks step them
                self.envelopes.append(trajectory_envelope(rec["params"], runs) if runs else {})
            self._before = rec["params"]
            self.steps.append(step)
            for part in trajectory_row_parts(rec, order, split):  # the row's bytes, a tensor at a time
                self._digest.update(row_major_bytes(part))
                self.finite = self.finite and all_finite(part)
            # Once the cell went non-finite the judge stops (the first divergence is named); the
            # reference and the matrices' rows go on, as over a snapshot.
            if not self.stopped and not self.judge.step(rec, comparison=comparison):
                self.stopped = True
            ref = comparison()
            if ref is not None:  # NaN propagates, as in the parent's matrices
                self.vs_reference = torch.maximum(self.vs_reference, ref.row_max.to(self.vs_reference.device))
        self._guard(run)

    def record(self, run_id: str) -> dict:
        """What the parent reads (harness/judge/verdict.py): the result, or why there is none."""
        result, trajectory = None, []
        if self.error is None:
            def run() -> None:
                nonlocal result, trajectory
                result = result_to_record(self.judge.finish(None))
                trajectory = [dev.to_record() for dev in self.judge.trajectory]
            self._guard(run)
        record = {"format": JUDGED_FORMAT, "run_id": run_id, "cell": self.cell.to_json(), "optimizer": self.kind,
                  "init_digest": self.header["init_digest"],
                  "world_size": self.cell.world_size, "steps": self.steps, "error": self.error,
                  "result": result if self.error is None else None, "trajectory": trajectory,
                  "envelopes": self.envelopes if self.perturbed is not None else None,
                  "gathered_mismatches": self.mismatches,
                  "matrix": {"vs_reference": float(self.vs_reference), "digest": self._digest.hexdigest(),
                             "finite": self.finite}}
        return record_on(record, torch.device("cpu"))
