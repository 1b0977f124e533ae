"""Mutation score of the judge: loosen each bound 10x, disable each check, flip the NaN-aware
comparison back to `diff > tol`; every such mutant must make a test of the default test command
fail. Run by hand (pytest does not collect it; about 25 minutes on 2 busy cores):

    python tests/judge_mutants.py                    # every mutant, then the table
    python tests/judge_mutants.py --only grad_bound_x10,loss_disabled
    python tests/judge_mutants.py --fast-tier        # the whole fast tier per mutant (slower)

Each mutant is applied to a temporary copy of the project (the work tree as git sees it; the real
files are never edited), and the tests run there with that copy first on PYTHONPATH (torchrun
ranks included). Per mutant the tests run are the fast-tier files that exercise the judge
(`JUDGE_FAST`) plus the slow tests aimed at that mutant (`Mutant.slow`): a subset of the default
command, so a mutant caught here is caught by the default command. The unmutated copy runs the
same selection first and must pass it whole, or no result means anything. Exit 0 when every
mutant is caught.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's tests package
from tests.support.scratch_repo import copy_project  # noqa: E402

# Fast-tier files that judge evidence (the whole fast tier with --fast-tier).
JUDGE_FAST = ("tests/harness/reference/test_tolerance_bounds.py", "tests/harness/judge/test_judge_checks.py", "tests/harness/judge/test_judge_nonfinite.py",
              "tests/harness/run/test_harness_units.py", "tests/harness/judge/test_padding_intervals.py", "tests/harness/judge/test_evidence.py",
              "tests/harness/fuzz/test_fuzz.py", "tests/harness/judge/test_bias_check.py", "tests/harness/judge/test_buffers.py", "tests/harness/judge/test_verdict_enum.py")
_PLANTED = "tests/harness/run/test_harness_runs.py::test_planted_error_is_caught_by_its_check[{}]"
_BUFFERS_SLOW = "tests/harness/run/test_harness_runs.py::test_buffers_zeroed_at_wrap_fail_at_step_0_on_every_rank"
_DRIFT = ("tests/harness/run/test_harness_runs.py::"
          "test_a_drift_every_step_hides_fails_on_the_trajectory_and_the_honest_twin_passes")
_NO_GRADIENT = "tests/harness/judge/test_no_gradient.py::{}"  # fast tests: parameters without a gradient
_SCALED_STEP = ("tests/harness/run/test_harness_runs.py::"
                "test_a_step_scaled_after_the_evidence_fails_the_update_bias_and_the_honest_twin_passes")


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    path: str  # file in the project
    edits: tuple[tuple[str, str], ...]  # (exact text, replacement); each text must occur once
    slow: tuple[str, ...] = ()  # slow tests aimed at this mutant, run besides JUDGE_FAST


def _disable(check: str) -> tuple[tuple[str, str], ...]:
    """A check that still counts its elements but never records a violation."""
    anchor = "out.append(None if o.failing is None else"
    return ((anchor, anchor.replace("else", f"or check == {check!r} else")),)


MUTANTS = (
    Mutant("grad_bound_x10", "reduction bound x10", "harness/reference/tolerance.py",
           (("bound = self.relative * abs_mean.double()", "bound = 10 * self.relative * abs_mean.double()"),),
           (_PLANTED.format("scale-1e-6-identical"),)),
    Mutant("param_bound_sgd_x10", "SGD parameter bound x10", "harness/reference/tolerance.py",
           (("return self._sgd(name, grad_tol, param, state, hyper)",
             "return 10 * self._sgd(name, grad_tol, param, state, hyper)"),)),
    Mutant("param_bound_adamw_x10", "AdamW parameter bound x10", "harness/reference/tolerance.py",
           (("return self._adamw(name, step, grad_tol, grad, param, state, hyper)",
             "return 10 * self._adamw(name, step, grad_tol, grad, param, state, hyper)"),)),
    Mutant("trajectory_factor_x10", "TRAJECTORY_FACTOR 4 -> 40", "harness/reference/tolerance.py",
           (("TRAJECTORY_FACTOR = 4.0", "TRAJECTORY_FACTOR = 40.0"),), (_DRIFT,)),
    Mutant("rounding_allowance_x10", "ROUNDING_ALLOWANCE 2 -> 20 ulps", "harness/reference/tolerance.py",
           (("ROUNDING_ALLOWANCE = 2\n", "ROUNDING_ALLOWANCE = 20\n"),)),
    Mutant("clip_coefficient_x10", "clip coefficient error bound x10", "harness/reference/tolerance.py",
           (("return coef, dcoef + 2 * u * coef", "return coef, 10 * (dcoef + 2 * u * coef)"),)),
    Mutant("bias_threshold_x10", "sign-test threshold x10", "harness/reference/tolerance.py",
           (("return math.sqrt(n * math.log(2.0 / false_alarm) / 2.0)",
             "return 10 * math.sqrt(n * math.log(2.0 / false_alarm) / 2.0)"),), (_PLANTED.format("shift-one-ulp"),)),
    Mutant("precision_refusal_x10", "MAX_MEDIAN_RELATIVE_TOLERANCE x10", "harness/reference/tolerance.py",
           (("MAX_MEDIAN_RELATIVE_TOLERANCE = 0.125", "MAX_MEDIAN_RELATIVE_TOLERANCE = 1.25"),)),
    Mutant("nonfinite_disabled", "non-finite values never reported", "harness/judge/diff.py",
           (("    bad = ~torch.isfinite(tensor)\n    if not bool(bad.any()):\n        return None",
             "    bad = ~torch.isfinite(tensor)\n    if True:\n        return None"),
            ("            if not finite:\n", "            if False:\n"),
            ("                if s.nonfinite is not None:\n", "                if False:\n"))),
    Mutant("init_disabled", "initial parameters never compared", "harness/judge/diff.py", _disable("init")),
    Mutant("loss_disabled", "per-rank losses never compared", "harness/judge/diff.py",
           (("            if not d == 0:\n", "            if False:\n"),)),
    Mutant("grad_disabled", "gradient check never fails", "harness/judge/diff.py", _disable("grad"),
           (_PLANTED.format("scale-1e-5-split"),)),
    Mutant("param_disabled", "parameter check never fails", "harness/judge/diff.py", _disable("param"),
           (_PLANTED.format("lost-master"),)),
    Mutant("no_gradient_nonzero_ignored", "a nonzero gradient where the plain model has none taken as none",
           "harness/judge/diff.py",
           (("nonzero = [n for n, g in cell_grads.items() if n not in replay_grads and not bool((g == 0).all())]",
             "nonzero = []"),), (_NO_GRADIENT.format("test_a_nonzero_gradient_where_the_plain_model_has_none_fails_the_grad_check"),)),
    Mutant("lost_gradient_ignored", "a gradient missing where the plain model has one never reported",
           "harness/judge/diff.py",
           (("            if name in cell_grads:\n                continue\n",
             "            if True:\n                continue\n"),),
           (_NO_GRADIENT.format("test_a_gradient_missing_where_the_plain_model_has_one_fails_naming_it"),)),
    Mutant("bias_disabled", "sign test never fails", "harness/judge/diff.py",
           (("return tilt if tilt and not tilt.ratio <= 1 else None", "return None"),),
           (_PLANTED.format("scale-1e-7-split"),)),
    Mutant("update_bias_disabled", "the updates' signs never counted (gradients' still are)", "harness/judge/diff.py",
           (("        if not step_bounds.clip_may_have_acted and not reordered:\n            self.update_bias(",
             "        if False:\n            self.update_bias("),), (_SCALED_STEP,)),
    Mutant("replicas_disabled", "replica digests never compared", "harness/judge/diff.py",
           (("if len(set(column)) > 1:", "if False:"),), (_PLANTED.format("replica-drift"),)),
    Mutant("buffers_disabled", "rank 0's buffers never compared", "harness/judge/checks/buffers.py",
           (("        if index is not None:\n            num = (", "        if False:\n            num = ("),),
           (_BUFFERS_SLOW,)),
    Mutant("buffer_digests_disabled", "the other ranks' buffer digests never compared", "harness/judge/checks/buffers.py",
           (("            if d != want_digest:\n", "            if False:\n"),), (_BUFFERS_SLOW,)),
    Mutant("padding_disabled", "padding never checked", "harness/judge/checks/padding.py",
           (("            if s.nonzero_padding is not None:\n", "            if False:\n"),)),
    Mutant("clip_norm_disabled", "the clip norms never compared with the exact gradients' norm",
           "harness/judge/diff.py", (("            if not ratio <= 1:\n                out.append(Violation(self.kind, step, \"clip\"",
                                      "            if False:\n                out.append(Violation(self.kind, step, \"clip\""),),
           ("tests/harness/judge/test_clip_check.py",)),
    Mutant("clip_coefficient_disabled", "the clipped gradients never compared with the gradient times the coefficient",
           "harness/judge/diff.py", _disable("clip"), ("tests/harness/judge/test_clip_check.py",)),
    Mutant("trajectory_disabled", "trajectory check never fails", "harness/judge/diff.py",
           (("        if o.failing is not None:\n            out.append(Violation(kind, dev.step, \"trajectory\"",
             "        if False:\n            out.append(Violation(kind, dev.step, \"trajectory\""),), (_DRIFT,)),
    Mutant("nan_comparison_flipped", "`not (diff <= tol)` written `diff > tol` (NaN passes)", "harness/judge/segments.py",
           (("bad = ~(diff <= tol)", "bad = diff > tol"), ("(~(diff <= tol) & (tol == 0))", "((diff > tol) & (tol == 0))"))),
    Mutant("error_ignored", "a result with an error but no violation passes (Judgement, the baseline check)",
           "harness/judge/result.py",
           (("return Verdict.ERROR if error is not None else Verdict.FAIL if violations else Verdict.PASS",
             "return Verdict.FAIL if violations else Verdict.PASS"),)),
    Mutant("max_ratio_drops_nan", "the largest ratio taken with max (a NaN dropped or kept by order)",
           "harness/judge/result.py", (("            out = nan_max(out, r)", "            out = max(out, r)"),)),
    Mutant("fuzz_replicas_disabled", "fuzz through an adapter: other ranks' digests never compared",
           "harness/fuzz/check.py", (("replicas=_replicas(replies, t)))", "replicas=None))"),)),
)


def apply(mutant: Mutant, root: Path) -> None:
    path = root / mutant.path
    text = path.read_text()
    for old, new in mutant.edits:
        count = text.count(old)
        if count != 1:
            raise SystemExit(f"mutant {mutant.name}: {count} occurrences of {old!r} in {mutant.path} (needs exactly "
                             f"one); the judge changed shape, update the mutant")
        text = text.replace(old, new)
    path.write_text(text)


def run_tests(root: Path, tests: list[str], fast_tier: bool, junit: Path, timeout_s: float) -> tuple[list[str], int, str]:
    """(failed test ids, tests run, output tail) of pytest in the copy `root`."""
    selection = (["tests", "-m", "not slow"] if fast_tier else list(JUDGE_FAST)) + tests
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "HYPOTHESIS_PROFILE": "ci"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", f"--junitxml={junit}",
           *selection]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
    if not junit.exists():
        return [f"(pytest did not run: exit {proc.returncode})"], 0, (proc.stdout + proc.stderr)[-2000:]
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed, total = [], 0
    for case in suite.iter("testcase"):
        total += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}")
    if proc.returncode not in (0, 1):  # collection errors, an interrupted session
        failed.append(f"(pytest exit {proc.returncode})")
    return failed, total, (proc.stdout + proc.stderr)[-2000:]


def _short(test_ids: list[str], width: int = 3) -> str:
    shown = ", ".join(test_ids[:width])
    return shown + (f" (+{len(test_ids) - width} more)" if len(test_ids) > width else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated mutant names (default: all)")
    parser.add_argument("--fast-tier", action="store_true", help="run the whole fast tier, not JUDGE_FAST")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per pytest session")
    args = parser.parse_args(argv)
    known = {m.name: m for m in MUTANTS}
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(known)
    unknown = sorted(set(names) - set(known))
    if unknown:
        print(f"error: unknown mutant(s) {unknown}; known: {sorted(known)}", file=sys.stderr)
        return 2

    rows, start = [], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="judge-mutants-") as tmp:
        for name in ["(none)", *names]:
            root = copy_project(Path(tmp) / name.strip("()"))
            mutant = known.get(name)
            if mutant is not None:
                apply(mutant, root)
            slow = sorted({t for m in MUTANTS if m.name in names for t in m.slow}) if mutant is None else list(mutant.slow)
            t0 = time.monotonic()
            failed, total, tail = run_tests(root, slow, args.fast_tier, Path(tmp) / f"{name.strip('()')}.xml", args.timeout)
            seconds = time.monotonic() - t0
            rows.append((name, mutant, failed, total, seconds))
            verdict = ("PASSES" if not failed else "FAILS") if mutant is None else ("caught" if failed else "NOT CAUGHT")
            print(f"[judge-mutants] {name}: {verdict} ({len(failed)}/{total} tests failed, {seconds:.0f}s)", flush=True)
            if mutant is None and failed:
                print(tail, file=sys.stderr)
                print(f"error: the unmutated project fails {failed}: fix that first", file=sys.stderr)
                return 1

    print()
    print("| mutant | what | caught | failing tests | tests run | s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, mutant, failed, total, seconds in rows:
        what = mutant.what if mutant else "unmutated (every selected test must pass)"
        caught = ("passes" if not failed else "FAILS") if mutant is None else ("yes" if failed else "NO")
        print(f"| {name} | {what} | {caught} | {len(failed)}: {_short(failed)} | {total} | {seconds:.0f} |")
    missed = [name for name, mutant, failed, _, _ in rows if mutant is not None and not failed]
    print(f"\n{len(rows) - 1 - len(missed)}/{len(rows) - 1} mutants caught; selection: "
          f"{'the whole fast tier' if args.fast_tier else 'JUDGE_FAST'} + each mutant's slow tests; "
          f"{time.monotonic() - start:.0f}s")
    if missed:
        print(f"NOT CAUGHT: {missed}")
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
