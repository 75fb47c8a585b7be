"""Issue 16, acceptance 4: coordination and ingest against a TLS etcd with authentication
and per-cluster roles (set up by packaging/debian/examples/etcd-rbac.sh) and a TLS
mosquitto with passwords and the shipped ACL and settings (agent/cloud/broker.py);
an agent cannot publish another agent's statuses, nor push jobs, nor touch another
cluster's keys. Certificates are made per test in tmp (python3-cryptography)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from agent.cloud.broker import acl_text, settings_text
from agent.cloud.mqtt import MqttLink
from tests.support.cloudkit import StatusCollector, TEMPLATES, job_doc, signed
from agent.cloud.topics import Topics
from agent.config import EtcdConfig, MqttConfig, TLSConfig
from agent.coordination.etcd import EtcdClient, EtcdError, EtcdUnavailable
from agent.coordination.keys import Keys
from agent.demo.services import EtcdServer, MosquittoServer, make_pki
from tests.support.cluster import Cluster
from tests.support.waiting import wait_for

T = Topics("t")
USERS = {"cloud": "cloud-pw", "cloud-pusher": "pusher-pw", "a1": "a1-pw", "a2": "a2-pw"}
RUN = {"run": {"argv": ["/bin/true"], "user": "root", "allow_root": True, "allow_exec": ["/bin/true", "/usr/bin/true"]}}


@pytest.fixture
def pki(tmp_path):
    return make_pki(str(tmp_path / "pki"))


@pytest.fixture
def secure_etcd(tmp_path, pki):
    with EtcdServer(str(tmp_path / "etcd"), tls=pki) as srv:
        srv.enable_auth("t", "agents-t", "pw-t", "root-pw")
        srv.enable_auth("u", "agents-u", "pw-u", "root-pw")
        yield srv


@pytest.fixture
def secure_mqtt(tmp_path, pki):
    # the shipped configuration (packaging/debian/examples/mosquitto-acl.conf and
    # mosquitto-millwright.conf are this generator's output), for this cluster and agents
    acl = acl_text("t", {"a1": "a1", "a2": "a2"}, ["cloud", "cloud-pusher"])
    with MosquittoServer(str(tmp_path / "mosquitto"), tls=pki, users=USERS, acl=acl,
                         extra_conf=settings_text(65536)) as srv:
        yield srv


def etcd_access(pki, user="agents-t", password="pw-t") -> dict:
    return {"tls": {"ca": pki.ca}, "username": user, "password": password}


def mqtt_cfg(srv, pki, user: str) -> MqttConfig:
    return MqttConfig(url=srv.url, username=user, password=USERS[user], tls=TLSConfig(ca=pki.ca))


def link(srv, pki, user: str, client_id: str, on_message=None, subscriptions=()) -> MqttLink:
    got = MqttLink(mqtt_cfg(srv, pki, user), client_id, clean_session=True, on_message=on_message,
                   subscriptions=subscriptions, topic_kind=T.kind, reconnect_min_s=0.2, reconnect_max_s=1.0)
    got.start()
    assert got.wait_connected(10), f"{user} could not connect"
    return got


def test_coordination_and_stored_jobs_over_tls_etcd_with_auth(secure_etcd, pki, tmp_path):
    c = Cluster(secure_etcd, str(tmp_path / "agents"), shards=16, etcd_access=etcd_access(pki),
                extra={"templates": RUN})
    try:
        c.start("a1")
        c.start("a2")
        wait_for(lambda: c.converged({"a1": 1, "a2": 1}), 40, interval=0.2, what="2-way plan over TLS + auth")
        store = c.job_store()
        for i in range(6):
            store.create({"v": 1, "id": f"tls-{i}", "template": "run", "params": {}, "schedule": {}})

        def done():
            return {r["job_id"] for r in c.run_records().values() if r["state"] == "succeeded"}
        wait_for(lambda: done() == {f"tls-{i}" for i in range(6)}, 40, interval=0.2, what="every job ran once")
        c.agents["a1"].kill()
        wait_for(lambda: c.all_owned_by({"a2"}), 30, interval=0.2, what="failover over TLS + auth")
    finally:
        c.close()


def test_etcd_roles_confine_an_agent_to_its_cluster(secure_etcd, pki):
    def client(**kw):
        access = {**etcd_access(pki), **kw}
        access["tls"] = TLSConfig(**access["tls"])
        return EtcdClient(EtcdConfig(endpoints=[secure_etcd.endpoint], request_timeout_s=3.0, **access))

    own = client()
    try:
        own.put(Keys("t").prefix + "probe", "ok")
        assert own.get(Keys("t").prefix + "probe").value == b"ok"
        for op in (lambda: own.get(Keys("u").prefix + "probe"), lambda: own.put(Keys("u").prefix + "x", "1"),
                   lambda: own.put("/elsewhere", "1")):
            with pytest.raises(Exception) as ei:
                op()
            assert "permission denied" in str(ei.value).lower(), ei.value
    finally:
        own.close()
    wrong = client(password="nope")
    try:
        # refused for the password: not a timeout or an unreachable server
        with pytest.raises(EtcdError, match="authentication failed") as info:
            wrong.get(Keys("t").prefix + "probe")
        assert not isinstance(info.value, EtcdUnavailable)
    finally:
        wrong.close()


def test_ingest_over_tls_mosquitto_with_passwords_and_acl(secure_etcd, secure_mqtt, pki, tmp_path):
    c = Cluster(secure_etcd, str(tmp_path / "agents"), shards=8, etcd_access=etcd_access(pki),
                extra={"templates": TEMPLATES})
    col = StatusCollector(secure_mqtt.url, "t", extra_filters=(T.presence_filter(),),
                          mqtt_cfg=mqtt_cfg(secure_mqtt, pki, "cloud")).start()
    pusher = link(secure_mqtt, pki, "cloud-pusher", "secure-pusher")
    try:
        for agent in ("a1", "a2"):  # secure: no mqtt.insecure needed
            c.start(agent, extra={"mqtt": {"url": secure_mqtt.url, "username": agent, "password": USERS[agent],
                                           "tls": {"ca": pki.ca}, "reconnect_min_s": 0.2, "reconnect_max_s": 1.0,
                                           "insecure": False}})
        wait_for(lambda: c.converged({"a1": 1, "a2": 1}), 40, interval=0.2, what="2-way plan")
        assert col.wait(lambda m: {T.presence(a) for a in ("a1", "a2")} <= {t for _, t, _ in m}, 30)
        ids = [f"sec-{i}" for i in range(20)]
        for i, j in enumerate(ids):
            assert pusher.publish_wait(T.push, signed(job_doc(j, line=str(i)), c.ring), 1, timeout=10)
        assert col.wait(lambda m: set(ids) <= {d.get("job_id") for d in col.docs("accepted")}, 60)
        # each status came from under the agent that signed it off
        for _, topic, d in col.messages:
            if T.kind(topic) == "status":
                assert T.agent_of(topic) == d["agent"], (topic, d)
    finally:
        pusher.stop()
        col.stop()
        c.close()


def test_an_agent_cannot_publish_another_agents_statuses_or_push_jobs(secure_mqtt, pki):
    seen: list = []
    lock = threading.Lock()

    def keep(msg):
        with lock:
            seen.append((msg.topic, msg.payload))
        watcher_links[0].ack(msg) if watcher_links else None

    watcher_links: list = []
    cloud = link(secure_mqtt, pki, "cloud", "cloud-watch", on_message=keep,
                 subscriptions=((T.status_filter(), 1), (T.rejections_filter(), 1)))
    watcher_links.append(cloud)
    a2_seen: list = []
    a2 = link(secure_mqtt, pki, "a2", "a2-watch", on_message=lambda m: a2_seen.append(m.topic),
              subscriptions=((T.push, 1),))
    a1 = link(secure_mqtt, pki, "a1", "a1-forger")
    try:
        time.sleep(0.3)
        forged = json.dumps({"v": 1, "job_id": "real-job", "state": "rejected", "agent": "a2"}).encode()
        assert a1.publish_wait(T.status("real-job", "a2"), forged, 1, timeout=10)   # as a2: denied
        assert a1.publish_wait(T.push, b'{"v":1}', 1, timeout=10)                   # a job push: denied
        marker = json.dumps({"v": 1, "job_id": "marker", "state": "running", "agent": "a1"}).encode()
        assert a1.publish_wait(T.status("marker", "a1"), marker, 1, timeout=10)     # its own: allowed
        wait_for(lambda: any(t == T.status("marker", "a1") for t, _ in list(seen)), 10, what="a1's own status")
        time.sleep(0.5)
        assert T.status("real-job", "a2") not in {t for t, _ in seen}
        assert T.push not in a2_seen
        # and nobody gets in without a password
        anon = MqttLink(MqttConfig(url=secure_mqtt.url, tls=TLSConfig(ca=pki.ca)), "anon", clean_session=True,
                        topic_kind=T.kind, reconnect_min_s=0.2, reconnect_max_s=1.0)
        anon.start()
        try:
            assert not anon.wait_connected(2)
        finally:
            anon.stop()
    finally:
        a1.stop()
        a2.stop()
        cloud.stop()
