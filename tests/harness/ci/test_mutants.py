"""The mutants verb: the table logic (fast) and one mutant through the real CLI (slow)."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.judge.result import Violation
from harness.ci.mutants import HONEST, Evidence, MutantRow, case_table, corpus, fault_cannot_act, table

REPO = Path(__file__).resolve().parents[3]


def _violation(check: str, ratio: float, step: int = 1) -> Violation:
    return Violation("sgd", step, check, "w", ratio, 1.0, 1.0 / ratio if ratio else 0.0, 1.0, 0.0)


def test_a_mutant_is_caught_by_any_failing_run_and_reports_its_gate_evidence_first():
    row = MutantRow("m", "a bug", [
        Evidence("gate mlp.ours.w2.split.m", violations=[_violation("param", 3.0, step=2)]),
        Evidence("fuzz tied_accum W=2", violations=[_violation("grad", 1e5)]),
        Evidence("gate mlp.ours.w2.identical.m", margins={"grad": 0.1}),
    ])
    assert row.caught and row.check() == "param" and row.ratio() == 3.0
    assert row.failing("gate") == "1/2" and row.failing("fuzz") == "1/1"
    assert "| m | yes | param | 3 | 1/2, 1/1 |" in table([row])


def test_an_uncaught_mutant_and_a_crash_are_reported_as_such():
    missed = MutantRow("m", "a bug", [Evidence("gate c", margins={"grad": 0.2, "trajectory": 0.4, "loss": 0.9})])
    assert not missed.caught and missed.check() == "-" and missed.ratio() == 0.4
    assert "| m | NO | - |" in table([missed])
    crashed = MutantRow("c", "a crash", [Evidence("fuzz x W=2", error="rank 1: Traceback\nRuntimeError: boom")])
    assert crashed.caught and crashed.check() == "crash" and math.isinf(crashed.ratio())
    assert "RuntimeError: boom" in crashed.first_divergence()


def test_the_honest_row_reports_the_largest_margin_of_the_judged_checks():
    honest = MutantRow(HONEST, "unmutated", [Evidence("gate a", margins={"grad": 0.2, "padding": 0.0}),
                                             Evidence("fuzz b W=4", margins={"param": 0.31})])
    assert not honest.caught and honest.ratio() == 0.31
    assert "passes | - | 0.31 (max over 2 runs)" in table([honest])


def test_the_corpus_covers_what_the_catalog_lacks():
    for w in (2, 4):
        specs = corpus(w).values()
        blocks = [b for s in specs for b in s.blocks]
        nested = [b.inner for b in blocks if b.inner is not None]
        everything = blocks + nested + [n.inner for n in nested if n.inner is not None]
        assert any(s.accumulation > 1 for s in specs)
        assert any(b.tied for b in everything) and any(b.frozen for b in everything)
        assert nested and all(s.world_size == w for s in specs)


@pytest.mark.slow
def test_one_mutant_is_caught_and_the_table_is_written(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "harness", "mutants", "--only", "grad_accum_overwrite",
                           "--world-sizes", "2", "--cases", "none", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    text = (tmp_path / "mutants.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith(("| mutant", "| ---"))]
    assert [r.split(" | ")[0] for r in rows] == ["| (none) (honest)", "| grad_accum_overwrite"], rows
    # The gate battery at W = 2: mlp and transformer x identical and split (4 cells, no accumulation:
    # none fails); the fuzz corpus: 2 models, the accumulating one catches it.
    assert re.search(r"\| grad_accum_overwrite \| yes \| grad \| [^|]+ \| 0/4, [12]/2 \|", text), text
    assert "(none) (honest) | passes | - |" in text and "(max over 6 runs) | 0/4, 0/2 |" in text, text
    # The honest margin is printed with the derivation of how close an honest run may come (it
    # stays below 1; the gradient bound's own worst case is (K-1)/(K+1), docs/error_model.md).
    honest = re.search(r"^Honest margin \(largest \|diff\|/tol of the grad/param/trajectory checks over every honest "
                       r"run\): ([0-9.e+-]+) \(an honest run stays below 1; .*\(K-1\)/\(K\+1\)", text, re.MULTILINE)
    assert honest and float(honest.group(1)) < 1, text


def test_the_per_case_table_counts_a_fault_that_cannot_act_as_not_applicable():
    caught = MutantRow("no_grad_average", "a bug", [
        Evidence("gate gpt2.ours.w2.split.no_grad_average", violations=[_violation("grad", 50.0)]),
        Evidence("gate gpt2.ours.w2.identical.no_grad_average", violations=[_violation("param", 2.0)]),
        Evidence("gate llama.ours.w2.split.no_grad_average", margins={"grad": 0.1})])
    text, ok = case_table([caught], ("gpt2", "llama"))
    assert "| no_grad_average | yes: grad 50 (2/2 cells) | NO (0/1 cells) |" in text and not ok, text
    tied = MutantRow("tied_param_duplicated", "a bug", [Evidence("gate mlp.ours.w2.split.tied_param_duplicated")])
    text, ok = case_table([tied], ("mlp",))
    assert "n/a: needs a parameter with two names" in text and ok, text


def test_a_fault_on_a_case_whose_package_is_missing_is_unknown_not_an_import_error(monkeypatch):
    """Inspecting a Hugging Face case without the models extra answers instead of raising (the
    README's test command installs no transformers; this raised ImportError there)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    assert fault_cannot_act("tied_param_duplicated", "llama") == "unknown without transformers"
    assert fault_cannot_act("buffers_zeroed_at_wrap", "gpt2") == "unknown without transformers"
    assert fault_cannot_act("no_grad_average", "llama") is None  # needs no build
    assert fault_cannot_act("replica_grad_drift", "llama") == "n/a: needs replicated shards (HSDP or NO_SHARD)"


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="the models extra")
def test_tied_parameters_are_read_off_the_built_hugging_face_models():
    assert fault_cannot_act("tied_param_duplicated", "gpt2") is None
    assert fault_cannot_act("tied_param_duplicated", "llama") == "n/a: needs a parameter with two names (tied weights)"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="the models extra")
def test_faults_are_caught_on_each_real_architecture_they_can_act_on(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "harness", "mutants", "--only", "no_grad_average,tied_param_duplicated",
                           "--world-sizes", "2", "--cases", "gpt2,llama", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    text = (tmp_path / "mutants.md").read_text()
    assert "| mutant | gpt2 | llama |" in text, text
    # Honest: 2 data modes at W = 2 per case; no_grad_average acts on both, tied_param_duplicated
    # only on GPT-2 (its token embedding is the output head; Llama's are separate).
    assert "| (none) (honest) | passes (2 cells) | passes (2 cells) |" in text, text
    assert re.search(r"\| no_grad_average \| yes: \w+ [^|]+ \(2/2 cells\) \| yes: \w+ [^|]+ \(2/2 cells\) \|", text), text
    assert re.search(r"\| tied_param_duplicated \| yes: [^|]+ \| n/a: needs a parameter with two names", text), text


def test_the_corpus_runs_accumulation_models_with_one_micro_batch_for_an_adapter_that_does_not_map_it():
    """The ten-line FSDP1 adapter (README) declares no gradient accumulation: the corpus must not
    fail it on a sync control it never declared (it did: 'no attribute set_requires_gradient_sync')."""
    from dataclasses import replace

    from harness.ci.mutants import corpus, corpus_for

    for w in (2, 4):
        full = corpus(w)
        assert any(s.accumulation > 1 for s in full.values())
        assert corpus_for("ours", w) == full  # ours maps accumulation: the corpus as it is
        reduced = corpus_for("fsdp1", w)  # maps no feature (harness/adapters/fsdp1.py)
        assert reduced == {n: replace(s, accumulation=1) for n, s in full.items()}


def test_the_corpus_runs_without_0d_gains_for_an_adapter_that_refuses_them_keeping_each_units_numel():
    """torch FSDP2 and DeepSpeed refuse a 0-d parameter at wrap: the corpus model that has one
    (tied_accum) runs for them with the gain's element moved into the block's 1-D parameter
    (it was not run at all), so the unit's numel, the padding edge it was built to hit, stays."""
    from harness.ci.mutants import corpus, corpus_for
    from harness.fuzz.spec import build_model, describe

    def gains(spec):
        return [n for n, p in build_model(spec).named_parameters() if p.dim() == 0]

    for w in (2, 4):
        full = corpus(w)
        assert any(gains(s) for s in full.values())
        for impl in ("fsdp2", "deepspeed_zero2"):
            adapted = corpus_for(impl, w)
            assert set(adapted) == set(full)
            for name, spec in adapted.items():
                assert not gains(spec), (impl, name)
                assert describe(spec) == describe(full[name]), (impl, name)  # the units' numels against W
