"""RFC 3339 times, the one parser and the one formatter of the contract.

Every time the agent writes (run records, status documents, audit records, presence,
job-store marks) is UTC with microseconds and a ``Z``: ``2026-12-02T12:00:00.000000Z``.
Fixed width, so the strings sort like the times they name. Parsing is strict (an explicit
offset is required) and keeps at most microseconds; see docs/jobs.md.

A leaf: imports nothing from ``agent``.
"""

from __future__ import annotations

import re
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Optional

UTC = timezone.utc
MIN_YEAR, MAX_YEAR = 1970, 2999

_RFC3339_RE = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?(?:([Zz])|([+-])(\d{2}):(\d{2}))",
    re.ASCII,
)


def utcnow() -> datetime:
    return datetime.now(UTC)


def parse_rfc3339(text: Any) -> datetime:
    """Strict RFC 3339 with an explicit offset (``Z`` or ``+hh:mm``) -> aware UTC datetime.
    Fractions beyond microseconds are truncated. Raises ValueError with a short reason."""
    if not isinstance(text, str):
        raise ValueError("must be an RFC 3339 string such as 2026-12-02T12:00:00Z")
    m = _RFC3339_RE.fullmatch(text)
    if not m:
        raise ValueError("must be RFC 3339 with a time zone, such as 2026-12-02T12:00:00Z")
    y, mo, d, h, mi, s = (int(m.group(i)) for i in range(1, 7))
    frac = (m.group(7) or "")[:6].ljust(6, "0")
    if not MIN_YEAR <= y <= MAX_YEAR:
        raise ValueError(f"year must be between {MIN_YEAR} and {MAX_YEAR}")
    if s == 60:
        raise ValueError("leap seconds are not supported")
    try:
        tz: timezone
        if m.group(8):
            tz = UTC
        else:
            oh, om = int(m.group(10)), int(m.group(11))
            if oh > 23 or om > 59:
                raise ValueError("bad offset")
            off = timedelta(hours=oh, minutes=om)
            tz = timezone(-off if m.group(9) == "-" else off)
        dt = datetime(y, mo, d, h, mi, s, int(frac), tzinfo=tz)
    except ValueError:
        raise ValueError("is not a valid date and time") from None
    dt = dt.astimezone(UTC)
    if not MIN_YEAR <= dt.year <= MAX_YEAR:
        raise ValueError(f"year must be between {MIN_YEAR} and {MAX_YEAR}")
    return dt


def format_rfc3339(dt: datetime) -> str:
    """``2026-12-02T12:00:00.000000Z`` for an aware datetime (naive ones raise ValueError)."""
    if not isinstance(dt, datetime):
        raise TypeError(f"datetime expected, got {type(dt).__name__}")
    if dt.tzinfo is None or dt.utcoffset() is None:
        raise ValueError("datetime must be timezone-aware (UTC)")
    dt = dt.astimezone(UTC)
    return f"{dt.year:04d}-{dt.month:02d}-{dt.day:02d}T{dt.hour:02d}:{dt.minute:02d}:{dt.second:02d}.{dt.microsecond:06d}Z"


def format_optional(dt: Optional[datetime]) -> Optional[str]:
    """format_rfc3339, passing None through (record fields that are not set yet)."""
    return format_rfc3339(dt) if dt is not None else None


_ts_cache: list = [None, ""]


def format_ts(t: float) -> str:
    """format_rfc3339 of a Unix time, the same string; cached per second (the audit
    writer formats every record's time on its hot path)."""
    secs = int(t)
    us = int(round((t - secs) * 1e6))
    if us >= 1000000:
        secs, us = secs + 1, us - 1000000
    cache = _ts_cache
    if cache[0] != secs:
        cache[1] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs))
        cache[0] = secs
    return f"{cache[1]}.{us:06d}Z"


def now_rfc3339() -> str:
    return format_ts(time.time())
