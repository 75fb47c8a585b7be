"""Targeting, as pure logic: agent labels, a job's target, placement pools and eligibility.

A job's *target* names where it may run: one agent (``{"agent": "gw-3"}``), any agent whose
labels include a selector (``{"labels": {"line": "2"}}``), or every such agent
(``"fanout": true``). The canonical target together with the job's template is the job's
*placement pool*; its id is a short hash of that canonical JSON, so every agent derives
the same pool from the same document. Untargeted jobs are in the pool ``default`` (the
cluster's shard space of contract v1). An agent is *eligible* for a pool when it is
available, matches the target, and has the job's template: an agent that lacks the
template is never eligible, whatever its labels.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Iterable, Mapping, Optional

DEFAULT_POOL = "default"
LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")
LABEL_VALUE_RE = re.compile(r"^[A-Za-z0-9._-]{1,63}$")
AGENT_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
MAX_LABELS = 32          # per agent
MAX_SELECTOR = 16        # per job target
TARGET_KEYS = ("agent", "labels", "fanout")
POOL_ID_RE = re.compile(r"^[0-9a-f]{16}$")


class TargetError(ValueError):
    """A target or label set that is not valid: ``field`` names the offending path."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _show(value: Any, limit: int = 40) -> str:
    text = json.dumps(value, ensure_ascii=True) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_labels(labels: Any, where: str, limit: int = MAX_LABELS) -> dict[str, str]:
    """A label set: a mapping of at most ``limit`` keys (LABEL_KEY_RE) to string values
    (LABEL_VALUE_RE). Raises TargetError with the offending path."""
    if not isinstance(labels, dict):
        raise TargetError(where, f"must be a mapping of label keys to strings, got {type(labels).__name__}")
    if len(labels) > limit:
        raise TargetError(where, f"has {len(labels)} labels; at most {limit} are allowed")
    out: dict[str, str] = {}
    for k, v in labels.items():
        if not isinstance(k, str) or not LABEL_KEY_RE.fullmatch(k):
            raise TargetError(where, f"label key {_show(k)} must match {LABEL_KEY_RE.pattern}")
        if not isinstance(v, str):
            raise TargetError(f"{where}.{k}", f"must be a string, got {_show(v)} (quote numbers in YAML)")
        if not LABEL_VALUE_RE.fullmatch(v):
            raise TargetError(f"{where}.{k}", f"value {_show(v)} must match {LABEL_VALUE_RE.pattern}")
        out[k] = v
    return out


def check_target(target: Any, where: str = "target") -> dict:
    """The canonical form of a job's target (sorted selector; ``fanout`` only when true)."""
    if not isinstance(target, dict):
        raise TargetError(where, f"must be an object with agent or labels, got {type(target).__name__}")
    unknown = [k for k in target if k not in TARGET_KEYS]
    if unknown:
        raise TargetError(f"{where}.{_show(unknown[0])}", f"unknown key (allowed: {', '.join(TARGET_KEYS)})")
    has_agent, has_labels = "agent" in target, "labels" in target
    if has_agent == has_labels:
        raise TargetError(where, "needs exactly one of agent (pinned) or labels (selector)")
    fanout = target.get("fanout", False)
    if not isinstance(fanout, bool):
        raise TargetError(f"{where}.fanout", f"must be true or false, got {_show(fanout)}")
    if has_agent:
        agent = target["agent"]
        if not isinstance(agent, str) or not AGENT_RE.fullmatch(agent):
            raise TargetError(f"{where}.agent", f"{_show(agent)} is not an agent id ([A-Za-z0-9._-]{{1,128}})")
        if fanout:
            raise TargetError(f"{where}.fanout", "is only allowed with labels (a pinned job runs on one agent)")
        return {"agent": agent}
    labels = check_labels(target["labels"], f"{where}.labels", MAX_SELECTOR)
    if not labels:
        raise TargetError(f"{where}.labels", "must name at least one label (omit target to run anywhere)")
    out: dict[str, Any] = {"labels": dict(sorted(labels.items()))}
    if fanout:
        out["fanout"] = True
    return out


def pool_spec(target: Optional[dict], template: str) -> Optional[dict]:
    """The placement pool of a job (None: the default pool)."""
    if not target:
        return None
    return {"template": template, **target}


def pool_id(spec: Optional[dict]) -> str:
    if spec is None:
        return DEFAULT_POOL
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def pool_of_doc(doc: Mapping) -> str:
    """The pool id of a stored job document; malformed targets fall in no pool (``""``),
    so no agent ever loads them (ingest refuses them; etcd is not trusted)."""
    target = doc.get("target")
    if target is None:
        return DEFAULT_POOL
    try:
        return pool_id(pool_spec(check_target(target), str(doc.get("template", ""))))
    except TargetError:
        return ""


def matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def eligible(agent: str, labels: Mapping[str, str], templates: Iterable[str], spec: Mapping) -> bool:
    """May this agent run jobs of the pool ``spec``?"""
    if spec.get("template") not in set(templates):
        return False
    if "agent" in spec:
        return agent == spec["agent"]
    return matches(labels, spec.get("labels") or {})


def unknown_keys(spec: Mapping, known: Iterable[str]) -> list[str]:
    """Selector keys no member has published: the target cannot match any agent seen yet."""
    seen = set(known)
    return sorted(k for k in (spec.get("labels") or {}) if k not in seen)


def templates_digest(templates: Mapping[str, Any]) -> str:
    """A short hash of the template configuration (published with the names, so an
    operator can see which agents run different versions of a template)."""
    text = json.dumps({k: repr(v) for k, v in sorted(templates.items())}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
