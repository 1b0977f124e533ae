"""Every mistake in the user's input exits 2 with one line naming the input and the fix, before
any rank starts (fast: the CLI in this process, launches and rank pools forbidden)."""

from __future__ import annotations

import errno
import json
import os

import pytest

from harness import cli

BROKEN_ADAPTERS = {
    "syntax": "class X(:\n    pass\n",
    "import": "raise RuntimeError('planted: the adapter module raises at import')\n",
    "init": ("from harness.adapters import Ours\n\n\nclass X(Ours):\n    def __init__(self):\n"
             "        raise RuntimeError('planted: the adapter raises in __init__')\n"),
}
CHEAP = ["--cases", "mlp", "--world-sizes", "1", "--data", "identical", "--steps", "1"]


@pytest.fixture
def no_ranks(monkeypatch):
    import harness.fuzz.pool
    import harness.run.orchestrate

    def forbidden(*args, **kwargs):
        raise AssertionError("a rank was started for bad input")

    monkeypatch.setattr(harness.run.orchestrate, "launch", forbidden)
    monkeypatch.setattr(harness.fuzz.pool.RankPool, "start", forbidden)


def _adapter(tmp_path, kind: str) -> str:
    path = tmp_path / f"adapter_{kind}.py"
    path.write_text(BROKEN_ADAPTERS[kind])
    return f"{path}:X"


def _baseline(tmp_path) -> str:
    from harness.ci.baseline import FORMAT
    from harness.report.environment import baseline_key

    record = {"step": 1, "loss": 1.0, "grads": {"w": [0.0, 1.0]}, "buffers": {}}  # no "params"
    optimizers = {k: {"init": {"w": [0.0, 1.0]}, "init_buffers": {}, "steps": [record]} for k in ("sgd", "adamw")}
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps({"format": FORMAT, "key": baseline_key("gloo", "cpu", 1), "recorded": {},
                                "cases": {"mlp": {"steps": 1, "optimizers": optimizers}}}))
    return str(path)


def _symlinked_logs(tmp_path) -> str:
    out = tmp_path / "owned"
    from harness.run.output import OutputDir

    with OutputDir(out, "a" * 32, ("logs",)):
        pass
    (tmp_path / "elsewhere").mkdir()
    (out / "logs").symlink_to(tmp_path / "elsewhere")
    return str(out)


def _users_dir(tmp_path) -> str:
    (tmp_path / "mine" / "logs").mkdir(parents=True)
    (tmp_path / "mine" / "logs" / "mine.txt").write_text("keep")
    return str(tmp_path / "mine")


MISTAKES = {
    "adapter with a syntax error": (lambda t: ["run", *CHEAP, "--impls", _adapter(t, "syntax"), "--out", str(t / "o")],
                                    "SyntaxError"),
    "adapter raising at import": (lambda t: ["run", *CHEAP, "--impls", _adapter(t, "import"), "--out", str(t / "o")],
                                  "raises at import"),
    "adapter raising in __init__": (lambda t: ["run", *CHEAP, "--impls", _adapter(t, "init"), "--out", str(t / "o")],
                                    "raises in __init__"),
    "baseline with a missing key": (lambda t: ["gate", *CHEAP, "--baseline", _baseline(t), "--out", str(t / "o")],
                                    "steps[0].params is NoneType"),
    "unwritable baseline record --out": (lambda t: ["baseline", "record", "--cases", "mlp", "--steps", "1", "--out",
                                                    "/proc/harness-no/baseline.json", "--work-dir", str(t / "w")],
                                         "baseline record --out=/proc/harness-no/baseline.json: cannot write"),
    "symlinked DIR/logs": (lambda t: ["run", *CHEAP, "--out", _symlinked_logs(t)], "is a symbolic link"),
    "a user's non-empty --out": (lambda t: ["run", *CHEAP, "--out", _users_dir(t)], "not created by the harness"),
    "empty --out": (lambda t: ["run", *CHEAP, "--out", ""], "--out is empty"),
    "empty gate --out": (lambda t: ["gate", *CHEAP, "--out", ""], "--out is empty"),
    "empty fuzz --out": (lambda t: ["fuzz", "--world-size", "2", "--out", ""], "--out is empty"),
    "empty mutants --out": (lambda t: ["mutants", "--out", ""], "--out is empty"),
    "empty baseline --work-dir": (lambda t: ["baseline", "record", "--out", str(t / "b.json"), "--work-dir", ""],
                                  "--work-dir is empty"),
    "fuzz --threads 0": (lambda t: ["fuzz", "--threads", "0", "--out", str(t / "o")], "--threads=0 must be >= 1"),
    "fuzz --world-size 0": (lambda t: ["fuzz", "--world-size", "0", "--out", str(t / "o")], "--world-size=0"),
    "malformed fuzz --replay": (lambda t: ["fuzz", "--world-size", "2", "--replay", '{"world_size": 2',
                                           "--out", str(t / "o")], "--replay is not a model spec"),
    "fuzz --replay missing a field": (lambda t: ["fuzz", "--world-size", "2", "--replay", '{"world_size": 2}',
                                                 "--out", str(t / "o")], "--replay is not a model spec (KeyError"),
    "--world-sizes 1,,2": (lambda t: ["run", "--world-sizes", "1,,2", "--out", str(t / "o")],
                           "--world-sizes=1,,2 has an empty entry"),
    "--cases with a trailing comma": (lambda t: ["run", "--cases", "mlp,", "--out", str(t / "o")],
                                      "--cases=mlp, has an empty entry"),
    "--steps 100000": (lambda t: ["run", *CHEAP[:-2], "--steps", "100000", "--out", str(t / "o")],
                       "--steps=100000 must be between 1 and 1000"),
    "--world-sizes 64 on a CPU": (lambda t: ["run", "--world-sizes", "64", "--data", "identical", "--out", str(t / "o")],
                                  "world_size=64 exceeds 16"),
    "two adapters of one name": (lambda t: ["run", *CHEAP, "--impls", f"{_adapter_x(t, 'a')},{_adapter_x(t, 'b')}",
                                            "--out", str(t / "o")], "share the name 'x'"),
}


def _adapter_x(tmp_path, name: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text("from harness.adapters import Ours\n\n\nclass X(Ours):\n    name = 'x'\n")
    return f"{path}:X"


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_user_mistake_exits_2_with_one_line(mistake, tmp_path, no_ranks, capsys):
    make_argv, names = MISTAKES[mistake]
    argv = make_argv(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    rc = cli.main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert rc == 2, (rc, captured.out[-2000:], err[-2000:])
    assert len(err.splitlines()) == 1 and "Traceback" not in captured.out + captured.err, err
    assert names in err, err
    assert {p: p.read_bytes() for p in before} == before  # the user's files, untouched


def test_a_full_disk_at_start_exits_2(tmp_path, no_ranks, monkeypatch, capsys):
    from harness.run.output import OutputDir

    def full(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path / ".probe-x"))

    monkeypatch.setattr(OutputDir, "_probe_space", full)
    rc = cli.main(["run", *CHEAP, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "No space left on device" in err, err


def test_a_users_files_survive_a_refused_run(tmp_path, no_ranks, capsys):
    mine = tmp_path / "mine"
    for rel in ("logs/mine.txt", "snapshots/mine/a.pt", "init/seed.cfg"):
        (mine / rel).parent.mkdir(parents=True, exist_ok=True)
        (mine / rel).write_text(rel)
    assert cli.main(["run", *CHEAP, "--out", str(mine)]) == 2
    assert "not empty and was not created by the harness" in capsys.readouterr().err
    assert sorted(str(p.relative_to(mine)) for p in mine.rglob("*") if p.is_file()) == [
        "init/seed.cfg", "logs/mine.txt", "snapshots/mine/a.pt"]
    assert all((mine / rel).read_text() == rel for rel in ("logs/mine.txt", "snapshots/mine/a.pt", "init/seed.cfg"))
