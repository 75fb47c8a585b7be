"""The MQTT link's subscriptions change while it runs (agent/cloud/mqtt.py), as dropping a
status subscription an older agent left in its session needs (agent/cloud/component.py):
what is subscribed is received, what
is unsubscribed no longer is, and both hold across reconnects of a persistent session,
including an unsubscribe made while the broker was down. Real mosquitto (paho 1.6 here,
2.x under `make test-cloud-paho2`)."""

from __future__ import annotations

import threading
import time

from agent.cloud.mqtt import MqttLink
from agent.config import MqttConfig
from tests.support.cloud import T
from tests.support.waiting import wait_for


class Receiver:
    def __init__(self, url: str):
        self.got: list[str] = []
        self.lock = threading.Lock()
        self.link = MqttLink(MqttConfig(url=url), "subs-receiver", clean_session=False, on_message=self._msg,
                             topic_kind=T.kind, reconnect_min_s=0.2, reconnect_max_s=0.5)

    def _msg(self, msg) -> None:
        self.link.ack(msg)
        with self.lock:
            self.got.append(msg.topic)

    def agents(self) -> set:
        with self.lock:
            return {T.agent_of(t) for t in self.got}

    def clear(self) -> None:
        with self.lock:
            self.got.clear()


def _peer(agent: str) -> str:
    return T.agent_prefix(agent) + "status/+"


def _round(url: str, rx: Receiver, agents=("a1", "a2", "a3")) -> set:
    """Each of ``agents`` publishes a status, then a marker on a1's topic (always
    subscribed) shows everything before it has arrived: the agents whose status arrived."""
    pub = MqttLink(MqttConfig(url=url), f"subs-pub-{time.monotonic_ns()}", clean_session=True)
    pub.start()
    assert pub.wait_connected(10)
    try:
        rx.clear()
        for a in agents:
            assert pub.publish_wait(T.status("j", a), b"{}", 1, timeout=10)
        assert pub.publish_wait(T.status("end", "a1"), b"{}", 1, timeout=10)
        wait_for(lambda: T.status("end", "a1") in list(rx.got), 10, what="the round's last status")
        return rx.agents()
    finally:
        pub.stop()


def test_subscriptions_change_while_connected_and_survive_reconnects(mosquitto_server):
    url = mosquitto_server.url
    rx = Receiver(url)
    rx.link.subscribe(_peer("a1"), 1)
    rx.link.start()
    try:
        assert rx.link.wait_connected(10)
        time.sleep(0.3)  # the SUBACK
        assert _round(url, rx) == {"a1"}
        rx.link.subscribe(_peer("a2"), 1)
        rx.link.subscribe(_peer("a3"), 1)
        time.sleep(0.3)
        assert _round(url, rx) == {"a1", "a2", "a3"}
        rx.link.unsubscribe(_peer("a3"))
        time.sleep(0.3)
        assert _round(url, rx) == {"a1", "a2"}

        mosquitto_server.restart()                        # the session (a1, a2) is persisted
        wait_for(lambda: rx.link.connected, 15, what="reconnected")
        time.sleep(0.3)
        assert _round(url, rx) == {"a1", "a2"}

        mosquitto_server.stop()
        wait_for(lambda: not rx.link.connected, 10, what="the link sees the broker gone")
        rx.link.unsubscribe(_peer("a2"))                  # not sent: the broker's session still has it
        rx.link.subscribe(_peer("a3"), 1)
        mosquitto_server.start()
        wait_for(lambda: rx.link.connected, 15, what="reconnected")
        time.sleep(0.3)
        assert _round(url, rx) == {"a1", "a3"}            # a2 unsubscribed on the reconnect
    finally:
        rx.link.stop()
