"""The cloud side of the demo: the signer's key, and a plain MQTT client that pushes signed
jobs and watches every status and presence document, as the real cloud would."""

from __future__ import annotations

import json
import os
import queue
import threading
import time

from agent.demo.plan import DemoFailed
from agent.jobs.signing import KeyRing, keygen_files, sign


def write_signer_keys(signer_path: str, agents_path: str, kid: str) -> KeyRing:
    """An ed25519 pair, as in production (`millwright keygen`): the cloud's file holds the
    private key, the agents' keys file (0600) only the public one. Returns the cloud's ring."""
    entry = keygen_files(kid, signer_path)
    fd = os.open(agents_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(entry)
    return KeyRing.load(signer_path, require_private=True)


def signed_payload(doc: dict, ring: KeyRing, kid: str) -> bytes:
    """``doc`` signed with the cloud's key, as the bytes of a push."""
    return json.dumps(sign(doc, ring, kid), separators=(",", ":")).encode()


class CloudConsole:
    """What the cloud sees: a paho client that publishes signed pushes (QoS 1) and
    subscribes to every status and presence document of the cluster."""

    def __init__(self, host: str, port: int, cluster: str):
        import paho.mqtt.client as paho

        from agent.cloud.mqtt import PAHO_MAJOR
        from agent.cloud.topics import Topics

        self.topics = Topics(cluster)
        self.host, self.port = host, port
        kw = dict(client_id=f"millwright-demo-console-{os.getpid()}", clean_session=True, protocol=paho.MQTTv311)
        self.client = (paho.Client(paho.CallbackAPIVersion.VERSION1, **kw) if PAHO_MAJOR >= 2 else paho.Client(**kw))
        self.q: "queue.Queue[tuple[float, str, dict]]" = queue.Queue()
        self.subscribed = threading.Event()
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda *a: self.subscribed.set()
        self.client.on_message = self._on_message

    def _on_connect(self, client, userdata, flags, rc, properties=None) -> None:
        if rc == 0:
            client.subscribe([(self.topics.status_filter(), 1), (self.topics.presence_filter(), 1),
                              (self.topics.rejections_filter(), 1)])

    def _on_message(self, client, userdata, msg) -> None:
        try:
            doc = json.loads(msg.payload)
        except ValueError:
            return
        if isinstance(doc, dict):
            self.q.put((time.time(), msg.topic, doc))

    def start(self, timeout: float = 10.0) -> None:
        self.client.connect_async(self.host, self.port, keepalive=30)
        self.client.loop_start()
        if not self.subscribed.wait(timeout):
            raise DemoFailed(f"the demo's cloud console could not subscribe at mqtt://{self.host}:{self.port}")

    def publish(self, topic: str, payload: bytes, timeout: float = 10.0, retain: bool = False) -> bool:
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        deadline = time.monotonic() + timeout
        while not info.is_published():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def stop(self) -> None:
        try:
            self.client.disconnect()
            self.client.loop_stop()
        except Exception:
            pass
