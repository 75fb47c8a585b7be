"""Issue 34, acceptance 3 (statuses), after issue 50 (one connection per agent): a gateway
floods the cluster with 10,000 large statuses, fake `accepted` and `failed` answers about
another agent's jobs among them, under its own prefix (all the shipped broker ACL lets it
write). No agent receives any of them: agents read no other agent's statuses, so what
an agent knows of another's answers is etcd alone. That agent dies with its answers
undelivered (never handed to the broker): the shard's new owner publishes every one, rebuilt
from etcd, unmarked, the fakes notwithstanding. (The ingest figure under such a flood is
bench/bench_ingest.py --flood.) Real agents, etcd and mosquitto."""

from __future__ import annotations

import json
import os
import time

import pytest

from agent.cloud.mqtt import MqttLink
from agent.config import MqttConfig
from agent.coordination.keys import shard_of
from agent.daemon.admin import query
from tests.support.cloud import T, CloudWorld, Pusher
from tests.support.cloudkit import TEMPLATES, job_doc, signed
from tests.support.waiting import wait_for

SHARDS = 8
FLOOD = 10000
FAIL = {"argv": ["/bin/sh", "-c", "echo boom >&2; exit 3"], "params": {}, "user": "root", "allow_root": True,
        "allow_exec": ["/bin/sh", "/bin/dash", "/usr/bin/dash"]}


@pytest.fixture
def world(etcd_server, mosquitto_server, tmp_path):
    w = CloudWorld(etcd_server, mosquitto_server, tmp_path, {**TEMPLATES, "fail": FAIL}, SHARDS)
    yield w
    w.close()


def _ids_on(owners: dict, agent: str, prefix: str, n: int) -> list[str]:
    out, i = [], 0
    while len(out) < n:
        j = f"{prefix}-{i}"
        if owners[shard_of(j, SHARDS)] == agent:
            out.append(j)
        i += 1
    return out


def flood(url: str, fakes: list[dict], n: int, agent: str = "gw") -> int:
    """``n`` statuses from the gateway ``agent`` under its own prefix, QoS 1, as fast as the
    broker takes them: the fakes in turn, padded to 8 KiB, every tenth 40 KiB. Returns the bytes sent."""
    link = MqttLink(MqttConfig(url=url), "gw-flood", clean_session=True, max_inflight=200,
                    reconnect_min_s=0.2, reconnect_max_s=1.0)
    link.start()
    assert link.wait_connected(10)
    sent = 0
    try:
        for i in range(n):
            fake = dict(fakes[i % len(fakes)], seq=i, pad="x" * (40000 if i % 10 == 0 else 8000))
            payload = json.dumps(fake).encode()
            while link.publish(T.status(fake["job_id"], agent), payload, 1)[0] != 0:
                time.sleep(0.01)
            sent += len(payload)
        assert link.publish_wait(T.status("last", agent), b"{}", 1, timeout=60)
    finally:
        link.stop()
    return sent


def test_a_gateways_status_flood_reaches_no_agent_and_drops_no_owed_answer(world):
    world.cluster.env = {"MILLWRIGHT_TEST_HOLD_OUTBOX": "1"}   # a1 answers nothing: every answer stays owed
    a1 = world.cluster.start("a1")
    world.cluster.env = {}
    a2 = world.cluster.start("a2")
    wait_for(lambda: world.cluster.converged({"a1": 1.0, "a2": 1.0}), 40, what="two agents share the shards")
    assert world.col.wait(lambda m: any(t == T.presence("a2") and d.get("state") == "online" for _, t, d in m), 30)
    owners = world.cluster.owners()
    ids = _ids_on(owners, "a1", "owed", 40)
    run_job = _ids_on(owners, "a1", "owed-run", 1)[0]
    pusher = Pusher(world.mq.url, "flood-pusher")
    try:
        for j in ids:
            pusher.push(signed(job_doc(j), world.ring))
        doc = job_doc(run_job, template="fail")
        doc["params"], doc["schedule"] = {}, {}
        pusher.push(signed(doc, world.ring))

        def final_record():
            recs = list(world.cluster.job_runs(run_job).values())
            return recs and recs[-1]["state"] == "failed" and recs[-1]
        rec = wait_for(final_record, 60, what="the run's final record")
        keys = world.cluster.keys
        wait_for(lambda: sum(len(world.cluster.client.get_prefix(keys.answers_prefix(s))[0]) for s in range(SHARDS))
                 >= len(ids) + 2, 30, what="a1's owed answers in etcd")
        assert not [d for d in world.col.docs() if d.get("job_id") in set(ids) | {run_job}]  # all held by a1

        # the gateway's fakes: "a1 delivered these" (they name a1, on the gateway's topic)
        fakes = [{"v": 1, "job_id": j, "run_id": None, "state": "accepted", "agent": "a1", "push_sha256": "0" * 16,
                  "ts": rec["ended_at"]} for j in ids]
        fakes.append({"v": 1, "job_id": run_job, "run_id": f"{rec['fire_id']}.{rec['attempt']}",
                      "fire_id": rec["fire_id"], "state": "succeeded", "agent": "a1",
                      "exit_code": 0, "ts": rec["ended_at"]})
        fakes.append(dict(fakes[-1], state="failed", exit_code=3))
        # the gateway is a member as far as etcd says (forged or real): still nobody reads it
        world.cluster.client.put(world.cluster.keys.member("gw"), json.dumps({"capacity": 1.0, "available": False}))
        t0 = time.monotonic()
        sent = flood(world.mq.url, fakes, FLOOD)
        flood_s = time.monotonic() - t0
        a1.kill()
        t_kill = time.monotonic()

        owed = {(j, "accepted") for j in ids + [run_job]} | {(run_job, "failed")}

        def owed_published():
            got = {(d["job_id"], d["state"]): d for _, t, d in world.col.messages
                   if T.agent_of(t) == "a2" and d.get("published_by") == "a2" and (d.get("job_id"), d.get("state")) in owed}
            return set(got) == owed and got
        got = wait_for(owed_published, 60, what="every owed answer published by the new owner")
        took = time.monotonic() - t_kill
        for j in ids + [run_job]:
            d = got[(j, "accepted")]
            assert d["agent"] == "a1" and "redelivery" not in d and d.get("push_sha256") != "0" * 16, d
            assert d["answer"] == "accepted", d
        d = got[(run_job, "failed")]
        assert (d["exit_code"], d["fire_id"], d["agent"]) == (3, rec["fire_id"], "a1") and "boom" in d["stderr_tail"]
        assert d["answer"] == "run." + rec["fire_id"], d
        unmarked = [d for _, t, d in world.col.messages if T.kind(t) == "status" and T.agent_of(t) != "gw"
                    and (d.get("job_id"), d.get("state")) in owed and not d.get("redelivery")]
        assert len(unmarked) == len(owed), len(unmarked)  # exactly one first answer each
        assert a2.alive()
        cloud = query(os.path.join(a2.dir, "admin.sock"))["cloud"]
        assert cloud["statuses_received"] == 0, cloud   # none of the flood, nor any agent's status
        print(f"\ngateway flood: {FLOOD} statuses, {sent / 1e6:.0f} MB in {flood_s:.1f}s, none received by a2; "
              f"a1 kill -9'd after it; all {len(owed)} owed answers published by a2 {took:.2f}s after the kill; "
              f"load {os.getloadavg()[0]:.1f}")
    finally:
        pusher.stop()
