"""[Note: Reordered accumulation] in harness/reference/shadow.py: the reordered replays backward
through the forward the exact terms came from (its graph kept), and their terms are, bit for bit,
the ones a second forward of the same micro-batch from the same buffers gives: per rank and
micro-batch, the same perturbing hooks seeded the same way."""

from __future__ import annotations

import pytest
import torch

from cases.catalog import get_case
from cases.data import local_batch, map_tensors
from harness.adapters.local_step import forward_backward
from harness.reference.shadow import REORDER_DRAWS, Shadow, _jitter_hooks, fold_partial
from harness.reference.tolerance import unit_roundoff
from harness.run.snapshot import build_init


def _second_forward_draws(case, init_state, init_buffers, batch, mode, world_size, seed):
    """Each draw's float64 sum of the local terms, every rank's micro-batches replayed by a forward
    of their own (as the replay did before it kept the exact pass's graph), divided by W on split."""
    shadow = Shadow(case, case.optimizers[0], init_state, init_buffers=init_buffers)
    shadow._reorder_seed = seed
    uses = shadow._untie()
    before = {n: b.detach().clone() for n, b in shadow.buffers.items()}
    u = unit_roundoff(case.features.compute_dtype)
    draws: list[dict] = [{} for _ in range(REORDER_DRAWS)]
    ranks = range(1) if mode == "identical" else range(world_size)
    for rank in ranks:
        shadow._set_buffers(before)
        inputs, targets = map_tensors(lambda t: t, local_batch(batch, mode, rank, world_size))
        partials: list[dict] = [{} for _ in draws]
        state: dict = {}

        def jittered(loss, i, partials=partials, state=state, rank=rank):
            handles = _jitter_hooks(loss, u, state)
            for d, sums in enumerate(partials):
                state["generator"] = torch.Generator().manual_seed((seed * 1_000_003 + rank * 1009 + i * 31 + d) % (2 ** 63))
                loss.backward(retain_graph=d < len(partials) - 1)
                for name, leaves in uses.items():
                    for leaf in leaves:
                        if leaf.grad is not None:
                            g = leaf.grad.detach()
                            sums[name] = g.double() if name not in sums else sums[name] + g.double()
                            leaf.grad = None
            state.clear()
            for h in handles:
                h.remove()

        forward_backward(shadow.model, case.loss_fn, inputs, targets, shadow.num_micro, backward=jittered)
        for d, p in zip(draws, partials):
            fold_partial(d, p)
    shadow._retie()
    return [{n: t.double() / (world_size if mode == "split" else 1) for n, t in d.items()} for d in draws]


@pytest.mark.parametrize("name,mode,world_size", [("mlp", "split", 2), ("transformer", "split", 4),
                                                  ("tied_embeddings", "identical", 2), ("grad_accumulation", "split", 2),
                                                  ("batchnorm", "identical", 2), ("mixed_precision", "split", 2)])
def test_the_draws_are_the_terms_of_a_second_forward(name, mode, world_size):
    case = get_case(name)
    init_state, init_buffers = build_init(case)
    batch = case.make_batch(case.seed, 1, case.global_batch)
    shadow = Shadow(case, case.optimizers[0], init_state, init_buffers=init_buffers)
    shadow._reorder_seed = 7
    _, exact, _, deviation = shadow._terms(batch, mode, world_size, shadow.num_micro)
    draws = _second_forward_draws(case, init_state, init_buffers, batch, mode, world_size, seed=7)
    assert set(deviation) == set(exact) and deviation
    for n, e in exact.items():
        expected = torch.stack([(d[n] - e.double()).abs() for d in draws]).amax(0)
        assert torch.equal(deviation[n].view(torch.int64), expected.view(torch.int64)), n
    # the model's buffers are rank 0's after its forward, as a plain step leaves them
    plain = Shadow(case, case.optimizers[0], init_state, init_buffers=init_buffers)
    plain._terms(batch, mode, world_size, plain.num_micro, reorder=False)
    for n, b in shadow.buffers.items():
        assert torch.equal(b, plain.buffers[n]), n
