"""What the plant's broker can carry, as configuration: a named :class:`BrokerProfile`
(``mqtt.profile``) with single limits overridden by ``mqtt.limits``. Validated with the
rest of the config (agent/configcheck.py); what a config asks of it (its topics, payloads,
subscriptions) is checked by agent/cloud/profile.py, which knows the contract's topics.

Why a check before the first connection: a broker that cannot carry a topic, a payload or
a subscription does not say so in a way the agent can act on (AWS IoT Core drops the
connection; 3.1.1 has no reason codes), so a cluster whose ids are one character too long
would lose its statuses in silence. The limits are the brokers' published ones (AWS IoT
Core's quotas) or what the contract needs of a broker we configure ourselves (mosquitto's
``message_size_limit`` is written equal to ``mqtt.max_payload_bytes`` by `millwright
broker settings`, so the profile leaves it open). The outbox's pacing to ``publish_rate``,
the link's ``max_inflight`` and the session expiry are used at run time (issue 50)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from agent.config import ConfigError, MqttConfig

# the MQTT versions the link may speak (``mqtt.protocol``)
PROTOCOLS = ("3.1.1", "5")
# The largest status an agent writes (a 4 KiB stderr tail, every byte escaped) stays below
# this: a broker that cannot carry it loses final statuses.
STATUS_MAX_BYTES = 32 * 1024
# Pushes, cancels and statuses are published and subscribed at QoS 1 (the contract).
QOS_USED = 1


@dataclass(frozen=True)
class BrokerProfile:
    """A broker's limits; None: the broker sets none the agent must keep."""

    name: str
    protocols: tuple[str, ...]           # MQTT versions it speaks ("3.1.1", "5")
    max_qos: int                         # highest QoS it grants
    max_payload_bytes: Optional[int]     # largest PUBLISH payload
    publish_rate: Optional[float]        # PUBLISH requests per second per connection
    max_inflight: int                    # unacknowledged QoS 1 messages per client
    max_topic_levels: Optional[int]      # levels of a topic or filter (7 slashes: 8 levels)
    max_topic_bytes: Optional[int]       # UTF-8 bytes of a topic or filter
    session_expiry_max_s: Optional[int]  # longest persistent session it keeps
    retained_wildcard: bool              # delivers retained messages to a wildcard filter
    subs_per_connection: Optional[int]   # subscriptions one connection may hold
    subs_per_subscribe: Optional[int]    # filters in one SUBSCRIBE packet
    client_id_max_bytes: Optional[int]   # UTF-8 bytes of a client id


PROFILES: dict[str, BrokerProfile] = {
    # ours: `millwright broker settings` sets message_size_limit to mqtt.max_payload_bytes
    "mosquitto": BrokerProfile(
        name="mosquitto", protocols=("3.1.1", "5"), max_qos=1, max_payload_bytes=None, publish_rate=None,
        max_inflight=256, max_topic_levels=None, max_topic_bytes=None, session_expiry_max_s=None,
        retained_wildcard=True, subs_per_connection=None, subs_per_subscribe=None, client_id_max_bytes=None),
    # AWS IoT Core's published message broker quotas (not adjustable, but for subscriptions)
    "aws-iot-core": BrokerProfile(
        name="aws-iot-core", protocols=("3.1.1", "5"), max_qos=1, max_payload_bytes=128 * 1024, publish_rate=100.0,
        max_inflight=100, max_topic_levels=8, max_topic_bytes=256, session_expiry_max_s=7 * 86400,
        retained_wildcard=True, subs_per_connection=50, subs_per_subscribe=8, client_id_max_bytes=128),
    # NATS server 2.9's MQTT: 3.1.1 only, QoS <= 1, max_payload 1 MiB by default
    "nats-2.9": BrokerProfile(
        name="nats-2.9", protocols=("3.1.1",), max_qos=1, max_payload_bytes=1024 * 1024, publish_rate=None,
        max_inflight=256, max_topic_levels=None, max_topic_bytes=None, session_expiry_max_s=None,
        retained_wildcard=True, subs_per_connection=None, subs_per_subscribe=None, client_id_max_bytes=None),
    # RabbitMQ 3.10's MQTT plugin: 3.1.1 only, mqtt.prefetch (10) in flight, sessions kept
    # mqtt.subscription_ttl (1 day), no retained message for a wildcard filter; payload ours
    "rabbitmq-3.10": BrokerProfile(
        name="rabbitmq-3.10", protocols=("3.1.1",), max_qos=1, max_payload_bytes=65536, publish_rate=None,
        max_inflight=10, max_topic_levels=None, max_topic_bytes=None, session_expiry_max_s=86400,
        retained_wildcard=False, subs_per_connection=None, subs_per_subscribe=None, client_id_max_bytes=None),
}

# mqtt.limits.<name>: every field but the profile's name
LIMITS = tuple(f.name for f in dataclasses.fields(BrokerProfile) if f.name != "name")
_OPTIONAL = {"max_payload_bytes", "publish_rate", "max_topic_levels", "max_topic_bytes", "session_expiry_max_s",
             "subs_per_connection", "subs_per_subscribe", "client_id_max_bytes"}   # null: no limit


def _limit_value(name: str, value: Any) -> tuple[Any, Optional[str]]:
    """(the value as the profile holds it, None) or (None, what is wrong with it)."""
    if value is None:
        return (None, None) if name in _OPTIONAL else (None, "may not be null (this limit always holds)")
    if name == "protocols":
        if (isinstance(value, list) and value and all(isinstance(v, str) for v in value)
                and set(value) <= set(PROTOCOLS)):
            return tuple(value), None
        return None, f"{value!r}: expected a non-empty list of {' and '.join(repr(p) for p in PROTOCOLS)}"
    if name == "retained_wildcard":
        return (value, None) if isinstance(value, bool) else (None, f"{value!r}: expected true or false")
    if name == "publish_rate":
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value), None
        return None, f"{value!r}: expected a number of publishes per second greater than 0, or null (no limit)"
    low = 0 if name == "max_qos" else 1
    if isinstance(value, int) and not isinstance(value, bool) and value >= low and (name != "max_qos" or value <= 2):
        return value, None
    what = "0, 1 or 2" if name == "max_qos" else "an integer of at least 1" + (", or null (no limit)"
                                                                            if name in _OPTIONAL else "")
    return None, f"{value!r}: expected {what}"


def resolve(m: MqttConfig) -> tuple[Optional[BrokerProfile], list[str]]:
    """The profile ``mqtt.profile`` names with ``mqtt.limits`` applied, and what is wrong
    with either (``"<key>: <problem>"``, no file: the caller prefixes it)."""
    base = PROFILES.get(m.profile)
    problems: list[str] = []
    if base is None:
        problems.append(f"mqtt.profile: {m.profile!r} is not a broker profile (known: {', '.join(PROFILES)})")
    changes: dict[str, Any] = {}
    limits = m.limits if isinstance(m.limits, dict) else {}
    for name, value in limits.items():
        if name not in LIMITS:
            problems.append(f"mqtt.limits.{name}: unknown limit (known: {', '.join(LIMITS)})")
            continue
        value, why = _limit_value(name, value)
        if why:
            problems.append(f"mqtt.limits.{name}: {why}")
        else:
            changes[name] = value
    if base is None or problems:
        return None, problems
    return dataclasses.replace(base, **changes), []


def effective_profile(m: MqttConfig) -> BrokerProfile:
    """The broker profile this config's link must keep; ConfigError when ``mqtt.profile``
    or ``mqtt.limits`` is unusable (a validated config never is)."""
    profile, problems = resolve(m)
    if profile is None:
        raise ConfigError(problems)
    return profile
