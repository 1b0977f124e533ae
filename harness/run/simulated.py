"""Simulated ranks: W ranks as W threads of one process, joined by an exact collective layer.

[Note: Simulated ranks]
The bugs of scale live above the world sizes a machine can launch: W larger than a unit's numel
(most ranks hold empty shards), W that is no power of two, padded sizes past 2^24. Here W ranks run
as W threads of one process, each with its own default process group (torch's thread-local
process-group world), and the groups are `SimulatedGroup`s: every collective is a rendezvous of its
group's threads, after which one thread computes every rank's output at once, vectorised over the
ranks, so a collective of W = 1024 ranks costs W tensor operations, not W^2.

What a collective computes is exact, not approximate:
- all-gather, broadcast, gather, scatter and point-to-point are copies;
- a sum (all-reduce, reduce-scatter) folds the ranks' terms left to right in rank order,
  ((t_0 + t_1) + t_2) + ..., one rounding per addition in the terms' dtype, as a ring does. Gloo
  folds each chunk in a rotated rank order ((r - 1, r - 2, ..., r) for chunk r, measured at
  W = 3, 4, 8), so with distinct terms the bits differ from gloo's while the error is the same
  kind (K - 1 roundings, Higham's bound: docs/error_model.md); with identical terms every
  sequential fold gives the same bits, so a simulated run of identical data is bitwise the run of
  real gloo ranks (tests/harness/run/test_simulated.py). AVG is the fold divided by W, as gloo's;
  MAX and MIN are exact.

Python's lock serialises the ranks' Python code, and torch releases it inside kernels: a simulated
launch uses the cores, but it is for small models at large W, not for speed.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

BACKEND = "simulated"

# Simulated ranks running Python at once (`_Pace`).
PACE_SLOTS = 2


_thread = threading.local()  # a simulated rank's thread: its simulation, its rank, its registered groups
_RENDEZVOUS_KEY = "simulated/rendezvous"


class SimulationAborted(RuntimeError):
    """Another rank of the simulation failed: this rank's collective cannot complete."""


class SimulationTimeout(RuntimeError):
    """This rank waited longer than its group's timeout for the others to come to a collective
    (a rank hung or diverged): its own failure, the one to report."""


class _Ticket:
    """A simulated rank's thread's own gate: closed while the thread waits, opened when it may run
    (a collective done, a slot free) or must stop (the simulation aborted)."""

    __slots__ = ("gate", "slot", "thread", "queued")

    def __init__(self) -> None:
        self.gate = threading.Lock()
        self.gate.acquire()
        self.slot = False  # it holds one of the pace's slots
        self.thread = threading.get_ident()  # made by its own thread (`_ticket`)
        self.queued = False  # runnable, waiting for a slot (the others' progress, not a hang)

    def open(self) -> None:
        try:
            self.gate.release()
        except RuntimeError:
            pass  # open already

    def cpu_s(self) -> float:
        """The CPU time its thread has used (0 where it has ended or the platform cannot say)."""
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self.thread))
        except (AttributeError, OSError):
            return 0.0


def _ticket() -> _Ticket:
    ticket = getattr(_thread, "ticket", None)
    if ticket is None:
        ticket = _thread.ticket = _Ticket()
    return ticket


class _Pace:
    """At most `slots` simulated ranks run at once; the others wait, in the order they became
    runnable, for a running one to block.

    After a collective every other rank of the group can go on, and W threads woken at once fight
    for Python's lock at every kernel call (each call releases it): at W = 256 a simulation spent
    more time in the kernel's futex calls than in the ranks' code. So the rank that computes a
    collective hands the waiting ranks to this queue instead of waking them, and a rank passes its
    slot on when it blocks (at a collective, a receive, its end, `blocking()`).

    A rank blocked where this cannot see (a lock of the code under test, a wait nobody wrapped in
    `blocking()`) keeps its slot. When no slot has moved for STALL_S and the holders' threads used
    less than STALL_CPU_SHARE of that time on a CPU (they are blocked, not merely slow: a holder
    starved of CPU by other processes still advances), the pace lends the waiting ranks slots of
    its own, one at the first stall and twice as many at each stall after it (so W ranks all
    blocked that way run within log2(W) stalls); a lent slot goes back at the next releases.
    Slower, never stuck, and never a herd while any holder computes."""

    STALL_S = 0.5
    STALL_CPU_SHARE = 0.02
    POLL_S = 5.0

    def __init__(self, slots: int) -> None:
        self.lock = threading.Lock()
        self.free = slots
        self.lent = 0  # slots lent beyond `slots`: the next releases take them back
        self.lend_next = 1
        self.ready: collections.deque[_Ticket] = collections.deque()
        self.holders: set[_Ticket] = set()
        self.moved = self.progress = time.monotonic()
        self.cpu_mark: float | None = None  # the holders' CPU time when last seen advancing
        self.waiting: set[_Ticket] = set()
        self.aborted = False

    def _dispatch(self) -> None:  # under self.lock
        while self.free and self.ready:
            ticket = self.ready.popleft()
            self.free -= 1
            ticket.slot, ticket.queued = True, False
            self.holders.add(ticket)
            ticket.open()
        self.moved, self.cpu_mark = time.monotonic(), None
        self.progress = self.moved  # a slot moved: some rank came to a wait or went on from one

    def runnable(self, tickets: list[_Ticket]) -> None:
        with self.lock:
            for ticket in tickets:
                ticket.queued = True
            self.ready.extend(tickets)
            self._dispatch()

    def release(self, ticket: _Ticket) -> None:
        """The thread of `ticket` blocks: its slot goes to the next runnable rank."""
        with self.lock:
            if ticket.slot:
                ticket.slot = False
                self.holders.discard(ticket)
                if self.lent:
                    self.lent -= 1
                else:
                    self.free += 1
                    self.lend_next = 1  # a slot came back on its own: the holders are not all stuck
                self._dispatch()

    def _stalled(self) -> bool:  # under self.lock
        now = time.monotonic()
        if not self.ready or now - self.moved <= self.STALL_S:
            return False
        cpu = sum(t.cpu_s() for t in self.holders)
        if self.cpu_mark is None or cpu - self.cpu_mark > self.STALL_CPU_SHARE * (now - self.moved):
            self.moved, self.cpu_mark = now, cpu  # the holders run: measure the next STALL_S from here
            return False
        return True

    def _lend(self) -> None:  # under self.lock, stalled
        n = min(self.lend_next, len(self.ready))
        self.lent += n
        self.free += n
        self.lend_next *= 2
        self._dispatch()

    def wait(self, ticket: _Ticket, check: Callable[[], None], what: str, timeout_s: float | None = None) -> None:
        """Until `ticket` is opened (`check` raises when the simulation aborted: `abort` opens every
        waiting ticket). A waiting thread wakes only every POLL_S on its own: W threads polling
        often cost the running ones Python's lock W times as often (the stall is watched by one
        thread, `watch`). `timeout_s` (a group's timeout) bounds the time spent waiting for other
        ranks while no slot moves: the others are queued for the slots, and the time they take to
        come grows with W while they make progress; time queued for a slot is not counted at all."""
        with self.lock:
            self.waiting.add(ticket)
            if self.aborted:
                ticket.open()
        try:
            start = time.monotonic()
            while not ticket.gate.acquire(timeout=self.POLL_S):
                check()
                if ticket.queued:
                    start = time.monotonic()
                waited = time.monotonic() - max(start, self.progress)
                if timeout_s is not None and waited > timeout_s:
                    raise SimulationTimeout(f"{what}: waited {waited:.0f} s (the group's timeout)")
        finally:
            with self.lock:
                self.waiting.discard(ticket)
        check()

    def abort(self) -> None:
        """Open every waiting ticket (their threads raise in `check`), now and from now on."""
        with self.lock:
            self.aborted = True
            for ticket in self.waiting:
                ticket.open()

    def watch(self, stop: threading.Event) -> None:
        """A simulation's watcher thread: lend slots while the holders are stalled (`_stalled`)."""
        while not stop.wait(self.STALL_S / 2):
            with self.lock:
                if self._stalled():
                    self._lend()

    def run(self, check: Callable[[], None], what: str) -> None:
        """This thread becomes runnable: wait for a slot."""
        ticket = _ticket()
        self.runnable([ticket])
        self.wait(ticket, check, what)


class _Rendezvous:
    """The meeting point of one group's threads: each collective deposits every rank's arguments;
    the last thread to arrive computes every rank's result and hands the others to the pace
    (`_Pace`), which opens each one's own gate when it may run."""

    def __init__(self, size: int, abort: threading.Event, pace: _Pace, timeout_s: float) -> None:
        self.size, self.abort, self.pace, self.timeout_s = size, abort, pace, timeout_s
        self.slots: list[Any] = [None] * size
        self.tickets: list[_Ticket | None] = [None] * size
        self.error: BaseException | None = None
        self.arrived = 0
        self.lock = threading.Lock()
        self.mailboxes: dict[tuple[int, int, int], queue.Queue] = {}
        self.mail_lock = threading.Lock()

    def _check(self) -> None:
        if self.abort.is_set():
            raise SimulationAborted("another simulated rank failed")

    def collective(self, rank: int, args: Any, compute: Callable[[list[Any]], None]) -> None:
        """Deposit `args`; once every rank has, one thread runs compute(all ranks' args); return
        when it is done (an error in it is raised on every rank).

        Nobody deposits the next collective's arguments before this one is computed (the others
        run on only after it), and its error is read before the next one's computation replaces it
        (that waits for every rank to arrive again)."""
        self._check()
        ticket = _ticket()
        self.slots[rank], self.tickets[rank] = args, ticket
        with self.lock:
            self.arrived += 1
            last = self.arrived == self.size
            if last:
                self.arrived = 0
            else:  # before the last rank can hand this one back to the pace, still holding its slot
                self.pace.release(ticket)
        if last:
            try:
                compute(self.slots)
                self.error = None
            except BaseException as e:  # raised on every rank below
                self.error = e
            self.pace.runnable([t for r, t in enumerate(self.tickets) if r != rank])
        else:
            self.pace.wait(ticket, self._check, f"rank {rank}, waiting for the other ranks' collective", self.timeout_s)
            self._check()
        if self.error is not None:
            raise RuntimeError(f"simulated collective failed: {self.error}") from self.error

    def mailbox(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self.mail_lock:
            return self.mailboxes.setdefault((src, dst, tag), queue.Queue())

    def broken(self) -> None:
        """Wake every rank waiting here (the abort event is set: they raise)."""
        for ticket in self.tickets:
            if ticket is not None:
                ticket.open()


def _fold(terms: torch.Tensor, op) -> torch.Tensor:
    """Reduce `terms` [W, ...] over its first dimension: a left fold in rank order for sums (one
    rounding per addition, [Note: Simulated ranks]), exact for MAX/MIN."""
    if op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
        return terms.amax(0) if op == dist.ReduceOp.MAX else terms.amin(0)
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise NotImplementedError(f"simulated ranks: reduce op {op} is not simulated")
    total = terms[0].clone()
    for k in range(1, terms.shape[0]):
        total += terms[k]
    if op == dist.ReduceOp.AVG:
        total /= terms.shape[0]
    return total


def _completed_work() -> dist.Work:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(None)
    return torch._C._distributed_c10d._create_work_from_future(fut)


_DONE: dist.Work | None = None


def _done() -> dist.Work:
    """A completed Work (every simulated collective is done when it returns); one for all of them."""
    global _DONE
    if _DONE is None:
        _DONE = _completed_work()
    return _DONE


def _reduce_op(opts):
    """The options' reduce op as its RedOpType (SUM, AVG, MAX, ...)."""
    op = opts.reduceOp
    return getattr(op, "op", op)


class SimulatedGroup(dist.ProcessGroup):
    """One rank's process group in a simulation; the group's threads share one `_Rendezvous`."""

    def __init__(self, rank: int, size: int, rendezvous: _Rendezvous) -> None:
        super().__init__(rank, size)
        self._rank, self._size, self._rdv = rank, size, rendezvous
        self._name = self._desc = ""

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return BACKEND

    # torch names a group it made from a backend's object by these two (its registry of groups by
    # name, read by functional collectives and device meshes).
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:
        return self._desc

    def _meet(self, args: Any, compute: Callable[[list[Any]], None]) -> dist.Work:
        self._rdv.collective(self._rank, args, compute)
        return _done()

    # -- copies -------------------------------------------------------------------------------
    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts=None):
        def compute(slots):
            for outs, _ in slots:
                for i, (_, ins) in enumerate(slots):
                    outs[0][i].copy_(ins[0])
        return self._meet((output_tensors, input_tensors), compute)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts=None):
        def compute(slots):
            whole = torch.cat([ins.reshape(-1) for _, ins in slots])
            for out, _ in slots:
                out.view(-1).copy_(whole)
        return self._meet((output, input), compute)

    _allgather_base = all_gather_single  # torch < 2.13's name

    def broadcast(self, tensors: list[torch.Tensor], opts=None):
        root = opts.rootRank

        def compute(slots):
            for r, ts in enumerate(slots):
                if r != root:
                    for t, src in zip(ts, slots[root]):
                        t.copy_(src)
        return self._meet(tensors, compute)

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts=None):
        root = opts.rootRank

        def compute(slots):
            for i, (_, ins) in enumerate(slots):
                slots[root][0][0][i].copy_(ins[0])
        return self._meet((output_tensors, input_tensors), compute)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts=None):
        root = opts.rootRank

        def compute(slots):
            for i, (outs, _) in enumerate(slots):
                outs[0].copy_(slots[root][1][0][i])
        return self._meet((output_tensors, input_tensors), compute)

    def barrier(self, opts=None):
        return self._meet(None, lambda slots: None)

    # -- sums -----------------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts=None):
        op = _reduce_op(opts) if opts is not None else dist.ReduceOp.SUM

        def compute(slots):
            for j in range(len(slots[0])):
                total = _fold(torch.stack([ts[j] for ts in slots]), op)
                for ts in slots:
                    ts[j].copy_(total)
        return self._meet(tensors, compute)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts=None):
        op = _reduce_op(opts) if opts is not None else dist.ReduceOp.SUM

        def compute(slots):
            total = _fold(torch.stack([ins.reshape(-1) for _, ins in slots]), op)
            for r, (out, _) in enumerate(slots):
                out.view(-1).copy_(total.view(len(slots), -1)[r])
        return self._meet((output, input), compute)

    _reduce_scatter_base = reduce_scatter_single  # torch < 2.13's name

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts=None):
        op = _reduce_op(opts) if opts is not None else dist.ReduceOp.SUM

        def compute(slots):
            for r, (outs, _) in enumerate(slots):
                outs[0].copy_(_fold(torch.stack([ins[0][r] for _, ins in slots]), op))
        return self._meet((output_tensors, input_tensors), compute)

    # -- point to point -------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0):
        self._rdv.mailbox(self._rank, dst, tag).put([t.detach().clone() for t in tensors])
        return _done()

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0):
        box = self._rdv.mailbox(src, self._rank, tag)
        self._rdv.pace.release(_ticket())
        while True:
            try:
                sent = box.get(timeout=1.0)
                break
            except queue.Empty:
                self._rdv._check()
        self._rdv.pace.run(self._rdv._check, f"rank {self._rank}, received from rank {src}")
        for t, s in zip(tensors, sent):
            t.copy_(s)
        return _done()


class Simulation:
    """W ranks as threads of this process: `run(fn)` calls fn(rank) on W threads, each inside its own
    default process group of the simulated backend (or, with `init=False`, with the simulation's
    store and rank ready for the thread's own `init_process_group`: `current`), and returns their
    results in rank order (the first failing rank's error raised once every thread has stopped)."""

    _installed = False
    _lock = threading.Lock()
    _current: "Simulation | None" = None

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"simulated world size {world_size} must be >= 1")
        self.world_size = world_size
        self.abort = threading.Event()
        self.store = dist.HashStore()  # the launch's store: every rank's, in this process
        self._rendezvous: dict[str, _Rendezvous] = {}
        self._rdv_lock = threading.Lock()
        self.pace = _Pace(PACE_SLOTS)

    def _group_for(self, store: dist.Store, rank: int, size: int, timeout_s: float) -> SimulatedGroup:
        # torch gives each group's members one store namespace of its own (its name under the store
        # they were given): the group's rank 0 makes the rendezvous, the others find it there.
        if rank == 0:
            with self._rdv_lock:
                token = str(len(self._rendezvous))
                self._rendezvous[token] = _Rendezvous(size, self.abort, self.pace, timeout_s)
            store.set(_RENDEZVOUS_KEY, token)
        else:
            self.pace.release(_ticket())  # rank 0 may be waiting for a slot: hand this one on
            try:
                store.wait([_RENDEZVOUS_KEY])
            finally:
                self.pace.run(self._check_abort, f"rank {rank}, joining a group")
            token = store.get(_RENDEZVOUS_KEY).decode()
        with self._rdv_lock:
            return SimulatedGroup(rank, size, self._rendezvous[token])

    @classmethod
    def _install(cls) -> None:
        """For the simulation's time: the thread-local process-group world (each thread its own
        default group), the backend (registered once per process), and torch's registry of groups
        by name made per rank; `_uninstall` puts torch's own back."""
        with cls._lock:
            try:
                from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld
            except ImportError as e:  # pragma: no cover - every torch >= 2.4 has it
                raise RuntimeError(f"simulated ranks need torch's thread-local process-group world: {e}") from None
            c10d = dist.distributed_c10d
            cls._torch_own = {name: getattr(c10d, name) for name in
                              ("_world", "_register_process_group", "_unregister_process_group",
                               "_unregister_all_process_groups", "_resolve_process_group")}
            c10d._world = ThreadLocalWorld()
            # torch registers every group under its name in one registry of the process; every
            # simulated rank names its groups alike (the names key the store's namespaces, where a
            # group's ranks meet), so each rank's entries are kept under a name of its own.
            register, unregister, resolve = (c10d._register_process_group, c10d._unregister_process_group,
                                              c10d._resolve_process_group)

            def own(name: str) -> str:
                sim = getattr(_thread, "simulation", None)
                return name if sim is None else f"{name}@simulation{id(sim)}.rank{_thread.rank}"

            def register_own(name, pg):
                _thread.__dict__.setdefault("registered", set()).add(name)
                return register(own(name), pg)

            def unregister_own(name):
                _thread.__dict__.setdefault("registered", set()).discard(name)
                return unregister(own(name))

            def unregister_all(unregister_all=c10d._unregister_all_process_groups):
                if getattr(_thread, "simulation", None) is None:
                    return unregister_all()
                for name in list(getattr(_thread, "registered", ())):
                    unregister_own(name)

            c10d._register_process_group = register_own
            c10d._unregister_process_group = unregister_own
            c10d._unregister_all_process_groups = unregister_all
            c10d._resolve_process_group = lambda name: resolve(own(name))
            if not cls._installed:
                dist.Backend.register_backend(BACKEND, Simulation._create, devices=["cpu"])
                cls._installed = True

    @classmethod
    def _uninstall(cls) -> None:
        with cls._lock:
            for name, value in cls._torch_own.items():
                setattr(dist.distributed_c10d, name, value)

    @staticmethod
    def _create(store, rank, size, timeout):
        sim = getattr(_thread, "simulation", None)
        if sim is None:
            raise RuntimeError(f"the {BACKEND!r} process-group backend runs only in a simulated rank's thread "
                               f"(harness/run/simulated.py)")
        # The group's timeout (init_process_group's, torch's default else), as a real group's.
        return sim._group_for(store, rank, size, timeout.total_seconds())

    def _check_abort(self) -> None:
        if self.abort.is_set():
            raise SimulationAborted("another simulated rank failed")

    def cancel(self) -> None:
        """Stop every rank at its next collective (it raises SimulationAborted): a rank failed."""
        self.abort.set()
        with self._rdv_lock:
            for rdv in self._rendezvous.values():
                rdv.broken()
        self.pace.abort()

    def init_rank(self) -> None:
        """This thread's default process group (a simulated rank's thread only)."""
        dist.init_process_group(BACKEND, store=dist.PrefixStore("world", self.store), rank=_thread.rank,
                                world_size=self.world_size)

    def run(self, fn: Callable[[int], Any], init: bool = True) -> list[Any]:
        with Simulation._lock:
            if Simulation._current is not None:
                raise RuntimeError("one simulation at a time in a process")
            Simulation._current = self
        self._install()
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException | None] = [None] * self.world_size

        def rank_main(rank: int) -> None:
            _thread.simulation, _thread.rank = self, rank
            try:
                self.pace.run(self._check_abort, f"rank {rank}, starting")
                if init:
                    self.init_rank()
                results[rank] = fn(rank)
            except BaseException as e:
                errors[rank] = e
                self.cancel()
            finally:
                if dist.is_initialized():
                    try:
                        dist.destroy_process_group()
                    except Exception:  # a failed rank's group: the error above is the one to see
                        pass
                self.pace.release(_ticket())

        threads = [threading.Thread(target=rank_main, args=(r,), name=f"simulated-rank-{r}", daemon=True)
                   for r in range(self.world_size)]
        stop_watch = threading.Event()
        watcher = threading.Thread(target=self.pace.watch, args=(stop_watch,), name="simulated-pace", daemon=True)
        try:
            watcher.start()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            stop_watch.set()
            self._uninstall()
            with Simulation._lock:
                Simulation._current = None
        self.errors = errors
        first = first_failure(errors)
        if first is not None:
            error = errors[first]
            raise RuntimeError(f"simulated rank {first} of {self.world_size} failed: {type(error).__name__}: "
                               f"{error}") from error
        return results


def first_failure(errors: list[BaseException | None]) -> int | None:
    """The rank whose own error ended the simulation (not one stopped by another's), else the first
    that failed at all."""
    own = [r for r, e in enumerate(errors) if e is not None and not isinstance(e, SimulationAborted)]
    failed = [r for r, e in enumerate(errors) if e is not None]
    return (own or failed or [None])[0]


def current() -> tuple["Simulation", int] | None:
    """(the simulation, this thread's rank) in a simulated rank's thread, else None."""
    sim = getattr(_thread, "simulation", None)
    return None if sim is None else (sim, _thread.rank)


@contextlib.contextmanager
def blocking() -> Iterator[None]:
    """Around a wait outside any collective (a store's): a simulated rank hands its slot on while
    it waits and queues for one after (`_Pace`); elsewhere nothing."""
    sim = current()
    if sim is None:
        yield
        return
    simulation, rank = sim
    simulation.pace.release(_ticket())
    try:
        yield
    finally:
        simulation.pace.run(simulation._check_abort, f"rank {rank}, after a wait outside the collectives")


def simulate(world_size: int, fn: Callable[[int], Any]) -> list[Any]:
    """fn(rank) on `world_size` simulated ranks ([Note: Simulated ranks]); their results in rank order."""
    return Simulation(world_size).run(fn)


# -- the launcher ---------------------------------------------------------------------------------
# [Note: A simulated launch]
# `python -m harness.run.simulated --world-size W --log-dir D -m <module> <args>` is what torchrun is
# to a launch of real ranks (harness/run/launch.py starts it the same way, in a session of its own,
# killed by the same launch id): it runs `<module>.main([module, *args])` on W simulated ranks and
# leaves the same things behind. Each rank's standard streams go to D/simulated/attempt_0/<rank>/
# {stdout,stderr}.log (opened when the rank first writes: W = 1024 ranks are 2048 files otherwise),
# a failing rank's traceback into its own stderr; the process's own output (the launcher log) ends
# with torchrun's "Root Cause (first observed failure)" lines naming the rank whose own error ended
# the launch; SIGUSR1 dumps every thread's stack into rank 0's stderr (the launcher's timeout).


class _RankStreams:
    """sys.stdout or sys.stderr of a simulated launch: each rank's thread writes its own log file."""

    def __init__(self, log_dir: Path, stream: str, fallback) -> None:
        self.log_dir, self.stream, self.fallback = log_dir, stream, fallback
        self.files: dict[int, Any] = {}
        self.lock = threading.Lock()

    def file_of(self, rank: int):
        with self.lock:
            f = self.files.get(rank)
            if f is None:
                path = self.log_dir / str(rank) / f"{self.stream}.log"
                path.parent.mkdir(parents=True, exist_ok=True)
                f = self.files[rank] = open(path, "a", buffering=1, encoding="utf-8", errors="replace")
            return f

    def write(self, text: str) -> int:
        sim = current()
        return (self.fallback if sim is None else self.file_of(sim[1])).write(text)

    def flush(self) -> None:
        sim = current()
        (self.fallback if sim is None else self.file_of(sim[1])).flush()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name):  # encoding, errors, fileno ...: the process's own stream's
        return getattr(self.fallback, name)


def main(argv: list[str]) -> int:
    import argparse
    import faulthandler
    import importlib
    import signal
    import traceback

    from harness.run import lifeline

    parser = argparse.ArgumentParser(prog="python -m harness.run.simulated")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("-m", dest="module", required=True)
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    lifeline.die_with_launch()
    lifeline.name_process(f"{lifeline.RANK_NAME_PREFIX}sim")  # the launcher's SIGUSR1 finds it
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    log_dir = ns.log_dir / "simulated" / "attempt_0"
    out, err = _RankStreams(log_dir, "stdout", sys.stdout), _RankStreams(log_dir, "stderr", sys.stderr)
    faulthandler.enable(file=err.file_of(0))
    faulthandler.register(signal.SIGUSR1, file=err.file_of(0), all_threads=True)
    sys.stdout, sys.stderr = out, err
    module = importlib.import_module(ns.module)
    sim = Simulation(ns.world_size)
    codes: list[int] = [0] * ns.world_size

    def rank_main(rank: int) -> int:
        try:
            code = module.main([ns.module, *ns.args])
        except SimulationAborted as e:
            print(f"[simulated rank {rank}] stopped: {e}", file=sys.stderr, flush=True)
            raise
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            raise
        codes[rank] = int(code or 0)
        return codes[rank]

    try:
        sim.run(rank_main, init=False)
    except RuntimeError:
        pass  # each rank wrote its own error; the summary below names the first
    first = first_failure(sim.errors)
    if first is None:
        first = next((r for r, c in enumerate(codes) if c), None)
    sys.stdout, sys.stderr = out.fallback, err.fallback
    if first is not None:
        print(f"simulated launch of {ns.world_size} ranks failed\nRoot Cause (first observed failure):\n"
              f"  rank      : {first}\n  exitcode  : {codes[first] or 1}", flush=True)
        return 1
    return 0


__all__: Sequence[str] = ("BACKEND", "Simulation", "SimulatedGroup", "SimulationAborted", "blocking", "current",
                          "first_failure", "simulate")


if __name__ == "__main__":
    # The module the ranks import (harness.run.simulated), not this __main__ copy of it: its thread
    # state is the one `current()` reads.
    from harness.run.simulated import main as simulated_main

    sys.exit(simulated_main(sys.argv[1:]))
