"""Reading what agents wrote: run records in etcd and audit records on disk.

The audit reader is the product's own (agent/audit/show.py: complete lines, oldest
first), so tests see exactly what `millwright audit show` shows.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from agent.audit.show import Filter, records
from agent.coordination.keys import Keys


def run_records(client: Any, keys: Keys) -> dict[tuple[str, str], dict]:
    """Every run record of the cluster: (job_id, fire_id) -> record."""
    kvs, _ = client.get_prefix(keys.runs_prefix())
    out = {}
    for kv in kvs:
        r = json.loads(kv.value)
        out[(r["job_id"], r["fire_id"])] = r
    return out


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
