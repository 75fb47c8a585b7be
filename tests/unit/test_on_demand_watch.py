"""OnDemandWatch: a watch runs from the first need until idle_s after the last need went."""

from __future__ import annotations

from agent.coordination.watch import OnDemandWatch


class FakeWatch:
    def __init__(self, revision: int):
        self.revision = revision
        self.stopped = False

    def stop(self, timeout: float = 0.0) -> None:
        self.stopped = True


class Timers:
    """call_later that the test fires by hand."""

    def __init__(self):
        self.pending: list = []

    def call_later(self, delay: float, fn):
        timer = _Timer(delay, fn)
        self.pending.append(timer)
        return timer

    def fire_all(self) -> None:
        due, self.pending = [t for t in self.pending if not t.cancelled], []
        for t in due:
            t.fn()


class _Timer:
    def __init__(self, delay, fn):
        self.delay, self.fn, self.cancelled = delay, fn, False

    def cancel(self):
        self.cancelled = True


def make(users: set, timers: Timers, started: list) -> OnDemandWatch:
    def start(rev: int) -> FakeWatch:
        w = FakeWatch(rev)
        started.append(w)
        return w
    return OnDemandWatch(timers.call_later, start, lambda: bool(users), idle_s=60.0)


def test_starts_once_from_the_first_revision_and_stops_idle_s_after_the_last_need():
    users, timers, started = {"a"}, Timers(), []
    w = make(users, timers, started)
    assert not w.running
    w.need_from(10)
    w.need_from(20)
    assert [s.revision for s in started] == [10] and w.running
    users.clear()
    w.maybe_idle()
    assert [t.delay for t in timers.pending] == [60.0] and w.running
    timers.fire_all()
    assert started[0].stopped and not w.running


def test_a_need_before_the_idle_timer_fires_keeps_the_same_watch():
    users, timers, started = {"a"}, Timers(), []
    w = make(users, timers, started)
    w.need_from(5)
    users.clear()
    w.maybe_idle()
    users.add("b")
    w.need_from(9)          # cancels the idle stop
    timers.fire_all()
    assert len(started) == 1 and not started[0].stopped and w.running


def test_the_idle_timer_does_not_stop_a_watch_that_is_needed_again_without_a_new_need_call():
    users, timers, started = {"a"}, Timers(), []
    w = make(users, timers, started)
    w.need_from(1)
    users.clear()
    w.maybe_idle()
    users.add("late")       # a user came back but has not called need_from yet
    timers.fire_all()
    assert w.running and not started[0].stopped


def test_stop_ends_the_watch_and_its_idle_timer():
    users, timers, started = {"a"}, Timers(), []
    w = make(users, timers, started)
    w.need_from(1)
    users.clear()
    w.maybe_idle()
    w.stop()
    assert started[0].stopped and not w.running
    assert all(t.cancelled for t in timers.pending)
