"""One MQTT client adapter for paho-mqtt 1.6 (Debian) and 2.x (PyPI): the implementation of
:class:`agent.cloud.link.Link`.

What the rest of the cloud package relies on:
- a persistent session (clean_session=False, stable client id): QoS 1 pushes that arrive
  while the agent is down wait in its session on the broker. MQTT 3.1.1 by default;
  ``mqtt.protocol: "5"`` connects with clean_start False on every connect (paho's default,
  clean start on the first connect only, would wipe the session at each start) and requests
  ``mqtt.session_expiry_s``. Each connect records ``session_present`` and ``session_lost``
  (a session expected and not found: counted, millwright_mqtt_sessions_lost_total);
- MQTT 5 (agent/cloud/mqtt5.py): a received message's properties in ``Message.props``,
  properties on :meth:`publish`, and PUBACK reason codes: a refusal (0x80 or more) goes to
  ``on_refused(mid, reason_code)`` instead of ``on_publish(mid)`` and is counted
  (millwright_mqtt_publish_refused_total); without ``on_refused`` it is logged and reported
  to ``on_publish``, as a 3.1.1 broker acknowledges a publish it drops;
- manual acknowledgement: a received QoS 1 message is PUBACKed only when :meth:`ack` is
  called, never when the callback returns. paho 2.x has this built in (``manual_ack=True``,
  ``Client.ack``). paho 1.6 sends the PUBACK right after ``on_message`` returns; the adapter
  defers it by replacing the client instance's ``_send_puback`` (a private method that is
  stable across all 1.x releases) and calling the original from :meth:`ack`. Without that
  method (an unknown paho) it falls back to synchronous mode: ``deferred_ack`` is False and
  the caller must finish the durable write inside on_message;
- an ack is only sent on the connection the message came from: message ids are per
  connection, so after a reconnect the broker redelivers instead (``generation``);
- TLS (CA, client certificate), username/password, a last will, and reconnects with
  capped exponential backoff (paho's own loop thread);
- subscriptions that change while it runs (:meth:`subscribe`, :meth:`unsubscribe`): the
  current set is subscribed on every connect; an unsubscribe that was not sent (no
  connection) is sent on the next one, since the persistent session still holds it.

Callbacks run on paho's network thread; they must not block.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from typing import Any, Callable, Optional
from urllib.parse import urlparse

import paho.mqtt as paho_pkg
import paho.mqtt.client as paho

from agent.brokerlimits import PROTOCOLS
from agent.config import MqttConfig
from agent.runtime.metrics import counter, gauge

from . import mqtt5
from .link import Message, MessageProps

log = logging.getLogger(__name__)

PAHO_VERSION = getattr(paho_pkg, "__version__", "1")
# Tests set this to run paho 1.x as if it had no _send_puback (make test-cloud-sync-ack).
SYNC_ACK_ENV = "MILLWRIGHT_TEST_PAHO_SYNC_ACK"
PAHO_MAJOR = int(PAHO_VERSION.split(".")[0] or 1)

MESSAGES = counter("millwright_mqtt_messages_total", "MQTT messages by direction and topic kind",
                   ("direction", "topic_kind"))
CONNECTED = gauge("millwright_mqtt_connected", "1 while connected to the broker")
CONNECTS = counter("millwright_mqtt_connects_total", "Connection attempts to the broker by result", ("result",))


def _rc(value: Any) -> int:
    """paho 1.6 passes ints, 2.x ReasonCode objects."""
    v = getattr(value, "value", value)
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


def _tls_errors_are_connection_errors(client) -> None:
    """paho 1.x handles a failed socket read or write only as ConnectionError: a TLS error
    (SSLEOFError when a write meets a reset connection) escaped and ended its network
    thread for good, the link still marked connected. Here the instance's socket calls
    turn them into ConnectionResetError: a lost connection, reconnected (paho 2.x catches
    OSError itself)."""
    for name in ("_sock_send", "_sock_recv"):
        call = getattr(client, name, None)
        if call is None:
            continue

        def guarded(arg, _call=call):
            try:
                return _call(arg)
            except ssl.SSLError as exc:   # the want-read/want-write ones paho turned into BlockingIOError
                raise ConnectionResetError(f"TLS: {exc}") from exc
        setattr(client, name, guarded)


DISCONNECT_WAIT_S = 2.0   # a replaced client's clean DISCONNECT, waited for at most this long
TAKEOVER_PAUSE_S = 0.2    # between a replaced client's DISCONNECT and the new client's CONNECT


class MqttLink:
    """A :class:`~agent.cloud.link.Link` over paho (1.6 or 2.x)."""

    def __init__(self, cfg: MqttConfig, client_id: str, *, clean_session: bool = False,
                 will: Optional[tuple[str, bytes, int, bool]] = None,
                 on_connect: Optional[Callable[[int, bool], None]] = None,
                 on_disconnect: Optional[Callable[[int], None]] = None,
                 on_message: Optional[Callable[[Message], None]] = None,
                 on_publish: Optional[Callable[[int], None]] = None,
                 on_refused: Optional[Callable[[int, int], None]] = None,
                 prior_client_id: Optional[str] = None,
                 subscriptions: tuple[tuple[str, int], ...] = (),
                 topic_kind: Callable[[str], str] = lambda t: "other",
                 reconnect_min_s: float = 0.5, reconnect_max_s: float = 30.0,
                 max_inflight: int = 256):
        self.cfg = cfg
        self.client_id = client_id
        self.clean_session = clean_session
        self.subscriptions: dict[str, int] = dict(subscriptions)   # under _lock
        self._unsubscribe_pending: set[str] = set()                  # under _lock
        self.topic_kind = topic_kind
        self._on_connect = on_connect
        self._on_disconnect = on_disconnect
        self._on_message = on_message
        self._on_publish = on_publish
        self._on_refused = on_refused
        self.protocol = cfg.protocol
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"mqtt.protocol: {self.protocol!r} is not 3.1.1 or 5")
        self.session_expiry_s = cfg.session_expiry_s
        self.granted_session_expiry_s: Optional[int] = None   # a CONNACK's lower value, if any
        self.session_present: Optional[bool] = None            # at the last connect
        self.session_lost = False                              # ... and no session where one was expected
        self.sessions_lost = 0
        # the client id the last connect used (a caller that persists it across restarts
        # passes it as prior_client_id: a session is then expected at the first connect)
        self._previous_client_id = prior_client_id
        self._puback_reasons: dict[int, int] = {}   # paho 1.x, v5: the PUBACK being handled
        self._refused: dict[int, int] = {}          # mid -> reason, until that mid succeeds
        self._lock = threading.Lock()
        # held around a publish and the swap of replace_client only (never in a paho callback)
        self._client_lock = threading.Lock()
        self.generation = 0
        self.connected = False
        self._connected_ev = threading.Event()
        self._started = False
        self._closing = False
        url = urlparse(cfg.url)
        self.host = url.hostname or "127.0.0.1"
        self.tls = url.scheme == "mqtts" or cfg.tls is not None
        self.port = url.port or (8883 if url.scheme == "mqtts" else 1883)
        self.deferred_ack = True

        self._will = will
        self._max_inflight = max_inflight
        self._reconnect = (reconnect_min_s, reconnect_max_s)
        self.client = self._new_client()

    def _new_client(self) -> Any:
        """A paho client for this link's id and session (paho's tls_set is once per client:
        a renewed certificate needs a new one, see replace_client)."""
        v5 = self.protocol == "5"
        # MQTT 5 has no clean_session (paho refuses one): clean_start at connect instead
        session_kw: dict[str, Any] = ({"protocol": paho.MQTTv5} if v5
                                      else {"protocol": paho.MQTTv311, "clean_session": self.clean_session})
        if PAHO_MAJOR >= 2:
            client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=self.client_id,
                                      manual_ack=True, **session_kw)
        else:
            client = paho.Client(client_id=self.client_id, **session_kw)
            if v5:
                mqtt5.capture_puback_reasons(client, self._puback_reasons)
            real = getattr(type(client), "_send_puback", None)
            if real is None or os.environ.get(SYNC_ACK_ENV) == "1":
                # an unknown paho (or the tests, through SYNC_ACK_ENV): the ack cannot be
                # withheld, so the caller finishes the durable write inside on_message
                self.deferred_ack = False
            else:
                self._real_puback = real
                client._send_puback = lambda mid: paho.MQTT_ERR_SUCCESS  # deferred: see ack()
            _tls_errors_are_connection_errors(client)
        client.max_inflight_messages_set(self._max_inflight)
        client.max_queued_messages_set(0)
        client.reconnect_delay_set(min_delay=max(0.1, self._reconnect[0]), max_delay=max(self._reconnect[0], self._reconnect[1]))
        if self.cfg.username is not None:
            client.username_pw_set(self.cfg.username, self.cfg.password)
        if self.tls:
            t = self.cfg.tls   # None for mqtts:// without a tls section: the system's CAs, no client certificate
            client.tls_set(ca_certs=t.ca if t else None, certfile=t.cert if t else None,
                                keyfile=t.key if t else None, cert_reqs=ssl.CERT_REQUIRED,
                                tls_version=ssl.PROTOCOL_TLS_CLIENT)
        if self._will is not None:
            will = self._will
            client.will_set(will[0], will[1], qos=will[2], retain=will[3])
        client.on_connect = self._cb_connect
        client.on_disconnect = self._cb_disconnect
        client.on_message = self._cb_message
        client.on_publish = self._cb_publish
        return client

    def replace_client(self, cfg: MqttConfig, before_start: Optional[Callable[[], None]] = None) -> None:
        """Reconnect with ``cfg``'s TLS files and password (a reload): a new paho client with
        the same client id and persistent session; the old one sends a clean DISCONNECT first
        (so the broker publishes no will and sees no session takeover). Pushes the broker
        queued meanwhile are delivered to the new client; acks of the old connection's
        messages are never sent (the generation moves), so the broker redelivers them; what
        the old client had in flight is not resent by the new one (``before_start``: the
        owner forgets those message ids and sends again)."""
        self.cfg = cfg
        url = urlparse(cfg.url)
        self.tls = url.scheme == "mqtts" or cfg.tls is not None
        new = self._new_client()
        gone = threading.Event()
        with self._client_lock, self._lock:
            # from here on nothing reaches the old connection: acks of its messages are never
            # sent (the generation moved) and publishes queue on the new client, so the old
            # one's last packet is its DISCONNECT (anything after it is a protocol error,
            # and the broker then publishes the will)
            old, self.client = self.client, new
            self.connected = False
            self.generation += 1
            self._connected_ev.clear()
            old.on_connect = old.on_message = old.on_publish = None
            old.on_disconnect = lambda *args: gone.set()
        CONNECTED.set(0)
        # the network thread stopped first: the DISCONNECT (and whatever was queued before it)
        # is then written by this thread alone; two threads writing one TLS connection can
        # interleave records, which the broker reads as a protocol error (and publishes the will)
        old.loop_stop()
        try:
            if _rc(old.disconnect()) == 0:
                gone.wait(DISCONNECT_WAIT_S)
        except Exception:  # pragma: no cover - already gone
            pass
        # the broker reads the old socket's DISCONNECT and the new socket's CONNECT in either
        # order; a CONNECT first is a session takeover, and the old connection's will is
        # published: give the broker a moment to read the DISCONNECT
        time.sleep(TAKEOVER_PAUSE_S)
        if before_start is not None:   # the old client is gone, the new one not connected yet
            before_start()
        log.info("broker client replaced (reload): reconnecting with the new settings",
                 extra={"fields": {"client_id": self.client_id}})
        if self._started:
            self._started = False
            self.start()

    # --- lifecycle ----------------------------------------------------------------
    def start(self) -> "MqttLink":
        if self.protocol == "5":
            # clean_start on every connect or none: never paho's first-only default
            self.client.connect_async(self.host, self.port, keepalive=self.cfg.keepalive_s,
                                      clean_start=self.clean_session,
                                      properties=(None if self.clean_session
                                                  else mqtt5.connect_properties(self.session_expiry_s)))
        else:
            self.client.connect_async(self.host, self.port, keepalive=self.cfg.keepalive_s)
        self.client.loop_start()
        self._started = True
        return self

    def wait_connected(self, timeout: float) -> bool:
        return self._connected_ev.wait(timeout)

    def stop(self, timeout: float = 2.0) -> None:
        if not self._started:
            return
        self._started = False
        self._closing = True
        try:
            self.client.disconnect()
        except Exception:  # pragma: no cover - already gone
            pass
        self.client.loop_stop()
        with self._lock:
            self.connected = False
            self._connected_ev.clear()
        CONNECTED.set(0)

    # --- paho callbacks (network thread) --------------------------------------------
    def _cb_connect(self, client, userdata, flags, rc, properties=None) -> None:
        code = _rc(rc)
        if code != 0:
            CONNECTS.labels("refused").inc()
            log.warning("broker refused the connection", extra={"fields": {"rc": code, "host": self.host,
                                                                          "port": self.port}})
            return
        session_present = bool(getattr(flags, "session_present", None) if not isinstance(flags, dict)
                               else flags.get("session present"))
        CONNECTS.labels("ok").inc()
        lost = mqtt5.session_lost(not self.clean_session, self._previous_client_id, self.client_id,
                                  session_present)
        self._previous_client_id = self.client_id
        self.session_present, self.session_lost = session_present, lost
        if self.protocol == "5":
            self.granted_session_expiry_s = mqtt5.granted_session_expiry(properties)
        if lost:
            self.sessions_lost += 1
            mqtt5.SESSIONS_LOST.inc()
            log.warning("the broker kept no session for this client id: messages queued for it meanwhile are lost",
                        extra={"fields": {"client_id": self.client_id, "protocol": self.protocol}})
        with self._lock:
            for topic in sorted(self._unsubscribe_pending):
                if _rc(client.unsubscribe(topic)[0]) == 0:
                    self._unsubscribe_pending.discard(topic)
            for topic, qos in self.subscriptions.items():
                client.subscribe(topic, qos)
            self.generation += 1
            self.connected = True
            gen = self.generation
            self._connected_ev.set()
        CONNECTED.set(1)
        log.info("connected to the broker", extra={"fields": {"host": self.host, "port": self.port,
                                                              "client_id": self.client_id,
                                                              "session_present": session_present,
                                                              "protocol": self.protocol,
                                                              "paho": PAHO_VERSION}})
        if self._on_connect:
            try:
                self._on_connect(gen, session_present)
            except Exception:
                log.exception("on_connect handler failed")

    def _cb_disconnect(self, client, userdata, *args) -> None:
        # 1.6: (rc) on 3.1.1, (reason_code, properties) on 5; 2.x: (disconnect_flags, reason_code, properties)
        rc = _rc(args[1] if PAHO_MAJOR >= 2 and len(args) >= 2 else (args[0] if args else 0))
        with self._lock:
            was = self.connected
            self.connected = False
            self.generation += 1  # acks of messages from the old connection are never sent
            self._connected_ev.clear()
        CONNECTED.set(0)
        if was and not self._closing:
            log.warning("disconnected from the broker; reconnecting", extra={"fields": {"rc": rc}})
        if self._on_disconnect:
            try:
                self._on_disconnect(rc)
            except Exception:
                log.exception("on_disconnect handler failed")

    def _cb_message(self, client, userdata, msg) -> None:
        try:
            MESSAGES.labels("in", self.topic_kind(msg.topic)).inc()
            m = Message(msg.topic, bytes(msg.payload), msg.qos, msg.mid, bool(getattr(msg, "dup", False)),
                        self.generation, time.monotonic(),
                        mqtt5.message_props(msg) if self.protocol == "5" else None)
            if self._on_message:
                self._on_message(m)
        except Exception:  # never let a payload kill paho's thread
            log.exception("message handler failed")

    def _cb_publish(self, client, userdata, mid, *args) -> None:
        # 2.x: (reason_code, properties); 1.6: the reason capture_puback_reasons read
        code = _rc(args[0]) if args else self._puback_reasons.get(mid, 0)
        if code > 0 and mqtt5.is_refusal(code):
            self._refused[mid] = code
            mqtt5.REFUSED.labels(mqtt5.reason_label(code)).inc()
            if self._on_refused:
                try:
                    self._on_refused(mid, code)
                except Exception:
                    log.exception("on_refused handler failed")
                return
            log.warning("the broker refused a publish", extra={"fields": {"mid": mid,
                                                                       "reason_code": mqtt5.reason_label(code)}})
        else:
            self._refused.pop(mid, None)
        if self._on_publish:
            try:
                self._on_publish(mid)
            except Exception:
                log.exception("on_publish handler failed")

    # --- calls from any thread -----------------------------------------------------
    def ack(self, msg: Message) -> bool:
        """PUBACK a QoS 1 message, if its connection is still the current one."""
        if msg.qos == 0:
            return True
        with self._lock:
            if msg.generation != self.generation or not self.connected:
                return False
            if PAHO_MAJOR >= 2:
                rc = self.client.ack(msg.mid, msg.qos)
            elif self.deferred_ack:
                rc = self._real_puback(self.client, msg.mid)
            else:
                return True  # synchronous mode: paho acks when on_message returns
        return _rc(rc) == 0

    def subscribe(self, topic: str, qos: int = 1) -> None:
        """Subscribe now if connected, and on every connect from now on."""
        with self._lock:
            self.subscriptions[topic] = qos
            self._unsubscribe_pending.discard(topic)
            if self.connected:
                self.client.subscribe(topic, qos)

    def unsubscribe(self, topic: str) -> None:
        """Unsubscribe now if connected, else on the next connect; never again subscribed
        on a connect (until :meth:`subscribe`)."""
        with self._lock:
            self.subscriptions.pop(topic, None)
            if not self.connected or _rc(self.client.unsubscribe(topic)[0]) != 0:
                self._unsubscribe_pending.add(topic)

    def _properties(self, props: Optional[MessageProps]):
        """paho PUBLISH properties: MQTT 5 only (a 3.1.1 PUBLISH has none to carry)."""
        return mqtt5.publish_properties(props) if self.protocol == "5" else None

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                props: Optional[MessageProps] = None) -> tuple[int, int]:
        """(rc, mid). rc != 0 when not connected; QoS 1 messages are still queued by paho."""
        with self._client_lock:   # never on a client replace_client took away
            info = self.client.publish(topic, payload, qos=qos, retain=retain, properties=self._properties(props))
        MESSAGES.labels("out", self.topic_kind(topic)).inc()
        return _rc(info.rc), info.mid

    def publish_wait(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                     timeout: float = 2.0, props: Optional[MessageProps] = None) -> bool:
        """True once the broker acknowledged the publish, and did not refuse it (MQTT 5)."""
        with self._client_lock:   # never on a client replace_client took away
            info = self.client.publish(topic, payload, qos=qos, retain=retain, properties=self._properties(props))
        MESSAGES.labels("out", self.topic_kind(topic)).inc()
        try:
            info.wait_for_publish(timeout)
        except (RuntimeError, ValueError):
            return False
        # a refusal of this mid stays in _refused until the mid is acknowledged again
        return info.is_published() and self._refused.pop(info.mid, None) is None
