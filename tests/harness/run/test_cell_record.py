"""Fast tier: the fence around a cell's completion record (harness/run/worker.py `_cell_record`).

Three ranks as threads on one in-process store: rank 0 writes the record only once every rank
has finished the cell, and no rank leaves the fence before the record is written.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from harness.adapters.base import RankContext
from harness.run.worker import _cell_record

WORLD = 3
LATE = 0.3  # seconds rank 2 takes longer than the others to finish the cell


def test_the_record_waits_for_every_rank_and_every_rank_waits_for_the_record():
    store = dist.PrefixStore("harness/cells", dist.HashStore())
    store.set_timeout(timedelta(seconds=30))
    events: list[tuple[str, int]] = []
    lock = threading.Lock()

    def log(what: str, rank: int) -> None:
        with lock:
            events.append((what, rank))

    def rank(r: int) -> None:
        if r == 2:
            time.sleep(LATE)  # the last rank to finish the cell
        log("done", r)
        with _cell_record(store, 7, RankContext(r, WORLD, None)) as record_it:
            if record_it:
                time.sleep(LATE)  # a slow write: the others must still be inside
                log("recorded", r)
        log("left", r)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    order = [what for what, _ in events]
    recorded = order.index("recorded")
    assert order[:recorded].count("done") == WORLD, events  # every rank finished before the record
    assert "left" not in order[:recorded], events  # nobody left before it
    assert order[recorded + 1:].count("left") == WORLD, events


def test_fences_of_two_cells_do_not_mix():
    store = dist.PrefixStore("harness/cells", dist.HashStore())
    store.set_timeout(timedelta(seconds=30))
    store.set("8/done/1", "1")  # rank 1 finished the next cell, not this one
    store.set("8/done/2", "1")
    entered = threading.Event()

    def rank0() -> None:
        with _cell_record(store, 7, RankContext(0, WORLD, None)) as record_it:
            assert record_it
            entered.set()

    t = threading.Thread(target=rank0, daemon=True)
    t.start()
    assert not entered.wait(0.5), "rank 0 recorded cell 7 on the other ranks' keys of cell 8"
    store.set("7/done/1", "1")
    store.set("7/done/2", "1")
    assert entered.wait(10)
    t.join(timeout=10)
