"""Exceptions that harness/cli.py alone turns into exit codes (standard library only: bisect and
the output directory use them without importing torch).

Library code raises `UserError` (or a subclass) with one line that names the input and the fix
(exit 2), and `PoolLost` when the infrastructure took a rank away (exit 1, one line).
"""

from __future__ import annotations


class UserError(ValueError):
    """A flag, file, adapter, baseline, directory or permission the user must fix; exit 2."""


class PlanError(UserError):
    """A bad request (unknown name, impossible combination, duplicate implementation name)."""


class PoolLost(BaseException):
    """A rank was ended from outside the run (killed, out of memory): no verdict on the example.
    A BaseException, like KeyboardInterrupt, so hypothesis stops at once instead of shrinking and
    replaying the example as a flaky failure."""
