"""Run records this agent did not write and does not believe (agent/jobs/recovery.py and
the claim's read-back say which): each reported as a status, a metric and an audit record,
with what the record said."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from agent.jobs.metrics import FOREIGN_RECORDS
from agent.jobs.states import JobState, RecordState

if TYPE_CHECKING:
    from agent.jobs.catalog import JobEntry
    from agent.jobs.firing import Firing
    from agent.jobs.seams import AuditSink
    from agent.jobs.statuses import Statuses

log = logging.getLogger(__name__)

AT_CLAIM = "a record this agent never claimed holds the firing's key"
SHOWN = 5   # records named in one load report


class ForeignRecords:
    def __init__(self, statuses: Statuses, audit: AuditSink):
        self.statuses = statuses
        self.audit = audit

    def report(self, f: Firing, where: str, why: str, state: str) -> None:
        """``f.claim`` holds the record as read. ``where``: load, claim; ``state``: the
        status to send now (a `failed` one goes with the firing's final record instead)."""
        rec = f.claim.record or {}
        seen = {"agent": rec.get("agent"), "state": rec.get("state"), "attempt": rec.get("attempt"),
                "revision": f.claim.rev}
        FOREIGN_RECORDS.labels(where).inc()
        log.warning("run record not believed", extra={"fields": {"job": f.entry.job.id, "fire_id": f.fire_id,
                                                                  "where": where, "why": why}})
        self.audit.record("job", event="foreign_record", job=f.entry.job.id, fire_id=f.fire_id, where=where,
                          why=why, record=seen)
        if state != RecordState.FAILED:
            self.statuses.send(f.entry, f, state, reason="foreign_record", detail=why, record=seen)

    def at_load(self, e: JobEntry, found: list[tuple[str, str, dict, int]]) -> None:
        """The records of one job not believed at its load: one status (``rejected``, from
        the store), one audit record and the metric, however many there are (a forger's
        thousands cost the agent no more than one report)."""
        FOREIGN_RECORDS.labels("load").inc(len(found))
        shown = [{"fire_id": fid, "why": why, "agent": rec.get("agent"), "state": rec.get("state"),
                  "attempt": rec.get("attempt"), "revision": rev} for fid, why, rec, rev in found[:SHOWN]]
        more = f" (and {len(found) - SHOWN} more)" if len(found) > SHOWN else ""
        log.warning("run records not believed", extra={"fields": {"job": e.job.id, "count": len(found)}})
        self.audit.record("job", event="foreign_record", job=e.job.id, where="load", count=len(found), records=shown)
        self.statuses.send(e, None, JobState.REJECTED, reason="foreign_record", source="store", count=len(found),
                           records=shown, detail=f"{len(found)} run record(s) not believed: {shown[0]['why']}{more}")

    def early_at_load(self, e: JobEntry, found: list[tuple[str, float, dict, int]]) -> None:
        """Fenced records of firings ahead of this agent's clock, believed (an owner whose
        clock runs ahead ran them early; running them again could run them twice): each load
        that finds some says so once, in the log, the metric and the audit log."""
        FOREIGN_RECORDS.labels("early").inc(len(found))
        shown = [{"fire_id": fid, "ahead_s": round(ahead, 3), "agent": rec.get("agent"), "state": rec.get("state"),
                  "revision": rev} for fid, ahead, rec, rev in found[:SHOWN]]
        log.warning("run records ahead of this agent's clock believed", extra={"fields": {
            "job": e.job.id, "count": len(found), "most_ahead_s": round(max(a for _, a, _, _ in found), 3)}})
        self.audit.record("job", event="early_record", job=e.job.id, where="load", count=len(found), records=shown)
