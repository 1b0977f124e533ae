"""Run one of tests/rank_scripts in a torchrun launch of the harness's own launcher
(harness/run/launch.py `Launch`), for the tests of impl/ that need several ranks without the rest of
the harness in between. The scripts start with `rank_prologue`, so a launch still running at its
timeout fails the test with every rank's stacks (SIGUSR1, faulthandler), and nothing of it is left
running (tests/harness/run/test_torchrun_script.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.run.launch import Launch, TorchrunSpec

ROOT = Path(__file__).resolve().parents[2]
RANK_SCRIPTS = Path(__file__).resolve().parents[1] / "rank_scripts"


def run_rank_script(name: str | Path, world_size: int, out_dir: Path, *args: str, timeout_s: float = 300) -> list[dict]:
    """Launch rank_scripts/`name` (or a script at an absolute path) at `world_size` with `out_dir` and
    `args`; each rank's JSON."""
    script = RANK_SCRIPTS / name
    # The checkout under test first: an editable install may point at another checkout (or none).
    spec = TorchrunSpec(world_size, script.stem, (str(out_dir), *args), out_dir / f"launch-{script.stem}", timeout_s,
                        threads=1, extra_pythonpath=(str(ROOT), str(script.parent)))
    result = Launch(spec).run()
    what = f"{script.name} at W={world_size}" + (f" with {' '.join(args)}" if args else "")
    assert result.ok, f"{what}: {result.failure_text()}"
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def finish_rank(out_dir: str, result) -> int:
    """A rank script's last step: its JSON where `run_rank_script` reads it, then `rank_epilogue`."""
    import torch.distributed as dist

    from harness.run.rank import rank_epilogue

    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    rank_epilogue()
    return 0
