"""`fuzz --impls`: any implementation through the fuzzer (harness/fuzz/worker.py run_adapter_example).

fast: impl=ours-only faults and unknown impls are refused before any rank starts.
slow: torch FSDP2 at W = 2 passes (models it refuses at wrap, 0-d parameters, are not counted);
an FSDP1 adapter whose comm hook sums without averaging fails, shrunk, with its first divergence;
an adapter that owns its step (its forward_backward averages the gradients) is driven through it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness import cli

REPO = Path(__file__).resolve().parents[3]

BUGGY_FSDP1 = '''
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from harness.adapters import Adapter


class SumWithoutAverage(Adapter):
    name = "sum_without_average"

    def wrap(self, model, wrap_paths, ctx):
        for path in wrap_paths:
            parent, _, child = path.rpartition(".")
            unit = FSDP(model.get_submodule(path), device_id=ctx.device, use_orig_params=True)
            model.get_submodule(parent).register_module(child, unit)
        model = FSDP(model, device_id=ctx.device, use_orig_params=True)

        def hook(state, grad, output=None):
            if output is None:
                dist.all_reduce(grad, group=ctx.group)
            else:
                dist.reduce_scatter_tensor(output, grad, group=ctx.group)

        model.register_comm_hook(None, hook)
        return model
'''


# An engine-like adapter: the plain module, gradients averaged inside its own forward_backward.
# Driven by a plain forward/backward instead, its gradients would be the local ones: a failure.
OWNS_ITS_STEP = '''
import torch.distributed as dist

from harness.adapters import Adapter


class AveragesInItsStep(Adapter):
    name = "averages_in_its_step"

    def wrap(self, model, wrap_paths, ctx):
        self.group, self.world_size = ctx.group, ctx.world_size
        return model

    def forward_backward(self, model, loss_fn, inputs, targets, num_micro):
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
                p.grad /= self.world_size
        return loss.detach()
'''


@pytest.mark.parametrize("args, message", [
    (["--impls", "fsdp2", "--faults", "no_grad_average"], "apply to --impls ours only"),
    (["--impls", "nope"], "unknown impl 'nope'"),
    (["--impls", "single"], "runs without a process group"),
])
def test_fuzz_impls_mistakes_are_exit_2_before_any_rank(tmp_path, capsys, args, message):
    rc = cli.main(["fuzz", "--world-size", "2", *args, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and len(err.splitlines()) == 1, err


def _fuzz(tmp_path, impl: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", "fuzz", "--impls", impl, "--world-size", "2",
                           "--max-examples", "6", "--out", str(tmp_path / "out")],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)


@pytest.mark.slow
def test_fuzz_fsdp2_passes(tmp_path):
    proc = _fuzz(tmp_path, "fsdp2")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "[fuzz] PASS: " in proc.stdout and "impl=fsdp2 W=2" in proc.stdout


@pytest.mark.slow
def test_fuzz_catches_a_comm_hook_bug_in_a_users_fsdp1_adapter(tmp_path):
    (tmp_path / "buggy.py").write_text(BUGGY_FSDP1)
    proc = _fuzz(tmp_path, f"{tmp_path / 'buggy.py'}:SumWithoutAverage")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "[fuzz] FAIL: minimal failing model" in proc.stdout
    assert "first divergence: fuzz optimizer=" in proc.stdout and " grad: " in proc.stdout, proc.stdout[-3000:]
    assert f"--impls {tmp_path / 'buggy.py'}:SumWithoutAverage" in proc.stdout  # the replay names the impl


@pytest.mark.slow
def test_fuzz_drives_an_adapter_that_owns_its_step_through_its_forward_backward(tmp_path):
    (tmp_path / "engine.py").write_text(OWNS_ITS_STEP)
    proc = _fuzz(tmp_path, f"{tmp_path / 'engine.py'}:AveragesInItsStep")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "[fuzz] PASS: 6 examples, none failing" in proc.stdout, proc.stdout[-3000:]
