"""The check that refuses a config its broker profile (agent/brokerlimits.py) cannot
carry: the contract's topics for the longest ids, payloads, subscriptions, the client id
(``config check`` and the agent's start, exit 2).

Why a check before the first connection: a broker that cannot carry a topic, a payload or
a subscription does not say so in a way the agent can act on (AWS IoT Core drops the
connection; 3.1.1 has no reason codes), so a cluster whose ids are one character too long
would lose its statuses in silence."""

from __future__ import annotations

from typing import Any, Optional

from agent.brokerlimits import QOS_USED, STATUS_MAX_BYTES, resolve
from agent.config import Config, ConfigError

from .topics import Topics

ID_MAX = 128   # ids the contract allows (topics.ID_RE): each topic computed for the longest
IDS = "cluster and agent_id"   # what makes a topic under the agent's own prefix long


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
    """Filters the agent's connection holds: push, cancel, jobs/get and each distinct gate
    topic (no agent reads another's statuses)."""
    gates = {g.mqtt for tpl in cfg.templates.values() if tpl is not None
             for g in tpl.gates.values() if g is not None and g.mqtt}
    return 3 + len(gates)


def check_profile(cfg: Config, protocol: Optional[str] = None,
                  session_expiry_s: Optional[int] = None) -> list[str]:
    """What of ``cfg`` its broker profile cannot carry, one line each naming the key, the
    value, the profile and the limit (``config check`` refuses them, exit 2).

    ``protocol`` and ``session_expiry_s`` are what the link requests: by default
    ``mqtt.protocol``, and ``mqtt.session_expiry_s`` on MQTT 5 (3.1.1 requests no expiry).
    Each SUBSCRIBE the link sends carries one filter, so
    ``subs_per_subscribe`` holds whatever its value; gate topics are single topics, so
    ``retained_wildcard`` does too."""
    profile, _ = resolve(cfg.mqtt)
    if profile is None:
        return []   # an unusable profile or limit: the config's validation reports it, once
    protocol = protocol or cfg.mqtt.protocol
    if session_expiry_s is None and protocol == "5":
        session_expiry_s = cfg.mqtt.session_expiry_s
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
        gated = subs > 3
        bad("templates" if gated else "mqtt.limits.subs_per_connection", f"the connection subscribes to {subs} filters (push, cancel, jobs/get, the templates' "
                         f"distinct gate topics), over the {p.subs_per_connection} of "
                         f"{limit('subs_per_connection')}")
    if session_expiry_s is not None and p.session_expiry_max_s is not None and session_expiry_s > p.session_expiry_max_s:
        bad("mqtt.session_expiry_s", f"{session_expiry_s} is over the {p.session_expiry_max_s} s of "
                                     f"{limit('session_expiry_max_s')}")
    return out


def require_fit(cfg: Config) -> None:
    """Raise ConfigError naming what the profile cannot carry: an agent and `millwright
    push` do not start on a broker connection `config check` refuses."""
    problems = check_profile(cfg)
    if problems:
        raise ConfigError(problems)
