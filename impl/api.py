"""Public API: fully_shard and the helpers around it (FSDP2-style)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from impl._collectives import CommStats, group_rank_and_size
from impl._faults import Seams, seams_for
from impl._flat_param import FlatLayout, align_numel_for
from impl._handle import CommConfig, FlatParamHandle, Precision, ShardGroups
from impl._unit import FSDPUnit, units_with_prefixes

FLAT_PARAM_NAMES = {True: "_flat_param", False: "_flat_param_frozen"}
_OWNER_ATTR = "_impl_fsdp_owner"  # set on an original Parameter once a unit owns it
_OWNED_BY_ATTR = "_impl_fsdp_params_owned_by"  # set on a module whose parameters a unit took
_IGNORED_ATTR = "_impl_fsdp_ignored"  # set on a parameter passed in ignored_params


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Compute in `param_dtype`, reduce gradients in `reduce_dtype`; master weights keep theirs."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None  # the unit's floating outputs cast to it (None: as computed)
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not dtype.is_floating_point:
                raise ValueError(f"MixedPrecisionPolicy.{name}={dtype} must be a floating dtype")


class FSDPModule:
    """Mixed into the class of every wrapped module (as torch FSDP2 does)."""

    def fsdp_unit(self) -> FSDPUnit:
        return self.__dict__["_fsdp_unit"]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward keeps accumulating unsharded gradients and skips the reduce-scatter
        (gradient accumulation); the next backward with True reduces the accumulated sum."""
        modules = self.modules() if recurse else [self]
        for module in modules:
            unit = module.__dict__.get("_fsdp_unit")
            if unit is not None:
                unit.set_requires_gradient_sync(requires_gradient_sync)

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """All-gather these wrapped modules asynchronously right after this one's pre-forward,
        instead of the implicit choice ([Note: Implicit prefetch] in impl/_unit.py; [] for none)."""
        self.fsdp_unit().forward_prefetch = [_unit_of(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """All-gather these wrapped modules asynchronously right after this one's pre-backward,
        instead of the implicit choice ([Note: Implicit prefetch] in impl/_unit.py; [] for none)."""
        self.fsdp_unit().backward_prefetch = [_unit_of(m, "set_modules_to_backward_prefetch") for m in modules]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters and point their names at the unsharded views; with
        `async_op`, start the all-gathers and return a handle whose `wait()` finishes them (the
        forward waits by itself if it comes first)."""
        handles = self.fsdp_unit().handles
        for handle in handles:
            handle.unshard(async_op=async_op)
        done = UnshardHandle(handles)
        if not async_op:
            done.wait()
            return None
        return done

    def reshard(self) -> None:
        for handle in self.fsdp_unit().handles:
            handle.reshard()

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether this unit (and, with `recurse`, every unit below it) frees its unsharded
        parameters after forward, from the next forward on (the root included when True)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"set_reshard_after_forward({reshard_after_forward!r}): pass True or False")
        for unit in self._units(recurse):
            unit.reshard_after_forward = reshard_after_forward
            for handle in unit.handles:  # the whole shard group from now on (an int given to fully_shard)
                handle.use_post_forward_group = False

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False keeps this unit's (and, with `recurse`, every unit's below it) unsharded parameters
        after backward, so the next forward gathers nothing: for gradient accumulation, with no
        optimizer step before the parameters are resharded (set True again, or `reshard()`)."""
        if not isinstance(reshard_after_backward, bool):
            raise ValueError(f"set_reshard_after_backward({reshard_after_backward!r}): pass True or False")
        for unit in self._units(recurse):
            for handle in unit.handles:
                handle.reshard_after_backward = reshard_after_backward

    def reset_iter_state(self) -> None:
        """After a forward or backward that raised: every unit back to IDLE and resharded, the
        reductions in flight and the gradients not yet reduced dropped (that iteration's gradients
        are lost: restart an accumulation), so the next iteration runs normally. Call it on the
        root (the module wrapped last, whose forward runs first)."""
        unit = self.fsdp_unit()
        if unit.is_root is False:
            raise RuntimeError(f"reset_iter_state: {type(self).__name__} is not the root; call it on the module "
                               f"whose forward runs first (wrapped last)")
        unit.reset_iteration()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer step: False lets it return with
        its last gradient reduction in flight (micro-batches), finished by the next reduction or
        the next backward with True; gradients are complete only after that one."""
        root = self.fsdp_unit()
        root = root.root_unit or root
        root.is_last_backward = bool(is_last_backward)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters each backward's gradients within the shard group and keeps the
        sums, True (the default) all-reduces them over the replicas, with any kept before, and
        averages: accumulation with one all-reduce per optimizer step. No-op without replicas."""
        for unit in self._units(recurse):
            for handle in unit.handles:
                handle.requires_all_reduce = bool(requires_all_reduce)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's reduced gradient sums by `factor` instead of the data-parallel size
        (FSDP2's, for a loss already scaled by the caller)."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor({factor!r}): the factor must be > 0")
        if any(h._aliased for h in self.fsdp_unit().handles):
            raise ValueError("set_gradient_divide_factor: this unit has no data-parallel reduction (one rank, no "
                             "group): its gradients are autograd's own; scale the loss instead")
        for handle in self.fsdp_unit().handles:
            handle.divide_factor = float(factor)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream=None) -> None:
        """Call `hook(grad)` on this unit's reduced gradient, this rank's flat shard of it, once it
        is averaged (after the reduce-scatter, and after the all-reduce over the replicas where the
        unit has them) and before it is added into the parameters' gradients: the hook may change it
        in place (e.g. all-reduce it over a group of the caller's own, FSDP2's custom HSDP). `stream`
        (an accelerator stream) is the one it runs on; not with a native replicate group."""
        handles = self.fsdp_unit().handles
        if stream is not None and any(h.comm.groups.replicate_group is not None for h in handles):
            raise ValueError("stream cannot be set when using native HSDP")
        if any(h._aliased for h in handles):
            raise ValueError("set_all_reduce_hook: this unit has no data-parallel reduction (one rank, no group): "
                             "its gradients are autograd's own and the hook would never run")
        for handle in handles:
            handle.all_reduce_hook = (hook, stream)

    def _units(self, recurse: bool) -> list[FSDPUnit]:
        modules = self.modules() if recurse else [self]
        found = {id(u): u for m in modules if (u := m.__dict__.get("_fsdp_unit")) is not None}
        return list(found.values())


class UnshardHandle:
    """What `FSDPModule.unshard(async_op=True)` returns: `wait()` finishes the all-gathers it started
    and points the parameters' names at the unsharded views."""

    def __init__(self, handles: list[FlatParamHandle]) -> None:
        self._handles = handles

    def wait(self) -> None:
        for handle in self._handles:
            handle.unshard()
            handle.use_views()


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run `module.<method_name>` (a `generate`, say) between the unit's forward hooks, as its
    `forward` runs: parameters gathered before, resharded after (FSDP2's function of this name)."""
    unit = _unit_of(module, "register_fsdp_forward_method")
    method = getattr(type(module), method_name, None)
    if method is None or not callable(method):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")

    def hooked(*args, **kwargs):
        args, kwargs = unit.pre_forward(module, args, kwargs)
        return unit.post_forward(module, args, kwargs, method(module, *args, **kwargs))
    module.__dict__[method_name] = hooked


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (FSDP2's base policy): the shards live where the parameters were."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and optimizer state on the CPU; all-gather them onto the
    compute device for forward and backward. `compute_device` (impl's addition): None means the
    current CUDA device where there is one, else the CPU (offloading is then a no-op)."""

    pin_memory: bool = True
    compute_device: torch.device | str | None = None

    def resolved_device(self) -> torch.device:
        if self.compute_device is not None:
            return torch.device(self.compute_device)
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _unit_of(module: nn.Module, caller: str):
    unit = module.__dict__.get("_fsdp_unit")
    if unit is None:
        raise ValueError(f"{caller}: {type(module).__name__} is not wrapped by fully_shard; wrap it first")
    return unit


def _groups_from_mesh(mesh) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """1-D mesh: shard over it. 2-D mesh: (replicate, shard), as torch FSDP2's HSDP."""
    if mesh.ndim == 1:
        return mesh.get_group(0), None
    if mesh.ndim == 2:
        # As FSDP2: an HSDP mesh names its dimensions (a mesh built for another purpose, say
        # (tensor parallel, data parallel), would otherwise be read as (replicate, shard)).
        if not mesh.mesh_dim_names:
            raise AssertionError(f"Please init the 2D mesh for HSDP with mesh_dim_names specified (the "
                                 f"dimensions are read as (replicate, shard)); got {mesh!r}")
        return mesh.get_group(1), mesh.get_group(0)
    raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh!r} (mesh.ndim={mesh.ndim}): "
                     f"1-D shards over it, 2-D is (replicate, shard)")


def _drop_trivial(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A group of one rank communicates nothing: treat it as no group."""
    return None if group is None or dist.get_world_size(group) == 1 else group


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    process_group: dist.ProcessGroup | None = None,
    replicate_group: dist.ProcessGroup | None = None,
    mesh=None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    comm_stats: CommStats | None = None,
    shard_placement_fn=None,
    ignored_params: set[nn.Parameter] | None = None,
    _faults: frozenset[str] = frozenset(),
) -> nn.Module:
    """Shard `module`'s parameters (those not already owned by a wrapped sub-module); returns it.

    module: a module, or a list of modules sharded as one unit (FSDP2's group: a tied embedding
        and output head in one flat parameter): all-gathered at the first member's forward,
        resharded after the last member's ([Note: Module groups] in impl/_unit.py); a member
        inside another member is dropped, as FSDP2 drops it.

    process_group: the group parameters are sharded over. None means the default (world) group
        when torch.distributed is initialized and no group at all (W = 1) otherwise.
    replicate_group: for hybrid sharding (HSDP) and NO_SHARD: gradients are additionally
        all-reduced over this group and averaged over shard x replicate ranks.
    mesh: a DeviceMesh instead of groups: 1-D shards over it, 2-D is (replicate, shard) (HSDP);
        a shard dimension of size 1 with replicate = world is NO_SHARD (DDP through this API).
    reshard_after_forward: False keeps parameters unsharded from forward to backward (ZeRO-2,
        SHARD_GRAD_OP); True frees them after forward and gathers them again for backward, the
        root's too; None (the default) is True for every unit but the root, as in FSDP2. An int N,
        a divisor of the shard group's size: after forward each rank keeps 1/N of the unit,
        gathered back in backward within its N consecutive ranks ([Note: Resharding to a smaller
        group] in impl/_handle.py); 1 means False, the group's size True.
    mp_policy: parameter (compute) and gradient-reduction dtypes; master weights keep theirs.
    offload_policy: OffloadPolicy() keeps the shards where they are (the default); CPUOffloadPolicy()
        keeps them on the CPU, all-gathered onto its compute device for compute.
    comm_stats: counts the bytes of every collective this unit issues.
    shard_placement_fn: FSDP2's per-parameter placement (None or Shard(dim)), validated as FSDP2
        does; impl shards one flat parameter per unit whatever it answers (`_check_placements`).
    ignored_params: parameters left as they are: not sharded, not gathered, their gradients not
        reduced (the caller keeps them in step across ranks), skipped by enclosing units too.
    """
    members = _group_members(module)
    what = _describe(members)
    for member in members:
        if "_fsdp_unit" in member.__dict__:
            raise ValueError(f"fully_shard({what}): {type(member).__name__} is already wrapped")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise ValueError(f"fully_shard({what}): reshard_after_forward={reshard_after_forward!r}: pass None, a bool, "
                         f"or an int (the group size to reshard to after forward)")
    for member in members:
        taken = [fqn or "<self>" for fqn, sub in _unwrapped_modules(member) if _OWNED_BY_ATTR in sub.__dict__]
        if taken:
            raise ValueError(
                f"fully_shard({what}): the parameters of {taken} already belong to an "
                f"enclosing unit ({member.__dict__.get(_OWNED_BY_ATTR) or 'a parent'}). Apply "
                f"fully_shard to sub-modules first, then to their parent and the root."
            )
    for param in ignored_params or ():
        setattr(param, _IGNORED_ATTR, True)
    seams = seams_for(frozenset(_faults))
    mp_policy = mp_policy or MixedPrecisionPolicy()
    if mesh is not None:
        if process_group is not None or replicate_group is not None:
            raise ValueError("fully_shard: pass either mesh or process_group/replicate_group, not both")
        process_group, replicate_group = seams.mesh_groups(_groups_from_mesh(mesh), True)
    elif process_group is None and dist.is_available() and dist.is_initialized():
        process_group = dist.group.WORLD
    process_group, replicate_group = _drop_trivial(process_group), _drop_trivial(replicate_group)
    shard_rank, shard_world_size = group_rank_and_size(process_group)
    _, replicate_world_size = group_rank_and_size(replicate_group)
    post_forward_group, post_forward_size = None, 0
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        n = reshard_after_forward
        if n < 1 or shard_world_size % n:
            raise ValueError(f"fully_shard({what}): reshard_after_forward={n}: an int is the group size to reshard "
                             f"to after forward, a divisor of the shard group's size {shard_world_size}")
        if 1 < n < shard_world_size:  # [Note: Resharding to a smaller group]
            post_forward_group = _post_forward_group(mesh, process_group, replicate_group, n, shard_rank, what)
            post_forward_size = n
        reshard_after_forward = n > 1  # 1: keep the parameters (FSDP2 warns and does so); S: True

    for member in members:
        _check_placements(member, shard_placement_fn, shard_world_size, what)
    owners, params, conflicts = _collect_params(members, seams, what)
    seams.wrapped_buffers([b for member in members for _, sub in _unwrapped_modules(member)
                           for b in sub.buffers(recurse=False)])
    comm = CommConfig(
        groups=ShardGroups(process_group, replicate_group, shard_rank, shard_world_size, replicate_world_size,
                           post_forward_group, post_forward_size),
        precision=Precision(mp_policy.param_dtype, mp_policy.reduce_dtype),
        stats=comm_stats,
        compute_device=offload_policy.resolved_device() if isinstance(offload_policy, CPUOffloadPolicy) else None,
        seams=seams,
    )
    handles = []
    for requires_grad in (True, False):
        idx = [i for i, p in enumerate(params) if p.requires_grad == requires_grad]
        if idx:
            handles.append(
                _make_handle(members, [params[i] for i in idx], [owners[i] for i in idx], comm, requires_grad)
            )
    for p in params:
        setattr(p, _OWNER_ATTR, what)

    unit = FSDPUnit(
        members[0],
        handles,
        reshard_after_forward=seams.reshard_after_forward(reshard_after_forward),
        cast_inputs_to=mp_policy.param_dtype if mp_policy.cast_forward_inputs else None,
        cast_outputs_to=mp_policy.output_dtype,
        members=members,
    )
    unit.conflicts = conflicts
    from impl._state_dict import register_state_dict_hooks

    for j, member in enumerate(members):
        member.__dict__["_fsdp_unit"] = unit
        member.register_forward_pre_hook(unit.pre_forward, with_kwargs=True)
        member.register_forward_hook(unit.post_forward, with_kwargs=True)
        register_state_dict_hooks(member, unit, j)
        cls = type(member)
        member.__class__ = type(f"FSDP{cls.__name__}", (cls, FSDPModule), {"__module__": cls.__module__})
    # Recomputation (activation checkpointing inside the unit) runs the owners' forward in
    # backward, possibly after the unit released its parameters: their hooks re-gather.
    owner_modules = {id(sub): sub for h in handles for owners in h.slot_owners for sub, _ in owners}
    for sub in owner_modules.values():
        if all(sub is not member for member in members):
            sub.register_forward_pre_hook(unit.owner_pre_forward)
    return module


_POST_FORWARD_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}  # made once per set of ranks


def _post_forward_group(mesh, process_group, replicate_group, n: int, shard_rank: int, what: str) -> dist.ProcessGroup:
    """This rank's group of `n` consecutive ranks of its shard group ([Note: Resharding to a smaller
    group]): every group is made on every rank, in one order, as torch.distributed requires."""
    if mesh is not None:
        rows = mesh.mesh.reshape(-1, n).tolist()
    elif replicate_group is None and process_group is not None and sorted(
            dist.get_process_group_ranks(process_group)) == list(range(dist.get_world_size())):
        ranks = dist.get_process_group_ranks(process_group)
        rows = [ranks[i:i + n] for i in range(0, len(ranks), n)]
    else:
        raise NotImplementedError(
            f"fully_shard({what}): reshard_after_forward={n} with a shard group that is not the whole world: pass "
            f"a DeviceMesh (its ranks give every rank the same groups to make)")
    mine = None
    for row in rows:
        key = tuple(row)
        if key not in _POST_FORWARD_GROUPS:
            _POST_FORWARD_GROUPS[key] = dist.new_group(list(row))
        if dist.get_rank() in row:
            mine = _POST_FORWARD_GROUPS[key]
    if mine is None or dist.get_rank(mine) != shard_rank % n:
        raise NotImplementedError(f"fully_shard({what}): reshard_after_forward={n}: the shard group's ranks are not "
                                  f"consecutive in the mesh, so a group of {n} would not hold every chunk")
    return mine


def _group_members(module: nn.Module | list[nn.Module]) -> list[nn.Module]:
    """The modules one unit holds: `module`, or the modules of a list that are not inside another
    of them, in the list's order ([Note: Module groups] in impl/_unit.py)."""
    if isinstance(module, nn.Module):
        return [module]
    modules = list(module) if isinstance(module, (list, tuple)) else None
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(f"fully_shard: expected a module or a non-empty list of modules, got {module!r}")
    inside = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    members, seen = [], set()
    for m in modules:
        if id(m) not in inside and id(m) not in seen:
            seen.add(id(m))
            members.append(m)
    return members


def _describe(members: list[nn.Module]) -> str:
    names = [type(m).__name__ for m in members]
    return names[0] if len(names) == 1 else f"[{', '.join(names)}]"


def _collect_params(
    members: list[nn.Module], seams: Seams, what: str
) -> tuple[list[list[tuple[nn.Module, str, str, int]]], list[nn.Parameter], list[str]]:
    """Parameters the members own (skipping wrapped sub-modules), deduplicated, with every name
    (relative to its member) and the member's index; and the errors for parameters another unit
    owns already (raised at the root's first forward)."""
    params: list[nn.Parameter] = []
    owners: list[list[tuple[nn.Module, str, str, int]]] = []
    index_of: dict[int, int] = {}
    conflicts: list[str] = []
    for j, fqn, sub, name, param in ((j, *o) for j, m in enumerate(members) for o in _owned_params(m)):
        if getattr(param, _IGNORED_ATTR, False):
            continue  # ignored_params: left as it is
        if hasattr(param, _OWNER_ATTR):
            # Raised at the root's first forward, as FSDP2 does (`FSDPUnit._lazy_init`); the
            # parameter stays with the unit that took it first.
            conflicts.append(
                f"fully_shard({what}): parameter '{fqn}' is already managed by another unit "
                f"({getattr(param, _OWNER_ATTR)}). A parameter shared across two wrapped units is not "
                f"supported; wrap both uses in one unit (fully_shard([embedding, head]) or a common ancestor)."
            )
            continue
        if not param.is_contiguous():
            raise NotImplementedError(
                f"FSDP does not support non-contiguous parameters: fully_shard({what}): parameter '{fqn}' "
                f"is not contiguous (shape "
                f"{tuple(param.shape)}, strides {param.stride()}; channels_last, a transposed view): its "
                f"unsharded view would be contiguous, so its memory format would change silently. Fix: make it "
                f"contiguous first (FSDP2 refuses it too)."
            )
        if not param.is_floating_point():
            raise ValueError(
                f"fully_shard({what}): parameter '{fqn}' has dtype {param.dtype}; "
                f"only floating-point parameters can be sharded. Fix: make it a buffer."
            )
        if id(param) in index_of and seams.shares_tied(True):
            owners[index_of[id(param)]].append((sub, name, fqn, j))
            continue
        index_of[id(param)] = len(params)
        params.append(param)
        owners.append([(sub, name, fqn, j)])
    # One flat parameter per unit for the trainable parameters, one for the frozen ones: each one dtype.
    for requires_grad in (True, False):
        dtypes = {p.dtype for p in params if p.requires_grad == requires_grad}
        if len(dtypes) > 1:
            by_dtype = {str(d): [o[0][2] for o, p in zip(owners, params) if p.dtype == d
                                 and p.requires_grad == requires_grad][:3] for d in dtypes}
            raise ValueError(
                f"fully_shard({what}): {'trainable' if requires_grad else 'frozen'} parameters of several "
                f"dtypes in one unit {by_dtype}; one flat parameter needs one dtype. Fix: wrap them in "
                f"separate units or cast the module to one dtype first."
            )
    return owners, params, conflicts


def _check_placements(module: nn.Module, shard_placement_fn, shard_world_size: int, what: str) -> None:
    """shard_placement_fn's answer for every parameter, validated as FSDP2 validates it: None or
    Shard(d) with d a dimension of the parameter, a dimension other than 0 split evenly over the
    shard group. impl shards one flat parameter per unit whatever the placement: the gathered
    parameters, the gradients and an element-wise optimizer's steps are the same for every
    placement; only the local piece differs (1-D here, the dim-d block in FSDP2), which a warning
    says once for a placement other than Shard(0)."""
    if shard_placement_fn is None:
        return
    warned = False
    for fqn, _, _, param in _owned_params(module):
        placement = shard_placement_fn(param)
        if placement is None:
            continue
        if type(placement).__name__ != "Shard":
            raise NotImplementedError(
                f"fully_shard({what}): shard_placement_fn gave {placement!r} for '{fqn}'; only None or "
                f"Shard(dim) shard a parameter")
        ndim, dim = param.dim(), placement.dim
        if ndim == 0 and dim in (0, -1):
            continue  # a 0-d parameter is one element of the flat parameter
        if not -ndim <= dim < ndim:
            raise AssertionError(f"Shard dim {dim} is invalid for {ndim}D tensor: fully_shard({what}), "
                                 f"shard_placement_fn's answer for '{fqn}' of shape {tuple(param.shape)}")
        dim %= ndim
        if dim == 0:
            continue
        if param.shape[dim] % shard_world_size:
            raise NotImplementedError(
                f"FSDP does not support uneven sharding on dim {dim}: fully_shard({what}), '{fqn}' of shape "
                f"{tuple(param.shape)} over {shard_world_size} ranks")
        if not warned:
            warned = True
            warnings.warn(f"fully_shard({what}): shard_placement_fn gave Shard({dim}) for '{fqn}': impl shards "
                          f"one flat parameter per unit, so each local piece is a 1-D slice of the flat "
                          f"parameter, not the dim-{dim} block; the training is the same for an element-wise "
                          f"optimizer", stacklevel=3)


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
    members: list[nn.Module],
    params: list[nn.Parameter],
    owners: list[list[tuple[nn.Module, str, str, int]]],
    comm: CommConfig,
    requires_grad: bool,
) -> FlatParamHandle:
    module = members[0]
    dtypes = {params[0].dtype} | ({comm.precision.param_dtype} if comm.precision.param_dtype is not None else set())
    layout = FlatLayout.build(
        [(tuple(fqn for _, _, fqn, _ in o), p.shape) for o, p in zip(owners, params)],
        comm.groups.shard_world_size,
        align_numel_for(*dtypes),  # [Note: Alignment]: in the sharded and the compute dtype
    )
    param_name = FLAT_PARAM_NAMES[requires_grad]
    device, dtype = params[0].device, params[0].dtype
    local = torch.empty(layout.shard_numel, dtype=dtype, device=device)
    handle = FlatParamHandle(
        module, param_name, layout, [[(m, n) for m, n, _, _ in o] for o in owners], comm, requires_grad, local,
        slot_members=[tuple(j for *_, j in o) for o in owners],
    )
    if len(members) > 1:  # released early only where every owner is below the members
        handle.release_early = all(sub is not m for o in owners for sub, *_ in o for m in members)
    if device.type != "meta":
        with torch.no_grad():
            local.copy_(handle.init_sharded_from([p.detach() for p in params]))
    # [Note: Per-parameter shards]: each owner's name now holds this rank's piece of the parameter.
    what = _describe(members)
    for piece, owner_list in zip(handle.pieces, owners):
        setattr(piece, _OWNER_ATTR, what)
        for sub, name, _, _ in owner_list:
            sub._parameters[name] = piece
            sub.__dict__[_OWNED_BY_ATTR] = what
    return handle


def units(model: nn.Module) -> list[tuple[str, FSDPUnit]]:
    """(fqn, unit) of every unit under `model`, once each (a group's under its first member's
    name), in module order."""
    return [(next((p for p in prefixes if p is not None), "").removesuffix("."), unit)
            for unit, prefixes in units_with_prefixes(model)]
