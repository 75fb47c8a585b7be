"""Group commit of fenced writes (agent/coordination/groupcommit.py), without an etcd: the
writes submitted within their windows leave in one batch and each gets its own outcome; a
write whose key is in flight waits for that batch (writes of one key land in order); a full
batch leaves at once; a batch's failure is every write's. fenced_batch itself runs against
a real etcd in tests/integration/test_group_commit.py."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from agent.coordination import fencing
from agent.coordination.etcd import Create, Put, TxnResult
from agent.coordination.fencing import Fence, FencedWrite, StaleToken
from agent.coordination.groupcommit import GroupCommit


class Loop:
    """The loop's timers by hand: ``advance(s)`` runs what fell due."""

    def __init__(self) -> None:
        self.now = 100.0
        self.timers: list[list[Any]] = []

    def clock(self) -> float:
        return self.now

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)

    def call_at(self, when: float, fn: Callable[..., Any], *args: Any) -> Any:
        t = [when, fn, args, False]

        class Handle:
            def cancel(self) -> None:
                t[3] = True
        self.timers.append(t)
        return Handle()

    def advance(self, s: float = 0.0) -> None:
        self.now += s
        while True:
            due = sorted((t for t in self.timers if not t[3] and t[0] <= self.now), key=lambda t: t[0])
            if not due:
                return
            t = due[0]
            self.timers.remove(t)
            t[1](*t[2])


class Workers:
    """Holds each batch until ``land()``: what is in flight stays visible."""

    max_threads = 1

    def __init__(self) -> None:
        self.queued: list[tuple[Any, Any]] = []

    def submit(self, op: Any, done: Any) -> None:
        self.queued.append((op, done))

    def land(self) -> None:
        queued, self.queued = self.queued, []
        for op, done in queued:
            try:
                r = op()
            except Exception as exc:
                done(None, exc)
            else:
                done(r, None)


class Etcd:
    """fenced_batch as a recording: which writes went together, and the outcome of each
    (a stale fence fails its writes; a compare on the key "taken" fails)."""

    def __init__(self, stale: frozenset = frozenset()) -> None:
        self.batches: list[list[str]] = []
        self.stale = stale
        self.error: Exception | None = None

    def __call__(self, client: Any, writes: list, timeout: Any = None) -> list:
        self.batches.append([_key(w) for w in writes])
        if self.error is not None:
            raise self.error
        out: list = []
        for w in writes:
            if w.fence.shard in self.stale:
                out.append(StaleToken("stale"))
            else:
                out.append(TxnResult(_key(w) != "taken", 7, []))
        return out


def _key(w: FencedWrite) -> str:
    return w.success[0].key


FENCE = Fence(1, "/shards/1", 5)


def write(key: str, *more: str, fence: Fence = FENCE) -> FencedWrite:
    return FencedWrite(fence, (Create(key) == 0,), tuple(Put(k, "v") for k in (key, *more)))


@pytest.fixture
def gc(monkeypatch):
    loop, workers, etcd = Loop(), Workers(), Etcd()
    monkeypatch.setattr(fencing, "fenced_batch", etcd)
    return GroupCommit(None, loop, workers), loop, workers, etcd


def outcome(seen: list, key: str) -> Callable[[Any, Any], None]:
    return lambda r, err: seen.append((key, "error" if err is not None and not isinstance(err, StaleToken)
                                       else "stale" if err is not None else r.succeeded))


def test_writes_of_one_tick_leave_in_one_transaction_each_with_its_own_outcome(gc):
    g, loop, workers, etcd = gc
    etcd.stale = frozenset({2})
    seen: list = []
    g.submit(write("a"), outcome(seen, "a"))
    g.submit(write("taken"), outcome(seen, "taken"))
    g.submit(write("c", fence=Fence(2, "/shards/2", 9)), outcome(seen, "c"))
    assert etcd.batches == [] and workers.queued == []   # nothing left during the tick
    loop.advance()
    workers.land()
    assert etcd.batches == [["a", "taken", "c"]]
    assert seen == [("a", True), ("taken", False), ("c", "stale")]


def test_a_write_waits_for_its_window_and_an_urgent_one_takes_it_along(gc):
    g, loop, workers, etcd = gc
    seen: list = []
    g.submit(write("early"), outcome(seen, "early"), within=0.02)
    loop.advance(0.01)
    assert etcd.batches == [] and workers.queued == []
    g.submit(write("late"), outcome(seen, "late"), within=0.05)
    loop.advance(0.01)                      # the first write's window ended: both go
    workers.land()
    assert etcd.batches == [["early", "late"]]
    g.submit(write("lazy"), outcome(seen, "lazy"), within=0.05)
    g.submit(write("now"), outcome(seen, "now"))
    loop.advance()
    workers.land()
    assert etcd.batches[1] == ["lazy", "now"]
    assert [k for k, _ in seen] == ["early", "late", "lazy", "now"]


def test_writes_of_one_key_never_travel_together_and_land_in_order(gc):
    g, loop, workers, etcd = gc
    seen: list = []
    g.submit(write("r1", "latest/j"), outcome(seen, "r1"))
    g.submit(write("r2", "latest/j"), outcome(seen, "r2"))   # the same latest/ copy
    g.submit(write("other"), outcome(seen, "other"))
    loop.advance()
    assert etcd.batches == []                  # the batch is built when the worker runs it
    workers.land()
    assert etcd.batches == [["r1", "other"]]   # r2 waited: its key was in this batch
    assert [k for k, _ in seen] == ["r1", "other"]
    g.submit(write("r3", "latest/j"), outcome(seen, "r3"))
    loop.advance()
    workers.land()
    assert etcd.batches[1] == ["r2"]           # r3 waits behind r2, in flight until now
    loop.advance()
    workers.land()
    assert etcd.batches[2] == ["r3"]
    assert [k for k, _ in seen] == ["r1", "other", "r2", "r3"]
    assert g.pending == [] and g.in_flight == set()


def test_a_full_batch_leaves_at_once_and_the_rest_follows(gc):
    g, loop, workers, etcd = gc
    g.max_writes = 4
    seen: list = []
    for i in range(6):
        g.submit(write(f"k{i}"), outcome(seen, f"k{i}"), within=1.0)
    loop.advance()
    workers.land()
    assert etcd.batches == [["k0", "k1", "k2", "k3"]]
    loop.advance(1.0)
    workers.land()
    assert etcd.batches[1] == ["k4", "k5"] and len(seen) == 6


def test_a_batch_that_failed_fails_each_of_its_writes(gc):
    g, loop, workers, etcd = gc
    etcd.error = TimeoutError("no answer")
    seen: list = []
    g.submit(write("a"), outcome(seen, "a"))
    g.submit(write("b"), outcome(seen, "b"))
    loop.advance()
    workers.land()
    assert seen == [("a", "error"), ("b", "error")]
    assert g.in_flight == set()


def test_work_after_the_batch_runs_for_the_writes_that_succeeded_only(gc):
    g, loop, workers, etcd = gc
    etcd.stale = frozenset({2})
    staged: list = []
    results: dict = {}

    def then(name: str) -> Callable[[Any], Any]:
        def run(r: Any) -> str:
            staged.append(name)
            return f"staged-{name}"
        return run

    for name, fence in (("a", FENCE), ("taken", FENCE), ("c", Fence(2, "/shards/2", 9))):
        g.submit(write(name, fence=fence), lambda r, err, name=name: results.setdefault(name, (r, err)),
                 then=then(name))
    loop.advance()
    workers.land()
    assert staged == ["a"]
    assert results["a"][0][1] == "staged-a" and results["a"][0][0].succeeded
    assert results["taken"][0][1] is None and not results["taken"][0][0].succeeded
    assert results["c"][0] is None and isinstance(results["c"][1], StaleToken)


def test_the_work_after_a_big_batch_is_spread_over_the_pool(gc):
    """Many claims in one batch: the worker that ran the transaction stages the first chunk
    and the loop hands the rest to other workers; each claim's outcome comes as its work is
    done, once."""
    g, loop, workers, etcd = gc
    g.spread = 3
    staged: list = []
    seen: list = []
    for i in range(10):
        g.submit(write(f"c{i}"), lambda r, err, i=i: seen.append(i),
                 then=lambda r, i=i: staged.append(i))
    loop.advance()
    workers.land()                 # the transaction, then the first chunk on the same worker
    assert etcd.batches == [[f"c{i}" for i in range(10)]]
    assert staged == [0, 1, 2, 3] and len(workers.queued) == 2   # the other chunks wait for workers
    workers.land()
    assert sorted(staged) == list(range(10)) and sorted(seen) == list(range(10))
