"""The one test fake of the MQTT link (agent/cloud/link.py's ``Link`` Protocol): for unit
tests of what consumes a link (dispatcher, outbox publisher, queries) without a broker.
Tests of the link itself run against a real mosquitto (tests/integration)."""

from __future__ import annotations

import json
import time
from typing import Callable, Optional

from agent.cloud.link import Message, MessageProps


class FakeLink:
    """Records what is published and acknowledged. ``connected`` and ``deferred_ack`` are
    plain attributes a test sets; ``on_ack`` sees each acknowledged message as it happens
    (to check the order of acks against other events)."""

    def __init__(self, *, connected: bool = True, deferred_ack: bool = True,
                 on_ack: Optional[Callable[[Message], None]] = None):
        self.host, self.port, self.client_id = "127.0.0.1", 1883, "fake-link"
        self.connected = connected
        self.deferred_ack = deferred_ack
        self.protocol = "3.1.1"
        self.session_present: Optional[bool] = True
        self.session_lost = False
        self.on_ack = on_ack
        self.started = False
        self.mid = 0
        self.sent: list[tuple[int, str, object]] = []   # (mid, topic, JSON document or raw bytes)
        self.sent_props: dict[int, MessageProps] = {}    # mid -> the properties it was published with
        self.acked: list[Message] = []
        self.subscriptions: dict[str, int] = {}
        self.unsubscribed: list[str] = []

    def start(self) -> "FakeLink":
        self.started = True
        return self

    def wait_connected(self, timeout: float) -> bool:
        return self.connected

    def stop(self, timeout: float = 2.0) -> None:
        self.started = False

    def ack(self, msg: Message) -> bool:
        self.acked.append(msg)
        if self.on_ack is not None:
            self.on_ack(msg)
        return True

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                props: Optional[MessageProps] = None) -> tuple[int, int]:
        self.mid += 1
        if props is not None:
            self.sent_props[self.mid] = props
        try:
            doc: object = json.loads(payload)
        except ValueError:
            doc = payload
        self.sent.append((self.mid, topic, doc))
        return 0, self.mid

    def subscribe(self, topic: str, qos: int = 1) -> None:
        self.subscriptions[topic] = qos

    def unsubscribe(self, topic: str) -> None:
        self.subscriptions.pop(topic, None)
        self.unsubscribed.append(topic)

    def publish_wait(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                     timeout: float = 2.0, props: Optional[MessageProps] = None) -> bool:
        self.publish(topic, payload, qos, retain, props)
        return self.connected


def message(topic: str, payload: bytes, mid: int = 1, qos: int = 1, received: Optional[float] = None) -> Message:
    """A message as the link delivers it (on connection generation 1)."""
    return Message(topic, payload, qos, mid, False, 1, time.monotonic() if received is None else received)
