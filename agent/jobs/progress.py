"""A running attempt's progress lines (agent/execute/progress.py reads them from the run's
MILLWRIGHT_PROGRESS FIFO) as the cloud and etcd see them: an ``in_progress`` status at
most every STATUS_EVERY_S per run and the run record's ``progress`` at most every
RECORD_EVERY_S, each with the newest line (the last one of a burst is never lost: a
trailing timer sends it). The step timeout itself is the executor's (its reaper thread
kills a silent run however busy this loop is); the final record and status carry the
whole summary and the result (outcomes.end_fields).

Loop thread only."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable, Optional

from agent.jobs.firing import FiringState
from agent.jobs.metrics import PROGRESS_LINES
from agent.jobs.states import JobState
from agent.runtime.timefmt import format_rfc3339

if TYPE_CHECKING:
    from agent.execute.runs import RunHandle
    from agent.jobs.firing import Firing
    from agent.jobs.records import RunRecords
    from agent.jobs.statuses import Statuses
    from agent.runtime.loop import EventLoop

STATUS_EVERY_S = 1.0
RECORD_EVERY_S = 5.0


@dataclass
class Reported:
    """What one attempt reported, and when it was last passed on."""

    handle: RunHandle
    lines: int = 0
    last: Optional[dict] = None
    status_at: float = -1e9
    record_at: float = -1e9
    timers: dict = field(default_factory=dict)   # "status" | "record" -> a trailing timer


class ProgressReports:
    def __init__(self, statuses: Statuses, records: RunRecords, loop: EventLoop,
                 clock: Callable[[], float] = time.monotonic):
        self.statuses = statuses
        self.records = records
        self.loop = loop
        self.clock = clock

    def seen(self, f: Firing, handle: RunHandle, lines: list[dict]) -> None:
        """New valid lines of the attempt ``handle`` runs (posted by the reaper thread)."""
        if f.handle is not handle or f.state != FiringState.RUNNING or not lines:
            return
        PROGRESS_LINES.inc(len(lines))
        rep = f.progress if isinstance(f.progress, Reported) and f.progress.handle is handle else None
        if rep is None:
            rep = f.progress = Reported(handle)
        rep.lines += len(lines)
        rep.last = lines[-1]
        self._due(f, rep, "status", STATUS_EVERY_S)
        self._due(f, rep, "record", RECORD_EVERY_S)

    def _due(self, f: Firing, rep: Reported, what: str, every: float) -> None:
        if what in rep.timers:
            return   # a trailing send is timed already: it takes the newest line
        wait = getattr(rep, what + "_at") + every - self.clock()
        if wait <= 0:
            self._send(f, rep, what)
        else:
            rep.timers[what] = self.loop.call_later(wait, self._trailing, f, rep, what)

    def _trailing(self, f: Firing, rep: Reported, what: str) -> None:
        rep.timers.pop(what, None)
        if f.progress is rep and f.handle is rep.handle and f.state == FiringState.RUNNING:
            self._send(f, rep, what)

    def _send(self, f: Firing, rep: Reported, what: str) -> None:
        setattr(rep, what + "_at", self.clock())
        if what == "status":
            last = rep.last or {}
            self.statuses.send(f.entry, f, JobState.IN_PROGRESS, pid=rep.handle.pid,
                               progress=self.fields(rep), at=_rfc(last.get("at")))
        elif not self.records.write_progress(f, self.fields(rep)):
            rep.record_at = -1e9   # a write was in flight: the next line tries again

    @staticmethod
    def fields(rep: Reported) -> dict:
        out: dict[str, Any] = {"lines": rep.lines}
        out.update({k: v for k, v in (rep.last or {}).items() if k != "at"})
        return out


def _rfc(ts: Optional[float]) -> Optional[str]:
    return format_rfc3339(datetime.fromtimestamp(ts, timezone.utc)) if ts else None
