"""Issue 54, acceptance 4: with a 1 MB forged field in a stored job, its `jobs/get` answer
by id and every page of a filter stay within `mqtt.get_page_bytes`; so does `millwright jobs
show`. The forger writes etcd directly (as an etcd writer without a signing key can):
a 1 MB ``_accepted``, a 1 MB unsigned field in a document, a 1 MB run record and a 1 MB
waiting mark. Real agent, etcd and mosquitto; sizes are the published payloads' bytes."""

from __future__ import annotations

import json

import pytest

from agent.cloud.asking import Asker
from agent.config import MqttConfig
from agent.coordination.jobstore import JobStore
from agent.coordination.keys import shard_of
from agent.jobs import bounded
from agent.jobs.cli import SHOW_MAX_BYTES
from agent.jobs import view
from tests.support.cloud import T, CloudWorld
from tests.support.cluster import Cluster
from tests.support.cloudkit import KID, TEMPLATES, job_doc
from tests.support.commands import millwright
from tests.support.waiting import wait_for

SHARDS = 4
PAGE_BYTES = 32768  # mqtt.get_page_bytes (the default)
MB = 1_000_000
FORGED = ("big-accepted", "big-field", "big-run", "big-mark")


@pytest.fixture
def world(etcd_server, mosquitto_server, tmp_path):
    w = CloudWorld(etcd_server, mosquitto_server, tmp_path, TEMPLATES, SHARDS)
    yield w
    w.close()


def _forge(c) -> list[str]:
    """200 signed jobs of cluster ``c`` (several pages of a filter), 4 of them then given a
    1 MB field straight in etcd."""
    store = c.signing(JobStore(c.client, c.keys, SHARDS, "seed"))
    ids = [f"fleet-{i:03d}" for i in range(196)] + list(FORGED)
    docs = [store.sign(job_doc(j, template="flush")) for j in ids]
    for i in range(0, len(docs), 50):
        store.create_many([(d, ()) for d in docs[i:i + 50]])
    k = c.keys

    def stored(job_id: str) -> tuple[str, dict]:
        key = k.job(shard_of(job_id, SHARDS), job_id)
        return key, json.loads(c.client.get(key).value)

    key, doc = stored("big-accepted")
    doc["_accepted"] = dict(doc["_accepted"], by="x" * MB)
    c.client.put(key, json.dumps(doc))
    key, doc = stored("big-field")
    doc["note"] = "n" * MB   # not signed: agents refuse to run it, views show it
    c.client.put(key, json.dumps(doc))
    s = shard_of("big-run", SHARDS)
    rec = {"v": 1, "job_id": "big-run", "fire_id": "20261201T120000Z", "attempt": 1, "agent": "ghost",
           "state": "failed", "reason": "r" * MB}
    c.client.put(k.run(s, "big-run", rec["fire_id"]), json.dumps(rec))
    c.client.put(k.latest(s, "big-run"), json.dumps(rec))
    s = shard_of("big-mark", SHARDS)
    c.client.put(k.waiting(s, "big-mark", "ghost"),
                 json.dumps({"v": 1, "job_id": "big-mark", "fire_id": "f", "attempt": 1, "agent": "ghost",
                             "reason": "window", "detail": "w" * MB, "since": "2026-12-01T12:00:00Z"}))
    return ids


def test_a_1_mb_forged_field_keeps_every_answer_within_get_page_bytes(world):
    ids = _forge(world.cluster)
    a = world.cluster.start("b1")
    wait_for(lambda: world.cluster.all_owned_by({"b1"}), 60, what="the agent holding every shard")
    assert world.col.wait(lambda m: any(t == T.presence("b1") and d.get("state") == "online" for _, t, d in m), 30)
    ask = Asker(MqttConfig(url=world.mq.url), "t", world.ring, KID)
    assert ask.start(10)
    sizes: dict = {}
    try:
        for job_id in FORGED:
            for include in ((), ("params", "stderr")):
                for _ in range(2):   # asked again: reported once
                    (agent, ans, size), = ask.wait(ask.ask(job_id=job_id, include=list(include)), 1, 30)
                    assert ans["found"] and ans["job"]["id"] == job_id, ans
                    assert size <= PAGE_BYTES and size == len(bounded.encode(ans))
                    assert ans["job"]["cut"] and ans["job"]["template"] == "flush"   # cut, not dropped
                    sizes[job_id] = max(sizes.get(job_id, 0), size)
        cut_by_id = {j: ask.wait(ask.ask(job_id=j), 1, 30)[0][1]["job"]["cut"] for j in FORGED}
        assert cut_by_id == {"big-accepted": ["accepted.by"], "big-field": ["doc.note"],
                             "big-run": ["runs.0.reason"], "big-mark": ["waiting.0.detail"]}

        pages = []
        for flt in ({}, {"template": "flush"}, {"template": "flush", "limit": 3}):
            got = ask.list(flt, include=["params", "stderr"], timeout=120)
            assert got["complete"] and sorted(j["id"] for j in got["jobs"]) == sorted(ids), got["missing"]
            assert all(size <= PAGE_BYTES for _, _, size in got["pages"])
            pages += [size for _, _, size in got["pages"]]
            with_forged = [size for _, d, size in got["pages"] if {j["id"] for j in d["jobs"]} & set(FORGED)]
            print(f"\nfilter {flt}: {len(got['pages'])} pages, largest {max(s for _, _, s in got['pages'])} bytes; "
                  f"those with a forged job: {with_forged} bytes")
        print(f"answers by id (bytes, cap {PAGE_BYTES}): {sizes}; {len(pages)} pages, largest {max(pages)} bytes")

        # one audit record per oversized job, however often it was asked for
        wait_for(lambda: {r.get("job") for r in world.cluster.audit("b1") if r.get("event") == "view_oversized"}
                 >= {"big-accepted", "big-field", "big-run"}, 30, what="the oversized views audited")
        seen = [r["job"] for r in world.cluster.audit("b1") if r.get("event") == "view_oversized"]
        assert sorted(seen) == sorted(set(seen)) and set(seen) == set(FORGED), seen

        for job_id in FORGED:   # the operator's view is bounded the same way
            r = millwright("jobs", "show", job_id, "-c", a.config_path, "--json")
            assert r.returncode == 0, r.stderr
            shown = json.loads(r.stdout)
            assert bounded.size(shown) <= SHOW_MAX_BYTES and shown["cut"], job_id
            r = millwright("jobs", "show", job_id, "-c", a.config_path)
            assert r.returncode == 0 and "Traceback" not in r.stderr and len(r.stdout) <= SHOW_MAX_BYTES
            assert "cut" in r.stdout and job_id in r.stdout
        r = millwright("jobs", "list", "-c", a.config_path, "--json")
        assert r.returncode == 0, r.stderr
        listed = {j["id"]: j for j in json.loads(r.stdout)}
        assert set(listed) == set(ids) and all(bounded.size(j) <= PAGE_BYTES for j in listed.values())
        assert {j for j, v in listed.items() if v.get("cut")} == {"big-accepted", "big-field", "big-run", "big-mark"}
    finally:
        ask.stop()


def test_the_first_job_of_a_page_is_held_to_the_bound_and_waiting_marks_are_read_within_one(etcd_server, tmp_path):
    """list_page itself, on a real etcd: a first view over the page's bytes (the shaping
    left it whole) is a stub with its key's id, and the page moves on past it; a job's
    waiting marks are read up to WAITING_MAX, however many an etcd writer added."""
    c = Cluster(etcd_server, str(tmp_path / "agents"), shards=SHARDS)
    try:
        ids = _forge(c)
        s = shard_of("big-accepted", SHARDS)
        on_shard = sorted(j for j in ids if shard_of(j, SHARDS) == s)
        first = on_shard.index("big-accepted")
        after = (s, on_shard[first - 1]) if first else None
        jobs, nxt = view.list_page(c.client, c.keys, SHARDS, [s], max_bytes=PAGE_BYTES, after=after, limit=1000)
        assert jobs[0] == {"id": "big-accepted", "shard": s, "truncated": True, "bytes": jobs[0]["bytes"]}
        assert jobs[0]["bytes"] > MB and nxt == (s, "big-accepted")   # moves on past it
        assert bounded.size(jobs) <= PAGE_BYTES

        s = shard_of("big-mark", SHARDS)
        for i in range(view.WAITING_MAX + 50):
            c.client.put(c.keys.waiting(s, "big-mark", f"forged-{i:03d}"), json.dumps({"reason": "gate", "i": i}))
        assert len(view.waiting_marks(c.client, c.keys, s, "big-mark")["big-mark"]) == view.WAITING_MAX
        assert len(view.waiting_marks(c.client, c.keys, s)["big-mark"]) == view.WAITING_MAX
        shown = view.get_job(c.client, c.keys, SHARDS, "big-mark")
        assert shown is not None and len(shown["waiting"]) == view.WAITING_MAX
    finally:
        c.close()
