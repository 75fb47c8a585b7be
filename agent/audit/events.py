"""Typed helpers so every module writes the same record shapes.

Any *audit sink* (the real :class:`agent.audit.AuditLog`, :class:`NullAudit` when audit is
off, :class:`MemoryAudit` in other modules' unit tests) has ``append(type, **fields)``
plus these helpers. Use the helpers rather than ``append`` so that ``audit show --job``
and auditors find the same field names everywhere:

====================  ==========================================================
type                  fields (besides seq, ts, type, prev, mac, v, agent)
====================  ==========================================================
exec                  pid, ppid, uid, comm, filename, argv, job, run_id, cgroup, verdict
job                   event (accepted|rejected|run_start|run_end|...), job, reason,
                      run_id, fire_id, attempt, state, exit_code, shard
lease                 event (granted|lost|revoked|fenced|expired), lease_id, ttl_s, reason
shard                 event (acquired|released|lost|handed_over), shard, owner,
                      fencing_rev, reason
policy_violation      job, run_id, pid, path, rule, action
config                source, sha256, summary
agent_start           version, agent_id, pid, cluster
agent_stop            reason
gap                   source (audit|bpf|...), count/dropped, reason
cleanup               event (quarantined|stuck), tree, entries, reason, where
recovered, checkpoint written by the audit writer itself
====================  ==========================================================

None-valued optional fields are left out, to keep records short.
"""

from __future__ import annotations

import hashlib
import threading
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from agent.config import Config

JOB_EVENTS = frozenset({
    "accepted", "rejected", "scheduled", "run_start", "run_end", "retrying", "cancelled",
    "misfired", "skipped", "timed_out", "killed",
})
LEASE_EVENTS = frozenset({"granted", "renewed", "lost", "revoked", "fenced", "expired"})
SHARD_EVENTS = frozenset({"acquired", "released", "lost", "handed_over", "fenced"})
EXEC_VERDICTS = frozenset({"allowed", "denied", "killed", "violation", "node"})


def _clean(fields: dict) -> dict:
    return {k: v for k, v in fields.items() if v is not None}


def _check(kind: str, event: str, allowed: frozenset) -> None:
    if event not in allowed:
        raise ValueError(f"unknown {kind} event {event!r} (known: {', '.join(sorted(allowed))})")


class RecordHelpers:
    """Mixin: typed record helpers on top of ``append(type, **fields) -> bool``."""

    def append(self, type: str, **fields: Any) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def record(self, type_: str, **fields: Any) -> None:
        """``append`` as parts call it (jobs.seams.AuditSink): a dropped record is the log's
        gap to count, not the caller's to handle."""
        self.append(type_, **fields)

    def exec(self, *, pid: int, filename: str, argv: Optional[list] = None, ppid: Optional[int] = None,
             uid: Optional[int] = None, comm: Optional[str] = None, job: Optional[str] = None,
             run_id: Optional[str] = None, cgroup: Optional[str] = None, verdict: str = "allowed",
             **extra: Any) -> bool:
        """A process exec seen by the sensor; ``job`` is None for node activity (verdict ``node``)."""
        _check("exec verdict", verdict, EXEC_VERDICTS)
        return self.append("exec", **_clean(dict(pid=pid, ppid=ppid, uid=uid, comm=comm, filename=filename,
                                                  argv=argv, job=job, run_id=run_id, cgroup=cgroup,
                                                  verdict=verdict, **extra)))

    def job(self, event: str, job: str, *, reason: Optional[str] = None, run_id: Optional[str] = None,
            fire_id: Optional[str] = None, attempt: Optional[int] = None, state: Optional[str] = None,
            exit_code: Optional[int] = None, shard: Optional[int] = None, **extra: Any) -> bool:
        """Job lifecycle: accepted/rejected (with reason), run_start, run_end (state, exit_code, reason)."""
        _check("job", event, JOB_EVENTS)
        return self.append("job", **_clean(dict(event=event, job=job, reason=reason, run_id=run_id,
                                                 fire_id=fire_id, attempt=attempt, state=state,
                                                 exit_code=exit_code, shard=shard, **extra)))

    def lease(self, event: str, *, lease_id: Optional[int] = None, ttl_s: Optional[float] = None,
              reason: Optional[str] = None, **extra: Any) -> bool:
        _check("lease", event, LEASE_EVENTS)
        return self.append("lease", **_clean(dict(event=event, lease_id=lease_id, ttl_s=ttl_s, reason=reason, **extra)))

    def shard(self, event: str, shard: int, *, owner: Optional[str] = None, fencing_rev: Optional[int] = None,
              reason: Optional[str] = None, **extra: Any) -> bool:
        _check("shard", event, SHARD_EVENTS)
        return self.append("shard", **_clean(dict(event=event, shard=shard, owner=owner,
                                                   fencing_rev=fencing_rev, reason=reason, **extra)))

    def policy_violation(self, *, job: Optional[str], pid: int, path: str, rule: str, action: str,
                         run_id: Optional[str] = None, **extra: Any) -> bool:
        """An exec (or other act) outside a template's policy; ``action`` is killed/recorded."""
        return self.append("policy_violation", **_clean(dict(job=job, run_id=run_id, pid=pid, path=path,
                                                              rule=rule, action=action, **extra)))

    def config(self, *, source: str, sha256: str, summary: Optional[dict] = None, **extra: Any) -> bool:
        """The configuration in force at start: its file, hash and a short summary."""
        return self.append("config", **_clean(dict(source=source, sha256=sha256, summary=summary, **extra)))

    def agent_start(self, *, version: str, agent_id: str, pid: int, cluster: Optional[str] = None,
                    **extra: Any) -> bool:
        return self.append("agent_start", **_clean(dict(version=version, agent_id=agent_id, pid=pid,
                                                         cluster=cluster, **extra)))

    def agent_stop(self, *, reason: str, **extra: Any) -> bool:
        return self.append("agent_stop", **_clean(dict(reason=reason, **extra)))

    def gap(self, *, source: str, count: int, reason: str, **extra: Any) -> bool:
        """Lost events from elsewhere (e.g. ``source="bpf", reason="perf_lost"``)."""
        return self.append("gap", **_clean(dict(source=source, count=count, reason=reason, **extra)))


SECRET_FIELDS = ("password", "secret", "private_key", "key")


def redacted(value: Any) -> Any:
    """A plain-data copy of a config object with every secret replaced by "<redacted>"."""
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): ("<redacted>" if k in SECRET_FIELDS and v is not None else redacted(v))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redacted(v) for v in value]
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)


def config_digest(cfg: Any) -> str:
    """SHA-256 of the effective config with secrets redacted: a changed setting changes the
    digest, but the record never carries (or lets anyone brute-force) a password."""
    import json

    body = json.dumps(redacted(cfg), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(body.encode()).hexdigest()


def describe_config(cfg: Config) -> dict:
    """Fields for the ``config`` record at start: the file, its SHA-256 and what matters most.

    ``audit.config(**describe_config(cfg))``. Secrets never enter the record: only the hash
    of the whole file, and a summary without passwords or key material.
    """
    summary = {
        "cluster": cfg.cluster,
        "agent_id": cfg.agent_id,
        "shards": cfg.shards,
        "templates": sorted(cfg.templates),
        "bpf_mode": cfg.bpf.mode,
    }
    return {"source": cfg.source, "sha256": config_digest(cfg), "summary": summary}


class NullAudit(RecordHelpers):
    """An audit sink that records nothing (audit disabled)."""

    def append(self, type: str, **fields: Any) -> bool:
        return True

    def close(self, timeout: float = 0) -> bool:
        return True


class MemoryAudit(RecordHelpers):
    """An in-memory audit sink for other modules' unit tests: ``records`` is a list of dicts."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self._lock = threading.Lock()

    def append(self, type: str, **fields: Any) -> bool:
        with self._lock:
            self.records.append({"type": type, **fields})
        return True

    def of_type(self, type: str) -> list[dict]:
        with self._lock:
            return [r for r in self.records if r["type"] == type]

    def close(self, timeout: float = 0) -> bool:
        return True
