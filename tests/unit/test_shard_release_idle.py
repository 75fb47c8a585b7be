"""A run's end triggers a shard reconcile only when a shard is waiting for its runs.

A reconcile walks every shard: at 100 runs/s one per run's end would cost the agent CPU
per firing. Only a shard the last reconcile kept for its runs makes release_idle()
reconcile, and that shard still goes once its runs are over."""

import json

from agent.coordination.keys import Keys
from agent.coordination.shards import Holder, Member, ShardManager
from tests.support.fakes import ManualLoop


def _manager(busy):
    loop = ManualLoop()
    m = ShardManager("a", 2, Keys("t"), None, None, loop, on_acquired=lambda f: None,
                     on_lost=lambda s, r: None, busy=lambda s: s in busy)
    m.members = {"a": Member("a", 1.0, True, 7), "b": Member("b", 1.0, True, 8)}
    m.lease, m.registered = 7, True
    for s in range(2):
        m.holders[s] = Holder("a", 100 + s, 7)
        m.mine[s] = object()
    released = []

    def release(s):
        released.append(s)
        m._releasing.add(s)
    m._release = release
    return m, loop, released


def test_a_shard_kept_for_its_runs_goes_when_they_end_and_only_then_is_a_reconcile_due():
    busy = {0, 1}
    m, loop, released = _manager(busy)
    m.draining = True                 # every shard wants to go
    m.reconcile()
    assert released == [] and m._kept_busy == {0, 1}
    busy.discard(0)                   # shard 0's last run ended
    m.release_idle()
    assert loop.run_all() == 1 and released == [0]
    busy.discard(1)
    assert m.waiting_on_runs()        # the scheduler asks busy() of a settled shard only now
    m.release_idle()
    assert loop.run_all() == 1 and released == [0, 1]
    assert m._kept_busy == set() and not m.waiting_on_runs()
    m.release_idle()                  # nothing waits for its runs: no reconcile
    assert loop.calls == []


def test_runs_ending_on_shards_that_stay_schedule_no_reconcile():
    busy = {0}
    m, loop, released = _manager(busy)
    m.members = {"a": Member("a", 1.0, True, 7)}   # alone: both shards stay here
    m.reconcile()
    assert released == [] and m._kept_busy == set()
    busy.clear()
    m.release_idle()
    assert loop.calls == []


def test_shards_held_before_our_own_member_record_is_seen_stay_held():
    """At start-up the shards watch can report our claims before the members watch reports
    our own registration (two streams; seen on a loaded CI host): the plan is empty then.
    Releasing the shards would only make us claim them again, under new fences, and give
    up the firings claimed under the old ones."""
    m, loop, released = _manager(set())
    m.members = {}
    m.reconcile()
    assert released == []
    m.unavailable_reason = "memory_pressure"   # handed off: they go, even with no peer to take them
    m.reconcile()
    assert released == [0, 1]


class _Workers:
    """The etcd workers, recorded: the member record puts asked for."""

    def __init__(self) -> None:
        self.ops: list = []

    def submit(self, op, done) -> None:
        self.ops.append(op)


def test_a_hand_off_publishes_the_member_unavailable_and_lets_idle_shards_go():
    """Supervision's hand-off (Availability): the reason is kept, the member record is put
    again, and a shard kept for its runs is reconsidered (release_idle); take_back undoes
    the reason the same way."""
    m, loop, released = _manager({0, 1})
    m.workers = _Workers()
    m._member_value = (1.0, {})
    m.draining = True
    m.reconcile()
    assert released == [] and m._kept_busy == {0, 1}
    m.hand_off("memory_pressure")
    assert m.unavailable_reason == "memory_pressure" and len(m.workers.ops) == 1
    assert json.loads(m._member_record(1.0, {}, 7))["available"] is False
    assert len(loop.calls) == 1 and loop.calls[0][1] == m.reconcile   # release_idle: a reconcile is due
    loop.run_all()
    m.take_back()
    assert m.unavailable_reason is None and len(m.workers.ops) == 2 and len(loop.calls) == 1
    m.draining = False
    assert json.loads(m._member_record(1.0, {}, 7))["available"] is True
