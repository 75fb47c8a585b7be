"""Issue 16, acceptance 4, and issue 34: coordination and ingest against a TLS etcd with
authentication, a user per agent confined to its cluster's prefix (set up by
packaging/debian/examples/etcd-rbac.sh, as an operator would) and a TLS mosquitto with
passwords and the shipped ACL and settings (agent/cloud/broker.py). An agent
starts against it without `etcd.insecure` and refuses a plaintext or credential-less etcd
without it; an agent cannot touch another cluster's keys, nor publish another agent's
statuses, nor push jobs; revoking one agent's etcd user stops that agent alone.
Certificates are made per test in tmp (python3-cryptography)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
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
from agent.demo.services import AgentProcess, EtcdServer, MosquittoServer, make_pki
from tests.support.cluster import Cluster
from tests.support.commands import millwright
from tests.support.waiting import wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T = Topics("t")
USERS = {"cloud": "cloud-pw", "cloud-pusher": "pusher-pw", "a1": "a1-pw", "a2": "a2-pw"}
RUN = {"run": {"argv": ["/bin/true"], "user": "root", "allow_root": True, "allow_exec": ["/bin/true", "/usr/bin/true"]}}
# etcd users: one per agent (cluster t: a1, a2; cluster u: b1) and the cloud's for both
ETCD_AGENTS = {("t", "a1"): "a1-etcd-pw", ("t", "a2"): "a2-etcd-pw", ("u", "b1"): "b1-etcd-pw"}


@pytest.fixture
def pki(tmp_path):
    return make_pki(str(tmp_path / "pki"))


@pytest.fixture
def secure_etcd(tmp_path, pki):
    with EtcdServer(str(tmp_path / "etcd"), tls=pki) as srv:
        srv.enable_auth("root-pw")
        for (cluster, agent), password in ETCD_AGENTS.items():
            assert srv.add_agent(cluster, agent, password) == f"agent.{cluster}.{agent}"
        srv.add_ops("cloud", "cloud-etcd-pw", "t", "u")
        yield srv


@pytest.fixture
def secure_mqtt(tmp_path, pki):
    # the shipped configuration (packaging/debian/examples/mosquitto-acl.conf and
    # mosquitto-millwright.conf are this generator's output), for this cluster and agents
    acl = acl_text("t", {"a1": "a1", "a2": "a2"}, ["cloud", "cloud-pusher"])
    with MosquittoServer(str(tmp_path / "mosquitto"), tls=pki, users=USERS, acl=acl,
                         extra_conf=settings_text(65536)) as srv:
        yield srv


def ops_access(pki) -> dict:
    """The cloud's etcd user: what the tests' own client (Cluster.client) reads with."""
    return {"tls": {"ca": pki.ca}, "username": "cloud", "password": "cloud-etcd-pw"}


def agent_etcd(cluster: str, agent: str) -> dict:
    """The agent's own etcd user, for its agent.yaml."""
    return {"etcd": {"username": f"agent.{cluster}.{agent}", "password": ETCD_AGENTS[(cluster, agent)]}}


def etcd_client(srv, pki, username: str, password: str) -> EtcdClient:
    return EtcdClient(EtcdConfig(endpoints=[srv.endpoint], request_timeout_s=3.0, tls=TLSConfig(ca=pki.ca),
                                 username=username, password=password))


def as_agent(srv, pki, cluster: str, agent: str) -> EtcdClient:
    return etcd_client(srv, pki, f"agent.{cluster}.{agent}", ETCD_AGENTS[(cluster, agent)])


def mqtt_cfg(srv, pki, user: str) -> MqttConfig:
    return MqttConfig(url=srv.url, username=user, password=USERS[user], tls=TLSConfig(ca=pki.ca))


def link(srv, pki, user: str, client_id: str, on_message=None, subscriptions=()) -> MqttLink:
    got = MqttLink(mqtt_cfg(srv, pki, user), client_id, clean_session=True, on_message=on_message,
                   subscriptions=subscriptions, topic_kind=T.kind, reconnect_min_s=0.2, reconnect_max_s=1.0)
    got.start()
    assert got.wait_connected(10), f"{user} could not connect"
    return got


def denied(op) -> str:
    """The error of an etcd operation that must be refused for its permissions."""
    with pytest.raises(EtcdError) as ei:
        op()
    assert not isinstance(ei.value, EtcdUnavailable), ei.value
    return str(ei.value).lower()


def test_coordination_and_stored_jobs_over_tls_etcd_with_auth(secure_etcd, pki, tmp_path):
    c = Cluster(secure_etcd, str(tmp_path / "agents"), shards=16, etcd_access=ops_access(pki),
                extra={"templates": RUN})
    try:
        for agent in ("a1", "a2"):
            a = c.start(agent, extra=agent_etcd("t", agent))
            assert "insecure" not in a.config["etcd"] and a.config["etcd"]["endpoints"][0].startswith("https://")
            check = millwright("config", "check", a.config_path)
            assert check.returncode == 0, check.stderr   # TLS and its own user: nothing to allow
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


def start_refused(tmp_path, name: str, etcd: dict) -> str:
    """Start an agent (a `millwright run` process) that must refuse its config; its stderr."""
    a = AgentProcess(name, str(tmp_path / "refused"), {"cluster": "t", "bpf": {"enabled": False}, "etcd": etcd})
    a.start()
    assert a.proc is not None and a.proc.wait(30) == 2, a.log_text()
    return a.log_text()


def test_without_insecure_a_plaintext_or_credential_less_etcd_is_refused(secure_etcd, pki, tmp_path):
    # a reachable plaintext etcd, with credentials: refused before any connection
    with EtcdServer(str(tmp_path / "plain-etcd")) as plain:
        log = start_refused(tmp_path, "plain", {"endpoints": [plain.endpoint], "username": "agent.t.a1",
                                                "password": ETCD_AGENTS[("t", "a1")]})
        assert log.strip().splitlines() == [
            f"millwright: config: {tmp_path}/refused/plain/agent.yaml: etcd.endpoints[0]: '{plain.endpoint}' "
            "is plaintext: use https:// with etcd.tls, or set etcd.insecure: true (tests and labs only)"]
        assert plain.proc is not None and plain.proc.poll() is None
    # the TLS etcd without a user: refused too
    log = start_refused(tmp_path, "anon", {"endpoints": [secure_etcd.endpoint], "tls": {"ca": pki.ca}})
    lines = log.strip().splitlines()
    assert len(lines) == 1 and "etcd.username: etcd without credentials is refused" in lines[0], log
    assert "etcd.insecure: true" in lines[0] and "Traceback" not in log
    # and that etcd refuses an anonymous client anyway
    anon = EtcdClient(EtcdConfig(endpoints=[secure_etcd.endpoint], request_timeout_s=3.0, tls=TLSConfig(ca=pki.ca)))
    try:
        assert "user name is empty" in denied(lambda: anon.put(Keys("t").prefix + "x", "1"))
    finally:
        anon.close()


def test_etcd_roles_confine_an_agent_to_its_cluster(secure_etcd, pki):
    own = as_agent(secure_etcd, pki, "t", "a1")
    other = as_agent(secure_etcd, pki, "u", "b1")
    try:
        own.put(Keys("t").prefix + "probe", "ok")
        assert own.get(Keys("t").prefix + "probe").value == b"ok"
        other.put(Keys("u").prefix + "probe", "theirs")
        for op in (lambda: own.get(Keys("u").prefix + "probe"), lambda: own.put(Keys("u").prefix + "x", "1"),
                   lambda: own.get_prefix(Keys("u").prefix), lambda: own.delete(Keys("u").prefix + "probe"),
                   lambda: own.put("/elsewhere", "1"), lambda: own.get_prefix("/millwright/"),
                   lambda: other.get(Keys("t").prefix + "probe")):
            assert "permission denied" in denied(op)
    finally:
        own.close()
        other.close()
    wrong = etcd_client(secure_etcd, pki, "agent.t.a1", "nope")
    try:
        # refused for the password: not a timeout or an unreachable server
        assert "authentication failed" in denied(lambda: wrong.get(Keys("t").prefix + "probe"))
    finally:
        wrong.close()


def test_each_agent_has_its_own_user_and_revoking_one_stops_it_alone(secure_etcd, pki, tmp_path):
    """Cluster t: a1 and a2, cluster u: b1, each agent with its own etcd user. Revoking a1
    (etcd-rbac.sh revoke) ends its session: its requests fail, its shards go to a2, which
    keeps the shards it held all along; cluster u does not notice."""
    t = Cluster(secure_etcd, str(tmp_path / "t"), cluster="t", shards=16, etcd_access=ops_access(pki))
    u = Cluster(secure_etcd, str(tmp_path / "u"), cluster="u", shards=8, etcd_access=ops_access(pki))
    try:
        for agent in ("a1", "a2"):
            t.start(agent, extra=agent_etcd("t", agent))
        u.start("b1", extra=agent_etcd("u", "b1"))
        wait_for(lambda: t.converged({"a1": 1, "a2": 1}), 40, interval=0.2, what="cluster t: a1 and a2")
        wait_for(lambda: u.all_owned_by({"b1"}), 40, interval=0.2, what="cluster u: b1")
        shard_keys = t.keys.shards_prefix()
        before = {kv.key: kv for kv in t.client.get_prefix(shard_keys)[0]}
        kept = {k: kv.create_revision for k, kv in before.items() if kv.value == b"a2"}
        u_before = {kv.key: kv.create_revision for kv in u.client.get_prefix(u.keys.shards_prefix())[0]}
        assert kept and len(kept) < 16

        out = secure_etcd.revoke_agent("t", "a1")
        assert "user agent.t.a1 deleted" in out and "session lease" in out, out

        # a1's credentials no longer open etcd
        gone = as_agent(secure_etcd, pki, "t", "a1")
        try:
            assert "authentication failed" in denied(lambda: gone.get(t.keys.shards_prefix()))
        finally:
            gone.close()
        # its shards moved to a2 (its lease was revoked: no waiting for the TTL), and a2 kept
        # its own: the same keys, never released and claimed again
        wait_for(lambda: t.all_owned_by({"a2"}), 20, interval=0.2, what="a1's shards taken over by a2")
        after = {kv.key: kv for kv in t.client.get_prefix(shard_keys)[0]}
        assert {k: after[k].create_revision for k in kept} == kept
        assert "a1" not in t.members()
        # a1 keeps running and trying, and never comes back
        assert t.agents["a1"].alive()
        time.sleep(3 * t.ttl / 2)
        assert t.all_owned_by({"a2"}) and "a1" not in t.members()
        assert "authentication failed" in t.agents["a1"].log_text()
        # a2's user still works, and cluster u never noticed
        still = as_agent(secure_etcd, pki, "t", "a2")
        try:
            still.put(t.keys.prefix + "probe", "a2")
        finally:
            still.close()
        assert {kv.key: kv.create_revision for kv in u.client.get_prefix(u.keys.shards_prefix())[0]} == u_before
    finally:
        t.close()
        u.close()


def test_the_rbac_script_refuses_passwords_on_the_command_line_and_bad_names(secure_etcd):
    with pytest.raises(RuntimeError, match="give the password on stdin"):
        secure_etcd.rbac("agent", "t", "a9")
    with pytest.raises(RuntimeError, match="cluster must match"):
        secure_etcd.rbac("agent", "t.x", "a9", stdin="pw\n")
    with pytest.raises(RuntimeError, match="usage|agent id must match"):
        secure_etcd.rbac("agent", "t", "a 9", stdin="pw\n")
    r = subprocess.run(["sh", os.path.join(ROOT, "packaging", "debian", "examples", "etcd-rbac.sh")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "etcd-rbac.sh agent CLUSTER AGENT_ID" in r.stderr


def test_ingest_over_tls_mosquitto_with_passwords_and_acl(secure_etcd, secure_mqtt, pki, tmp_path):
    c = Cluster(secure_etcd, str(tmp_path / "agents"), shards=8, etcd_access=ops_access(pki),
                extra={"templates": TEMPLATES})
    col = StatusCollector(secure_mqtt.url, "t", extra_filters=(T.presence_filter(),),
                          mqtt_cfg=mqtt_cfg(secure_mqtt, pki, "cloud")).start()
    pusher = link(secure_mqtt, pki, "cloud-pusher", "secure-pusher")
    try:
        for agent in ("a1", "a2"):  # secure: neither etcd.insecure nor mqtt.insecure
            c.start(agent, extra={**agent_etcd("t", agent),
                                  "mqtt": {"url": secure_mqtt.url, "username": agent, "password": USERS[agent],
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
        # positive witnesses: the broker handled each denied message before it acknowledged
        # it (publish_wait), and delivers one session's messages in order; a marker sent
        # after them arrived, so a denied message that had got through would be there first
        wait_for(lambda: any(t == T.status("marker", "a1") for t, _ in list(seen)), 10, what="a1's own status")
        assert T.status("real-job", "a2") not in {t for t, _ in seen}
        assert cloud.publish_wait(T.push, b'{"v":1,"marker":true}', 1, timeout=10)   # the cloud may push
        wait_for(lambda: a2_seen, 10, what="the cloud's marker push at a2")
        assert a2_seen == [T.push], a2_seen   # only the cloud's: a1's push never came through
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


def _broken_for_writes():
    """A socket that reads nothing yet and fails every write (its peer shut reading: EPIPE),
    and that peer, to keep open: paho writes before it reads anything."""
    ours, peer = socket.socketpair()
    peer.shutdown(socket.SHUT_RD)
    ours.setblocking(False)
    return ours, peer


def test_a_tls_write_on_a_broken_connection_is_a_reconnect_not_a_dead_link(secure_mqtt, pki):
    """paho 1.6 ended its network thread on SSLEOFError (a TLS write on a broken
    connection), the link still marked connected; the adapter makes it a lost connection."""
    connects: list = []
    holder: list = []
    peers: list = []

    def on_message(msg):
        holder[0].ack(msg)
        if msg.payload == b"reset":   # the connection breaks under paho, then it writes
            broken, peer = _broken_for_writes()
            peers.append(peer)
            os.dup2(broken.fileno(), holder[0].client.socket().fileno())
            broken.close()
            holder[0].publish(T.status("after-reset", "a1"), b"x", 1)
    a1 = MqttLink(mqtt_cfg(secure_mqtt, pki, "a1"), "a1", clean_session=True, on_message=on_message,
                  on_connect=lambda gen, present: connects.append(gen), topic_kind=T.kind,
                  subscriptions=((T.push, 1),), reconnect_min_s=0.2, reconnect_max_s=1.0)
    holder.append(a1.start())
    cloud = link(secure_mqtt, pki, "cloud", "cloud")
    try:
        assert a1.wait_connected(10)
        time.sleep(0.3)
        # the cloud's push reaches a1 (an agent reads no status, its own neither): the reset
        assert cloud.publish_wait(T.push, b"reset", 1, timeout=10)
        wait_for(lambda: len(connects) >= 2 and a1.connected, 15, what="the link reconnected after the break")
    finally:
        cloud.stop()
        a1.stop()
        for peer in peers:
            peer.close()
