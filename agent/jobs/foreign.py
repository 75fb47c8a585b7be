"""Run records this agent did not write and does not believe (agent/jobs/recovery.py and
the claim's read-back say which): each reported as a status, a metric and an audit record,
with what the record said."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from agent.jobs.metrics import FOREIGN_RECORDS
from agent.jobs.states import RecordState

if TYPE_CHECKING:
    from agent.jobs.firing import Firing
    from agent.jobs.seams import AuditSink
    from agent.jobs.statuses import Statuses

log = logging.getLogger(__name__)

AT_CLAIM = "a record this agent never claimed holds the firing's key"


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
