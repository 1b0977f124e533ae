"""[Note: Each rank's term replayed on it] (harness/reference/shadow.py): a judged split cell's rank
r >= 1 replays its own term and sends it to rank 0 (`TermFeed`), which folds it only where it was
computed from rank 0's own parameters and buffers (their digests), and computes it itself otherwise.
That the judged records are bitwise those of rank 0 replaying every term is
tests/harness/run/test_judged_on_ranks.py (its ranks send their terms; the parent's replay computes
them all); here, the feed itself."""

from __future__ import annotations

import torch

from harness.reference.shadow import RankTerm, Shadow, with_abs_of_one
from harness.run.simulated import simulate
from harness.run.worker import TermFeed
from cases.catalog import get_case


def _term(seed: int) -> RankTerm:
    g = torch.Generator().manual_seed(seed)
    one = torch.randn(5, 3, generator=g)
    several = torch.randn(4, generator=g).double()
    return RankTerm(torch.tensor(0.25), {"w": one, "b": several}, {"b": several.abs() + 1})


def test_a_term_sent_from_the_same_values_arrives_bit_for_bit_and_one_from_other_values_is_refused():
    before = [11, 22, 33]

    def fn(rank):
        if rank == 0:
            same = TermFeed.receive(1, before, torch.device("cpu"))
            sums, abs_sums = {}, {}
            same.fold_into(sums, abs_sums)  # received as it is folded
            other = TermFeed.receive(1, before, torch.device("cpu"))
            return same.loss, sums, abs_sums, other
        feed = TermFeed()
        feed.send(_term(1), before)
        feed.send(_term(1), [11, 22, 34])  # a replica whose parameters differ in one tensor
        feed.wait()
        return None

    (loss, sums, abs_sums, other), _ = simulate(2, fn)
    sent = _term(1)
    assert other is None
    assert torch.equal(loss, sent.loss)
    # what rank 0 folds: the partials as sent, one term's |.| computed from it, several terms' as sent
    assert list(sums) == list(sent.sums)
    for name in sent.sums:
        assert sums[name].dtype == sent.sums[name].dtype and torch.equal(sums[name], sent.sums[name])
    assert list(abs_sums) == ["b"]  # one term's |.| is not held, only computed when read
    abs_sums = with_abs_of_one(sums, abs_sums)
    assert list(abs_sums) == list(sent.sums)
    assert torch.equal(abs_sums["w"], sent.sums["w"].abs())
    assert torch.equal(abs_sums["b"], sent.abs_of_several["b"])


def test_a_term_read_in_part_is_received_whole_and_the_next_arrives_intact():
    """A fold that stops after one parameter (an error in it) still takes the term's other
    messages, so the next term is read as sent, not from the rest of this one."""
    before = [1, 2]

    def fn(rank):
        if rank == 0:
            first = TermFeed.receive(1, before, torch.device("cpu"))
            parts = first.parts()
            next(parts)
            parts.close()
            nxt = TermFeed.receive(1, before, torch.device("cpu"))
            sums: dict = {}
            nxt.fold_into(sums, None)
            return nxt.loss, sums
        feed = TermFeed()
        feed.send(_term(1), before)
        feed.send(_term(2), before)
        feed.wait()
        return None

    (loss, sums), _ = simulate(2, fn)
    sent = _term(2)
    assert torch.equal(loss, sent.loss) and list(sums) == list(sent.sums)
    assert all(torch.equal(sums[n], sent.sums[n]) for n in sent.sums)


def test_a_ranks_replayed_term_is_the_term_rank_0_replays_for_it():
    """Shadow.rank_term on a rank is the term Shadow.step folds for that rank: the step's record
    with every term computed on rank 0 and with rank 1's given are the same bits (split, two
    micro-batches: float64 partial sums and absolute sums travel)."""
    case = get_case("grad_accumulation")
    model = case.build_model()
    init = {n: t.detach().clone() for n, t in model.state_dict().items()}
    batch = case.make_batch(case.seed, 1, case.global_batch)
    spec = case.optimizers[0]
    alone = Shadow(case, spec, init).step(init, batch, "split", 2, reorder=False)
    term = Shadow(case, spec, init).rank_term(init, batch, "split", 2, 1)
    assert any(t.dtype == torch.float64 for t in term.sums.values()) and term.abs_of_several
    given = Shadow(case, spec, init).step(init, batch, "split", 2, reorder=False,
                                          given=lambda rank: term if rank == 1 else None)
    for key in ("grads", "abs_grads", "params"):
        assert list(alone[key]) == list(given[key])
        for name in alone[key]:
            assert torch.equal(alone[key][name], given[key][name]), (key, name)
    assert torch.equal(alone["loss"], given["loss"])
    # planted: rank 1's term from another rank's batch is not what rank 0 replays for rank 1
    wrong = Shadow(case, spec, init).rank_term(init, batch, "split", 2, 0)
    other = Shadow(case, spec, init).step(init, batch, "split", 2, reorder=False,
                                          given=lambda rank: wrong if rank == 1 else None)
    assert any(not torch.equal(alone["grads"][n], other["grads"][n]) for n in alone["grads"])
