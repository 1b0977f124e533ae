"""The rank runtime: the prologue, the first thing every rank does whichever verb launched it
(run, fuzz, mutants and bench all launch through harness/run/launch.py), and the training step
the matrix worker and the fuzz worker both run (`train_step`).

Each rank dies with torchrun and with the harness ([Note: No survivors] in
harness/run/lifeline.py), dumps every thread's stack on SIGUSR1 (the launcher's timeout), pins
its intra-op threads and joins the process group. The environment variables read here are
torchrun's own (LOCAL_RANK, and RANK, WORLD_SIZE, MASTER_* inside init_process_group).
"""

from __future__ import annotations

import faulthandler
import ctypes
import ctypes.util
import gc
import os
import signal
from datetime import timedelta
from typing import Callable, NamedTuple, TypeVar

import torch
import torch.distributed as dist

from harness.adapters.base import Adapter, RankContext, takes_after_clip
from harness.adapters.local_step import forward_backward
from harness.run import dist_faults, lifeline, simulated
from harness.run.collectives import CollectiveLedger, window
from harness.run.snapshot import digest

T = TypeVar("T")


def rank_prologue(threads: int, backend: str | None = "gloo", device: str = "cpu",
                  collective_timeout_s: float | None = None) -> RankContext:
    """This rank's context in the world group, after the steps above. A simulated rank (a thread of
    a simulated launch, [Note: A simulated launch] in harness/run/simulated.py) only joins its
    group: its launcher did the rest once for the process."""
    sim = simulated.current()
    if sim is not None:
        if backend != simulated.BACKEND or device != "cpu":
            raise RuntimeError(f"a simulated rank runs the {simulated.BACKEND!r} backend on the CPU, not "
                               f"{backend!r} on {device!r}")
        sim[0].init_rank()
        return RankContext(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, torch.device("cpu"))
    lifeline.die_with_launch()  # dies with torchrun and with the harness, SIGKILL included
    # A forked rank's command line and /proc environ are its fork server's ([Note: Forked ranks]):
    # its name says which rank it is.
    lifeline.name_process(f"{lifeline.RANK_NAME_PREFIX}{os.environ.get('RANK', '')}")
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(threads)
    rank_device = torch.device("cpu")
    if device == "cuda":  # one rank per GPU of this node
        rank_device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(rank_device)
        # The shadow replays each rank's local computation bitwise (docs/error_model.md): kernels
        # must not depend on atomics or autotuning.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    if backend is None:  # a process that joins no group itself (the fuzzer's simulated pool: its ranks do)
        return RankContext(0, 1, None, rank_device)
    if collective_timeout_s is None:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, timeout=timedelta(seconds=collective_timeout_s))
    return RankContext(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, rank_device)


def rank_epilogue() -> None:
    """The last thing every rank does before returning from main: leave the process group, then
    freeze the objects alive now out of the cyclic garbage collector. Interpreter exit still runs
    every atexit hook and tears every module down (a rank that raises, exits non-zero or hangs
    there still fails its launch); it skips only the final collection's walk over the million
    objects torch and torch._dynamo leave, about a second of CPU per rank, eight ranks on two cores.
    (A forked rank runs the atexit hooks in harness/run/prefork.py and ends without the teardown.)"""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.freeze()


def release_freed_memory() -> None:
    """Hand the memory freed so far back to the system (glibc's malloc_trim; nothing elsewhere).
    torch's CPU tensors below glibc's mmap threshold (every one under the launch's MALLOC_ENV;
    those below `returned_block_threshold` in ranks that judge: harness/run/launch.py) come from the heap, where a
    judged step's model-sized temporaries, freed, stay in the process's RSS as free chunks between live ones: 2-3 GB of a GPT-2 of 16.8M parameters judged
    on its rank (issue 31). That memory goes back between cells, after each judged step, and after
    the passes that free most within a step: the replay's step, the lock-step reference's step and
    the noise's measure (GPT-2 d384 at W = 2: the ranks' peak RSS 1785 / 1714 -> 1739 / 1668 MiB,
    the run's wall unchanged)."""
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _trim = False
    if _trim:
        _trim(0)


_trim = None


def evidence_copy(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached CPU copies of what an adapter handed back as evidence: an adapter may return its live
    parameters or gradients, which the next step changes in place under the recorded values."""
    return {n: t.detach().to("cpu", copy=True) for n, t in tensors.items()}


def pick_evidence(tensors: dict[str, torch.Tensor], names: list[str], what: str) -> dict[str, torch.Tensor]:
    """`evidence_copy` of the plain model's `names` out of what an adapter handed back (a full state
    dict also names every alias of a tied parameter); RuntimeError naming `what` when one is missing."""
    missing = [n for n in names if n not in tensors]
    if missing:
        raise RuntimeError(f"{what} lack parameters {missing[:4]} (has {sorted(tensors)[:4]}...); the adapter must "
                           f"use the plain model's names")
    return evidence_copy({n: tensors[n] for n in names})


def pick_grads(tensors: dict[str, torch.Tensor], grad_names: list[str], known_names: set[str],
               what: str) -> dict[str, torch.Tensor]:
    """`evidence_copy` of the gradients of the plain model's trainable `grad_names` an adapter handed
    back. A name it left out had no gradient this step, as `p.grad is None` in the plain model, and is
    absent from the result: the judge decides whether the plain model had one ([Note: Parameters
    without a gradient] in harness/judge/diff.py). A name that is no parameter of the plain model at
    all (`known_names`: every name, aliases of tied parameters included) raises RuntimeError naming
    `what`: the adapter's names are wrong."""
    unknown = sorted(set(tensors) - known_names)
    if unknown:
        raise RuntimeError(f"{what} name {unknown[:4]}, which are no parameters of the plain model (it has "
                           f"{sorted(known_names)[:4]}...); the adapter must use the plain model's names")
    return evidence_copy({n: tensors[n] for n in grad_names if n in tensors})


# The replicas digest of a gradient a rank does not have (digests are 52-bit, never negative).
NO_GRADIENT_DIGEST = -1


def replica_digests(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], grad_names: list[str]) -> dict:
    """This rank's replicas evidence: {"names": parameter names in the dict's order, then "<name> (grad)"
    for each of `grad_names` (the plain model's trainable parameters: the same list on every rank, so
    every rank's digests line up), "digests": a 52-bit digest of each, NO_GRADIENT_DIGEST for a
    gradient this rank does not have}; every rank's must agree bitwise (the replicas check)."""
    return {"names": list(params) + [f"{n} (grad)" for n in grad_names],
            "digests": [digest(t) for t in params.values()]
                       + [digest(grads[n]) if n in grads else NO_GRADIENT_DIGEST for n in grad_names]}


class Step(NamedTuple):
    """What one training step leaves: the local loss, the evidence taken before the optimizer,
    and the clip norm the implementation computed (None: no clipping, or not reported)."""

    loss: torch.Tensor
    evidence: object
    clip_norm: float | None
    clipped: object = None  # `clipped_evidence()` taken after clipping, before the step (None: not taken)


def train_step(adapter: Adapter, model: torch.nn.Module, optim: torch.optim.Optimizer, loss_fn, inputs, targets,
               num_micro: int, features, evidence: Callable[[], T] | None = None,
               sync_every_micro: bool = False, clipped_evidence: Callable[[], object] | None = None,
               ledger: CollectiveLedger | None = None) -> Step:
    """One training step through the adapter: zero the gradients, forward and backward over
    `num_micro` micro-batches (gradients synced on the last one only, or on every one with
    `sync_every_micro`), `evidence()` taken after backward and before the optimizer (the averaged
    gradients), then the optimizer step (clipping included). Returns (local loss, evidence, clip norm).
    With a `ledger`, the adapter's own work is counted ([Note: Collective ledger]), not the evidence."""
    with window(ledger):
        adapter.zero_grad(model, optim)
    if num_micro > 1 and sync_every_micro:
        # The wrapped model as it is: every micro-batch syncs (the adapter's own forward_backward
        # syncs the last one only); the adapter's collective faults armed as its step arms them.
        with dist_faults.armed(adapter), window(ledger):
            loss = forward_backward(model, loss_fn, inputs, targets, num_micro)
    else:
        with window(ledger):
            loss = adapter.forward_backward(model, loss_fn, inputs, targets, num_micro)
    seen = evidence() if evidence is not None else None
    clipped = []
    if clipped_evidence is not None and features.clip_norm_type is not None and takes_after_clip(adapter):
        def take_clipped() -> None:
            clipped.append(clipped_evidence())
        with window(ledger):
            norm = adapter.optimizer_step(model, optim, features,
                                          ledger.paused(take_clipped) if ledger is not None else take_clipped)
    else:
        with window(ledger):
            norm = adapter.optimizer_step(model, optim, features)
    return Step(loss, seen, None if norm is None else float(norm), clipped[0] if clipped else None)
