"""The event loop: timers drop their callbacks once fired or cancelled (no reference
cycles through a firing's timer), and a handler that holds the loop is reported."""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref

from agent.runtime.loop import STALLS, EventLoop


class Holder:
    pass


def run_loop(loop: EventLoop) -> threading.Thread:
    t = threading.Thread(target=loop.run, daemon=True)
    t.start()
    return t


def test_fired_and_cancelled_timers_release_what_they_refer_to():
    gc.disable()   # only reference counting may free them
    try:
        _timers_release(EventLoop())
    finally:
        gc.enable()


def _timers_release(loop: EventLoop) -> None:
    fired, cancelled = Holder(), Holder()
    fired.timer = loop.call_later(0.01, lambda h: None, fired)       # a cycle while armed
    cancelled.timer = loop.call_later(60, lambda h: None, cancelled)
    refs = weakref.ref(fired), weakref.ref(cancelled)
    cancelled.timer.cancel()
    t = run_loop(loop)
    time.sleep(0.1)
    loop.stop()
    t.join(2)
    del fired, cancelled
    assert [r() for r in refs] == [None, None]   # freed by reference counting, no GC needed


def test_a_handler_holding_the_loop_is_logged_with_its_stack(caplog):
    loop = EventLoop()
    before = STALLS._value.get()

    def slow_handler():
        time.sleep(0.8)

    with caplog.at_level(logging.WARNING, logger="agent.runtime.loop"):
        loop.watch_stalls(0.3)
        t = run_loop(loop)
        loop.post(slow_handler)
        loop.post(lambda: None)
        time.sleep(1.2)
        loop.stop()
        t.join(2)
    stalls = [r for r in caplog.records if r.getMessage() == "event loop stalled"]
    assert len(stalls) == 1 and STALLS._value.get() == before + 1
    fields = stalls[0].fields
    assert "slow_handler" in fields["handler"] and fields["held_s"] >= 0.3
    assert "slow_handler" in fields["stack"]


def _busy(s: float) -> None:
    end = time.perf_counter() + s
    while time.perf_counter() < end:
        pass


def test_past_capacity_due_timers_and_posted_callbacks_take_turns():
    """A stream of due timers does not starve the callbacks posted meanwhile (the work they
    started), and a flood of callbacks does not hold back a due timer."""
    loop = EventLoop()
    order: list[str] = []
    for i in range(400):
        loop.call_later(0, lambda i=i: (_busy(0.001), order.append(f"timer-{i}")))
    loop.post(lambda: order.append("posted"))
    t = run_loop(loop)
    time.sleep(0.01)
    try:
        deadline = time.monotonic() + 20
        while len(order) < 401 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(order) == 401
        assert order.index("posted") < 399, "the posted callback waited for every due timer"

        flood: list[str] = []

        def again(n: int) -> None:
            _busy(0.001)
            flood.append("cb")
            if n:
                loop.post(again, n - 1)
        done = threading.Event()
        loop.post(again, 300)
        loop.post(lambda: loop.call_later(0.005, lambda: (flood.append("timer"), done.set())))
        assert done.wait(20)
        assert flood.index("timer") < 300, "the due timer waited for the whole flood"
    finally:
        loop.stop()
        t.join(5)


def test_the_lag_is_how_late_due_timers_run_and_goes_back_to_zero():
    loop = EventLoop()
    ran = threading.Event()
    loop.post(lambda: time.sleep(0.3))   # holds the loop past the timer's due time
    loop.call_later(0.05, ran.set)
    t = run_loop(loop)
    try:
        assert ran.wait(5)
        assert loop.lag() >= 0.25
        time.sleep(2.1)   # two lag windows without a late timer
        assert loop.lag() == 0.0
    finally:
        loop.stop()
        t.join(5)


def test_work_noted_late_counts_in_the_lag_while_the_timers_run_on_time():
    """A backlog of claims and spawns behind on-time timers: the lag says so, then clears."""
    now = [100.0]
    loop = EventLoop(clock=lambda: now[0])
    assert loop.lag() == 0.0
    loop.note_late(3.5)            # a firing started 3.5 s after it was due
    assert loop.lag() == 3.5
    loop.note_late(0.2)            # later, smaller ones do not hide the worst of the window
    assert loop.lag() == 3.5
    now[0] += 1.5                  # the next window: the one before still counts
    loop.note_late(0.001)
    assert loop.lag() == 3.5
    now[0] += 1.0                  # two windows on, only on-time work was noted
    loop.note_late(0.001)
    assert loop.lag() == 0.001
    now[0] += 2.5                  # nothing noted for two windows
    assert loop.lag() == 0.0
