"""The judge's checks, registered once.

Each check is one line of CHECKS: its name (a Violation's `check`), what it holds a cell to, the
kind of its tolerance and where it is computed. The judge's order (the first divergence is the
earliest step, then the check first here: harness/judge/result.py), the report's columns and the
vocabularies the verbs read (BOUNDED, JUDGED) are derived from it, so a check added here is known
everywhere at once. A check of its own module (`where` names it) computes its violations from one
field of the step record (harness/run/snapshot.py) and is called by the judge
(harness/judge/diff.py CellJudge) where that field is judged; docs/error_model.md says why its
tolerance is what it is. Adding one: its module, its line here, its evidence field, its call in
CellJudge and its paragraph in docs/error_model.md (tests/harness/judge/test_check_registry.py keeps the table
and the modules in step).
"""

from __future__ import annotations

from dataclasses import dataclass

# What a check's tolerance is (docs/error_model.md): "exact" (bit for bit, or a declared value),
# "rounding" (a few units of roundoff of one operation), "bound" (the error model's worst case),
# "envelope" (the perturbed references' spread), "sign test" (a false-alarm rate).
TOLERANCES = ("exact", "rounding", "bound", "envelope", "sign test")


@dataclass(frozen=True)
class Check:
    name: str
    holds: str  # what the check holds the cell to, one line (reports and docs)
    tolerance: str  # one of TOLERANCES
    where: str  # the module that computes it (and the function, where the module holds several)

    def __post_init__(self) -> None:
        if self.tolerance not in TOLERANCES:
            raise ValueError(f"check {self.name!r}: tolerance {self.tolerance!r} is not one of {TOLERANCES}")


CHECKS: tuple[Check, ...] = (
    Check("nonfinite", "every gradient, parameter and raw-shard element is finite", "exact",
          "harness/judge/diff.py CellJudge.nonfinite"),
    Check("init", "the parameters right after wrapping are the reference's initial state, bit for bit", "exact",
          "harness/judge/diff.py CellJudge.start"),
    Check("loss", "each rank's local loss is the replay's, bit for bit", "exact", "harness/judge/diff.py CellJudge.step"),
    Check("buffers", "every rank's buffers are the replay's, bit for bit", "exact", "harness/judge/checks/buffers.py"),
    Check("grad", "the averaged gradient is within the error model's bound of the exact mean of the replayed terms",
          "bound", "harness/judge/diff.py CellJudge.step, StepBounds.step_flat"),
    Check("clip", "the clipping norm and the clipped gradient are within the rounding of the norm and coefficient",
          "rounding", "harness/judge/diff.py CellJudge.clip_check, clip_coefficient_check"),
    Check("param", "the parameters after a step are within the error model's bound of the replayed optimizer step",
          "bound", "harness/judge/diff.py CellJudge.step, StepBounds.step_flat"),
    Check("bias", "the differences from the replay lean to no side (a sign test per tensor and over the run)",
          "sign test", "harness/judge/diff.py CellJudge.step, StepBounds.step_flat"),
    Check("replicas", "every replica's full parameters and gradients agree bit for bit", "exact",
          "harness/judge/diff.py CellJudge.step"),
    Check("padding", "padding the adapter declares zero is zero", "exact", "harness/judge/checks/padding.py"),
    Check("contract", "each configured feature does what it promises to the collectives", "exact",
          "harness/judge/contracts.py"),
    Check("trajectory", "the parameters stay within the perturbed reference runs' envelope over the whole run",
          "envelope", "harness/judge/diff.py complete_trajectory"),
)

CHECK_ORDER = tuple(c.name for c in CHECKS)
# A worst-case bound or an envelope: honest margins stay below 1 (docs/error_model.md).
BOUNDED = tuple(c.name for c in CHECKS if c.tolerance in ("bound", "envelope"))
# The checks with a non-zero tolerance of the error model (the sign test's too).
JUDGED = tuple(c.name for c in CHECKS if c.tolerance in ("bound", "envelope", "sign test"))
