"""What a case configures beyond the model: the FSDP features a cell turns on.

Plain data, validated on construction. The harness maps each field onto an implementation's API
(impl/ or torch FSDP2) and onto the single-process reference, which must do the same thing
unsharded (clip by the global norm, cast to the compute dtype, take one large batch, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MESH_KINDS = ("shard", "hybrid", "no_shard")
AUTO_WRAP_KINDS = ("layer_class", "size")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Features:
    mesh: str = "shard"  # shard over all ranks | hybrid: (replicas, W / replicas) | no_shard: (W, 1)
    replicas: int = 2  # hybrid: the replicate dimension of the mesh (HSDP)
    reshard_after_forward: bool = True
    param_dtype: str | None = None  # mixed precision: compute dtype of the unsharded parameters
    reduce_dtype: str | None = None  # dtype gradients are reduced in
    prefetch: bool = False  # each unit prefetches the next (forward) and previous (backward)
    auto_wrap: str | None = None  # wrap by policy instead of the case's explicit wrap list
    auto_wrap_min_params: int = 0  # the size policy's threshold
    expected_units: tuple[str, ...] = ()  # what auto_wrap must produce, root last as ''
    meta_init: bool = False  # build on meta, materialise per unit, then load the reference state
    activation_checkpointing: tuple[str, ...] = ()  # sub-modules whose forward is recomputed
    grad_accum: int = 1  # micro-batches per step, gradient sync skipped until the last
    clip_norm_type: float | None = None  # global gradient-norm clipping (2.0 or inf)
    clip_max_norm: float = 0.0
    zero1: bool = False  # optimizer-state-only sharding: no fully_shard, ZeroRedundancyOptimizer
    checkpoint_reshard_at: tuple[int, ...] = ()  # after these steps: save sharded, reload resharded
    refused_wrap: tuple[str, ...] = ()  # wrapping these separately must raise a clear error
    # Modules wrapped together as one unit (fully_shard of a list, FSDP2's group), after the wrap
    # list and before the root: a tied embedding and its output head, say.
    wrap_groups: tuple[tuple[str, ...], ...] = ()
    cpu_offload: bool = False  # sharded parameters, gradients, optimizer state on the CPU; compute on the rank's device
    requires_device: str | None = None  # e.g. "cuda": cells are skipped, with this reason, elsewhere

    def __post_init__(self) -> None:
        if self.mesh not in MESH_KINDS:
            raise ValueError(f"Features mesh={self.mesh!r} must be one of {MESH_KINDS}")
        if self.replicas < 2:
            raise ValueError(f"Features replicas={self.replicas} must be >= 2 (a hybrid mesh replicates)")
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPES:
                raise ValueError(f"Features {name}={value!r} must be one of {sorted(DTYPES)}")
        if self.auto_wrap is not None and self.auto_wrap not in AUTO_WRAP_KINDS:
            raise ValueError(f"Features auto_wrap={self.auto_wrap!r} must be one of {AUTO_WRAP_KINDS}")
        if self.auto_wrap == "size" and self.auto_wrap_min_params < 1:
            raise ValueError(f"Features auto_wrap='size' needs auto_wrap_min_params >= 1, got {self.auto_wrap_min_params}")
        if self.expected_units and self.auto_wrap is None:
            raise ValueError("Features expected_units only make sense with auto_wrap")
        if self.grad_accum < 1:
            raise ValueError(f"Features grad_accum={self.grad_accum} must be >= 1")
        if self.clip_norm_type is not None and not (self.clip_max_norm > 0 and self.clip_norm_type > 0):
            raise ValueError(
                f"Features clip_norm_type={self.clip_norm_type} needs clip_max_norm > 0 (got {self.clip_max_norm})"
            )
        if any(len(group) < 2 for group in self.wrap_groups):
            raise ValueError(f"Features wrap_groups={self.wrap_groups!r}: a group wraps two modules or more")
        if self.wrap_groups and (self.auto_wrap or self.zero1):
            raise ValueError("Features wrap_groups names modules to wrap: it combines with neither auto_wrap nor zero1")
        if self.zero1 and (self.mesh != "shard" or self.param_dtype or self.auto_wrap or self.meta_init):
            raise ValueError("Features zero1 replaces fully_shard: it combines with no mesh, mixed precision, "
                             "auto_wrap or meta_init")

    @property
    def mixed_precision(self) -> bool:
        return self.param_dtype is not None

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.param_dtype] if self.param_dtype else torch.float32

    def mesh_shape(self, world_size: int) -> tuple[int, int]:
        """(replicate, shard) sizes at this world size."""
        if self.mesh == "no_shard":
            return world_size, 1
        if self.mesh == "hybrid" and world_size >= 2 * self.replicas and world_size % self.replicas == 0:
            return self.replicas, world_size // self.replicas
        return 1, world_size

    def shard_group(self, world_size: int, rank: int) -> frozenset[int]:
        """The ranks whose shards make up `rank`'s parameters: its row of the (replicate, shard)
        mesh (harness/adapters/features.py make_mesh lays ranks out row by row)."""
        _, shard = self.mesh_shape(world_size)
        first = rank // shard * shard
        return frozenset(range(first, first + shard))

    def batch_divisor(self) -> int:
        """Every rank's batch must split into grad_accum equal micro-batches."""
        return self.grad_accum


PLAIN = Features()
