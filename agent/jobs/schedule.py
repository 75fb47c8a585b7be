"""Due times: now / at / delay / cron (5 or 6 fields, IANA time zones, DST), misfire
recovery, overlap and retry backoff. Pure functions of their arguments: no clock, no I/O.

Every agent must compute the same firings for the same job, because after a failover
another agent recomputes them and the firing's id (``fire_id``) is what makes a run
exactly-once. So nothing here reads the local clock or the local time zone, and all
datetimes are timezone-aware (naive ones raise ValueError) and returned in UTC.

Cron semantics (see docs/jobs.md):
- 5 fields ``min hour dom month dow`` or 6 fields ``sec min hour dom month dow``
  (seconds FIRST; croniter's own 6-field order puts seconds last, so we never hand it
  six fields: it evaluates the 5 minute-level fields and we add the seconds ourselves).
- Fields are matched against the wall clock of the job's ``tz`` (default UTC).
- DST, following Debian cron(8): an expression whose hour field matches every hour
  ("interval job", e.g. ``*/15 * * * *``) runs on elapsed time: nothing is added in the
  spring-forward gap (those wall times do not exist) and the repeated hour at fall-back
  fires again, because it is real time passing. An expression with specific hours
  ("fixed-time job", e.g. ``30 2 * * *``): firings whose wall time falls into the
  spring-forward gap run once, at the first valid instant (the transition); wall times
  repeated at fall-back fire once, at their first occurrence.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
import re
import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Optional, Protocol

from agent.runtime.text import short as _short
from agent.runtime.timefmt import MAX_YEAR, UTC, format_rfc3339, parse_rfc3339

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MAX_DELAY_S = 366 * 86400.0
MAX_CRON_LEN = 200
MISFIRE_POLICIES = ("run_once", "skip", "run_all")
OVERLAP_POLICIES = ("forbid", "allow", "replace")
_SCAN_STEP = timedelta(hours=6)  # transitions are assumed to be > 6 h apart (true of all tzdata since 1970 that matters here)
_ONE_S = timedelta(seconds=1)
_ONE_MIN = timedelta(minutes=1)
_MAX_ENUM = 100_000  # hard cap on firings enumerated by one recovery computation
_MAX_SKIP_COUNT = 100  # skipped firings are counted exactly up to this many


class ScheduleError(ValueError):
    """An invalid schedule; ``field`` is the document path (e.g. ``schedule.cron``)."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


# --------------------------------------------------------------------------- time helpers


def _utc(dt: datetime, what: str = "datetime") -> datetime:
    if not isinstance(dt, datetime):
        raise TypeError(f"{what} must be a datetime, got {type(dt).__name__}")
    if dt.tzinfo is None or dt.utcoffset() is None:
        raise ValueError(f"{what} must be timezone-aware (UTC)")
    return dt.astimezone(UTC)


def fire_id(job_id: str, due: datetime) -> str:
    """The firing's id: its due time in UTC with millisecond precision, e.g.
    ``20261202T120000.000Z``. Key-safe ([0-9TZ.]) and sortable. Together with the job
    id (which is already a key segment in ``runs/<shard>/<job_id>/<fire_id>``) it names
    a firing; the job id is accepted for symmetry and not repeated in the result."""
    due = _utc(due, "due")
    return f"{due.year:04d}{due.month:02d}{due.day:02d}T{due.hour:02d}{due.minute:02d}{due.second:02d}.{due.microsecond // 1000:03d}Z"


_FIRE_ID_RE = re.compile(r"(\d{4})(\d{2})(\d{2})T(\d{2})(\d{2})(\d{2})\.(\d{3})Z", re.ASCII)


def parse_fire_id(fid: str) -> datetime:
    """Inverse of :func:`fire_id` (to millisecond precision)."""
    m = _FIRE_ID_RE.fullmatch(fid or "")
    if not m:
        raise ValueError(f"not a fire id: {fid!r}")
    y, mo, d, h, mi, s, ms = (int(x) for x in m.groups())
    return datetime(y, mo, d, h, mi, s, ms * 1000, tzinfo=UTC)


# --------------------------------------------------------------------------- cron


_FIELD_RE = re.compile(r"[0-9A-Za-z*/,#-]+")
_NAMES = {
    3: {"jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"},
    4: {"sun", "mon", "tue", "wed", "thu", "fri", "sat"},
}
_TZ_RE = re.compile(r"[A-Za-z0-9_+-]+(?:/[A-Za-z0-9_+-]+){0,2}")
_TZ_REJECT = {"localtime", "posixrules", "Factory", "posix", "right"}


def load_zone(name: Any, field_name: str = "schedule.tz"):
    """An IANA zone by name (e.g. Europe/Berlin), or ScheduleError."""
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    if not isinstance(name, str):
        raise ScheduleError(field_name, "must be an IANA time zone name such as Europe/Berlin")
    if len(name) > 64 or not _TZ_RE.fullmatch(name) or name.split("/")[0] in _TZ_REJECT or name in _TZ_REJECT:
        raise ScheduleError(field_name, f"{_short(name)} is not an IANA time zone name")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError, UnicodeError):
        raise ScheduleError(field_name, f"unknown time zone {_short(name)} (not in the tz database)") from None


class _CronSpec:
    """A parsed cron expression bound to a zone. Iteration happens in naive local wall
    time (croniter with naive datetimes is pure calendar arithmetic)."""

    def __init__(self, expr: str, tzname: str):
        from croniter import croniter

        if not isinstance(expr, str):
            raise ScheduleError("schedule.cron", "must be a string of 5 or 6 fields")
        if len(expr) > MAX_CRON_LEN:
            raise ScheduleError("schedule.cron", f"longer than {MAX_CRON_LEN} characters")
        fields = expr.split()
        if len(fields) not in (5, 6):
            raise ScheduleError(
                "schedule.cron",
                f"needs 5 fields (min hour dom month dow) or 6 (sec min hour dom month dow), got {len(fields)}",
            )
        sec_field = fields[0] if len(fields) == 6 else "0"
        minute_fields = fields[1:] if len(fields) == 6 else fields
        names = ("second", "minute", "hour", "day-of-month", "month", "day-of-week")
        for i, f in enumerate(([sec_field] if len(fields) == 6 else []) + minute_fields):
            label = names[i if len(fields) == 6 else i + 1]
            if not f.isascii() or not _FIELD_RE.fullmatch(f):
                raise ScheduleError("schedule.cron", f"{label} field {_short(f)} has characters outside 0-9 A-Z * / , - #")
        for i, f in enumerate(minute_fields):
            for word in re.findall(r"[A-Za-z]+", f):
                w = word.lower()
                ok = w in _NAMES.get(i, set()) or (w == "l" and i in (2,))
                if not ok:
                    raise ScheduleError("schedule.cron", f"{names[i + 1]} field {_short(f)}: {word!r} is not allowed there")
        if re.search(r"[A-Za-z#]", sec_field):
            raise ScheduleError("schedule.cron", f"second field {_short(sec_field)} must be numeric")
        self.minute_expr = " ".join(minute_fields)
        try:
            expanded, _ = croniter.expand(self.minute_expr)
            sec_expanded, _ = croniter.expand(f"{sec_field} * * * *")
        except Exception as exc:  # croniter raises a zoo of ValueError/TypeError/KeyError subclasses
            raise ScheduleError("schedule.cron", f"invalid expression {_short(expr)}: {_croniter_msg(exc)}") from None
        secs = sec_expanded[0]
        self.seconds: list[int] = list(range(60)) if secs == ["*"] else sorted(int(s) for s in secs)
        hours = expanded[1]
        self.fixed = not (hours == ["*"] or len(set(hours)) >= 24)
        self.zone = load_zone(tzname)
        self.tzname = tzname
        self._lock = threading.Lock()
        self._it = croniter(self.minute_expr, datetime(2000, 1, 1), ret_type=datetime)
        # An expression that can never match (e.g. 30 February) is an error, not a silent no-op.
        if self._next_minute(datetime(2000, 1, 1)) is None:
            raise ScheduleError("schedule.cron", f"{_short(expr)} never fires (no such date)")

    def _next_minute(self, start: datetime) -> Optional[datetime]:
        """First matching naive minute strictly after ``start`` (minute-aligned)."""
        from croniter import CroniterBadDateError

        try:
            with self._lock:
                return self._it.get_next(datetime, start_time=start)
        except (CroniterBadDateError, OverflowError, ValueError):
            return None

    def naive_next(self, lower: datetime, strict: bool = True) -> Optional[datetime]:
        """First matching naive wall time (whole seconds) > lower (>= when not strict)."""
        if not strict:
            lower = lower.replace(microsecond=0) if lower.microsecond else lower - _ONE_S
        lower = lower.replace(microsecond=0)
        m0 = lower.replace(second=0)
        later = [s for s in self.seconds if s > lower.second]
        if later and self._next_minute(m0 - _ONE_MIN) == m0:
            return m0 + timedelta(seconds=later[0])
        m1 = self._next_minute(m0)
        if m1 is None or m1.year > MAX_YEAR + 1:
            return None
        return m1 + timedelta(seconds=self.seconds[0])


@functools.lru_cache(maxsize=4096)
def _cron_spec(expr: str, tzname: str) -> _CronSpec:
    """Parsed specs are shared: re-parsing thousands of stored jobs after a takeover
    must not re-run croniter's expression parser for each (errors are not cached)."""
    return _CronSpec(expr, tzname)


def _croniter_msg(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) < 120 else text[:117] + "..."


def _offset(zone, t: datetime) -> timedelta:
    return t.astimezone(zone).utcoffset() or timedelta(0)


def _bisect_transition(zone, lo: datetime, hi: datetime) -> datetime:
    """offset(lo) != offset(hi), lo < hi: the earliest whole second T in (lo, hi] whose
    UTC offset differs from lo's (tz transitions fall on whole seconds)."""
    base = _offset(zone, lo)
    a = math.floor(lo.timestamp())
    b = math.ceil(hi.timestamp())
    while b - a > 1:
        mid = (a + b) // 2
        if _offset(zone, datetime.fromtimestamp(mid, UTC)) == base:
            a = mid
        else:
            b = mid
    return datetime.fromtimestamp(b, UTC)


def _first_transition(zone, a: datetime, b: datetime) -> Optional[datetime]:
    """First instant T in (a, b] where the UTC offset differs from the offset at a."""
    if b <= a:
        return None
    base = _offset(zone, a)
    prev = a
    while True:
        nxt = min(prev + _SCAN_STEP, b)
        if _offset(zone, nxt) != base:
            return _bisect_transition(zone, prev, nxt)
        if nxt >= b:
            return None
        prev = nxt


def _last_transition(zone, t: datetime, window: timedelta) -> Optional[datetime]:
    """Latest transition T in (t - window, t], if any (window <= _SCAN_STEP)."""
    a = t - window
    if _offset(zone, a) == _offset(zone, t):
        return None
    return _bisect_transition(zone, a, t)


def _naive(t: datetime, off: timedelta) -> datetime:
    return (t + off).replace(tzinfo=None)


def _from_naive(local: datetime, off: timedelta) -> datetime:
    return (local - off).replace(tzinfo=UTC)


def _cron_next(spec: _CronSpec, after: datetime) -> Optional[datetime]:
    """First firing strictly after ``after`` (aware). See the module docstring."""
    zone = spec.zone
    t = after.astimezone(UTC).replace(microsecond=0)  # firings are whole seconds: > floor(after) == > after
    off = _offset(zone, t)
    lower, strict = _naive(t, off), True
    if spec.fixed:
        # If t lies in the repeated period after a fall-back, wall times up to the end of
        # the first pass already fired: start there.
        tp = _last_transition(zone, t, timedelta(hours=6))
        if tp is not None:
            off_before = _offset(zone, tp - _ONE_S)
            end_prev = _naive(tp, off_before)
            if off_before > _offset(zone, tp) and end_prev > lower:
                lower, strict = end_prev, False
    seg_start = t
    for _ in range(1000):
        local = spec.naive_next(lower, strict)
        if local is None:
            return None
        cand = _from_naive(local, off)
        if cand.year > MAX_YEAR:
            return None
        tr = _first_transition(zone, seg_start, cand)
        if tr is None:
            return cand
        new_off = _offset(zone, tr)
        if new_off > off:  # spring forward: naive [tr+off, tr+new_off) does not exist
            if spec.fixed and local < _naive(tr, new_off):
                return tr
            lower = _naive(tr, new_off)
        else:  # fall back: naive [tr+new_off, tr+off) happens twice
            lower = _naive(tr, off) if spec.fixed else _naive(tr, new_off)
        strict = False
        off, seg_start = new_off, tr
    return None  # pragma: no cover - would need 1000 transitions without a match


# --------------------------------------------------------------------------- Schedule


@dataclass(frozen=True)
class Schedule:
    """kind: ``now`` | ``at`` | ``delay`` | ``cron``."""

    kind: str
    at: Optional[datetime] = None
    delay_s: Optional[float] = None
    cron: Optional[str] = None
    tz: Optional[str] = None
    _spec: Optional[_CronSpec] = field(default=None, compare=False, repr=False, hash=False)

    @property
    def one_shot(self) -> bool:
        return self.kind != "cron"

    @classmethod
    def now(cls) -> "Schedule":
        return cls("now")

    @classmethod
    def at_time(cls, when: datetime) -> "Schedule":
        return cls("at", at=_utc(when, "at"))

    @classmethod
    def delay(cls, seconds: float) -> "Schedule":
        return cls.parse({"delay_s": seconds})

    @classmethod
    def cron_expr(cls, expr: str, tz: str = "UTC") -> "Schedule":
        return cls.parse({"cron": expr, "tz": tz})

    @classmethod
    def parse(cls, obj: Any) -> "Schedule":
        """From the document's ``schedule`` member. Raises ScheduleError."""
        if not isinstance(obj, dict):
            raise ScheduleError("schedule", "must be an object: {}, {at}, {delay_s} or {cron, tz}")
        allowed = ("at", "delay_s", "cron", "tz")
        extra = [k for k in obj if k not in allowed]
        if extra:
            raise ScheduleError("schedule", f"unknown key(s) {', '.join(sorted(_short(k) for k in extra))} (allowed: {', '.join(allowed)})")
        kinds = [k for k in ("at", "delay_s", "cron") if k in obj]
        if len(kinds) > 1:
            raise ScheduleError("schedule", f"exactly one of at, delay_s or cron may be given, got {' and '.join(kinds)}")
        if "tz" in obj and kinds != ["cron"]:
            raise ScheduleError("schedule.tz", "is only allowed together with cron")
        if not kinds:
            return cls("now")
        kind = kinds[0]
        if kind == "at":
            try:
                return cls("at", at=parse_rfc3339(obj["at"]))
            except ValueError as exc:
                raise ScheduleError("schedule.at", str(exc)) from None
        if kind == "delay_s":
            v = obj["delay_s"]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ScheduleError("schedule.delay_s", f"must be a number of seconds, got {_short(v)}")
            if not 0 <= v <= MAX_DELAY_S:
                raise ScheduleError("schedule.delay_s", f"must be between 0 and {int(MAX_DELAY_S)} (366 days), got {_short(v)}")
            return cls("delay", delay_s=float(v))
        tzname = obj.get("tz", "UTC")
        if not isinstance(tzname, str):
            raise ScheduleError("schedule.tz", "must be an IANA time zone name such as Europe/Berlin")
        spec = _cron_spec(obj["cron"], tzname) if isinstance(obj.get("cron"), str) else None
        if spec is None:
            raise ScheduleError("schedule.cron", f"must be a string of 5 or 6 fields, got {type(obj['cron']).__name__}")
        return cls("cron", cron=obj["cron"], tz=tzname, _spec=spec)

    def to_doc(self) -> dict:
        if self.kind == "now":
            return {}
        if self.kind == "at":
            assert self.at is not None
            return {"at": format_rfc3339(self.at)}
        if self.kind == "delay":
            return {"delay_s": self.delay_s}
        return {"cron": self.cron, "tz": self.tz}


def next_due(schedule: Schedule, after: datetime) -> Optional[datetime]:
    """The first firing strictly after ``after``. For cron, the next matching instant;
    for ``at``, the at time if it is after ``after``; ``now`` and ``delay`` firings are
    relative to the job and come from :func:`first_due` (None here)."""
    after = _utc(after, "after")
    if schedule.kind == "cron":
        assert schedule._spec is not None
        return _cron_next(schedule._spec, after)
    if schedule.kind == "at":
        at = schedule.at
        return at if at is not None and at > after else None
    return None


def firings_between(schedule: Schedule, lo: datetime, hi: datetime, limit: int = _MAX_ENUM,
                    *, include_lo: bool = False) -> list[datetime]:
    """Cron firings in (lo, hi] (or [lo, hi] with include_lo), oldest first, at most ``limit``."""
    lo, hi = _utc(lo, "lo"), _utc(hi, "hi")
    out: list[datetime] = []
    t = lo - timedelta(microseconds=1) if include_lo else lo
    while len(out) < limit:
        d = next_due(schedule, t)
        if d is None or d > hi:
            break
        out.append(d)
        t = d
    return out


class JobDocument(Protocol):
    """What the schedule reads of a job (agent/jobs/document.py's Job is one; read-only)."""

    @property
    def id(self) -> str: ...
    @property
    def schedule(self) -> Schedule: ...
    @property
    def misfire(self) -> str: ...
    @property
    def misfire_limit(self) -> int: ...
    @property
    def retry(self) -> RetryPolicy: ...
    @property
    def not_after(self) -> Optional[datetime]: ...   # no firing at or after it
    @property
    def issued_at(self) -> Optional[datetime]: ...   # what relative schedules count from


def anchor_time(job: JobDocument, accepted_at: datetime) -> datetime:
    """The instant relative schedules count from: the document's ``issued_at`` when it has
    one (identical on every agent), else ``accepted_at`` (which the job store must keep
    durably with the job so that every agent uses the same value)."""
    issued = job.issued_at
    return _utc(issued, "issued_at") if issued is not None else _utc(accepted_at, "accepted_at")


def first_due(job: JobDocument, accepted_at: datetime) -> Optional[datetime]:
    """The job's first firing: now -> anchor; at -> at; delay -> anchor + delay_s;
    cron -> the first match strictly after the anchor. Deterministic across agents
    (see anchor_time)."""
    sch: Schedule = job.schedule
    anchor = anchor_time(job, accepted_at)
    if sch.kind == "now":
        return anchor
    if sch.kind == "at":
        return sch.at
    if sch.kind == "delay":
        return anchor + timedelta(seconds=sch.delay_s or 0.0)
    return next_due(sch, anchor)


def next_firing(job: JobDocument, after: datetime, accepted_at: datetime) -> Optional[datetime]:
    """The job's first firing strictly after ``after`` (one-shots: first_due if it is
    later than ``after``), or None when there is none before not_after. Use it to arm the
    timer after a firing was handled."""
    after = _utc(after, "after")
    if job.schedule.kind == "cron":
        first = first_due(job, accepted_at)
        d = None if first is None else (first if first > after else next_due(job.schedule, after))
    else:
        d = first_due(job, accepted_at)
        d = d if d is not None and d > after else None
    na = job.not_after
    return None if d is None or (na is not None and d >= na) else d


def is_firing(job: JobDocument, due: datetime, accepted_at: datetime) -> bool:
    """Is ``due`` one of the job's firings? (A run record names its firing: a record for a
    time the schedule never fires at was not written by an agent running the job.)"""
    due = _utc(due, "due")
    first = first_due(job, accepted_at)
    if first is None:
        return False
    na = job.not_after
    if na is not None and due >= na:
        return False
    if job.schedule.kind != "cron":
        return fire_id("", due) == fire_id("", first)   # fire ids keep milliseconds
    return due >= first and next_due(job.schedule, due - timedelta(microseconds=1)) == due


def is_expired(job: JobDocument, now: datetime) -> bool:
    """True once ``now`` >= the job's not_after: no firing may start from then on."""
    na = job.not_after
    return na is not None and _utc(now, "now") >= na


# --------------------------------------------------------------------------- misfire


@dataclass(frozen=True)
class Recovery:
    """What to do with a job's firings at ``now`` (after a takeover, restart or clock step).

    run: due firings to run now, oldest first. skipped: firings that were due and will
    not run because of the misfire policy (counted up to a cap: skipped_capped says the
    true number is larger); report them as ``misfired``. next_due: the next future
    firing to arm a timer for (None: the job has no more firings)."""

    run: list[datetime]
    skipped: int
    skipped_capped: bool
    next_due: Optional[datetime]


def missed_firings(schedule: Schedule, last_due_done: Optional[datetime], now: datetime,
                   policy: str = "run_once", limit: int = 1, *, first_due: Optional[datetime] = None,
                   grace_s: float = 0.0) -> list[datetime]:
    """The firings due at ``now`` that should run, oldest first.

    Window: firings d with d <= now, d > last_due_done (the latest firing already
    handled, whatever its outcome) and d >= first_due (the job's first firing; required
    when last_due_done is None). Policy:
    - run_once: only the latest firing of the window;
    - skip: only firings late by less than grace_s (on time, not missed); none otherwise;
    - run_all: the latest ``limit`` firings of the window, oldest first.
    A one-shot job (now/at/delay) has the single firing ``first_due`` (for at, the at
    time). ``now`` jobs ignore the policy: they exist to run once, promptly.
    """
    return recover(schedule, last_due_done, now, policy, limit, first_due=first_due, grace_s=grace_s).run


def recover(schedule: Schedule, last_due_done: Optional[datetime], now: datetime,
            policy: str = "run_once", limit: int = 1, *, first_due: Optional[datetime] = None,
            grace_s: float = 0.0) -> Recovery:
    """:func:`missed_firings` plus the skipped count and the next future firing."""
    if policy not in MISFIRE_POLICIES:
        raise ValueError(f"unknown misfire policy {policy!r}")
    now = _utc(now, "now")
    last = _utc(last_due_done, "last_due_done") if last_due_done is not None else None
    first = _utc(first_due, "first_due") if first_due is not None else None
    limit = max(1, int(limit))
    on_time_from = now - timedelta(seconds=max(0.0, grace_s))

    def select(window: list[datetime]) -> list[datetime]:
        if not window:
            return []
        if policy == "run_once":
            return [window[-1]]
        if policy == "skip":
            return [d for d in window if d > on_time_from]
        return window[-limit:]

    if schedule.kind != "cron":
        due = first if first is not None else schedule.at
        if due is None:
            raise ValueError("first_due is required for now/delay schedules")
        pending = due > last if last is not None else True
        if not pending:
            return Recovery([], 0, False, None)
        if due > now:
            return Recovery([], 0, False, due)
        run = [due] if schedule.kind == "now" else select([due])
        return Recovery(run, 1 - len(run), False, None)

    if last is None and first is None:
        raise ValueError("cron recovery needs last_due_done or first_due")
    # lower bound of the window: exclusive of last, inclusive of first
    if last is not None and (first is None or last >= first):
        lo, inclusive = last, False
    else:
        assert first is not None
        lo, inclusive = first, True
    nxt = next_due(schedule, now)
    if lo > now:
        return Recovery([], 0, False, nxt)
    need = 1 if policy == "run_once" else limit
    # Enumerate only the tail of the window: double a look-back span until it holds
    # enough firings or reaches lo (a per-second cron missed for a year stays cheap).
    span = timedelta(seconds=1)
    while True:
        start = now - span
        if start <= lo:
            tail = firings_between(schedule, lo, now, _MAX_ENUM, include_lo=inclusive)
            head_count, head_capped = 0, False
            break
        tail = firings_between(schedule, start, now, _MAX_ENUM)
        if len(tail) >= need or policy == "skip" and start <= on_time_from:
            head = firings_between(schedule, lo, start, _MAX_SKIP_COUNT, include_lo=inclusive)
            head_count, head_capped = len(head), len(head) >= _MAX_SKIP_COUNT
            break
        span *= 2
    run = select(tail)
    skipped = head_count + len(tail) - len(run)
    return Recovery(run, skipped, head_capped, nxt)


def window_end(job: JobDocument, now: datetime) -> datetime:
    """The last instant whose firings recovery may consider: ``now``, or just before the
    job's not_after once that has passed (firings at or after not_after do not exist)."""
    now = _utc(now, "now")
    na = job.not_after
    return na - timedelta(microseconds=1) if na is not None and now >= na else now


def recover_job(job: JobDocument, accepted_at: datetime, last_due_done: Optional[datetime], now: datetime,
                grace_s: float = 0.0) -> Recovery:
    """:func:`recover` with the job's own schedule, misfire policy and not_after (firings
    at or after not_after never run)."""
    now = _utc(now, "now")
    na = job.not_after
    expired = na is not None and now >= na
    rec = recover(job.schedule, last_due_done, window_end(job, now), job.misfire, job.misfire_limit,
                  first_due=first_due(job, accepted_at), grace_s=grace_s)
    if expired:
        return Recovery(rec.run, rec.skipped, rec.skipped_capped, None)
    if na is not None and rec.next_due is not None and rec.next_due >= na:
        return Recovery(rec.run, rec.skipped, rec.skipped_capped, None)
    return rec


# --------------------------------------------------------------------------- overlap


def overlap_action(policy: str, running: bool) -> str:
    """What a new firing does while an earlier run of the same job is still running:
    ``start`` (nothing running, or allow), ``skip`` (forbid: the new firing is recorded
    as misfired and does not run), ``replace`` (kill the running one, then start)."""
    if policy not in OVERLAP_POLICIES:
        raise ValueError(f"unknown overlap policy {policy!r}")
    if not running or policy == "allow":
        return "start"
    return "skip" if policy == "forbid" else "replace"


# --------------------------------------------------------------------------- retry


@dataclass(frozen=True)
class RetryPolicy:
    """max_attempts counts the first run (1 = no retry). ``on``: the outcomes that may be
    retried (agent/jobs/outcomes.py RETRY_ON); by default not ``owner_lost``, a firing
    that may have run."""

    max_attempts: int = 1
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    jitter: float = 0.0
    on: tuple = ("failed", "timed_out")

    def retries(self, outcome: str) -> bool:
        """May an attempt that ended with this outcome (a final state, or owner_lost) be
        followed by another?"""
        return outcome in self.on




def retry_delay(policy: RetryPolicy, attempt: int, rng: Optional[random.Random] = None) -> float:
    """Seconds to wait after attempt number ``attempt`` (1-based) failed, before the next:
    base = min(backoff_s * 2**(attempt-1), max_backoff_s), reduced by a random fraction
    of up to ``jitter``: the result lies in [base * (1 - jitter), base], never above
    max_backoff_s. ``rng`` needs ``.random()``; None uses a deterministic rng."""
    attempt = max(1, int(attempt))
    exp = min(attempt - 1, 1023)
    try:
        base = policy.backoff_s * (2.0 ** exp)
    except OverflowError:  # pragma: no cover
        base = math.inf
    base = min(base, policy.max_backoff_s)
    if policy.jitter <= 0:
        return float(base)
    r = (rng if rng is not None else random.Random(attempt)).random()
    return float(base * (1.0 - policy.jitter * r))


def retry_rng(job_id: str, fire_id_: str, attempt: int) -> random.Random:
    """A jitter rng seeded by the firing and attempt, so every agent derives the same delay."""
    seed = hashlib.sha256(f"{job_id}\0{fire_id_}\0{attempt}".encode()).digest()[:8]
    return random.Random(int.from_bytes(seed, "big"))


def next_retry_at(job: JobDocument, fire_id_: str, attempt: int, failed_at: datetime) -> Optional[datetime]:
    """When attempt ``attempt + 1`` starts, or None when attempts are exhausted (or the job
    expires first). Deterministic (retry_rng)."""
    pol: RetryPolicy = job.retry
    if attempt >= pol.max_attempts:
        return None
    at = _utc(failed_at, "failed_at") + timedelta(seconds=retry_delay(pol, attempt, retry_rng(job.id, fire_id_, attempt)))
    na = job.not_after
    if na is not None and at >= na:
        return None
    return at


__all__ = [
    "UTC", "Schedule", "ScheduleError", "RetryPolicy", "Recovery", "parse_rfc3339", "format_rfc3339",
    "fire_id", "parse_fire_id", "next_due", "window_end", "next_firing", "first_due", "anchor_time", "firings_between", "missed_firings",
    "recover", "recover_job", "is_firing", "is_expired", "overlap_action", "retry_delay", "retry_rng", "next_retry_at",
    "load_zone", "MISFIRE_POLICIES", "JobDocument", "OVERLAP_POLICIES",
]
