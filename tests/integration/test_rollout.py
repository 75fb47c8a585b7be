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
from agent.jobs import rollout as ro
from agent.jobs.schedule import format_rfc3339
from tests.support import history
from tests.support.cloudkit import StatusCollector
from tests.support.cluster import Cluster
from tests.support.jobs import JOBS, effects_file, now
from tests.support.waiting import wait_for

EFFECT = os.path.join(JOBS, "effect.sh")
LINE1 = tuple(f"l1-{i:02d}" for i in range(10))


def fw_templates(out: str, agent: str, fails: bool) -> dict:
    """`fw` records its side effect as ``agent`` and fails (exit 3) where ``fails``; its
    rollback `fw-undo` records one and succeeds."""
    base = {"params": {"sleep": r"^[0-9.]+$"}, "user": "root", "allow_root": True,
            "allow_exec": ["/bin/*", "/usr/bin/*", EFFECT]}
    return {"fw": {**base, "argv": [EFFECT, out, agent, "{sleep}", "2" if fails else "0"], "rollback": "fw-undo"},
            "fw-undo": {**base, "argv": [EFFECT, out, agent, "0", "0"]}}


class Fleet:
    """Line-1 agents (processes) of one cluster whose `fw` template fails on ``failing``."""

    def __init__(self, etcd, tmp_path, failing=(), mqtt_url: str = "mqtt://127.0.0.1:9"):
        self.out = effects_file(tmp_path)
        self.failing = set(failing)
        self.c = Cluster(etcd, str(tmp_path / "agents"), shards=4, ttl=4, renew_deadline=2.5, retry_period=0.5,
                         extra={"mqtt": {"url": mqtt_url, "reconnect_min_s": 0.2, "reconnect_max_s": 1.0},
                                "execute": {"max_concurrent": 4, "memory_mb": 4096, "cpu": 8.0, "kill_grace_s": 1.0}})
        self.store = self.c.job_store()

    def start(self, agent: str) -> None:
        self.c.start(agent, extra={"labels": {"line": "1"},
                                   "templates": fw_templates(self.out, agent, agent in self.failing)})

    def push(self, job_id: str, rollout: dict, sleep: str = "2", **extra) -> dict:
        doc = {"v": 1, "id": job_id, "template": "fw", "params": {"sleep": sleep}, "schedule": {},
               "issued_at": format_rfc3339(now()), "target": {"labels": {"line": "1"}, "fanout": True},
               "rollout": rollout, **extra}
        self.store.create(doc)
        return doc

    def records(self, job_id: str) -> dict[str, dict]:
        return self.c.job_runs(job_id)

    def finals(self, job_id: str) -> dict[str, dict]:
        """agent -> its main firing's record, once final."""
        return {r["agent"]: r for fid, r in self.records(job_id).items()
                if ro.rolled_back(fid) is None and r["state"] not in ("running", "retrying")}

    def close(self) -> None:
        self.c.close()


def running_at_once(effects: list, died: dict) -> int:
    """The most side effects of the job's main firing that ran at the same time, on their
    own clock (a run killed before its end line ends when its process was seen gone,
    ``died[agent]``; else it lasts until the end of the log)."""
    edges = []
    for se in effects:
        end = se.end if se.end is not None else died.get(se.agent, float("inf"))
        edges += [(se.start, 1), (end, -1)]
    most = cur = 0
    for _, d in sorted(edges, key=lambda x: (x[0], x[1])):
        cur += d
        most = max(most, cur)
    return most


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
    """Replays etcd's history of the job's rollout keys: the revision of each start key,
    and the revision of the outcome that crossed the abort threshold (None: never)."""
    events = history.read_history(c.client, c.keys.prefix, contiguous=True)
    fr = None
    starts, crossed, mark = {}, None, None
    for ev in events:
        if "/rollouts/" not in ev.key or f"/{job_id}/" not in ev.key:
            continue
        rel = ev.key.split(f"/{job_id}/", 1)[1]
        if rel == "aborted":
            mark = mark or ev.rev
            continue
        base, _, rest = rel.partition("/")
        if fr is None:
            fr = ro.FiringRollout(base)
        if rest.startswith("starts/") and ev.kind == "put" and ev.version == 1:
            starts[rest] = (ev.rev, json.loads(ev.value))
        if rest.startswith(("outcomes/", "starts/")) and ev.kind == "put":
            ro.JobRollout(firings={base: fr}).put(rel, KV(ev.key, ev.value, ev.create_rev, ev.rev, ev.version, 0))
            if crossed is None and ro.crossed(spec, ro.tally(spec, fr)):
                crossed = ev.rev
    return {"starts": starts, "crossed": crossed, "mark": mark, "base": fr.base if fr else None}


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
        assert all(rev < h["crossed"] for rev, _ in h["starts"].values()), (h["crossed"], h["starts"])
        started = {doc["agent"] for _, doc in h["starts"].values()}
        assert {se.agent for se in effects} == started
        assert {a for a, r in finals.items() if r["state"] == "aborted"} == set(LINE1) - started
        # exactly one final status per agent for its firing, on the broker
        def final_statuses() -> dict:
            """agent -> the final statuses of its firing of fw-1 the broker carried (a
            transport duplicate, same agent and seq, counts once)."""
            seen: dict = {}
            for d in col.docs():
                rid = d.get("run_id") or ""
                if d.get("job_id") == "fw-1" and rid == f"{h['base']}@{d.get('agent')}" \
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
        history.assert_clean(history.check(history.read_history(fleet.c.client, fleet.c.keys.prefix,
                                                                contiguous=True), fleet.c.keys.prefix))
    finally:
        col.stop()
        fleet.close()
