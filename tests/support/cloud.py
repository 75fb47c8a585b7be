"""The cloud's side of the MQTT channel in tests and benchmarks: agents wired to a broker,
a pusher, what the agents answered, what reached etcd."""

from __future__ import annotations

import os
import threading
from typing import Any

from agent.cloud.mqtt import MqttLink
from tests.support.cloudkit import StatusCollector, write_keys
from agent.cloud.topics import Topics
from agent.config import EtcdConfig, MqttConfig
from agent.coordination.etcd import EtcdClient
from agent.coordination.keys import Keys
from tests.support.cluster import Cluster

T = Topics("t")


class CloudWorld:
    """Agents of cluster "t" (not started) that take pushes from a real broker and verify
    them with ``ring``, and a collector of every message they publish (statuses,
    rejections, presence)."""

    def __init__(self, etcd: Any, mq: Any, tmp_path: Any, templates: dict, shards: int):
        self.etcd, self.mq = etcd, mq
        # in a directory of its own: the templates may name files under tmp_path, which
        # hiding cannot then cover whole, and a root template makes that a start-up error
        os.makedirs(os.path.join(str(tmp_path), "signing"), exist_ok=True)
        self.keys_file = os.path.join(str(tmp_path), "signing", "keys.yaml")
        self.ring = write_keys(self.keys_file)
        self.cluster = Cluster(etcd, str(tmp_path / "agents"), shards=shards, ttl=4, renew_deadline=2.5,
                               retry_period=0.5,
                               extra={"mqtt": {"url": mq.url, "reconnect_min_s": 0.2, "reconnect_max_s": 1.0,
                                               "ingest_grace_s": 1.5},
                                      "signing": {"keys_file": self.keys_file}, "templates": templates,
                                      "bpf": {"enabled": False}})
        self.col = StatusCollector(mq.url, "t", extra_filters=("millwright/t/agents/#",)).start()

    def close(self) -> None:
        self.col.stop()
        self.cluster.close()


class Pusher:
    """Publishes pushes with QoS 1 on a persistent session; counts broker acks."""

    def __init__(self, url: str, client_id: str = "test-pusher"):
        self.acked = 0
        self.lock = threading.Lock()
        self.link = MqttLink(MqttConfig(url=url), client_id, clean_session=False, on_publish=self._pub,
                             reconnect_min_s=0.2, reconnect_max_s=1.0, max_inflight=100)
        self.link.start()
        assert self.link.wait_connected(10)

    def _pub(self, mid):
        with self.lock:
            self.acked += 1

    def push(self, payload: bytes, topic: str = T.push) -> None:
        self.link.publish(topic, payload, qos=1)

    def stop(self):
        self.link.stop()


def jobs_in_etcd(etcd, cluster: str = "t") -> dict:
    """job_id -> KV of every stored job."""
    c = EtcdClient(EtcdConfig(endpoints=[etcd.endpoint], request_timeout_s=5.0))
    try:
        kvs, _ = c.get_prefix(Keys(cluster).jobs_prefix())
        return {kv.key.rsplit("/", 1)[1]: kv for kv in kvs}
    finally:
        c.close()


def accepted(col, ids=None) -> dict:
    """job_id -> {(agent, seq): accepted status} seen by a StatusCollector."""
    out: dict = {}
    for d in col.docs("accepted"):
        if ids is None or d["job_id"] in ids:
            out.setdefault(d["job_id"], {})[(d["agent"], d["seq"])] = d
    return out


def wait_agent_connected(col, agent_id, timeout=30):
    assert col.wait(lambda msgs: any(t == T.presence(agent_id) and d.get("state") == "online" and
                                     d.get("pid") for _, t, d in msgs[-50:]), timeout)
