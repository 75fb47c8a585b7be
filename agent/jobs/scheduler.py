"""Turns owned shards into work: due firings, exactly-once run records, retries, policies.

Everything here runs on the daemon's loop thread; etcd calls go through the worker
threads and come back as callbacks, so timers stay precise.

Exactly-once rests on one rule: a job process is released only after its run record
runs/<shard>/<job>/<fire_id> was created (create-revision==0) in the state `running`
by a transaction fenced with the shard's token. So:
- a firing has at most one record, written by the one agent that held the shard;
- a record in `running` whose owner is gone means "may have run": it is resolved by the
  job's retry policy (another attempt) or failed with reason owner_lost, never silently
  run again as the same attempt;
- a firing without a record never ran, and the new owner runs it (misfire policy).
The fire_id is the due time (deterministic on every agent), so recovery after a
takeover recomputes exactly the same firings.

Precision: a firing is claimed shortly before its due time (agent/jobs/claimlead.py: three
times the recent claim latency, at most ``execute.claim_lead_s``), and its process is
prepared then (quota container, launcher waiting on its go pipe). At the due
time the executor's release thread writes one byte to that pipe, so neither the etcd
claim nor the spawn is on the critical path. A firing whose fate depends on what happens
until its due time (depends_on, or an earlier run of the job still running: overlap) is
not claimed early. If the agent dies in between, the launcher exits with the agent (its
go pipe closes) and the record is resolved like any run of a dead owner.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Optional

from agent.coordination.etcd import Create, EtcdError, EtcdUnavailable, Mod, Put
from agent.coordination.fencing import Fence, StaleToken, fenced_txn
from agent.coordination.jobstore import JobStore, StoredJob, public_doc
from agent.coordination.keys import shard_of
from agent.coordination.watch import PrefixWatch, WatchEvent
from agent.coordination.worker import EtcdWorkers
from agent.jobs.claimlead import ClaimLead
from agent.runtime.gcpolicy import GcPolicy
from agent.jobs.document import Job, JobRejected, effective_resources, render_argv
from agent.runtime.metrics import counter, gauge, histogram
from agent.jobs import schedule as sch

log = logging.getLogger("millwright.scheduler")

RUNS = counter("millwright_runs_total", "Finished runs by result", ("result",))
FIRINGS = counter("millwright_firings_total", "Firings by outcome", ("outcome",))
TRIGGER_DELAY = histogram("millwright_trigger_delay_seconds", "Process start minus due time",
                          buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5))
JOB_DURATION = histogram("millwright_job_duration_seconds", "Run duration",
                         buckets=(0.01, 0.1, 0.5, 1, 5, 15, 60, 300, 1800, 7200))
JOBS_OWNED = gauge("millwright_jobs_owned", "Jobs in shards this agent holds")

TERMINAL = ("succeeded", "failed", "timed_out", "killed", "cancelled", "misfired")
RETRYABLE = ("failed", "timed_out")
SPAWN_AHEAD_MIN_S = 0.001  # closer to the due time than this, start at once
RECORD_WORKERS = 6         # threads writing run records (claims, final states) to etcd
DEPENDENCY_RECHECK_S = 1.0


_FIRING_SEQ = itertools.count(1)


# How often a firing re-checks its fence while the session is past its renew deadline but
# the shard is still held (see Scheduler._session_lapsed).
FENCE_WAIT_S = 0.1


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def rfc(dt: Optional[datetime]) -> Optional[str]:
    return sch.format_rfc3339(dt) if dt is not None else None


@dataclass
class Firing:
    entry: "JobEntry"
    due: datetime
    fire_id: str
    attempt: int = 1
    state: str = "pending"   # pending, waiting, claiming, running, retrying, done
    record: Optional[dict] = None
    record_rev: int = 0      # mod revision of the run record we last wrote
    handle: Any = None
    timer: Any = None
    wait_reason: Optional[str] = None
    started_mono: float = 0.0
    health: str = "healthy"
    lead: float = 0.0        # how far ahead of `due` its claim was planned (0: at or after due)
    seq: int = field(default_factory=lambda: next(_FIRING_SEQ))

    @property
    def key(self) -> str:
        """Admission key: unique per Firing object, so a firing re-installed after a shard
        came back never collides with the old one still being stopped."""
        return f"{self.entry.job.id}/{self.fire_id}#{self.seq}"


@dataclass
class JobEntry:
    job: Job
    stored: StoredJob
    shard: int
    accepted_at: datetime
    last_due_done: Optional[datetime] = None
    next_timer: Any = None
    next_due: Optional[datetime] = None
    firings: dict[str, Firing] = field(default_factory=dict)
    cancelled: bool = False
    backlog: list = field(default_factory=list)  # missed firings to run one after another


class Scheduler:
    def __init__(self, agent: Any, executor: Any, admission: Any):
        self.agent = agent
        self.cfg = agent.cfg
        self.loop = agent.loop
        self.keys = agent.keys
        self.client = agent.client
        # its own pool: run records are most of the etcd writes, and a firing's claim must
        # not queue behind shard hand-overs (or they behind a burst of claims); several
        # threads let etcd batch concurrent writes into one fsync
        self.workers = EtcdWorkers(self.loop.post, threads=RECORD_WORKERS, name="runs")
        self.executor = executor
        self.admission = admission
        self.store = JobStore(agent.client, agent.keys, agent.cfg.shards, agent.cfg.agent_id)
        self.entries: dict[str, JobEntry] = {}
        self.by_shard: dict[int, dict[str, JobEntry]] = {}   # the same entries, by shard
        self.loaded: dict[int, int] = {}          # shard -> revision its jobs were listed at
        self.loading: dict[int, Fence] = {}
        self._dirty: dict[int, int] = {}          # shard -> newest job revision seen while loading
        self.waiting: dict[str, Firing] = {}      # admission key -> firing
        self.run_listeners: list[Any] = []        # health/sensor: run_started(f), run_ended(f)
        self.paused: Optional[str] = None         # early fence: no new runs start while set
        self._held: list[Firing] = []             # firings that fell due while paused
        self.gc = GcPolicy(self.loop, self._quiet_for).start()
        self.claim_lead = ClaimLead(self.cfg.execute.claim_lead_s)
        agent.shard_listeners.append(self)
        agent.busy_checks.append(self.busy)
        agent.status_providers["jobs"] = self.status
        if not hasattr(agent, "job_listeners"):
            agent.job_listeners = []
        agent.job_listeners.append(self)

    # --- wiring ------------------------------------------------------------------------
    def start_watches(self) -> list[PrefixWatch]:
        post = self.loop.post
        w = PrefixWatch(self.client, self.keys.jobs_prefix(), "jobs",
                        on_snapshot=lambda kvs, rev: post(self._jobs_snapshot, rev),
                        on_events=lambda evs, rev: post(self._jobs_events, evs, rev),
                        start_revision=None)
        # the snapshot of all jobs is not needed (shards load their own): list keys only
        w.client = _KeysOnly(self.client)
        return [w.start()]

    def busy(self, shard: int) -> bool:
        return any(f.state in ("running", "claiming") for e in self.by_shard.get(shard, {}).values()
                   for f in e.firings.values())

    def _pop_entry(self, job_id: str) -> Optional[JobEntry]:
        e = self.entries.pop(job_id, None)
        if e is not None:
            in_shard = self.by_shard.get(e.shard)
            if in_shard is not None and in_shard.get(job_id) is e:
                del in_shard[job_id]
                if not in_shard:
                    del self.by_shard[e.shard]
        return e

    # --- shard lifecycle ------------------------------------------------------------------
    def shard_acquired(self, fence: Fence) -> None:
        self.loading[fence.shard] = fence
        self._load(fence)

    def _load(self, fence: Fence) -> None:
        shard = fence.shard

        def op():
            jobs, rev = self.store.list_shard(shard)
            runs, _ = self.client.get_prefix(self.keys.runs_prefix(shard), revision=rev)
            return jobs, runs, rev

        def done(result, error):
            if self.loading.get(shard) != fence:
                return
            if error is not None:
                log.warning("loading shard failed; retrying", extra={"fields": {"shard": shard, "error": str(error)}})
                self.loop.call_later(0.5, self._retry_load, fence)
                return
            jobs, runs, rev = result
            del self.loading[shard]
            self.loaded[shard] = rev
            self._install_shard(fence, jobs, runs)
            if self._dirty.pop(shard, 0) > rev:
                self._reload(shard)

        self.workers.submit(op, done)

    def _retry_load(self, fence: Fence) -> None:
        if self.loading.get(fence.shard) == fence and self.agent.shards.mine.get(fence.shard) == fence:
            self._load(fence)

    def _reload(self, shard: int) -> None:
        fence = self.agent.shards.mine.get(shard)
        if fence is None:
            return
        # keep running firings; reinstall jobs not yet known
        self.loading[shard] = fence
        self.loaded.pop(shard, None)
        self._load(fence)

    def shard_lost(self, shard: int, reason: str) -> None:
        self.loading.pop(shard, None)
        self.loaded.pop(shard, None)
        self._dirty.pop(shard, None)
        for jid in list(self.by_shard.get(shard, ())):
            e = self._pop_entry(jid)
            self._drop_entry(e, reason="shard_lost" if reason != "released" else "released")
        JOBS_OWNED.set(len(self.entries))

    def _drop_entry(self, e: JobEntry, reason: str) -> None:
        if e.next_timer:
            e.next_timer.cancel()
        for f in list(e.firings.values()):
            if f.timer:
                f.timer.cancel()
            if f.state == "running" and f.handle is not None:
                # we may no longer write for this shard: stop the process so the new owner's
                # policy never overlaps with it
                f.handle.terminate(reason)
            elif f.key in self.waiting:
                self.waiting.pop(f.key, None)
                self._admit(self.admission.cancel(f.key))

    # --- job store input --------------------------------------------------------------------
    def _jobs_snapshot(self, rev: int) -> None:
        pass  # shards list their own jobs when acquired

    def _jobs_events(self, events: list[WatchEvent], rev: int) -> None:
        for ev in events:
            rest = ev.kv.key[len(self.keys.jobs_prefix()):]
            try:
                shard_s, job_id = rest.split("/", 1)
                shard = int(shard_s)
            except ValueError:
                continue
            if shard in self.loading:
                self._dirty[shard] = max(self._dirty.get(shard, 0), ev.kv.mod_revision)
                continue
            if shard not in self.loaded or ev.kv.mod_revision <= self.loaded[shard]:
                continue
            if ev.kind == "delete":
                e = self._pop_entry(job_id)
                if e:
                    self._drop_entry(e, "deleted")
                continue
            try:
                doc = json.loads(ev.kv.value)
            except ValueError:
                continue
            stored = StoredJob(shard, doc, ev.kv.mod_revision, ev.kv.create_revision)
            self.job_stored(stored)

    def job_stored(self, stored: StoredJob) -> None:
        """A job was created or changed in etcd (watch, or the ingest shortcut)."""
        shard = stored.shard
        if shard not in self.loaded:
            if shard in self.loading:
                self._dirty[shard] = max(self._dirty.get(shard, 0), stored.revision)
            return
        e = self.entries.get(stored.id)
        if stored.cancelled or stored.tombstone:
            if e is not None:
                self._cancel_entry(e)
            return
        if e is not None:
            return  # same id: content never changes (conflicts are refused at ingest)
        self._install_job(stored, {})
        JOBS_OWNED.set(len(self.entries))

    def job_cancelled(self, job_id: str) -> None:
        e = self.entries.get(job_id)
        if e is not None:
            self._cancel_entry(e)

    def _cancel_entry(self, e: JobEntry) -> None:
        if e.cancelled:
            return
        e.cancelled = True
        if e.next_timer:
            e.next_timer.cancel()
        for f in list(e.firings.values()):
            if f.state == "running" and f.handle is not None:
                f.handle.terminate("cancelled")
            elif f.state in ("pending", "held", "waiting", "retrying", "retrying_admission"):
                if f.timer:
                    f.timer.cancel()
                if f.key in self.waiting:
                    self.waiting.pop(f.key)
                    self._admit(self.admission.cancel(f.key))
                self._finish_without_run(f, "cancelled", "cancelled")
        self._status(e, None, "cancelled", reason="cancelled")
        self.agent.record("job", event="cancelled", job=e.job.id, shard=e.shard)

    # --- install ---------------------------------------------------------------------------
    def _install_shard(self, fence: Fence, jobs: list[StoredJob], runs: list) -> None:
        by_job: dict[str, dict[str, Any]] = {}
        for kv in runs:
            rest = kv.key[len(self.keys.runs_prefix(fence.shard)):]
            try:
                job_id, fire_id = rest.split("/", 1)
                rec = json.loads(kv.value)
            except ValueError:
                continue
            by_job.setdefault(job_id, {})[fire_id] = (rec, kv.mod_revision)
        for stored in jobs:
            if stored.cancelled or stored.tombstone or stored.id in self.entries:
                continue
            self._install_job(stored, by_job.get(stored.id, {}))
        JOBS_OWNED.set(len(self.entries))

    def _install_job(self, stored: StoredJob, records: dict[str, tuple[dict, int]]) -> None:
        self.gc.settle()  # job entries are long-lived: keep them out of full collections
        try:
            job = Job.from_stored(public_doc(stored.doc))
        except JobRejected as exc:
            log.error("stored job is invalid; ignoring", extra={"fields": {"job": stored.id, "error": exc.detail}})
            return
        try:
            accepted_at = sch.parse_rfc3339(stored.accepted_at) if stored.accepted_at else utcnow()
        except Exception:
            accepted_at = utcnow()
        e = JobEntry(job, stored, stored.shard, accepted_at)
        self._pop_entry(job.id)
        self.entries[job.id] = e
        self.by_shard.setdefault(e.shard, {})[job.id] = e
        now = utcnow()
        # 1. what earlier owners left behind
        for fire_id, (rec, rev) in sorted(records.items()):
            try:
                due = sch.parse_fire_id(fire_id)
            except Exception:
                continue
            if e.last_due_done is None or due > e.last_due_done:
                e.last_due_done = due
            state = rec.get("state")
            if state in TERMINAL:
                continue
            f = Firing(e, due, fire_id, int(rec.get("attempt", 1)), record=rec, record_rev=rev)
            e.firings[fire_id] = f
            if state == "retrying":
                f.state = "retrying"
                at = _parse_or(rec.get("retry_at"), now)
                f.timer = self.loop.call_later((at - now).total_seconds(), self._retry_due, f)
            else:  # running (or any unknown live state) by an owner that is gone
                self._orphan(f, now)
        # 2. firings due while nobody owned the shard (misfire policy), and the next one
        try:
            rec = sch.recover_job(job, accepted_at, e.last_due_done, now)
        except Exception as exc:
            log.error("cannot compute the schedule; ignoring job", extra={"fields": {"job": job.id, "error": str(exc)}})
            return
        if rec.skipped:
            FIRINGS.labels("misfired").inc(rec.skipped)
            self._status(e, None, "misfired", reason=f"misfire policy {job.misfire}: {rec.skipped}"
                         f"{'+' if rec.skipped_capped else ''} firing(s) skipped")
            # one record for the latest skipped firing, so the next owner does not decide again
            try:
                latest = sch.missed_firings(job.schedule, e.last_due_done, now, "run_once", 1,
                                            first_due=sch.first_due(job, accepted_at))
            except ValueError:
                latest = []
            for due in latest:
                if due not in rec.run:
                    f = Firing(e, due, sch.fire_id(job.id, due))
                    e.firings[f.fire_id] = f
                    if e.last_due_done is None or due > e.last_due_done:
                        e.last_due_done = due
                    self._finish_without_run(f, "misfired", f"misfire_{job.misfire}")
        if rec.run:  # catch-ups of one job run one after another, oldest first
            e.backlog.extend(rec.run[1:])
            self._fire(e, rec.run[0])
        if rec.next_due is not None:
            self._arm(e, rec.next_due)
        if not records and job.schedule.kind != "now" and rec.next_due is not None:
            self._status(e, None, "scheduled", due=rfc(rec.next_due))

    def _orphan(self, f: Firing, now: datetime) -> None:
        """A run left `running` by an owner that is gone: it may have run. Policy decides."""
        job = f.entry.job
        prev_agent = (f.record or {}).get("agent")
        nxt = sch.next_retry_at(job, f.fire_id, f.attempt, now)
        self.agent.record("job", event="owner_lost", job=job.id, fire_id=f.fire_id, attempt=f.attempt,
                          previous_agent=prev_agent)
        if nxt is not None:
            f.state = "retrying"
            self._write_record(f, "retrying", reason="owner_lost", retry_at=rfc(nxt), ended_at=rfc(now))
            f.timer = self.loop.call_later(max(0.0, (nxt - now).total_seconds()), self._retry_due, f)
        else:
            f.state = "done"
            self._write_record(f, "failed", reason="owner_lost", ended_at=rfc(now))
            RUNS.labels("owner_lost").inc()
            self._forget(f)

    # --- timers ----------------------------------------------------------------------------
    def _arm(self, e: JobEntry, due: datetime) -> None:
        if e.next_timer:
            e.next_timer.cancel()
        e.next_due = due
        delay = (due - utcnow()).total_seconds()
        lead = self.claim_lead.lead()
        e.next_timer = self.loop.call_later(max(0.0, delay - lead), self._due, e, due, min(lead, max(0.0, delay)))

    def _due(self, e: JobEntry, due: datetime, lead: float = 0.0) -> None:
        e.next_timer = None
        if self.entries.get(e.job.id) is not e or e.cancelled:
            return
        # wall-clock check: a timer is monotonic; if the clock stepped, re-arm on the new clock
        now = utcnow()
        early = (due - now).total_seconds() - lead
        if early > 0.05:
            log.warning("clock stepped back; re-arming", extra={"fields": {"job": e.job.id, "early_s": round(early, 3)}})
            self._arm(e, due)
            return
        if early < -2.0:
            log.warning("timer fired late (clock step or overload)", extra={"fields": {"job": e.job.id,
                                                                                       "late_s": round(-early, 3)}})
        nxt = sch.next_firing(e.job, due, e.accepted_at)
        if nxt is not None:
            self._arm(e, nxt)
        else:
            e.next_due = None
        self._fire(e, due, lead)

    # --- firing ---------------------------------------------------------------------------
    def _fire(self, e: JobEntry, due: datetime, lead: float = 0.0) -> None:
        fid = sch.fire_id(e.job.id, due)
        if fid in e.firings:
            return
        if e.last_due_done is None or due > e.last_due_done:
            e.last_due_done = due
        job = e.job
        now = utcnow()
        running = [g for g in e.firings.values() if g.state in ("running", "claiming")]
        ahead = (due - now).total_seconds()
        if ahead > SPAWN_AHEAD_MIN_S and (job.depends_on or running):
            # dependencies and overlap are decided at the due time, not at claim time
            self.loop.call_later(ahead, self._fire_if_current, e, due)
            return
        f = Firing(e, due, fid, lead=lead)
        if sch.is_expired(job, now):
            e.firings[fid] = f
            self._finish_without_run(f, "misfired", "expired")
            return
        if running and job.schedule.kind == "cron":
            action = sch.overlap_action(job.overlap, True)
            if action == "skip":
                e.firings[fid] = f
                FIRINGS.labels("overlap_skipped").inc()
                self._finish_without_run(f, "misfired", "overlap")
                return
            if action == "replace":
                for g in running:
                    if g.handle is not None:
                        g.handle.terminate("replaced")
        e.firings[fid] = f
        if job.depends_on:
            self._check_dependencies(f)
        else:
            self._request_admission(f)

    def _fire_if_current(self, e: JobEntry, due: datetime) -> None:
        if self.entries.get(e.job.id) is e and not e.cancelled:
            self._fire(e, due)

    def _check_dependencies(self, f: Firing) -> None:
        deps = list(f.entry.job.depends_on)

        def op():
            states = {}
            for dep in deps:
                s = shard_of(dep, self.cfg.shards)
                kvs, _ = self.client.get_prefix(self.keys.runs_prefix(s, dep))
                latest = None
                for kv in kvs:  # keys sort by fire_id = due time
                    latest = json.loads(kv.value)
                states[dep] = latest.get("state") if latest else None
            return states

        def done(states, error):
            if f.state == "done" or self.entries.get(f.entry.job.id) is not f.entry:
                return
            if error is None and all(v == "succeeded" for v in states.values()):
                self._request_admission(f)
                return
            if sch.is_expired(f.entry.job, utcnow()):
                self._finish_without_run(f, "misfired", "expired")
                return
            if f.wait_reason != "dependencies":
                f.state, f.wait_reason = "waiting", "dependencies"
                pending = sorted(k for k, v in (states or {}).items() if v != "succeeded")
                self._status(f.entry, f, "waiting", reason="dependencies", waiting_for=pending)
            f.timer = self.loop.call_later(DEPENDENCY_RECHECK_S, self._check_dependencies, f)

        self.workers.submit(op, done)

    def _limits(self, e: JobEntry):
        from agent.execute.limits import effective_limits

        tpl = self.cfg.templates.get(e.job.template)
        return effective_limits(e.job.resources, tpl.resources if tpl else None,
                                getattr(self.executor, "default_limits", None))

    def pause(self, reason: str) -> None:
        """Early fence: stop starting runs (shards are kept; firings wait, not misfire)."""
        if self.paused is None:
            log.warning("new runs paused", extra={"fields": {"reason": reason}})
        self.paused = reason or "paused"

    def resume(self) -> None:
        if self.paused is None:
            return
        log.info("new runs resumed", extra={"fields": {"held": len(self._held)}})
        self.paused = None
        held, self._held = sorted(self._held, key=lambda f: f.due), []
        for f in held:
            if f.state == "held" and self.entries.get(f.entry.job.id) is f.entry:
                self._request_admission(f)

    def publish_health(self, f: Firing, state: str, rule: Optional[str]) -> None:
        self._status(f.entry, f, "running", reason=f"health {state}: {rule}" if rule else None,
                     pid=getattr(f.handle, "pid", None))

    def _request_admission(self, f: Firing) -> None:
        from agent.execute.admission import ADMITTED, REJECTED

        if self.paused is not None:
            f.state = "held"
            self._held.append(f)
            return

        decision = self.admission.request(f.key, f.due.timestamp(), self._limits(f.entry))
        if decision == ADMITTED:
            self._claim(f)
        elif decision == REJECTED:
            self._finish_without_run(f, "failed", "quota_never_fits")
        else:
            f.state, f.wait_reason = "waiting", "quota"
            self.waiting[f.key] = f
            self._status(f.entry, f, "waiting", reason="quota")

    def _admit(self, keys: list[str]) -> None:
        """Start the runs admission just let in. A key whose firing is gone is released at
        once, and whatever that release admits is dispatched too (never dropped: a dropped
        admission would hold node budget forever)."""
        work = list(keys)
        while work:
            k = work.pop(0)
            f = self.waiting.pop(k, None)
            if f is None:
                work.extend(self.admission.release(k))
                continue
            if f.state == "retrying_admission":
                self._claim(f, retry=True)
            else:
                self._claim(f)

    def _release(self, f: Firing) -> None:
        self._admit(self.admission.release(f.key))

    def _claim(self, f: Firing, retry: bool = False) -> None:
        """Write the run record as `running` under the shard's fence, then start the process.

        The first attempt creates the record (create-revision==0: one record per firing);
        a retry swaps it in place (its mod revision must be the one we last wrote)."""
        e = f.entry
        fence = self.agent.fence_for(e.shard)
        if fence is None:
            if self._session_lapsed(f):
                self.loop.call_later(FENCE_WAIT_S, self._when_current, f, f.state, self._claim, f, retry)
                return
            self._abandon(f, "not_owner")
            return
        if retry:
            f.attempt += 1
        f.state = "claiming"
        key = self.keys.run(e.shard, e.job.id, f.fire_id)
        rec = self._record(f, "running", started_at=rfc(max(utcnow(), f.due)))
        compare = [Mod(key) == f.record_rev] if retry else [Create(key) == 0]

        def op():
            return fenced_txn(self.client, fence, compare=compare, success=[Put(key, json.dumps(rec))])

        def done(r, error):
            if f.state != "claiming":
                return
            if retry and isinstance(error, StaleToken):
                self._abandon(f, "shard_lost")
                return
            if retry and (error is not None or not r.succeeded):
                # etcd unreachable, an unknown outcome, or our own `retrying` write landed after
                # this claim was built: read the record back before deciding (found by the fault
                # test, seed 310: a retry dropped during an etcd leader kill stayed `retrying`)
                self._resolve_retry_claim(f, key, rec)
                return
            if isinstance(error, StaleToken):
                self._abandon(f, "shard_lost")
                return
            if error is not None:
                # unknown outcome (timeout): the record may exist; read it back before deciding
                self._resolve_unknown_claim(f, key, rec, fence, str(error))
                return
            if not r.succeeded:
                FIRINGS.labels("already_claimed").inc()
                self._abandon(f, "already_claimed")
                return
            f.record, f.record_rev = rec, r.revision
            self._spawn(f)

        self.workers.submit(op, done)

    def _resolve_unknown_claim(self, f: Firing, key: str, rec: dict, fence: Fence, error: str) -> None:
        def op():
            return self.client.get(key)

        def done(kv, err):
            if f.state != "claiming":
                return
            if err is not None:
                if self.agent.fence_for(f.entry.shard) is None:
                    self._abandon(f, "shard_lost")
                else:
                    self.loop.call_later(0.2, self._resolve_unknown_claim, f, key, rec, fence, error)
                return
            if kv is None:
                self._claim(f)  # the create did not happen: try again
                return
            cur = json.loads(kv.value)
            if cur.get("agent") == self.cfg.agent_id and cur.get("started_at") == rec["started_at"] \
                    and cur.get("attempt") == rec["attempt"]:
                f.record, f.record_rev = cur, kv.mod_revision
                self._spawn(f)
            else:
                self._abandon(f, "already_claimed")

        self.workers.submit(op, done)

    def _resolve_retry_claim(self, f: Firing, key: str, rec: dict) -> None:
        def op():
            return self.client.get(key)

        def done(kv, err):
            if f.state != "claiming" or self.entries.get(f.entry.job.id) is not f.entry or f.entry.cancelled:
                return
            if err is not None:
                if self.agent.shards.owns(f.entry.shard) is not None:
                    self.loop.call_later(0.2, self._resolve_retry_claim, f, key, rec)
                else:
                    self._abandon(f, "shard_lost")
                return
            cur = json.loads(kv.value) if kv is not None else {}
            if cur.get("state") == "running" and cur.get("agent") == self.cfg.agent_id \
                    and cur.get("attempt") == rec["attempt"] and cur.get("started_at") == rec["started_at"]:
                f.record, f.record_rev = cur, kv.mod_revision   # our claim did land
                self._spawn(f)
            elif cur.get("state") == "running" and int(cur.get("attempt") or 0) == rec["attempt"] - 1:
                # our `retrying` write for the previous attempt (or for an orphan of a dead
                # owner) has not landed yet: read again; the claim stays fenced either way
                self.loop.call_later(0.2, self._resolve_retry_claim, f, key, rec)
            elif cur.get("state") == "retrying" and int(cur.get("attempt") or 0) == rec["attempt"] - 1:
                f.record, f.record_rev = cur, kv.mod_revision   # still waiting for this attempt: claim again
                f.attempt -= 1
                self.loop.call_later(0.2, self._when_current, f, "claiming", self._claim, f, True)
            else:
                self._abandon(f, "retry_claim_failed")

        self.workers.submit(op, done)

    def _abandon(self, f: Firing, why: str) -> None:
        f.state = "done"
        self._release(f)
        self._forget(f)
        log.debug("firing abandoned", extra={"fields": {"job": f.entry.job.id, "fire_id": f.fire_id, "why": why}})

    def _spawn(self, f: Firing) -> None:
        from agent.execute.executor import RunSpec

        e = f.entry
        if self.agent.fence_for(e.shard) is None:  # fenced while claiming: do not start
            if self._session_lapsed(f):
                self.loop.call_later(FENCE_WAIT_S, self._when_current, f, "claiming", self._spawn, f)
                return
            self._abandon(f, "fenced")
            return
        tpl = self.cfg.templates.get(e.job.template)
        if tpl is None:
            self._run_failed_early(f, "unknown_template")
            return
        try:
            argv = render_argv(e.job, tpl)
        except JobRejected as exc:
            self._run_failed_early(f, f"bad_param: {exc.detail}")
            return
        spec = RunSpec(run_key=f"{f.key}.{f.attempt}", argv=argv, user=tpl.user, limits=self._limits(e),
                       timeout_s=e.job.timeout_s, kill_grace_s=self.cfg.execute.kill_grace_s,
                       output_max_bytes=self.cfg.execute.output_max_bytes, job_id=e.job.id,
                       run_id=f.fire_id, attempt=f.attempt)
        f.state = "running"
        on_exit = lambda h, r: self.loop.post(self._ended, f, r)  # noqa: E731
        ahead = (f.due - utcnow()).total_seconds()
        if f.lead > 0 and f.attempt == 1:
            self.claim_lead.observe(f.lead - ahead)
        prepare = getattr(self.executor, "prepare", None)
        if ahead > SPAWN_AHEAD_MIN_S and prepare is not None:
            session = self.agent.session
            lease = session.lease_id
            # checked by the releasing thread itself: even with this loop busy, nothing is
            # released once the lease the claim was made under may have run out
            f.handle = prepare(spec, on_exit, release_at=time.monotonic() + ahead,
                               on_release=lambda h, ok: self.loop.post(self._released, f, h, ok, argv, tpl.user),
                               guard=lambda: session.is_valid() and session.lease_id == lease)
            # listeners (exec policy, sensor attribution) know the run before it can exec
            for l in self.run_listeners:
                l.run_started(f)
            return
        if f.lead > 0 and f.attempt == 1:
            # the claim took longer than its lead: the spawn is on the due time's path
            FIRINGS.labels("claimed_late").inc()
        f.handle = self.executor.start(spec, on_exit)
        for l in self.run_listeners:
            l.run_started(f)
        self._released(f, f.handle, True, argv, tpl.user)

    def _released(self, f: Firing, handle: Any, ok: bool, argv: list, user: Optional[str]) -> None:
        """The job process was let go (exec'ing now): metrics, audit and the running status.
        Not ok: it could not start; its on_exit (spawn_error) follows."""
        if not ok or f.handle is not handle:
            return
        e = f.entry
        f.started_mono = time.monotonic()
        started = getattr(handle, "started_at", None) or time.time()
        delay = started - f.due.timestamp()
        if f.attempt == 1:
            TRIGGER_DELAY.observe(max(0.0, delay))
        FIRINGS.labels("started").inc()
        self.agent.record("job", event="run_start", job=e.job.id, fire_id=f.fire_id, attempt=f.attempt,
                          shard=e.shard, pid=getattr(handle, "pid", None), argv=argv, user=user)
        if f.state == "running":
            self._status(e, f, "running", pid=getattr(handle, "pid", None))

    def _run_failed_early(self, f: Firing, reason: str) -> None:
        f.state = "running"

        class _R:
            pass

        r = _R()
        r.reason, r.exit_code, r.signal, r.usage, r.error = "spawn_error", None, None, None, reason
        self._ended(f, r)

    def _ended(self, f: Firing, result: Any) -> None:
        e = f.entry
        self._release(f)
        for l in self.run_listeners:
            l.run_ended(f)
        reason = getattr(result, "reason", "failed")
        state = {"succeeded": "succeeded", "timed_out": "timed_out", "killed": "killed",
                 "cancelled": "cancelled", "replaced": "killed", "exec_policy": "killed"}.get(reason, "failed")
        if reason in ("shard_lost", "fenced", "released", "deleted"):
            f.state = "done"
            self._forget(f)
            RUNS.labels("abandoned").inc()
            return  # we may not write for this shard any more; the new owner resolves it
        usage = getattr(result, "usage", None)
        usage_doc = usage.to_dict() if hasattr(usage, "to_dict") else (usage or {})
        duration = time.monotonic() - f.started_mono if f.started_mono else 0.0
        JOB_DURATION.observe(duration)
        now = utcnow()
        detail = getattr(result, "error", None)
        fields = dict(exit_code=getattr(result, "exit_code", None), reason=reason if detail is None else f"{reason}: {detail}",
                      usage=usage_doc, ended_at=rfc(now), health=f.health)
        released = getattr(result, "started_at", None)
        # the claim wrote the planned start; the record keeps the real one (None: never released)
        fields["started_at"] = rfc(datetime.fromtimestamp(released, timezone.utc)) if released else None
        nxt = None
        if state in RETRYABLE and not e.cancelled:
            nxt = sch.next_retry_at(e.job, f.fire_id, f.attempt, now)
        RUNS.labels(reason if state != "succeeded" else "succeeded").inc()
        self.agent.record("job", event="run_end", job=e.job.id, fire_id=f.fire_id, attempt=f.attempt,
                          state=state, **{k: v for k, v in fields.items() if k != "usage"})
        if nxt is not None:
            f.state = "retrying"
            self._write_record(f, "retrying", retry_at=rfc(nxt), **fields)
            self._status(e, f, "retrying", retry_at=rfc(nxt), **fields)
            f.timer = self.loop.call_later(max(0.0, (nxt - now).total_seconds()), self._retry_due, f)
        else:
            f.state = "done"
            self._write_record(f, state, **fields)
            self._status(e, f, state, **fields)
            self._forget(f)
        if not self.busy(e.shard):
            self.agent.shards.release_idle()

    def _retry_due(self, f: Firing) -> None:
        f.timer = None
        e = f.entry
        if self.entries.get(e.job.id) is not e or e.cancelled or f.state != "retrying":
            return
        from agent.execute.admission import ADMITTED, REJECTED

        decision = self.admission.request(f.key, f.due.timestamp(), self._limits(e))
        if decision == ADMITTED:
            self._claim(f, retry=True)
        elif decision == REJECTED:
            self._finish_without_run(f, "failed", "quota_never_fits")
        else:
            f.state = "retrying_admission"
            self.waiting[f.key] = f

    def _finish_without_run(self, f: Firing, state: str, reason: str) -> None:
        """Record a firing that will not run (misfired, cancelled, failed before start)."""
        e = f.entry
        if self.agent.fence_for(e.shard) is None and self._session_lapsed(f):
            # the record must be written, not skipped, while we keep the shard (as in _claim)
            f.state = "finishing"
            self.loop.call_later(FENCE_WAIT_S, self._when_current, f, "finishing", self._finish_without_run,
                                 f, state, reason)
            return
        f.state = "done"
        FIRINGS.labels(reason).inc()
        fence = self.agent.fence_for(e.shard)
        if fence is not None:
            key = self.keys.run(e.shard, e.job.id, f.fire_id)
            rec = self._record(f, state, reason=reason, ended_at=rfc(utcnow()))
            if f.record_rev:
                cmp = [Mod(key) == f.record_rev]
            else:
                cmp = [Create(key) == 0]
            self.workers.submit(lambda: fenced_txn(self.client, fence, compare=cmp, success=[Put(key, json.dumps(rec))]),
                                lambda r, err: None)
        self._status(e, f, state, reason=reason)
        self._forget(f)

    def _forget(self, f: Firing) -> None:
        e = f.entry
        if e.firings.get(f.fire_id) is f:
            del e.firings[f.fire_id]
        if e.backlog and self.entries.get(e.job.id) is e and not e.cancelled \
                and not any(g.state in ("running", "claiming") for g in e.firings.values()):
            self.loop.call_later(0, self._fire, e, e.backlog.pop(0))
        # a one-shot job with nothing left to do stays known (cancel may still come)

    # --- records and statuses -----------------------------------------------------------------
    def _record(self, f: Firing, state: str, **fields: Any) -> dict:
        e = f.entry
        base = dict(f.record or {})
        base.update({"v": 1, "job_id": e.job.id, "fire_id": f.fire_id, "due": rfc(f.due), "state": state,
                     "attempt": f.attempt, "agent": self.cfg.agent_id, "shard": e.shard})
        base.setdefault("started_at", None)
        for k in ("ended_at", "exit_code", "reason", "health", "usage", "retry_at"):
            base.setdefault(k, None)
        if state == "running":
            for k in ("ended_at", "exit_code", "reason", "retry_at"):
                base[k] = None
            base["usage"] = None
        base.update(fields)
        return base

    def _write_record(self, f: Firing, state: str, **fields: Any) -> None:
        e = f.entry
        fence = self.agent.fence_for(e.shard)
        if fence is None:
            if self._session_lapsed(f):
                self.loop.call_later(FENCE_WAIT_S, self._rewrite, f, state, fields, f.record_rev)
            return
        key = self.keys.run(e.shard, e.job.id, f.fire_id)
        rec = self._record(f, state, **fields)
        rev = f.record_rev
        f.record = rec

        def op():
            return fenced_txn(self.client, fence, compare=[Mod(key) == rev], success=[Put(key, json.dumps(rec))])

        def done(r, error):
            if error is None and r.succeeded:
                f.record_rev = r.revision
            elif isinstance(error, (EtcdUnavailable, EtcdError)):
                # transient: retry while we still hold the shard
                self.loop.call_later(0.3, self._rewrite, f, state, fields, rev)
            elif error is not None and not isinstance(error, StaleToken):
                log.warning("run record write failed", extra={"fields": {"job": e.job.id, "error": str(error)}})

        self.workers.submit(op, done)

    def _rewrite(self, f: Firing, state: str, fields: dict, rev: int) -> None:
        if f.record_rev == rev and self.agent.shards.owns(f.entry.shard) is not None:
            self._write_record(f, state, **fields)

    def _session_lapsed(self, f: Firing) -> bool:
        """No fence only because the session is past its renew deadline, while the shard is
        still held (the keepalive may yet succeed; if not, the self-fence drops the shard
        and its entries). Dropping the firing here would lose it until the shard changes
        owner (found by the fault test: a firing left unrun for 17 s on a live owner)."""
        e = f.entry
        return (self.entries.get(e.job.id) is e and not e.cancelled and f.state != "done"
                and self.agent.shards.owns(e.shard) is not None)

    def _when_current(self, f: Firing, state: str, fn, *args) -> None:
        """Call fn(*args) later only if the firing is still where it was (same entry, same state)."""
        if f.state == state and self.entries.get(f.entry.job.id) is f.entry and not f.entry.cancelled:
            fn(*args)

    def _status(self, e: JobEntry, f: Optional[Firing], state: str, **fields: Any) -> None:
        doc = {"v": 1, "job_id": e.job.id, "run_id": f.fire_id if f else None, "state": state,
               "attempt": f.attempt if f else None, "agent": self.cfg.agent_id, "shard": e.shard,
               "ts": rfc(utcnow()), "exit_code": None, "reason": None, "usage": None}
        if f is not None:
            doc["due"] = rfc(f.due)
            doc["health"] = f.health
        doc.update(fields)
        self.agent.publish_status(doc)

    # --- status ---------------------------------------------------------------------------
    def status(self) -> dict:
        now = utcnow()
        running, due = [], []
        for e in self.entries.values():
            for f in e.firings.values():
                if f.state == "running" and f.started_mono:
                    running.append({"job_id": e.job.id, "fire_id": f.fire_id, "attempt": f.attempt,
                                    "pid": getattr(f.handle, "pid", None), "health": f.health,
                                    "age_s": round(time.monotonic() - f.started_mono, 1)})
            if e.next_due is not None:
                due.append((e.next_due, e.job.id))
        due.sort()
        return {"owned_jobs": len(self.entries), "running": running,
                "waiting": sum(1 for e in self.entries.values() for f in e.firings.values()
                               if f.state in ("waiting", "retrying_admission")),
                "due": [{"job_id": j, "due": rfc(d), "in_s": round((d - now).total_seconds(), 3)} for d, j in due[:50]],
                "loading_shards": sorted(self.loading),
                "admission": {"running": len(self.admission.running), "waiting": len(self.admission)}}

    def stop(self) -> None:
        self.gc.stop()
        for e in self.entries.values():
            for f in e.firings.values():
                if f.state == "running" and f.handle is not None:
                    f.handle.terminate("agent_stopped")

    def _quiet_for(self) -> Optional[float]:
        """Seconds until a process is due to be released: the next armed due time, or a
        prepared run waiting for its due time (for GcPolicy's full collections)."""
        soonest = None
        for e in self.entries.values():
            if e.next_due is not None and (soonest is None or e.next_due < soonest):
                soonest = e.next_due
            for f in e.firings.values():
                if f.state in ("claiming", "running") and not f.started_mono and (soonest is None or f.due < soonest):
                    soonest = f.due
        if soonest is None:
            return None
        return (soonest - utcnow()).total_seconds() - self.cfg.execute.claim_lead_s


def _parse_or(text: Optional[str], default: datetime) -> datetime:
    try:
        return sch.parse_rfc3339(text) if text else default
    except Exception:
        return default


class _KeysOnly:
    """Client view whose prefix listing returns keys only (the jobs watch needs no values
    at start: each shard lists its own jobs when acquired)."""

    def __init__(self, client):
        self._c = client

    def get_prefix(self, prefix, **kw):
        kw["keys_only"] = True
        return self._c.get_prefix(prefix, **kw)

    def __getattr__(self, name):
        return getattr(self._c, name)
