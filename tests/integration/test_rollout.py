"""Staged fleet rollouts on real agents, etcd and mosquitto (issue 38, acceptance 1, 2, 4).

A fan-out job runs once on every line-1 agent; its ``rollout`` stages those runs through
etcd alone. What the runs did is judged by their own side effects (tests/jobs/effect.sh,
one clock: the host's) and by the whole etcd history: every start key was created before
the outcome that crossed the abort threshold, whatever was killed or cut off meanwhile.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from agent.coordination.etcd import KV
from agent.coordination.keys import shard_of
from agent.jobs import rollout as ro
from agent.jobs.schedule import fire_id, format_rfc3339
from tests.support import history
from tests.support.cloudkit import StatusCollector
from tests.support.cluster import Cluster
from tests.support.commands import millwright
from tests.support.jobs import now
from tests.support.rollouts import Fleet, running_at_once
from tests.support.waiting import wait_for

LINE1 = tuple(f"l1-{i:02d}" for i in range(10))


def pid_of(out: str, job_id: str, agent: str) -> int:
    """The pid of ``agent``'s run of ``job_id`` as its start line says."""
    with open(out) as fh:
        for line in fh:
            p = line.split()
            if p[0] == "start" and p[1] == job_id and p[4] == agent and "+" not in p[2]:
                return int(p[5])
    raise AssertionError(f"no side effect of {agent}")


def gone_at(pid: int) -> float:
    """When process ``pid`` was first seen gone (host clock, polled)."""
    def gone():
        try:
            os.kill(pid, 0)
            return None
        except ProcessLookupError:
            return time.time()
    return wait_for(gone, 30, interval=0.005, what=f"process {pid} gone")


def rollout_history(c: Cluster, job_id: str, spec: ro.RolloutSpec) -> dict:
    """Replays etcd's history of the job's rollout keys (every agent's): each start (agent
    -> the revision of the state it was judged on, and its key's document), and the
    revision of the outcome that crossed the abort threshold (None: never)."""
    events = history.read_history(c.client, c.keys.prefix, contiguous=True)
    jr = ro.JobRollout()
    starts, crossed, mark, base = {}, None, None, None
    for ev in events:
        where = c.keys.split_rollout_key(ev.key)
        if where is None or where[2] != job_id:
            continue
        agent, _, _, rel = where
        if rel == "aborted":
            mark = mark or ev.rev
            continue
        base = base or rel.partition("/")[0]
        if rel.endswith("/start") and ev.kind == "put" and ev.version == 1:
            doc = json.loads(ev.value)
            starts[agent] = (doc["judged_at"], doc)
        if rel.endswith(("/outcome", "/start")) and ev.kind == "put":
            jr.put(agent, rel, KV(ev.key, ev.value, ev.create_rev, ev.rev, ev.version, 0))
            if crossed is None and ro.crossed(spec, ro.tally(spec, jr.firing(base))):
                crossed = ev.rev
    return {"starts": starts, "crossed": crossed, "mark": mark, "base": base}


@pytest.fixture
def broker(mosquitto_server):
    return mosquitto_server


def test_rollout_of_ten_agents_aborts_after_the_threshold_through_a_kill_and_a_broker_outage(etcd_server, broker,
                                                                                            tmp_path):
    """Acceptance 1: 10 line-1 agents, a fan-out job failing on 4 of them, max_concurrent 2,
    abort at 30 % after 4 finished; one agent is killed -9 mid-run and restarted, the
    broker is down for 20 s meanwhile."""
    failing = {"l1-01", "l1-04", "l1-06", "l1-08"}
    fleet = Fleet(etcd_server, tmp_path, failing, mqtt_url=broker.url)
    col = StatusCollector(broker.url, "t").start()
    try:
        for a in LINE1:
            fleet.start(a)
        wait_for(lambda: fleet.c.members() == set(LINE1), 60, what="10 members")
        rollout = {"max_concurrent": 2, "abort": {"failed_pct": 30, "min_finished": 4}}
        fleet.push("fw-1", rollout, sleep="2")
        # kill -9 an agent while its run runs, then bring it back
        victim = wait_for(lambda: next((r["agent"] for r in fleet.records("fw-1").values()
                                        if r["state"] == "running"), None), 60, interval=0.05, what="a running run")
        pid = wait_for(lambda: pid_of(fleet.out, "fw-1", victim), 30, errors=(AssertionError, OSError),
                       what="the victim's side effect")
        fleet.c.agents[victim].kill()
        died = {victim: gone_at(pid)}
        broker.stop()
        time.sleep(5)
        fleet.start(victim)
        time.sleep(15)
        broker.start()
        wait_for(lambda: set(fleet.finals("fw-1")) == set(LINE1), 120, interval=0.5,
                 what="a final record on every agent")
        finals = fleet.finals("fw-1")
        assert all(r["state"] in ("succeeded", "failed", "aborted") for r in finals.values()), \
            {a: (r["state"], r.get("reason")) for a, r in finals.items()}
        assert finals[victim]["state"] == "failed" and finals[victim]["reason"] == "owner_lost"
        # the side effects never overlapped beyond max_concurrent
        effects = [se for se in history.parse_effects(fleet.out) if se.job == "fw-1"
                   and ro.rolled_back(se.fire_id) is None]
        assert running_at_once(effects, died) <= 2, sorted((se.agent, se.start, se.end) for se in effects)
        # the rollout aborted, and no start after the outcome that crossed the threshold
        spec = ro.RolloutSpec(max_concurrent=2, failed_pct=30.0, min_finished=4)
        h = rollout_history(fleet.c, "fw-1", spec)
        assert h["crossed"] is not None and h["mark"] is not None and h["mark"] > h["crossed"]
        # each start was judged on a state before the crossing outcome
        assert all(rev < h["crossed"] for rev, _ in h["starts"].values()), (h["crossed"], h["starts"])
        started = set(h["starts"])
        assert {se.agent for se in effects} == started
        assert {a for a, r in finals.items() if r["state"] == "aborted"} == set(LINE1) - started
        # exactly one final status per agent for its firing, on the broker
        def final_statuses() -> dict:
            """agent -> the final statuses of its firing of fw-1 the broker carried (a
            transport duplicate, same agent and seq, counts once)."""
            seen: dict = {}
            for d in col.docs():
                if d.get("job_id") == "fw-1" and d.get("fire_id") == f"{h['base']}@{d.get('agent')}" \
                        and d.get("state") in ("succeeded", "failed", "aborted", "timed_out", "killed", "cancelled"):
                    seen.setdefault(d["agent"], set()).add((d["state"], d.get("seq")))
            return seen
        wait_for(lambda: set(final_statuses()) == set(LINE1), 60, what="final statuses of every agent")
        seen = final_statuses()
        assert all(len(v) == 1 for v in seen.values()), {a: v for a, v in seen.items() if len(v) > 1}
        assert {a: next(iter(v))[0] for a, v in seen.items()} == {a: r["state"] for a, r in finals.items()}
        # rollback: once on every agent whose run ended
        ran = {a for a, r in finals.items() if r["state"] in ro.RUN_STATES}
        wait_for(lambda: {r["agent"] for fid, r in fleet.records("fw-1").items() if ro.rolled_back(fid)
                          and r["state"] == "succeeded"} == ran, 60, what="a rollback on each agent that ran")
        undo = [se for se in history.parse_effects(fleet.out) if ro.rolled_back(se.fire_id)]
        assert sorted(se.agent for se in undo) == sorted(ran)
        # jobs show: the job is aborted, and where each agent stands
        show = millwright("jobs", "show", "fw-1", "-c", fleet.c.agents[LINE1[0]].config_path, "--json")
        view = json.loads(show.stdout)
        assert view["state"] == "aborted" and view["rollout"]["aborted"]["fire"] == h["base"]
        assert {a: s["state"] for a, s in view["rollout"]["agents"].items()} == {a: r["state"] for a, r in finals.items()}
        assert {a for a, s in view["rollout"]["agents"].items() if s.get("rollback") == "succeeded"} == ran
        counts = view["rollout"]["counts"]
        assert (counts["started"], counts["aborted"], counts["waiting"]) == (len(started), 10 - len(started), 0)
        text = millwright("jobs", "show", "fw-1", "-c", fleet.c.agents[LINE1[0]].config_path).stdout
        assert "rollout   aborted" in text and f"{len(started)} started" in text, text
        history.assert_clean(history.check(history.read_history(fleet.c.client, fleet.c.keys.prefix,
                                                                contiguous=True), fleet.c.keys.prefix))
    finally:
        col.stop()
        fleet.close()


def earliest_starts(spec: ro.RolloutSpec, starts: list[float], successes: list[float]) -> list[float]:
    """When each start after the first may come at the earliest by the rollout: at least
    60/rate after the one before, the rate being the one the successes ended by then allow
    (side-effect clocks)."""
    out = []
    steps = sorted(successes)
    for prev in starts[:-1]:
        t = None
        for j in range(len(steps) + 1):
            since = steps[j - 1] if j else -float("inf")
            until = steps[j] if j < len(steps) else float("inf")
            rate = ro.rate(spec, j)
            assert rate is not None
            cand = max(since, prev + 60.0 / rate)
            if cand < until:
                t = cand
                break
        out.append(t)
    return out


def test_per_minute_with_growth_spaces_the_starts(etcd_server, tmp_path):
    """Acceptance 2: per_minute 12, doubled after every 2 successes: each start comes when
    the rate allows it, within 1 s, on the side effects' own clock."""
    agents = LINE1[:6]
    fleet = Fleet(etcd_server, tmp_path)
    try:
        for a in agents:
            fleet.start(a)
        wait_for(lambda: fleet.c.members() == set(agents), 60, what="6 members")
        rollout = {"per_minute": 12, "growth": {"factor": 2, "after_succeeded": 2}}
        fleet.push("fw-rate", rollout, sleep="1")
        wait_for(lambda: len(fleet.finals("fw-rate")) == len(agents), 120, interval=0.5, what="every agent ran")
        assert {r["state"] for r in fleet.finals("fw-rate").values()} == {"succeeded"}
        effects = sorted((se for se in history.parse_effects(fleet.out) if se.job == "fw-rate"),
                         key=lambda se: se.start)
        starts = [se.start for se in effects]
        spec = ro.RolloutSpec(per_minute=12.0, growth_factor=2.0, growth_after=2)
        expected = earliest_starts(spec, starts, [se.end for se in effects if se.end is not None])
        late = [(round(s - e, 3)) for s, e in zip(starts[1:], expected)]
        print(f"\nstarts after the earliest the rate allows (s): {late}")
        assert all(-1.0 <= d <= 1.0 for d in late), late
    finally:
        fleet.close()


def rollout_keys(c: Cluster) -> list[str]:
    """Every agent's rollout keys."""
    kvs, _ = c.client.get_prefix(c.keys.rollouts_prefix(), keys_only=True)
    return [kv.key for kv in kvs]


def test_an_aborted_rollout_and_its_keys_go_with_the_job(etcd_server, tmp_path):
    """Abort with stop and rollback on three agents; then retention turns the finished job
    into a tombstone and deletes every rollout key with its records, then the tombstone."""
    agents = LINE1[:3]
    fleet = Fleet(etcd_server, tmp_path, failing={agents[0]},
                  # finished_job_s: long enough for the later agents to start and see the job
                  # (a fan-out one-shot counts as finished from its first final record)
                  extra={"retention": {"interval_s": 0.2, "finished_job_s": 15, "tombstone_s": 2,
                                       "max_deletes_per_s": 500}})
    try:
        # the failing agent runs first and alone; its failure aborts the rollout before the
        # others join
        fleet.start(agents[0])
        wait_for(lambda: fleet.c.members() == {agents[0]}, 60, what="the first member")
        fleet.push("fw-ret", {"max_concurrent": 1, "abort": {"failed_pct": 50, "min_finished": 1}},
                   abort_action="stop", sleep="0.2")
        shard = shard_of("fw-ret", 4)
        wait_for(lambda: fleet.c.client.get(fleet.c.keys.rollout_aborted(agents[0], shard, "fw-ret")) is not None,
                 60, what="the abort mark")
        for a in agents[1:]:
            fleet.start(a)
        wait_for(lambda: set(fleet.finals("fw-ret")) == set(agents), 60, what="every agent final")
        finals = fleet.finals("fw-ret")
        assert finals[agents[0]]["state"] == "failed"
        assert {finals[a]["state"] for a in agents[1:]} == {"aborted"}
        wait_for(lambda: any(ro.rolled_back(fid) and r["state"] == "succeeded" and r["agent"] == agents[0]
                             for fid, r in fleet.records("fw-ret").items()), 30, what="the rollback of the failed run")
        assert rollout_keys(fleet.c)
        # retention: job -> tombstone (records, rollout keys go), tombstone -> nothing
        wait_for(lambda: not rollout_keys(fleet.c) and fleet.c.client.get(fleet.c.keys.job(shard, "fw-ret")) is None,
                 90, interval=0.2, what="the job and its rollout keys gone")
        assert fleet.records("fw-ret") == {}
    finally:
        fleet.close()


def test_forged_rollout_keys_hold_agents_back_and_never_start_one_early(etcd_server, tmp_path):
    """Rollout keys written by someone who can write etcd (here without RBAC) under an
    agent id of its own: a claim bound to no lease and a start key with an early time hold
    both agents back (seen: their waiting statuses), and once the claim is gone they start
    no earlier than the signed rate allows; an outcome rewritten after its creation counts
    as a failure and aborts."""
    agents = LINE1[:2]
    fleet = Fleet(etcd_server, tmp_path)
    c = fleet.c
    try:
        for a in agents:
            fleet.start(a)
        wait_for(lambda: c.members() == set(agents), 60, what="2 members")
        due = now().replace(microsecond=0)
        base = ro.base_of(fire_id_of(due))
        prefix = c.keys.rollout_firing("forger", shard_of("fw-forged", 4), "fw-forged", base)
        c.client.put(prefix + "claim", json.dumps({"agent": "forger", "fire_id": f"{base}@forger"}))
        c.client.put(prefix + "start", json.dumps({"agent": "forger", "fire_id": f"{base}@forger", "at": 0}))
        fleet.push("fw-forged", {"max_concurrent": 1, "per_minute": 6}, sleep="0.2", issued_at=format_rfc3339(due))

        def waiting(agent):
            return [d for d in c.statuses(agent) if d.get("job_id") == "fw-forged" and d.get("state") == "waiting"]
        wait_for(lambda: all(any("max_concurrent" in (d.get("detail") or "") or d.get("reason") == "rollout"
                                 for d in waiting(a)) for a in agents), 60, what="both agents waiting")
        wait_for(lambda: all(any(r.get("event") == "rollout_wait" for r in c.audit(a)) for a in agents), 30,
                 what="their wait audited")
        assert fleet.records("fw-forged") == {} and not [se for se in _effects(fleet) if se.job == "fw-forged"]
        c.client.delete(prefix + "claim")   # the operator removes what the forger wrote
        wait_for(lambda: len(fleet.finals("fw-forged")) == 2, 60, interval=0.2, what="both ran")
        runs = sorted((se for se in _effects(fleet) if se.job == "fw-forged"), key=lambda se: se.start)
        assert len(runs) == 2 and running_at_once(runs, {}) == 1
        # the forged start at time 0 counts at the due time: the first real start is one
        # spacing (10 s) after it, the second another spacing later
        spacing = 60 / 6
        assert runs[0].start >= due.timestamp() + spacing - 0.5, (runs[0].start - due.timestamp())
        assert runs[1].start >= runs[0].start + spacing - 0.5, (runs[1].start - runs[0].start)

        # an outcome rewritten after its creation is a failure: the rollout aborts at once
        due2 = now().replace(microsecond=0)
        base2 = ro.base_of(fire_id_of(due2))
        key = c.keys.rollout_firing("forger", shard_of("fw-forged-2", 4), "fw-forged-2", base2) + "outcome"
        good = json.dumps({"agent": "forger", "fire_id": f"{base2}@forger", "state": "succeeded"})
        c.client.put(key, good)
        c.client.put(key, good)
        fleet.push("fw-forged-2", {"max_concurrent": 1, "abort": {"failed_pct": 50, "min_finished": 1}},
                   sleep="0.2", issued_at=format_rfc3339(due2))
        wait_for(lambda: len(fleet.finals("fw-forged-2")) == 2, 60, what="both final")
        assert {r["state"] for r in fleet.finals("fw-forged-2").values()} == {"aborted"}
        assert not [se for se in _effects(fleet) if se.job == "fw-forged-2"]
    finally:
        fleet.close()


def fire_id_of(due) -> str:
    return fire_id("", due)


def _effects(fleet: Fleet) -> list:
    return history.parse_effects(fleet.out) if os.path.exists(fleet.out) else []


def test_abort_action_stop_stops_a_running_run_and_rolls_it_back(etcd_server, tmp_path):
    """One agent fails while another's long run runs: the abort stops that run (killed,
    reason aborted), and both agents run their rollback once."""
    fast, slow = LINE1[:2]
    fleet = Fleet(etcd_server, tmp_path, failing={fast}, slow={slow})
    try:
        for a in (fast, slow):
            fleet.start(a)
        wait_for(lambda: fleet.c.members() == {fast, slow}, 60, what="2 members")
        fleet.push("fw-stop", {"max_concurrent": 2, "abort": {"failed_pct": 50, "min_finished": 1}},
                   abort_action="stop", sleep="1")
        wait_for(lambda: len(fleet.finals("fw-stop")) == 2, 50, interval=0.2, what="both final")
        finals = fleet.finals("fw-stop")
        assert finals[fast]["state"] == "failed"
        assert (finals[slow]["state"], finals[slow]["reason"]) == ("killed", "aborted")
        run = next(se for se in _effects(fleet) if se.job == "fw-stop" and se.agent == slow and not ro.rolled_back(se.fire_id))
        assert run.end is None   # stopped before its 60 s were up
        wait_for(lambda: {r["agent"] for fid, r in fleet.records("fw-stop").items()
                          if ro.rolled_back(fid) and r["state"] == "succeeded"} == {fast, slow}, 30,
                 what="both rolled back")
        stops = [r for r in fleet.c.audit(slow) if r.get("event") == "rollout_stop"]
        assert len(stops) == 1 and stops[0]["fire_id"].endswith("@" + slow)
    finally:
        fleet.close()
