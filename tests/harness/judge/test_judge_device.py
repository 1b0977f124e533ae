"""The device boundary of a rank's judge ([Note: Judged on the evidence's device] in
harness/run/judged.py), tested without a GPU: the meta device stands in for one (a factory under
its context makes meta tensors, which is what a judge's factories must do on a GPU, and a case's
code must not).

On an H200 the first version of this boundary made a case's CPU generator raise under the judge's
device context, and left the reference's record on the CPU; these tests hold both."""

from __future__ import annotations

import torch

from harness.run.judged import on_device, outside, record_on

META = torch.device("meta")


def test_the_judges_factories_make_their_tensors_on_its_device_and_nothing_on_the_cpu_changes():
    with on_device(META):
        assert torch.zeros(3).device == META
    with on_device(torch.device("cpu")):  # a null context: the CPU path is the one it always was
        assert torch.zeros(3).device.type == "cpu"


def test_a_cases_code_runs_under_the_ranks_own_default_device_inside_the_judge():
    def make_batch():  # as cases/data.py does: a CPU generator, a factory with no device
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, 10, (4,), generator=g)

    wrapped = outside(make_batch, META)
    with on_device(META):
        batch = wrapped()
        # unwrapped, the case's factory follows the judge's device (a GPU raises here instead:
        # "Expected a 'cuda' device type for generator but found 'cpu'")
        assert make_batch().is_meta
    assert batch.device.type == "cpu" and torch.equal(batch, make_batch())
    assert outside(make_batch, torch.device("cpu")) is make_batch  # nothing wrapped on the CPU
    assert outside(None, META) is None


def test_a_record_is_moved_whole_containers_rebuilt_and_other_values_kept():
    later = object()
    rec = {"step": 2, "loss": torch.ones(2), "grads": {"w": torch.ones(3)}, "runs": [{"w": torch.ones(1)}],
           "reorder_later": later}
    moved = record_on(rec, META)
    assert moved["step"] == 2 and moved["reorder_later"] is later
    assert moved["loss"].is_meta and moved["grads"]["w"].is_meta and moved["runs"][0]["w"].is_meta
    assert not rec["loss"].is_meta and rec["grads"] is not moved["grads"]  # the caller's record untouched
