"""Maintenance windows: when a job's runs may start (the document's ``window``).

A window is recurring (``{"cron", "duration_s", "tz"}``: one opens at each cron time, on
the wall clock of ``tz`` and DST-correct exactly like a schedule, and lasts ``duration_s``
of elapsed time) or a list of absolute ``{"start", "end"}`` ranges (RFC 3339). Each is the
half-open interval [start, end). ``end`` says what a run still going when its window
closes gets: ``finish`` (it may finish), ``stop`` (SIGTERM kill_grace_s before the close,
SIGKILL at it: outcome ``window_closed``) or ``cancel`` (as stop, and the job is cancelled).

Pure: every function takes the instant it is asked about; nothing reads the clock, so
every agent (and ``millwright jobs show``) computes the same windows from the signed
document.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Optional

from agent.jobs.envelope import field_name
from agent.jobs.schedule import Schedule, ScheduleError, next_due
from agent.runtime.text import short
from agent.runtime.timefmt import format_rfc3339, parse_rfc3339

ENDS = ("finish", "stop", "cancel")
WAIT_REASON = "window"  # a firing waiting for its window: the status's reason, and a misfired one's
MIN_DURATION_S = 1.0
MAX_DURATION_S = 7 * 86400.0
MAX_RANGES = 64
MAX_MERGE = 50          # windows chained into one close time at most (a later check goes on from there)
MAX_SCAN = 10_000       # cron starts looked at for one answer, at most


class WindowError(ValueError):
    """An invalid window; ``field`` is the document path (``window.duration_s``)."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class Window:
    end: str = "finish"
    schedule: Optional[Schedule] = None          # recurring: the cron times windows open at
    duration_s: float = 0.0
    ranges: tuple[tuple[datetime, datetime], ...] = ()   # absolute: sorted by start

    @property
    def stops_runs(self) -> bool:
        return self.end in ("stop", "cancel")

    # --- parsing ---------------------------------------------------------------------
    @classmethod
    def parse(cls, obj: Any) -> "Window":
        """From the document's ``window``. Raises WindowError naming the field."""
        if isinstance(obj, list):
            return cls(ranges=_ranges(obj, "window"))
        if not isinstance(obj, dict):
            raise WindowError("window", "must be an object ({cron, duration_s, tz} or {ranges}, with end) or a list "
                                        "of {start, end}")
        allowed = ("cron", "duration_s", "tz", "ranges", "end")
        extra = [k for k in obj if k not in allowed]
        if extra:
            raise WindowError(f"window.{field_name(extra[0])}", f"unknown key (allowed: {', '.join(allowed)})")
        end = obj.get("end", "finish")
        if not isinstance(end, str) or end not in ENDS:
            raise WindowError("window.end", f"must be one of {', '.join(ENDS)}, got {short(end)}")
        if "ranges" in obj:
            for k in ("cron", "duration_s", "tz"):
                if k in obj:
                    raise WindowError(f"window.{k}", "is not allowed with window.ranges")
            return cls(end=end, ranges=_ranges(obj["ranges"], "window.ranges"))
        if "cron" not in obj:
            raise WindowError("window.cron", "is required (or window.ranges)")
        if "duration_s" not in obj:
            raise WindowError("window.duration_s", "is required with window.cron")
        d = obj["duration_s"]
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d) \
                or not MIN_DURATION_S <= d <= MAX_DURATION_S:
            raise WindowError("window.duration_s", f"must be a number of seconds between {MIN_DURATION_S:g} and "
                                                   f"{MAX_DURATION_S:g} (7 days), got {short(d)}")
        try:
            sch = Schedule.parse({k: obj[k] for k in ("cron", "tz") if k in obj})
        except ScheduleError as exc:
            raise WindowError("window" + exc.field[len("schedule"):], exc.message) from None
        return cls(end=end, schedule=sch, duration_s=float(d))

    def to_doc(self) -> dict:
        if self.schedule is not None:
            return {"cron": self.schedule.cron, "tz": self.schedule.tz, "duration_s": self.duration_s,
                    "end": self.end}
        return {"ranges": [{"start": format_rfc3339(a), "end": format_rfc3339(b)} for a, b in self.ranges],
                "end": self.end}

    # --- questions about an instant ---------------------------------------------------
    def opened_at(self, t: datetime) -> Optional[datetime]:
        """The start of the latest window that contains ``t`` (None: closed at ``t``)."""
        if self.schedule is None:
            starts = [a for a, b in self.ranges if a <= t < b]
            return max(starts) if starts else None
        d = timedelta(seconds=self.duration_s)
        first = next_due(self.schedule, t - d)        # the earliest start in (t - d, t], if any
        if first is None or first > t:
            return None
        # the latest start <= t: look back in doubling steps to the nearest one, then forward
        step = timedelta(seconds=1)
        while step < d:
            s = next_due(self.schedule, t - step)
            if s is not None and s <= t:
                first = s
                break
            step *= 2
        latest, n = first, 0
        while n < MAX_SCAN:
            s = next_due(self.schedule, latest)
            if s is None or s > t:
                break
            latest, n = s, n + 1
        return latest

    def is_open(self, t: datetime) -> bool:
        return self.opened_at(t) is not None

    def closes_at(self, t: datetime) -> Optional[datetime]:
        """When the window open at ``t`` closes: the first instant after ``t`` at which no
        window is open (windows that overlap or touch are one). None: closed at ``t``.
        After MAX_MERGE chained windows the answer is that far only; asked again there, it
        goes on."""
        close = self._end_of(t)
        if close is None:
            return None
        for _ in range(MAX_MERGE):
            nxt = self._end_of(close)
            if nxt is None or nxt <= close:
                break
            close = nxt
        return close

    def _end_of(self, t: datetime) -> Optional[datetime]:
        if self.schedule is None:
            ends = [b for a, b in self.ranges if a <= t < b]
            return max(ends) if ends else None
        start = self.opened_at(t)
        return None if start is None else start + timedelta(seconds=self.duration_s)

    def next_open(self, t: datetime) -> Optional[datetime]:
        """``t`` when a window is open at ``t``; else when the next one opens (None: never)."""
        if self.is_open(t):
            return t
        if self.schedule is None:
            later = [a for a, b in self.ranges if a > t]
            return min(later) if later else None
        return next_due(self.schedule, t)

    def next_change(self, t: datetime) -> Optional[datetime]:
        """When the answer of is_open may next change after ``t`` (None: never)."""
        return self.closes_at(t) if self.is_open(t) else self.next_open(t)

    def describe(self, t: datetime) -> dict:
        """What ``millwright jobs show`` and ``jobs/get`` say of the window at ``t``."""
        out: dict[str, Any] = {"end": self.end, "open": self.is_open(t)}
        if out["open"]:
            out["closes_at"] = _rfc(self.closes_at(t))
        else:
            out["opens_at"] = _rfc(self.next_open(t))
            nxt = self.next_open(t)
            out["then_closes_at"] = _rfc(self.closes_at(nxt)) if nxt is not None else None
        return out


def _rfc(t: Optional[datetime]) -> Optional[str]:
    return format_rfc3339(t) if t is not None else None


def _ranges(items: Any, path: str) -> tuple[tuple[datetime, datetime], ...]:
    if not isinstance(items, list) or not items:
        raise WindowError(path, "must be a non-empty list of {start, end}")
    if len(items) > MAX_RANGES:
        raise WindowError(path, f"has {len(items)} ranges; at most {MAX_RANGES} are allowed")
    out = []
    for i, r in enumerate(items):
        where = f"{path}[{i}]"
        if not isinstance(r, dict) or set(r) != {"start", "end"}:
            raise WindowError(where, "must be an object with exactly start and end (RFC 3339)")
        try:
            a, b = parse_rfc3339(r["start"]), parse_rfc3339(r["end"])
        except ValueError as exc:
            raise WindowError(where, str(exc)) from None
        if not a < b:
            raise WindowError(f"{where}.end", "must be later than start")
        out.append((a, b))
    return tuple(sorted(out))
