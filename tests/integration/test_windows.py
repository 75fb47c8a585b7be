"""Maintenance windows on real agents and a real etcd (issue 37, acceptance 1 and 4).

A per-5-second cron job whose window is open 20 s of every minute runs only inside the
windows for 3 minutes (make test-release only; run by hand without MILLWRIGHT_SLOW=1: 10 s
of every 20 s, four windows),
judged by its side effects' own clocks (tests/jobs/effect.sh), also across a kill -9 of its
owner inside a window and one outside; a long run with ``end: stop`` is stopped within
kill_grace_s + 1 s of its window's end, in every window."""

from __future__ import annotations

import os
import time
from datetime import datetime, timedelta, timezone

import pytest

from agent.coordination.keys import shard_of
from agent.jobs.schedule import parse_fire_id
from agent.runtime.timefmt import format_rfc3339, parse_rfc3339
from tests.support import history
from tests.support.cluster import Cluster, merge_sections
from tests.support.jobs import effects_file
from tests.support.waiting import wait_for

EFFECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs", "effect.sh")
SLOW = os.environ.get("MILLWRIGHT_SLOW") == "1"
PERIOD_S = 60 if SLOW else 20   # a window opens every PERIOD_S (a divisor of 60) ...
OPEN_S = 20 if SLOW else 10     # ... and stays open OPEN_S
SECONDS = ",".join(str(s) for s in range(0, 60, PERIOD_S))   # the cron seconds the windows open at
GRACE_S = 1.0        # execute.kill_grace_s of the test cluster


def effect_template(out: str, agent: str) -> dict:
    return {"templates": {"fx": {"argv": [EFFECT, out, agent, "{sleep}", "0"], "params": {"sleep": r"^[0-9.]+$"},
                                 "user": "root", "allow_root": True, "allow_exec": ["/bin/*", "/usr/bin/*", EFFECT]}}}


def in_window(t: float) -> bool:
    return t % PERIOD_S < OPEN_S


def close_of(t: float) -> float:
    """The end of the window that ``t`` is in."""
    return (t // PERIOD_S) * PERIOD_S + OPEN_S


@pytest.mark.release   # ~100 s: make test-release runs it with MILLWRIGHT_SLOW=1 (3 minutes)
def test_a_cron_job_runs_only_inside_its_window_through_owner_kills_and_end_stop_stops_long_runs(etcd_server,
                                                                                                  tmp_path):
    out = effects_file(tmp_path)
    c = Cluster(etcd_server, str(tmp_path / "agents"), shards=8, extra={"execute": {"kill_grace_s": GRACE_S}})
    for a in ("a1", "a2"):
        c.start(a, extra=effect_template(out, a))
    wait_for(lambda: c.all_owned_by({"a1", "a2"}) and len(set(c.owners().values())) == 2, 40, what="two owners")
    store = c.job_store()
    now = datetime.now(timezone.utc)
    # start just after a window closed, so the first firings are due outside one
    t0 = (now.timestamp() // PERIOD_S) * PERIOD_S + OPEN_S + PERIOD_S * (now.timestamp() % PERIOD_S > OPEN_S - 5)
    while time.time() < t0 + 2:
        time.sleep(0.2)
    w1 = t0 + PERIOD_S - OPEN_S   # the first window opens here (t0 is a window's end)
    not_after = format_rfc3339(datetime.fromtimestamp(w1 + 4 * PERIOD_S + 20, timezone.utc))
    window = {"cron": f"{SECONDS} * * * * *", "duration_s": OPEN_S, "tz": "Europe/Berlin"}
    store.create({"v": 1, "id": "tick", "template": "fx", "params": {"sleep": "0"},
                  "schedule": {"cron": "*/5 * * * * *", "tz": "UTC"}, "misfire": "run_once",
                  "window": window, "not_after": not_after})
    long_at = ",".join(str(s + 2) for s in range(0, 60, PERIOD_S))   # 2 s into each window
    store.create({"v": 1, "id": "long", "template": "fx", "params": {"sleep": "60"},
                  "schedule": {"cron": f"{long_at} * * * * *", "tz": "UTC"}, "window": {**window, "end": "stop"},
                  "not_after": not_after, "timeout_s": 120})

    def owner_of(job: str) -> str:
        return c.owners()[shard_of(job, c.shards)]

    def kill_owner_at(t: float) -> None:
        while time.time() < t:
            time.sleep(0.1)
        victim = owner_of("tick")
        c.agents[victim].kill()   # kill -9
        time.sleep(6)             # past the lease: the survivor takes the shard over
        c.start(victim, extra=effect_template(out, victim))

    kill_owner_at(w1 + PERIOD_S + 8)                                          # inside the second window
    kill_owner_at(w1 + 2 * PERIOD_S + OPEN_S + (PERIOD_S - OPEN_S) // 4)      # outside, before the fourth
    while time.time() < w1 + 3 * PERIOD_S + OPEN_S + 3:
        time.sleep(0.5)

    effects = history.parse_effects(out)
    starts = [(e.job, e.start) for e in effects]
    assert [s for s in starts if not in_window(s[1])] == []                 # never outside a window
    per_window = {w: [j for j, t in starts if j == "tick" and w <= t < w + OPEN_S]
                  for w in (w1 + k * PERIOD_S for k in range(4))}
    assert all(per_window.values()), per_window                              # and it did run in each
    # firings due outside a window wait for the next one (run_once: the newest of them runs)
    recs = c.job_runs("tick")
    ran = [r for r in recs.values() if r.get("started_at")]
    assert all(in_window(parse_rfc3339(r["started_at"]).timestamp()) for r in ran)
    assert any(not in_window(parse_fire_id(r["fire_id"]).timestamp()) for r in recs.values()
               if r["state"] == "misfired" and r["reason"] == "window")

    # end: stop: each long run got SIGTERM kill_grace_s before its window closed, was dead by the close
    stopped = [r for r in c.job_runs("long").values() if r.get("reason") == "window_closed"]
    assert len(stopped) >= 2, c.job_runs("long")
    for r in stopped:
        assert r["state"] == "killed"
        close = close_of(parse_rfc3339(r["started_at"]).timestamp())
        ended = parse_rfc3339(r["ended_at"]).timestamp()
        assert close - GRACE_S - 0.5 <= ended <= close + GRACE_S + 1.0, (r, close)
    assert not [e for e in effects if e.job == "long" and e.end is not None]   # none ran to its end
    c.close()


def test_a_window_closing_while_a_run_waits_for_node_quota_holds_it_to_the_next_window(etcd_server, tmp_path):
    """Admission comes after the start policies; the claim asks them again, so a firing
    that waited for node quota past its window's end does not start outside it."""
    out = effects_file(tmp_path)
    c = Cluster(etcd_server, str(tmp_path / "agents"), shards=4,
                extra=merge_sections({"execute": {"kill_grace_s": GRACE_S, "max_concurrent": 1}},
                                     effect_template(out, "a1")))
    c.start("a1")
    store = c.job_store()
    now = time.time()
    opens = now + 3
    win = [{"start": format_rfc3339(datetime.fromtimestamp(opens, timezone.utc)),
            "end": format_rfc3339(datetime.fromtimestamp(opens + 4, timezone.utc))},
           {"start": format_rfc3339(datetime.fromtimestamp(opens + 12, timezone.utc)),
            "end": format_rfc3339(datetime.fromtimestamp(opens + 20, timezone.utc))}]
    at = format_rfc3339(datetime.fromtimestamp(opens + 0.5, timezone.utc))
    hog = format_rfc3339(datetime.fromtimestamp(opens - 1, timezone.utc))   # takes the one slot first
    store.create({"v": 1, "id": "hog", "template": "fx", "params": {"sleep": "9"}, "schedule": {"at": hog}})
    store.create({"v": 1, "id": "held", "template": "fx", "params": {"sleep": "0"}, "schedule": {"at": at},
                  "window": win})
    rec = wait_for(lambda: next((r for r in c.job_runs("held").values() if r["state"] == "succeeded"), None), 40,
                   interval=0.2, what="held runs")
    started = parse_rfc3339(rec["started_at"]).timestamp()
    assert opens + 12 <= started < opens + 20, (started - opens)
    (e,) = [e for e in history.parse_effects(out) if e.job == "held"]
    assert opens + 12 <= e.start < opens + 20
    waits = [d["reason"] for d in c.statuses("a1") if d["job_id"] == "held" and d["state"] == "waiting"]
    assert waits == ["quota", "window"], waits   # quota first, then (asked again before its claim) the window
    c.close()


def test_jobs_without_a_window_run_as_before(etcd_server, tmp_path):
    out = effects_file(tmp_path)
    c = Cluster(etcd_server, str(tmp_path / "agents"), shards=4, extra=effect_template(out, "a1"))
    c.start("a1")
    due = datetime.now(timezone.utc) + timedelta(seconds=2)
    c.job_store().create({"v": 1, "id": "plain", "template": "fx", "params": {"sleep": "0"},
                          "schedule": {"at": format_rfc3339(due)}})
    rec = wait_for(lambda: next((r for r in c.job_runs("plain").values() if r["state"] == "succeeded"), None), 20,
                   interval=0.2, what="plain runs")
    assert parse_rfc3339(rec["started_at"]) >= due
    c.close()
