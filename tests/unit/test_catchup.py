"""Catch-up firings found at a load start a few at a time, oldest first, and wait while the
loop lags (never for ever); a job that went meanwhile is not started."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any, Callable

from agent.jobs.catchup import BURST, GAP_S, WAIT_MAX_S, CatchUps

T0 = datetime(2026, 12, 1, tzinfo=timezone.utc)


class Loop:
    def __init__(self) -> None:
        self.now, self.lagging = 0.0, 0.0
        self.timers: list[list[Any]] = []

    def clock(self) -> float:
        return self.now

    def lag(self) -> float:
        return self.lagging

    def call_later(self, delay: float, fn: Callable[..., Any], *args: Any) -> Any:
        t = [self.now + delay, fn, args]
        self.timers.append(t)
        return SimpleNamespace(cancel=lambda: self.timers.remove(t) if t in self.timers else None)

    def advance(self, s: float) -> None:
        self.now += s
        for t in sorted([t for t in self.timers if t[0] <= self.now], key=lambda t: t[0]):
            self.timers.remove(t)
            t[1](*t[2])


def make(gone: frozenset = frozenset()) -> tuple[Loop, CatchUps, list]:
    loop, fired = Loop(), []
    c = CatchUps(loop, lambda e, due: fired.append(e.name), lambda e: e.name not in gone)  # type: ignore[arg-type]
    return loop, c, fired


def job(i: int) -> Any:
    return SimpleNamespace(name=f"j{i}")


def test_catch_ups_start_a_few_at_a_time_oldest_first():
    loop, c, fired = make(gone=frozenset({"j2"}))
    for i in range(10):
        c.add(job(i), T0 + timedelta(seconds=i))
    assert fired == []                      # not in the load's own callback
    loop.advance(0)
    assert fired == [f"j{i}" for i in range(BURST + 1) if i != 2]   # j2's job went: skipped
    while c:
        loop.advance(GAP_S)
    assert fired == [f"j{i}" for i in range(10) if i != 2]


def test_catch_ups_wait_while_the_loop_lags_but_not_for_ever():
    loop, c, fired = make()
    loop.lagging = 1.0
    c.add(job(1), T0)
    loop.advance(0)
    loop.advance(WAIT_MAX_S / 2)
    assert fired == []
    loop.lagging = 0.0
    loop.advance(GAP_S)
    assert fired == ["j1"]
    loop.lagging = 1.0
    c.add(job(2), T0)
    for _ in range(int(WAIT_MAX_S / GAP_S) + 2):
        loop.advance(GAP_S)
    assert fired == ["j1", "j2"]
