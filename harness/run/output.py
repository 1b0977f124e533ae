"""The output directory of one run: owned, locked for the run, and cleaned only of what the
harness itself wrote. Standard library only (bisect uses it without importing torch).

[Note: Output ownership]
- Ownership: a directory the harness writes into carries MARKER, created by the harness. A
  non-empty directory without it (a user's directory) and an empty --out are refused (UserError,
  exit 2), so no user file is ever overwritten or deleted.
- One run at a time: the run holds an exclusive flock on MARKER from start to end; a second run
  into the same directory is refused instead of mixing its evidence with the first one's.
- Deleting: STATE lists the files the last run wrote (relative paths). A new run deletes exactly
  those, then records which files already sit in its generated directories (someone else's,
  never deleted) and, when it ends, the files it wrote. A run that was killed before recording
  them left STATE saying "running" with that pre-existing list, so its files are still known.
- The report set: the previous run's reports are deleted when the next run starts (a report
  must never sit beside another run's evidence); the new set is written completely into a
  temporary directory inside the output directory and then renamed into place, so a failing
  write (a full disk) leaves no report rather than a mix of two runs. Every report file carries
  the run id.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from harness.errors import UserError

MARKER = ".harness-output"
STATE = ".harness-state.json"
MARKER_TEXT = ("This directory was created by the fsdp-equiv harness (python -m harness). The harness deletes\n"
               f"only the files it wrote here, listed in {STATE}; other files are left alone.\n")
PROBE_BYTES = 64 * 1024  # a start-up write this large fails on a full disk, an empty file may not


class OutputError(UserError):
    """The output directory cannot be used (not ours, in use, not writable)."""


def _walk_files(root: Path, names: tuple[str, ...]) -> set[str]:
    """Files (and links) under root/name for each name, as paths relative to root."""
    found: set[str] = set()
    for name in names:
        top = root / name
        if top.is_symlink() or top.is_file():
            found.add(name)
            continue
        for dirpath, _, filenames in os.walk(top):
            for f in filenames:
                found.add(str((Path(dirpath) / f).relative_to(root)))
    return found


@dataclass
class OutputDir:
    """Use as a context manager; see [Note: Output ownership]. `generated` names the files and
    directories (relative to `path`) whose content the run writes, besides its report set."""

    path: Path
    run_id: str
    generated: tuple[str, ...]
    flag: str = "--out"
    _fd: int | None = None
    _preexisting: set[str] = field(default_factory=set)
    _report_set: list[str] = field(default_factory=list)

    def __enter__(self) -> OutputDir:
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- claim ------------------------------------------------------------------------------------
    def open(self) -> None:
        raw = str(self.path)
        if raw.strip() == "":
            raise OutputError(f"{self.flag} is empty; name a directory (for example {self.flag} runs/mine)")
        path = self.path = Path(raw)
        if path.exists() and not path.is_dir():
            raise OutputError(f"{self.flag}={path} is a file, not a directory; choose a directory")
        marker = path / MARKER
        if path.is_dir() and not marker.is_file() and any(path.iterdir()):
            raise OutputError(f"{self.flag}={path} is not empty and was not created by the harness (no {MARKER}); "
                              f"the harness writes only into a directory it owns: choose a new or empty directory")
        for name in (*self.generated, STATE):
            if (path / name).is_symlink():
                raise OutputError(f"{self.flag}={path}: {path / name} is a symbolic link; the harness writes only "
                                  f"into the directory it owns: remove the link or choose another {self.flag}")
        try:
            path.mkdir(parents=True, exist_ok=True)
            if not marker.is_file():
                marker.write_text(MARKER_TEXT)
            self._fd = os.open(marker, os.O_RDONLY)
        except OSError as e:
            raise OutputError(f"{self.flag}={path} is not writable: {e.strerror or e}") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            owner = self._read_state().get("pid", "?")
            raise OutputError(f"{self.flag}={path} is in use by another harness run (pid {owner}); wait for it to "
                              f"finish or choose another {self.flag}") from None
        try:
            self._probe_space()
            self._remove_previous()
            self._preexisting = _walk_files(path, self.generated)
            self._write_state({"status": "running", "run_id": self.run_id, "pid": os.getpid(),
                               "preexisting": sorted(self._preexisting), "written": []})
        except OSError as e:
            self.close(record=False)
            raise OutputError(f"{self.flag}={path} is not writable: {e.strerror or e}"
                              f"{' (' + str(e.filename) + ')' if e.filename else ''}") from None
        except BaseException:
            self.close(record=False)
            raise

    def _probe_space(self) -> None:
        fd, probe = tempfile.mkstemp(dir=self.path, prefix=".probe-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(b"\0" * PROBE_BYTES)
                f.flush()
                os.fsync(f.fileno())
        finally:
            os.unlink(probe)

    def _read_state(self) -> dict:
        try:
            state = json.loads((self.path / STATE).read_text())
        except (OSError, ValueError):
            return {}
        return state if isinstance(state, dict) else {}

    def _write_state(self, state: dict) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=f".{STATE}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(state, indent=1) + "\n")
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.path / STATE)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def _remove_previous(self) -> None:
        state = self._read_state()
        written = {w for w in state.get("written", []) if isinstance(w, str)}
        if state.get("status") == "running":  # that run was killed before recording its files
            before = {p for p in state.get("preexisting", []) if isinstance(p, str)}
            written |= _walk_files(self.path, self.generated) - before
        root = self.path.resolve()
        parents: set[Path] = set()
        for rel in sorted(written):
            target = self.path / rel
            # Never outside the directory, never through a link planted since (the check above
            # refuses links at the top of the generated directories only).
            if target.parent.resolve() != root / Path(rel).parent:
                continue
            if target.is_symlink() or target.is_file():
                target.unlink()
                parents.add(target.parent)
        for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            while parent != self.path and parent.resolve().is_relative_to(root):
                try:
                    parent.rmdir()  # only when empty: someone else's files keep their directory
                except OSError:
                    break
                parent = parent.parent

    # -- write --------------------------------------------------------------------------------------
    def write_report_set(self, files: dict[str, str]) -> dict[str, Path]:
        """All of `files` (name -> text) into the directory, or none of them (see the Note)."""
        for name in files:
            if (self.path / name).is_symlink() or "/" in name:
                raise OutputError(f"{self.flag}={self.path}: {self.path / name} is a symbolic link or a path; "
                                  f"remove it or choose another {self.flag}")
        staging = Path(tempfile.mkdtemp(dir=self.path, prefix=f".report-{self.run_id[:8]}-"))
        try:
            for name, text in files.items():
                with open(staging / name, "w") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
            # summary.json last: a reader polling for it finds the rest already in place
            for name in sorted(files, key=lambda n: n == "summary.json"):
                os.replace(staging / name, self.path / name)
                self._report_set.append(name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return {name: self.path / name for name in files}

    def track(self, name: str) -> Path:
        """A file the caller writes itself (a log written as it goes); deleted by the next run."""
        self._report_set.append(name)
        return self.path / name

    # -- release ------------------------------------------------------------------------------------
    def close(self, record: bool = True) -> None:
        if self._fd is None:
            return
        try:
            if record:
                written = (_walk_files(self.path, self.generated) - self._preexisting) | set(self._report_set)
                self._write_state({"status": "done", "run_id": self.run_id,
                                   "written": sorted(w for w in written if (self.path / w).exists())})
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
                raise
        finally:
            os.close(self._fd)  # releases the flock
            self._fd = None
