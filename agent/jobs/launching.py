"""Starting a claimed firing's process: its run made from the template (argv rendered with
the firing's ids), then handed to the executor, which releases it at the due time by
itself when the claim came ahead (prepared), or starts it now.

A run is released, and killed, only while the lease its claim was made under is valid:
the executor's own threads check that (the guard), so a busy loop cannot start a run
whose shard may have moved."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Union

from agent.execute.limits import Limits, effective_limits
from agent.execute.runs import RunSpec
from agent.jobs.envelope import JobRejected
from agent.jobs.metrics import FIRINGS
from agent.jobs.render import render_argv, run_id
from agent.runtime.timefmt import utcnow

if TYPE_CHECKING:
    from agent.config import ExecuteConfig, Template
    from agent.jobs.catalog import JobEntry
    from agent.jobs.claimlead import ClaimLead
    from agent.jobs.firing import Firing, RunListener
    from agent.jobs.seams import Lease, OnExit, OnProgress, OnRelease, RunStarter

SPAWN_AHEAD_MIN_S = 0.001  # closer to the due time than this, start at once


@dataclass(frozen=True)
class Planned:
    """A firing's current attempt as the executor will run it."""

    spec: RunSpec
    argv: list
    user: Optional[str]


class Launcher:
    def __init__(self, executor: RunStarter, lease: Lease, templates: dict[str, Template],
                 execute: ExecuteConfig, claim_lead: ClaimLead, run_listeners: Sequence[RunListener]):
        self.executor = executor
        self.lease = lease
        self.templates = templates
        self.execute = execute
        self.claim_lead = claim_lead
        self.run_listeners = run_listeners

    def limits(self, e: JobEntry) -> Limits:
        """The job's resources within its template's ceilings."""
        tpl = self.templates.get(e.job.template)
        return effective_limits(e.job.resources, tpl.resources if tpl else None, self.executor.default_limits)

    def plan(self, f: Firing) -> Union[Planned, str]:
        """The run of the firing's current attempt, or why it cannot start (its run then
        fails early, after the claim)."""
        e = f.entry
        tpl = self.templates.get(e.job.template)
        if tpl is not None and f.rollback:   # an aborted rollout's rollback: the template it names
            tpl = self.templates.get(tpl.rollback or "")
        if tpl is None:
            return "unknown_template"
        rid = run_id(f.fire_id, f.attempt)
        try:
            argv = render_argv(e.job, tpl, {"fire_id": f.fire_id, "attempt": f.attempt, "run_id": rid})
        except JobRejected as exc:
            return f"bad_param: {exc.detail}"
        spec = RunSpec(run_key=f"{f.key}.{f.attempt}", argv=argv, user=tpl.user, limits=f.limits or self.limits(e),
                       timeout_s=e.job.timeout_s, kill_grace_s=self.execute.kill_grace_s,
                       output_max_bytes=self.execute.output_max_bytes, job_id=e.job.id,
                       run_id=rid, fire_id=f.fire_id, attempt=f.attempt,
                       allow_root=tpl.allow_root, network=tpl.network, capabilities=tuple(tpl.capabilities),
                       step_timeout_s=e.job.step_timeout_s)
        return Planned(spec, argv, tpl.user)

    def unstage(self, f: Firing) -> None:
        """The staged directories and quota container of a run that will not start go."""
        staged, f.staged = f.staged, None
        if staged is not None:
            self.executor.unstage(staged)

    def launch(self, f: Firing, run: Planned, on_exit: OnExit, on_release: OnRelease,
               on_progress: Optional[OnProgress] = None) -> bool:
        """Hand the firing's run to the executor (the firing is RUNNING). True: prepared,
        ``on_release`` follows at the due time; False: started now (released already)."""
        if f.staged is not None and f.staged.run_key != run.spec.run_key:
            self.unstage(f)
        staged, f.staged = f.staged, None
        session = self.lease
        lease = session.lease_id

        def lease_valid() -> bool:
            return session.is_valid() and session.lease_id == lease

        ahead = (f.due - utcnow()).total_seconds()
        if f.lead > 0 and f.attempt == 1:
            self.claim_lead.observe(f.lead - ahead)
        if ahead > SPAWN_AHEAD_MIN_S:
            # the lease's local validity only grows while it lives: until then lease_valid()
            # holds, so the launcher may release itself on a kernel timer (no thread of
            # ours on the due time's path)
            valid_until = session.valid_until if session.lease_id == lease else 0.0
            f.handle = self.executor.prepare(run.spec, on_exit, release_at=time.monotonic() + ahead,
                                             on_release=on_release, guard=lease_valid, guard_until=valid_until,
                                             staged=staged, on_progress=on_progress)
            self._started(f)   # exec policy and sensor attribution know the run before it can exec
            return True
        if f.lead > 0 and f.attempt == 1:
            FIRINGS.labels("claimed_late").inc()   # the claim took longer than its lead
        f.handle = self.executor.start(run.spec, on_exit, guard=lease_valid, staged=staged, on_progress=on_progress)
        self._started(f)
        return False

    def _started(self, f: Firing) -> None:
        for listener in self.run_listeners:
            listener.run_started(f)

    def ended(self, f: Firing) -> None:
        for listener in self.run_listeners:
            listener.run_ended(f)
