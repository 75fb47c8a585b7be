"""Due times, cron with seconds and time zones across DST (computed schedules, never by
changing the clock), misfire recovery, overlap and retry backoff."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from zoneinfo import ZoneInfo

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from agent.runtime.timefmt import format_ts
from agent.jobs.schedule import (
    RetryPolicy,
    Schedule,
    ScheduleError,
    anchor_time,
    fire_id,
    firings_between,
    first_due,
    format_rfc3339,
    is_expired,
    missed_firings,
    next_due,
    next_retry_at,
    overlap_action,
    parse_fire_id,
    parse_rfc3339,
    recover,
    recover_job,
    window_end,
    retry_delay,
    retry_rng,
)

UTC = timezone.utc
NY = ZoneInfo("America/New_York")
BERLIN = ZoneInfo("Europe/Berlin")


def u(*a) -> datetime:
    return datetime(*a, tzinfo=UTC)


def run(expr: str, tz: str, start: datetime, n: int) -> list[datetime]:
    s = Schedule.cron_expr(expr, tz)
    out, t = [], start
    for _ in range(n):
        t = next_due(s, t)
        out.append(t)
    return out


def local(ts: list[datetime], zone) -> list[str]:
    return [t.astimezone(zone).strftime("%m-%d %H:%M:%S%z") for t in ts]


# ---------------------------------------------------------------- time formats and ids


def test_rfc3339_parse_and_format():
    assert parse_rfc3339("2026-12-02T12:00:00Z") == u(2026, 12, 2, 12)
    assert parse_rfc3339("2026-12-02t13:30:00.123456789+01:30") == u(2026, 12, 2, 12, 0, 0, 123456)
    assert parse_rfc3339("2026-12-02T07:00:00-05:00") == u(2026, 12, 2, 12)
    # one precision everywhere (runtime/timefmt.py): microseconds, fixed width, sorts like time
    assert format_rfc3339(u(2026, 12, 2, 12)) == "2026-12-02T12:00:00.000000Z"
    assert format_rfc3339(u(2026, 12, 2, 12, 0, 0, 5)) == "2026-12-02T12:00:00.000005Z"
    assert format_ts(u(2026, 12, 2, 12, 0, 0, 5).timestamp()) == "2026-12-02T12:00:00.000005Z"
    assert parse_rfc3339(format_rfc3339(u(2026, 12, 2, 12, 0, 0, 5))) == u(2026, 12, 2, 12, 0, 0, 5)
    for bad in ["2026-12-02T12:00:00", "2026-12-02", "2026-02-30T00:00:00Z", "2026-12-02T24:00:00Z",
                "2026-12-02T12:00:60Z", "3000-01-01T00:00:00Z", "2026-12-02T12:00:00+25:00", " 2026-12-02T12:00:00Z",
                "2026-12-02T12:00:00Z\n", "２０２６-12-02T12:00:00Z", 5, None]:
        with pytest.raises(ValueError):
            parse_rfc3339(bad)


def test_fire_id_deterministic_key_safe_sortable():
    d = u(2026, 12, 2, 12, 0, 0, 123999)
    assert fire_id("job", d) == "20261202T120000.123Z"
    assert fire_id("job", d.astimezone(NY)) == fire_id("other", d)
    assert parse_fire_id(fire_id("job", d)) == u(2026, 12, 2, 12, 0, 0, 123000)
    ids = [fire_id("j", u(2026, 1, 1) + timedelta(seconds=37 * i)) for i in range(50)]
    assert ids == sorted(ids) and all(set(i) <= set("0123456789TZ.") for i in ids)
    with pytest.raises(ValueError):
        fire_id("j", datetime(2026, 1, 1))  # naive


# ---------------------------------------------------------------- schedule kinds


def test_parse_kinds_and_roundtrip():
    assert Schedule.parse({}).kind == "now"
    assert Schedule.parse({"at": "2026-12-02T12:00:00Z"}).at == u(2026, 12, 2, 12)
    assert Schedule.parse({"delay_s": 5}).delay_s == 5.0
    s = Schedule.parse({"cron": "*/5 * * * *"})
    assert s.kind == "cron" and s.tz == "UTC"
    for doc in ({}, {"at": "2026-12-02T12:00:00Z"}, {"delay_s": 2.5}, {"cron": "0 0 * * *", "tz": "Europe/Berlin"}):
        assert Schedule.parse(Schedule.parse(doc).to_doc()) == Schedule.parse(doc)
    assert Schedule.parse({"at": "2026-12-02T12:00:00Z"}).to_doc() == {"at": "2026-12-02T12:00:00.000000Z"}
    assert Schedule.parse({"cron": "0 0 * * *", "tz": "Europe/Berlin"}) == Schedule.cron_expr("0 0 * * *", "Europe/Berlin")


def test_first_due_uses_issued_at_when_present():
    accepted = u(2026, 12, 2, 11, 0, 7)
    issued = u(2026, 12, 2, 11, 0, 0)
    with_issued = SimpleNamespace(schedule=Schedule.parse({"delay_s": 60}), issued_at=issued)
    without = SimpleNamespace(schedule=Schedule.parse({"delay_s": 60}), issued_at=None)
    assert first_due(with_issued, accepted) == issued + timedelta(seconds=60)
    assert first_due(without, accepted) == accepted + timedelta(seconds=60)
    assert anchor_time(with_issued, accepted) == issued
    assert first_due(SimpleNamespace(schedule=Schedule.now(), issued_at=issued), accepted) == issued
    at = Schedule.parse({"at": "2026-12-02T12:00:00Z"})
    assert first_due(SimpleNamespace(schedule=at, issued_at=issued), accepted) == u(2026, 12, 2, 12)
    cron = Schedule.parse({"cron": "0 * * * *"})
    assert first_due(SimpleNamespace(schedule=cron, issued_at=issued), accepted) == u(2026, 12, 2, 12)
    # strictly after the anchor
    assert first_due(SimpleNamespace(schedule=cron, issued_at=u(2026, 12, 2, 11)), accepted) == u(2026, 12, 2, 12)


def test_next_due_one_shots():
    at = Schedule.parse({"at": "2026-12-02T12:00:00Z"})
    assert next_due(at, u(2026, 12, 2, 11)) == u(2026, 12, 2, 12)
    assert next_due(at, u(2026, 12, 2, 12)) is None
    assert next_due(Schedule.now(), u(2026, 12, 2)) is None


def test_naive_datetimes_are_refused():
    with pytest.raises(ValueError):
        next_due(Schedule.parse({"cron": "* * * * *"}), datetime(2026, 1, 1))


# ---------------------------------------------------------------- cron basics


def test_five_fields_are_minute_level():
    assert run("*/15 * * * *", "UTC", u(2026, 1, 1, 12, 7, 30), 3) == [u(2026, 1, 1, 12, 15), u(2026, 1, 1, 12, 30), u(2026, 1, 1, 12, 45)]


def test_six_fields_have_seconds_first():
    # "10,40 */2 * * * *": seconds 10 and 40 of every second minute
    assert run("10,40 */2 * * * *", "UTC", u(2026, 1, 1, 12, 1, 0), 4) == [
        u(2026, 1, 1, 12, 2, 10), u(2026, 1, 1, 12, 2, 40), u(2026, 1, 1, 12, 4, 10), u(2026, 1, 1, 12, 4, 40)]
    # every second, from a fractional start: strictly after
    assert run("* * * * * *", "UTC", u(2026, 1, 1, 12, 0, 0, 500000), 2) == [u(2026, 1, 1, 12, 0, 1), u(2026, 1, 1, 12, 0, 2)]
    # day-of-week is the 6th field; 7 and 0 both mean Sunday
    assert run("0 0 0 * * 7", "UTC", u(2026, 1, 1), 1) == run("0 0 0 * * sun", "UTC", u(2026, 1, 1), 1) == [u(2026, 1, 4)]


def test_cron_dom_dow_or_semantics_and_last_day():
    # classic cron: both restricted -> either matches
    assert run("0 0 13 * fri", "UTC", u(2026, 3, 1), 3) == [u(2026, 3, 6), u(2026, 3, 13), u(2026, 3, 20)]
    assert run("0 12 L * *", "UTC", u(2026, 1, 31, 13), 2) == [u(2026, 2, 28, 12), u(2026, 3, 31, 12)]


def test_cron_in_a_zone_without_dst_change():
    assert run("0 9 * * *", "Asia/Tokyo", u(2026, 5, 31, 23), 2) == [u(2026, 6, 1, 0), u(2026, 6, 2, 0)]


@pytest.mark.parametrize("expr", ["* * * *", "61 * * * *", "0 0 30 2 *", "0 0 31 4,6 *", "H * * * *", "@hourly",
                                  "1-2-3 * * * *", "* * * * * * *", "0 0 * * mon 0", "L * * * *", "x" * 300,
                                  "*/0 * * * *", "0 0 * * 8", "0;1 * * * *", "０ * * * *", "a * * * * *"])
def test_invalid_cron(expr):
    with pytest.raises(ScheduleError) as ei:
        Schedule.parse({"cron": expr})
    assert ei.value.field == "schedule.cron"


@pytest.mark.parametrize("tz", ["Mars/Base", "../etc/passwd", "/etc/localtime", "localtime", "posixrules", "", "Europe/"])
def test_invalid_tz(tz):
    with pytest.raises(ScheduleError) as ei:
        Schedule.parse({"cron": "* * * * *", "tz": tz})
    assert ei.value.field == "schedule.tz"


# ---------------------------------------------------------------- DST, computed (2026 dates)
# America/New_York: spring forward 2026-03-08 02:00 EST -> 03:00 EDT (07:00Z);
#                   fall back 2026-11-01 02:00 EDT -> 01:00 EST (06:00Z).
# Europe/Berlin:    spring forward 2026-03-29 02:00 CET -> 03:00 CEST (01:00Z);
#                   fall back 2026-10-25 03:00 CEST -> 02:00 CET (01:00Z).


def test_spring_forward_fixed_time_runs_once_at_first_valid_instant():
    got = run("30 2 * * *", "America/New_York", u(2026, 3, 7, 12), 3)
    assert local(got, NY) == ["03-08 03:00:00-0400", "03-09 02:30:00-0400", "03-10 02:30:00-0400"]
    assert got[0] == u(2026, 3, 8, 7)


def test_spring_forward_several_gap_matches_coalesce_into_one_firing():
    # every 20 minutes during 02:xx: all three wall times are skipped -> one run at 03:00
    got = run("0 */20 2 * * *", "America/New_York", u(2026, 3, 8, 5), 2)
    assert local(got, NY) == ["03-08 03:00:00-0400", "03-09 02:00:00-0400"]


def test_spring_forward_interval_job_keeps_real_time_spacing():
    got = run("*/30 * * * *", "America/New_York", u(2026, 3, 8, 5, 45), 4)
    assert local(got, NY) == ["03-08 01:00:00-0500", "03-08 01:30:00-0500", "03-08 03:00:00-0400", "03-08 03:30:00-0400"]
    assert [b - a for a, b in zip(got, got[1:])] == [timedelta(minutes=30)] * 3


def test_fall_back_fixed_time_fires_once():
    got = run("30 1 * * *", "America/New_York", u(2026, 10, 31, 12), 3)
    assert local(got, NY) == ["11-01 01:30:00-0400", "11-02 01:30:00-0500", "11-03 01:30:00-0500"]


def test_fall_back_fixed_time_from_inside_the_repeated_hour():
    # an agent taking over at 01:15 EST (second pass) must not run 01:30 again
    s = Schedule.cron_expr("30 1 * * *", "America/New_York")
    assert next_due(s, u(2026, 11, 1, 6, 15)) == u(2026, 11, 2, 6, 30)
    # ... and an agent taking over at 01:15 EDT (first pass) runs it at 01:30 EDT
    assert next_due(s, u(2026, 11, 1, 5, 15)) == u(2026, 11, 1, 5, 30)


def test_fall_back_interval_job_runs_through_the_repeated_hour():
    got = run("*/30 * * * *", "America/New_York", u(2026, 11, 1, 4, 45), 5)
    assert local(got, NY) == ["11-01 01:00:00-0400", "11-01 01:30:00-0400", "11-01 01:00:00-0500",
                              "11-01 01:30:00-0500", "11-01 02:00:00-0500"]
    assert [b - a for a, b in zip(got, got[1:])] == [timedelta(minutes=30)] * 4


def test_cron_with_seconds_and_tz_across_both_berlin_transitions():
    expr = "30 15 2 * * *"  # 02:15:30 every day, Berlin
    spring = run(expr, "Europe/Berlin", u(2026, 3, 27, 12), 3)
    assert local(spring, BERLIN) == ["03-28 02:15:30+0100", "03-29 03:00:00+0200", "03-30 02:15:30+0200"]
    autumn = run(expr, "Europe/Berlin", u(2026, 10, 24, 12), 3)
    assert local(autumn, BERLIN) == ["10-25 02:15:30+0200", "10-26 02:15:30+0100", "10-27 02:15:30+0100"]
    # the repeated 02:15:30 (CET, second pass) is not a firing
    assert u(2026, 10, 25, 1, 15, 30) not in autumn


def test_every_10_seconds_across_fall_back_is_evenly_spaced():
    s = Schedule.cron_expr("*/10 * * * * *", "Europe/Berlin")
    got = firings_between(s, u(2026, 10, 25, 0, 59), u(2026, 10, 25, 1, 1))
    assert len(got) == 12 and all(b - a == timedelta(seconds=10) for a, b in zip(got, got[1:]))


def test_half_hour_dst_lord_howe():
    # Australia/Lord_Howe: +10:30 -> +11:00 on 2026-10-04 at 02:00 local
    zone = ZoneInfo("Australia/Lord_Howe")
    got = run("15 2 * * *", "Australia/Lord_Howe", u(2026, 10, 2), 3)
    assert [t.astimezone(zone).strftime("%m-%d %H:%M") for t in got] == ["10-03 02:15", "10-04 02:30", "10-05 02:15"]


def test_midnight_gap_zone():
    # America/Havana springs forward at 00:00 -> 01:00 (2026-03-08); a daily midnight job runs at 01:00
    zone = ZoneInfo("America/Havana")
    got = run("0 0 * * *", "America/Havana", u(2026, 3, 6, 12), 3)
    assert [t.astimezone(zone).strftime("%m-%d %H:%M") for t in got] == ["03-07 00:00", "03-08 01:00", "03-09 00:00"]


CASES = [("30 2 * * *", "America/New_York"), ("*/20 * * * *", "America/New_York"), ("0 */7 1-3 * * *", "Europe/Berlin"),
         ("15 2 * * *", "Australia/Lord_Howe"), ("0 0 * * *", "America/Havana"), ("*/45 0-3 * * *", "Europe/Berlin")]
WINDOWS = [u(2026, 3, 8, 4), u(2026, 11, 1, 3), u(2026, 3, 28, 22), u(2026, 10, 24, 22), u(2026, 10, 3, 12), u(2026, 3, 7, 2)]


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(CASES), window=st.sampled_from(WINDOWS), offset_s=st.integers(0, 8 * 3600),
       offset2_s=st.integers(0, 8 * 3600))
def test_firings_do_not_depend_on_where_the_computation_starts(case, window, offset_s, offset2_s):
    """Any agent, starting from any instant, computes the same firings (failover safety),
    strictly increasing, and each one either matches the expression in local time or is
    the first instant after a spring-forward gap."""
    s = Schedule.cron_expr(*case)
    end = window + timedelta(hours=30)
    full = firings_between(s, window, end)
    a = window + timedelta(seconds=offset_s)
    b = window + timedelta(seconds=offset2_s)
    assert firings_between(s, a, end) == [d for d in full if d > a]
    assert firings_between(s, b, end) == [d for d in full if d > b]
    assert all(x < y for x, y in zip(full, full[1:]))
    assert len(set(fire_id("j", d) for d in full)) == len(full)


def test_fixed_time_job_fires_exactly_once_per_local_day_across_dst():
    for tz, days in [("America/New_York", (u(2026, 3, 7), u(2026, 11, 2))), ("Europe/Berlin", (u(2026, 3, 28), u(2026, 10, 26)))]:
        zone = ZoneInfo(tz)
        for expr in ["30 1 * * *", "30 2 * * *", "0 3 * * *", "59 59 1 * * *"]:
            s = Schedule.cron_expr(expr, tz)
            for d in days:
                got = firings_between(s, d - timedelta(days=2), d + timedelta(days=2))
                per_day = {}
                for t in got:
                    per_day.setdefault(t.astimezone(zone).date(), []).append(t)
                assert all(len(v) == 1 for v in per_day.values()), (tz, expr, per_day)


# ---------------------------------------------------------------- misfire


EVERY_MIN = Schedule.cron_expr("* * * * *")


def test_misfire_run_once_runs_only_the_latest():
    got = missed_firings(EVERY_MIN, u(2026, 1, 1, 12, 0), u(2026, 1, 1, 12, 10, 30), "run_once", 1)
    assert got == [u(2026, 1, 1, 12, 10)]


def test_misfire_skip_runs_none_unless_within_grace():
    now = u(2026, 1, 1, 12, 10, 30)
    assert missed_firings(EVERY_MIN, u(2026, 1, 1, 12, 0), now, "skip", 1) == []
    assert missed_firings(EVERY_MIN, u(2026, 1, 1, 12, 0), now, "skip", 1, grace_s=45) == [u(2026, 1, 1, 12, 10)]
    rec = recover(EVERY_MIN, u(2026, 1, 1, 12, 0), now, "skip")
    assert rec.run == [] and rec.skipped == 10 and rec.next_due == u(2026, 1, 1, 12, 11)


def test_misfire_run_all_up_to_limit_oldest_first():
    last = u(2026, 1, 1, 12, 0)
    now = u(2026, 1, 1, 12, 10, 30)
    assert missed_firings(EVERY_MIN, last, now, "run_all", 3) == [u(2026, 1, 1, 12, 8), u(2026, 1, 1, 12, 9), u(2026, 1, 1, 12, 10)]
    assert missed_firings(EVERY_MIN, last, now, "run_all", 100) == [u(2026, 1, 1, 12, m) for m in range(1, 11)]
    rec = recover(EVERY_MIN, last, now, "run_all", 3)
    assert rec.skipped == 7 and not rec.skipped_capped


def test_misfire_window_bounds():
    now = u(2026, 1, 1, 12, 5)
    # first_due is inclusive, last_due_done exclusive, now inclusive
    assert missed_firings(EVERY_MIN, None, now, "run_all", 10, first_due=u(2026, 1, 1, 12, 3)) == [
        u(2026, 1, 1, 12, 3), u(2026, 1, 1, 12, 4), u(2026, 1, 1, 12, 5)]
    assert missed_firings(EVERY_MIN, u(2026, 1, 1, 12, 4), now, "run_all", 10, first_due=u(2026, 1, 1, 12, 3)) == [now]
    assert missed_firings(EVERY_MIN, now, now, "run_all", 10) == []
    assert missed_firings(EVERY_MIN, None, now, "run_once", 1, first_due=now + timedelta(minutes=1)) == []
    with pytest.raises(ValueError):
        missed_firings(EVERY_MIN, None, now, "run_once", 1)


def test_misfire_huge_backlog_is_cheap():
    every_s = Schedule.cron_expr("* * * * * *")
    last = u(2025, 1, 1)
    now = u(2026, 1, 1, 0, 0, 0, 500)
    assert missed_firings(every_s, last, now, "run_once", 1) == [u(2026, 1, 1)]
    assert missed_firings(every_s, last, now, "run_all", 3) == [u(2025, 12, 31, 23, 59, 58), u(2025, 12, 31, 23, 59, 59), u(2026, 1, 1)]
    rec = recover(every_s, last, now, "skip")
    assert rec.run == [] and rec.skipped_capped and rec.next_due == u(2026, 1, 1, 0, 0, 1)


def test_misfire_sparse_schedule():
    yearly = Schedule.cron_expr("0 0 1 1 *", "Europe/Berlin")
    got = missed_firings(yearly, u(2020, 6, 1), u(2026, 6, 1), "run_all", 2)
    assert got == [u(2024, 12, 31, 23), u(2025, 12, 31, 23)]


def test_misfire_one_shots():
    at = Schedule.parse({"at": "2026-01-01T12:00:00Z"})
    late = u(2026, 1, 1, 13)
    assert missed_firings(at, None, late, "run_once") == [u(2026, 1, 1, 12)]
    assert missed_firings(at, None, late, "run_all", 5) == [u(2026, 1, 1, 12)]
    assert missed_firings(at, None, late, "skip") == []
    assert recover(at, None, late, "skip").skipped == 1
    assert missed_firings(at, u(2026, 1, 1, 12), late, "run_once") == []  # already done
    assert recover(at, None, u(2026, 1, 1, 11), "run_once").next_due == u(2026, 1, 1, 12)
    # delay needs its first_due; now ignores the policy (never lost)
    delay = Schedule.parse({"delay_s": 30})
    assert missed_firings(delay, None, late, "skip", first_due=u(2026, 1, 1, 12, 0, 30)) == []
    assert missed_firings(Schedule.now(), None, late, "skip", first_due=u(2026, 1, 1, 12)) == [u(2026, 1, 1, 12)]


def test_recover_job_respects_not_after_and_job_policy():
    job = SimpleNamespace(schedule=EVERY_MIN, misfire="run_all", misfire_limit=5, issued_at=u(2026, 1, 1, 11, 59, 30),
                          not_after=u(2026, 1, 1, 12, 3))
    rec = recover_job(job, u(2026, 1, 1, 11, 59, 31), None, u(2026, 1, 1, 12, 10))
    assert rec.run == [u(2026, 1, 1, 12, 0), u(2026, 1, 1, 12, 1), u(2026, 1, 1, 12, 2)]
    assert rec.next_due is None
    assert is_expired(job, u(2026, 1, 1, 12, 3)) and not is_expired(job, u(2026, 1, 1, 12, 2, 59))


def test_the_latest_missed_firing_of_an_expired_job_is_before_not_after():
    """The scheduler records the latest skipped firing as misfired: after not_after that
    must be the last real firing, not one the job never had (the seeded fault test found
    a misfired record at a firing past not_after)."""
    job = SimpleNamespace(schedule=EVERY_MIN, misfire="skip", misfire_limit=1, issued_at=u(2026, 1, 1, 11, 59, 30),
                          not_after=u(2026, 1, 1, 12, 3))
    now = u(2026, 1, 1, 12, 10)
    assert window_end(job, now) < job.not_after and window_end(job, u(2026, 1, 1, 12, 2)) == u(2026, 1, 1, 12, 2)
    latest = missed_firings(job.schedule, None, window_end(job, now), "run_once",
                            first_due=first_due(job, job.issued_at))
    assert latest == [u(2026, 1, 1, 12, 2)]
    assert recover_job(job, job.issued_at, None, now).skipped == 3


# ---------------------------------------------------------------- overlap and retry


def test_overlap_action():
    assert overlap_action("forbid", False) == "start"
    assert overlap_action("forbid", True) == "skip"
    assert overlap_action("allow", True) == "start"
    assert overlap_action("replace", True) == "replace"
    with pytest.raises(ValueError):
        overlap_action("queue", True)


def test_retry_delay_exponential_without_jitter():
    p = RetryPolicy(max_attempts=10, backoff_s=2, max_backoff_s=60, jitter=0)
    assert [retry_delay(p, a) for a in range(1, 8)] == [2, 4, 8, 16, 32, 60, 60]
    assert retry_delay(p, 10_000) == 60  # no overflow


@settings(max_examples=300, deadline=None, database=None)
@given(backoff=st.floats(0, 3600), extra=st.floats(0, 86400), jitter=st.floats(0, 1), attempt=st.integers(1, 200),
       seed=st.integers(0, 2**32))
def test_retry_delay_bounds(backoff, extra, jitter, attempt, seed):
    p = RetryPolicy(max_attempts=100, backoff_s=backoff, max_backoff_s=backoff + extra, jitter=jitter)
    base = min(backoff * 2 ** min(attempt - 1, 1023), p.max_backoff_s)
    d = retry_delay(p, attempt, random.Random(seed))
    assert 0 <= d <= p.max_backoff_s
    assert base * (1 - jitter) - 1e-9 <= d <= base + 1e-9


def test_retry_rng_is_deterministic_per_firing_and_attempt():
    p = RetryPolicy(max_attempts=5, backoff_s=10, max_backoff_s=100, jitter=0.5)
    a = retry_delay(p, 2, retry_rng("job", "20261202T120000.000Z", 2))
    assert a == retry_delay(p, 2, retry_rng("job", "20261202T120000.000Z", 2))
    assert a != retry_delay(p, 2, retry_rng("job", "20261202T120100.000Z", 2))


def test_next_retry_at():
    job = SimpleNamespace(id="j", retry=RetryPolicy(max_attempts=3, backoff_s=2, max_backoff_s=60, jitter=0), not_after=None)
    failed = u(2026, 1, 1, 12)
    assert next_retry_at(job, "f", 1, failed) == failed + timedelta(seconds=2)
    assert next_retry_at(job, "f", 2, failed) == failed + timedelta(seconds=4)
    assert next_retry_at(job, "f", 3, failed) is None
    job.not_after = failed + timedelta(seconds=3)
    assert next_retry_at(job, "f", 2, failed) is None


_TOKENS = ["*", "0", "1", "5", "7", "12", "23", "29", "30", "31", "59", "60", "*/5", "*/0", "1-5", "5-1", "1-31/7", "L",
           "mon", "sun", "jan", "dec", "mon#2", "fri#5", "1,2", ",", "-", "/", "0-7", "mon-fri", "l", "#", "2L"]


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(fields=st.lists(st.sampled_from(_TOKENS), min_size=4, max_size=7),
       tz=st.sampled_from(["UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe"]),
       start=st.datetimes(min_value=datetime(2020, 1, 1), max_value=datetime(2030, 1, 1), timezones=st.just(UTC)))
def test_any_cron_expression_parses_or_raises_schedule_error_and_then_iterates(fields, tz, start):
    try:
        s = Schedule.parse({"cron": " ".join(fields), "tz": tz})
    except ScheduleError as exc:
        assert exc.field == "schedule.cron"
        return
    t = start
    for _ in range(3):
        nxt = next_due(s, t)
        if nxt is None:
            break
        assert nxt > t
        t = nxt


ORACLE_CASES = [
    ("30 2 * * *", "America/New_York", u(2026, 3, 7, 20)), ("30 2 * * *", "America/New_York", u(2026, 10, 31, 20)),
    ("*/20 * * * *", "America/New_York", u(2026, 3, 7, 20)), ("*/20 * * * *", "America/New_York", u(2026, 10, 31, 20)),
    ("*/10 1-3 * * *", "Europe/Berlin", u(2026, 3, 28, 20)), ("*/10 1-3 * * *", "Europe/Berlin", u(2026, 10, 24, 20)),
    ("0,15 2 * * *", "Australia/Lord_Howe", u(2026, 10, 3, 5)), ("45 1 * * *", "Australia/Lord_Howe", u(2026, 4, 4, 5)),
]


@pytest.mark.parametrize("expr,tz,start", ORACLE_CASES)
def test_cron_dst_rules_against_a_brute_force_oracle(expr, tz, start):
    """Walk every minute of 14 hours around a transition and derive the firings from the
    documented rules directly; the computed schedule must be exactly that."""
    from croniter import croniter

    zone = ZoneInfo(tz)
    s = Schedule.cron_expr(expr, tz)
    fixed = s._spec.fixed
    expected = set()
    seen_wall = set()
    prev_off = None
    for i in range(14 * 60 + 1):
        t = start + timedelta(minutes=i)
        loc = t.astimezone(zone)
        off = loc.utcoffset()
        wall = loc.replace(tzinfo=None)
        if prev_off is not None and off > prev_off and fixed:  # spring-forward at t: the skipped wall times
            gap_start = (t + prev_off).replace(tzinfo=None)
            m = gap_start
            while m < wall:
                if croniter.match(expr, m):
                    expected.add(t)
                m += timedelta(minutes=1)
        prev_off = off
        if croniter.match(expr, wall) and (not fixed or wall not in seen_wall):
            expected.add(t)
        seen_wall.add(wall)
    got = set(firings_between(s, start, start + timedelta(hours=14), include_lo=True))
    assert sorted(got) == sorted(expected)


def test_next_firing_for_timers():
    from agent.jobs.schedule import next_firing

    issued = u(2026, 1, 1, 12, 0, 30)
    cron = SimpleNamespace(schedule=Schedule.cron_expr("* * * * *"), issued_at=issued, not_after=u(2026, 1, 1, 12, 3))
    assert next_firing(cron, u(2026, 1, 1, 11), issued) == u(2026, 1, 1, 12, 1)  # never before the first firing
    assert next_firing(cron, u(2026, 1, 1, 12, 1), issued) == u(2026, 1, 1, 12, 2)
    assert next_firing(cron, u(2026, 1, 1, 12, 2), issued) is None  # 12:03 is not before not_after
    once = SimpleNamespace(schedule=Schedule.parse({"delay_s": 10}), issued_at=issued, not_after=None)
    assert next_firing(once, issued, issued) == issued + timedelta(seconds=10)
    assert next_firing(once, issued + timedelta(seconds=10), issued) is None
