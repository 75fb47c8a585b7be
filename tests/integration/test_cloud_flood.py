"""Issue 34, acceptance 3 (statuses): a gateway floods the cluster with 10,000 large
statuses, fake `accepted` and `failed` answers about another agent's jobs among them, under
its own prefix (all the shipped broker ACL lets it write). That agent dies with its answers
undelivered. No owed answer is dropped: the shard's new owner publishes every one, rebuilt
from etcd, because an answer counts as delivered only under its writer's own prefix; the
flooding member is unsubscribed for a cool-off, and the connection an agent reads its peers'
statuses on (``mqtt.peers_username``) is cut, with what the broker had queued. A member that floods and dies with answers
it may have delivered gets them republished, marked ``redelivery``. (The
ingest figure under such a flood is bench/bench_ingest.py --flood.) Real agents, etcd and
mosquitto."""

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
    broker takes them: the fakes in turn, padded to 8 KiB, every tenth 40 KiB (over an
    agent's peer status cap). Returns the bytes sent."""
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


def test_a_gateways_status_flood_and_fake_answers_drop_no_owed_answer(world):
    world.cluster.env = {"MILLWRIGHT_TEST_HOLD_OUTBOX": "1"}   # a1 answers nothing: every answer stays owed
    a1 = world.cluster.start("a1")
    world.cluster.env = {}
    # a2 reads its peers' statuses on a link of its own (mqtt.peers_username)
    a2 = world.cluster.start("a2", extra={"mqtt": {"peers_username": "a2-peers"}})
    wait_for(lambda: world.cluster.converged({"a1": 1.0, "a2": 1.0}), 40, what="two agents share the shards")
    assert world.col.wait(lambda m: any(t == T.presence("a2") and d.get("state") == "online" for _, t, d in m), 30)
    time.sleep(1.5)  # a2 trusts "not seen" only for answers written 1 s after its subscription began
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
        # the gateway is a member as far as etcd says (forged or real): a2 reads its statuses
        world.cluster.client.put(world.cluster.keys.member("gw"), json.dumps({"capacity": 1.0, "available": False}))
        time.sleep(1.0)
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
        d = got[(run_job, "failed")]
        assert (d["exit_code"], d["fire_id"], d["agent"]) == (3, rec["fire_id"], "a1") and "boom" in d["stderr_tail"]
        unmarked = [d for _, t, d in world.col.messages if T.kind(t) == "status" and T.agent_of(t) != "gw"
                    and (d.get("job_id"), d.get("state")) in owed and not d.get("redelivery")]
        assert len(unmarked) == len(owed), len(unmarked)  # exactly one first answer each
        wait_for(lambda: any(r.get("event") == "peer_statuses_dropped" and r.get("agent") == "gw"
                             for r in world.cluster.audit("a2")), 30, what="a2's audit record of the gateway's drops")
        reasons = {r["reason"] for r in world.cluster.audit("a2") if r.get("event") == "peer_statuses_dropped"}
        assert "too_large" in reasons, reasons
        assert any(r.get("event") == "peer_statuses_unsubscribed" and r.get("agent") == "gw"
                   for r in world.cluster.audit("a2"))   # the broker stopped sending them for a while
        assert a2.alive()
        cloud = query(os.path.join(a2.dir, "admin.sock"))["cloud"]
        # the flood was cut with the peers connection: what the broker had queued of it went
        # with the clean session, unread (a cut comes after ~1 MiB of it, about 100 statuses)
        assert cloud["peers_link"]["cut"] >= 1 and cloud["peers_link"]["client_id"] == "a2-peers", cloud
        assert cloud["peer_statuses_received"] < FLOOD // 10, cloud
        print(f"\ngateway flood: {FLOOD} statuses, {sent / 1e6:.0f} MB in {flood_s:.1f}s; a1 kill -9'd after it; "
              f"all {len(owed)} owed answers published by a2 {took:.2f}s after the kill (dropped at a2: "
              f"{sorted(reasons)}; peers link cut {cloud['peers_link']['cut']}x, statuses received "
              f"{cloud['peer_statuses_received']}); load {os.getloadavg()[0]:.1f}")
    finally:
        pusher.stop()



def test_a_member_that_floods_and_dies_has_its_answers_republished_marked_redelivery(world):
    """a1 floods its own status topic (here the test's client writes there: the fixture's
    broker has no ACL), so a2 stops reading a1 for a cool-off; meanwhile a1 writes answers,
    hands them to the broker and dies. a2 cannot know they were not delivered and
    republishes each, marked ``redelivery`` (had it read a1 all along, or only missed some
    of its statuses before these answers, they would go out unmarked)."""
    world.cluster.env = {"MILLWRIGHT_TEST_HOLD_OUTBOX": "1"}
    a1 = world.cluster.start("a1")
    world.cluster.env = {}
    world.cluster.start("a2")
    wait_for(lambda: world.cluster.converged({"a1": 1.0, "a2": 1.0}), 40, what="two agents share the shards")
    assert world.col.wait(lambda m: any(t == T.presence("a2") and d.get("state") == "online" for _, t, d in m), 30)
    ids = _ids_on(world.cluster.owners(), "a1", "handed", 10)
    pusher = Pusher(world.mq.url, "flood-pusher")
    try:
        flood(world.mq.url, [{"v": 1, "job_id": "noise", "state": "running", "agent": "a1"}], 1000, agent="a1")
        wait_for(lambda: any(r.get("event") == "peer_statuses_unsubscribed" and r.get("agent") == "a1"
                             for r in world.cluster.audit("a2")), 30, what="a2 stops reading a1")
        time.sleep(1.2)  # past a2's margin for its last drop of a1's statuses: only the cool-off hides them
        for j in ids:
            pusher.push(signed(job_doc(j), world.ring))
        client, keys = world.cluster.client, world.cluster.keys

        def markers():
            return [kv for s in range(SHARDS) for kv in client.get_prefix(keys.answers_prefix(s))[0]
                    if kv.key.split("/")[-2] in ids]
        wait_for(lambda: len(markers()) == len(ids), 30, interval=0.05, what="a1's answers in etcd")
        for kv in markers():   # as a1's publisher stamps them before the broker gets them
            client.put(kv.key, json.dumps(dict(json.loads(kv.value), handed=True)))
        a1.kill()

        def republished():
            got = {d["job_id"]: d for _, t, d in world.col.messages
                   if T.agent_of(t) == "a2" and d.get("published_by") == "a2" and d.get("job_id") in ids
                   and d.get("state") == "accepted"}
            return len(got) == len(ids) and got
        got = wait_for(republished, 60, what="a1's answers republished by a2")
        assert all(d.get("redelivery") is True and d["agent"] == "a1" for d in got.values()), got
    finally:
        pusher.stop()
