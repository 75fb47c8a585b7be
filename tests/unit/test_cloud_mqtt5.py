"""MQTT 5 helpers of the paho adapter (agent/cloud/mqtt5.py) and its config keys: when a
session counts as lost, properties out and back in through paho's own packing, PUBACK
reason codes read from a packet as paho 1.6 holds it. The link against a broker:
tests/integration/test_mqtt5_link.py."""

from __future__ import annotations

import struct
import types

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.cloud import mqtt5
from agent.cloud.link import Message, MessageProps
from agent.config import ConfigError, parse_config


@pytest.mark.parametrize("persistent,previous,present,lost", [
    (True, "gw-1", False, True),      # connected before with a session: the broker lost it
    (True, "gw-1", True, False),      # kept
    (True, None, False, False),       # first connect of this client id: nothing expected
    (True, "gw-0", False, False),     # another client id before: its session, not ours
    (False, "gw-1", False, False),    # a clean session never expects one
])
def test_a_session_is_lost_only_where_one_was_expected(persistent, previous, present, lost):
    assert mqtt5.session_lost(persistent, previous, "gw-1", present) is lost


def test_reason_codes_below_0x80_are_success():
    assert not mqtt5.is_refusal(0x00) and not mqtt5.is_refusal(0x10)
    assert mqtt5.is_refusal(0x87) and mqtt5.is_refusal(0x97)
    assert mqtt5.reason_label(0x87) == "0x87"


def test_connect_properties_request_the_session_expiry():
    props = mqtt5.connect_properties(3600)
    back = Properties(PacketTypes.CONNECT)
    back.unpack(props.pack())
    assert back.SessionExpiryInterval == 3600
    assert mqtt5.granted_session_expiry(back) == 3600
    assert mqtt5.granted_session_expiry(Properties(PacketTypes.CONNACK)) is None
    assert mqtt5.granted_session_expiry(None) is None


def test_publish_properties_come_back_as_message_props():
    sent = MessageProps(message_expiry_s=30, response_topic="r/t", correlation_data=b"\x00c",
                        user_properties=(("trace_id", "t-9"), ("k", "1"), ("k", "2")))
    packed = mqtt5.publish_properties(sent)
    assert packed is not None
    back = Properties(PacketTypes.PUBLISH)
    back.unpack(packed.pack())
    got = mqtt5.message_props(types.SimpleNamespace(properties=back))
    assert got == sent
    assert got.user_property("k") == "1" and got.user_property("none") is None
    assert mqtt5.publish_properties(None) is None and mqtt5.publish_properties(MessageProps()) is None
    assert mqtt5.message_props(types.SimpleNamespace(properties=None)) is None   # 3.1.1
    assert mqtt5.message_props(types.SimpleNamespace(properties=Properties(PacketTypes.PUBLISH))) == MessageProps()


def test_a_message_expires_its_expiry_after_it_arrived():
    m = Message("t", b"", 1, 1, False, 1, 100.0, MessageProps(message_expiry_s=10))
    assert m.expires_at == 110.0
    assert Message("t", b"", 1, 1, False, 1, 100.0).expires_at is None


class _Paho16:
    """What capture_puback_reasons touches of a paho 1.6 client."""

    def __init__(self):
        self._in_packet = {"packet": b""}
        self.seen: list[tuple[str, dict]] = []
        self.reasons: dict[int, int] = {}

    def _handle_pubackcomp(self, cmd):
        self.seen.append((cmd, dict(self.reasons)))
        return 0


def test_puback_reasons_are_read_from_the_packet_while_paho_handles_it():
    client = _Paho16()
    assert mqtt5.capture_puback_reasons(client, client.reasons)
    for packet in (struct.pack("!HB", 7, 0x87) + b"\x00", struct.pack("!H", 8), struct.pack("!HB", 9, 0x10)):
        client._in_packet = {"packet": packet}
        assert client._handle_pubackcomp("PUBACK") == 0
    client._in_packet = {"packet": struct.pack("!HB", 10, 0x92)}
    client._handle_pubackcomp("PUBCOMP")
    assert client.seen == [("PUBACK", {7: 0x87}), ("PUBACK", {}), ("PUBACK", {9: 0x10}), ("PUBCOMP", {})]
    assert client.reasons == {}                               # gone once paho is done
    assert not mqtt5.capture_puback_reasons(object(), {})     # nothing to wrap


def _problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        parse_config("etcd: {insecure: true}\n" + text, "agent.yaml")
    return ei.value.problems


def test_the_protocol_and_session_expiry_keys():
    base = "etcd: {insecure: true}\nmqtt: {insecure: true"
    cfg = parse_config(base + "}\n", "agent.yaml").mqtt
    assert (cfg.protocol, cfg.session_expiry_s) == ("3.1.1", 3600)
    cfg = parse_config(base + ", protocol: '5', session_expiry_s: 60}\n", "agent.yaml").mqtt
    assert (cfg.protocol, cfg.session_expiry_s) == ("5", 60)
    assert _problems("mqtt: {insecure: true, protocol: '3'}\n") == [
        "agent.yaml: mqtt.protocol: '3' must be \"3.1.1\" or \"5\""]
    assert _problems("mqtt: {insecure: true, protocol: 5}\n") == [
        "agent.yaml: mqtt.protocol: expected a string, got 5"]
    p = _problems("mqtt: {insecure: true, session_expiry_s: 0}\n")
    assert len(p) == 1 and p[0].startswith("agent.yaml: mqtt.session_expiry_s: must be between 1"), p
