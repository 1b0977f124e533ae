"""The one exception type for mistakes in the user's input (standard library only: bisect and the
output directory use it without importing torch).

Library code raises `UserError` (or a subclass) with one line that names the input and the fix;
harness/cli.py alone turns it into exit code 2.
"""

from __future__ import annotations


class UserError(ValueError):
    """A flag, file, adapter, baseline, directory or permission the user must fix; exit 2."""
