"""Real architectures (cases/architectures.py, Hugging Face transformers configs with random
weights): gpt2, llama and moe for ours and fsdp2 at W = 1, 2, 4, 8 on identical and split data in
one harness run; batchnorm on identical data, and its refusal of split data. The issue-30 shapes
(qwen2, t5, bert, vit, unused_head): fast single-process checks of what each case is built to
exercise, and each for ours and fsdp2 at W = 1, 2, 4 in a run of its own (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cases.case import resolve_wrap
from cases.data import call_model, local_batch
from impl._flat_param import FlatLayout, align_numel_for
from tests.support.judged import assert_judged

pytest.importorskip("transformers", reason="the models extra: pip install -e '.[models]'")

REPO = Path(__file__).resolve().parents[2]
ARCHITECTURES = ("gpt2", "llama", "moe")
IMPLS = ("ours", "fsdp2")
WORLD_SIZES = (1, 2, 4, 8)
DATA = ("identical", "split")
# Issue 30: case -> the units its wrap policy selects. Not in the standard matrix (the default tier's
# duration): each runs in the extended tier in a run of its own. fsdp2 on t5 reorders its backward's
# accumulation (hooks on the blocks' inputs): it passes through the judge's reordering allowance
# ([Note: Reordered accumulation], harness/judge).
NEW_ARCHITECTURES = {"qwen2": 2, "t5": 4, "bert": 2, "vit": 2}
NEW_WORLD_SIZES = (1, 2, 4)


def _harness(args: list[str], out: Path, timeout: float) -> subprocess.CompletedProcess:
    # Offline: building a model from a config must not reach the Hugging Face hub.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "harness", *args, "--out", str(out), "--quiet"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _cells(out: Path) -> dict[str, dict]:
    return {c["cell_id"]: c for c in json.loads((out / "summary.json").read_text())["cells"]}


@pytest.mark.slow
def test_gpt2_llama_moe_pass_for_ours_and_fsdp2_at_every_w_identical_and_split(tmp_path):
    out = tmp_path / "arch"
    proc = _harness(["run", "--cases", ",".join(ARCHITECTURES), "--impls", ",".join(IMPLS),
                     "--world-sizes", ",".join(map(str, WORLD_SIZES)), "--data", ",".join(DATA),
                     "--timeout", "3000"], out, timeout=6000)
    assert (out / "summary.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    cells = _cells(out)
    expected = {f"{case}.{impl}.w{w}.{data}" for case in ARCHITECTURES for impl in IMPLS for w in WORLD_SIZES
                for data in DATA}
    assert set(cells) == expected, (sorted(set(cells) - expected), sorted(expected - set(cells)))
    failing = {i: c["first_divergence_text"] or c["error"] for i, c in cells.items() if c["verdict"] != "pass"}
    assert not failing, failing
    for cell in cells.values():
        # fsdp2 exposes no raw shards, so its padding check compares nothing; ours pads (alignment
        # gaps at every W, shard tails at W > 1).
        assert_judged(out, cell, 5, padding=cell["impl"] == "ours")
    summary = json.loads((out / "summary.json").read_text())
    assert {r["case"]: r["verdict"] for r in summary["references"]} == {c: "pass" for c in ARCHITECTURES}
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_batchnorm_passes_on_identical_data_and_split_data_is_refused_before_any_rank(tmp_path):
    out = tmp_path / "bn"
    proc = _harness(["run", "--cases", "batchnorm", "--impls", ",".join(IMPLS), "--world-sizes",
                     ",".join(map(str, WORLD_SIZES)), "--data", "identical", "--timeout", "1500"], out, timeout=3000)
    assert (out / "summary.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    cells = _cells(out)
    assert set(cells) == {f"batchnorm.{impl}.w{w}.identical" for impl in IMPLS for w in WORLD_SIZES}, sorted(cells)
    for cell in cells.values():
        assert cell["verdict"] == "pass", (cell["cell_id"], cell["first_divergence_text"] or cell["error"])
        assert_judged(out, cell, 5, padding=cell["impl"] == "ours")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    refused = _harness(["run", "--cases", "batchnorm", "--impls", "ours", "--world-sizes", "2",
                        "--data", "identical,split"], tmp_path / "bn_split", timeout=300)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert "refuses data mode 'split'" in lines[0] and "BatchNorm normalises over each rank's local batch" in lines[0]
    assert not (tmp_path / "bn_split" / "logs").exists()  # no rank started


def _case(name: str):
    from cases.catalog import get_case

    return get_case(name)


def _units(model, wrap) -> dict[str, list[tuple[str, torch.Size]]]:
    """Each unit's parameters (the root's: ''), a shared one counted in the first unit that has it."""
    paths = resolve_wrap(wrap, model)
    owned: dict[str, list[tuple[str, torch.Size]]] = {u: [] for u in ("",) + paths}
    for name, p in model.named_parameters():
        unit = max((u for u in owned if u == "" or name.startswith(u + ".")), key=len)
        owned[unit].append((name, p.shape))
    return owned


@pytest.mark.parametrize("name", [*NEW_ARCHITECTURES, "unused_head"])
def test_new_architectures_pad_at_w8_and_run_without_dropout_on_eager_attention(name):
    case = _case(name)
    torch.manual_seed(0)
    model = case.build_model()
    units = _units(model, case.wrap)
    assert len(units) - 1 == NEW_ARCHITECTURES.get(name, 2), sorted(units)
    for unit, params in units.items():
        layout = FlatLayout.build([((n,), size) for n, size in params], 8, align_numel_for(torch.float32))
        assert layout.tail_padding_numel > 0, (name, unit or "<root>", layout.aligned_numel)
    if hasattr(model, "config"):
        assert model.config._attn_implementation == "eager"
    inputs, targets = case.make_batch(case.seed, 1, case.global_batch)
    model.train()  # dropout, if any were left on, would act here
    first, second = (case.loss_fn(call_model(model, inputs), targets) for _ in range(2))
    assert torch.equal(first, second), (name, first, second)


@pytest.mark.parametrize("name", [*NEW_ARCHITECTURES, "unused_head"])
@pytest.mark.parametrize("world_size", (2, 4))
def test_new_architectures_global_loss_is_the_mean_of_the_ranks_local_losses(name, world_size):
    """What makes split data honest: each sample weighs the same in every split (T5's labels are
    never -100, BERT's loss is a per-sample mean however many tokens its padding masks)."""
    case = _case(name)
    torch.manual_seed(0)
    model = case.build_model()
    batch = case.make_batch(case.seed, 1, case.global_batch)
    with torch.no_grad():
        whole = case.loss_fn(call_model(model, batch[0]), batch[1])
        local = [case.loss_fn(call_model(model, x), y)
                 for x, y in (local_batch(batch, "split", r, world_size) for r in range(world_size))]
    torch.testing.assert_close(torch.stack(local).mean(), whole, rtol=1e-6, atol=0)


def test_bert_batches_pad_samples_to_lengths_of_their_own():
    inputs, _ = _case("bert").make_batch(0, 1, 8)
    lengths = inputs["attention_mask"].sum(dim=1)
    assert len(set(lengths.tolist())) > 2 and lengths.min() < inputs["attention_mask"].size(1)
    assert torch.equal(inputs["input_ids"] == 0, inputs["attention_mask"] == 0)  # padding is exactly the masked tail


def test_unused_head_leaves_parameters_without_gradients_in_units_with_gradients():
    case = _case("unused_head")
    model = case.build_model()
    inputs, targets = case.make_batch(case.seed, 1, case.global_batch)
    case.loss_fn(call_model(model, inputs), targets).backward()
    without = sorted(n for n, p in model.named_parameters() if p.grad is None)
    assert without == ["blocks.0.aux_head.bias", "blocks.0.aux_head.weight", "blocks.1.aux_head.bias",
                       "blocks.1.aux_head.weight", "unused_scale"]
    for unit, params in _units(model, case.wrap).items():  # each unit also holds parameters with gradients
        assert any(n not in without for n, _ in params), unit


def _assert_new_case_passes(tmp_path, name: str, impls: tuple[str, ...]) -> None:
    out = tmp_path / name
    proc = _harness(["run", "--cases", name, "--impls", ",".join(impls), "--world-sizes",
                     ",".join(map(str, NEW_WORLD_SIZES)), "--data", ",".join(DATA), "--timeout", "1500"], out,
                    timeout=3000)
    assert (out / "summary.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    cells = _cells(out)
    expected = {f"{name}.{impl}.w{w}.{data}" for impl in impls for w in NEW_WORLD_SIZES for data in DATA}
    assert set(cells) == expected, sorted(cells)
    failing = {i: c["first_divergence_text"] or c["error"] for i, c in cells.items() if c["verdict"] != "pass"}
    assert not failing, failing
    for cell in cells.values():
        assert_judged(out, cell, 5, padding=cell["impl"] == "ours")
        if cell["impl"] == "ours":  # its local backward is the plain model's, bitwise: nothing reordered
            assert not cell["bias_not_applied"], (cell["cell_id"], cell["bias_not_applied"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(NEW_ARCHITECTURES))
def test_new_architectures_pass_for_ours_and_fsdp2_at_w_1_2_4_identical_and_split(tmp_path, name):
    _assert_new_case_passes(tmp_path, name, IMPLS)


@pytest.mark.slow
def test_unused_head_passes_for_ours_and_fsdp2_at_w_1_2_4_identical_and_split(tmp_path):
    # [Note: Parameters without a gradient] (harness/judge/diff.py), [Note: Per-parameter shards]
    # (impl/_handle.py); the planted fault that steps them is tests/harness/judge/test_no_gradient.py's.
    _assert_new_case_passes(tmp_path, "unused_head", IMPLS)
