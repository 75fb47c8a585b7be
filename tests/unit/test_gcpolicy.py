"""GcPolicy: long-lived state is frozen out of the collector; full collections run only
in quiet gaps (or when overdue), and they do reclaim cycles that were frozen."""

from __future__ import annotations

import gc
import time
import weakref

import pytest

from agent.runtime.gcpolicy import FULL, GcPolicy
from tests.support.fakes import ManualLoop


class Node:
    pass


@pytest.fixture(autouse=True)
def unfrozen():
    yield
    gc.unfreeze()


def test_settle_is_coalesced_and_freezes_what_is_alive():
    gc.unfreeze()
    loop = ManualLoop()
    p = GcPolicy(loop, lambda: None, settle_s=1.0)
    p.settle()
    p.settle()
    assert [c[0] for c in loop.calls] == [1.0]
    loop.run_next()
    assert gc.get_freeze_count() > 0
    p.settle()   # a later install schedules a new freeze
    assert len(loop.calls) == 1


def test_full_collection_waits_for_a_quiet_gap_and_reclaims_frozen_cycles():
    loop = ManualLoop()
    quiet = {"s": 0.1}
    _policy = GcPolicy(loop, lambda: quiet["s"], full_every_s=600, gap_s=0.5, max_wait_s=1800).start()
    a, b = Node(), Node()
    a.other, b.other = b, a          # a reference cycle, frozen while still in use
    gone = weakref.ref(a)
    gc.freeze()
    del a, b
    gc.collect()
    assert gone() is not None        # frozen: ordinary collections never see it
    before = FULL._sum.get()
    assert loop.run_next() == 600    # the first full collection falls due
    assert [c[0] for c in loop.calls] == [0.25] and gone() is not None   # not quiet: later
    quiet["s"] = 5.0
    loop.run_next()
    assert gone() is None            # unfrozen, collected, frozen again
    assert FULL._sum.get() > before
    assert [c[0] for c in loop.calls] == [600]


def test_an_overdue_full_collection_runs_even_when_never_quiet():
    loop = ManualLoop()
    p = GcPolicy(loop, lambda: 0.0, full_every_s=600, gap_s=0.5, max_wait_s=10).start()
    p._full_due = time.monotonic() - 11
    a = Node()
    a.self = a
    gone = weakref.ref(a)
    gc.freeze()
    del a
    loop.run_next()
    assert gone() is None
    p.stop()
    assert all(c[3] for c in loop.calls)
