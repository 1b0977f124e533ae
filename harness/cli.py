"""`python -m harness VERB` (console script: fsdp-harness). The only place that maps outcomes to
exit codes (`main`, `_exit_code`):
    0    every cell equivalent;
    1    a cell not equivalent, or a rank crashed, hung or was lost;
    2    a mistake in the user's input (flags, files, adapters, baselines, the output directory,
         disk space, permissions): one line naming the input and the fix, before any rank starts
         where it can be known then;
    125  could not test at all (the project does not import; the `git bisect run` convention);
    128 + N  stopped by signal N (SIGINT, SIGTERM, SIGHUP) after killing every process of the run.
"""

from __future__ import annotations

import errno
import signal
import sys
import threading

from harness.errors import CannotTest, ExitWith, PoolLost, UsageError, UserError, VerbFailed
from harness.verbs import VERBS
from harness.verbs.common import Parser, import_project

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_CANNOT_TEST = 0, 1, 2, 125
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# OSErrors caused by where the user asked us to write, not by the harness.
USER_OS_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)


class Stopped(BaseException):
    """A stop signal, raised in the main thread (like KeyboardInterrupt) so that every `finally`
    on the way out runs: the launch kills its processes, bisect removes its worktree
    ([Note: No survivors] in harness/run/lifeline.py)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_stop_signal(signum, frame) -> None:
    # The first signal unwinds through the clean-ups; a second one must not cut them short.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


def build_parser() -> Parser:
    """Every verb's sub-command (harness/verbs: one module each)."""
    parser = Parser(prog="harness", description="Is this FSDP numerically the same training run as the unsharded model?")
    verbs = parser.add_subparsers(dest="verb", required=True, parser_class=Parser)
    for verb in VERBS.values():
        verb.add_parser(verbs)
    return parser


def _dispatch(argv: list[str]) -> int:
    args, extra = build_parser().parse_known_args(argv)
    verb = VERBS[args.verb]
    if extra and not verb.TAKES_EXTRA:
        raise UsageError(f"harness {args.verb}: unrecognized arguments: {' '.join(extra)}")
    if verb.IMPORTS_PROJECT:
        import_project(args)
    return EXIT_PASS if verb.run(args, extra, argv) else EXIT_FAIL


def _exit_code(verb: str, e: BaseException) -> int:
    """The one mapping from an exception that ended a verb to its exit code and one line."""
    if isinstance(e, UsageError):
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(e, UserError):
        print(f"harness {verb}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(e, OSError) and e.errno in USER_OS_ERRNOS:
        where = f" {e.filename}" if e.filename else ""
        print(f"harness {verb}: error: cannot write{where}: {e.strerror}; free space or choose a writable --out",
              file=sys.stderr)
        return EXIT_USAGE
    if isinstance(e, ExitWith):
        print(f"harness {verb}: {e}", file=sys.stderr)
        return e.code
    if isinstance(e, VerbFailed):
        print(f"harness {verb}: {e}", file=sys.stderr)
        return EXIT_FAIL
    if isinstance(e, CannotTest):
        print(f"harness: cannot test: {e}", file=sys.stderr)
        return EXIT_CANNOT_TEST
    if isinstance(e, PoolLost):
        print(f"harness {verb}: {e}", file=sys.stderr)
        return EXIT_FAIL
    if isinstance(e, (Stopped, KeyboardInterrupt)):
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        cleaned = " and removed its temporary worktree" if verb == "bisect" else ""
        print(f"harness {verb}: interrupted by {signal.Signals(signum).name}; stopped every process it "
              f"started{cleaned}", file=sys.stderr)
        return 128 + signum
    raise e


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = next((a for a in argv if not a.startswith("-")), "harness")
    in_main_thread = threading.current_thread() is threading.main_thread()  # where handlers can be set
    handlers = {sig: signal.signal(sig, _on_stop_signal) for sig in STOP_SIGNALS} if in_main_thread else {}
    try:
        return _dispatch(argv)
    except (Exception, KeyboardInterrupt, Stopped, PoolLost) as e:
        return _exit_code(verb, e)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
