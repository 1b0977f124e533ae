"""The README's quick-start commands, read from the README itself (stdlib only).

`.ci/run` runs what this prints, so CI runs exactly what a new user copies: `python .ci/quickstart.py
main` prints the command that sets up and runs the main job, `... test` the one that sets up and passes
the tests. They are the first and second command lines of the first ```bash block under
'## Quick start' in README.md (comment lines skipped)."""

from __future__ import annotations

import sys
from pathlib import Path

WHICH = ("main", "test")


def quickstart_commands(readme: str) -> dict[str, str]:
    """{'main': ..., 'test': ...} from the text of a README; ValueError naming what is missing."""
    lines = readme.splitlines()
    try:
        start = lines.index("## Quick start")
    except ValueError:
        raise ValueError("README.md has no '## Quick start' section") from None
    block, inside = [], False
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if line.strip().startswith("```"):
            if inside:
                break
            inside = line.strip() == "```bash"
            continue
        if inside and line.strip() and not line.lstrip().startswith("#"):
            block.append(line.strip())
    if len(block) != len(WHICH):
        raise ValueError(f"README.md's quick start must hold exactly {len(WHICH)} commands "
                         f"(main job, tests) in its ```bash block; found {len(block)}: {block}")
    return dict(zip(WHICH, block))


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in WHICH:
        print(f"usage: python .ci/quickstart.py {{{'|'.join(WHICH)}}}", file=sys.stderr)
        return 2
    readme = Path(__file__).resolve().parent.parent / "README.md"
    try:
        print(quickstart_commands(readme.read_text())[argv[0]])
    except ValueError as exc:
        print(f"quickstart: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
