"""The MQTT link on MQTT 5 beside 3.1.1 (agent/cloud/mqtt.py, mqtt5.py), against a real
mosquitto 2.0: connects on both, a persistent session kept across a reconnect and a
restart, a session lost (broker restarted without persistence, or expired) counted as
lost, a publish the broker's ACL refuses reaching on_refused with 0x87 (MQTT 5), message
properties in and out. paho 1.6 here, 2.x under `make test-cloud-paho2`."""

from __future__ import annotations

import threading
import time

import pytest

from agent.cloud.link import Message, MessageProps
from agent.cloud.mqtt import MqttLink
from agent.config import MqttConfig
from agent.demo.services import MosquittoServer
from agent.runtime.metrics import REGISTRY
from tests.support.waiting import wait_for

PROTOCOLS = ("3.1.1", "5")
PROBE = "_ready"


class Rx:
    """A link that records what it receives, acknowledging each message."""

    def __init__(self, cfg: MqttConfig, client_id: str, clean_session: bool = False, refusals: bool = False, **kw):
        self.got: list[Message] = []
        self.published: list[int] = []
        self.refused: list[tuple[int, int]] = []
        self.probes = 0
        self.lock = threading.Lock()
        self.link = MqttLink(cfg, client_id, clean_session=clean_session, on_message=self._msg,
                             on_publish=self._pub, on_refused=self.on_refused if refusals else None,
                             reconnect_min_s=0.2, reconnect_max_s=0.5, **kw)

    def _msg(self, msg: Message) -> None:
        self.link.ack(msg)
        with self.lock:
            if msg.topic.endswith("/" + PROBE):
                self.probes += 1
            else:
                self.got.append(msg)

    def _pub(self, mid: int) -> None:
        with self.lock:
            self.published.append(mid)

    def on_refused(self, mid: int, code: int) -> None:
        with self.lock:
            self.refused.append((mid, code))

    def start(self) -> "Rx":
        self.link.start()
        assert self.link.wait_connected(10), "the link did not connect"
        return self.ready()

    def ready(self) -> "Rx":
        """Once this returns, the broker has the subscriptions the link made at its connect:
        a probe published on the same connection after them has come back (another client's
        publish could otherwise reach the broker before them)."""
        for sub in list(self.link.subscriptions):
            with self.lock:
                seen = self.probes
            self.link.publish(sub.replace("#", PROBE), b"", 1)
            wait_for(lambda: self.probes > seen, 10, what=f"the probe on {sub}")
        return self

    def topics(self) -> list[str]:
        with self.lock:
            return [m.topic for m in self.got]


def _cfg(url: str, protocol: str, **kw) -> MqttConfig:
    return MqttConfig(url=url, protocol=protocol, **kw)


def _lost() -> float:
    return REGISTRY.get_sample_value("millwright_mqtt_sessions_lost_total") or 0.0


def _refused(code: str) -> float:
    return REGISTRY.get_sample_value("millwright_mqtt_publish_refused_total", {"reason_code": code}) or 0.0


def _publish(url: str, protocol: str, topic: str, payload: bytes, props: MessageProps | None = None) -> None:
    pub = MqttLink(_cfg(url, protocol), f"pub-{time.monotonic_ns()}", clean_session=True)
    pub.start()
    try:
        assert pub.wait_connected(10)
        assert pub.publish_wait(topic, payload, 1, timeout=10, props=props)
    finally:
        pub.stop()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_connects_and_round_trips(mosquitto_server, protocol):
    url = mosquitto_server.url
    rx = Rx(_cfg(url, protocol), f"rx-{protocol}", subscriptions=(("t/#", 1),)).start()
    try:
        assert rx.link.protocol == protocol
        assert rx.link.session_present is False      # a fresh broker has no session for it
        assert rx.link.session_lost is False         # nor was one expected
        _publish(url, protocol, "t/a", b"hello")
        wait_for(lambda: rx.topics() == ["t/a"], 10, what="the message")
        msg = rx.got[0]
        assert msg.payload == b"hello" and msg.qos == 1
        assert (msg.props is not None) == (protocol == "5")
        assert msg.expires_at is None
    finally:
        rx.link.stop()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_session_kept_across_a_reconnect_and_a_broker_restart(mosquitto_server, protocol):
    url, cid = mosquitto_server.url, f"kept-{protocol}"
    first = Rx(_cfg(url, protocol), cid, subscriptions=(("kept/#", 1),)).start()
    first.link.stop()
    _publish(url, protocol, "kept/while-away", b"1")    # QoS 1, queued in the session
    lost = _lost()
    # a restarted agent: same client id, and it knows it had a session
    again = Rx(_cfg(url, protocol), cid, prior_client_id=cid).start()
    try:
        assert again.link.session_present is True
        assert again.link.session_lost is False
        wait_for(lambda: "kept/while-away" in again.topics(), 10, what="the message sent while disconnected")
        gen = again.link.generation
        mosquitto_server.restart()                       # persistence on: the session survives
        wait_for(lambda: again.link.connected and again.link.generation > gen, 30, what="the reconnect")
        assert again.link.session_present is True and again.link.session_lost is False
        _publish(url, protocol, "kept/after-restart", b"2")   # still subscribed: the session's own
        wait_for(lambda: "kept/after-restart" in again.topics(), 10, what="a message after the restart")
        # acknowledged on its connection (manual ack on 5 too): not redelivered by the resumed session
        assert again.topics().count("kept/while-away") == 1
        assert _lost() == lost
    finally:
        again.link.stop()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_session_lost_when_the_broker_restarts_without_persistence(tmp_path, protocol):
    with MosquittoServer(str(tmp_path / "mq"), extra_conf="persistence false\n") as srv:
        rx = Rx(_cfg(srv.url, protocol), f"lost-{protocol}", subscriptions=(("lost/#", 1),)).start()
        try:
            assert rx.link.session_lost is False
            lost, gen = _lost(), rx.link.generation
            srv.restart()
            wait_for(lambda: rx.link.connected and rx.link.generation > gen, 30, what="the reconnect")
            rx.ready()
            assert rx.link.session_present is False
            assert rx.link.session_lost is True
            assert rx.link.sessions_lost == 1
            assert _lost() == lost + 1
            # the link subscribes again on every connect: messages flow on the new session
            _publish(srv.url, protocol, "lost/after", b"x")
            wait_for(lambda: "lost/after" in rx.topics(), 10, what="a message on the new session")
        finally:
            rx.link.stop()


def test_session_lost_after_its_expiry_on_mqtt5(mosquitto_server):
    url, cid = mosquitto_server.url, "expiring"
    cfg = _cfg(url, "5", session_expiry_s=1)
    first = Rx(cfg, cid, subscriptions=(("exp/#", 1),)).start()
    first.link.stop()
    _publish(url, "5", "exp/while-away", b"1")
    time.sleep(3)          # past the 1 s session expiry the link requested
    lost = _lost()
    again = Rx(cfg, cid, prior_client_id=cid).start()   # subscribes to nothing: only a session would deliver
    try:
        assert again.link.session_present is False
        assert again.link.session_lost is True
        assert _lost() == lost + 1
        _publish(url, "5", "exp/probe", b"2")           # not subscribed any more: never delivered
        time.sleep(0.5)
        assert again.topics() == []
    finally:
        again.link.stop()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_publish_the_acl_refuses(tmp_path, protocol):
    acl = "user writer\ntopic readwrite ok/#\n"
    with MosquittoServer(str(tmp_path / "mq"), users={"writer": "pw"}, acl=acl) as srv:
        cfg = _cfg(srv.url, protocol, username="writer", password="pw")
        rx = Rx(cfg, f"acl-{protocol}", clean_session=True, refusals=True, subscriptions=(("ok/#", 1),)).start()
        try:
            before = _refused("0x87")
            rc, denied = rx.link.publish("denied/x", b"no", 1)
            assert rc == 0
            rc, allowed = rx.link.publish("ok/x", b"yes", 1)
            wait_for(lambda: allowed in rx.published, 10, what="the allowed publish's PUBACK")
            if protocol == "5":
                wait_for(lambda: rx.refused, 10, what="the refusal")
                assert rx.refused == [(denied, 0x87)]
                assert denied not in rx.published
                assert _refused("0x87") == before + 1
                assert not rx.link.publish_wait("denied/y", b"no", 1, timeout=10)
            else:   # 3.1.1 has no reason codes: mosquitto acknowledges and drops it
                wait_for(lambda: denied in rx.published, 10, what="the denied publish's PUBACK")
                assert rx.refused == [] and _refused("0x87") == before
                assert rx.link.publish_wait("denied/y", b"no", 1, timeout=10)
            assert rx.link.publish_wait("ok/y", b"yes", 1, timeout=10)
            wait_for(lambda: rx.topics() == ["ok/x", "ok/y"], 10, what="the allowed messages")
        finally:
            rx.link.stop()


def test_a_refusal_without_on_refused_is_reported_as_published(tmp_path):
    """A link without on_refused is never left waiting for a PUBACK it got (the outbox would
    retry it for ever): as a 3.1.1 broker does, the refused publish reads as done."""
    with MosquittoServer(str(tmp_path / "mq"), users={"writer": "pw"}, acl="user writer\ntopic readwrite ok/#\n") as srv:
        rx = Rx(_cfg(srv.url, "5", username="writer", password="pw"), "acl-plain", clean_session=True).start()
        try:
            before = _refused("0x87")
            _, denied = rx.link.publish("denied/x", b"no", 1)
            wait_for(lambda: denied in rx.published, 10, what="the refused publish reported")
            assert _refused("0x87") == before + 1
        finally:
            rx.link.stop()


def test_message_properties_in_and_out(mosquitto_server):
    url = mosquitto_server.url
    server = Rx(_cfg(url, "5"), "responder", subscriptions=(("req/#", 1),)).start()
    client = Rx(_cfg(url, "5"), "requester", subscriptions=(("replies/#", 1),)).start()
    old = Rx(_cfg(url, "3.1.1"), "old-reader", subscriptions=(("req/#", 1),)).start()
    try:
        sent = MessageProps(message_expiry_s=60, response_topic="replies/requester", correlation_data=b"\x00\x01q",
                            user_properties=(("trace_id", "t-1"), ("k", "v1"), ("k", "v2")))
        assert client.link.publish_wait("req/get", b"?", 1, timeout=10, props=sent)
        wait_for(lambda: server.got, 10, what="the request")
        req = server.got[0]
        assert req.props is not None
        assert req.props.response_topic == "replies/requester"
        assert req.props.correlation_data == b"\x00\x01q"
        assert req.props.user_properties == (("trace_id", "t-1"), ("k", "v1"), ("k", "v2"))
        assert req.props.user_property("k") == "v1"
        assert req.props.message_expiry_s is not None and 0 < req.props.message_expiry_s <= 60
        assert req.expires_at is not None and req.expires_at > time.monotonic()
        # answered on the request's Response Topic with its Correlation Data
        answer = MessageProps(correlation_data=req.props.correlation_data, user_properties=(("trace_id", "t-1"),))
        assert server.link.publish_wait(req.props.response_topic, b"!", 1, timeout=10, props=answer)
        wait_for(lambda: client.got, 10, what="the answer")
        got = client.got[0]
        assert got.topic == "replies/requester" and got.payload == b"!"
        assert got.props is not None and got.props.correlation_data == b"\x00\x01q"
        assert got.props.user_property("trace_id") == "t-1" and got.props.response_topic is None
        assert got.expires_at is None
        # a 3.1.1 subscriber gets the payload, no properties; a 3.1.1 link ignores them
        wait_for(lambda: old.got, 10, what="the request on 3.1.1")
        assert old.got[0].payload == b"?" and old.got[0].props is None
        assert old.link.publish_wait("req/old", b"o", 1, timeout=10, props=answer)
        wait_for(lambda: "req/old" in server.topics(), 10, what="a 3.1.1 publish")
        assert next(m for m in server.got if m.topic == "req/old").props == MessageProps()
    finally:
        for rx in (server, client, old):
            rx.link.stop()
