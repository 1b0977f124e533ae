"""Exceptions that harness/cli.py alone turns into exit codes (standard library only: bisect and
the output directory use them without importing torch).

Library code raises `UserError` (or a subclass) with one line that names the input and the fix
(exit 2), `VerbFailed` when a verb could not reach its result (exit 1, one line), `CannotTest` when
the project does not import (exit 125), and `PoolLost` when the infrastructure took a rank away
(exit 1, one line).
"""

from __future__ import annotations


class UserError(ValueError):
    """A flag, file, adapter, baseline, directory or permission the user must fix; exit 2."""


class PlanError(UserError):
    """A bad request (unknown name, impossible combination, duplicate implementation name)."""


class UsageError(UserError):
    """A mistake on the command line (a flag argparse refuses, an empty --out): exit 2, printed as
    it is (its message names the command)."""


class CannotTest(Exception):
    """The project itself does not import: nothing can be tested (exit 125)."""


class VerbFailed(Exception):
    """A verb ran and could not reach its result, for the reason it names (exit 1, one line)."""


class ExitWith(Exception):
    """End with `code`, another process's (a node following node 0 exits with node 0's)."""

    def __init__(self, code: int, line: str) -> None:
        super().__init__(line)
        self.code = code


class PoolLost(BaseException):
    """A rank was ended from outside the run (killed, out of memory): no verdict on the example.
    A BaseException, like KeyboardInterrupt, so hypothesis stops at once instead of shrinking and
    replaying the example as a flaky failure."""
