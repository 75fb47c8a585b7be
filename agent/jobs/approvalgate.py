"""Four-eyes approval at the start of a firing: a job of a template with ``approvals`` waits
(status ``waiting_approval``) until its document carries the signatures the template asks
for (agent/jobs/approvals.py), and never runs before.

Approvals arrive as a push of the same document with more signatures; the job store merges
them into the stored document (agent/coordination/jobstore.py), the catalog re-verifies it
and replaces the installed job (``job_changed``), and the waiting firing is asked again.
The last approval can come while the document may still be pushed: ``mqtt.max_age_s``
after its ``issued_at``. A firing still short of approvals then ends ``misfired``, reason
``approval_expired``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Callable

from agent.jobs import approvals
from agent.jobs.metrics import APPROVAL_DECISIONS
from agent.jobs.startpolicy import GO, Verdict, end, wait
from agent.jobs.states import JobState, RecordState
from agent.runtime.recent import RecentMemory
from agent.runtime.timefmt import format_optional as rfc
from agent.runtime.timefmt import utcnow

if TYPE_CHECKING:
    from agent.config import Config
    from agent.jobs.catalog import JobEntry
    from agent.jobs.firing import Firing
    from agent.jobs.seams import AuditSink
    from agent.runtime.loop import EventLoop

REASON = "approvals"
TOLD_MEMORY = 10000   # (job, signers) decisions audited already


class ApprovalGate:
    """Implements StartPolicy (agent/jobs/startpolicy.py); the catalog calls ``job_changed``
    when an installed job's approvals changed."""

    name = "approval"

    def __init__(self, cfg: Config, loop: EventLoop, audit: AuditSink):
        self.templates = cfg.templates
        self.max_age_s = cfg.mqtt.max_age_s
        self.loop = loop
        self.audit = audit
        self.waiting: dict[str, dict[str, Callable[[], None]]] = {}   # job id -> firing key -> wake
        self._told: RecentMemory[tuple, None] = RecentMemory(TOLD_MEMORY)

    def judge(self, f: Firing) -> Verdict:
        job = f.entry.job
        rule = approvals.rule_of(self.templates, job.template)
        if rule is None or f.rollback:
            return GO
        st = approvals.standing(job.signers, rule)
        if st.ok:
            self._tell(f, "approved", st)
            return GO
        expires = job.issued_at + timedelta(seconds=self.max_age_s) if job.issued_at is not None else None
        if expires is None or utcnow() >= expires:
            self._tell(f, "expired", st)
            return end(RecordState.MISFIRED, "approval_expired",
                       f"{st.describe()} by {rfc(expires)} (issued_at + mqtt.max_age_s)")
        self._tell(f, "waiting", st)
        return wait(REASON, f"{st.describe()}; approvals may come until {rfc(expires)}",
                    state=JobState.WAITING_APPROVAL)

    def subscribe(self, f: Firing, wake: Callable[[], None]) -> Callable[[], None]:
        job = f.entry.job
        self.waiting.setdefault(job.id, {})[f.key] = wake
        timer = None
        if job.issued_at is not None:   # when the approvals can no longer come
            left = (job.issued_at + timedelta(seconds=self.max_age_s) - utcnow()).total_seconds()
            timer = self.loop.call_later(max(0.0, left), wake)

        def cancel() -> None:
            w = self.waiting.get(job.id)
            if w is not None:
                w.pop(f.key, None)
                if not w:
                    del self.waiting[job.id]
            if timer is not None:
                timer.cancel()
        return cancel

    def job_changed(self, e: JobEntry) -> None:
        """Its document gained approvals: the firings waiting for them are asked again."""
        for wake in list(self.waiting.get(e.job.id, {}).values()):
            wake()

    def _tell(self, f: Firing, decision: str, st: approvals.Standing) -> None:
        """Audit each decision once per job and set of signers (every approval and its key)."""
        seen = (f.entry.job.id, f.fire_id, decision, f.entry.job.signers)
        if seen in self._told:
            return
        self._told.remember(seen, None)
        APPROVAL_DECISIONS.labels(decision).inc()
        self.audit.record("job", event=f"approval_{decision}", job=f.entry.job.id, fire_id=f.fire_id,
                          signers=[{"kid": k, "role": r} for k, r in f.entry.job.signers], **st.to_dict())
