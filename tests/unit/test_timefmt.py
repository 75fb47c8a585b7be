"""The one RFC 3339 format (agent/runtime/timefmt.py): fixed width, exact, sorts like time."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.runtime.timefmt import format_optional, format_rfc3339, format_ts, parse_rfc3339

UTC = timezone.utc
times = st.datetimes(min_value=datetime(1970, 1, 2), max_value=datetime(2999, 12, 30), timezones=st.just(UTC))


@given(times)
def test_format_then_parse_is_exact_and_fixed_width(dt):
    text = format_rfc3339(dt)
    assert len(text) == len("2026-12-02T12:00:00.000000Z") and text.endswith("Z")
    assert parse_rfc3339(text) == dt


@given(times, times)
def test_strings_sort_like_the_times(a, b):
    assert (format_rfc3339(a) < format_rfc3339(b)) == (a < b)


@given(st.floats(min_value=86400, max_value=32503593600, allow_nan=False))
def test_unix_time_and_datetime_format_the_same(t):
    dt = datetime.fromtimestamp(t, UTC)
    # format_ts rounds to the microsecond, fromtimestamp may too: compare within 1 µs
    got = parse_rfc3339(format_ts(t))
    assert abs(got - dt) <= timedelta(microseconds=1)


def test_offsets_are_normalised_and_naive_times_refused():
    assert format_rfc3339(parse_rfc3339("2026-12-02T13:30:00.5+01:30")) == "2026-12-02T12:00:00.500000Z"
    assert format_optional(None) is None
    with pytest.raises(ValueError):
        format_rfc3339(datetime(2026, 12, 2, 12))
