"""Evidence is complete or it is an error: a snapshot is checked against the plan before the
judge reads it (harness/judge/verdict.py). A check that compared a truncated snapshot would pass on
whatever it was given, so every shortfall here names what is missing instead.
"""

from __future__ import annotations

import torch

from cases.catalog import get_case
from harness.run.plan import Cell


class EvidenceError(ValueError):
    """A snapshot that does not hold what the plan asked for (the cell becomes an `error`)."""


def model_parameters(case_name: str) -> tuple[dict[str, torch.Size], list[str]]:
    """(name -> size of every parameter, names of the trainable ones) of the case's plain model."""
    params = list(get_case(case_name).build_shapes().named_parameters())
    return {n: p.shape for n, p in params}, [n for n, p in params if p.requires_grad]


def model_buffers(case_name: str) -> dict[str, torch.Size]:
    """name -> size of every buffer of the case's plain model, persistent or not."""
    return {n: b.shape for n, b in get_case(case_name).build_shapes().named_buffers()}


def _buffers(what: str, evidence, sizes: dict[str, torch.Size], world_size: int) -> None:
    """{"values": {name: tensor} (rank 0's), "digests": (W, len(values)) every rank's}."""
    if not isinstance(evidence, dict) or not isinstance(evidence.get("digests"), torch.Tensor):
        raise EvidenceError(f"{what} buffers are missing (the adapter's full_buffers and every rank's digests)")
    _names(f"{what} buffers", evidence.get("values"), list(sizes))
    _shapes(f"{what} buffer", evidence["values"], sizes)
    if tuple(evidence["digests"].shape) != (world_size, len(sizes)):
        raise EvidenceError(f"{what} buffer digests are {tuple(evidence['digests'].shape)}, expected one per rank and "
                            f"buffer ({world_size}, {len(sizes)})")


def _names(what: str, got, expected: list[str]) -> None:
    if not isinstance(got, dict):
        raise EvidenceError(f"{what} is {type(got).__name__}, not a dict of named tensors")
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing or extra:
        raise EvidenceError(f"{what} names differ from the model's parameters: missing {missing[:4]}, "
                            f"unexpected {extra[:4]} ({len(missing)} missing, {len(extra)} unexpected)")


def _gradient_names(what: str, got, grad_names: list[str]) -> None:
    """Gradients of trainable parameters only; one may be absent: that parameter had no gradient this
    step, which the judge holds against the replay ([Note: Parameters without a gradient] in
    harness/judge/diff.py)."""
    if not isinstance(got, dict):
        raise EvidenceError(f"{what} is {type(got).__name__}, not a dict of named tensors")
    extra = sorted(set(got) - set(grad_names))
    if extra:
        raise EvidenceError(f"{what} name {extra[:4]}, which are not trainable parameters of the model "
                            f"({len(extra)} unexpected)")


def _shapes(what: str, tensors: dict, sizes: dict[str, torch.Size]) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.shape != sizes[name]:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise EvidenceError(f"{what} '{name}' is {shape}, the model's parameter is {tuple(sizes[name])}")


def check_snapshot_evidence(snap: dict, cell: Cell, optimizer: str, run_id: str,
                            sizes: dict[str, torch.Size], grad_names: list[str],
                            buffer_sizes: dict[str, torch.Size]) -> None:
    """Raise EvidenceError unless `snap` is this run's complete evidence for (cell, optimizer):
    `sizes` are the case model's parameters (name -> size), `grad_names` the trainable ones,
    `buffer_sizes` its buffers."""
    if not isinstance(snap, dict):
        raise EvidenceError(f"the snapshot is a {type(snap).__name__}, not a dict")
    if snap.get("run_id") != run_id:
        raise EvidenceError(f"run_id={snap.get('run_id')!r} is not this run's {run_id!r} (evidence of another run)")
    try:
        snap_cell = Cell.from_json(snap["cell"])
    except Exception as e:
        raise EvidenceError(f"its cell record is unreadable ({type(e).__name__}: {e})") from None
    if snap_cell != cell:
        raise EvidenceError(f"it is the snapshot of cell {snap_cell.cell_id}, not of {cell.cell_id}")
    if snap.get("optimizer") != optimizer:
        raise EvidenceError(f"optimizer={snap.get('optimizer')!r}, expected {optimizer!r}")
    if snap.get("world_size") != cell.world_size:
        raise EvidenceError(f"world_size={snap.get('world_size')!r}, the cell runs at {cell.world_size}")
    check_init_evidence(snap.get("init"), sizes, buffer_sizes, cell.world_size)
    steps = snap.get("steps")
    if not isinstance(steps, list):
        raise EvidenceError(f"steps is {type(steps).__name__}, not a list")
    numbers = [rec.get("step") if isinstance(rec, dict) else None for rec in steps]
    if numbers != list(range(1, cell.steps + 1)):
        raise EvidenceError(f"steps {_ranges(numbers)} recorded, the plan has steps 1..{cell.steps}")
    for rec in steps:
        check_step_evidence(rec, cell, sizes, grad_names, buffer_sizes)


def check_init_evidence(init, sizes: dict[str, torch.Size], buffer_sizes: dict[str, torch.Size], world_size: int) -> None:
    """The "init" part of `check_snapshot_evidence`."""
    _names("initial parameters", init.get("params") if isinstance(init, dict) else None, list(sizes))
    _shapes("initial parameter", init["params"], sizes)
    _buffers("initial", init.get("buffers"), buffer_sizes, world_size)


def check_step_evidence(rec: dict, cell: Cell, sizes: dict[str, torch.Size], grad_names: list[str],
                        buffer_sizes: dict[str, torch.Size]) -> None:
    """One step's part of `check_snapshot_evidence` (a rank judging its own evidence checks each
    step as it is taken)."""
    names = list(sizes)
    step = rec["step"]
    loss = rec.get("loss")
    if not isinstance(loss, torch.Tensor) or tuple(loss.shape) != (cell.world_size,):
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise EvidenceError(f"step {step}: loss is {shape}, expected one entry per rank ({cell.world_size},)")
    _names(f"step {step}: parameters", rec.get("params"), names)
    _shapes(f"step {step}: parameter", rec["params"], sizes)
    _gradient_names(f"step {step}: gradients", rec.get("grads"), grad_names)
    _shapes(f"step {step}: gradient", rec["grads"], sizes)
    if rec.get("clipped_grads") is not None:
        _gradient_names(f"step {step}: clipped gradients", rec["clipped_grads"], grad_names)
        _shapes(f"step {step}: clipped gradient", rec["clipped_grads"], sizes)
    for key in ("shards", "shard_grads", "padding_intervals", "shadow", "replicas"):
        if not isinstance(rec.get(key), dict):
            raise EvidenceError(f"step {step}: {key} is missing")
    _buffers(f"step {step}:", rec.get("buffers"), buffer_sizes, cell.world_size)
    _names(f"step {step}: the replay's buffers", rec["shadow"].get("buffers"), list(buffer_sizes))


def check_same_steps(snap: dict, ref: dict, ref_cell: Cell) -> None:
    got, ref_steps = [r["step"] for r in snap["steps"]], [r["step"] for r in ref["steps"]]
    if got != ref_steps:
        raise EvidenceError(f"steps {_ranges(got)} but the reference {ref_cell.cell_id} has steps {_ranges(ref_steps)}")


def _ranges(numbers: list) -> str:
    if not numbers:
        return "none"
    if all(isinstance(n, int) for n in numbers) and numbers == list(range(numbers[0], numbers[0] + len(numbers))):
        return f"{numbers[0]}..{numbers[-1]}"
    return str(numbers[:12]) + ("..." if len(numbers) > 12 else "")
