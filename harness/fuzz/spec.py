"""The fuzzer's drawn models: frozen, JSON-serialisable specs and the modules they build.

A `ModelSpec` is a stack of blocks feeding a linear head. Each block is one candidate unit: a
Linear, optionally a second square Linear whose weight is tied to a third (two names, one
parameter, one unit), a 1-D auxiliary parameter of any numel (the knob that puts a unit's flat
numel at W*k - 1, W*k, W*k + 1, a prime or below W), a 0-d gain, a frozen weight, a fan-out
(one tensor feeding three square Linears and a residual, as x -> q, k, v and x + ...), a parameter
the forward never reads, and an optional nested block that is wrapped before it. Blocks not
marked `wrap` hand their parameters to the nearest wrapped ancestor (the root at the top).

The fan-out and the unused parameter came after the corpus and the pinned counterexamples: a
spec without them serialises as before (`ModelSpec.to_json` leaves them out when off).

The spec becomes a `cases.catalog.Case`, so the worker's shadow reference and the harness's
checks (`harness.judge.diff.check_snapshot`) apply to it unchanged.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from cases.catalog import Case, OptimizerSpec
from cases.data import DATA_MODES, regression_batch

MAX_NESTING = 3


@dataclass(frozen=True)
class BlockSpec:
    width: int  # out_features of the block's Linear
    bias: bool = True
    tied: bool = False  # a square Linear applied twice under two names ('mix', 'mix_t')
    aux_numel: int = 0  # 0: none; else a 1-D parameter of exactly this numel
    gain: bool = False  # a 0-d parameter
    frozen: bool = False  # the Linear's weight does not train
    fan_out: bool = False  # h feeds 'q', 'k', 'v' (square Linears, no bias) and a residual: 4 consumers
    unused: bool = False  # a 1-D parameter 'unused' of `width` elements that the forward never reads
    wrap: bool = True  # a unit of its own (else its parameters go to the enclosing unit)
    inner: BlockSpec | None = None  # a nested block, wrapped (if `wrap`) before this one

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"BlockSpec width={self.width} must be >= 1")
        if self.aux_numel < 0:
            raise ValueError(f"BlockSpec aux_numel={self.aux_numel} must be >= 0")
        if self.depth > MAX_NESTING:
            raise ValueError(f"BlockSpec nesting depth={self.depth} > MAX_NESTING={MAX_NESTING}")

    @property
    def depth(self) -> int:
        return 1 + (self.inner.depth if self.inner is not None else 0)


@dataclass(frozen=True)
class ModelSpec:
    """Everything one fuzz example trains; `world_size` is part of it (the padding depends on it)."""

    world_size: int
    in_features: int
    out_features: int
    blocks: tuple[BlockSpec, ...]
    optimizer: OptimizerSpec
    steps: int = 2
    batch_per_rank: int = 2  # global batch = world_size * batch_per_rank
    accumulation: int = 1  # micro-batches per step
    sync_every_micro: bool = True  # reduce every micro-batch's gradient; False: only the last one's
    data_mode: str = "split"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("world_size", "in_features", "out_features", "steps", "batch_per_rank", "accumulation"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelSpec {name}={getattr(self, name)} must be >= 1")
        if self.data_mode not in DATA_MODES:
            raise ValueError(f"ModelSpec data_mode={self.data_mode!r} is not one of {DATA_MODES}")
        local = self.batch_per_rank if self.data_mode == "split" else self.global_batch
        if local % self.accumulation:
            raise ValueError(f"ModelSpec local batch={local} does not divide by accumulation={self.accumulation}")

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_per_rank

    def to_json(self) -> str:
        d = asdict(self)
        d["blocks"] = [_block_to_dict(b) for b in d["blocks"]]
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | dict) -> ModelSpec:
        d = json.loads(text) if isinstance(text, str) else dict(text)
        opt = d["optimizer"]
        d["optimizer"] = OptimizerSpec(**{**opt, "betas": tuple(opt.get("betas", (0.9, 0.999)))})
        d["blocks"] = tuple(_block_from_dict(b) for b in d["blocks"])
        return cls(**d)


# Block options added after specs were first pinned, with their off value: left out of the JSON
# when off, so every spec drawn or written before them keeps its exact text (replay commands,
# counterexample files, the judged-ahead keys of fuzz/main.py).
_LATER_BLOCK_OPTIONS = {"fan_out": False, "unused": False}


def _block_to_dict(d: dict) -> dict:
    inner = d["inner"]
    d = {k: v for k, v in d.items() if k not in _LATER_BLOCK_OPTIONS or v != _LATER_BLOCK_OPTIONS[k]}
    return {**d, "inner": _block_to_dict(inner) if inner is not None else None}


def _block_from_dict(d: dict) -> BlockSpec:
    inner = d.get("inner")
    return BlockSpec(**{**d, "inner": _block_from_dict(inner) if inner is not None else None})


class FuzzBlock(nn.Module):
    def __init__(self, in_features: int, spec: BlockSpec) -> None:
        super().__init__()
        self.spec = spec
        self.lin = nn.Linear(in_features, spec.width, bias=spec.bias)
        if spec.frozen:
            self.lin.weight.requires_grad_(False)
        if spec.tied:
            self.mix = nn.Linear(spec.width, spec.width, bias=False)
            self.mix_t = nn.Linear(spec.width, spec.width, bias=False)
            self.mix_t.weight = self.mix.weight
        if spec.aux_numel:
            self.aux = nn.Parameter(torch.empty(spec.aux_numel))
        if spec.gain:
            self.gain = nn.Parameter(torch.empty(()))
        if spec.fan_out:
            self.q, self.k, self.v = (nn.Linear(spec.width, spec.width, bias=False) for _ in range(3))
        if spec.unused:
            self.unused = nn.Parameter(torch.empty(spec.width))
        self.inner = FuzzBlock(spec.width, spec.inner) if spec.inner is not None else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.spec.aux_numel:
                self.aux.uniform_(-1.0, 1.0)
            if self.spec.gain:
                self.gain.uniform_(-0.5, 0.5)
            if self.spec.unused:
                self.unused.uniform_(-1.0, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, in) -> (B, width)
        h = torch.tanh(self.lin(x))
        if self.spec.tied:
            h = self.mix_t(torch.tanh(self.mix(h)))
        if self.spec.fan_out:  # h's gradient: a sum over its four consumers, in autograd's order
            h = h + torch.tanh(self.q(h)) * torch.tanh(self.k(h)) + 0.5 * self.v(h)
        if self.spec.aux_numel:
            h = h * (1.0 + 0.5 * torch.tanh(self.aux).mean())
        if self.spec.gain:
            h = h * (1.0 + self.gain)
        if self.inner is not None:
            h = self.inner(h)
        return h


class FuzzModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        blocks, width = [], spec.in_features
        for block in spec.blocks:
            blocks.append(FuzzBlock(width, block))
            width = _out_width(block)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(width, spec.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, in) -> (B, out)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _out_width(block: BlockSpec) -> int:
    return _out_width(block.inner) if block.inner is not None else block.width


def wrap_paths(spec: ModelSpec) -> tuple[str, ...]:
    """Sub-modules to wrap before the root, innermost first."""
    paths = []

    def visit(block: BlockSpec, path: str) -> None:
        if block.inner is not None:
            visit(block.inner, f"{path}.inner")
        if block.wrap:
            paths.append(path)

    for i, block in enumerate(spec.blocks):
        visit(block, f"blocks.{i}")
    return tuple(paths)


def build_model(spec: ModelSpec) -> nn.Module:
    return FuzzModel(spec)


def init_state(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The one reference initial state every rank and the reference load."""
    with torch.random.fork_rng(devices=[]):
        # The CPU generator alone: torch.manual_seed also queues seeds for every accelerator
        # backend, a few ms per call here, for a model built on the CPU.
        torch.default_generator.manual_seed(spec.seed)
        model = build_model(spec)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def as_case(spec: ModelSpec) -> Case:
    """The spec as a catalog-style Case (never registered): what the shadow and the checks read."""
    return Case(
        name="fuzz",
        description="a model drawn by the fuzzer",
        build_model=functools.partial(build_model, spec),
        wrap=wrap_paths(spec),
        make_batch=regression_batch(spec.in_features, spec.out_features),
        loss_fn=F.mse_loss,
        optimizers=(spec.optimizer,),
        steps=spec.steps,
        global_batch=spec.global_batch,
        data_modes=(spec.data_mode,),
        world_sizes=(spec.world_size,),
        seed=spec.seed,
    )


def describe(spec: ModelSpec) -> str:
    """One line per wrapped unit: its flat numel against W (what the padding sees)."""
    model = build_model(spec)
    units = ("",) + tuple(reversed(wrap_paths(spec)))
    owned: dict[str, list[tuple[str, int, bool]]] = {u: [] for u in units}
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        unit = max((u for u in units if u == "" or name.startswith(u + ".")), key=len)
        owned[unit].append((name, p.numel(), p.requires_grad))
    w = spec.world_size
    lines = []
    for unit in units:
        for trainable in (True, False):
            numel = sum(n for _, n, t in owned[unit] if t == trainable)
            if numel:
                kind = "" if trainable else " frozen"
                lines.append(f"  unit '{unit or '<root>'}'{kind}: numel={numel} = {w}*{numel // w}+{numel % w} "
                             f"(shard_numel={-(-numel // w)}, padding={-(-numel // w) * w - numel})")
    return "\n".join(lines)
