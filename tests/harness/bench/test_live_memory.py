"""The live-tensor tracker counts exactly the bytes of storages alive (fast tier)."""

from __future__ import annotations

import pytest
import torch

from harness.bench import live_memory
from harness.bench.live_memory import LiveMemory


def test_allocations_frees_and_storage_resizes_are_counted_to_the_byte():
    with LiveMemory() as mem:
        mem.phase("forward")
        a = torch.empty(1000)  # 4000 B
        b = torch.ones(250, dtype=torch.float64)  # 2000 B
        view = a[10:20]  # a view: no new storage
        assert mem.live_bytes() == 6000
        a.untyped_storage().resize_(0)  # how FSDP frees an unsharded buffer in place
        assert mem.live_bytes() == 2000
        a.untyped_storage().resize_(4000)
        del b
        assert mem.live_bytes() == 4000
        c = torch.zeros(2000)  # 8000 B: the peak is a + c = 12000
        del c, view, a
        mem.phase("end")
    assert mem.live_bytes() == 0
    peak = mem.peak()
    assert (peak.total, peak.phase) == (12000, "forward")


def test_categories_follow_tags_phases_and_collectives():
    weight = torch.zeros(64)
    with LiveMemory() as mem:
        mem.track(weight, live_memory.PARAMS)
        mem.phase("forward")
        saved = torch.ones(32)  # alive when backward starts: an activation
        scratch = torch.ones(16)
        del scratch  # freed in forward: a temporary
        mem.phase("backward")
        grad = torch.ones(64)  # a parameter's numel, allocated in backward: a gradient in flight
        peak_event = len(mem.events) - 1
        del saved, grad
        mem.phase("end")
    at = mem.breakdown_at(peak_event, grad_numels=frozenset({64}))
    assert at.by_category[live_memory.PARAMS] == 256
    assert at.by_category[live_memory.ACTIVATIONS] == 128
    assert at.by_category[live_memory.GRADIENTS_IN_FLIGHT] == 256
    assert at.total == 640
    before_free = mem.breakdown_at(peak_event - 2)  # scratch still alive, grad not yet allocated
    assert before_free.by_category[live_memory.TEMPORARIES] == 64


def test_weighted_peak_divides_the_state_it_is_told_to():
    with LiveMemory() as mem:
        params = torch.zeros(1000)  # 4000 B of state
        mem.track(params, live_memory.PARAMS)
        mem.phase("forward")
        act = torch.zeros(500)  # 2000 B
        del act
        mem.phase("end")
    ideal = mem.weighted_peak({live_memory.PARAMS: 1 / 4})
    assert ideal.weighted == 4000 / 4 + 2000
    assert mem.peak().total == 6000


def test_track_refuses_a_tensor_without_its_own_memory():
    with LiveMemory() as mem:
        with pytest.raises(TypeError, match="plain tensor"):
            mem.track(torch.empty(3, device="meta"))
