"""Unit tests of the cloud channel's pure parts: topics, outbox (real SQLite), ids, presence."""

from __future__ import annotations

import json
import time
import os

import pytest

from agent.cloud.ingest import peek_id, push_digest
from agent.cloud.outbox import Outbox, OutboxPublisher, keep_state
from agent.cloud.presence import presence_doc, will_doc
from agent.cloud.topics import INVALID_ID, Topics
from tests.support.link import FakeLink, message


def test_topics_and_kinds():
    t = Topics("plant-a", "gw-1")
    assert t.push == "millwright/plant-a/jobs/push"
    assert t.cancel == "millwright/plant-a/jobs/cancel"
    # an agent publishes only under its own prefix, so a broker ACL can protect it
    assert t.status("j-1") == "millwright/plant-a/agents/gw-1/status/j-1"
    assert t.status("j-1", "gw-2") == "millwright/plant-a/agents/gw-2/status/j-1"
    assert t.status(None).endswith("/" + INVALID_ID)
    assert t.status("../x").endswith("/" + INVALID_ID)
    assert t.status(".hidden").endswith("/" + INVALID_ID)
    assert t.status("a+b").endswith("/" + INVALID_ID)  # a wildcard must never become a topic level
    assert t.rejections() == "millwright/plant-a/agents/gw-1/rejected"
    assert t.presence() == t.presence("gw-1") == "millwright/plant-a/agents/gw-1/presence"
    assert t.checkpoint("gw-1") == "millwright/plant-a/agents/gw-1/audit/checkpoint"
    assert t.status_filter() == "millwright/plant-a/agents/+/status/+"
    assert t.job_status_filter("j-1") == "millwright/plant-a/agents/+/status/j-1"
    assert t.agent_of(t.status("j")) == "gw-1" and t.agent_of(t.push) is None
    assert [t.kind(x) for x in (t.push, t.cancel, t.status("j"), t.rejections(), t.presence("a"), t.checkpoint("a"),
                                "x/y")] == ["push", "cancel", "status", "rejected", "presence", "checkpoint", "other"]
    with pytest.raises(ValueError):
        Topics("plant-a").status("j")  # the cloud side has no agent prefix of its own


def test_outbox_file_is_private(tmp_path):
    path = str(tmp_path / "ob.sqlite")
    ob = Outbox(path, 10)
    ob.enqueue("t", {"job_id": "j", "state": "running"})
    for name in os.listdir(tmp_path):
        assert os.stat(tmp_path / name).st_mode & 0o077 == 0, name
    ob.close()


def test_unauthenticated_reports_are_rate_limited():
    from agent.cloud.ratelimit import TokenBucket

    clock = [0.0]
    b = TokenBucket(2.0, 3.0, clock=lambda: clock[0])
    assert [b.take() for _ in range(5)] == [True, True, True, False, False]
    clock[0] = 1.0
    assert [b.take() for _ in range(3)] == [True, True, False]


def test_cancelled_mark_is_read_from_the_document_not_its_text():
    from agent.cloud.dispatch import stored_cancelled

    assert stored_cancelled(b'{"id":"j","_cancelled":{"at":"x"}}')
    assert not stored_cancelled(json.dumps({"id": "j", "params": {"p": '"_cancelled"'}}).encode())
    assert not stored_cancelled(b'{"id":"j","params":{"_cancelled":1}}')
    assert not stored_cancelled(b"not json")


def test_peek_id():
    assert peek_id(b'{"id":"abc"}', 100) == "abc"
    assert peek_id(b'{"id":".."}', 100) is None
    assert peek_id(b'{"id":5}', 100) is None
    assert peek_id(b'[1]', 100) is None
    assert peek_id(b'\xff', 100) is None
    assert peek_id(b'{"id":"abc"}', 5) is None  # over the size limit: not even parsed
    assert len(push_digest(b"x")) == 16


def test_presence_docs():
    d = json.loads(presence_doc("a1", "draining", "sigterm"))
    assert d["v"] == 1 and d["state"] == "draining" and d["agent"] == "a1" and d["reason"] == "sigterm"
    w = json.loads(will_doc("a1"))
    assert w["state"] == "offline" and w["reason"] == "connection_lost"


def _rows(ob):
    return [(seq, topic, json.loads(p), sent) for seq, topic, p, sent in ob.batch(0, 10 ** 6)]


def test_outbox_order_seq_and_persistence(tmp_path):
    path = str(tmp_path / "ob.sqlite")
    ob = Outbox(path, 100)
    for i in range(5):
        ob.enqueue(f"t/{i % 2}", {"job_id": f"j{i % 2}", "state": "running", "i": i})
    rows = _rows(ob)
    assert [r[2]["i"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r[2]["seq"] for r in rows] == [1, 2, 3, 4, 5]
    ob.mark_sent([1, 2])
    ob.delete([1])
    assert ob.depth == 4
    ob.close()
    ob = Outbox(path, 100)  # reopened: same rows, sequence continues, never reused
    assert ob.depth == 4
    assert [(r[0], r[3]) for r in _rows(ob)] == [(2, 1), (3, 0), (4, 0), (5, 0)]
    ob.delete([2, 3, 4, 5])
    assert ob.enqueue("t", {"state": "accepted"}) == 6
    ob.close()
    ob = Outbox(path, 100)
    ob.delete([6])
    ob.close()
    ob = Outbox(path, 100)
    assert ob.depth == 0 and ob.enqueue("t", {}) == 7  # even when empty, seq is not reused


def test_outbox_reservation_holds_later_rows(tmp_path):
    ob = Outbox(str(tmp_path / "ob.sqlite"), 100)
    ob.enqueue("t", {"i": 0})
    held = ob.reserve("t")
    ob.enqueue("t", {"i": 2})
    assert [r[2]["i"] for r in _rows(ob)] == [0]  # nothing passes the undecided row
    ob.fill(held, "t2", {"i": 1, "state": "accepted"}, ledger_job_id="jx")
    assert [r[2]["i"] for r in _rows(ob)] == [0, 1, 2]
    assert ob.in_ledger("jx") and not ob.in_ledger("jy")
    h2 = ob.reserve("t")
    ob.release(h2)
    assert ob.depth == 3
    h3 = ob.reserve("t")
    ob.close()
    ob = Outbox(str(tmp_path / "ob.sqlite"), 100)  # a crash left a reservation: it is dropped
    assert ob.depth == 3 and [r[0] for r in _rows(ob)] == [1, 2, 3]
    assert h3 == 5 and ob.in_ledger("jx")




def _fill(ob, states):
    for i, st in enumerate(states):
        ob.enqueue("t", {"state": st, "i": i})


def test_outbox_drop_oldest_terminal(tmp_path):
    drops = []
    ob = Outbox(str(tmp_path / "ob.sqlite"), 4, "drop_oldest_terminal", on_drop=lambda n, p: drops.append((n, p)))
    _fill(ob, ["accepted", "running", "succeeded", "running", "failed", "scheduled"])
    # the two intermediate 'running' rows went first; final answers stayed
    assert [r[2]["i"] for r in _rows(ob)] == [0, 2, 4, 5]
    _fill(ob, ["succeeded", "succeeded"])
    # next the intermediate 'scheduled' (i=5), then the oldest final one (i=0)
    assert [r[2]["state"] for r in _rows(ob)] == ["succeeded", "failed", "succeeded", "succeeded"]
    assert sum(n for n, _ in drops) == 4 and ob.depth == 4


def test_outbox_drop_oldest_and_reject_new(tmp_path):
    ob = Outbox(str(tmp_path / "a.sqlite"), 3, "drop_oldest")
    _fill(ob, ["accepted", "running", "succeeded", "running"])
    assert [r[2]["i"] for r in _rows(ob)] == [1, 2, 3]
    drops = []
    ob = Outbox(str(tmp_path / "b.sqlite"), 3, "reject_new", on_drop=lambda n, p: drops.append(n))
    _fill(ob, ["accepted", "running", "succeeded", "running"])
    assert [r[2]["i"] for r in _rows(ob)] == [0, 1, 2] and drops == [1]
    with pytest.raises(ValueError):
        Outbox(str(tmp_path / "c.sqlite"), 3, "drop_everything")


def test_keep_state():
    assert keep_state({"state": "accepted"}) and keep_state({"state": "killed"}) and keep_state({"seq": 1})
    assert not keep_state({"state": "running"}) and not keep_state({"state": "retrying"})


def test_publisher_window_ack_and_redelivery_mark(tmp_path):
    path = str(tmp_path / "ob.sqlite")
    ob = Outbox(path, 1000)
    for i in range(10):
        ob.enqueue("t", {"i": i})
    link = FakeLink()
    pub = OutboxPublisher(ob, link, window=4)
    pub.step()
    assert [d["i"] for _, _, d in link.sent] == [0, 1, 2, 3]
    pub.step()
    assert len(link.sent) == 4  # window full until acknowledged
    for mid, _, _ in link.sent[:2]:
        pub.on_publish(mid)
    pub.step()
    assert [d["i"] for _, _, d in link.sent] == [0, 1, 2, 3, 4, 5] and ob.depth == 8
    assert not any(d.get("redelivery") for _, _, d in link.sent)
    ob.close()
    # a new process: rows handed to the broker before are marked as a redelivery
    ob = Outbox(path, 1000)
    link2 = FakeLink()
    pub = OutboxPublisher(ob, link2, window=100)
    pub.step()
    got = [(d["i"], d.get("redelivery", False)) for _, _, d in link2.sent]
    assert got == [(2, True), (3, True), (4, True), (5, True), (6, False), (7, False), (8, False), (9, False)]


def test_publisher_after_the_link_replaced_its_client(tmp_path):
    """A reload's new broker client starts its message ids again and never resends what the
    old one had in flight: every unacknowledged row is sent again (an ack still queued from
    the old client counts for nothing: a duplicate, never a loss), and a PUBACK of the new
    client deletes only the row it sent under that mid."""
    ob = Outbox(str(tmp_path / "ob.sqlite"), 100)
    for i in range(4):
        ob.enqueue("t", {"i": i})
    link = FakeLink()
    pub = OutboxPublisher(ob, link, window=2)
    pub.step()          # rows 0 and 1 as mids 1 and 2 on the old client
    pub.on_publish(2)   # the old client's ack of row 1, not yet taken by a step
    link.mid = 0        # the new client: ids from 1 again
    pub.link_replaced()
    pub.step()
    sent = [(mid, d["i"], d.get("redelivery", False)) for mid, _, d in link.sent]
    assert sent[2:] == [(1, 0, True), (2, 1, True)], sent
    pub.on_publish(2)   # the new client's mid 2: row 1
    pub.step()
    assert ob.depth == 3 and [(mid, d["i"]) for mid, _, d in link.sent[4:]] == [(3, 2)]


def test_publisher_waits_while_disconnected(tmp_path):
    ob = Outbox(str(tmp_path / "ob.sqlite"), 10)
    ob.enqueue("t", {"i": 0})
    link = FakeLink(connected=False)
    pub = OutboxPublisher(ob, link)
    pub.step()
    assert link.sent == [] and ob.depth == 1


def test_the_paho_adapter_and_the_test_fake_implement_the_link_protocol():
    from agent.cloud.link import Link
    from agent.cloud.mqtt import MqttLink
    from agent.config import MqttConfig

    assert isinstance(MqttLink(MqttConfig(url="mqtt://127.0.0.1:1"), "x"), Link)
    assert isinstance(FakeLink(), Link)


def test_paho_under_test_is_the_expected_one():
    """`make test-cloud-paho2` sets MILLWRIGHT_EXPECT_PAHO=2: prove the 2.x run really used 2.x."""
    from agent.cloud.mqtt import PAHO_MAJOR, MqttLink
    from agent.config import MqttConfig

    want = os.environ.get("MILLWRIGHT_EXPECT_PAHO")
    if want:
        assert PAHO_MAJOR == int(want)
    from agent.cloud.mqtt import SYNC_ACK_ENV

    link = MqttLink(MqttConfig(url="mqtt://127.0.0.1:1"), "x")
    if os.environ.get(SYNC_ACK_ENV) == "1":  # make test-cloud-sync-ack: the fallback is in use
        assert PAHO_MAJOR == 1 and not link.deferred_ack
    else:
        assert link.deferred_ack  # manual ack available on this paho


def test_unauthenticated_input_is_acknowledged_at_once_and_never_held(tmp_path):
    """The screen runs before routing: a non-owner holds only authentic, bound pushes."""
    import types

    from tests.support import cloudkit
    from agent.cloud.dispatch import Dispatcher
    from agent.cloud.ingest import Ingest
    from agent.jobs.signing import KeyRing, generate_hmac_secret

    ring = cloudkit.write_keys(str(tmp_path / "keys.yaml"))
    other = KeyRing.from_mapping({cloudkit.KID: {"alg": "hmac-sha256", "secret": generate_hmac_secret()}})
    topics = Topics("t", "a1")
    outbox = Outbox(str(tmp_path / "ob.sqlite"), 1000)
    ingest = Ingest(store=types.SimpleNamespace(shards=8), keyring=ring, templates={}, topics=topics, agent_id="a1",
                    max_bytes=4096, max_skew_s=300, cluster="t", outbox=outbox)
    link = FakeLink()
    acked = link.acked
    d = Dispatcher(ingest, link, topics, owned=lambda: frozenset(), grace_s=60.0)  # owns nothing: would hold
    msg = lambda payload: message(topics.push, payload, received=0.0)
    junk = [b"x", json.dumps(cloudkit.job_doc("real")).encode(), cloudkit.signed(cloudkit.job_doc("real"), other),
            cloudkit.signed(cloudkit.job_doc("real", cluster="u"), ring),
            cloudkit.signed({**cloudkit.job_doc("real"), "kind": "cancel"}, ring)]
    for p in junk:
        d.on_message(msg(p))
    assert len(acked) == len(junk) and d.pending == 0
    assert list(outbox.batch(0, 100)) == []   # only the owner of the digest's shard reports junk
    valid = msg(cloudkit.signed(cloudkit.job_doc("real"), ring))
    d.on_message(valid)
    assert d.pending == 1 and valid not in acked   # held for the owner, as before
    outbox.close()


class _SlowIngest:
    """Ingest stand-in (our own interface): the durable write takes a while."""

    max_bytes, shards = 65536, 8

    def __init__(self):
        self.durable = []

    def screen(self, kind, payload, responsible):
        return None  # authentic and bound (the screen itself is tested above)

    def push(self, payload, as_owner, screened=False):
        time.sleep(0.2)
        self.durable.append((json.loads(payload)["id"], as_owner))
        return type("Outcome", (), {"result": "accepted"})()


@pytest.mark.parametrize("owned", [True, False])
def test_without_deferred_ack_the_push_is_durable_before_on_message_returns(owned):
    """paho 1.x without _send_puback acks when the callback returns: the dispatcher must
    finish the durable write inside on_message (owner or not: it cannot hold the message)."""
    from agent.cloud.dispatch import Dispatcher
    from agent.cloud.topics import Topics

    # a link whose client acknowledges when on_message returns (no deferred ack)
    ingest, link, topics = _SlowIngest(), FakeLink(deferred_ack=False), Topics("t")
    d = Dispatcher(ingest, link, topics, owned=lambda: frozenset(range(8)) if owned else frozenset(), grace_s=1.5)
    msg = message(topics.push, json.dumps({"id": "j1"}).encode(), mid=7)
    d.on_message(msg)   # no worker threads started: only on_message itself can have stored it
    assert ingest.durable == [("j1", owned)]
    assert [m.mid for m in link.acked] == [7] and d.pending == 0


class _BatchIngest:
    """Ingest stand-in (our own interface) that records when each push became durable;
    the first attempt of the ids in ``fail`` meets an etcd outage."""

    max_bytes, shards = 65536, 8

    def __init__(self, events, fail=()):
        self.events, self.fail, self.batches = events, set(fail), []

    def screen(self, kind, payload, responsible):
        return None

    def push_many(self, items, screened=False):
        from agent.cloud.ingest import Outcome
        from agent.coordination.etcd import EtcdUnavailable

        ids = [json.loads(p)["id"] for p, _ in items]
        self.batches.append(ids)
        out = []
        for i in ids:
            if i in self.fail:
                self.fail.discard(i)
                out.append(EtcdUnavailable("etcd down"))
            else:
                self.events.append(("durable", i))
                out.append(Outcome("push", "accepted", i))
        return out

    def push(self, payload, as_owner, screened=False):
        from agent.cloud.ingest import Outcome

        i = json.loads(payload)["id"]
        self.events.append(("durable-alone", i))
        return Outcome("push", "accepted", i)


def test_group_commit_acks_each_push_after_its_own_write():
    """What queued while a transaction was in flight goes to the store as one batch; a push
    whose write failed is retried alone and acknowledged only after that write."""
    from agent.cloud.dispatch import Dispatcher

    events: list = []
    ingest, topics = _BatchIngest(events, fail={"j2"}), Topics("t")
    link = FakeLink(on_ack=lambda m: events.append(("ack", m.mid)))
    d = Dispatcher(ingest, link, topics, owned=lambda: frozenset(range(8)), grace_s=1.5, workers=1)
    for n in range(5):   # queued before the worker starts: as if a transaction was in flight
        d.on_message(message(topics.push, json.dumps({"id": f"j{n}"}).encode(), mid=n))
    d.start()
    try:
        deadline = time.monotonic() + 10
        while sum(e[0] == "ack" for e in events) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        d.stop()
    assert ingest.batches == [["j0", "j1", "j2", "j3", "j4"]]
    assert ("durable-alone", "j2") in events
    for n in range(5):
        durable = next(k for k, e in enumerate(events) if e[0].startswith("durable") and e[1] == f"j{n}")
        assert events.index(("ack", n)) > durable   # never acknowledged before its own write


def test_outbox_enqueue_many_keeps_order_and_policy(tmp_path):
    ob = Outbox(str(tmp_path / "m.sqlite"), 3, "reject_new", on_drop=lambda n, p: drops.append(n))
    drops: list = []
    ob.enqueue_many([("t/a", {"state": "scheduled", "i": i}, None) for i in range(2)])
    ob.enqueue_many([("t/b", {"state": "scheduled", "i": i}, "m") for i in range(2, 5)])
    rows = ob.batch(0, 10)
    assert [json.loads(r[2])["i"] for r in rows] == [0, 1, 2] and [r[0] for r in rows] == [1, 2, 3]
    assert drops == [2] and ob.depth == 3 and ob.has_marker("m")
    ob.close()


# --------------------------------------------------------------------------- broker and transport

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "packaging", "debian", "examples")


def _settings_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.startswith("#")]


def test_the_shipped_broker_examples_are_the_generators_output():
    import yaml

    from agent.cloud.broker import acl_text, settings_text
    from agent.config import MqttConfig

    with open(os.path.join(EXAMPLES, "mosquitto-acl.conf")) as fh:
        shipped = _settings_lines(fh.read())
    assert shipped == _settings_lines(acl_text("plant-a", {"gw-01": "gw-01", "gw-02": "gw-02"}, ["cloud", "cloud-ops"]))
    with open(os.path.join(EXAMPLES, "mosquitto-millwright.conf")) as fh:
        conf = _settings_lines(fh.read())
    # the shipped agent.yaml does not pass the check until etcd is set up: read its value only
    with open(os.path.join(EXAMPLES, "..", "..", "..", "configs", "agent.yaml")) as fh:
        size = (yaml.safe_load(fh).get("mqtt") or {}).get("max_payload_bytes", MqttConfig().max_payload_bytes)
    assert set(_settings_lines(settings_text(size))) <= set(conf)
    assert {"allow_anonymous false", "per_listener_settings false"} <= set(conf)
    assert not [line for line in conf if "#" in line]  # mosquitto reads a comment after a value as the value


def test_the_broker_acl_has_a_user_block_per_client_and_no_patterns():
    from agent.cloud.broker import acl_text

    text = acl_text("t", {"a1": "a1", "a2": "user-2"}, ["cloud"])
    assert "pattern" not in text and "%u" not in text
    blocks = {b.splitlines()[0]: b.splitlines()[1:] for b in text.split("\n\n") if b.startswith("user ")}
    writes = {user: [line for line in lines if line.startswith("topic write")] for user, lines in blocks.items()}
    assert writes == {"user cloud": ["topic write millwright/t/jobs/push", "topic write millwright/t/jobs/cancel",
                                     "topic write millwright/t/jobs/get"],
                      "user a1": ["topic write millwright/t/agents/a1/#"],
                      "user user-2": ["topic write millwright/t/agents/a2/#"]}
    for bad in (lambda: acl_text("a b", {}, ["cloud"]), lambda: acl_text("t", {"a/1": "a1"}, []),
                lambda: acl_text("t", {"a1": "a 1"}, []), lambda: acl_text("t", {"a1": "a1"}, [], ["plant/#"]),
                lambda: acl_text("t", {"a1": "a1"}, [], ["millwright/t/jobs/push"])):
        with pytest.raises(ValueError):
            bad()


def test_an_agent_reads_no_agents_statuses():
    """One connection per agent, which reads no other agent's statuses (its own neither):
    an agent's block reads only the cluster's push, cancel and get topics and the gates."""
    from agent.cloud.broker import acl_text
    from agent.config import parse_config
    from agent.configcheck import ignored_peers_keys, mqtt_insecurities

    text = acl_text("t", {"a1": "a1", "a2": "a2"}, ["cloud"], ["plant/line2/state"])
    blocks = {b.splitlines()[0]: b.splitlines()[1:] for b in text.split("\n\n") if b.startswith("user ")}
    for agent in ("a1", "a2"):
        reads = [line for line in blocks[f"user {agent}"] if line.startswith("topic read")]
        assert reads == ["topic read millwright/t/jobs/push", "topic read millwright/t/jobs/cancel",
                         "topic read millwright/t/jobs/get", "topic read plant/line2/state"], reads
    assert "status" not in text.replace("topic read millwright/t/agents/#", "")   # only the cloud reads them
    # a config that still names a peers user loads, and is told it is ignored
    base = "etcd: {insecure: true}\nmqtt: {url: 'mqtts://b:8883', tls: {ca: /ca, cert: /c.pem, key: /c.key}, "
    cfg = parse_config(base + "peers_username: p}")
    assert mqtt_insecurities(cfg) == []
    (line,) = ignored_peers_keys(cfg)
    assert "mqtt.peers_username: ignored" in line
    assert ignored_peers_keys(parse_config("etcd: {insecure: true}\nmqtt: {insecure: true, username: gw-1, "
                                           "peers_username: gw-1}"))


def test_gate_topics_are_read_by_every_agent_and_written_by_no_user_of_the_acl():
    from agent.cloud.broker import acl_text

    text = acl_text("t", {"a1": "a1", "a2": "a2"}, ["cloud"], ["plant/line2/state"])
    blocks = {b.splitlines()[0]: b.splitlines()[1:] for b in text.split("\n\n") if b.startswith("user ")}
    assert [user for user, lines in blocks.items() if "topic read plant/line2/state" in lines] == ["user a1", "user a2"]
    assert "write plant/line2/state" not in text


def test_plain_or_anonymous_mqtt_is_refused_unless_insecure(tmp_path, capsys):
    from agent.cli import main
    from agent.config import ConfigError, parse_config
    from agent.configcheck import mqtt_insecurities, require_secure_mqtt

    problems = mqtt_insecurities(parse_config("cluster: t\netcd: {insecure: true}\n", "agent.yaml"))
    assert [p.split(":")[1].strip() for p in problems] == ["mqtt.url", "mqtt.username"]
    assert all(p.startswith("agent.yaml: ") and "mqtt.insecure: true" in p for p in problems)
    for ok in ("mqtt: {url: 'mqtts://b:8883', username: gw-1, password: p}",
               "mqtt: {url: 'mqtts://b:8883', tls: {ca: /ca, cert: /c.pem, key: /c.key}}",
               "mqtt: {url: 'mqtt://b:8883', username: gw-1, password: p, tls: {ca: /ca}}",  # TLS on the mqtt port
               "mqtt: {insecure: true}"):
        assert mqtt_insecurities(parse_config("etcd: {insecure: true}\n" + ok)) == [], ok
    assert [p.split(":")[1].strip() for p in mqtt_insecurities(parse_config(
        "etcd: {insecure: true}\nmqtt: {url: 'mqtts://b:8883', tls: {ca: /ca}}"))] == ["mqtt.username"]
    with pytest.raises(ConfigError):
        require_secure_mqtt(parse_config("cluster: t\netcd: {insecure: true}\n"))
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("cluster: t\netcd: {insecure: true}\n")
    assert main(["config", "check", str(cfg)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "mqtt.url" in err[0] and "mqtt.username" in err[1]
    assert main(["get", "-c", str(cfg), "j", "--key-file", "/nonexistent", "--kid", "k"]) == 2
    assert "mqtt.insecure: true" in capsys.readouterr().err
    cfg.write_text("cluster: t\nagent_id: gw-1\netcd: {insecure: true}\n"
                   "mqtt: {url: 'mqtts://b:8883', username: gw-1, password: p}\n")
    cfg.chmod(0o600)   # it holds a password
    assert main(["push", "-c", str(cfg), "job.json", "--key-file", "/nonexistent", "--kid", "k"]) == 2
    assert "a cloud user" in capsys.readouterr().err  # an agent's own broker identity is not for the CLI
