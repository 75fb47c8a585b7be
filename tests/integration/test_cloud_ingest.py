"""The push/cancel pipeline in-process against a real etcd: every rejection reason (and
which of them never reach a job's status topic), binding and replay, redelivery and
conflict semantics, and a hypothesis fuzz of >= 10,000 payloads."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from agent.cloud.ingest import Ingest
from agent.cloud.outbox import Outbox
from tests.support.cloudkit import KID, TEMPLATES, cancel_doc, job_doc, rfc, signed, write_keys
from agent.cloud.topics import Topics
from agent.config import EtcdConfig, parse_config
from agent.coordination.etcd import EtcdClient, EtcdUnavailable
from agent.coordination.jobstore import JobStore
from agent.coordination.keys import Keys
from agent.jobs.envelope import REASONS
from agent.jobs.signing import KeyRing, generate_hmac_secret, sign

SHARDS = 8


class Env:
    def __init__(self, etcd, tmp_path, agent_id="a1", outbox=True):
        self.client = EtcdClient(EtcdConfig(endpoints=[etcd.endpoint], request_timeout_s=1.0))
        self.store = JobStore(self.client, Keys("t"), SHARDS, agent_id)
        self.ring = write_keys(str(tmp_path / f"keys-{agent_id}.yaml"))
        self.cfg = parse_config(yaml.safe_dump({"cluster": "t", "etcd": {"insecure": True}, "templates": TEMPLATES}))
        self.outbox = Outbox(str(tmp_path / f"outbox-{agent_id}.sqlite"), 100000) if outbox else None
        self.records = []
        self.notified = []
        self.topics = Topics("t", agent_id)
        self.ingest = Ingest(store=self.store, keyring=self.ring, templates=self.cfg.templates, topics=self.topics,
                             agent_id=agent_id, max_bytes=4096, max_skew_s=300, cluster="t", max_age_s=86400,
                             outbox=self.outbox,
                             record=lambda t, **f: self.records.append((t, f)),
                             notify=lambda k, o: self.notified.append((k, o)),
                             has_other_owner=lambda shard: False)

    def statuses(self, topic_kind=None):
        return [json.loads(p) for _, topic, p, _ in self.outbox.batch(0, 10 ** 6)
                if topic_kind is None or self.topics.kind(topic) == topic_kind]


@pytest.fixture
def env(etcd_server, tmp_path):
    e = Env(etcd_server, tmp_path)
    yield e
    e.client.close()


def test_each_rejection_reason(env):
    ring = env.ring
    other = KeyRing.from_mapping({KID: {"alg": "hmac-sha256", "secret": generate_hmac_secret()}})
    unknown = KeyRing.from_mapping({"cloud-9": {"alg": "hmac-sha256", "secret": generate_hmac_secret()}})
    now = datetime.now(timezone.utc)
    assert env.ingest.push(signed(job_doc("to-cancel"), ring)).result == "accepted"
    assert env.ingest.cancel(signed(cancel_doc("to-cancel"), ring)).result == "cancelled"
    assert env.ingest.push(signed(job_doc("twin", line="1"), ring)).result == "accepted"
    # authentic and bound to this cluster: rejected on the job's own status topic, with details
    bound = {
        "bad_field": signed(job_doc("wrong-type", timeout_s="ten"), ring),
        "unknown_template": signed(job_doc("tpl", template="nope"), ring),
        "bad_param": signed(job_doc("param", line="3; rm -rf /"), ring),
        "expired": signed(job_doc("old", now=now - timedelta(days=40), at_offset_s=1), ring),
        "skew": signed(job_doc("skew", issued_at=rfc(now + timedelta(hours=2))), ring),
        "too_old": signed(job_doc("stale", issued_at=rfc(now - timedelta(days=2))), ring),
        "cancelled": signed(job_doc("to-cancel"), ring),
        "conflict": signed(job_doc("twin", line="2"), ring),
    }
    # not authentic, or not for this cluster: dropped, reported by reason only on the agent's
    # own rejections topic, never on a job's topic
    tampered = json.loads(signed(job_doc("tampered"), ring))
    tampered["params"]["line"] = "4"
    unbound = {
        "bad_json": b'{"v":1,"id":"x",',
        "unsigned": json.dumps(job_doc("unsigned")).encode(),
        "bad_signature": signed(job_doc("badsig"), other),
        "unknown_kid": json.dumps(sign(job_doc("kid"), unknown, "cloud-9")).encode(),
        "too_large": signed(job_doc("big", depends_on=[f"d{i:05d}" for i in range(60)] * 1), ring) + b" " * 4096,
        "wrong_cluster": signed(job_doc("elsewhere", cluster="plant-b"), ring),
        "wrong_kind": signed({**job_doc("kinded"), "kind": "cancel"}, ring),
        "bad_signature (tampered)": json.dumps(tampered).encode(),
    }
    for want, payload in bound.items():
        out = env.ingest.push(payload)
        assert out.result == "rejected", (want, out)
        assert out.reason == want, (want, out.reason, out.detail)
        assert out.status["state"] == "rejected" and out.status["reason"] == out.reason and out.status["detail"]
    for want, payload in unbound.items():
        out = env.ingest.push(payload)
        assert out.result == "dropped", (want, out)
        assert out.reason == want.split(" ")[0], (want, out.reason, out.detail)
        assert set(out.status) == {"v", "state", "kind", "reason", "agent", "ts", "push_sha256"}, out.status
    # each rejection: a status, an audit record, a metric (reason only, never the job id)
    from agent.runtime.metrics import REGISTRY
    on_jobs = [s for s in env.statuses("status") if s["state"] == "rejected"]
    assert sorted({s["reason"] for s in on_jobs}) == sorted(bound)
    reported = env.statuses("rejected")
    assert sorted({s["reason"] for s in reported}) == sorted({w.split(" ")[0] for w in unbound})
    assert all("job_id" not in s and "detail" not in s for s in reported)
    assert len([r for r in env.records if r[1].get("event") == "rejected"]) == len(bound)
    assert len([r for r in env.records if r[1].get("event") == "rejected_unauthenticated"]) == len(unbound)
    for reason in ("bad_json", "conflict", "cancelled", "too_large", "wrong_cluster"):
        assert REGISTRY.get_sample_value("millwright_mqtt_rejected_total", {"reason": reason}) >= 1
    assert REGISTRY.get_sample_value("millwright_mqtt_unauthenticated_total",
                                     {"kind": "push", "reason": "unsigned"}) >= 1
    for metric in REGISTRY.collect():
        for s in metric.samples:
            assert "job_id" not in s.labels and "twin" not in s.labels.values()
    # nothing rejected reached etcd; the twin kept its first content
    for jid in ("tpl", "param", "unsigned", "badsig", "kid", "old", "skew", "stale", "wrong-type", "tampered",
                "elsewhere", "kinded"):
        assert env.store.get(jid) is None
    assert env.store.get("twin").doc["params"] == {"line": "1"}


def test_replays_are_refused_with_their_reasons(env, etcd_server, tmp_path):
    """Acceptance 2: a valid push replayed into another cluster, a cancel replayed after a
    day, a push older than max_age_s."""
    ring = env.ring
    now = datetime.now(timezone.utc)
    # the same signed bytes, valid in cluster t, arrive at an agent of cluster u
    other = Env(etcd_server, tmp_path, agent_id="u1")
    try:
        other.ingest.keyring = ring
        other.ingest.cluster = "u"
        payload = signed(job_doc("replayed"), ring)
        assert env.ingest.push(payload).result == "accepted"
        out = other.ingest.push(payload)
        assert (out.result, out.reason) == ("dropped", "wrong_cluster")
        out = other.ingest.cancel(signed(cancel_doc("replayed"), ring))
        assert (out.result, out.reason) == ("dropped", "wrong_cluster")
    finally:
        other.client.close()
    # a cancel captured a day ago
    out = env.ingest.cancel(signed(cancel_doc("replayed", now=now - timedelta(days=1, minutes=1)), ring))
    assert (out.result, out.reason) == ("rejected", "too_old") and "issued_at" in out.detail
    assert not env.store.get("replayed").cancelled
    # a push older than max_age_s (a shorter one here)
    env.ingest.max_age_s = 60
    out = env.ingest.push(signed(job_doc("aged", now=now - timedelta(seconds=120)), ring))
    assert (out.result, out.reason) == ("rejected", "too_old")
    assert env.store.get("aged") is None


def test_cancel_rejections_and_tombstone(env):
    ring = env.ring
    out = env.ingest.cancel(json.dumps(cancel_doc("x")).encode())
    assert out.result == "dropped" and out.reason == "unsigned"
    out = env.ingest.cancel(signed({**cancel_doc("x"), "extra": 1}, ring))
    assert out.result == "rejected" and out.reason == "bad_field"
    # a cancel before its push leaves a tombstone: the push is then refused
    out = env.ingest.cancel(signed(cancel_doc("early"), ring))
    assert out.result == "cancelled" and out.status["state"] == "cancelled"
    assert ("cancelled", "early") in env.notified
    assert env.ingest.push(signed(job_doc("early"), ring)).reason == "cancelled"
    # idempotent: a repeat is marked
    again = env.ingest.cancel(signed(cancel_doc("early"), ring))
    assert again.result == "redelivery" and again.status["redelivery"] is True


def test_redelivery_is_recognised_before_time_checks(env):
    ring = env.ring
    now = datetime.now(timezone.utc)
    doc = job_doc("r1", now=now)
    payload = signed(doc, ring)
    first = env.ingest.push(payload)
    assert first.result == "accepted" and "redelivery" not in first.status
    assert env.notified and env.notified[-1][0] == "stored" and env.notified[-1][1].id == "r1"
    second = env.ingest.push(payload)
    assert second.result == "redelivery" and second.status["redelivery"] is True
    # the same push redelivered after its issued_at left the max_age_s window (it waited on
    # the broker): still recognised as the stored job, not rejected
    env.ingest.max_age_s = 0.001
    third = env.ingest.push(payload)
    assert third.result == "redelivery"
    # a different job with the same stale issued_at is rejected as too old
    late = env.ingest.push(signed(job_doc("r2", now=now - timedelta(seconds=5)), ring))
    assert late.reason == "too_old"
    accepted = [s for s in env.statuses() if s["state"] == "accepted" and s["job_id"] == "r1"]
    assert [bool(s.get("redelivery")) for s in accepted] == [False, True, True]


def test_created_but_status_lost_gets_its_first_status(env, etcd_server, tmp_path):
    """A crash between the etcd write and the outbox: the redelivered push is answered with
    the first, unmarked accepted status (the ledger does not know the job)."""
    ring = env.ring
    payload = signed(job_doc("lost-status"), ring)
    env.store.create(json.loads(payload))  # as if ingest died right after the write
    out = env.ingest.push(payload)
    assert out.result == "accepted" and "redelivery" not in out.status
    assert env.ingest.push(payload).result == "redelivery"


def test_created_push_hands_the_scheduler_its_verified_job(env):
    """The job this agent just verified and created travels with the notification
    (StoredJob.parsed, with the key that signed it), so the scheduler does not parse and
    verify the same bytes again; a job read back from etcd never carries one."""
    env.ingest.push(signed(job_doc("p-one"), env.ring), screened=True)
    env.ingest.push_many([(signed(job_doc(f"p-many-{i}"), env.ring), True) for i in range(3)], screened=True)
    stored = {o.id: o for kind, o in env.notified if kind == "stored"}
    assert sorted(stored) == ["p-many-0", "p-many-1", "p-many-2", "p-one"]
    for job_id, s in stored.items():
        assert s.parsed is not None and s.parsed.id == job_id and s.parsed.kid == KID
        assert s.parsed.doc == {k: v for k, v in s.doc.items() if not k.startswith("_")}
    payload = signed(job_doc("p-lost"), env.ring)
    env.store.create(json.loads(payload))  # stored, then the agent died before its status
    env.notified.clear()
    assert env.ingest.push(payload, screened=True).result == "accepted"
    [(kind, s)] = env.notified
    assert kind == "stored" and s.id == "p-lost" and s.parsed is None  # read from etcd: verified again


def test_verified_job_carries_its_keys_retirement(env):
    """The job handed to the scheduler names the key that signed it and that key's
    retired_after, so the scheduler stops it at the retirement as it would a job it
    verified itself (agent/jobs/scheduler.py _arm_retirement)."""
    retire = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(days=2)
    ring = KeyRing.from_mapping({"rotating": {"alg": "hmac-sha256", "secret": generate_hmac_secret(),
                                              "retired_after": rfc(retire)}})
    env.ingest.keyring = ring
    payload = json.dumps(sign(job_doc("p-rotating"), ring, "rotating"), separators=(",", ":")).encode()
    assert env.ingest.push(payload, screened=True).result == "accepted"
    [(kind, s)] = [n for n in env.notified if n[1].id == "p-rotating"]
    assert s.parsed.kid == "rotating" and s.parsed.key_retired_after == retire


def test_other_agents_job_is_silent_for_non_owner(env, etcd_server, tmp_path):
    b = Env(etcd_server, tmp_path, agent_id="b1")
    try:
        b.ingest.keyring = env.ring
        payload = signed(job_doc("by-a"), env.ring)
        assert env.ingest.push(payload).result == "accepted"
        assert b.ingest.push(payload, as_owner=False).result == "silent"  # a1 answered already
        assert b.statuses() == []
        out = b.ingest.push(payload, as_owner=True)  # the owner answers a repeat, marked
        assert out.result == "redelivery" and out.status["redelivery"] is True
    finally:
        b.client.close()


def test_etcd_outage_raises_and_leaves_nothing(env, etcd_server):
    etcd_server.stop()
    try:
        with pytest.raises(EtcdUnavailable):
            env.ingest.push(signed(job_doc("during-outage"), env.ring))
        assert env.outbox.depth == 0  # the reservation was given back
    finally:
        etcd_server.start()
    assert env.ingest.push(signed(job_doc("during-outage"), env.ring)).result == "accepted"


def test_group_commit_gives_each_push_its_own_outcome(env):
    """One batch (one etcd transaction): new jobs, a job already stored, a conflict, a
    cancelled id, a rejected document and an id twice in the batch each get the answer
    they get alone, and every answer is in the outbox (ledger included) when it returns."""
    ring = env.ring
    now = datetime.now(timezone.utc)  # one clock: a job pushed twice is the same document
    assert env.ingest.push(signed(job_doc("g-old", now=now), ring)).result == "accepted"
    assert env.ingest.push(signed(job_doc("g-twin", now=now, line="1"), ring)).result == "accepted"
    assert env.ingest.cancel(signed(cancel_doc("g-cancelled"), ring)).result == "cancelled"
    items = [(signed(job_doc(f"g-new-{i}", now=now), ring), True) for i in range(5)]
    items += [(signed(job_doc("g-old", now=now), ring), True),                     # stored before: a redelivery
              (signed(job_doc("g-twin", now=now, line="2"), ring), True),          # other content: conflict
              (signed(job_doc("g-cancelled", now=now), ring), True),               # cancelled before
              (signed(job_doc("g-bad", now=now, template="nope"), ring), True),    # refused by parse_job
              (signed(job_doc("g-new-0", now=now), ring), True)]                   # twice in this batch
    depth = env.outbox.depth
    outs = env.ingest.push_many(items)
    assert [o.result for o in outs] == ["accepted"] * 5 + ["redelivery", "rejected", "rejected", "rejected",
                                                           "redelivery"], [vars(o) for o in outs]
    assert [o.reason for o in outs[6:9]] == ["conflict", "cancelled", "unknown_template"]
    for i in range(5):
        stored = env.store.get(f"g-new-{i}")
        assert stored is not None and stored.doc["_accepted"]["by"] == "a1"
        assert env.outbox.in_ledger(f"g-new-{i}")
    assert env.store.get("g-bad") is None
    assert env.outbox.depth == depth + len(items)  # one status each, no reservation left held
    assert all(not r[3] for r in env.outbox.batch(0, 10 ** 6))  # nothing held: all publishable
    firsts = [s for s in env.statuses() if s["state"] == "accepted" and s["job_id"].startswith("g-new-")
              and not s.get("redelivery")]
    assert sorted(s["job_id"] for s in firsts) == [f"g-new-{i}" for i in range(5)]


def test_group_commit_during_etcd_outage_stores_and_answers_nothing(env, etcd_server):
    items = [(signed(job_doc(f"o-{i}"), env.ring), True) for i in range(4)]
    etcd_server.stop()
    try:
        outs = env.ingest.push_many(items)
        assert all(isinstance(o, EtcdUnavailable) for o in outs)  # each item: retry, do not acknowledge
        assert env.outbox.depth == 0  # every reservation given back
    finally:
        etcd_server.start()
    assert [o.result for o in env.ingest.push_many(items)] == ["accepted"] * 4


def test_create_many_matches_create(env):
    """JobStore.create_many: per-item outcomes of one transaction, the same as create's."""
    from agent.coordination.jobstore import CREATED, EXISTS, JobCancelled, JobConflict

    ring = env.ring
    now = datetime.now(timezone.utc)  # one clock for all: c-old pushed twice is the same document
    env.store.create(json.loads(signed(job_doc("c-old", now=now), ring)))
    env.store.cancel("c-gone")
    docs = [json.loads(signed(job_doc(j, now=now), ring)) for j in ("c-new", "c-old")]
    docs += [json.loads(signed(job_doc("c-old", line="9", now=now), ring)),
             json.loads(signed(job_doc("c-gone", now=now), ring))]
    res = env.store.create_many([(docs[0], ()), (docs[1], ()), (docs[3], ())])
    assert res[0][0] == CREATED and res[1][0] == EXISTS and isinstance(res[2], JobCancelled)
    assert res[0][1].revision == res[0][1].create_revision  # created in this transaction
    res = env.store.create_many([(docs[2], ())])
    assert isinstance(res[0], JobConflict)


# --------------------------------------------------------------------------- fuzz

FIELDS = ["v", "id", "cluster", "kind", "template", "params", "schedule", "misfire", "misfire_limit", "overlap", "retry", "timeout_s",
          "resources", "depends_on", "not_after", "issued_at", "sig", "zzz"]
TRICKY = [None, True, False, 0, -1, 1, 2.0, 1e308, -1e308, 2 ** 64, "", "3", "..", "a" * 200, "\u0000", "\ud800x",
          "2026-12-02T12:00:00Z", "9999-99-99", "t", "job", "cancel", "plant-b", "*/5 * * * *", {"line": "3"}, {"at": "x"}, {"cron": "* * *"}, [],
          ["a"], {"alg": "hmac-sha256", "kid": KID, "value": "AAAA"}, {"max_attempts": 1000}, {"cpu": -1}]


def _rand_json(rnd, depth=0):
    r = rnd.random()
    if depth > 3 or r < 0.45:
        return rnd.choice(TRICKY) if rnd.random() < 0.6 else rnd.choice(
            [rnd.randint(-10 ** 6, 10 ** 6), rnd.random() * 1e6, "".join(chr(rnd.randint(0, 0x2FF)) for _ in range(rnd.randint(0, 8)))])
    if r < 0.7:
        return [_rand_json(rnd, depth + 1) for _ in range(rnd.randint(0, 3))]
    return {rnd.choice(FIELDS + ["line", "at", "x"]): _rand_json(rnd, depth + 1) for _ in range(rnd.randint(0, 3))}


@st.composite
def payloads(draw, ring_box):
    """Cheap draws (a kind, a seed, a few choices) expanded by a seeded RNG: hypothesis
    explores and shrinks the choices, and 10,000 examples stay fast."""
    import random

    kind = draw(st.sampled_from(["bytes", "json", "mutate", "mutate_resign", "valid", "truncate"]))
    seed = draw(st.integers(0, 2 ** 32))
    rnd = random.Random(seed)
    ring = ring_box[0]
    doc = job_doc(f"fz-{seed}", line=str(seed % 100))
    if kind == "bytes":
        return bytes(rnd.randrange(256) for _ in range(rnd.randint(0, 200))), kind
    if kind == "json":
        return json.dumps(_rand_json(rnd)).encode(), kind
    if kind == "valid":
        return signed(doc, ring), kind
    if kind == "truncate":
        p = signed(doc, ring)
        return p[: rnd.randint(0, len(p) - 1)], kind
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(FIELDS))
        if rnd.random() < 0.3:
            doc.pop(field, None)
        else:
            doc[field] = _rand_json(rnd)
    if kind == "mutate_resign":
        try:
            return signed(doc, ring), kind
        except Exception:
            return json.dumps(doc, default=str).encode(), kind
    d = json.loads(signed(job_doc(f"fz-{seed}", line=str(seed % 100)), ring))
    d.update({k: v for k, v in doc.items() if k != "sig"})
    return json.dumps(d).encode(), kind


def _valid_by_oracle(payload: bytes, ring: KeyRing, templates) -> bool:
    """An independent, partial notion of validity that every accepted push must meet."""
    doc = json.loads(payload)
    ring.verify(doc)  # raises if not signed by our key
    assert doc["cluster"] == "t" and doc["kind"] == "job"  # bound to this cluster, as a job
    t = templates[doc["template"]]
    assert set(doc.get("params", {})) == set(t.params)
    for k, rx in t.params.items():
        assert re.fullmatch(rx, doc["params"][k])
    if "not_after" in doc:
        assert doc["not_after"] > rfc(datetime.now(timezone.utc))
    return True


def test_fuzz_ingest_never_crashes_never_accepts_invalid(env):
    ring_box = [env.ring]
    env.ingest.outbox = None  # keep the fuzz about the pipeline; the outbox has its own tests
    counts = {"accepted": 0, "rejected": 0, "valid": 0}

    @settings(max_examples=2500, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(payloads(ring_box), min_size=4, max_size=4))
    def run(items):  # 4 payloads per example: 10,000 payloads, a quarter of the engine overhead
        for payload, kind in items:
            check(payload, kind)

    def check(payload, kind):
        out = env.ingest.push(payload)  # any exception but EtcdUnavailable fails the test
        assert out.result in ("accepted", "redelivery", "rejected", "dropped"), out
        if out.result == "dropped":  # unauthenticated or unbound: nothing of it may be stored
            counts["rejected"] += 1
            assert kind != "valid"
        elif out.result == "rejected":
            counts["rejected"] += 1
            assert out.reason in REASONS + ("cancelled", "conflict"), out.reason
            assert kind != "valid" or out.reason == "conflict", (kind, out.reason, out.detail)
        else:
            counts["accepted"] += 1
            assert _valid_by_oracle(payload, env.ring, env.cfg.templates)
            if out.result == "accepted":
                stored = env.store.get(out.job_id)
                assert stored is not None and stored.doc["sig"] == json.loads(payload)["sig"]
        if kind == "valid":
            counts["valid"] += 1

    run()
    assert counts["accepted"] + counts["rejected"] >= 10000
    # nothing unsigned or wrongly bound was ever stored
    from agent.coordination.jobstore import public_doc

    stored_n = 0
    for shard in range(SHARDS):
        for stored in env.store.list_shard(shard)[0]:
            doc = public_doc(stored.doc)
            env.ring.verify(doc)
            assert doc["cluster"] == "t" and doc["kind"] == "job"
            stored_n += 1
    assert stored_n > 100
    assert counts["valid"] > 500 and counts["accepted"] >= counts["valid"] * 0.9
    # and it keeps ingesting
    assert env.ingest.push(signed(job_doc("after-fuzz"), env.ring)).result == "accepted"


def test_pushes_past_the_cluster_quota_are_refused_and_redeliveries_still_answered(env, etcd_server, tmp_path):
    """The documents the cluster already stores are counted by each shard's owner (a real
    agent here, writing usage/<shard>); ingest adds what it stored since its last read."""
    from agent.coordination.quota import ClusterQuota
    from tests.support.cluster import Cluster
    from tests.support.jobs import job
    from tests.support.waiting import wait_for

    c = Cluster(etcd_server, str(tmp_path / "agents"), shards=SHARDS)
    try:
        c.start("owner")
        wait_for(lambda: c.all_owned_by({"owner"}), 30, what="the owner holding every shard")
        store = c.job_store()
        for i in range(3):
            store.create(job(f"stored-{i}", {"at": rfc(datetime.now(timezone.utc) + timedelta(days=1))}))

        def published() -> int:
            kvs, _ = env.client.get_prefix(Keys("t").usage_prefix())
            return sum(json.loads(kv.value)["jobs"] for kv in kvs)

        wait_for(lambda: published() == 3, 20, what="the owner's usage/ keys counting the 3 documents")
        env.ingest.quota = ClusterQuota(env.client, Keys("t"), max_jobs=5, max_mb=1, refresh_s=60.0)
        first = signed(job_doc("q1"), env.ring)
        assert env.ingest.push(first).result == "accepted"
        assert env.ingest.push_many([(signed(job_doc("q2"), env.ring), True)])[0].result == "accepted"
        refused = env.ingest.push(signed(job_doc("q3"), env.ring))
        assert (refused.result, refused.reason) == ("rejected", "quota_exceeded")
        assert "quotas.jobs is 5" in refused.detail and env.store.get("q3") is None
        batch = env.ingest.push_many([(signed(job_doc("q4"), env.ring), True), (first, True)])
        assert [(o.result, o.reason) for o in batch] == [("rejected", "quota_exceeded"), ("redelivery", None)]
        (st,) = [s for s in env.statuses() if s["job_id"] == "q3"]
        assert (st["state"], st["reason"]) == ("rejected", "quota_exceeded")
        assert [f for t, f in env.records if f.get("reason") == "quota_exceeded"]
    finally:
        c.close()


def test_a_conflict_says_which_fields_differ_and_when_only_issued_at_does(env):
    """The same document signed anew (push stamped a new issued_at on a file without one)
    is a conflict whose answer says so, with the stored issued_at, which makes a repeat of
    it; another difference is named. Fails on a build whose answer said only "different
    content"."""
    now = datetime.now(timezone.utc)
    first, later = rfc(now - timedelta(minutes=5)), rfc(now)
    assert env.ingest.push(signed(job_doc("again", now=now, issued_at=first), env.ring)).result == "accepted"
    out = env.ingest.push(signed(job_doc("again", now=now, issued_at=later), env.ring))
    assert (out.result, out.reason) == ("rejected", "conflict")
    assert out.detail == (f"id: job again already exists with different content: only issued_at differs (stored "
                          f"{first}, this push {later}); to repeat the push, sign it with the stored issued_at "
                          f"(millwright push --issued-at {first})")
    assert out.status["detail"] == out.detail
    assert env.ingest.push(signed(job_doc("again", now=now, issued_at=first), env.ring)).result == "redelivery"
    out = env.ingest.push(signed(job_doc("again", line="4", now=now, issued_at=later), env.ring))
    assert out.detail == "id: job again already exists with different content (issued_at, params differ)"


def test_ingest_audits_the_job_under_the_key_run_records_use(env):
    """`audit show --job ID` finds a job's ingest records (accepted, rejected, cancelled)
    beside its run records: all carry the id as `job`. Fails on a build that wrote `job_id`."""
    assert env.ingest.push(signed(job_doc("audited"), env.ring)).result == "accepted"
    assert env.ingest.push(signed(job_doc("audited", line="5"), env.ring)).reason == "conflict"
    assert env.ingest.cancel(signed(cancel_doc("audited"), env.ring)).result == "cancelled"
    events = [(f["event"], f.get("job"), "job_id" in f) for t, f in env.records if t == "job"]
    assert events == [("accepted", "audited", False), ("rejected", "audited", False), ("cancelled", "audited", False)]


def test_answers_about_the_job_alone_name_no_run(env):
    """accepted, rejected and cancelled answers carry run_id, fire_id and attempt as null,
    as the owner's scheduled status does (a run's statuses carry all three)."""
    env.ingest.push(signed(job_doc("no-run"), env.ring))
    env.ingest.cancel(signed(cancel_doc("no-run"), env.ring))
    docs = [d for d in env.statuses() if d.get("job_id") == "no-run"]
    assert [d["state"] for d in docs] == ["accepted", "cancelled"]
    assert all((d["run_id"], d["fire_id"], d["attempt"]) == (None, None, None) for d in docs), docs
    assert docs[1]["reason"] == "cancelled_by_cloud"
