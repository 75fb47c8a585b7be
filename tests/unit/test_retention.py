"""Retention decisions (agent/jobs/retention.py): what goes, and what must never go."""

from __future__ import annotations

import json

from agent.coordination.jobstore import StoredJob, content_digest, finished_tombstone
from agent.jobs.retention import finished_since, plan_run_dirs, plan_shard
from agent.jobs.schedule import format_rfc3339, parse_rfc3339

DAY = 86400.0
NOW = parse_rfc3339("2026-12-01T12:00:00Z").timestamp()


def ts(offset_s: float) -> str:
    from datetime import datetime, timezone

    return format_rfc3339(datetime.fromtimestamp(NOW + offset_s, timezone.utc))


def rec(fire: str, state: str = "succeeded", ended: float = -DAY, job: str = "o") -> bytes:
    return json.dumps({"job_id": job, "fire_id": fire, "state": state, "ended_at": ts(ended)}).encode()


def fires(n: int) -> list[str]:
    return [f"20261201T{h:02d}{m:02d}00.000Z" for h in range(24) for m in range(60)][:n]


def runs_of(job: str, states: list[str]) -> list:
    return [(f, f"runs/0000/{job}/{f}", rec(f, s, job=job), i + 1)
            for i, (f, s) in enumerate(zip(fires(len(states)), states))]


def cron(job: str, **kw) -> dict:
    return {"id": job, "schedule": {"cron": "* * * * *"}, "_accepted": {"at": ts(-30 * DAY)}, **kw}


def plan(jobs: dict, runs: dict, latest: dict | None = None, keep: int = 3, fin: float = 7 * DAY, tomb: float = 7 * DAY):
    j = {k: (d, f"jobs/0000/{k}", 10) for k, d in jobs.items()}
    return plan_shard(j, runs, latest or {}, NOW, keep, fin, tomb)


def test_keeps_the_newest_keep_runs_records_and_never_a_live_one():
    states = ["succeeded"] * 6 + ["retrying"] + ["succeeded"] * 5 + ["running"]
    p = plan({"c": cron("c")}, {"c": runs_of("c", states)}, keep=3)
    deleted = {k.rsplit("/", 1)[1] for k, _ in p.runs}
    all_fires = fires(len(states))
    assert all_fires[-3:] == sorted(set(all_fires[-3:]) - deleted)          # newest 3 kept
    assert all_fires[6] not in deleted                                      # retrying kept
    assert all_fires[-1] not in deleted                                     # newest (running) kept
    assert len(deleted) == len(states) - 3 - 1
    assert not p.finish and not p.tombstones


def test_keep_runs_one_still_keeps_the_newest_record():
    p = plan({"c": cron("c")}, {"c": runs_of("c", ["failed"] * 50)}, keep=1)
    assert len(p.runs) == 49 and fires(50)[-1] not in {k.rsplit("/", 1)[1] for k, _ in p.runs}


def test_one_shot_done_long_ago_becomes_a_tombstone_and_its_records_go():
    doc = {"id": "o", "schedule": {}, "template": "t", "_accepted": {"at": ts(-9 * DAY), "by": "a1"}}
    runs = {"o": [("20261120T000000.000Z", "runs/0000/o/x", rec("20261120T000000.000Z", "succeeded", ended=-8 * DAY), 5)]}
    p = plan({"o": doc}, runs, latest={"o": ("latest/0000/o", 6)})
    assert len(p.finish) == 1
    key, rev, tomb, latest_key, reason = p.finish[0]
    assert (key, rev, latest_key, reason) == ("jobs/0000/o", 10, "latest/0000/o", "done")
    assert tomb["_digest"] == content_digest(doc) and tomb["_accepted"]["by"] == "a1" and tomb["_tombstone"]
    assert p.runs == [("runs/0000/o/x", 5)]


def test_one_shot_done_recently_or_still_running_stays():
    doc = {"id": "o", "schedule": {}}
    recent = {"o": [("f", "runs/0000/o/f", rec("f", "succeeded", ended=-DAY), 5)]}
    assert plan({"o": doc}, recent).empty()
    running = {"o": [("f", "runs/0000/o/f", rec("f", "running", ended=-30 * DAY), 5)]}
    assert plan({"o": doc}, running).empty()
    assert plan({"o": doc}, {}).empty()  # never ran (waiting for depends_on): stays


def test_cron_job_finishes_only_when_cancelled_or_expired():
    assert finished_since(cron("c"), json.loads(rec("f")), True) is None
    at, why = finished_since(cron("c", _cancelled={"at": ts(-8 * DAY)}), None, True)
    assert why == "cancelled" and at == NOW - 8 * DAY
    at, why = finished_since(cron("c", not_after=ts(-9 * DAY)), json.loads(rec("f")), True)
    assert why == "expired"
    assert finished_since(cron("c", _cancelled={"at": ts(-8 * DAY)}), None, all_terminal=False) is None


def test_tombstones_go_after_tombstone_s_and_their_leftovers_with_them():
    old = {"id": "t1", "_tombstone": True, "_finished": {"at": ts(-8 * DAY), "reason": "done"}}
    young = {"id": "t2", "_tombstone": True, "_finished": {"at": ts(-1 * DAY), "reason": "done"}}
    cancel_first = {"id": "t3", "_tombstone": True, "_cancelled": {"at": ts(-10 * DAY)}}
    runs = {"t2": runs_of("t2", ["cancelled"])}
    p = plan({"t1": old, "t2": young, "t3": cancel_first}, runs,
             latest={"t2": ("latest/0000/t2", 3), "gone": ("latest/0000/gone", 4)})
    assert sorted(k for k, _ in p.tombstones) == ["jobs/0000/t1", "jobs/0000/t3"]
    assert len(p.runs) == 1
    assert sorted(k for k, _ in p.latest) == ["latest/0000/gone", "latest/0000/t2"]


def test_records_of_a_job_that_does_not_exist_go_unless_live():
    p = plan({}, {"x": runs_of("x", ["succeeded", "running"])})
    assert len(p.runs) == 1


def test_a_finished_tombstone_answers_a_redelivered_push_like_the_job():
    doc = {"v": 1, "id": "o", "template": "t", "params": {}, "schedule": {}}
    stored = dict(doc, _accepted={"at": ts(-9 * DAY), "by": "a1"})
    tomb = StoredJob(0, finished_tombstone(stored, ts(0), "done"), 1, 1)
    assert tomb.finished and tomb.tombstone and not tomb.cancelled
    assert tomb.same_content(doc)
    assert not tomb.same_content(dict(doc, params={"x": "1"}))
    assert len(json.dumps(tomb.doc)) < 400


def test_run_dirs_by_age_per_job_count_and_budget_never_in_use():
    def name(job: str, i: int) -> str:
        return f"{job}_20261201T{i // 60:02d}{i % 60:02d}00.000Z_{i}.1-{i:010x}"

    entries = [(name("a", i), NOW - 1000 + i, 100) for i in range(30)]
    entries += [(name("b", i), NOW - 8 * DAY, 100) for i in range(2)]
    entries += [("not-a-run-dir", NOW - 500, 5000)]
    in_use = {name("a", 0)}
    doomed = set(plan_run_dirs(entries, in_use, NOW, keep_runs=20, max_age_s=7 * DAY, budget_bytes=10**9))
    assert {name("b", 0), name("b", 1)} <= doomed                     # too old
    assert {name("a", i) for i in range(1, 10)} <= doomed             # beyond 20 per job
    assert name("a", 0) not in doomed                                 # in use
    assert not {name("a", i) for i in range(10, 30)} & doomed
    # budget: oldest first until the rest fits; a directory in use stays even over budget
    doomed2 = set(plan_run_dirs(entries, in_use, NOW, 20, 7 * DAY, budget_bytes=5100))
    assert {n for n, _, _ in entries} - doomed2 == {name("a", 0), "not-a-run-dir"}
    doomed3 = set(plan_run_dirs(entries, in_use, NOW, 20, 7 * DAY, budget_bytes=1))
    assert {n for n, _, _ in entries} - doomed3 == {name("a", 0)}
    fresh = [(name("c", 1), NOW - 1, 10**6)]
    assert plan_run_dirs(fresh, set(), NOW, 20, 7 * DAY, budget_bytes=1) == []  # just created


def test_a_forged_final_record_does_not_finish_a_one_shot():
    """Records are not signed: a `succeeded` naming another job, a firing not yet due, or
    no end does not make retention tombstone the job (that would stop it)."""
    doc = {"id": "o", "schedule": {"at": ts(3 * DAY)}, "_accepted": {"at": ts(-9 * DAY)}}
    future = "20261204T120000.000Z"
    for forged in ({"job_id": "other", "fire_id": "20261120T120000.000Z", "state": "succeeded", "ended_at": ts(-8 * DAY)},
                   {"job_id": "o", "fire_id": future, "state": "succeeded", "ended_at": ts(-8 * DAY)},
                   {"job_id": "o", "fire_id": "20261120T120000.000Z", "state": "succeeded"}):
        assert finished_since(doc, forged, True, NOW) is None, forged
    assert finished_since(doc, {"job_id": "o", "fire_id": "20261120T120000.000Z", "state": "succeeded",
                                "ended_at": ts(-8 * DAY)}, True, NOW) is not None


def rollout_keys(job: str, firings: list[str], aborted_at: float | None = None, agents=("a", "b")) -> list:
    """(name under the job, key, value, mod_rev) of every agent's rollout keys of the job."""
    items = []
    for a in agents:
        for f in firings:
            for name in (f"{f}/start", f"{f}/outcome", f"{f}/claim"):
                items.append((name, f"rollouts/{a}/0000/{job}/{name}", b"{}", 5))
    if aborted_at is not None:
        items.append(("aborted", f"rollouts/{agents[0]}/0000/{job}/aborted",
                      json.dumps({"at": ts(aborted_at)}).encode(), 6))
    return items


def test_rollout_keys_go_with_their_job_and_a_live_job_keeps_its_newest_firings():
    r = {"c": rollout_keys("c", fires(5), aborted_at=-DAY), "gone": rollout_keys("gone", fires(1))}
    p = plan_shard({"c": (cron("c"), "jobs/0000/c", 10)}, {}, {}, NOW, 3, 7 * DAY, 7 * DAY, r)
    deleted = {k for k, _ in p.rollouts}
    assert {k for _, k, _, _ in r["gone"]} <= deleted                       # the job is gone: all of it
    kept = {k for _, k, _, _ in r["c"]} - deleted
    assert {k.split("/")[4] for k in kept if not k.endswith(("/claim", "aborted"))} == set(fires(5)[-3:])
    assert "rollouts/a/0000/c/aborted" in kept                              # the abort mark stays with the job
    assert all(not k.endswith("/claim") for k in deleted if "/gone/" not in k)   # a held claim goes with its lease


def test_an_aborted_job_finishes_from_its_abort_mark_once_nothing_runs():
    r = {"c": rollout_keys("c", [], aborted_at=-8 * DAY)}
    p = plan_shard({"c": (cron("c"), "jobs/0000/c", 10)}, {}, {}, NOW, 3, 7 * DAY, 7 * DAY, r)
    assert [(k, why) for k, _, _, _, why in p.finish] == [("jobs/0000/c", "aborted")]
    live = {"c": runs_of("c", ["running"])}
    p = plan_shard({"c": (cron("c"), "jobs/0000/c", 10)}, live, {}, NOW, 3, 7 * DAY, 7 * DAY, r)
    assert not p.finish
