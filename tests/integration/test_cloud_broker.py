"""Issue 34: the shipped broker configuration holds against a broker client. A mosquitto
runs with the ACL and settings `millwright broker acl|settings` generate for this test's
cluster and agents (password file by mosquitto_passwd): an agent cannot publish under
another agent's prefix, nor push, cancel or ask, nor read any agent's statuses; a message larger than the agents'
push cap never reaches anyone; a client id is its username, so nobody takes over an
agent's session; real agents ingest and answer jobs/get through it."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from agent.cloud.asking import Asker
from agent.cloud.broker import acl_text, settings_text
from agent.cloud.mqtt import MqttLink
from agent.cloud.topics import Topics
from agent.config import MqttConfig
from agent.demo.services import MosquittoServer
from agent.daemon.admin import query
from tests.support.cloudkit import KID, TEMPLATES, StatusCollector, job_doc, signed
from tests.support.cluster import Cluster
from tests.support.waiting import wait_for

T = Topics("t")
LIMIT = 65536  # mqtt.max_payload_bytes (the default)
USERS = {"cloud": "cloud-pw", "cloud-watch": "watch-pw", "a1": "a1-pw", "a2": "a2-pw"}


@pytest.fixture
def broker(tmp_path):
    acl = acl_text("t", {"a1": "a1", "a2": "a2"}, ["cloud", "cloud-watch"])
    with MosquittoServer(str(tmp_path / "mosquitto"), users=USERS, acl=acl, extra_conf=settings_text(LIMIT)) as srv:
        yield srv


def cfg(srv, user: str) -> MqttConfig:
    return MqttConfig(url=srv.url, username=user, password=USERS[user], insecure=True)


class Client:
    """A connected client as ``user`` that keeps what it receives (topic, payload)."""

    def __init__(self, srv, user: str, client_id: str, subscriptions=(), on_disconnect=None):
        self.got: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()
        self.link = MqttLink(cfg(srv, user), client_id, clean_session=True, on_message=self._msg,
                             on_disconnect=on_disconnect, subscriptions=subscriptions, topic_kind=T.kind,
                             reconnect_min_s=0.2, reconnect_max_s=1.0)
        self.link.start()
        assert self.link.wait_connected(10), f"{user} could not connect"
        time.sleep(0.2)  # the SUBACK

    def _msg(self, msg) -> None:
        self.link.ack(msg)
        with self.lock:
            self.got.append((msg.topic, msg.payload))

    def topics(self) -> set[str]:
        with self.lock:
            return {t for t, _ in self.got}

    def publish(self, topic: str, payload: bytes) -> None:
        # mosquitto acknowledges a QoS 1 publish it refuses (ACL, size) as if it took it
        assert self.link.publish_wait(topic, payload, 1, timeout=10)

    def stop(self) -> None:
        self.link.stop()


def test_an_agent_writes_only_under_its_own_prefix_and_nothing_too_large_passes(broker):
    watch = Client(broker, "cloud-watch", "w", ((T.status_filter(), 1), (T.get_reply_filter(), 1),
                                                 (T.presence_filter(), 1)))
    a2 = Client(broker, "a2", "a2", ((T.push, 1), (T.cancel, 1), (T.jobs_get, 1), (T.status_filter(), 1)))
    a1 = Client(broker, "a1", "a1")
    cloud = Client(broker, "cloud", "cloud")
    try:
        status = json.dumps({"v": 1, "job_id": "real-job", "state": "succeeded", "agent": "a2"}).encode()
        a1.publish(T.status("real-job", "a2"), status)               # as a2: denied
        a1.publish(T.get_reply("c-1", "a2"), b'{"agent":"a2"}')       # a jobs/get answer as a2: denied
        a1.publish(T.presence("a2"), b'{"state":"offline"}')          # a2's presence: denied
        a1.publish(T.push, b'{"v":1}')                                 # a job: denied
        a1.publish(T.cancel, b'{"v":1}')
        a1.publish(T.jobs_get, b'{"v":1}')
        a1.publish(T.status("big", "a1"), b"x" * (LIMIT + 1))          # its own, but too large
        a1.publish(T.status("marker", "a1"), b'{"state":"running"}')  # its own: allowed
        cloud.publish(T.push, b"p" * (LIMIT + 1))                      # a push over the agents' cap
        cloud.publish(T.push, b'{"small":1}')                          # the cloud's own push: allowed
        wait_for(lambda: T.status("marker", "a1") in watch.topics() and T.push in a2.topics(), 10,
                 what="the allowed messages")
        time.sleep(1.0)  # the denied ones were published first: had one passed, it would be here
        assert watch.topics() == {T.status("marker", "a1")}, watch.topics()
        assert [p for t, p in a2.got if t == T.push] == [b'{"small":1}']
        assert {t for t, _ in a2.got} == {T.push}   # no agent's status, though a2 asked for all
    finally:
        for c in (a1, a2, cloud, watch):
            c.stop()


def test_a_client_id_is_its_username(broker):
    """use_username_as_clientid: a second connection with an agent's credentials and another
    client id still takes the agent's session, so nobody can hold two (or pose as one
    without its password)."""
    drops = threading.Event()
    first = Client(broker, "a1", "millwright-t-a1", on_disconnect=lambda rc: drops.set())
    second = Client(broker, "a1", "something-else")
    try:
        assert drops.wait(10), "the first a1 connection was not taken over"
    finally:
        second.stop()
        first.stop()


def test_agents_work_through_the_generated_broker_config(broker, etcd_server, tmp_path):
    c = Cluster(etcd_server, str(tmp_path / "agents"), shards=8, extra={"templates": TEMPLATES})
    col = StatusCollector(broker.url, "t", mqtt_cfg=cfg(broker, "cloud-watch")).start()
    ask = Asker(cfg(broker, "cloud"), "t", c.ring, KID)
    assert ask.start(10)
    try:
        for agent in ("a1", "a2"):   # a1's config still names a peers user: ignored (a warning)
            c.start(agent, extra={"mqtt": {"url": broker.url, "username": agent, "password": USERS[agent],
                                           "reconnect_min_s": 0.2, "reconnect_max_s": 1.0,
                                           **({"peers_username": "a1-peers"} if agent == "a1" else {})}})
        wait_for(lambda: c.converged({"a1": 1, "a2": 1}), 40, interval=0.2, what="2-way plan")
        ids = [f"acl-{i}" for i in range(10)]
        for i, j in enumerate(ids):
            assert ask.link.publish_wait(T.push, signed(job_doc(j, line=str(i)), c.ring), 1, timeout=10)
        assert col.wait(lambda m: set(ids) <= {d.get("job_id") for d in col.docs("accepted")}, 60)
        for _, topic, d in col.messages:
            assert T.agent_of(topic) == d["agent"], (topic, d)
        got = ask.list({}, timeout=60)
        assert got["complete"] and {j["id"] for j in got["jobs"]} == set(ids)
        assert {agent for agent, _, _ in got["pages"]} == {"a1", "a2"}
        cloud_a1 = query(os.path.join(c.agents["a1"].dir, "admin.sock"))["cloud"]
        assert cloud_a1["connected"] and "peers_link" not in cloud_a1, cloud_a1   # one connection per agent
        assert cloud_a1["statuses_received"] == 0, cloud_a1
    finally:
        ask.stop()
        col.stop()
        c.close()
