"""The answer an answer marker stands for, rebuilt from the facts in etcd.

A marker (agent/cloud/answers.py) is a copy of a status kept in etcd until the broker has
it, and any etcd client can write one. So when the shard's owner publishes a marker whose
writer is gone, it does not repeat the marker's words: it rebuilds the status from the
fact the answer states, and publishes nothing when there is no such fact.

- ``run.<fire_id>``: the fenced run record ``runs/<shard>/<job>/<fire_id>``, written in the
  marker's own transaction: it must exist, be final, be of that job and firing, and name
  the marker's agent;
- ``accepted``: the stored job ``jobs/<shard>/<job>``, created in the marker's own
  transaction: it must exist and name the marker's agent in ``_accepted.by``;
- ``rejected.<push_sha256>``: a rejection has no other fact; the status keeps only what
  the marker can say without inventing anything: a reason an authenticated push can be
  refused for, a one-line detail, the agent.

Anything else raises :class:`Unfounded` (the owner deletes the marker, counts and audits it).
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from agent.coordination.keys import Keys
from agent.jobs.envelope import (
    BAD_FIELD,
    BAD_PARAM,
    EXPIRED,
    SKEW,
    TOO_OLD,
    UNKNOWN_TEMPLATE,
    UNSUPPORTED_VERSION,
    clip,
)
from agent.jobs.render import run_id
from agent.jobs.states import TERMINAL, JobState
from agent.runtime.timefmt import now_rfc3339

from .topics import ID_RE

DIGEST_RE = re.compile(r"[0-9a-f]{16}")
# why an authenticated, bound push is refused (ingest.py); unauthenticated input has no marker
REJECTION_REASONS = frozenset({UNSUPPORTED_VERSION, BAD_FIELD, UNKNOWN_TEMPLATE, BAD_PARAM, EXPIRED, TOO_OLD, SKEW,
                               "cancelled", "conflict"})
DETAIL_MAX = 300


class Unfounded(Exception):
    """The marker states no fact etcd holds; ``reason`` is a stable code for metrics and audit."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def marker_writer(doc: dict) -> Optional[str]:
    """Who last wrote this marker's answer to the broker: the agent that republished it
    (``published_by``, stamped when it handed its copy over), else the one that decided it."""
    who = doc.get("published_by") or doc.get("agent")
    return who if isinstance(who, str) and ID_RE.fullmatch(who) else None


def _json(kv: Any) -> dict:
    try:
        doc = json.loads(kv.value)
    except (ValueError, RecursionError):
        raise Unfounded("unreadable_fact") from None
    if not isinstance(doc, dict):
        raise Unfounded("unreadable_fact")
    return doc


def _base(job_id: str, shard: int, state: str, agent: str, ts: Any) -> dict:
    return {"v": 1, "job_id": job_id, "run_id": None, "fire_id": None, "state": state, "attempt": None,
            "agent": agent, "shard": shard,
            "ts": ts if isinstance(ts, str) else now_rfc3339(), "exit_code": None, "reason": None, "usage": None}


def rebuild(client: Any, keys: Keys, shard: int, job_id: str, name: str, marker: dict) -> dict:
    """The status the marker ``answers/<shard>/<job_id>/<name>`` stands for, from etcd.
    Raises Unfounded; EtcdUnavailable/EtcdError pass through (the sweep tries later)."""
    agent = marker.get("agent")
    if not ID_RE.fullmatch(job_id) or not isinstance(agent, str) or not ID_RE.fullmatch(agent):
        raise Unfounded("bad_marker")
    if name.startswith("run."):
        fire_id = name[len("run."):]
        kv = client.get(keys.run(shard, job_id, fire_id))
        if kv is None:
            raise Unfounded("no_run_record")
        rec = _json(kv)
        if rec.get("job_id") != job_id or rec.get("fire_id") != fire_id:
            raise Unfounded("record_mismatch")
        if rec.get("state") not in TERMINAL:
            raise Unfounded("run_not_final")
        if rec.get("agent") != agent:
            raise Unfounded("other_writer")
        doc = _base(job_id, shard, rec["state"], agent, rec.get("ended_at"))
        attempt = rec.get("attempt")
        doc.update({"run_id": run_id(fire_id, attempt) if isinstance(attempt, int) else None, "fire_id": fire_id,
                    "attempt": attempt, "exit_code": rec.get("exit_code"),
                    "reason": rec.get("reason"), "usage": rec.get("usage"), "due": rec.get("due"),
                    "health": rec.get("health")})
        if rec.get("stderr_tail") is not None:
            doc["stderr_tail"] = rec["stderr_tail"]
        return doc
    if name == "accepted":
        kv = client.get(keys.job(shard, job_id))
        if kv is None:
            raise Unfounded("no_job")
        accepted = _json(kv).get("_accepted")
        if not isinstance(accepted, dict) or accepted.get("by") != agent:
            raise Unfounded("other_writer")
        doc = _base(job_id, shard, JobState.ACCEPTED, agent, accepted.get("at"))
        digest = marker.get("push_sha256")
        if isinstance(digest, str) and DIGEST_RE.fullmatch(digest):
            doc["push_sha256"] = digest
        return doc
    if name.startswith("rejected."):
        digest = name[len("rejected."):]
        reason = marker.get("reason")
        if not DIGEST_RE.fullmatch(digest) or reason not in REJECTION_REASONS:
            raise Unfounded("bad_marker")
        doc = _base(job_id, shard, JobState.REJECTED, agent, None)
        doc.update({"reason": reason, "push_sha256": digest})
        detail = marker.get("detail")
        if isinstance(detail, str):
            doc["detail"] = clip(" ".join(detail.split()), DETAIL_MAX)
        return doc
    raise Unfounded("unknown_answer")
