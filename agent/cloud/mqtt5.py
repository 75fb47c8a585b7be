"""MQTT 5 for the paho adapter (agent/cloud/mqtt.py), with paho 1.6 and 2.x alike: the
CONNECT, PUBLISH and incoming message properties, PUBACK reason codes, and whether a
persistent session the agent expected was kept by the broker (both protocols).

paho 1.6 parses a PUBACK's reason code and drops it (``_handle_pubackcomp``);
:func:`capture_puback_reasons` reads it from the packet before the original runs, the
same kind of per-instance wrap as the deferred ``_send_puback`` of mqtt.py.
"""

from __future__ import annotations

import logging
import struct
from typing import Any, Callable, Optional

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.runtime.metrics import counter

from .link import MessageProps

log = logging.getLogger(__name__)


REFUSED = counter("millwright_mqtt_publish_refused_total",
                  "Publishes the broker refused with an MQTT 5 PUBACK reason code of 0x80 or more",
                  ("reason_code",))
SESSIONS_LOST = counter("millwright_mqtt_sessions_lost_total",
                        "Connects that found no session where one was expected (session present false)")


def is_refusal(reason_code: int) -> bool:
    """MQTT 5: a PUBACK reason below 0x80 (0x10, no matching subscribers, included) is success."""
    return reason_code >= 0x80


def reason_label(reason_code: int) -> str:
    """The metric label of a reason code, as the MQTT 5 specification writes it (0x87)."""
    return f"0x{reason_code:02x}"


def session_lost(persistent: bool, previous_client_id: Optional[str], client_id: str,
                 session_present: bool) -> bool:
    """A session was expected and the broker had none: this client id connected before with a
    persistent session (clean_session False / clean_start False), and the CONNACK says
    session present false. Then whatever the broker would have queued meanwhile is gone."""
    return persistent and previous_client_id is not None and previous_client_id == client_id \
        and not session_present


def connect_properties(session_expiry_s: int) -> Properties:
    """The CONNECT properties of a persistent MQTT 5 session: without a Session Expiry
    Interval the broker ends the session when the connection ends (MQTT 5 3.1.2.11.2)."""
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = int(session_expiry_s)
    return props


def granted_session_expiry(properties: Any) -> Optional[int]:
    """The Session Expiry Interval a CONNACK says the broker uses instead of ours, if any."""
    value = getattr(properties, "SessionExpiryInterval", None) if properties is not None else None
    return int(value) if isinstance(value, int) else None


def publish_properties(props: Optional[MessageProps]) -> Optional[Properties]:
    """PUBLISH properties from ``props`` (None when there is nothing to send)."""
    if props is None:
        return None
    out = Properties(PacketTypes.PUBLISH)
    any_set = False
    if props.message_expiry_s is not None:
        out.MessageExpiryInterval = int(props.message_expiry_s)
        any_set = True
    if props.response_topic is not None:
        out.ResponseTopic = props.response_topic
        any_set = True
    if props.correlation_data is not None:
        out.CorrelationData = bytes(props.correlation_data)
        any_set = True
    if props.user_properties:
        out.UserProperty = [(str(k), str(v)) for k, v in props.user_properties]
        any_set = True
    return out if any_set else None


def message_props(msg: Any) -> Optional[MessageProps]:
    """The properties of a received paho message (MQTT 5 only; None on 3.1.1). Unset ones
    are None; a malformed value (a non-UTF-8 user property the broker let through) is
    dropped rather than failing the message."""
    p = getattr(msg, "properties", None)
    if p is None:
        return None
    expiry = getattr(p, "MessageExpiryInterval", None)
    topic = getattr(p, "ResponseTopic", None)
    corr = getattr(p, "CorrelationData", None)
    users = []
    for pair in getattr(p, "UserProperty", None) or ():
        try:
            k, v = pair
        except (TypeError, ValueError):
            continue
        if isinstance(k, str) and isinstance(v, str):
            users.append((k, v))
    return MessageProps(message_expiry_s=expiry if isinstance(expiry, int) else None,
                        response_topic=topic if isinstance(topic, str) else None,
                        correlation_data=bytes(corr) if isinstance(corr, (bytes, bytearray)) else None,
                        user_properties=tuple(users))


def capture_puback_reasons(client: Any, reasons: dict[int, int]) -> bool:
    """paho 1.x on MQTT 5: while paho handles a PUBACK that carries a reason code,
    ``reasons[mid]`` holds it (so the on_publish callback can read it); the entry is removed
    when paho is done. False when this paho has no ``_handle_pubackcomp`` to wrap (reason
    codes are then unknown: every PUBACK reads as success, as on 3.1.1)."""
    real = getattr(client, "_handle_pubackcomp", None)
    if real is None:
        return False

    def handle(cmd: str, _real: Callable[[str], Any] = real) -> Any:
        packet = client._in_packet.get("packet", b"")
        if cmd != "PUBACK" or len(packet) < 3:     # no reason code: 0x00, success
            return _real(cmd)
        mid = struct.unpack("!H", packet[:2])[0]
        reasons[mid] = packet[2]
        try:
            return _real(cmd)
        finally:
            reasons.pop(mid, None)

    client._handle_pubackcomp = handle
    return True
