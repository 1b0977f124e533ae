"""The fuzzer's persistent pool of W torchrun ranks, seen from the orchestrator.

Start-up (torchrun, imports, the gloo group) is paid once per pool, not per example. Requests
and replies travel through a TCPStore the orchestrator hosts (`harness.fuzz.worker` documents
the keys). A rank that raises, a rank that dies and an example that overruns its timeout all
become an `ExampleError` carrying the ranks' logs; the pool is then torn down (every process
of the launch killed, as `harness.run.launch` does) and started afresh for the next example. A rank
ended by a signal from outside the run (killed, out of memory) is no evidence about the example:
that raises `PoolLost` instead, which ends the fuzzing with one line.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist

from harness.errors import PoolLost
from harness.run.launch import EXIT_GRACE_S, Launch, TorchrunSpec
from harness.run.outcome import EXTERNAL_SIGNALS, root_cause_signal
from harness.run.snapshot import decode, encode

POLL_S = 0.25  # checks for a dead or hung pool
LOST_GRACE_S = 5.0  # for torchrun to report a rank killed from outside (see RankPool._fail)


class ExampleError(Exception):
    """An example that produced no evidence: a rank raised, died or hung."""


class PoolExitError(Exception):
    """The pool's ranks did not end cleanly once told to stop (a rank raised, exited non-zero or
    hung at exit): every example's evidence had come back, yet, as for a launch of the matrix
    (harness/run/orchestrate.py), no verdict stands on evidence from a launch that failed after it."""


@dataclass(frozen=True)
class PoolConfig:
    world_size: int
    log_dir: Path
    threads: int = 1
    example_timeout_s: float = 60.0
    start_timeout_s: float = 120.0
    exit_grace_s: float = EXIT_GRACE_S  # for the ranks to exit once told to stop
    # One rank that runs each example on simulated ranks at the example's own world size
    # ([Note: Fuzzing on simulated ranks], harness/fuzz/simulated.py); world_size is then 1.
    simulated: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1 or (self.simulated and self.world_size != 1):
            raise ValueError(f"PoolConfig world_size={self.world_size} must be >= 1 (1 when simulated: the one rank "
                             f"simulates each example's ranks)")
        if not (self.example_timeout_s > 0 and self.start_timeout_s > 0 and self.exit_grace_s > 0):
            raise ValueError(f"PoolConfig timeouts example={self.example_timeout_s} start={self.start_timeout_s} "
                             f"exit={self.exit_grace_s} must be > 0")


class RankPool:
    size = 1  # examples it trains at once (a PoolGroup: one per pool)

    def __init__(self, config: PoolConfig, name: str = "pool") -> None:
        self.config = config
        self.name = name  # its logs: config.log_dir / f"{name}-{start}"
        self.num_starts = 0
        self.start_s = 0.0  # seconds spent starting pools, all restarts included
        self._launch: Launch | None = None
        self._store: dist.TCPStore | None = None
        self._waiter_store: dist.TCPStore | None = None  # a second client, blocked in wait() (see submit)
        self._next = 0
        self._pending: dict[int, tuple[threading.Event, float]] = {}  # request -> (all replied, deadline)
        self._started = 0.0

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.launch()
        self.await_ready()

    def launch(self) -> None:
        """Start the ranks and return at once (`await_ready` waits for them): pools of a
        `PoolGroup` start side by side."""
        self._started = time.monotonic()
        cfg = self.config
        log_dir = (cfg.log_dir / f"{self.name}-{self.num_starts}").resolve()
        log_dir.mkdir(parents=True, exist_ok=True)
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=cfg.example_timeout_s))
        self._waiter_store = dist.TCPStore("127.0.0.1", self._store.port, is_master=False,
                                           timeout=timedelta(seconds=cfg.example_timeout_s))
        config_file = log_dir / "pool.json"
        config_file.write_text(json.dumps({
            "host": "127.0.0.1", "port": self._store.port, "threads": cfg.threads, "simulated": cfg.simulated,
            "collective_timeout_s": cfg.example_timeout_s, "idle_timeout_s": 24 * 3600,
        }))
        self._launch = Launch(TorchrunSpec(cfg.world_size, "harness.fuzz.worker", (str(config_file),), log_dir,
                                           timeout_s=None, threads=cfg.threads, prefork=True))
        self._launch.start()
        self._next = 0
        self.num_starts += 1

    def await_ready(self) -> None:
        try:
            self._wait([f"ready/{r}" for r in range(self.config.world_size)], self.config.start_timeout_s, "start")
        finally:
            self.start_s += time.monotonic() - self._started

    def close(self) -> None:
        """Tell the ranks to stop and wait for them to exit; PoolExitError (with the ranks'
        tracebacks, or their stacks) when they do not exit 0 within exit_grace_s. Nothing of the
        launch survives either way."""
        if self._launch is None:
            return
        launch, what = self._launch, None
        if launch.poll() is None:
            try:
                self._store.set(f"req/{self._next}", encode({"stop": True}))
            except Exception:  # a dead store: torchrun's exit status says what happened
                pass
            if not launch.wait(self.config.exit_grace_s):
                launch.dump_stacks()
                what = (f"its ranks did not exit within {self.config.exit_grace_s:g} s of the stop request "
                        f"(their stacks below)")
        if what is None and launch.returncode != 0:
            what = f"torchrun exited {launch.returncode} after the stop request (a rank failed at exit)"
        text = None if what is None else launch.failure_text(f"pool W={self.config.world_size}: {what}")
        self._kill()
        if text is not None:
            raise PoolExitError(text)

    def _kill(self) -> None:
        if self._launch is None:
            return
        self._launch.kill()
        # Release a waiter still blocked on this store: the replies it waits for will never come
        # (dropping the store under it would make torch print a C++ stack).
        for i, (done, _) in self._pending.items():
            for k in self._reply_keys(i):
                if not self._store.check([k]):
                    self._store.set(k, b"")
            done.wait(POLL_S)
        self._launch, self._store, self._waiter_store = None, None, None
        self._pending.clear()

    def __enter__(self) -> RankPool:
        self.start()
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:  # already failing (a lost rank, Ctrl-C): end the launch, no grace
            self._kill()

    # -- requests -----------------------------------------------------------------------------------
    def _wait(self, keys: list[str], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._store.check(keys):
                return
            time.sleep(POLL_S)
            if self._launch.poll() is not None:
                self._fail(self._launch.failure_text(
                    f"pool W={self.config.world_size}: {what}: torchrun exited {self._launch.returncode}"))
            if time.monotonic() > deadline:
                self._launch.dump_stacks()
                self._fail(self._launch.failure_text(
                    f"pool W={self.config.world_size}: {what}: no reply after {timeout_s:.0f}s (stacks below)"))

    def _fail(self, text: str, grace_s: float = 0.0) -> NoReturn:
        """Tear the pool down and raise PoolLost when torchrun names a rank ended by a signal from
        outside the run as the first failure, else ExampleError(text). A rank that replied with
        an error may be one whose peer was killed: torchrun gets `grace_s` to notice that."""
        deadline = time.monotonic() + grace_s
        while self._launch.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        cause = None
        if self._launch.poll() is not None:
            cause = root_cause_signal(self._launch.launcher_output())
        log_dir = self._launch.log_dir
        self._kill()
        if cause is not None and cause[1] in EXTERNAL_SIGNALS:
            raise PoolLost(f"pool W={self.config.world_size}: rank {cause[0]} was ended by {cause[1]} from outside "
                           f"the run (killed, or out of memory); no example was judged, so there is no verdict "
                           f"(rank logs: {log_dir})")
        raise ExampleError(text)

    def submit(self, request: dict) -> int:
        """Hand every rank `request` and return at once (the caller works while the ranks train);
        `collect` returns the replies."""
        if self._launch is None:
            self.start()
        i = self._next
        self._next += 1
        self._store.set(f"req/{i}", encode(request))
        # One thread sleeps in the store until every rank has replied, so the orchestrator neither
        # polls the store (a round trip each time, CPU the ranks need) nor misses a dead pool.
        done = threading.Event()
        keys, store = self._reply_keys(i), self._waiter_store

        def wait() -> None:
            try:
                store.wait(keys)
            except Exception:  # timed out, or the pool (and its store) torn down: collect decides
                pass
            done.set()

        threading.Thread(target=wait, name=f"fuzz-pool-reply-{i}", daemon=True).start()
        self._pending[i] = (done, time.monotonic() + self.config.example_timeout_s)
        return i

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet collected."""
        return len(self._pending)

    def _reply_keys(self, i: int) -> list[str]:
        return [f"rep/{i}/{r}" for r in range(self.config.world_size)]

    def collect(self, i: int) -> list[dict]:
        """Every rank's reply to request `i`, in rank order; ExampleError if any rank failed."""
        done, deadline = self._pending[i]
        keys = self._reply_keys(i)
        # A rank that raised answers at once; the others may never answer (stuck in a collective).
        while not (done.wait(POLL_S) and self._store.check(keys)):
            answered = [decode(self._store.get(k)) for k in keys if self._store.check([k])]
            errors = [r["error"] for r in answered if "error" in r]
            if errors:
                self._fail("\n".join(errors), grace_s=LOST_GRACE_S)
            if self._launch.poll() is not None or time.monotonic() > deadline or done.is_set():
                self._wait(keys, 0.0, f"request {i}")  # raises with the ranks' logs
        replies = [decode(self._store.get(k)) for k in keys]
        errors = [r["error"] for r in replies if "error" in r]
        if errors:
            self._fail("\n".join(errors), grace_s=LOST_GRACE_S)
        del self._pending[i]
        for k in keys:
            self._store.delete_key(k)
        self._store.delete_key(f"req/{i}")
        return replies

    def run(self, request: dict) -> list[dict]:
        """Every rank's reply to one request, in rank order; ExampleError if any rank failed."""
        return self.collect(self.submit(request))


class PoolGroup:
    """`size` pools of W ranks each, started side by side, serving examples side by side: a
    pool's ranks spend most of an example waiting on one another (each collective a chain of
    wake-ups across the processes), so one pool leaves cores idle that a second one fills. The
    interface of one `RankPool`: `submit` hands the request to the pool with the fewest in flight
    and returns its ticket; `collect` takes the ticket. A failing example restarts its own pool
    only. Pools run the same code with the same threads and backend, so an example's evidence is
    the same bits in any of them."""

    def __init__(self, config: PoolConfig, size: int) -> None:
        if size < 1:
            raise ValueError(f"PoolGroup size={size} must be >= 1")
        self.size = size
        self.pools = [RankPool(config, "pool" if k == 0 else f"pool{k}") for k in range(size)]
        self._start_wall = 0.0
        self._first_start_s = [0.0] * size

    @property
    def num_starts(self) -> int:
        return sum(p.num_starts for p in self.pools)

    @property
    def start_s(self) -> float:
        """The wall time of the side-by-side start, plus every restart since."""
        return self._start_wall + sum(p.start_s - s for p, s in zip(self.pools, self._first_start_s))

    def start(self) -> None:
        started = time.monotonic()
        try:
            for p in self.pools:
                p.launch()
            for p in self.pools:
                p.await_ready()
        finally:
            self._start_wall = time.monotonic() - started
            self._first_start_s = [p.start_s for p in self.pools]

    def submit(self, request: dict) -> tuple[int, int]:
        k = min(range(self.size), key=lambda j: self.pools[j].in_flight)
        return k, self.pools[k].submit(request)

    def collect(self, ticket: tuple[int, int]) -> list[dict]:
        k, i = ticket
        return self.pools[k].collect(i)

    def close(self) -> None:
        """Close every pool (see RankPool.close); the first PoolExitError once all are closed."""
        errors = []
        for p in self.pools:
            try:
                p.close()
            except PoolExitError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def _kill(self) -> None:
        for p in self.pools:
            p._kill()

    def __enter__(self) -> PoolGroup:
        try:
            self.start()
        except BaseException:
            self._kill()
            raise
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            self._kill()
