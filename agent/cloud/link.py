"""The MQTT link every part of the cloud channel talks through, as a Protocol.

Its one real implementation is :class:`agent.cloud.mqtt.MqttLink` (paho 1.6 and 2.x);
tests use one fake of it (tests/support/link.py). A second MQTT flavour implements this
Protocol and is constructed in agent/cloud/component.py; nothing else changes.

What a consumer may rely on:
- ``ack(msg)`` PUBACKs a received QoS 1 message, and only on the connection it came from
  (False otherwise: the broker redelivers it after the reconnect);
- ``deferred_ack``: True when the PUBACK waits for ``ack``. False when the client library
  acknowledges as soon as the message callback returns: then whatever must be durable
  before the PUBACK is made durable inside that callback;
- ``publish`` never blocks (rc != 0 while disconnected; QoS 1 messages are still queued
  and sent after the reconnect); ``publish_wait`` waits for the broker's acknowledgement;
- ``subscribe``/``unsubscribe`` change the link's subscriptions from any thread without
  blocking: the current set is subscribed again on every (re)connect, and an unsubscribe
  that could not be sent is sent on the next connect (a persistent session keeps what it
  was subscribed to across connections);
- the callbacks given at construction run on the link's own thread and must not block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Message:
    """One message received from the broker."""

    topic: str
    payload: bytes
    qos: int
    mid: int
    dup: bool
    generation: int   # the connection it arrived on (acks on a later one are never sent)
    received: float   # time.monotonic() at arrival


@runtime_checkable
class Link(Protocol):
    """What the cloud channel needs of an MQTT client (see the module doc)."""

    host: str
    port: int
    client_id: str
    connected: bool
    deferred_ack: bool

    def start(self) -> "Link": ...

    def wait_connected(self, timeout: float) -> bool: ...

    def stop(self, timeout: float = 2.0) -> None: ...

    def ack(self, msg: Message) -> bool: ...

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> tuple[int, int]:
        """(rc, mid)."""
        ...

    def subscribe(self, topic: str, qos: int = 1) -> None: ...

    def unsubscribe(self, topic: str) -> None: ...

    def publish_wait(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                     timeout: float = 2.0) -> bool: ...
