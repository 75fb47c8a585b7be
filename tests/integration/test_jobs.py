"""Durable jobs, scheduling and exactly-once runs on a real etcd with real agent processes
(issue 3 acceptance). Jobs are written straight into the job store, as ingest does, signed
and bound by the shared helper (Cluster.signing); and what happens to documents written
there by anyone else (issue 16: unsigned, forged, another cluster's, a retired key's)."""

from __future__ import annotations

import bisect
import collections
import json
import os
import random
import time
from datetime import datetime, timedelta, timezone
from typing import Optional

import pytest

from agent.coordination.etcd import EtcdUnavailable
from agent.coordination.jobstore import JobStore
from agent.coordination.keys import shard_of
from agent.jobs.schedule import fire_id, format_rfc3339
from tests.support.cluster import Cluster, recording_cluster
from tests.support.waiting import wait_for
from tests.support.records import agent_statuses
from tests.support import history
from tests.support.jobs import effects, job, now

CATCH_UP_PER_S = 100.0   # firings/s the 3-agent test cluster on 2 cores starts at least, catching up after faults

@pytest.fixture
def env(etcd_server, tmp_path):
    c, out = recording_cluster(etcd_server, tmp_path)
    store = c.job_store()
    yield c, store, out, tmp_path
    c.close()


def wait_records(c: Cluster, pred, timeout: float, what: str):
    return wait_for(lambda: pred(c.run_records()), timeout, interval=0.2, what=what)


def test_exactly_once_2000_jobs_with_agent_kills_and_an_etcd_restart(env, etcd_server):
    c, store, out, _ = env
    for i in range(3):
        c.start(f"a{i}")
    wait_for(lambda: c.converged({"a0": 1, "a1": 1, "a2": 1}), 20, what="3-way plan")
    rng = random.Random(7)
    t0 = now() + timedelta(seconds=4)
    horizon = 36.0
    expected: set[tuple[str, str]] = set()
    firings: list[history.Firing] = []
    cron_jobs = []
    issued0 = now().replace(microsecond=0)
    not_after = (t0 + timedelta(seconds=horizon)).replace(microsecond=0)
    for i in range(2000):
        kind = i % 10
        jid = f"j{i:04d}"
        if kind < 6:  # at: spread over the horizon
            due = t0 + timedelta(seconds=rng.uniform(0, horizon))
            due = due.replace(microsecond=(due.microsecond // 1000) * 1000)
            store.create(job(jid, {"at": format_rfc3339(due)}))
            expected.add((jid, fire_id(jid, due)))
            # creating 2,000 jobs takes seconds (longer on a busy host): one due before its
            # job was stored is due when stored
            firings.append(history.Firing(jid, fire_id(jid, due), due.timestamp(), stored_at=time.time()))
        elif kind < 8:  # delay relative to issued_at
            issued = now().replace(microsecond=0)
            delay = round(rng.uniform(4, 4 + horizon), 3)
            store.create(job(jid, {"delay_s": delay}, issued_at=format_rfc3339(issued)))
            due = issued + timedelta(seconds=delay)
            expected.add((jid, fire_id(jid, due)))
            firings.append(history.Firing(jid, fire_id(jid, due), due.timestamp(), stored_at=time.time()))
        elif kind < 9:  # now: due at issued_at
            issued = now().replace(microsecond=0)
            store.create(job(jid, {}, issued_at=format_rfc3339(issued)))
            firings.append(history.Firing(jid, fire_id(jid, issued), issued.timestamp(), stored_at=time.time()))
        else:  # cron every 5 s (seconds field first) in a DST zone, counted from issued_at
            store.create(job(jid, {"cron": "*/5 * * * * *", "tz": "Europe/Berlin"}, misfire="run_once",
                             issued_at=format_rfc3339(issued0), not_after=format_rfc3339(not_after)))
            stored_at = time.time()
            cron_jobs.append(jid)
            d = (int(issued0.timestamp()) // 5 + 1) * 5
            while d < not_after.timestamp():
                due = datetime.fromtimestamp(d, timezone.utc)
                # creating 2,000 jobs takes seconds: a firing due before its job was stored
                # (and picked up) is missed, and run_once keeps only the latest of those
                firings.append(history.Firing(jid, fire_id(jid, due), float(d), "cron", may_skip=True,
                                              missed_at_store=d <= stored_at + 2.0))
                d += 5
    # chaos: two kill -9 with restarts, one etcd restart; each fault's window is kept
    faults = []
    cron_share = {}  # victim -> its cron jobs at the kill (a cron batch it may have in flight)

    def crons_of(agent: str) -> int:
        owners = c.owners()
        return sum(1 for j in cron_jobs if owners.get(shard_of(j, c.shards)) == agent)

    # what each fault caught in flight, read from etcd: a killed agent's `running` records
    # (nobody may write them until its lease expires, TTL later), and before the etcd stop
    # every agent's, with the firings not yet claimed at the read until a TTL after etcd is back
    in_flight: dict[str, set] = {}

    def running(agent: Optional[str] = None) -> set:
        return {k for k, r in c.run_records().items() if r["state"] == "running" and agent in (None, r["agent"])}

    time.sleep(8)
    print("\nkill a0 at", now().isoformat()[11:23])
    cron_share["a0"] = crons_of("a0")
    t = time.time()
    c.agents["a0"].kill()
    time.sleep(0.3)
    in_flight["a0"] = running("a0")
    time.sleep(4.7)
    c.start("a0")
    faults.append((t, time.time()))
    time.sleep(5)
    print("kill a1 at", now().isoformat()[11:23])
    cron_share["a1"] = crons_of("a1")
    t = time.time()
    c.agents["a1"].kill()
    time.sleep(0.3)
    in_flight["a1"] = running("a1")
    time.sleep(3.7)
    print("etcd stop at", now().isoformat()[11:23])
    t_read = time.time()
    at_read = c.run_records()
    in_flight["etcd"] = {k for k, r in at_read.items() if r["state"] == "running"}
    t_etcd = time.time()
    etcd_server.stop()
    time.sleep(2)
    etcd_server.start()
    # also caught: a firing not yet claimed at the read (due soon, or due earlier and still
    # waiting, e.g. a takeover's paced catch-up), up to a TTL after etcd is back (an agent
    # whose renew deadline passed while etcd was down self-fences that late: owner_lost)
    healed_ttl = time.time() + c.ttl
    in_flight["etcd"] |= {(f.job, f.fire_id) for f in firings
                          if f.due <= healed_ttl and (f.due >= t_read - 1.0 or (f.job, f.fire_id) not in at_read)}
    c.start("a1")
    faults += [(t, time.time()), (t_etcd, time.time())]
    # wait for every one-shot firing to reach a final record (lateness is judged from the
    # records' own times below, so a slow machine only makes this wait longer), at most
    # until a minute after the horizon; then a little more for the last cron firings
    end = t0 + timedelta(seconds=horizon + 60)
    final = ("succeeded", "failed", "misfired")
    # a cron job's firing due while the one before it still waits to start (node quota,
    # during the catch-up after a fault) is misfired `overlap` (at most one firing of a job
    # waits): the catch-up of the backlog the last faults leave is part of their recovery
    healed = max(e for _, e in faults)
    backlog = sum(1 for f in firings if any(s - 1 <= f.due <= e for s, e in faults if e == healed))
    recover = c.ttl + 4.0 + backlog / CATCH_UP_PER_S
    # a firing is still in flight after its due time while the firings due with it (the
    # second before it, its own batch included) start and are recorded: a kill 1.3 s after
    # the 200 cron firings due together can catch its victim's share of them unstarted or
    # unrecorded (owner_lost, or skipped by run_once, with no fault in flight). They start
    # at CATCH_UP_PER_S at least, as the lateness bound assumes
    dues = sorted(f.due for f in firings)

    def in_flight_until(d: float) -> float:
        return d + (bisect.bisect_right(dues, d) - bisect.bisect_left(dues, d - 1.0)) / CATCH_UP_PER_S

    affected = lambda d: any(s - 1 <= in_flight_until(d) and d <= e + recover for s, e in faults)  # noqa: E731
    must = [(f.job, f.fire_id) for f in firings if not (f.may_skip and affected(f.due))]
    while now() < end:
        try:
            rs = c.run_records()
        except EtcdUnavailable:     # this observer's channel, right after the etcd restart above
            time.sleep(1)
            continue
        if now() > t0 + timedelta(seconds=horizon + 1) and all(rs.get(k, {}).get("state") in final for k in must):
            break
        time.sleep(1)
    time.sleep(2)
    recs = c.run_records()
    fx = effects(out)
    # every one-shot firing that was due has exactly one run record (nothing lost)
    missing = [k for k in expected if k not in recs]
    if missing:
        by_shard = collections.Counter(shard_of(j, c.shards) for j, _ in missing)
        owners = c.owners()
        detail = {s: (n, owners.get(s)) for s, n in sorted(by_shard.items())}
        print("\nMISSING by shard (count, owner now):", detail)
        print("expected per agent:", collections.Counter(owners.get(shard_of(j, c.shards)) for j, _ in expected))
        from agent.daemon.admin import query
        for a in c.agents.values():
            st = query(a.config["admin"]["socket"])
            print(a.agent_id, {k: v for k, v in st["jobs"].items() if k != "due"}, st["session"])
    assert not missing, f"{len(missing)} firings without a run record, e.g. {missing[:3]}"
    # the whole history, strictly: fencing, one running record per attempt, every due
    # firing resolved (cron firings may be skipped by run_once only around a fault),
    # within the lateness bound after the faults healed, owner_lost only for runs a fault
    # caught in flight, and owner_lost/misfired within the budget stated here. A kill -9
    # orphans what its agent had claimed or running: one-shots (about 55 due per second,
    # a third of them its own, claimed up to 0.25 s ahead and short: at most 40) and, when
    # the kill comes near a 5 s boundary (before it, or while that batch still starts), its
    # share of the 200 cron firings due together there. The etcd restart fences all three agents at once: 3 x 40 one-shots
    # and at most one cron batch (200). misfired: every cron firing of the jobs whose shard
    # was affected, bounded by all cron firings due within TTL + 4 s of a fault
    ttl = c.ttl
    effective = lambda d: max([d] + [e for s, e in faults if s - 1 <= d <= e])  # noqa: E731
    cron_near = sum(1 for f in firings if f.kind == "cron" and affected(f.due))
    # owner_lost: at most what the faults caught in flight (the earlier budget, 40 one-shots
    # per victim plus cron shares, was about 540 against 107-155 used)
    caught = set().union(*in_flight.values())
    lost_budget = len(caught)
    print("owner_lost budget:", lost_budget, "in flight per fault:", {k: len(v) for k, v in in_flight.items()},
          "victims' cron shares:", cron_share)
    budget = history.Budget(owner_lost=lost_budget, misfired=cron_near)
    # lateness after the faults healed: the dead agent's lease outlives the etcd restart by a
    # TTL (etcd renews every lease when it comes back), a hand-over takes up to another TTL,
    # plus 2 s; and the firings that fell due during the last faults all become due at the
    # heal, so a firing due then waits for them: they start at the cluster's catch-up rate
    # (CATCH_UP_PER_S: one agent alone on this 2-core machine starts about 100 firings/s,
    # issue 18; three share the same cores). Hundreds of firings can fall due during the
    # last faults: 2 x TTL + 2 alone does not cover starting them.
    bound = 2 * ttl + 2 + backlog / CATCH_UP_PER_S
    print(f"lateness bound {bound:.1f} s ({backlog} firings due during the last faults)")
    rep = history.check(history.read_history(c.client, c.keys.prefix, contiguous=True), c.keys.prefix,
                        firings=firings, budget=budget, lateness_bound_s=bound, effective_due=effective,
                        affected=affected)
    print("history check:", {k: v for k, v in rep.stats.items() if k != "states"})
    history.assert_clean(rep)
    # the 'now' jobs too: one record each
    now_jobs = {f"j{i:04d}" for i in range(2000) if i % 10 == 8}
    got_now = collections.Counter(j for (j, _) in recs if j in now_jobs)
    assert set(got_now) == now_jobs and max(got_now.values()) == 1
    # no firing ever ran twice: at most one side effect per (job, firing)
    twice = [k for k, n in fx.items() if n > 1]
    assert not twice, f"ran twice: {twice[:5]}"
    # every record is final and consistent with the side effects
    states = collections.Counter(r["state"] for r in recs.values())
    lost = []
    for k, r in recs.items():
        assert r["state"] in ("succeeded", "failed", "misfired"), (k, r)
        if r["state"] == "succeeded":
            assert fx.get(k) == 1, (k, r)
        if r["state"] == "failed":
            assert r["reason"] == "owner_lost", json.dumps(r)
            lost.append(k)
    # firings of the cron jobs never repeat a fire id and follow the 5 s grid
    for (j, f) in recs:
        if j in cron_jobs:
            assert f.endswith(("0.000Z", "5.000Z")), f

    lost_at = collections.Counter(recs[k]["due"][11:19] for k in lost)
    print("\nowner_lost by due second:", sorted(lost_at.items()))
    print(f"\nrecords={len(recs)} states={dict(states)} owner_lost={len(lost)} side_effects={sum(fx.values())}")
    # owner_lost: the owner died or fenced itself while the run was in flight, so its end could
    # not be recorded; such a firing ran at most once (checked above) and is never re-run
    # with max_attempts=1. The count is a figure for the notes, not an invariant.
    for k in lost:
        assert fx.get(k, 0) <= 1
    # and each was one of those the faults caught in flight
    assert set(lost) <= caught, sorted(set(lost) - caught)[:5]


def test_retry_with_backoff(env):
    c, store, out, _ = env
    c.start("a0")
    wait_for(lambda: c.converged({"a0": 1}), 15, what="shards")
    store.create(job("flaky", {}, params={"sleep": "0", "code": "3"},
                     retry={"max_attempts": 3, "backoff_s": 0.5, "max_backoff_s": 5, "jitter": 0}))
    wait_records(c, lambda rs: any(v["state"] == "failed" for v in rs.values()), 20, "final failure")
    (rec,) = [v for v in c.run_records().values() if v["job_id"] == "flaky"]
    assert rec["attempt"] == 3 and rec["exit_code"] == 3
    lines = [l.split() for l in open(out)]
    attempts = [int(l[2]) for l in lines if l[0] == "flaky"]
    assert attempts == [1, 2, 3]


def test_timeout_kills_the_whole_process_tree(env):
    c, store, out, tmp = env
    c.start("a0")
    wait_for(lambda: c.converged({"a0": 1}), 15, what="shards")
    pidfile = str(tmp / "out" / "child.pid")
    store.create({"v": 1, "id": "hang", "template": "tree", "params": {"pidfile": pidfile}, "schedule": {},
                  "timeout_s": 1})
    wait_records(c, lambda rs: any(v["state"] == "timed_out" for v in rs.values()), 20, "timeout")
    child = int(open(pidfile).read().strip())
    wait_for(lambda: not os.path.exists(f"/proc/{child}") or
             open(f"/proc/{child}/stat").read().split()[2] == "Z", 5, what="child that ignores SIGTERM to die")


@pytest.mark.parametrize("policy", ["forbid", "replace"])
def test_overlap_policies(env, policy):
    c, store, out, _ = env
    c.start("a0")
    wait_for(lambda: c.converged({"a0": 1}), 15, what="shards")
    store.create(job("slow", {"cron": "*/2 * * * * *"}, params={"sleep": "3", "code": "0"}, overlap=policy,
                     not_after=format_rfc3339(now() + timedelta(seconds=9))))
    time.sleep(12)
    recs = [r for r in c.run_records().values() if r["job_id"] == "slow"]
    states = collections.Counter(r["state"] for r in recs)
    if policy == "forbid":
        assert states["misfired"] >= 1 and all(r["reason"] == "overlap" for r in recs if r["state"] == "misfired")
        assert states["succeeded"] >= 1
    else:
        assert states["killed"] >= 1, states
        assert all(r["reason"].startswith("replaced") for r in recs if r["state"] == "killed")


def test_depends_on_chain_across_shards(env):
    c, store, out, _ = env
    c.start("a0")
    c.start("a1")
    wait_for(lambda: c.converged({"a0": 1, "a1": 1}), 15, what="shards")
    ids = ["chain-a", "chain-b", "chain-c"]
    assert len({shard_of(i, c.shards) for i in ids}) > 1
    t = now()
    store.create(job("chain-c", {}, depends_on=["chain-b"], issued_at=format_rfc3339(t)))
    store.create(job("chain-b", {}, depends_on=["chain-a"], issued_at=format_rfc3339(t)))
    store.create(job("chain-a", {"delay_s": 2}, issued_at=format_rfc3339(t), params={"sleep": "1", "code": "0"}))
    wait_records(c, lambda rs: sum(1 for v in rs.values() if v["state"] == "succeeded") == 3, 30, "chain")
    by = {r["job_id"]: r for r in c.run_records().values()}
    assert by["chain-a"]["ended_at"] <= by["chain-b"]["started_at"] <= by["chain-b"]["ended_at"] <= by["chain-c"]["started_at"]


def test_misfire_policies_for_firings_missed_while_no_agent_owned_the_shard(env):
    c, store, out, _ = env
    start = now()
    na = format_rfc3339(start + timedelta(seconds=60))
    store.create(job("m-once", {"cron": "* * * * * *"}, misfire="run_once", not_after=na))
    store.create(job("m-skip", {"cron": "* * * * * *"}, misfire="skip", not_after=na))
    store.create(job("m-all", {"cron": "* * * * * *"}, misfire="run_all", misfire_limit=3, not_after=na))
    store.create(job("at-skip", {"at": format_rfc3339(start + timedelta(seconds=1))}, misfire="skip"))
    store.create(job("at-once", {"at": format_rfc3339(start + timedelta(seconds=1))}, misfire="run_once"))
    time.sleep(5)  # nobody owns any shard: firings are missed
    c.start("a0")
    wait_for(lambda: c.converged({"a0": 1}), 15, what="shards")
    time.sleep(3)
    recs = c.run_records()

    from agent.jobs.schedule import parse_rfc3339

    # a firing due before the first one the agent armed at the job's load (its `scheduled`
    # status's `due`) was missed: the shard's `acquired` audit record comes earlier, and a
    # firing due between the two is one the agent also counts as missed
    first_armed = {d["job_id"]: parse_rfc3339(d["due"]) for d in c.statuses("a0")
                   if d.get("state") == "scheduled" and d.get("job_id", "").startswith("m-")}
    assert set(first_armed) == {"m-once", "m-skip", "m-all"}, first_armed
    missed = lambda r: parse_rfc3339(r["due"]) < first_armed[r["job_id"]]
    caught_up = lambda j: [r for (jj, f), r in recs.items() if jj == j and r["state"] != "misfired" and missed(r)]
    assert len(caught_up("m-once")) == 1
    assert len(caught_up("m-skip")) == 0
    assert len(caught_up("m-all")) == 3
    at = {r["job_id"]: r for r in recs.values() if r["job_id"].startswith("at-")}
    assert at["at-skip"]["state"] == "misfired" and at["at-skip"]["reason"] == "misfire_skip"
    assert at["at-once"]["state"] == "succeeded"
    # and the cron jobs keep firing on time afterwards
    on_time = [r for (j, f), r in recs.items() if j == "m-skip" and r["state"] == "succeeded" and not missed(r)]
    assert on_time


def test_cancel_stops_future_firings(env):
    c, store, out, _ = env
    c.start("a0")
    wait_for(lambda: c.converged({"a0": 1}), 15, what="shards")
    store.create(job("to-cancel", {"cron": "* * * * * *"}))
    wait_records(c, lambda rs: any(k[0] == "to-cancel" for k in rs), 10, "first firing")
    store.cancel("to-cancel")
    # from the moment the agent has seen the cancel (its audit says so), nothing new fires;
    # waiting for that, not a fixed 1.5 s, keeps the test right on a loaded machine
    wait_for(lambda: any(r.get("event") == "cancelled" and r.get("job") == "to-cancel" for r in c.audit()), 30,
             interval=0.05, what="the agent to see the cancel")
    n = len([k for k in c.run_records() if k[0] == "to-cancel"])
    time.sleep(2.5)
    assert len([k for k in c.run_records() if k[0] == "to-cancel"]) == n


def test_firing_is_claimed_ahead_and_released_at_its_due_time_and_a_cancel_in_between_runs_nothing(
        etcd_server, tmp_path):
    """execute.claim_lead_s: the run record is written and the process prepared ahead of the
    due time; the job execs at the due time, not before. A cancel between the claim and the
    due time discards the prepared process: the job never runs."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    os.chmod(out_dir, 0o777)
    stamp = {"early": str(out_dir / "early"), "dropped": str(out_dir / "dropped")}
    tpl = {name: {"argv": ["/bin/sh", "-c", 'date +%s.%N > "$0"', path], "user": "root", "allow_root": True,
                  "allow_exec": ["/bin/*", "/usr/bin/*"]} for name, path in stamp.items()}
    c = Cluster(etcd_server, str(tmp_path / "agents"), ttl=4, renew_deadline=2.5, retry_period=0.5,
                extra={"templates": tpl, "execute": {"claim_lead_s": 1.5}})
    try:
        store = c.job_store()
        c.start("a0")
        wait_for(lambda: c.converged({"a0": 1}), 15, what="shards")
        due = now() + timedelta(seconds=4)
        for name in stamp:
            store.create({"v": 1, "id": name, "template": name, "params": {}, "schedule": {"at": format_rfc3339(due)}})
        wait_records(c, lambda rs: {k[0] for k in rs} == set(stamp), 10, "both firings claimed")
        assert now() < due, "claimed ahead of the due time"
        assert {r["state"] for r in c.run_records().values()} == {"running"}
        assert not any(os.path.exists(p) for p in stamp.values()), "nothing ran before the due time"
        store.cancel("dropped")
        wait_records(c, lambda rs: {r["job_id"]: r["state"] for r in rs.values()} ==
                     {"early": "succeeded", "dropped": "cancelled"}, 15, "the run and the cancel")
        ran_at = float(open(stamp["early"]).read())
        assert ran_at >= due.timestamp() - 0.01, (ran_at, due.timestamp())
        from agent.jobs.schedule import parse_rfc3339

        final = {r["job_id"]: r for r in c.run_records().values()}
        started = parse_rfc3339(final["early"]["started_at"]).timestamp()
        assert due.timestamp() - 0.01 <= started <= ran_at   # the real release, not the claim's plan
        assert final["dropped"]["started_at"] is None         # never released
        # the agent stops: its prepared process loses its go pipe and can never run (the
        # launcher exits 126 without exec), and its audit log is complete; only then is
        # the absence of the dropped job's side effect and run_start final
        c.agents["a0"].terminate(timeout=30)
        assert not os.path.exists(stamp["dropped"])
        audit = []
        for path in sorted((tmp_path / "agents").rglob("audit-*.jsonl")):
            audit += [json.loads(l) for l in open(path) if l.strip()]
        starts = [r["job"] for r in audit if r.get("type") == "job" and r.get("event") == "run_start"]
        assert starts == ["early"]   # the discarded one never started
    finally:
        c.close()


# --------------------------------------------------------------------------- trust (issue 16)


def _metric(port: int, name: str, labels: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}}}"):
            return float(line.split()[-1])
    return 0.0


def test_jobs_written_into_etcd_unsigned_forged_or_for_another_cluster_never_run(env):
    """Acceptance 1: each case gives a status, a metric and an audit record, and never runs;
    a properly signed job next to them runs."""
    from tests.support.cloudkit import SigningStore
    from agent.demo.services import free_port

    c, store, out, tmp = env
    port = free_port()
    a = c.start("a0", extra={"metrics": {"listen": f"127.0.0.1:{port}"}})
    wait_for(lambda: c.converged({"a0": 1}), 15, what="shards")
    raw = JobStore(c.client, c.keys, c.shards, "intruder")   # anyone who can write etcd
    t = now()
    base = lambda jid: {**job(jid, {}), "cluster": c.cluster, "kind": "job", "issued_at": format_rfc3339(t)}
    forged = store.sign(base("forged"))
    forged["params"]["code"] = "7"                      # edited after signing
    bad = {"unsigned": base("unsigned"), "forged": forged,
           "foreign": SigningStore(raw, c.ring, "plant-b").sign({**base("foreign"), "cluster": "plant-b"})}
    reasons = {"unsigned": "unsigned", "forged": "bad_signature", "foreign": "wrong_cluster"}
    for doc in bad.values():
        raw.create(doc)
    store.create(job("control", {}))
    wait_records(c, lambda rs: any(k[0] == "control" and r["state"] == "succeeded" for k, r in rs.items()),
                 20, "the signed job ran")

    def reported():
        got = {d["job_id"]: d for d in agent_statuses(a) if d.get("state") == "rejected"}
        return set(bad) <= set(got) and got

    got = wait_for(reported, 15, interval=0.2, what="a rejected status per bad document")
    time.sleep(1.0)
    assert {k[0] for k in c.run_records()} == {"control"}      # no run record for any of them
    assert set(effects(out)) == {k for k in effects(out) if k[0] == "control"}
    for jid, reason in reasons.items():
        assert got[jid]["reason"] == reason and got[jid]["source"] == "store", got[jid]
        assert _metric(port, "millwright_jobs_rejected_stored_total", f'reason="{reason}"') >= 1
    recs = [r for r in c.audit() if r.get("type") == "job" and r.get("event") == "rejected_stored"]
    assert {r["job"]: r["reason"] for r in recs} == reasons
    # a restart re-verifies at load: still never run, reported again by the new incarnation
    a.kill()
    c.start("a0")
    wait_for(lambda: c.converged({"a0": 1}), 20, what="shards after restart")
    time.sleep(2.0)
    assert {k[0] for k in c.run_records()} == {"control"}


def test_retired_key_keeps_its_jobs_until_the_date_then_stops_them(env, tmp_path):
    """Key rotation: a job signed by a key with retired_after runs until then, then stops
    with status rejected / key_retired; jobs of the current key carry on."""
    import yaml

    from tests.support.cloudkit import SigningStore
    from agent.jobs.signing import KeyRing, generate_hmac_secret

    c, store, out, tmp = env
    retire_at = now().replace(microsecond=0) + timedelta(seconds=20)  # room for a slow start under load
    keys = {"old": {"alg": "hmac-sha256", "secret": generate_hmac_secret(),
                    "retired_after": format_rfc3339(retire_at)},
            "new": {"alg": "hmac-sha256", "secret": generate_hmac_secret()}}
    (tmp_path / "signing").mkdir()   # a directory of its own: runs must not reach it (hiding.py)
    path = str(tmp_path / "signing" / "rotating-keys.yaml")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        yaml.safe_dump(keys, fh)
    ring = KeyRing.load(path)
    a = c.start("a0", extra={"signing": {"keys_file": path}})
    wait_for(lambda: c.converged({"a0": 1}), 15, what="shards")
    SigningStore(store.store, ring, c.cluster, kid="old").create(job("by-old", {"cron": "* * * * * *"}))
    SigningStore(store.store, ring, c.cluster, kid="new").create(job("by-new", {"cron": "* * * * * *"}))
    wait_records(c, lambda rs: any(k[0] == "by-old" and r["state"] == "succeeded" for k, r in rs.items()),
                 max(1.0, (retire_at - now()).total_seconds() - 1), "a run of the old key's job before its retirement")
    wait_for(lambda: now() > retire_at + timedelta(seconds=3), 30, interval=0.2, what="past the retirement")
    recs = c.run_records()
    old_dues = sorted(r["due"] for (j, _), r in recs.items() if j == "by-old")
    new_dues = sorted(r["due"] for (j, _), r in recs.items() if j == "by-new")
    assert old_dues, "ran before the retirement"
    assert max(old_dues) < format_rfc3339(retire_at + timedelta(seconds=1)), old_dues
    assert max(new_dues) > format_rfc3339(retire_at + timedelta(seconds=1)), new_dues
    st = [d for d in agent_statuses(a) if d.get("job_id") == "by-old" and d.get("state") == "rejected"]
    assert st and st[-1]["reason"] == "key_retired" and "retired" in st[-1]["detail"]
