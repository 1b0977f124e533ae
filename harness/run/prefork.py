"""torchrun with the ranks forked from one interpreter that has imported their code:
`python -m harness.run.prefork <torchrun's arguments> -m <module> <args>`.

[Note: Forked ranks]
A rank started by torchrun's command line is a fresh interpreter: it imports torch (about 1.3 s
of CPU here) and, at its first optimizer step, torch._dynamo (about 1 s more; torch.optim imports
it to mark its steps uncompilable). A launch of 8 ranks on 2 cores spends its first 9 seconds on
that. This launcher is torchrun's own agent (`elastic_launch`, the code behind the command line,
with the same arguments, rendezvous, logs, failure summary and exit status) given a function
instead of a program, with multiprocessing's fork server: a fresh interpreter that imports the
rank's module and torch._dynamo once (beside the agent's own import of torch), then forks each
rank, which starts in milliseconds with those modules loaded. The fork server runs nothing but
imports, one thread; forking the agent itself, whose rendezvous store serves connections on a
thread of its own, once left all 8 ranks of a launch blocked in their first process group (a
lock that thread held, copied into each child; 1 launch of about 40 here).

In the rank (`rank_main`), the module runs as `python -u -m <module>` would run it: as
`__main__`, in a session of its own, with the signal dispositions of a fresh interpreter,
unbuffered standard streams on the log files torchrun redirected, an uncaught exception printed
by `sys.excepthook` (torch's rank prefix included) with exit status 1, `sys.exit`'s status kept,
and the atexit hooks run before the rank leaves: a hook that hangs or kills the process still
fails the launch.

What differs from a fresh rank: /proc/<pid>/environ and the command line are the fork server's
(the rank's environment is set in `os.environ`, where the rank reads it), so a rank is found by
its name, `harness-rank<N>` (harness/run/rank.py, harness/run/launch.py); its parent is the fork
server, which ends when the agent does (the rank's parent-death signal then ends the rank); and a
rank that finishes waits for the others before it exits (the agent collects every rank's return
value).

Used for launches on CPUs (harness/run/launch.py `TorchrunSpec.prefork`); GPU launches and the
bench's launch floor start ranks through torchrun's command line.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import sys
import time
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


def rank_main(module: str, argv: list[str], failure_grace_s: float = 0.0) -> None:
    """One forked rank: `module` as __main__ with `argv`; returns on exit status 0, raises
    SystemExit with any other status, `failure_grace_s` after the failure (see `main`)."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _fresh_streams()
    # A session of its own, as torchrun's command line starts each rank: the ranks of one launch
    # sharing a session ran the fuzzer 12% slower here (more CPU per example, all of it in gloo's
    # threads), presumably by how the scheduler groups the processes of a session.
    os.setsid()
    # The fork server imported the module by its name; running it again as __main__ is what
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
    if status not in (0, None) or interrupted:
        time.sleep(failure_grace_s)
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


def _start_fork_server(argv: list[str]) -> None:
    """The fork server, importing the module that follows `-m` (and PRELOAD) while this process
    imports torch for the agent: the two imports take a core each."""
    if "-m" in argv[:-1]:
        multiprocessing.set_forkserver_preload([argv[argv.index("-m") + 1], *PRELOAD])
        multiprocessing.forkserver.ensure_running()


def main(argv: list[str]) -> None:
    _start_fork_server(argv)
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    args = get_args_parser().parse_args(argv)
    if args.standalone or args.master_port is None:
        raise SystemExit("harness.run.prefork: pass --master-addr and --master-port (a static rendezvous)")
    config, _, cmd_args = config_from_args(args)
    module, module_args = _split_module(cmd_args)
    config.start_method = "forkserver"
    # The agent polls its ranks every monitor_interval and, when several have ended since the last
    # poll, reports the lowest of them as the first failure (torchrun's command line reports each
    # with its own time). A rank that fails makes its peers fail in their next collective once its
    # sockets close, at its exit: a failing rank that waits two polls before it exits is seen
    # alone, as the first failure, before any failure it causes (a rank killed from outside too:
    # the peers that then fail wait).
    grace_s = 2 * config.monitor_interval
    try:
        record(lambda: elastic_launch(config, rank_main)(module, module_args, grace_s))()
    finally:
        _stop_fork_server()


def _stop_fork_server() -> None:
    """End the fork server and reap it, so that its CPU time and its ranks' (which it reaped)
    count as this process's children's, as a rank's of torchrun's command line does (the bench
    reads them). Only multiprocessing's own stop does both; without it the server ends by itself
    when this process does, reaped by no one of the run."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    stop = getattr(server, "_stop", None)
    if stop is not None:
        stop()


if __name__ == "__main__":
    main(sys.argv[1:])
