"""impl/'s planted faults as hook objects at named seams ([Note: Fault seams] in impl/_faults.py):
no code path of impl/ asks for a fault by name, an honest unit's hooks return what they are given,
every fault overrides at least one hook, and several faults in one unit each act."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from impl._faults import FAULTS, SEAMS, Seams, seams_for

IMPL = Path(__file__).resolve().parents[2] / "impl"
HOOKS = [n for n, v in vars(Seams).items() if callable(v) and not n.startswith("_")]


def test_no_code_of_impl_names_a_fault():
    named = {}
    for path in IMPL.glob("*.py"):
        if path.name == "_faults.py":
            continue
        text = path.read_text()
        hits = [name for name in FAULTS if re.search(rf"['\"]{re.escape(name)}['\"]", text)]
        if hits:
            named[path.name] = hits
    assert named == {}, named


def test_every_fault_overrides_a_hook_and_the_honest_hooks_change_nothing():
    for name in FAULTS:
        seam = seams_for(frozenset({name}))
        assert seam.planted and any(getattr(type(seam), h) is not getattr(Seams, h) for h in HOOKS), name
    honest = seams_for(frozenset())
    assert type(honest) is Seams and not honest.planted
    t = torch.arange(4.0)
    honest_inputs = {"mesh_groups": (("a", "b"), True), "shares_tied": (True,), "reshard_after_forward": (False,),
                     "init_padding_value": (0.0,), "gathered": (t, 2), "regathers_for_backward": (True,),
                     "gradient_sync": (False,), "used_slots": ([True, False],), "reduce_at_last_gradient": (False,),
                     "before_reduce": (t, 3), "average_divisor": (3,), "averaged": (t, None, None),
                     "gradient_padding_value": (0.0,), "accumulates": (True,), "zero1_whole_state": (False,),
                     "gathered_blocks": (t,), "clip_norm_group": ("g",), "clip_times": (1,),
                     "cast_for_gather": (t, t), "wrapped_buffers": ([t],), "shard_bounds": (((0, 2), t),)}
    assert set(honest_inputs) == set(HOOKS), "every hook's honest identity is checked here"
    for hook, args in honest_inputs.items():
        got = getattr(honest, hook)(*args)
        assert got is args[0], hook


def test_several_faults_in_one_unit_each_act():
    both = seams_for(frozenset({"clip_twice", "no_grad_average", "grad_scale_1e-5"}))
    assert (both.clip_times(1), both.average_divisor(4)) == (2, 1)
    g = torch.ones(3)
    both.averaged(g, None, None)
    assert torch.equal(g, torch.full((3,), 1 + 1e-5))
    assert tuple(SEAMS) == FAULTS  # the names impl/ plants are its seams (what each plants: harness/faults.py)
    # a fault of the shard's cut folded with another: each hook takes and returns one value
    cut = seams_for(frozenset({"shard_offset_off_by_one", "grad_scale_1e-5"})).shard_bounds(((0, 2), t := torch.ones(4)))
    assert cut[0] == (1, 3) and cut[1].numel() == t.numel() + 1


@pytest.mark.parametrize("intervals, numel, first", [
    ((), 5, 0), (((0, 3),), 5, 3), (((3, 5), (0, 3)), 5, None), (((1, 2),), 4, 0),
    (((0, 2), (1, 4)), 6, 4), (((0, 2), (2, 3), (4, 6)), 6, 3), ((), 0, None)])
def test_grad_nan_goes_to_the_first_element_outside_padding(intervals, numel, first):
    """grad_nan_one_element plants its NaN where the reduction's zeroing of the padding cannot clear
    it (uneven_tiny's last rank holds alignment padding first); a shard all padding is left alone."""
    from impl._faults import _first_outside

    assert _first_outside(intervals, numel) == first
