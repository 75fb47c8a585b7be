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
- the callbacks given at construction run on the link's own thread and must not block;
- ``protocol`` is "3.1.1" or "5". On MQTT 5 a received message carries its properties
  (``Message.props``) and ``publish`` sends ``props``; on 3.1.1 there are none and ``props``
  is not sent;
- ``session_present`` is what the broker said at the last connect (None before the
  first); ``session_lost`` is True when that connect expected a session (the same client
  id connected before, persistently) and found none: pushes queued meanwhile are gone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable


@dataclass(frozen=True)
class MessageProps:
    """MQTT 5 properties of a message, received or to publish. Typed here so that consumers
    never see the client library's Properties object."""

    message_expiry_s: Optional[int] = None      # received: what is left of it at the broker
    response_topic: Optional[str] = None
    correlation_data: Optional[bytes] = None
    user_properties: tuple[tuple[str, str], ...] = ()

    def user_property(self, name: str) -> Optional[str]:
        """The first value of a user property (MQTT 5 allows repeats)."""
        return next((v for k, v in self.user_properties if k == name), None)


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
    props: Optional[MessageProps] = None   # MQTT 5 only

    @property
    def expires_at(self) -> Optional[float]:
        """time.monotonic() at which the message's MQTT 5 Message Expiry passes, if it has one."""
        if self.props is None or self.props.message_expiry_s is None:
            return None
        return self.received + self.props.message_expiry_s


@runtime_checkable
class Link(Protocol):
    """What the cloud channel needs of an MQTT client (see the module doc)."""

    host: str
    port: int
    client_id: str
    connected: bool
    deferred_ack: bool
    protocol: str
    session_present: Optional[bool]
    session_lost: bool

    def start(self) -> "Link": ...

    def wait_connected(self, timeout: float) -> bool: ...

    def stop(self, timeout: float = 2.0) -> None: ...

    def ack(self, msg: Message) -> bool: ...

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                props: Optional[MessageProps] = None) -> tuple[int, int]:
        """(rc, mid)."""
        ...

    def subscribe(self, topic: str, qos: int = 1) -> None: ...

    def unsubscribe(self, topic: str) -> None: ...

    def publish_wait(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                     timeout: float = 2.0, props: Optional[MessageProps] = None) -> bool: ...
