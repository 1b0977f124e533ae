"""The public Case API: what a harness cell trains, as frozen, validated dataclasses.

`Case` names a model factory, what is wrapped before the root, a batch factory, a loss, the
optimizers (`OptimizerSpec`, with `ParamGroup`s and an LR scheduler) and which world sizes and data
modes make sense. The built-in cases are in cases/catalog.py; a user's own is loaded from their
file (cases/user.py; README, "Verify your own model"). It imports torch and cases/ only: the
harness decides how to run it.
"""

from __future__ import annotations

import fnmatch
import importlib.util
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.nn as nn

from cases.data import DATA_MODES, Batch
from cases.features import PLAIN, Features

OPTIMIZER_KINDS = ("sgd", "adamw")
# The optimizers the error model covers (harness/reference/tolerance.py); any other has no bound, and a
# loose one would be a check that cannot fail.
SUPPORTED_OPTIMIZERS = "OptimizerSpec('sgd', ...) (torch.optim.SGD) or OptimizerSpec('adamw', ...) (torch.optim.AdamW)"
# Hyperparameters a parameter group may override, and that the error model reads per group.
GROUP_HYPERPARAMETERS = ("lr", "momentum", "betas", "eps", "weight_decay")

WrapPolicy = Callable[[str, nn.Module], bool]  # (fully qualified name, module) -> wrap it as a unit
LRSchedulerFactory = Callable[[torch.optim.Optimizer], "torch.optim.lr_scheduler.LRScheduler"]


@dataclass(frozen=True)
class ParamGroup:
    """Parameters whose names match any of `params` (fnmatch patterns such as '*.bias' or
    'lm.model.embed_tokens.*', or exact names) train with these hyperparameters instead of the
    spec's. A parameter belongs to the first group that matches it; the rest form a last, default
    group with the spec's own values."""

    params: tuple[str, ...]
    lr: float | None = None
    weight_decay: float | None = None
    momentum: float | None = None
    betas: tuple[float, float] | None = None
    eps: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.params, str):
            object.__setattr__(self, "params", (self.params,))
        if not self.params or not all(isinstance(x, str) and x for x in self.params):
            raise ValueError(f"ParamGroup params={self.params!r} must be a non-empty tuple of name patterns")

    def matches(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.params)

    def overrides(self) -> dict:
        return {k: getattr(self, k) for k in GROUP_HYPERPARAMETERS if getattr(self, k) is not None}


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer configuration: torch.optim.SGD ('sgd') or torch.optim.AdamW ('adamw'), the
    two the error model covers. foreach=False: the per-tensor loop applies the same elementwise
    arithmetic to a flat shard as to the full tensor (see docs/error_model.md).

    param_groups: per-group hyperparameters, by parameter name (see ParamGroup). lr_scheduler: a
    factory `optimizer -> torch.optim.lr_scheduler.LRScheduler`, stepped once after every
    optimizer step in every rank and in the reference; schedulers that take one value per group
    see the groups in the order of `param_groups`, then the default group (when it is not empty).
    """

    kind: str
    lr: float
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    param_groups: tuple[ParamGroup, ...] = ()
    lr_scheduler: LRSchedulerFactory | None = None

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZER_KINDS:
            what = self.kind if isinstance(self.kind, str) else getattr(self.kind, "__qualname__", self.kind)
            raise ValueError(f"OptimizerSpec kind={what!r} has no error model; use {SUPPORTED_OPTIMIZERS}")
        object.__setattr__(self, "param_groups", tuple(self.param_groups))
        for i, group in enumerate(self.param_groups):
            if not isinstance(group, ParamGroup):
                raise ValueError(f"OptimizerSpec param_groups[{i}] is a {type(group).__name__}; give "
                                 f"ParamGroup(params=('pattern', ...), lr=..., weight_decay=...)")
        if self.lr_scheduler is not None and not callable(self.lr_scheduler):
            raise ValueError(f"OptimizerSpec lr_scheduler={self.lr_scheduler!r} must be a function "
                             f"optimizer -> LRScheduler (for example lambda opt: StepLR(opt, 2))")
        for where, hyper in [("", self.hyper())] + [(f" param_groups[{i}]", self.hyper(g))
                                                    for i, g in enumerate(self.param_groups)]:
            self._check(where, hyper)

    def _check(self, where: str, h: dict) -> None:
        if not h["lr"] > 0:
            raise ValueError(f"OptimizerSpec kind={self.kind}{where} lr={h['lr']} must be > 0")
        if not 0 <= h["weight_decay"]:
            raise ValueError(f"OptimizerSpec kind={self.kind}{where} weight_decay={h['weight_decay']} must be >= 0")
        if not 0 <= h["momentum"] < 1:
            raise ValueError(f"OptimizerSpec kind={self.kind}{where} momentum={h['momentum']} must be in [0, 1)")
        beta1, beta2 = h["betas"]
        if self.kind == "adamw" and not (0 <= beta1 < 1 and 0 <= beta2 < 1 and h["eps"] > 0):
            raise ValueError(f"OptimizerSpec adamw{where} betas={h['betas']} eps={h['eps']} out of range")

    @property
    def name(self) -> str:
        return self.kind

    def hyper(self, group: ParamGroup | None = None) -> dict:
        """The hyperparameters of `group` (the spec's own for None)."""
        base = {"lr": self.lr, "momentum": self.momentum, "betas": tuple(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay}
        return base if group is None else {**base, **group.overrides()}

    def group_index(self, name: str) -> int:
        """The index into param_groups of the group of parameter `name`; len(param_groups) for the default."""
        for i, group in enumerate(self.param_groups):
            if group.matches(name):
                return i
        return len(self.param_groups)

    def build(self, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        """The optimizer over `params`, every one in the default group (a spec without param_groups)."""
        if self.param_groups:
            raise ValueError(f"OptimizerSpec kind={self.kind} has param_groups: build it with build_grouped")
        return self._optimizer([{"params": list(params), **self.hyper()}])

    def build_grouped(self, params: Iterable[tuple[tuple[str, ...], torch.Tensor]]) -> torch.optim.Optimizer:
        """The optimizer over `params`, each given with the plain model's parameter names it holds
        (one name for a plain parameter, several for a flat parameter of a sharded unit): it joins
        the group of those names, which must be one."""
        members: dict[int, list[torch.Tensor]] = {}
        for names, param in params:
            indices = {self.group_index(n) for n in names}
            if len(indices) != 1:
                by_group = {self._group_label(i): [n for n in names if self.group_index(n) == i][:3] for i in sorted(indices)}
                raise ValueError(f"one parameter holds {list(names)[:4]}... of several param groups {by_group}; a flat "
                                 f"parameter has one learning rate. Fix: wrap so that each unit's parameters "
                                 f"share a group, or group whole units")
            members.setdefault(indices.pop(), []).append(param)
        groups = [{"params": members[i], **self.hyper(self.param_groups[i] if i < len(self.param_groups) else None)}
                  for i in sorted(members)]
        return self._optimizer(groups)

    def _group_label(self, index: int) -> str:
        return f"param_groups[{index}]" if index < len(self.param_groups) else "default"

    def _optimizer(self, groups: list[dict]) -> torch.optim.Optimizer:
        unused = ("betas", "eps") if self.kind == "sgd" else ("momentum",)
        groups = [{k: v for k, v in g.items() if k not in unused} for g in groups]
        if self.kind == "sgd":
            return torch.optim.SGD(groups, lr=self.lr, foreach=False)
        return torch.optim.AdamW(groups, lr=self.lr, foreach=False)

    def build_scheduler(self, optimizer):
        """The spec's LR scheduler on `optimizer`, or None."""
        return self.lr_scheduler(optimizer) if self.lr_scheduler is not None else None


def resolve_wrap(wrap, model: nn.Module) -> tuple[str, ...]:
    """The sub-module paths a case's `wrap` names in `model`, innermost first, root excluded.

    `wrap` is a tuple of module paths ('blocks.0'), of module classes (every sub-module of that
    class), or a mix; or a policy (fqn, module) -> bool. Paths alone keep their given order; classes
    and policies select in post-order (children before their parent, siblings in order), the order
    fully_shard needs for nested units."""
    if callable(wrap) and not isinstance(wrap, type):
        selected = [fqn for fqn, module in _post_order(model) if fqn and wrap(fqn, module)]
        return tuple(selected)
    paths = [w for w in wrap if isinstance(w, str)]
    classes = tuple(w for w in wrap if isinstance(w, type))
    for path in paths:
        try:
            model.get_submodule(path)
        except AttributeError:
            raise ValueError(f"wrap path {path!r} is not a sub-module of {type(model).__name__}; "
                             f"its children: {[n for n, _ in model.named_children()]}") from None
    if not classes:
        return tuple(paths)
    chosen = set(paths) | {fqn for fqn, module in model.named_modules() if fqn and isinstance(module, classes)}
    missing = [c.__name__ for c in classes if not any(isinstance(m, c) for _, m in model.named_modules())]
    if missing:
        raise ValueError(f"wrap classes {missing} match no sub-module of {type(model).__name__}")
    return tuple(fqn for fqn, _ in _post_order(model) if fqn in chosen)


def _post_order(module: nn.Module, prefix: str = ""):
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


@dataclass(frozen=True)
class Case:
    """What a harness cell trains: the public API for a model of one's own (README, "Verify your
    own model"). Load one with `--cases path/to/file.py:make_case` or `--cases pkg.mod:make_case`.

    build_model: () -> nn.Module, called once per rank and once for the reference; the harness
        loads the same initial state into every copy. Outputs may be tensors, tuples, dicts or
        Hugging Face ModelOutputs; the loss function receives them as they are.
    wrap: what is sharded as its own unit before the root: module paths ('blocks.0'), module
        classes (GPT2Block), or a policy (fqn, module) -> bool (see resolve_wrap).
    make_batch: (seed, step, global_batch) -> (inputs, targets), each a pytree of tensors with the
        sample along dim 0 (cases/data.py: how inputs reach the model, how a batch is split).
    loss_fn: (outputs, targets) -> a floating scalar, the mean over the batch's samples of terms
        that do not look at the other samples: split data and micro-batches average the local
        losses, and the plan refuses a loss whose whole-batch value is not that average
        ([Note: Batch makeup] in harness/run/batch_makeup.py).
    optimizers: OptimizerSpec per optimizer kind; each trains the case separately.
    data_modes: 'identical' (every rank the whole batch) and/or 'split' (rank r the rows
        [r B/W, (r + 1) B/W)); a run without --data runs these. refused_modes: (mode, why) pairs for modes left out on
        purpose: a run asking for one is refused (exit 2) with `why`.
    requires: import names of the optional packages build_model needs ('transformers'): code that
        only inspects a case answers "unknown without <package>" instead of building it.
    global_batch: samples per step. A run that splits it over a world size (times grad_accum) it
        does not divide trains the case, reference included, on the least multiple of it that every
        split world size of the run divides, named '<case>@batch=<B>' (make_batch must honour it).
    world_sizes: the world sizes the case may run at.
    """

    name: str
    description: str
    build_model: Callable[[], nn.Module]
    wrap: tuple[str | type[nn.Module], ...] | WrapPolicy
    make_batch: Callable[[int, int, int], Batch]  # (seed, step, global_batch) -> (inputs, targets)
    loss_fn: Callable[..., torch.Tensor]  # (outputs, targets) -> a mean over every term
    optimizers: tuple[OptimizerSpec, ...]
    steps: int = 5
    global_batch: int = 8
    data_modes: tuple[str, ...] = DATA_MODES
    world_sizes: tuple[int, ...] = (1, 2, 4, 8)
    seed: int = 0
    tags: tuple[str, ...] = field(default_factory=tuple)
    features: Features = PLAIN  # the FSDP features the cell turns on (cases/features.py)
    # Data modes the case refuses, each with the reason a user is told (the plan exits 2 with it).
    refused_modes: tuple[tuple[str, str], ...] = ()
    requires: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not self.name.replace("_", "").isalnum():
            raise ValueError(f"Case name={self.name!r} must be a non-empty identifier")
        for attr in ("build_model", "make_batch", "loss_fn"):
            if not callable(getattr(self, attr)):
                raise ValueError(f"case={self.name}: {attr} must be a function, got {type(getattr(self, attr)).__name__}")
        if isinstance(self.wrap, (str, type)):
            object.__setattr__(self, "wrap", (self.wrap,))
        elif isinstance(self.wrap, list):
            object.__setattr__(self, "wrap", tuple(self.wrap))
        if isinstance(self.wrap, tuple):
            bad = [w for w in self.wrap if not (isinstance(w, str) or (isinstance(w, type) and issubclass(w, nn.Module)))]
            if bad:
                raise ValueError(f"case={self.name}: wrap entries {bad[:3]} are neither module paths nor nn.Module "
                                 f"classes; give ('blocks.0', ...), (MyBlock,) or a function (fqn, module) -> bool")
        elif not callable(self.wrap):
            raise ValueError(f"case={self.name}: wrap={self.wrap!r} must be a tuple of module paths or classes, "
                             f"or a function (fqn, module) -> bool")
        if isinstance(self.optimizers, OptimizerSpec):
            object.__setattr__(self, "optimizers", (self.optimizers,))
        object.__setattr__(self, "optimizers", tuple(self.optimizers))
        if not self.optimizers:
            raise ValueError(f"case={self.name}: needs at least one optimizer")
        for i, spec in enumerate(self.optimizers):
            if not isinstance(spec, OptimizerSpec):
                what = getattr(spec, "__qualname__", type(spec).__name__)
                raise ValueError(f"case={self.name}: optimizers[{i}] is {what}, which has no error model; "
                                 f"use {SUPPORTED_OPTIMIZERS}")
        kinds = [o.kind for o in self.optimizers]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"case={self.name}: optimizer kinds {kinds} must be distinct")
        for name, value in (("steps", self.steps), ("global_batch", self.global_batch)):
            if value < 1:
                raise ValueError(f"case={self.name}: {name}={value} must be >= 1")
        refused = {mode for mode, _ in self.refused_modes}
        if refused & set(self.data_modes) or refused - set(DATA_MODES):
            raise ValueError(f"case={self.name}: refused_modes {sorted(refused)} must be data modes it does not run")
        bad_modes = sorted(set(self.data_modes) - set(DATA_MODES))
        if bad_modes or not self.data_modes:
            raise ValueError(f"case={self.name}: data_modes={self.data_modes} must be a non-empty subset of {DATA_MODES}")
        if not self.world_sizes or min(self.world_sizes) < 1:
            raise ValueError(f"case={self.name}: world_sizes={self.world_sizes} must all be >= 1")
        per = self.features.batch_divisor()
        if self.global_batch % per:
            raise ValueError(f"case={self.name}: global_batch={self.global_batch} does not divide into "
                             f"grad_accum={per} micro-batches")
        features = self.features
        if any(o.param_groups or o.lr_scheduler for o in self.optimizers) and (
                features.zero1 or features.checkpoint_reshard_at):
            raise ValueError(f"case={self.name}: param_groups and lr_scheduler are not mapped onto ZeRO-1 or "
                             f"checkpoint resharding; use them in a case without those features")

    def build_shapes(self) -> nn.Module:
        """The plain model built on the meta device: its parameters' and buffers' names and shapes,
        with no memory for their values (the parent's view of a model it never trains); built for
        real where the model cannot be built on meta."""
        try:
            with torch.device("meta"):
                return self.build_model()
        except Exception:
            return self.build_model()

    def missing_requirements(self) -> tuple[str, ...]:
        """The packages of `requires` this environment cannot import."""
        return tuple(r for r in self.requires if importlib.util.find_spec(r) is None)

    def wrap_paths(self, model: nn.Module) -> tuple[str, ...]:
        """The sub-module paths of `model` wrapped before the root, in wrapping order."""
        return resolve_wrap(self.wrap, model)

    def optimizer(self, kind: str) -> OptimizerSpec:
        for spec in self.optimizers:
            if spec.kind == kind:
                return spec
        raise ValueError(f"case={self.name}: no optimizer kind={kind!r}; has {[o.kind for o in self.optimizers]}")
