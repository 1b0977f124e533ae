"""torchrun with the ranks forked from one interpreter that has imported their code:
`python -m harness.run.prefork <torchrun's arguments> -m <module> <args>`.

[Note: Forked ranks]
A rank started by torchrun's command line is a fresh interpreter: it imports torch (about 1.3 s
of CPU here) and, at its first optimizer step, torch._dynamo (about 1 s more; torch.optim imports
it to mark its steps uncompilable). A launch of 8 ranks on 2 cores spends its first 9 seconds on
that. This launcher is torchrun's own agent (`elastic_launch`, the code behind the command line,
with the same arguments, rendezvous, logs, failure summary and exit status) given a function
instead of a program: it imports the rank's module and torch._dynamo once, then the agent forks
each rank from it (`start_method="fork"`), which starts in milliseconds with those modules
loaded. The launcher runs nothing on a tensor before it forks, so no rank inherits a thread pool.

In the rank (`rank_main`), the module runs as `python -u -m <module>` would run it: as
`__main__`, with the signal dispositions of a fresh interpreter (the agent's handlers are its
own), unbuffered standard streams on the log files torchrun redirected, an uncaught exception
printed by `sys.excepthook` (torch's rank prefix included) with exit status 1, `sys.exit`'s
status kept, and the atexit hooks run before the rank leaves: a hook that hangs or kills the
process still fails the launch.

What differs from a fresh rank: /proc/<pid>/environ and the command line are the launcher's (the
rank's environment is set in `os.environ`, where the rank reads it), so a rank is found as a
process of the launch other than the launcher (harness/run/launch.py) or by its name,
`harness-rank<N>` (harness/run/rank.py); and a rank that finishes waits for the others before
it exits (torchrun's agent collects every rank's return value).

Used for launches on CPUs (harness/run/launch.py `TorchrunSpec.prefork`); GPU launches and the
bench's launch floor start ranks through torchrun's command line.
"""

from __future__ import annotations

import atexit
import importlib
import io
import os
import runpy
import signal
import sys
import warnings

# What every rank imports besides its module: torch.optim's first step imports torch._dynamo.
PRELOAD = ("torch._dynamo",)


def _fresh_streams() -> None:
    """sys.stdout and sys.stderr as `python -u` makes them, on the descriptors torchrun's agent
    redirected to this rank's log files."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding, errors=old.errors,
                                  write_through=True)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def rank_main(module: str, argv: list[str]) -> None:
    """One forked rank: `module` as __main__ with `argv`; returns on exit status 0, raises
    SystemExit with any other status."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _fresh_streams()
    # A session of its own, as torchrun's command line starts each rank: the ranks of one launch
    # sharing a session ran the fuzzer 12% slower here (more CPU per example, all of it in gloo's
    # threads), presumably by how the scheduler groups the processes of a session.
    os.setsid()
    # The launcher imported the module by its name; running it again as __main__ is what
    # `python -m` does too, without runpy's warning that it was imported first.
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package", category=RuntimeWarning)
    sys.argv = [module, *argv]
    interrupted = False
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as e:
        status = e.code
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        status, interrupted = 1, True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if interrupted:  # as an interpreter ends on an uncaught KeyboardInterrupt: by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    if status not in (0, None):
        if not isinstance(status, int):  # sys.exit("message"): printed, status 1
            print(status, file=sys.stderr)
            status = 1
        raise SystemExit(status)


def _split_module(cmd_args: list[str]) -> tuple[str, list[str]]:
    """(module, its arguments) out of torchrun's `python -u -m <module> <args>`."""
    if len(cmd_args) < 3 or cmd_args[:2] != ["-u", "-m"]:
        raise SystemExit(f"harness.run.prefork: expected `-m <module> <args>` after torchrun's arguments, got {cmd_args}")
    return cmd_args[2], cmd_args[3:]


def main(argv: list[str]) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    args = get_args_parser().parse_args(argv)
    if args.standalone or args.master_port is None:
        raise SystemExit("harness.run.prefork: pass --master-addr and --master-port (a static rendezvous)")
    config, _, cmd_args = config_from_args(args)
    module, module_args = _split_module(cmd_args)
    config.start_method = "fork"
    for name in (module, *PRELOAD):
        importlib.import_module(name)
    sys.stdout.flush()
    sys.stderr.flush()
    record(lambda: elastic_launch(config, rank_main)(module, module_args))()


if __name__ == "__main__":
    main(sys.argv[1:])
