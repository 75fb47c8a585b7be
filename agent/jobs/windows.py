"""Maintenance windows enforced by the agent from the signed document alone (no cloud
connection needed): a StartPolicy (no run of the job starts outside a window: not a due
firing, a retry, a misfire catch-up nor a run after failover, since all of them pass the
start policies before their claim) and a RunListener (with ``end: stop|cancel``, a run
still going gets SIGTERM kill_grace_s before its window closes and SIGKILL at the close;
with ``cancel`` the job is cancelled too).

A firing due outside a window waits for the next one (status ``waiting``, reason
``window``), except under ``misfire: skip``, where it is misfired ``window`` at once; what
happens to later firings due while one waits is the misfire policy (crowding.py). A retry
always waits. The window is judged at the instant the run would start: the firing's due
time when it is claimed ahead of it, else now. With ``end: stop|cancel`` a run starts only
while at least kill_grace_s of its window is left (it would be stopped at once).

Loop thread; the clock is injected (tests run it on a fake one).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional

from agent.jobs.firing import FiringState
from agent.jobs.startpolicy import GO, Verdict, end, wait
from agent.jobs.states import EndReason, RecordState
from agent.jobs.window import WAIT_REASON, Window
from agent.runtime.timefmt import format_rfc3339, utcnow

if TYPE_CHECKING:
    from agent.jobs.catalog import JobEntry
    from agent.jobs.firing import Firing
    from agent.jobs.seams import AuditSink
    from agent.runtime.loop import EventLoop

log = logging.getLogger(__name__)

MAX_TIMER_S = 3600.0   # a wake-up further out is re-armed from there (the wall clock may step meanwhile)
EARLY_S = 0.001        # a timer may fire a hair before the wall clock says the window changed


class WindowPolicy:
    """StartPolicy and RunListener of ``window`` (loop thread)."""

    name = "window"

    def __init__(self, loop: EventLoop, kill_grace_s: float, audit: AuditSink,
                 cancel_job: Callable[[JobEntry, str], None], clock: Callable[[], datetime] = utcnow):
        self.loop = loop
        self.grace = timedelta(seconds=kill_grace_s)
        self.audit = audit
        self.cancel_job = cancel_job   # end: cancel (writes the job's cancel mark, stops it here)
        self.clock = clock
        self._stops: dict[str, Any] = {}   # firing key -> the timer that stops its run

    # --- StartPolicy ---------------------------------------------------------------------
    def _start_at(self, f: Firing) -> datetime:
        """When ``f``'s run would start: its due time when claimed ahead of it, else now."""
        return max(self.clock(), f.due)

    def _usable(self, w: Window, t: datetime) -> bool:
        if not w.is_open(t):
            return False
        if not w.stops_runs or not self.grace:
            return True
        close = w.closes_at(t)
        return close is None or close - t >= self.grace

    def judge(self, f: Firing) -> Verdict:
        w = f.entry.job.window
        if w is None:
            return GO
        t = self._start_at(f)
        if self._usable(w, t):
            return GO
        nxt = w.next_open(t + (self.grace if w.stops_runs else timedelta(0)))
        retry = f.claim.record is not None
        if nxt is None or (f.entry.job.misfire == "skip" and not retry):
            why = "no window of the job opens again" if nxt is None else "misfire skip: due outside its window"
            self.audit.record("window", event="misfired", job=f.entry.job.id, fire_id=f.fire_id, detail=why)
            return end(RecordState.MISFIRED, WAIT_REASON, why)
        if f.wait_reason != WAIT_REASON:
            self.audit.record("window", event="waits", job=f.entry.job.id, fire_id=f.fire_id,
                              attempt=f.attempt, opens_at=format_rfc3339(nxt))
        return wait(WAIT_REASON, f"the job's window opens at {format_rfc3339(nxt)}")

    def subscribe(self, f: Firing, wake: Callable[[], None]) -> Callable[[], None]:
        w = f.entry.job.window
        if w is None:
            return _nothing
        t = self._start_at(f)
        change = w.next_change(t)
        if change is None:
            return _nothing
        if w.stops_runs and w.is_open(t) and change - self.grace > t:
            change -= self.grace   # where _usable turns (past it: the close, then the next window)
        delay = (change - self.clock()).total_seconds() + EARLY_S
        timer = self.loop.call_later(min(max(0.0, delay), MAX_TIMER_S), wake)
        return timer.cancel

    # --- RunListener ---------------------------------------------------------------------
    def run_started(self, f: Firing) -> None:
        w = f.entry.job.window
        if w is None or not w.stops_runs:
            return
        self._arm_stop(f, w, self._start_at(f))

    def _arm_stop(self, f: Firing, w: Window, t: datetime) -> None:
        close = w.closes_at(t)
        if close is None:
            close = t   # started outside its window (its claim raced the close): stopped now
        delay = (close - self.grace - self.clock()).total_seconds()
        self._stops[f.key] = self.loop.call_later(min(max(0.0, delay), MAX_TIMER_S), self._stop, f, close)

    def _stop(self, f: Firing, close: datetime) -> None:
        self._stops.pop(f.key, None)
        w = f.entry.job.window
        if w is None or f.state != FiringState.RUNNING or f.handle is None:
            return
        now = self.clock()
        later = w.closes_at(close) if w.is_open(close) else None
        if later is not None and later > close:   # another window goes on from there
            self._arm_stop(f, w, close)
            return
        if close - now > self.grace + timedelta(seconds=EARLY_S):   # woken early (MAX_TIMER_S): again
            self._arm_stop(f, w, now)
            return
        e = f.entry
        log.info("run stopped at its window's end", extra={"fields": {"job": e.job.id, "fire_id": f.fire_id,
                                                                      "end": w.end}})
        self.audit.record("window", event="stop", job=e.job.id, fire_id=f.fire_id, attempt=f.attempt,
                          closes_at=format_rfc3339(close), end=w.end)
        f.handle.terminate(EndReason.WINDOW_CLOSED)
        if w.end == "cancel":
            self.cancel_job(e, EndReason.WINDOW_CLOSED)

    def run_ended(self, f: Firing) -> None:
        timer = self._stops.pop(f.key, None)
        if timer is not None:
            timer.cancel()


def _nothing() -> None:
    pass


def describe(window: Optional[Window], now: datetime) -> Optional[dict]:
    """The window as ``jobs show`` prints it (None: the job has none)."""
    return None if window is None else window.describe(now)
