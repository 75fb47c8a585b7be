"""Production gates on a real agent, etcd and mosquitto (issue 37, acceptance 2): a due
firing waits while its gate (a retained MQTT topic, an etcd key) is closed and starts
within 1 s of it opening; gate_timeout and gate_closed end runs with those outcomes and
statuses; each change and decision is an audit record. And the threat model
(docs/security.md): a forged or unauthenticated gate value cannot start a job outside
its window, nor anything a signed job does not ask for."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timedelta, timezone

import pytest

from agent.coordination.jobstore import JobStore
from agent.runtime.timefmt import format_rfc3339, parse_rfc3339
from tests.support import history
from tests.support.cloud import CloudWorld, Pusher, wait_agent_connected
from tests.support.cloudkit import SigningStore
from tests.support.commands import millwright
from tests.support.jobs import effects_file
from tests.support.records import agent_audit
from tests.support.waiting import wait_for

EFFECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs", "effect.sh")
TOPIC = "plant/line2/state"
KEY = "gates/line2"
OPEN_WITHIN_S = 1.0   # the contract: a due firing starts within 1 s of its gate opening


def templates(out: str) -> dict:
    fx = {"argv": [EFFECT, out, "a1", "{sleep}", "0"], "params": {"sleep": r"^[0-9.]+$"}, "user": "root",
          "allow_root": True, "allow_exec": ["/bin/*", "/usr/bin/*", EFFECT]}
    mqtt = {"line": {"mqtt": TOPIC, "equals": "stopped"}}
    etcd = {"line": {"etcd": KEY, "equals": "open"}}
    return {"by_mqtt": {**fx, "gates": mqtt}, "by_etcd": {**fx, "gates": etcd},
            "timed": {**fx, "gates": mqtt, "gate_timeout_s": 3},
            "guarded": {**fx, "gates": etcd, "while_running": "stop"}}


@pytest.fixture
def world(etcd_server, mosquitto_server, tmp_path):
    out = effects_file(tmp_path)
    w = CloudWorld(etcd_server, mosquitto_server, tmp_path, templates(out), 8)
    w.out = out
    w.store = SigningStore(JobStore(w.cluster.client, w.cluster.keys, 8, "test"), w.ring, "t")
    w.plc = Pusher(mosquitto_server.url, client_id="plc-line2")   # the line's own publisher of its state
    yield w
    w.plc.stop()
    w.close()


def set_mqtt(w, value: str) -> float:
    t = time.time()
    w.plc.link.publish(TOPIC, value.encode(), qos=1, retain=True)
    return t


def set_etcd(w, value: str) -> float:
    t = time.time()
    w.cluster.client.put(w.cluster.keys.prefix + KEY, value)
    return t


def job(job_id: str, template: str, sleep: str = "0", **kw) -> dict:
    d = {"v": 1, "id": job_id, "template": template, "params": {"sleep": sleep}, "schedule": {}, "timeout_s": 120}
    d.update(kw)
    return d


def statuses(w, job_id: str, state: str = None) -> list[dict]:
    return [d for d in w.col.docs(state) if d.get("job_id") == job_id]


def starts(w, job_id: str) -> list[float]:
    try:
        return [e.start for e in history.parse_effects(w.out) if e.job == job_id]
    except history.HistoryError:
        return []


@pytest.mark.parametrize("kind", ["mqtt", "etcd"])
def test_a_due_firing_waits_for_its_gate_and_starts_within_a_second_of_it_opening(world, kind):
    flip = {"mqtt": set_mqtt, "etcd": set_etcd}[kind]
    flip(world, "running" if kind == "mqtt" else "closed")
    world.cluster.start("a1")
    wait_agent_connected(world.col, "a1")
    jid = f"held-{kind}"
    world.store.create(job(jid, f"by_{kind}"))
    assert world.col.wait(lambda m: statuses(world, jid, "waiting"), 20)
    (w,) = statuses(world, jid, "waiting")
    # held either way: the gate's value may not have reached the agent yet (unknown holds too)
    assert w["reason"] == "gate:line" and ("closed" in w["detail"] or "unknown" in w["detail"]), w
    # jobs show (etcd alone) says what it waits for
    shown = millwright("jobs", "show", jid, "--json", "-c", world.cluster.agents["a1"].config_path)
    assert shown.returncode == 0, shown.stderr
    view = json.loads(shown.stdout)
    assert (view["state"], view["reason"]) == ("waiting", "gate:line"), view
    time.sleep(2)
    assert starts(world, jid) == []   # still held
    t_open = flip(world, "stopped" if kind == "mqtt" else "open")
    wait_for(lambda: starts(world, jid), 10, interval=0.05, what="the run starts")
    (started,) = starts(world, jid)
    assert 0 <= started - t_open <= OPEN_WITHIN_S, started - t_open
    audit = [r for r in agent_audit(world.cluster.agents["a1"]) if r.get("type") == "gate"]
    events = [r.get("event") for r in audit]
    assert "waits" in events and "released" in events and events.count("changed") >= 1
    shown = json.loads(millwright("jobs", "show", jid, "--json", "-c",
                                  world.cluster.agents["a1"].config_path).stdout)
    assert shown["state"] != "waiting"


def test_gate_timeout_and_gate_closed_end_with_those_outcomes_and_statuses(world):
    set_mqtt(world, "running")
    set_etcd(world, "open")
    world.cluster.start("a1")
    wait_agent_connected(world.col, "a1")
    world.store.create(job("times-out", "timed"))
    world.store.create(job("guarded", "guarded", sleep="30"))
    wait_for(lambda: starts(world, "guarded"), 20, interval=0.1, what="the guarded run starts")
    t_close = set_etcd(world, "closed")

    def final(job_id):
        recs = world.cluster.job_runs(job_id)
        return next((r for r in recs.values() if r["state"] not in ("running", "retrying")), None)

    timed = wait_for(lambda: final("times-out"), 30, interval=0.2, what="gate_timeout")
    assert (timed["state"], timed["reason"]) == ("failed", "gate_timeout") and timed["started_at"] is None
    assert starts(world, "times-out") == []
    guarded = wait_for(lambda: final("guarded"), 30, interval=0.2, what="gate_closed")
    assert (guarded["state"], guarded["reason"]) == ("killed", "gate_closed")
    assert parse_rfc3339(guarded["ended_at"]).timestamp() - t_close <= 1.0 + 1.0 + 1.0   # seen, SIGTERM, kill_grace_s
    assert world.col.wait(lambda m: statuses(world, "times-out", "failed") and statuses(world, "guarded", "killed"), 20)
    assert statuses(world, "times-out", "failed")[0]["reason"] == "gate_timeout"
    assert statuses(world, "guarded", "killed")[0]["reason"] == "gate_closed"
    events = {r.get("event") for r in agent_audit(world.cluster.agents["a1"]) if r.get("type") == "gate"}
    assert {"gate_timeout", "stop", "changed"} <= events


@pytest.mark.parametrize("kind", ["mqtt", "etcd"])
def test_a_forged_gate_value_cannot_start_a_job_outside_its_window(world, mosquitto_server, kind):
    """Anyone who can publish the topic (here an anonymous client) or write the key opens
    the gate; the job still starts only inside its signed window."""
    world.cluster.start("a1")
    wait_agent_connected(world.col, "a1")
    opens = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(seconds=8)
    window = [{"start": format_rfc3339(opens), "end": format_rfc3339(opens + timedelta(seconds=30))}]
    jid = f"windowed-{kind}"
    world.store.create(job(jid, f"by_{kind}", window=window))
    if kind == "mqtt":
        forger = Pusher(mosquitto_server.url, client_id="anonymous-forger")
        forger.link.publish(TOPIC, b"stopped", qos=1, retain=True)
        forger.stop()
    else:
        set_etcd(world, "open")
    assert world.col.wait(lambda m: statuses(world, jid, "waiting"), 10)
    assert statuses(world, jid, "waiting")[0]["reason"] == "window"
    wait_for(lambda: starts(world, jid), 30, interval=0.1, what="the run in its window")
    (started,) = starts(world, jid)
    assert started >= opens.timestamp()
