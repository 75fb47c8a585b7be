"""What the plant's broker can carry, as configuration: a named :class:`BrokerProfile`
(``mqtt.profile``) with single limits overridden by ``mqtt.limits``, and the check that
refuses a config the profile cannot carry (``config check``, exit 2).

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

from agent.config import Config, ConfigError, MqttConfig

from .topics import Topics

# the MQTT versions the link may speak (``mqtt.protocol``); 3.1.1 until it says otherwise
PROTOCOLS = ("3.1.1", "5")
DEFAULT_PROTOCOL = "3.1.1"
# Ids the contract allows (topics.ID_RE): config check computes each topic for the longest.
ID_MAX = 128
# The largest status an agent writes (a 4 KiB stderr tail, every byte escaped) stays below
# this (agent/cloud/peers.py's MAX_BYTES): a broker that cannot carry it loses final statuses.
STATUS_MAX_BYTES = 32 * 1024
# Pushes, cancels and statuses are published and subscribed at QoS 1 (the contract).
QOS_USED = 1
IDS = "cluster and agent_id"   # what makes a topic under the agent's own prefix long


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


def client_id(cfg: Config) -> str:
    """The client id the agent connects with (as agent/cloud/component.py's client_id_for)."""
    return cfg.mqtt.client_id or f"millwright-{cfg.cluster}-{cfg.agent_id}"


def _worst_topics(cfg: Config) -> list[tuple[str, str, str]]:
    """(key to blame, the topic as its pattern, the longest topic it can be) for every topic
    this agent publishes or subscribes to: ids at the contract's longest (128 characters),
    each key's longest topic first."""
    t, longest, ids = Topics(cfg.cluster, cfg.agent_id), "x" * ID_MAX, IDS
    out = [(ids, "millwright/<c>/agents/<agent_id>/status/<job_id>", t.status(longest)),
           (ids, "millwright/<c>/agents/<agent_id>/get/<correlation>", t.get_reply(longest)),
           (ids, "millwright/<c>/agents/<agent_id>/audit/checkpoint", t.checkpoint()),
           (ids, "millwright/<c>/agents/<agent_id>/rejected", t.rejections()),
           (ids, "millwright/<c>/agents/<agent_id>/presence", t.presence()),
           (ids, "millwright/<c>/agents/<agent_id>/status/+", t.agent_prefix() + "status/+"),
           ("cluster", "millwright/<c>/jobs/cancel", t.cancel),
           ("cluster", "millwright/<c>/jobs/push", t.push),
           ("cluster", "millwright/<c>/jobs/get", t.jobs_get)]
    for name, tpl in sorted(cfg.templates.items()):
        for gate, g in sorted((tpl.gates if tpl is not None else {}).items()):
            if g is not None and g.mqtt:
                out.append((f"templates.{name}.gates.{gate}.mqtt", g.mqtt, g.mqtt))
    return out


def subscriptions(cfg: Config) -> int:
    """Filters the agent's connection holds at least: push, cancel, jobs/get, each distinct
    gate topic, and (unless ``mqtt.peers_username`` reads them on a connection of its own)
    its own statuses, with one more per further cluster member (agent/cloud/peersubs.py)."""
    gates = {g.mqtt for tpl in cfg.templates.values() if tpl is not None
             for g in tpl.gates.values() if g is not None and g.mqtt}
    return 3 + len(gates) + (0 if cfg.mqtt.peers_username else 1)


def check_profile(cfg: Config, protocol: str = DEFAULT_PROTOCOL,
                  session_expiry_s: Optional[int] = None) -> list[str]:
    """What of ``cfg`` its broker profile cannot carry, one line each naming the key, the
    value, the profile and the limit (``config check`` refuses them, exit 2).

    ``protocol`` and ``session_expiry_s`` are what the link requests (``mqtt.protocol``,
    ``mqtt.session_expiry_s``, once the config has them; until then the link speaks
    3.1.1 and requests no expiry): the caller passes them, this module reads no key the
    config may lack. Each SUBSCRIBE the link sends carries one filter, so
    ``subs_per_subscribe`` holds whatever its value; gate topics are single topics, so
    ``retained_wildcard`` does too."""
    profile, problems = resolve(cfg.mqtt)
    if profile is None:
        return [f"{cfg.source}: {p}" for p in problems]
    m, p = cfg.mqtt, profile
    out: list[str] = []

    def limit(name: str) -> str:
        """Where the limit comes from: the override, or the profile."""
        if name in (m.limits or {}):
            return f"mqtt.limits.{name} of broker profile {p.name}"
        return f"broker profile {p.name} (mqtt.limits.{name})"

    def bad(key: str, text: str) -> None:
        out.append(f"{cfg.source}: {key}: {text}")

    if protocol not in p.protocols:
        bad("mqtt.protocol", f"{protocol!r} is not spoken by {limit('protocols')}: it speaks MQTT "
                             f"{', '.join(p.protocols)}")
    if p.max_qos < QOS_USED:
        bad("mqtt.profile", f"{p.name!r}: the contract publishes and subscribes at QoS {QOS_USED}, over the "
                            f"highest QoS {p.max_qos} of {limit('max_qos')}")
    if p.max_payload_bytes is not None:
        for key, value, what in (("mqtt.max_payload_bytes", m.max_payload_bytes, "the largest push accepted"),
                                 ("mqtt.get_page_bytes", m.get_page_bytes, "the largest jobs/get answer")):
            if value > p.max_payload_bytes:
                bad(key, f"{value} ({what}) is over the payload limit of {p.max_payload_bytes} bytes of "
                         f"{limit('max_payload_bytes')}")
        if p.max_payload_bytes < STATUS_MAX_BYTES:
            bad("mqtt.profile", f"{p.name!r}: a status document may take {STATUS_MAX_BYTES} bytes, over the payload "
                                f"limit of {p.max_payload_bytes} bytes of {limit('max_payload_bytes')}")
    told: set[Any] = set()
    for key, pattern, topic in _worst_topics(cfg):
        levels, size = topic.count("/") + 1, len(topic.encode("utf-8"))
        deep = key if key.startswith("templates.") else "the contract"
        if p.max_topic_levels is not None and levels > p.max_topic_levels and ("levels", deep) not in told:
            told.add(("levels", deep))   # the contract's deepest topic is listed first
            where = key if key.startswith("templates.") else (
                "mqtt.limits.max_topic_levels" if "max_topic_levels" in (m.limits or {}) else "mqtt.profile")
            bad(where, f"the topic {pattern} has {levels} levels, over the {p.max_topic_levels} of "
                       f"{limit('max_topic_levels')}")
        if p.max_topic_bytes is None or size <= p.max_topic_bytes or key in told:
            continue
        told.add(key)   # the longest topic of each key is listed first: one line says it
        if key.startswith("templates."):
            bad(key, f"the topic {topic!r} is {size} bytes, over the {p.max_topic_bytes} of "
                     f"{limit('max_topic_bytes')}")
            continue
        fixed = size - len(cfg.cluster.encode("utf-8")) - (len(cfg.agent_id.encode("utf-8")) if key == IDS else 0)
        who = f"{cfg.agent_id!r} with cluster {cfg.cluster!r}" if key == IDS else repr(cfg.cluster)
        bad("agent_id" if key == IDS else "cluster",
            f"{who} makes the topic {pattern} {size} bytes (ids of {ID_MAX} characters), over the "
            f"{p.max_topic_bytes} of {limit('max_topic_bytes')}: {'cluster and agent_id' if key == IDS else 'cluster'}"
            f" may have {max(0, p.max_topic_bytes - fixed)} bytes" + (" together" if key == IDS else ""))
    cid = client_id(cfg)
    if p.client_id_max_bytes is not None and len(cid.encode("utf-8")) > p.client_id_max_bytes:
        key = "mqtt.client_id" if m.client_id else "agent_id"
        bad(key, f"the client id {cid!r} is {len(cid.encode('utf-8'))} bytes, over the {p.client_id_max_bytes} of "
                 f"{limit('client_id_max_bytes')}" + ("" if m.client_id else
                                                      " (millwright-<cluster>-<agent_id>: set mqtt.client_id)"))
    subs = subscriptions(cfg)
    if p.subs_per_connection is not None and subs > p.subs_per_connection:
        peers = "" if m.peers_username else ", its own statuses (one more per further member)"
        gated = subs > 3 + (0 if m.peers_username else 1)
        bad("templates" if gated else "mqtt.limits.subs_per_connection", f"the connection subscribes to {subs} filters (push, cancel, jobs/get, the templates' "
                         f"distinct gate topics{peers}), over the {p.subs_per_connection} of "
                         f"{limit('subs_per_connection')}")
    if session_expiry_s is not None and p.session_expiry_max_s is not None and session_expiry_s > p.session_expiry_max_s:
        bad("mqtt.session_expiry_s", f"{session_expiry_s} is over the {p.session_expiry_max_s} s of "
                                     f"{limit('session_expiry_max_s')}")
    return out
