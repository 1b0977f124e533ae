"""What the judge returns: the checks it runs, one Violation per failing check, one Judgement
per body of evidence judged, and the Verdict they come to.

Every verb reads the same result type: `check_snapshot` returns a Judgement (an OptimizerResult:
one optimizer's run of one cell), a fuzz example is a Judgement of its drawn model
(harness/fuzz/check.py), a mutants run is one of its gate cell or corpus model
(harness/ci/mutants.py), and a cell's result gathers its optimizers' (harness/judge/verdict.py).
So a verdict, a first divergence and a margin mean one thing wherever they are read.
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field

from harness.judge.checks import CHECK_ORDER
from harness.reference.tolerance import BIAS_FALSE_ALARM



BIAS_STATISTICS = {
    "upward": "differ upward (a shift)",
    "along_gradient": "differ in the direction of the gradient (a scale error, or a term added or dropped)",
    # the parameters after a step against the replay's step from the same parameters
    "update_upward": "differ upward from the replayed step (a shift of the update)",
    "along_update": "differ from the replayed step in the direction of the update (a scale error of the step)",
    # the same, over every parameter element at the first step it differs, from step 1 on
    "run_update_upward": "(each at the first step it differs) differ upward from the replayed step",
    "run_along_update": "(each at the first step it differs) differ from the replayed step in the direction of "
                        "the update (a scale error of the steps)",
}
GRAD_STATISTICS = ("upward", "along_gradient")
UPDATE_STATISTICS = ("update_upward", "along_update")
RUN_UPDATE_STATISTICS = ("run_update_upward", "run_along_update")
ALL_PARAMETERS = "<all parameters>"  # the name of the run-level update counts
CLIP_NORM = "<clip norm>"  # the name of the clip check's violations (harness/judge/diff.py)


@dataclass(frozen=True)
class Violation:
    """One element beyond its tolerance: the evidence for a failing check."""

    optimizer: str
    step: int  # 0: initial parameters
    check: str  # one of CHECK_ORDER
    name: str  # original parameter name, '<loss>', or '<unit>/<flat param>' for padding
    ratio: float  # |diff| / tol (inf when tol is 0)
    abs_diff: float
    tol: float
    actual: float
    expected: float
    index: int | None = None  # flat index into the parameter (or into the rank's shard)
    coords: tuple[int, ...] | None = None
    rank: int | None = None  # the rank whose shard holds the element (None: replicated)
    in_padding: bool = False
    num_violating: int = 1  # elements of this tensor beyond tolerance (bias: the elements counted)
    statistic: str | None = None  # bias: BIAS_STATISTICS key of the tilted count
    lost_gradient: bool = False  # grad: no gradient where the plain model has one (expected: its largest |g|)
    gathered: bool = False  # replicas: the gathered full parameter (actual) vs its raw shard (expected)

    def sort_key(self) -> tuple:
        return (self.step, CHECK_ORDER.index(self.check), -self.ratio)

    def describe(self, cell_id: str) -> str:
        where = f"'{self.name}'"
        if self.index is not None:
            where += f"[{self.index}]"
            if self.coords is not None:
                where += f" at {self.coords}"
        if self.check == "replicas" and self.gathered:
            return (f"{cell_id} optimizer={self.optimizer} step={self.step} replicas: {where}: the gathered full "
                    f"parameter holds {self.actual!r} where rank {self.rank}'s raw shard holds {self.expected!r} "
                    f"({self.num_violating} element(s) differ): the implementation's gathered state disagrees with "
                    f"its own shards (an all-gather that misplaces or alters a shard), or the adapter's layouts() "
                    f"misplace the parameter")
        if self.check == "replicas":
            return (f"{cell_id} optimizer={self.optimizer} step={self.step} replicas: {where}: rank {self.rank}'s "
                    f"full tensor differs bitwise from the other ranks' (replicas must be identical)")
        if self.check == "buffers":
            what = ("the reference model's as built" if self.step == 0
                    else "what the replay's forward made of the buffers before the step")
            values = ("" if self.index is None else
                      f": actual={self.actual!r} expected={self.expected!r} ({self.num_violating} element(s) differ)")
            return (f"{cell_id} optimizer={self.optimizer} step={self.step} buffers: buffer {where} on rank "
                    f"{self.rank} differs bitwise from {what}{values}")
        if self.check == "contract":
            from harness.judge.contracts import CONTRACTS  # it imports this module

            limit = f"fewer than {self.expected:.0f}" if self.expected else "none"
            where = "over the ranks" if self.rank is None else f"on rank {self.rank}"
            return (f"{cell_id} optimizer={self.optimizer} step={self.step} contract: '{self.name}' broken {where}: "
                    f"{CONTRACTS[self.name].promise}; counted {self.actual:.0f} where the contract allows "
                    f"{limit}: the feature was not applied as configured")
        if self.check == "bias":
            count = round(self.actual * self.num_violating)
            return (f"{cell_id} optimizer={self.optimizer} step={self.step} bias: {where}: {count} of its "
                    f"{self.num_violating} differing elements {BIAS_STATISTICS[self.statistic]} "
                    f"(honest rounding: half, +-{self.tol:.3g} at false-alarm probability {BIAS_FALSE_ALARM:g}); "
                    f"|count - n/2| = {self.abs_diff:.3g} (ratio {self.ratio:.3g})")
        if self.check == "clip" and self.name != CLIP_NORM:
            owner = "replicated on every rank" if self.rank is None else f"in rank {self.rank}'s shard"
            return (f"{cell_id} optimizer={self.optimizer} step={self.step} clip: {where} {owner}: the clipped "
                    f"gradient {self.actual:.9g} is not the gradient times the coefficient its clip norm gives, "
                    f"{self.expected:.9g}: |diff|={self.abs_diff:.3g} > tol={self.tol:.3g} (ratio {self.ratio:.3g}, "
                    f"{self.num_violating} element(s)): the implementation scaled its gradients by another "
                    f"coefficient (clipped twice, or by another formula)")
        if self.check == "clip":
            return (f"{cell_id} optimizer={self.optimizer} step={self.step} clip: rank {self.rank}'s clip norm "
                    f"{self.actual:.9g} is not the exact gradients' norm {self.expected:.9g}: |diff|={self.abs_diff:.3g} "
                    f"> tol={self.tol:.3g} (ratio {self.ratio:.3g}): the implementation clipped by another norm than "
                    f"the unsharded model's (a norm reduced over another group, or of other gradients)")
        if self.lost_gradient:
            return (f"{cell_id} optimizer={self.optimizer} step={self.step} grad: {where}: no gradient, where the "
                    f"plain model has one (expected={self.expected:.9g}, {self.num_violating} element(s)): the "
                    f"implementation lost it")
        if self.check == "loss":
            owner = f"on rank {self.rank}"
        else:
            owner = "replicated on every rank" if self.rank is None else f"in rank {self.rank}'s shard"
        pad = " (padding)" if self.in_padding else ""
        return (f"{cell_id} optimizer={self.optimizer} step={self.step} {self.check}: {where} {owner}{pad}: "
                f"actual={self.actual:.9g} expected={self.expected:.9g} |diff|={self.abs_diff:.3g} "
                f"> tol={self.tol:.3g} (ratio {self.ratio:.3g}, {self.num_violating} element(s))"
                if self.check != "nonfinite" else
                f"{cell_id} optimizer={self.optimizer} step={self.step} nonfinite: {where} {owner}{pad}: "
                f"actual={self.actual!r} is not finite ({self.num_violating} element(s))")

    def to_json(self) -> dict:
        d = asdict(self)
        d["coords"] = list(self.coords) if self.coords is not None else None
        for key in ("ratio", "abs_diff", "tol", "actual", "expected"):
            value = d[key]
            if value != value or value in (float("inf"), float("-inf")):
                d[key] = str(value)  # JSON has no NaN/Inf
        return d


class Verdict(str, enum.Enum):
    """A cell's (and a run's) verdict. A str, so JSON, CSV and JUnit carry its value ('pass');
    made from a string it must be one of these, so a misspelt verdict raises instead of reading
    as 'not pass' somewhere and 'not fail' somewhere else."""

    PASS = "pass"
    FAIL = "fail"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:  # f-strings show the value on every Python version
        return format(self.value, spec)


SEVERITY = (Verdict.PASS, Verdict.FAIL, Verdict.ERROR)


def worst_verdict(*verdicts: Verdict) -> Verdict:
    """The worst of `verdicts` (PASS when there are none): an error over a fail over a pass."""
    return max(verdicts, key=SEVERITY.index, default=Verdict.PASS)


def verdict_of(error: str | None, violations: list) -> Verdict:
    """ERROR when no verdict could be reached (`error` set, an empty message too), else FAIL on
    any violation, else PASS: the rule of every judged result (Judgement, the baseline check)."""
    return Verdict.ERROR if error is not None else Verdict.FAIL if violations else Verdict.PASS


def nan_max(a: float, b: float) -> float:
    """max that keeps a NaN (the built-in max keeps or drops it depending on the order)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def first_of(violations: list[Violation]) -> Violation | None:
    """The first divergence: the earliest step, then the check first in CHECK_ORDER, then the
    largest ratio."""
    return min(violations, key=Violation.sort_key) if violations else None


@dataclass(kw_only=True)
class Judgement:
    """What the judge found in one body of evidence (one optimizer's run of a cell, a fuzz example,
    a mutants run). `error` set: no verdict could be reached (a crash, evidence missing or
    contradicting itself); else any violation fails it."""

    violations: list[Violation] = field(default_factory=list)
    margins: dict[str, float] = field(default_factory=dict)  # check -> max |diff| / tol
    checks: dict[str, dict] = field(default_factory=dict)  # check -> what it compared (CheckStats.summary)
    error: str | None = None

    @property
    def verdict(self) -> Verdict:
        return verdict_of(self.error, self.violations)

    @property
    def first_divergence(self) -> Violation | None:
        return first_of(self.violations)

    @property
    def max_ratio(self) -> float:
        """The largest |diff| / tol of its violations (inf for an exact check broken, NaN kept),
        else of its margins."""
        ratios = [v.ratio for v in self.violations] or [self.margins.get(c, 0.0) for c in CHECK_ORDER]
        out = 0.0
        for r in ratios:
            out = nan_max(out, r)
        return out
