"""The firing pipeline: a job's due times become firings, each admitted, claimed, run and
finished with one final record.

Exactly-once rests on one rule: a job process is released only after its run record
runs/<shard>/<job>/<fire_id> was created in the state `running` by a transaction fenced
with the shard's token (claims.py). So:
- a firing has at most one record, written by the one agent that held the shard;
- a record in `running` whose owner is gone means "may have run": it is resolved by the
  job's retry policy (another attempt) or failed with reason owner_lost, never silently
  run again as the same attempt;
- a firing without a record never ran, and the new owner runs it (misfire policy).
The fire_id is the due time (deterministic on every agent), so recovery after a takeover
recomputes exactly the same firings.

Precision: a firing is claimed shortly before its due time (claimlead.py) and its process
prepared then; at the due time the launcher releases itself (launching.py), so neither the
etcd claim, the spawn nor any thread of the agent is on the critical path. A firing whose
fate depends on what happens until its due time (depends_on, or an earlier run of the job
still running: overlap) is not claimed early. If the agent dies in between, the launcher
exits with the agent and the record is resolved like any run of a dead owner.

Everything here runs on the daemon's loop thread; etcd calls go through worker threads and
come back as callbacks, so timers stay precise.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from agent.execute.runs import RunResult
from agent.jobs import outcomes, recovery
from agent.jobs import schedule as sch
from agent.jobs.admitting import Admitter
from agent.jobs.catchup import CatchUps
from agent.jobs.claimlead import ClaimLead
from agent.jobs.claims import Claim, ClaimKind, ClaimWriter, decided_here
from agent.jobs.crowding import Crowding
from agent.jobs.dependencies import DependencyCheck
from agent.jobs.firing import ACTIVE, NOT_STARTED, Firing, FiringEnd, FiringState
from agent.jobs.foreign import AT_CLAIM, ForeignRecords
from agent.jobs.launching import SPAWN_AHEAD_MIN_S, Launcher, Planned
from agent.jobs.metrics import ABANDONED, FIRINGS, JOB_DURATION, RUNS, TRIGGER_DELAY
from agent.jobs.progress import ProgressReports
from agent.jobs.records import FENCE_WAIT_S, RunRecords
from agent.jobs.startpolicy import StartGate
from agent.jobs.states import EndReason, JobState, RecordState
from agent.jobs.statuses import Statuses
from agent.runtime.timefmt import format_optional as rfc
from agent.runtime.timefmt import utcnow

if TYPE_CHECKING:
    from agent.config import Config
    from agent.coordination.keys import Keys
    from agent.coordination.worker import EtcdWorkers
    from agent.execute.admission import Admission
    from agent.execute.runs import RunHandle
    from agent.jobs.catalog import JobCatalog, JobEntry, Records
    from agent.jobs.firing import RunListener
    from agent.jobs.seams import AuditSink, Fencing, Lease, RunStarter, StatusSink
    from agent.jobs.startpolicy import StartPolicy, WaitMarks
    from agent.runtime.loop import EventLoop

log = logging.getLogger(__name__)

S, F = FiringState, FiringEnd
QUEUED = frozenset({S.HELD, S.WAITING, S.RETRYING_ADMISSION})   # due, not started, not yet claimable


class Scheduler:
    """The catalog's CatalogListener and supervision's RunGate; tells its RunListeners of each run's start and end."""

    def __init__(self, cfg: Config, catalog: JobCatalog, *, fencing: Fencing, lease: Lease, loop: EventLoop,
                 client: Any, keys: Keys, workers: EtcdWorkers, executor: RunStarter, admission: Admission,
                 sink: StatusSink, audit: AuditSink, run_listeners: Sequence[RunListener] = (),
                 start_policies: Sequence[StartPolicy] = (), answer_markers: bool = False,
                 marks: Optional[WaitMarks] = None):
        self.cfg = cfg
        self.catalog = catalog
        self.fencing = fencing
        self.loop = loop
        self.audit = audit
        self.statuses = Statuses(sink, keys, cfg.agent_id, cfg.shards, answer_markers)
        self.records = RunRecords(client, keys, fencing, loop, workers, cfg.agent_id, cfg.shards, self._settled)
        self.claim_lead = ClaimLead(cfg.execute.claim_lead_s)
        self.launcher = Launcher(executor, lease, cfg.templates, cfg.execute, self.claim_lead, run_listeners)
        self.claims = ClaimWriter(client, fencing, self.records, loop, workers, cfg.agent_id, catalog.current,
                                  executor)
        self.admitter = Admitter(admission, self.launcher, self.statuses, catalog.current, self._claim,
                                 lambda f: self._finish_without_run(f, RecordState.FAILED, "quota_never_fits"))
        self.starts = StartGate(start_policies, self.statuses, loop, marks)
        self.records.final_ops = self.starts.final_ops
        self.crowding = Crowding(self._unqueue, lambda f, why: self._finish_without_run(f, RecordState.MISFIRED, why))
        self.progress = ProgressReports(self.statuses, self.records, loop)
        self.foreign = ForeignRecords(self.statuses, audit)
        self.catch_ups = CatchUps(loop, self._fire, lambda e: catalog.current(e) and not e.cancelled)
        self.dependencies = DependencyCheck(client, keys, cfg.shards, loop, workers, self.statuses, catalog.current,
                                            catalog.keyring, cfg.cluster, audit)

    # --- the daemon's hooks -------------------------------------------------------------
    def busy(self, shard: int) -> bool:
        """A shard is busy while a run of it may be alive or its record is being written:
        it is not handed over before both are done (no shard leaves with a live run)."""
        return self.records.busy(shard) or self.catalog.active_in(shard)

    def _settled(self, shard: int) -> None:
        # busy() lists the shard's jobs: asked only while a shard waits for its runs to move
        if self.fencing.waiting_on_runs() and not self.busy(shard):
            self.fencing.release_idle()

    def drain_started(self, done: Callable[[], None]) -> None:
        """Graceful stop: claim nothing new. Firings that fall due now stay unclaimed (the
        next owner runs them by the misfire policy); retries stay `retrying` in etcd."""
        self.admitter.draining = True
        done()

    def stop_runs(self, reason: str = EndReason.AGENT_STOPPED) -> int:
        """End every live run (SIGTERM, SIGKILL after kill_grace_s); each gets its final
        record, status and run_end audit record while the shard is still ours."""
        running = self.catalog.running()
        for f in running:
            f.handle.terminate(reason)
        return len(running)

    def stop(self) -> None:
        self.catch_ups.stop()
        self.catalog.stop()
        self.dependencies.stop()
        self.stop_runs()

    # --- the catalog's --------------------------------------------------------------------
    def job_installed(self, e: JobEntry, records: Records) -> None:
        """Resolve what earlier owners left (live records), then the firings due while no one
        owned the shard (misfire policy), and arm the next."""
        now = utcnow()
        r = recovery.recover(e, records, self.cfg.agent_id, now)
        for f, at in r.retrying:
            f.move(S.RETRYING)
            f.timer = self.loop.call_later((at - now).total_seconds(), self._retry_due, f)
        for f in r.orphans:
            self._orphan(f, now)
        if r.foreign:
            self.foreign.at_load(e, r.foreign)
        if r.early:
            self.foreign.early_at_load(e, r.early)
        if r.error is not None:
            log.error("cannot compute the schedule; ignoring job", extra={"fields": {"job": e.job.id, "error": r.error}})
            return
        if r.skipped:
            FIRINGS.labels("misfired").inc(r.skipped)
            self.statuses.send(e, None, RecordState.MISFIRED, reason=f"misfire policy {e.job.misfire}: {r.skipped}"
                               f"{'+' if r.skipped_capped else ''} firing(s) skipped")
        for f in r.misfired:
            self._finish_without_run(f, RecordState.MISFIRED, f"misfire_{e.job.misfire}")
        if r.catch_up:
            self.catch_ups.start(e, r.catch_up)
        if r.next_due is not None:
            self._arm(e, r.next_due)
        if r.announce:
            self.statuses.send(e, None, JobState.SCHEDULED, due=rfc(r.next_due))
        self.starts.installed(e, records)

    def job_cancelled(self, e: JobEntry, reason: str = EndReason.CANCELLED) -> None:
        """Its runs are stopped and every firing not started ends `cancelled`; ``reason``:
        cancelled (a cancel), deleted or tombstoned (its key changed outside retention).
        A cancel's one job-level `cancelled` status is ingest's answer to it (reason
        cancelled_by_cloud); the others are announced here."""
        if e.cancelled:
            return
        e.cancelled = True
        if e.next_timer:
            e.next_timer.cancel()
        e.next_due = None
        for f in list(e.firings.values()):
            if f.state == S.RUNNING and f.handle is not None:
                f.handle.terminate(EndReason.CANCELLED)
            elif f.state in NOT_STARTED:
                self._unqueue(f)
                self._finish_without_run(f, RecordState.CANCELLED, EndReason.CANCELLED)
        if reason != EndReason.CANCELLED:
            self.statuses.send(e, None, RecordState.CANCELLED, reason=reason)
        self.audit.record("job", event=reason, job=e.job.id, shard=e.shard)

    def _unqueue(self, f: Firing, release: bool = True) -> None:
        """A firing that has not started leaves its timer and the queues it waits in; with
        ``release``, an admitted one (its claim waiting for the fence) gives its slot back."""
        if f.timer:
            f.timer.cancel()
        self.dependencies.forget(f)
        self.starts.forget(f)
        if not self.admitter.withdraw(f) and release:
            self.admitter.release(f)

    def job_dropped(self, e: JobEntry, reason: str) -> None:
        """The job's entry went (shard lost, deleted, key retired, finished): its timers stop,
        and a live run is stopped, so the new owner's policy never overlaps with it."""
        if e.next_timer:
            e.next_timer.cancel()
        for f in list(e.firings.values()):
            self.launcher.unstage(f)
            if f.state == S.RUNNING and f.handle is not None:
                f.handle.terminate(reason)
            else:
                self._unqueue(f, release=False)

    # --- due times ---------------------------------------------------------------------
    def _arm(self, e: JobEntry, due: datetime) -> None:
        if e.next_timer:
            e.next_timer.cancel()
        e.next_due = due
        delay = (due - utcnow()).total_seconds()
        lead = self.claim_lead.lead()
        e.next_timer = self.loop.call_later(max(0.0, delay - lead), self._due, e, due, min(lead, max(0.0, delay)))

    def _due(self, e: JobEntry, due: datetime, lead: float = 0.0) -> None:
        e.next_timer = None
        if not self.catalog.current(e) or e.cancelled:
            return
        # wall-clock check: a timer is monotonic; if the clock stepped, re-arm on the new clock
        early = (due - utcnow()).total_seconds() - lead
        if early > 0.05:
            log.warning("clock stepped back; re-arming", extra={"fields": {"job": e.job.id, "early_s": round(early, 3)}})
            self._arm(e, due)
            return
        if early < -2.0:
            log.warning("timer fired late (clock step or overload)",
                        extra={"fields": {"job": e.job.id, "late_s": round(-early, 3)}})
        nxt = sch.next_firing(e.job, due, e.accepted_at)
        if nxt is not None:
            self._arm(e, nxt)
        else:
            e.next_due = None
        self._fire(e, due, lead)

    def _fire(self, e: JobEntry, due: datetime, lead: float = 0.0) -> None:
        fid = e.fire_id(due, self.cfg.agent_id)
        if fid in e.firings:
            return
        if e.last_due_done is None or due > e.last_due_done:
            e.last_due_done = due
        job, now = e.job, utcnow()
        running = [g for g in e.firings.values() if g.state in ACTIVE]
        ahead = (due - now).total_seconds()
        if ahead > SPAWN_AHEAD_MIN_S and (job.depends_on or running):
            # dependencies and overlap are decided at the due time, not at claim time
            self.loop.call_later(ahead, self._fire_if_current, e, due)
            return
        f = Firing(e, due, fid, lead=lead)
        e.firings[fid] = f
        if sch.is_expired(job, now):
            self._finish_without_run(f, RecordState.MISFIRED, "expired")
            return
        queued = [g for g in e.firings.values() if g.state in QUEUED and g is not f]
        if queued and not self.crowding.admit(e, f, queued):   # at most one firing of a job waits
            return
        if running and job.schedule.kind == "cron":
            action = sch.overlap_action(job.overlap, True)
            if action == "skip":
                FIRINGS.labels("overlap_skipped").inc()
                self._finish_without_run(f, RecordState.MISFIRED, "overlap")
                return
            if action == "replace":
                for g in running:
                    if g.handle is not None:
                        g.handle.terminate(EndReason.REPLACED)
        if job.depends_on:
            self.dependencies.check(f, self._may_start, lambda g: self._finish_without_run(g, RecordState.MISFIRED,
                                                                                          "expired"))
        else:
            self._may_start(f)

    def _may_start(self, f: Firing, retry: bool = False) -> None:
        """The start policies (windows, gates, ...) first, then admission and the claim."""
        self.starts.request(f, lambda g: self.admitter.request(g, retry=retry),
                            lambda g, state, reason, detail: self._finish_without_run(g, state, reason))

    def adopt(self, f: Firing) -> None:
        """A firing a start policy made for the job (a rollback): through the pipeline like any."""
        if f.fire_id not in f.entry.firings and self.catalog.current(f.entry):
            f.entry.firings[f.fire_id] = f
            self._may_start(f)

    def _fire_if_current(self, e: JobEntry, due: datetime) -> None:
        if self.catalog.current(e) and not e.cancelled:
            self._fire(e, due)

    # --- supervision's RunGate ---------------------------------------------------------
    def pause(self, reason: str) -> None:
        """Early fence: stop starting runs (shards are kept; firings wait, not misfire)."""
        self.admitter.pause(reason)

    def resume(self) -> None:
        self.admitter.resume()

    def health_changed(self, f: Firing, state: str, rule: Optional[str]) -> None:
        f.health = state
        self.statuses.send(f.entry, f, RecordState.RUNNING, reason=f"health {state}: {rule}" if rule else None,
                           pid=f.handle.pid if f.handle is not None else None)

    # --- claims -------------------------------------------------------------------------
    def _claim(self, f: Firing, retry: bool = False, takeover: bool = False) -> None:
        """Claim the firing's run record (claims.py), then start its process."""
        e = f.entry
        if not self.catalog.current(e):
            # its entry went (shard lost, job dropped): a fence held now is not the one it
            # was installed under, and the entry installed since decides for the firing
            self._abandon(f, F.DROPPED)
            return
        fence = self.fencing.fence_for(e.shard)
        if fence is None:
            if self._session_lapsed(f):
                self.loop.call_later(FENCE_WAIT_S, self._when_current, f, f.state, self._claim, f, retry)
                return
            self._abandon(f, F.NOT_OWNER)
            return
        if f.state != S.CLAIMING and not self.starts.still(f):   # a window closed or a gate shut meanwhile
            self.admitter.release(f)
            self._may_start(f, retry)
            return
        if retry:
            f.attempt += 1
        f.mark_ready()
        f.move(S.CLAIMING)
        f.run = self.launcher.plan(f)
        self.claims.claim(f, fence, retry, f.run.spec if isinstance(f.run, Planned) else None, self._claimed,
                          takeover=takeover)

    def _claimed(self, f: Firing, c: Claim) -> None:
        if c.kind is ClaimKind.CLAIMED:
            f.staged = c.staged
            self._spawn(f)
        elif c.kind is ClaimKind.AGAIN:
            if c.delay:
                self.loop.call_later(c.delay, self._when_current, f, S.CLAIMING, self._claim, f, c.retry)
            else:
                self._claim(f, c.retry)
        elif c.kind is ClaimKind.DISCARD:
            self._discard(f)
        elif c.kind is ClaimKind.FOREIGN:
            self._claimed_foreign(f, c)
        else:
            if c.why is F.ALREADY_CLAIMED:
                FIRINGS.labels("already_claimed").inc()
            self._abandon(f, c.why or F.DROPPED)

    def _claimed_foreign(self, f: Firing, c: Claim) -> None:
        """A record this agent never claimed holds the firing's key. Written after this agent
        took the shard, it is no agent's claim (they are fenced out); or the load found it
        ahead of its firing and did not believe it: reported, and the firing claims over it,
        once. Any other is reported and the firing ends there."""
        f.claim.record, f.claim.rev = c.record if isinstance(c.record, dict) else None, c.rev
        fence = self.fencing.fence_for(f.entry.shard)
        if decided_here(f.claim.record, self.cfg.agent_id, fence):
            return self._abandon(f, F.ALREADY_CLAIMED)
        judged = f.entry.foreign_ahead.pop(f.fire_id, None) == c.rev
        over = fence is not None and (c.rev > fence.token or judged) and not f.claim.taken_over
        self.foreign.report(f, "claim", AT_CLAIM, RecordState.RUNNING if over else RecordState.FAILED)
        if over:
            f.claim.record, f.claim.taken_over = None, True
            self._claim(f, takeover=True)
        else:
            FIRINGS.labels("already_claimed").inc()
            self._abandon(f, F.ALREADY_CLAIMED)

    # --- runs ----------------------------------------------------------------------------
    def _spawn(self, f: Firing) -> None:
        e = f.entry
        if self.fencing.fence_for(e.shard) is None:  # fenced while claiming: do not start
            if self._session_lapsed(f):
                self.loop.call_later(FENCE_WAIT_S, self._when_current, f, S.CLAIMING, self._spawn, f)
                return
            self.launcher.unstage(f)
            self._abandon(f, F.FENCED)
            return
        if e.cancelled or not self.catalog.current(e):
            # cancelled, or its job dropped while its claim was in flight: it must not start
            # here. A job installed again meanwhile came with its shard held again under a
            # new fence: that shard's load read this claim's record and the new entry
            # resolves it (owner_lost), so running it here too could run the firing twice.
            self._discard(f)
            return
        planned, f.run = f.run, None
        if planned is None or (isinstance(planned, Planned) and planned.spec.attempt != f.attempt):
            planned = self.launcher.plan(f)   # claimed by another path (a read-back): built now
        if isinstance(planned, str):
            self.launcher.unstage(f)
            f.move(S.RUNNING)
            self._ended(f, RunResult.spawn_error(f"{f.key}.{f.attempt}", planned))
            return
        run = planned
        f.move(S.RUNNING)
        on_exit = lambda h, r: self.loop.post(self._ended, f, r)  # noqa: E731
        on_release = lambda h, ok: self.loop.post(self._released, f, h, ok, run.argv, run.user)  # noqa: E731
        on_progress = lambda h, lines: self.loop.post(self.progress.seen, f, h, lines)  # noqa: E731
        if not self.launcher.launch(f, run, on_exit, on_release, on_progress):
            self._released(f, f.handle, True, run.argv, run.user)

    def _released(self, f: Firing, handle: Optional[RunHandle], ok: bool, argv: list, user: Optional[str]) -> None:
        """The job process was let go (exec'ing now): metrics, audit and the running status.
        Not ok: it could not start; its on_exit (spawn_error) follows."""
        if not ok or handle is None or f.handle is not handle:
            return
        e = f.entry
        f.started_mono = time.monotonic()
        _count_start(self.loop, f, handle.started_at or time.time())
        self.audit.record("job", event="run_start", job=e.job.id, fire_id=f.fire_id, attempt=f.attempt,
                          shard=e.shard, pid=handle.pid, argv=argv, user=user)
        if f.state == S.RUNNING:
            self.statuses.send(e, f, RecordState.RUNNING, pid=handle.pid)

    def _ended(self, f: Firing, result: RunResult) -> None:
        e = f.entry
        self.admitter.release(f)
        reason = result.reason
        f.end_reason = str(reason)   # the job quarantine judges the run by it (agent/jobs/quarantine.py)
        self.launcher.ended(f)
        if reason == EndReason.FENCED and self.fencing.owns(e.shard) is not None:
            self._resolve_lease_kill(f)
            return
        if reason in outcomes.HANDED_OVER:
            f.finish(F.HANDED_OVER)   # we may not write for this shard any more: the new owner resolves it
            self._forget(f)
            RUNS.labels("abandoned").inc()
            return
        JOB_DURATION.observe(time.monotonic() - f.started_mono if f.started_mono else 0.0)
        now = utcnow()
        fields = outcomes.end_fields(result, reason, f.health, now)
        out = outcomes.after_run(e.job, reason, f.fire_id, f.attempt, now, e.cancelled or f.rollback)
        RUNS.labels(reason if out.state != RecordState.SUCCEEDED else "succeeded").inc()
        self.audit.record("job", event="run_end", job=e.job.id, fire_id=f.fire_id, attempt=f.attempt,
                          state=out.state, **{k: v for k, v in fields.items() if k != "usage"})
        if out.retry_at is not None:
            self._retry_later(f, out.retry_at, now, fields)
        else:
            self._finish(f, out.state, fields)
        self._settled(e.shard)

    def _retry_later(self, f: Firing, at: datetime, now: datetime, fields: dict,
                     status: Optional[dict] = None) -> None:
        """Record `retrying` with ``fields`` (the status carries ``status``, by default the
        same) and time the next attempt (after a drain, the next owner does)."""
        f.move(S.RETRYING)
        self.records.write(f, RecordState.RETRYING, retry_at=rfc(at), **fields)
        self.statuses.send(f.entry, f, RecordState.RETRYING, retry_at=rfc(at), **(fields if status is None else status))
        if not self.admitter.draining:
            f.timer = self.loop.call_later(max(0.0, (at - now).total_seconds()), self._retry_due, f)

    def _finish(self, f: Firing, state: str, fields: dict, status: Optional[dict] = None) -> None:
        """The firing's final record with ``fields`` and its answer marker, and its final
        status (carrying ``status``, by default the same fields)."""
        f.finish(F.RECORDED)
        doc, key = self.statuses.final(f, state, **(fields if status is None else status))
        self.records.write(f, state, answer=(key, doc), **fields)
        self.statuses.publish(doc, key)
        self._forget(f)

    def _retry_due(self, f: Firing) -> None:
        f.timer = None
        e = f.entry
        if not self.catalog.current(e) or e.cancelled or f.state != S.RETRYING or self.admitter.draining:
            return
        if f.claim.writing:   # the `retrying` record is still on its way: its revision is the claim's compare
            f.timer = self.loop.call_later(0.05, self._retry_due, f)
            return
        self._may_start(f, retry=True)

    def _orphan(self, f: Firing, now: datetime) -> None:
        """A run left `running` by an owner that is gone may have run: it runs again only if
        the job opted in (retry.on lists owner_lost) and attempts remain, else it ends
        `failed`/owner_lost. A retry never overlaps the old run: this agent holds the shard,
        so the old lease is gone, and its runs died first (with the agent: the run guard; at
        its self-fence: kill_grace_s fits before the lease expires; on its graceful stop)."""
        job = f.entry.job
        prev_agent = (f.claim.record or {}).get("agent")
        nxt = None if f.rollback else outcomes.after_owner_lost(job, f.fire_id, f.attempt, now)
        self.audit.record("job", event="owner_lost", job=job.id, fire_id=f.fire_id, attempt=f.attempt,
                          previous_agent=prev_agent, retry_at=rfc(nxt))
        RUNS.labels(EndReason.OWNER_LOST).inc()
        fields = {"reason": EndReason.OWNER_LOST, "ended_at": rfc(now)}
        if nxt is not None:
            self._retry_later(f, nxt, now, fields, {"reason": EndReason.OWNER_LOST, "previous_agent": prev_agent})
        else:
            self._finish(f, RecordState.FAILED, fields, dict(fields, previous_agent=prev_agent))

    def _resolve_lease_kill(self, f: Firing) -> None:
        """The executor killed a run whose lease looked lapsed, but the keepalive came back
        before the self-fence and the shard is still ours: we resolve it as a new owner
        would (owner_lost), or its record stays `running` while the shard stays here."""
        e = f.entry
        if not self.catalog.current(e) or f.state != S.RUNNING:
            if f.state != S.DONE:
                f.finish(F.HANDED_OVER)
            return
        if self.fencing.fence_for(e.shard) is not None:
            self._orphan(f, utcnow())
        elif self._session_lapsed(f):
            self.loop.call_later(FENCE_WAIT_S, self._resolve_lease_kill, f)
        else:  # the shard left after all: its next owner resolves the record
            f.finish(F.HANDED_OVER)
            self._forget(f)
            RUNS.labels("abandoned").inc()

    # --- firings that end without a run ------------------------------------------------
    def _finish_without_run(self, f: Firing, state: str, reason: str) -> None:
        """Record a firing that will not run (misfired, cancelled, failed before start)."""
        if self.records.waits(f.entry.shard):
            # the record must be written, not skipped, while we keep the shard (a cancelled
            # job's too: its record says cancelled)
            f.move(S.FINISHING)
            self.loop.call_later(FENCE_WAIT_S, self._when_current, f, S.FINISHING, self._finish_without_run,
                                 f, state, reason)
            return
        FIRINGS.labels(reason).inc()
        doc, answer_key = self.statuses.final(f, state, reason=reason)
        written = self.records.write_not_run(f, state, reason, (doc, answer_key))
        f.finish(F.RECORDED if written else F.HANDED_OVER)
        self.statuses.publish(doc, answer_key if written else None)
        self._forget(f)

    def _forget(self, f: Firing) -> None:
        e = f.entry
        self.starts.done(f)
        if e.firings.get(f.fire_id) is f:
            del e.firings[f.fire_id]
        if e.backlog and self.catalog.current(e) and not e.cancelled \
                and not any(g.state in ACTIVE for g in e.firings.values()):
            self.loop.call_later(0, self._fire, e, e.backlog.pop(0))
        # a one-shot job with nothing left to do stays known (cancel may still come)

    def _abandon(self, f: Firing, why: FiringEnd) -> None:
        f.finish(why)
        self.admitter.release(f)
        self._forget(f)
        ABANDONED.labels(why.value).inc()
        log.debug("firing abandoned", extra={"fields": {"job": f.entry.job.id, "fire_id": f.fire_id, "why": why.value}})

    def _discard(self, f: Firing) -> None:
        """A firing whose job was cancelled or dropped between admission and spawn gives back
        its staged run and its slot; a cancelled one's record says cancelled."""
        self.launcher.unstage(f)
        if self.catalog.current(f.entry):
            self.admitter.release(f)
            self._finish_without_run(f, RecordState.CANCELLED, EndReason.CANCELLED)
        else:
            self._abandon(f, F.DROPPED)

    def _session_lapsed(self, f: Firing) -> bool:
        """No fence only because the session is past its renew deadline while the shard is
        still held: the firing waits (dropped, it would be lost until the shard moves)."""
        e = f.entry
        return (self.catalog.current(e) and not e.cancelled and f.state != S.DONE
                and self.fencing.owns(e.shard) is not None)

    def _when_current(self, f: Firing, state: FiringState, fn: Callable[..., None], *args: Any) -> None:
        """Call fn(*args) later only if the firing is still where it was (same entry, same state)."""
        here = self.catalog.current(f.entry)
        if f.state == state and here and (not f.entry.cancelled or state == S.FINISHING):
            fn(*args)   # (a record being finished is written as it was, even for a job cancelled since)
        elif f.state == state and f.state != S.DONE:
            self._discard(f)   # its job went meanwhile: it ends here, not never
        else:
            self.launcher.unstage(f)   # it will not be spawned: its staged run goes

    # --- status --------------------------------------------------------------------------
    def status(self) -> dict:
        """What the jobs held here are doing; ``lag_s``: how late the agent starts what falls due."""
        return {**self.catalog.status(), "admission": self.admitter.status(),
                "catch_ups": len(self.catch_ups), "lag_s": round(self.loop.lag(), 3)}


def _count_start(loop: EventLoop, f: Firing, started: float) -> None:
    """A run let go: its trigger delay, and how late the agent's own queues (claims, spawns)
    started it, which the loop counts in its lag."""
    if f.attempt == 1:
        TRIGGER_DELAY.observe(max(0.0, started - f.due.timestamp()))
        if f.ready_mono:
            loop.note_late(f.started_mono - f.ready_mono)
    FIRINGS.labels("started").inc()
