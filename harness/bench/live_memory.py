"""Live tensor memory through a training step: every storage's bytes from allocation to free.

RSS on the CPU mixes live tensors with allocator slack (freed memory the allocator keeps), so it
cannot say whether a peak comes from tensors an implementation holds too long or from the
allocator. This tracker counts only bytes of storages that are alive, as torch's own
`torch.distributed._tools.mem_tracker` does: a TorchDispatchMode sees every op's outputs (new
storages), a weak reference to each storage reports its free, and `UntypedStorage.resize_` (which
FSDP implementations use to free and re-allocate unsharded buffers in place, and which no dispatch
mode sees) is wrapped while the tracker is active.

Every change is an event (storage id, bytes delta). The peak and its breakdown are computed after
the step by replaying the events, so each storage is classified with everything known by then:
whether it was an input or output of a collective, when it was freed, which phase allocated it,
and the category it was tagged with (parameters, optimizer state, unsharded buffers are tagged by
the caller, who knows the implementation). The same tracker and rules measure every
implementation, so their figures compare.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import wraps

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

PARAMS = "parameters"  # what the optimizer steps: sharded for ZeRO-3, full for the plain model
UNSHARDED_PARAMS = "unsharded parameters"  # gathered copies for compute
GRADIENTS = "gradients"  # what ends up in .grad for the optimizer
GRADIENTS_IN_FLIGHT = "gradients in flight"  # parameter-sized gradients of backward not (yet) in .grad
OPTIMIZER_STATE = "optimizer state"
ACTIVATIONS = "activations"  # allocated in forward, alive when backward starts
COMMUNICATION = "communication buffers"
TEMPORARIES = "temporaries"
INPUTS = "inputs and buffers"
CATEGORIES = (PARAMS, UNSHARDED_PARAMS, GRADIENTS, GRADIENTS_IN_FLIGHT, OPTIMIZER_STATE, ACTIVATIONS, COMMUNICATION,
              TEMPORARIES, INPUTS)
STATE = (PARAMS, GRADIENTS, OPTIMIZER_STATE)  # divided by W in an ideal ZeRO-3

def _holds_memory(t) -> bool:
    """Plain tensors own storages; subclasses (DTensor wrappers, the fake tensors DTensor's
    sharding propagation runs on) and meta tensors do not."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type != "meta"


@dataclass
class StorageRecord:
    id: int
    phase: str  # the phase that allocated it ("before" for storages tracked on entry)
    numel: int  # elements of the tensor that first showed the storage
    op: str  # the op whose output first showed it ("track" for tensors that existed before)
    tag: str | None = None  # a category the caller assigned
    comm: bool = False  # an argument of a collective at some point
    partial_view: bool = False  # first seen through a view smaller than the storage
    freed_at: int | None = None  # event index of its free


@dataclass
class Breakdown:
    """Bytes live at one instant, by category."""

    total: int
    by_category: dict[str, int]
    event: int  # index in the event log
    phase: str
    weighted: float | None = None  # weighted_peak's objective at this instant


class LiveMemory(TorchDispatchMode):
    """`with LiveMemory() as mem: ...`; `mem.phase("forward")` marks phases; `mem.track(t, category)`."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []  # (record id, bytes delta)
        self.phases: list[tuple[int, str]] = []  # (first event index, phase name)
        self.records: list[StorageRecord] = []
        self._ids: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> record id
        self._nbytes: dict[int, int] = {}  # record id -> current bytes (live records only)
        self._weakrefs: dict[int, weakref.ref] = {}
        self._orig_resize = None
        self._phase = "before"

    # -- recording -----------------------------------------------------------------------------
    def phase(self, name: str) -> None:
        self._phase = name
        self.phases.append((len(self.events), name))

    def _record(self, storage: torch.UntypedStorage, numel: int, op: str = "track") -> StorageRecord:
        rid = self._ids.get(storage)
        if rid is not None:
            self._resized(rid, storage.nbytes())
            return self.records[rid]
        rid = len(self.records)
        rec = StorageRecord(rid, self._phase, numel, op)
        self.records.append(rec)
        self._ids[storage] = rid
        self._nbytes[rid] = storage.nbytes()
        self._weakrefs[rid] = weakref.ref(storage, lambda _, rid=rid: self._freed(rid))
        if storage.nbytes():
            self.events.append((rid, storage.nbytes()))
        return rec

    def _resized(self, rid: int, nbytes: int) -> None:
        delta = nbytes - self._nbytes[rid]
        if delta:
            self._nbytes[rid] = nbytes
            self.events.append((rid, delta))

    def _freed(self, rid: int) -> None:
        nbytes = self._nbytes.pop(rid, 0)
        self.records[rid].freed_at = len(self.events)
        if nbytes:
            self.events.append((rid, -nbytes))

    def track(self, tensor: torch.Tensor, tag: str | None = None) -> None:
        """Count a tensor that exists already (and tag it; a later tag wins)."""
        if not _holds_memory(tensor):
            raise TypeError(f"track() takes a plain tensor holding memory, got {type(tensor).__name__} on "
                            f"{tensor.device}; pass a DTensor's local tensor")
        rec = self._record(tensor.untyped_storage(), tensor.numel())
        if tag is not None:
            rec.tag = tag

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # DTensor runs first and calls back with its local tensors, which hold the memory; the
            # wrapper's own storage is a placeholder of the global size.
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if _holds_memory(t):
                storage = t.untyped_storage()
                known = storage in self._ids
                rec = self._record(storage, t.numel(), str(func))
                if not known and t.numel() * t.element_size() < storage.nbytes():
                    rec.partial_view = True
        if func.namespace == "c10d":
            for t in tree_flatten((args, kwargs))[0]:
                if _holds_memory(t):
                    self._record(t.untyped_storage(), t.numel(), str(func)).comm = True
        return out

    def __enter__(self):
        self._orig_resize = torch.UntypedStorage.resize_
        orig = self._orig_resize

        @wraps(orig)
        def resize_(storage, size):
            result = orig(storage, size)
            rid = self._ids.get(storage)
            if rid is not None and rid in self._nbytes:
                self._resized(rid, storage.nbytes())
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)

    # -- analysis ------------------------------------------------------------------------------
    def phase_at(self, event: int) -> str:
        name = "before"
        for start, phase in self.phases:
            if start <= event:
                name = phase
        return name

    def phase_start(self, name: str) -> int:
        return next(start for start, phase in self.phases if phase == name)

    def classify(self, rec: StorageRecord, grad_numels: frozenset[int]) -> str:
        """The category of one storage, with everything known after the step.

        Tags win (the caller tags parameters, optimizer state, unsharded buffers and, after
        backward, the storages behind .grad). A storage first seen through a smaller view was
        allocated inside a backend and is a communication buffer. Otherwise: allocated in backward with a parameter's
        (or a flat parameter's) numel is a gradient in flight; an argument of a collective is a
        communication buffer; allocated in forward and still alive when backward starts is an
        activation; anything else is a temporary.
        """
        if rec.tag is not None:
            return rec.tag
        if rec.partial_view:
            # Allocated where the dispatcher does not show it (gloo's reduce-scatter copies its
            # input inside the backend; a view of that copy is the first tensor we see).
            return COMMUNICATION
        if rec.phase == "backward" and rec.numel in grad_numels:
            return GRADIENTS_IN_FLIGHT
        if rec.comm:
            return COMMUNICATION
        if rec.phase == "forward":
            backward = self.phase_start("backward") if any(p == "backward" for _, p in self.phases) else None
            if backward is not None and (rec.freed_at is None or rec.freed_at > backward):
                return ACTIVATIONS
        return TEMPORARIES

    def peak(self, grad_numels: frozenset[int] = frozenset(), start_phase: str | None = None) -> Breakdown:
        """The largest total of live bytes (from `start_phase` on), broken down at that instant."""
        start = self.phase_start(start_phase) if start_phase is not None else 0
        total, best, best_at = 0, -1, start
        for i, (_, delta) in enumerate(self.events):
            total += delta
            if i >= start and total > best:
                best, best_at = total, i
        return self.breakdown_at(best_at, grad_numels)

    def weighted_peak(self, weights: dict[str, float], grad_numels: frozenset[int] = frozenset()) -> Breakdown:
        """The instant maximising sum over categories of weight * live bytes (weight 1 unless given),
        e.g. the plain model's timeline with its state divided by W; `.weighted` holds that sum."""
        category = [self.classify(rec, grad_numels) for rec in self.records]
        weighted, best, best_at = 0.0, float("-inf"), 0
        for i, (rid, delta) in enumerate(self.events):
            weighted += weights.get(category[rid], 1.0) * delta
            if weighted > best:
                best, best_at = weighted, i
        out = self.breakdown_at(best_at, grad_numels)
        out.weighted = best
        return out

    def breakdown_at(self, event: int, grad_numels: frozenset[int] = frozenset()) -> Breakdown:
        live: dict[int, int] = {}
        for rid, delta in self.events[: event + 1]:
            live[rid] = live.get(rid, 0) + delta
        by_category = dict.fromkeys(CATEGORIES, 0)
        for rid, nbytes in live.items():
            if nbytes:
                by_category[self.classify(self.records[rid], grad_numels)] += nbytes
        return Breakdown(sum(by_category.values()), by_category, event, self.phase_at(event))

    def largest_at(self, event: int, grad_numels: frozenset[int] = frozenset(), n: int = 8) -> list[dict]:
        """The `n` largest storages live at `event`: what a peak is made of."""
        live: dict[int, int] = {}
        for rid, delta in self.events[: event + 1]:
            live[rid] = live.get(rid, 0) + delta
        top = sorted((nbytes, rid) for rid, nbytes in live.items() if nbytes)[-n:]
        return [{"bytes": nbytes, "category": self.classify(self.records[rid], grad_numels),
                 "allocated_in": self.records[rid].phase, "numel": self.records[rid].numel, "op": self.records[rid].op,
                 "collective_arg": self.records[rid].comm} for nbytes, rid in reversed(top)]

    def live_bytes(self) -> int:
        return sum(self._nbytes.values())
