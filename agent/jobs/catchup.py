"""Catch-up firings (misfire run_once/run_all) found when a unit is loaded (a takeover, a
start), started a few at a time. A job pushed or stored while its unit is held starts its
due firing at once, as before.

A takeover finds the firings that fell due while no agent owned the shard; started all at
once in the load's loop callback, their claims and spawns queued ahead of the firings due
right after the takeover, which were then late too. Here they start BURST at a time, one
turn every GAP_S, and wait while the loop lags more than LAG_BOUND_S (the firings due now
go first), though never longer than WAIT_MAX_S: overload delays them, never drops them.
Oldest first; a job's own later catch-ups still follow its first one (JobEntry.backlog).
"""

from __future__ import annotations

import collections
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from agent.jobs.catalog import JobEntry
    from agent.runtime.loop import EventLoop

BURST = 8
GAP_S = 0.01
LAG_BOUND_S = 0.1
WAIT_MAX_S = 1.0


class CatchUps:
    """Loop thread only."""

    def __init__(self, loop: EventLoop, fire: Callable[[JobEntry, datetime], None],
                 may_fire: Callable[[JobEntry], bool]):
        self.loop = loop
        self.fire = fire
        self.may_fire = may_fire        # the entry is still installed and not cancelled
        self.queue: collections.deque = collections.deque()   # (entry, due, queued at)
        self._timer: Any = None

    def start(self, e: JobEntry, dues: list[datetime]) -> None:
        """A job's catch-ups found at its load, oldest first: the first fires now (a job
        pushed or stored while its unit is held) or paced here (a takeover's, at_load); the
        others follow it one after another (JobEntry.backlog)."""
        e.backlog.extend(dues[1:])
        if e.at_load:
            self.add(e, dues[0])
        else:
            self.fire(e, dues[0])

    def add(self, e: JobEntry, due: datetime) -> None:
        self.queue.append((e, due, self.loop.clock()))
        if self._timer is None:
            self._timer = self.loop.call_later(0, self._turn)

    def __len__(self) -> int:
        return len(self.queue)

    def _turn(self) -> None:
        self._timer = None
        now = self.loop.clock()
        lagging = self.loop.lag() > LAG_BOUND_S
        started = 0
        while self.queue and started < BURST:
            e, due, since = self.queue[0]
            if lagging and now - since < WAIT_MAX_S:
                break
            self.queue.popleft()
            if self.may_fire(e):
                self.fire(e, due)
                started += 1
        if self.queue:
            self._timer = self.loop.call_later(GAP_S, self._turn)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.queue.clear()
