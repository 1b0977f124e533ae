"""Public API: fully_shard and the helpers around it (FSDP2-style)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from impl._collectives import CommStats, group_rank_and_size
from impl._faults import validate_faults
from impl._flat_param import FlatLayout
from impl._handle import CommConfig, FlatParamHandle
from impl._unit import FSDPUnit

FLAT_PARAM_NAMES = {True: "_flat_param", False: "_flat_param_frozen"}
_OWNER_ATTR = "_impl_fsdp_owner"  # set on an original Parameter once a unit owns it
_OWNED_BY_ATTR = "_impl_fsdp_params_owned_by"  # set on a module whose parameters a unit took


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Compute in `param_dtype`, reduce gradients in `reduce_dtype`; master weights keep theirs."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not dtype.is_floating_point:
                raise ValueError(f"MixedPrecisionPolicy.{name}={dtype} must be a floating dtype")


class FSDPModule:
    """Mixed into the class of every wrapped module (as torch FSDP2 does)."""

    def fsdp_unit(self) -> FSDPUnit:
        return self.__dict__["_fsdp_unit"]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        modules = self.modules() if recurse else [self]
        for module in modules:
            unit = module.__dict__.get("_fsdp_unit")
            if unit is not None:
                unit.set_requires_gradient_sync(requires_gradient_sync)


def fully_shard(
    module: nn.Module,
    *,
    process_group: dist.ProcessGroup | None = None,
    replicate_group: dist.ProcessGroup | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    comm_stats: CommStats | None = None,
    _faults: frozenset[str] = frozenset(),
) -> nn.Module:
    """Shard `module`'s parameters (those not already owned by a wrapped sub-module).

    process_group: the group parameters are sharded over. None means the default (world) group
        when torch.distributed is initialized and no group at all (W = 1) otherwise.
    replicate_group: for hybrid sharding (HSDP) and NO_SHARD: gradients are additionally
        all-reduced over this group and averaged over shard x replicate ranks.
    reshard_after_forward: False keeps parameters unsharded from forward to backward (ZeRO-2).
    """
    if "_fsdp_unit" in module.__dict__:
        raise ValueError(f"fully_shard({type(module).__name__}): module is already wrapped")
    taken = [fqn or "<self>" for fqn, sub in _unwrapped_modules(module) if _OWNED_BY_ATTR in sub.__dict__]
    if taken:
        raise ValueError(
            f"fully_shard({type(module).__name__}): the parameters of {taken} already belong to an "
            f"enclosing unit ({module.__dict__.get(_OWNED_BY_ATTR) or 'a parent'}). Apply "
            f"fully_shard to sub-modules first, then to their parent and the root."
        )
    faults = validate_faults(frozenset(_faults))
    mp_policy = mp_policy or MixedPrecisionPolicy()
    if process_group is None and dist.is_available() and dist.is_initialized():
        process_group = dist.group.WORLD
    shard_rank, shard_world_size = group_rank_and_size(process_group)
    _, replicate_world_size = group_rank_and_size(replicate_group)

    owners, params = _collect_params(module, faults)
    comm = CommConfig(
        shard_group=process_group,
        replicate_group=replicate_group,
        shard_rank=shard_rank,
        shard_world_size=shard_world_size,
        replicate_world_size=replicate_world_size,
        param_dtype=mp_policy.param_dtype,
        reduce_dtype=mp_policy.reduce_dtype,
        faults=faults,
        stats=comm_stats,
    )
    handles = []
    for requires_grad in (True, False):
        idx = [i for i, p in enumerate(params) if p.requires_grad == requires_grad]
        if idx:
            handles.append(
                _make_handle(module, [params[i] for i in idx], [owners[i] for i in idx], comm, requires_grad)
            )
    for p in params:
        setattr(p, _OWNER_ATTR, type(module).__name__)

    unit = FSDPUnit(
        module,
        handles,
        reshard_after_forward=reshard_after_forward,
        cast_inputs_to=mp_policy.param_dtype if mp_policy.cast_forward_inputs else None,
    )
    module.__dict__["_fsdp_unit"] = unit
    module.register_forward_pre_hook(unit.pre_forward, with_kwargs=True)
    module.register_forward_hook(unit.post_forward, with_kwargs=True)
    from impl._state_dict import register_state_dict_hooks

    register_state_dict_hooks(module, unit)
    cls = type(module)
    module.__class__ = type(f"FSDP{cls.__name__}", (cls, FSDPModule), {"__module__": cls.__module__})
    return module


def _collect_params(
    module: nn.Module, faults: frozenset[str]
) -> tuple[list[list[tuple[nn.Module, str, str]]], list[nn.Parameter]]:
    """Parameters `module` owns (skipping wrapped sub-modules), deduplicated, with every name."""
    params: list[nn.Parameter] = []
    owners: list[list[tuple[nn.Module, str, str]]] = []
    index_of: dict[int, int] = {}
    for fqn, sub, name, param in _owned_params(module):
        if hasattr(param, _OWNER_ATTR):
            raise ValueError(
                f"fully_shard({type(module).__name__}): parameter '{fqn}' is already sharded by "
                f"another unit ({getattr(param, _OWNER_ATTR)}). A parameter shared across two "
                f"wrapped units is not supported; wrap a common ancestor of both uses instead "
                f"(e.g. keep tied embedding and output head in the same unit)."
            )
        if not param.is_floating_point():
            raise ValueError(
                f"fully_shard({type(module).__name__}): parameter '{fqn}' has dtype {param.dtype}; "
                f"only floating-point parameters can be sharded. Fix: make it a buffer."
            )
        if id(param) in index_of and "tied_param_duplicated" not in faults:
            owners[index_of[id(param)]].append((sub, name, fqn))
            continue
        index_of[id(param)] = len(params)
        params.append(param)
        owners.append([(sub, name, fqn)])
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        by_dtype = {str(d): [o[0][2] for o, p in zip(owners, params) if p.dtype == d][:3] for d in dtypes}
        raise ValueError(
            f"fully_shard({type(module).__name__}): parameters of several dtypes in one unit "
            f"{by_dtype}; one flat parameter needs one dtype. Fix: wrap them in separate units "
            f"or cast the module to one dtype first."
        )
    return owners, params


def _unwrapped_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """`module` and its descendants, skipping the subtrees of already wrapped children."""
    stack = [("", module)]
    while stack:
        fqn, sub = stack.pop(0)
        if sub is not module and "_fsdp_unit" in sub.__dict__:
            continue  # a wrapped child owns its own parameters
        yield fqn, sub
        for child_name, child in sub._modules.items():
            if child is not None:
                stack.append((f"{fqn}.{child_name}" if fqn else child_name, child))


def _owned_params(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Parameter]]:
    for fqn, sub in _unwrapped_modules(module):
        for name, param in list(sub._parameters.items()):
            if param is not None:
                yield (f"{fqn}.{name}" if fqn else name), sub, name, param


def _make_handle(
    module: nn.Module,
    params: list[nn.Parameter],
    owners: list[list[tuple[nn.Module, str, str]]],
    comm: CommConfig,
    requires_grad: bool,
) -> FlatParamHandle:
    layout = FlatLayout.build(
        [(tuple(fqn for _, _, fqn in o), p.shape) for o, p in zip(owners, params)], comm.shard_world_size
    )
    param_name = FLAT_PARAM_NAMES[requires_grad]
    handle = FlatParamHandle(
        module, param_name, layout, [[(m, n) for m, n, _ in o] for o in owners], comm, requires_grad
    )
    device, dtype = params[0].device, params[0].dtype
    if device.type == "meta":
        local = torch.empty(layout.shard_numel, dtype=dtype, device="meta")
    else:
        with torch.no_grad():
            local = handle.init_sharded_from([p.detach() for p in params])
    for owner_list in owners:
        for sub, name, _ in owner_list:
            sub._parameters.pop(name, None)
            sub.__dict__[_OWNED_BY_ATTR] = type(module).__name__
    module.register_parameter(param_name, nn.Parameter(local, requires_grad=requires_grad))
    return handle


def units(model: nn.Module) -> list[tuple[str, FSDPUnit]]:
    """(fqn, unit) of every wrapped module under `model`, in module order."""
    return [(fqn, m.__dict__["_fsdp_unit"]) for fqn, m in model.named_modules() if "_fsdp_unit" in m.__dict__]
