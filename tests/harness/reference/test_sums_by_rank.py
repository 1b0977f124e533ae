"""[Note: Sums by rank] in harness/reference/shadow.py: the replay's exact mean is each rank's own
partial sum, added in rank order, so ranks that sum their own terms and send one partial each give
the judge the same bits as the one-process replay."""

from __future__ import annotations

import pytest
import torch

from cases.catalog import get_case
from cases.data import local_batch
from harness.reference.shadow import Shadow


@pytest.mark.parametrize("name", ["grad_accumulation", "tied_embeddings", "unused_head"])
def test_the_split_replay_is_the_ranks_own_sums_added_in_rank_order(name):
    """Each rank's local batch replayed on its own (identical data at W = 1: that rank's terms,
    summed undivided), the partials added in rank order in float64 and divided by W: bitwise the
    split replay's mean, with a parameter no rank has a term for left out as the replay leaves it
    out."""
    case = get_case(name)
    init = {n: t.detach().clone() for n, t in case.build_model().state_dict().items()}
    batch = case.make_batch(case.seed, 1, case.global_batch)
    w = 4
    shadow = Shadow(case, case.optimizers[0], init)
    _, grads, _, _ = shadow._terms(batch, "split", w, shadow.num_micro, reorder=False)
    totals: dict[str, torch.Tensor] = {}
    for rank in range(w):
        mine = Shadow(case, case.optimizers[0], init)
        _, partial, _, _ = mine._terms(local_batch(batch, "split", rank, w), "identical", 1, mine.num_micro,
                                       reorder=False)
        for n, p in partial.items():
            totals[n] = p.double().clone() if n not in totals else totals[n] + p
    assert set(totals) == set(grads)
    for n, t in totals.items():
        assert torch.equal(t / w, grads[n]), n


@pytest.mark.parametrize("name", ["clip_grad_norm", "mlp"])
def test_one_term_stays_float32_and_the_record_keeps_it_unclipped(name):
    """Identical data, one micro-batch: the exact mean is one float32 term per parameter, kept as
    that float32 tensor (the same value as its float64 copy); the optimizer steps a copy of it, so
    clipping (which scales gradients in place) leaves the record's mean as the replay computed it."""
    case = get_case(name)
    init = {n: t.detach().clone() for n, t in case.build_model().state_dict().items()}
    batch = case.make_batch(case.seed, 1, case.global_batch)
    shadow = Shadow(case, case.optimizers[0], init)
    _, fresh, _, _ = shadow._terms(batch, "identical", 2, 1, reorder=False)
    rec = Shadow(case, case.optimizers[0], init).step(init, batch, "identical", 2, reorder=False)
    assert {g.dtype for g in fresh.values()} == {torch.float32}
    for n, g in fresh.items():
        assert torch.equal(rec["grads"][n], g), n
