"""Reading what agents wrote: run records in etcd, audit records on disk, the status
documents in their MQTT outbox.

The audit reader is the product's own (agent/audit/show.py: complete lines, oldest
first), so tests see exactly what `millwright audit show` shows.
"""

from __future__ import annotations

import json
import os
import sqlite3
from typing import Any, Optional

from agent.audit.show import Filter, records
from agent.coordination.keys import Keys, shard_of


def run_records(client: Any, keys: Keys) -> dict[tuple[str, str], dict]:
    """Every run record of the cluster: (job_id, fire_id) -> record."""
    kvs, _ = client.get_prefix(keys.runs_prefix())
    out = {}
    for kv in kvs:
        r = json.loads(kv.value)
        out[(r["job_id"], r["fire_id"])] = r
    return out


def job_runs(client: Any, keys: Keys, shards: int, job_id: str) -> dict[str, dict]:
    """The run records of one job: fire_id -> record, oldest firing first."""
    kvs, _ = client.get_prefix(keys.runs_prefix(shard_of(job_id, shards), job_id))
    return {kv.key.rsplit("/", 1)[1]: json.loads(kv.value) for kv in kvs}


def latest_by_job(recs: dict[tuple[str, str], dict]) -> dict[str, dict]:
    """job_id -> its latest firing's record (fire ids sort by due time)."""
    return {jid: r for (jid, _), r in sorted(recs.items())}


def audit_records(audit_dir: str, types: Optional[set[str]] = None) -> list[dict]:
    """The audit records in a directory, oldest first; only these types when given."""
    if not os.path.isdir(audit_dir):
        return []
    return [rec for _, rec in records(audit_dir, Filter(types=types))]


def agent_audit(agent: Any, types: Optional[set[str]] = None) -> list[dict]:
    """audit_records of an AgentProcess (its configured audit dir)."""
    return audit_records(agent.config["audit"]["dir"], types)


def outbox_statuses(state_dir: str) -> list[dict]:
    """The status documents in an agent's MQTT outbox (state_dir/mqtt-outbox.sqlite), sent
    or not, oldest first; rejections of unauthenticated pushes (their own topic) left out."""
    path = os.path.join(state_dir, "mqtt-outbox.sqlite")
    if not os.path.exists(path):
        return []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        return [json.loads(p) for t, p in db.execute("SELECT topic, payload FROM outbox ORDER BY seq") if "/status/" in t]
    finally:
        db.close()


def agent_statuses(agent: Any) -> list[dict]:
    """outbox_statuses of an AgentProcess (its configured state dir)."""
    return outbox_statuses(agent.config["state_dir"])
