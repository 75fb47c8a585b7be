"""Fakes of the agent's own seams for unit tests of pure logic: a clock the test moves and
an event loop whose timers the test runs."""

from __future__ import annotations

from typing import Any, Callable


class ManualClock:
    """A monotonic clock (``clock()``) that stands still until the test moves ``t``."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class _Timer:
    def __init__(self, entry: list) -> None:
        self.entry = entry

    def cancel(self) -> None:
        self.entry[3] = True


class ManualLoop:
    """The EventLoop's call_later, recorded: ``calls`` holds [delay, fn, args, cancelled]
    in the order asked; the test runs them (the logic that asks is under test)."""

    def __init__(self) -> None:
        self.calls: list[list] = []

    def call_later(self, delay: float, fn: Callable[..., Any], *args: Any) -> _Timer:
        entry = [delay, fn, args, False]
        self.calls.append(entry)
        return _Timer(entry)

    def run_next(self) -> float:
        """Run the oldest timer (never a cancelled one); its delay."""
        entry = self.calls.pop(0)
        assert not entry[3], "the next timer was cancelled"
        entry[1](*entry[2])
        return entry[0]

    def run_all(self) -> int:
        """Run every timer recorded so far that is not cancelled, oldest first; how many ran."""
        calls, self.calls = self.calls, []
        live = [c for c in calls if not c[3]]
        for _, fn, args, _ in live:
            fn(*args)
        return len(live)
