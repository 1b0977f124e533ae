"""What a training step sends: its collectives counted at the seam collective faults act on.

[Note: Collective ledger]
A feature a user configures for its memory or traffic (gradient accumulation without sync,
reshard_after_forward=False, NO_SHARD) can be silently not applied while every number stays
legal: the run is then equivalent, and not what was configured. The ledger counts, during the
training step only (zero_grad, forward and backward, clipping, the optimizer step: the window
collective faults are armed in), the collectives an implementation issues through torch's
ProcessGroup (the seam of harness/run/dist_faults.py: every Python collective of torch.distributed
ends in a method of that class) on groups of more than one rank, by phase: each call of
torch.autograd.backward is one backward pass (a micro-batch), and everything else is outside
backward. Per step it yields `LedgerStep`: the backward passes seen, the most elements any pass
but the last reduced (summing reductions of floating tensors: a reduce-scatter's input, an
all-reduce's tensor), the all-gathers issued inside backward, and the all-gathers and
reduce-scatters issued at all. The contracts (harness/judge/contracts.py) hold the configured
features to them.

Counting changes nothing: each wrapper calls torch's own method with the same arguments and
returns its result. The wrappers, installed at a rank's first counted step, stay: each reports to
the ledger counting on the calling thread (`_counting`), if any, so the W simulated ranks of one
process (harness/run/simulated.py, whose groups implement the same methods in Python, wrapped alike)
each count their own collectives. Collectives issued from C++ (DDP's reducer, functional collectives) are not
seen, as collective faults do not see them: an adapter declares the contracts it keeps
(Adapter.contracts), and one whose collectives the seam cannot see declares none.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from harness.judge.contracts import LedgerStep
from harness.run.dist_faults import COLLECTIVE_METHODS, flat_tensors, is_summing

T = TypeVar("T")


def _reduced_elements(layout: str, args: tuple) -> int:
    """The elements a summing reduction takes in: its input tensors."""
    inputs = args[0] if layout == "inplace" else args[1]
    return sum(t.numel() for t in flat_tensors(inputs) if t.is_floating_point())


class CollectiveLedger:
    """Counts one training step's collectives at a time: inside `step()` the collectives and
    backward passes of its thread count, while a `window()` is open (the adapter's zero_grad,
    forward and backward, optimizer step; not the harness's evidence taken between them, nor a
    callback `paused` inside); `taken` holds the step's LedgerStep after."""

    def __init__(self, shard_group: frozenset[int] | None = None) -> None:
        self.shard_group = shard_group  # the ranks a sharded collective must run over (None: not checked)
        self._group_ranks: dict[int, frozenset[int]] = {}
        self._off_group = 0
        self.taken: LedgerStep | None = None
        self._open = 0
        self._reduced: list[int] = []  # per backward pass
        self._in_backward = False
        self._gathers_in_backward = 0
        self._sharded = 0

    def _record(self, group, name: str, args: tuple, kwargs: dict) -> None:
        if not self._open or group.size() <= 1:
            return
        kind, layout = COLLECTIVE_METHODS[name]
        if kind == "gather" or "scatter" in name:
            self._sharded += 1
            self._off_group += self.shard_group is not None and self._ranks_of(group) != self.shard_group
        if kind == "gather":
            self._gathers_in_backward += self._in_backward
            return
        opts = args[-1] if len(args) > 1 else kwargs.get("opts")
        if self._in_backward and is_summing(opts):
            self._reduced[-1] += _reduced_elements(layout, args)

    def _ranks_of(self, group) -> frozenset[int]:
        key = id(group)
        if key not in self._group_ranks:
            self._group_ranks[key] = frozenset(dist.get_process_group_ranks(group))
        return self._group_ranks[key]

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        self._open += 1
        try:
            yield
        finally:
            self._open -= 1

    def paused(self, fn: Callable[[], T]) -> Callable[[], T]:
        """`fn` called with counting off (evidence the harness takes inside an adapter's method)."""
        def call():
            closed, self._open = self._open, 0
            try:
                return fn()
            finally:
                self._open = closed
        return call

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Count the collectives of the windows opened inside, on this thread (a simulated rank's
        own: harness/run/simulated.py); `taken` holds them after."""
        install()
        self._reduced, self._gathers_in_backward, self._sharded, self._off_group = [], 0, 0, 0
        outer = getattr(_counting, "ledger", None)
        _counting.ledger = self
        try:
            yield
        finally:
            _counting.ledger = outer
        self.taken = LedgerStep(len(self._reduced), max(self._reduced[:-1], default=0), self._gathers_in_backward,
                                self._sharded, sharded_off_group=self._off_group)

    def _backward(self, backward, args, kwargs):
        # outside a window, or a nested call (a recomputation's own backward): not a new pass
        if not self._open or self._in_backward:
            return backward(*args, **kwargs)
        self._reduced.append(0)
        self._in_backward = True
        try:
            return backward(*args, **kwargs)
        finally:
            self._in_backward = False


# The ledger counting on this thread, if any: a rank's own (one per thread of a simulated launch).
_counting = threading.local()


def _counted(name: str, original):
    def collective(group, *args, **kwargs):
        ledger = getattr(_counting, "ledger", None)
        if ledger is not None:
            ledger._record(group, name, args, kwargs)
        return original(group, *args, **kwargs)

    collective.__name__ = name
    collective._counts_for_ledger = True
    return collective


def install() -> None:
    """The counting wrappers on torch's ProcessGroup methods, on the simulated group's (which
    implement them in Python: harness/run/simulated.py) and on torch.autograd.backward, where they
    are not already: each reports to the calling thread's counting ledger, if any, then calls what
    it wraps with the same arguments. Called at every ledger step: a seam that put torch's own
    methods back (harness/run/dist_faults.py after its cell) gets them wrapped again."""
    from harness.run.simulated import SimulatedGroup

    for cls in (ProcessGroup, SimulatedGroup):
        for name in COLLECTIVE_METHODS:
            if name in cls.__dict__ and not getattr(cls.__dict__[name], "_counts_for_ledger", False):
                setattr(cls, name, _counted(name, getattr(cls, name)))
    if not getattr(torch.autograd.backward, "_counts_for_ledger", False):
        backward = torch.autograd.backward

        def backward_pass(*args, **kwargs):
            ledger = getattr(_counting, "ledger", None)
            return backward(*args, **kwargs) if ledger is None else ledger._backward(backward, args, kwargs)

        backward_pass._counts_for_ledger = True
        torch.autograd.backward = backward_pass


def window(ledger: CollectiveLedger | None) -> contextlib.AbstractContextManager:
    return ledger.window() if ledger is not None else contextlib.nullcontext()
