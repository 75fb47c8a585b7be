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
prepared then (quota container, launcher waiting on its go pipe). At the due time the
launcher releases itself on a kernel timer (armed while the lease is known to stay valid past
the due time; else the executor's release thread writes one byte to that pipe), so neither
the etcd claim, the spawn nor any thread of the agent is on the critical path. A firing
whose fate depends on what happens until its due time (depends_on, or an earlier run of the job still running: overlap) is
not claimed early. If the agent dies in between, the launcher exits with the agent (its
go pipe closes) and the record is resolved like any run of a dead owner.

Trust: a stored job runs only if its signature verifies against the agent's keyring and it
is bound to this cluster, checked at every load (etcd is writable by more than ingest). A
stored document that fails is never run: log, metric, audit ``rejected_stored``, status.
A job signed by a key with ``retired_after`` stops at that instant (status ``rejected``,
reason ``key_retired``).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Optional, Sequence, cast

from agent.coordination import placement
from agent.coordination.etcd import Create, EtcdClient, EtcdError, EtcdUnavailable, Mod, Put
from agent.coordination.fencing import Fence, StaleToken, fenced_txn
from agent.coordination.jobstore import JobStore, StoredJob, public_doc
from agent.coordination.keys import shard_of
from agent.coordination.watch import PrefixWatch, WatchEvent
from agent.coordination.worker import EtcdWorkers
from agent.jobs import schedule as sch
from agent.jobs.claimlead import ClaimLead
from agent.jobs.document import Job, JobRejected, render_argv, run_id
from agent.jobs.firing import ACTIVE, NOT_STARTED, RETRYABLE, TERMINAL, Firing, FiringState, RunListener
from agent.runtime.gcpolicy import GcPolicy
from agent.runtime.metrics import counter, gauge, histogram
from agent.runtime.recent import RecentMemory
from agent.runtime.timefmt import format_optional as rfc
from agent.runtime.timefmt import parse_rfc3339, utcnow

if TYPE_CHECKING:
    from agent.execute.admission import Admission
    from agent.execute.executor import Executor
    from agent.runtime.daemon import Agent

log = logging.getLogger(__name__)

RUNS = counter("millwright_runs_total", "Finished runs by result", ("result",))
FIRINGS = counter("millwright_firings_total", "Firings by outcome", ("outcome",))
TRIGGER_DELAY = histogram("millwright_trigger_delay_seconds", "Process start minus due time",
                          buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5))
JOB_DURATION = histogram("millwright_job_duration_seconds", "Run duration",
                         buckets=(0.01, 0.1, 0.5, 1, 5, 15, 60, 300, 1800, 7200))
JOBS_OWNED = gauge("millwright_jobs_owned", "Jobs in shards this agent holds")
REJECTED_STORED = counter("millwright_jobs_rejected_stored_total",
                          "Stored jobs refused at load (signature, binding, retired key, invalid)", ("reason",))

SPAWN_AHEAD_MIN_S = 0.001  # closer to the due time than this, start at once
RECORD_WORKERS = 6         # threads writing run records (claims, final states) to etcd
DEPENDENCY_RECHECK_S = 1.0
REJECTED_STORED_MEMORY = 10000  # (job, revision) pairs already reported, so reloads do not repeat them
RETIRE_CHECK_MAX_S = 3600.0     # a retirement far ahead is re-armed at most this far out


# How often a firing re-checks its fence while the session is past its renew deadline but
# the shard is still held (see Scheduler._session_lapsed).
FENCE_WAIT_S = 0.1
UNSURE_CLAIMS_MAX = 8   # earlier claims of one firing with an unknown outcome that are remembered


@dataclass
class JobEntry:
    job: Job
    stored: StoredJob
    shard: int               # the ownership unit (agent/coordination/pools.py); % shards: storage shard
    accepted_at: datetime
    last_due_done: Optional[datetime] = None
    next_timer: Any = None
    next_due: Optional[datetime] = None
    firings: dict[str, Firing] = field(default_factory=dict)
    cancelled: bool = False
    backlog: list = field(default_factory=list)  # missed firings to run one after another
    latest_fire: str = ""   # newest fire_id with a record: the one latest/<shard>/<job> copies


class Scheduler:
    """Implements the daemon's ShardListener, the cloud's JobListener and supervision's
    RunGate; tells its RunListeners of every run it starts and ends."""

    def __init__(self, agent: Agent, executor: Executor, admission: Admission,
                 run_listeners: Sequence[RunListener] = ()):
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
        self.run_listeners = run_listeners        # sensing, supervision (the daemon's list)
        self.paused: Optional[str] = None         # early fence: no new runs start while set
        self.draining = False                     # graceful stop: nothing new is claimed
        self._writes: dict[int, int] = {}         # shard -> run-record writes in flight
        self._held: list[Firing] = []             # firings that fell due while paused
        self.gc = GcPolicy(self.loop, self._quiet_for).start()
        self.claim_lead = ClaimLead(self.cfg.execute.claim_lead_s)
        if agent.keyring is None:  # no cloud component: read the keys file here
            agent.keyring = _load_keyring(self.cfg.signing.keys_file)
        self._rejected_seen: RecentMemory[tuple, None] = RecentMemory(REJECTED_STORED_MEMORY)
        agent.shard_listeners.append(self)
        agent.busy_checks.append(self.busy)
        agent.drain_hooks.append(self._drain_started)
        agent.run_stoppers.append(self.stop_runs)
        agent.status_providers["jobs"] = self.status
        agent.job_listeners.append(self)

    # --- wiring ------------------------------------------------------------------------
    def start_watches(self) -> list[PrefixWatch]:
        post = self.loop.post
        w = PrefixWatch(self.client, self.keys.jobs_prefix(), "jobs",
                        on_snapshot=lambda kvs, rev: post(self._jobs_snapshot, rev),
                        on_events=lambda evs, rev: post(self._jobs_events, evs, rev),
                        start_revision=None)
        # the snapshot of all jobs is not needed (shards load their own): list keys only
        w.client = cast(EtcdClient, _KeysOnly(self.client))
        return [w.start()]

    def busy(self, shard: int) -> bool:
        """A shard is busy while a run of it may be alive or its record is being written:
        it is not handed over before both are done (no shard leaves with a live run)."""
        if self._writes.get(shard):
            return True
        return any(f.state in ACTIVE for e in self.by_shard.get(shard, {}).values()
                   for f in e.firings.values())

    def _drain_started(self, done: Any) -> None:
        """Graceful stop: claim nothing new. Firings that fall due now stay unclaimed (the
        next owner runs them by the misfire policy); retries stay `retrying` in etcd."""
        self.draining = True
        done()

    def stop_runs(self, reason: str = "agent_stopped") -> int:
        """End every live run (SIGTERM, SIGKILL after kill_grace_s); each gets its final
        record, status and run_end audit record while the shard is still ours."""
        n = 0
        for e in list(self.entries.values()):
            for f in list(e.firings.values()):
                if f.state == FiringState.RUNNING and f.handle is not None:
                    f.handle.terminate(reason)
                    n += 1
        return n

    def _submit_write(self, shard: int, op: Any, done: Any) -> None:
        """A run-record write, counted against its shard until it finished (busy())."""
        self._writes[shard] = self._writes.get(shard, 0) + 1

        def finished(result, error):
            try:
                done(result, error)
            finally:
                n = self._writes.get(shard, 0) - 1
                if n > 0:
                    self._writes[shard] = n
                else:
                    self._writes.pop(shard, None)
                    if not self.busy(shard):
                        self.agent.release_idle()

        self.workers.submit(op, finished)

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
        storage, pool = self._st(shard), self.agent.placement.pool_of_unit(shard)

        def op():
            # paged reads at one revision; records are parsed here, off the loop thread, so
            # a shard with many records never delays due timers of the shards already held.
            # A unit holds the jobs of its storage shard that are in its placement pool.
            jobs, rev = self.store.list_shard(storage)
            jobs = [j if shard == storage else replace(j, shard=shard)
                    for j in jobs if placement.pool_of_doc(j.doc) == pool]
            runs = _records_by_job(self.client, self.keys.runs_prefix(storage), rev)
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
        if self.loading.get(fence.shard) == fence and self.agent.held(fence.shard) == fence:
            self._load(fence)

    def _reload(self, shard: int) -> None:
        fence = self.agent.held(shard)
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
            if e is not None:
                self._drop_entry(e, reason="shard_lost" if reason != "released" else "released")
        JOBS_OWNED.set(len(self.entries))

    def _drop_entry(self, e: JobEntry, reason: str) -> None:
        if e.next_timer:
            e.next_timer.cancel()
        for f in list(e.firings.values()):
            if f.timer:
                f.timer.cancel()
            self._unstage(f)
            if f.state == FiringState.RUNNING and f.handle is not None:
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
                storage = int(shard_s)
            except ValueError:
                continue
            doc = None
            if ev.kind == "put" and job_id not in self.entries and b'"target"' in ev.kv.value:
                # maybe targeted: its unit depends on its pool (untargeted documents, the
                # common case, are parsed only if their shard is ours, as before)
                try:
                    doc = json.loads(ev.kv.value)
                except ValueError:
                    continue
            shard = self._unit_for(job_id, storage, doc)
            if shard is None:
                continue  # a pool this agent does not know (yet): its shards load it
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
            if doc is None:
                try:
                    doc = json.loads(ev.kv.value)
                except ValueError:
                    continue
            stored = StoredJob(shard, doc, ev.kv.mod_revision, ev.kv.create_revision)
            self.job_stored(stored)

    def job_stored(self, stored: StoredJob) -> None:
        """A job was created or changed in etcd (watch, or the ingest shortcut)."""
        if stored.shard < self.cfg.shards:  # a storage shard: find the job's unit
            unit = self._unit_for(stored.id, stored.shard, stored.doc)
            if unit is None:
                return
            stored = replace(stored, shard=unit)
        shard = stored.shard
        if shard not in self.loaded:
            if shard in self.loading:
                self._dirty[shard] = max(self._dirty.get(shard, 0), stored.revision)
            return
        e = self.entries.get(stored.id)
        if stored.finished and not stored.cancelled:
            # retention replaced a job that can never fire again by its tombstone: forget it
            # quietly (it is not a cancel)
            if e is not None and not any(f.state != FiringState.DONE for f in e.firings.values()):
                self._pop_entry(stored.id)
                self._drop_entry(e, "finished")
                JOBS_OWNED.set(len(self.entries))
            return
        if stored.cancelled or stored.tombstone:
            if e is not None:
                self._cancel_entry(e)
            return
        if e is not None:
            return  # same id: content never changes (conflicts are refused at ingest)
        self._install_job(stored, {})
        JOBS_OWNED.set(len(self.entries))

    def _st(self, unit: int) -> int:
        """A unit's storage shard: where its jobs and run records live."""
        return unit % self.cfg.shards

    def _unit_for(self, job_id: str, storage: int, doc: Optional[dict]) -> Optional[int]:
        """The unit a job belongs to: its entry's if installed (tombstones carry no target),
        else from its document's placement pool."""
        e = self.entries.get(job_id)
        if e is not None:
            return e.shard
        if doc is None:
            return storage
        return self.agent.placement.unit_of(placement.pool_of_doc(doc), storage)

    def _fire_id(self, e: JobEntry, due: datetime) -> str:
        """A fan-out job's firing on this agent names the agent: ``<fire id>@<agent>``."""
        fid = sch.fire_id(e.job.id, due)
        return f"{fid}@{self.cfg.agent_id}" if e.job.fanout else fid

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
            if f.state == FiringState.RUNNING and f.handle is not None:
                f.handle.terminate("cancelled")
            elif f.state in NOT_STARTED:
                if f.timer:
                    f.timer.cancel()
                if f.key in self.waiting:
                    self.waiting.pop(f.key)
                    self._admit(self.admission.cancel(f.key))
                else:   # admitted, its claim waiting for the fence: its slot goes (unknown keys: none)
                    self._release(f)
                self._finish_without_run(f, "cancelled", "cancelled")
        self._status(e, None, "cancelled", reason="cancelled")
        self.agent.record("job", event="cancelled", job=e.job.id, shard=e.shard)

    # --- install ---------------------------------------------------------------------------
    def _install_shard(self, fence: Fence, jobs: list[StoredJob], by_job: dict[str, dict[str, Any]]) -> None:
        for stored in jobs:
            if stored.cancelled or stored.tombstone or stored.id in self.entries:
                continue
            self._install_job(stored, by_job.get(stored.id, {}))
        JOBS_OWNED.set(len(self.entries))

    def _install_job(self, stored: StoredJob, records: dict[str, tuple[dict, int]]) -> None:
        self.gc.settle()  # job entries are long-lived: keep them out of full collections
        job = stored.parsed  # verified by this agent's ingest from the pushed bytes (StoredJob.parsed)
        if job is None or (job.key_retired_after is not None and utcnow() >= job.key_retired_after):
            try:
                job = Job.from_stored(public_doc(stored.doc), keyring=self.agent.keyring, cluster=self.cfg.cluster,
                                      now=utcnow())
            except JobRejected as exc:
                self._reject_stored(stored, exc.reason, exc.detail)
                return
        try:
            accepted_at = parse_rfc3339(stored.accepted_at) if stored.accepted_at else utcnow()
        except Exception:
            accepted_at = utcnow()
        # the entry keeps the parsed job, not a second copy of the stored document (~2 KB
        # a job: 200 MB of an agent's RSS at 100,000 jobs owned; bench_scale.py memory)
        slim = StoredJob(stored.shard, {"id": stored.id}, stored.revision, stored.create_revision)
        e = JobEntry(job, slim, stored.shard, accepted_at)
        self._pop_entry(job.id)
        self.entries[job.id] = e
        self.by_shard.setdefault(e.shard, {})[job.id] = e
        if job.key_retired_after is not None:
            self._arm_retirement(e)
        now = utcnow()
        # 1. what earlier owners left behind
        mine = "@" + self.cfg.agent_id
        for fire_id, (rec, rev) in sorted(records.items()):
            if job.fanout and not fire_id.endswith(mine):
                continue  # another agent's own firings of a fan-out job
            try:
                due = sch.parse_fire_id(fire_id[:-len(mine)] if job.fanout else fire_id)
            except Exception:
                continue
            if e.last_due_done is None or due > e.last_due_done:
                e.last_due_done = due
            e.latest_fire = max(e.latest_fire, fire_id)
            state = rec.get("state")
            if state in TERMINAL:
                continue
            f = Firing(e, due, fire_id, int(rec.get("attempt", 1)), record=rec, record_rev=rev)
            e.firings[fire_id] = f
            if state == "retrying":
                f.move(FiringState.RETRYING)
                at = _parse_or(rec.get("retry_at"), now)
                f.timer = self.loop.call_later((at - now).total_seconds(), self._retry_due, f)
            else:  # running (or any unknown live state) by an owner that is gone
                self._orphan(f, now)
        # 2. firings due while nobody owned the shard (misfire policy), and the next one
        try:
            recovery = sch.recover_job(job, accepted_at, e.last_due_done, now)
        except Exception as exc:
            log.error("cannot compute the schedule; ignoring job", extra={"fields": {"job": job.id, "error": str(exc)}})
            return
        if recovery.skipped:
            FIRINGS.labels("misfired").inc(recovery.skipped)
            self._status(e, None, "misfired", reason=f"misfire policy {job.misfire}: {recovery.skipped}"
                         f"{'+' if recovery.skipped_capped else ''} firing(s) skipped")
            # one record for the latest skipped firing, so the next owner does not decide again
            try:
                latest = sch.missed_firings(job.schedule, e.last_due_done, sch.window_end(job, now), "run_once", 1,
                                            first_due=sch.first_due(job, accepted_at))
            except ValueError:
                latest = []
            for due in latest:
                if due not in recovery.run:
                    f = Firing(e, due, self._fire_id(e, due))
                    e.firings[f.fire_id] = f
                    if e.last_due_done is None or due > e.last_due_done:
                        e.last_due_done = due
                    self._finish_without_run(f, "misfired", f"misfire_{job.misfire}")
        if recovery.run:  # catch-ups of one job run one after another, oldest first
            e.backlog.extend(recovery.run[1:])
            self._fire(e, recovery.run[0])
        if recovery.next_due is not None:
            self._arm(e, recovery.next_due)
        if not records and job.schedule.kind != "now" and recovery.next_due is not None:
            self._status(e, None, "scheduled", due=rfc(recovery.next_due))

    # --- trust ------------------------------------------------------------------------------
    def _reject_stored(self, stored: StoredJob, reason: str, detail: str) -> None:
        """A stored document that may not run: never installed; reported once per revision."""
        job_id = stored.id if isinstance(stored.id, str) else ""
        seen = (job_id, stored.revision, reason)
        if seen in self._rejected_seen:
            return
        self._rejected_seen.remember(seen, None)
        REJECTED_STORED.labels(reason).inc()
        log.error("stored job refused: it is never run", extra={"fields": {
            "job": job_id, "shard": stored.shard, "reason": reason, "detail": detail}})
        self.agent.record("job", event="rejected_stored", job=job_id, shard=stored.shard, reason=reason,
                          detail=detail, revision=stored.revision)
        self.agent.publish_status({
            "v": 1, "job_id": job_id, "run_id": None, "state": "rejected", "attempt": None,
            "agent": self.cfg.agent_id, "shard": stored.shard, "ts": rfc(utcnow()), "exit_code": None,
            "reason": reason, "detail": f"stored job refused: {detail}", "usage": None, "source": "store"})

    def _arm_retirement(self, e: JobEntry) -> None:
        if e.job.key_retired_after is None:
            return
        left = (e.job.key_retired_after - utcnow()).total_seconds()
        if left <= 0:
            self._retire(e)
            return
        self.loop.call_later(min(left, RETIRE_CHECK_MAX_S), self._check_retirement, e)

    def _check_retirement(self, e: JobEntry) -> None:
        if self.entries.get(e.job.id) is e:
            self._arm_retirement(e)

    def _retire(self, e: JobEntry) -> None:
        """The key that signed this job was retired: it stops here (runs included)."""
        if self.entries.get(e.job.id) is not e:
            return
        self._pop_entry(e.job.id)
        self._drop_entry(e, "key_retired")
        JOBS_OWNED.set(len(self.entries))
        when = rfc(e.job.key_retired_after)
        self._reject_stored(e.stored, "key_retired", f"sig: key {e.job.kid} was retired at {when}")

    def _orphan(self, f: Firing, now: datetime) -> None:
        """A run left `running` by an owner that is gone: it may have run, or be partly done.
        It is run again only if the job opted in (retry.on lists owner_lost) and attempts
        remain; otherwise it ends `failed`, reason owner_lost (at most once by default).

        A retry here never overlaps the old run: this agent holds the shard, so the old
        owner's lease is gone (expired, or revoked after its runs ended), and its runs died
        before that: with the agent (the run guard kills them on its death), at its
        self-fence (kill_grace_s fits before the lease can expire: config check), or on its
        graceful stop (runs end before the lease is revoked)."""
        e = f.entry
        job = e.job
        prev_agent = (f.record or {}).get("agent")
        nxt = sch.next_retry_at(job, f.fire_id, f.attempt, now) if job.retry.retries("owner_lost") else None
        self.agent.record("job", event="owner_lost", job=job.id, fire_id=f.fire_id, attempt=f.attempt,
                          previous_agent=prev_agent, retry_at=rfc(nxt))
        RUNS.labels("owner_lost").inc()
        if nxt is not None:
            f.move(FiringState.RETRYING)
            self._write_record(f, "retrying", reason="owner_lost", retry_at=rfc(nxt), ended_at=rfc(now))
            self._status(e, f, "retrying", reason="owner_lost", retry_at=rfc(nxt), previous_agent=prev_agent)
            f.timer = self.loop.call_later(max(0.0, (nxt - now).total_seconds()), self._retry_due, f)
        else:
            f.move(FiringState.DONE)
            doc, key = self._final_status(f, "failed", reason="owner_lost", ended_at=rfc(now),
                                          previous_agent=prev_agent)
            self._write_record(f, "failed", answer=(key, doc), reason="owner_lost", ended_at=rfc(now))
            self._publish(doc, key)
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
        fid = self._fire_id(e, due)
        if fid in e.firings:
            return
        if e.last_due_done is None or due > e.last_due_done:
            e.last_due_done = due
        job = e.job
        now = utcnow()
        running = [g for g in e.firings.values() if g.state in ACTIVE]
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
                # one key: the copy of the dependency's newest record (never a prefix read);
                # records written before latest/ existed: the last key of its runs prefix
                kv = self.client.get(self.keys.latest(s, dep)) or self.client.get_last(self.keys.runs_prefix(s, dep))
                latest = json.loads(kv.value) if kv is not None else None
                states[dep] = latest.get("state") if latest else None
            return states

        def done(states, error):
            if f.state == FiringState.DONE or self.entries.get(f.entry.job.id) is not f.entry:
                return
            if error is None and all(v == "succeeded" for v in states.values()):
                self._request_admission(f)
                return
            if sch.is_expired(f.entry.job, utcnow()):
                self._finish_without_run(f, "misfired", "expired")
                return
            if f.wait_reason != "dependencies":
                f.move(FiringState.WAITING, wait_reason="dependencies")
                pending = sorted(k for k, v in (states or {}).items() if v != "succeeded")
                self._status(f.entry, f, "waiting", reason="dependencies", waiting_for=pending)
            f.timer = self.loop.call_later(DEPENDENCY_RECHECK_S, self._check_dependencies, f)

        self.workers.submit(op, done)

    def _limits(self, e: JobEntry):
        from agent.execute.limits import effective_limits

        tpl = self.cfg.templates.get(e.job.template)
        return effective_limits(e.job.resources, tpl.resources if tpl else None,
                                self.executor.default_limits)

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
            if f.state == FiringState.HELD and self.entries.get(f.entry.job.id) is f.entry:
                self._request_admission(f)

    def publish_health(self, f: Firing, state: str, rule: Optional[str]) -> None:
        self._status(f.entry, f, "running", reason=f"health {state}: {rule}" if rule else None,
                     pid=getattr(f.handle, "pid", None))

    def _request_admission(self, f: Firing) -> None:
        from agent.execute.admission import ADMITTED, REJECTED

        if self.paused is not None or self.draining:
            f.move(FiringState.HELD)
            self._held.append(f)
            return

        f.limits = self._limits(f.entry)
        decision = self.admission.request(f.key, f.due.timestamp(), f.limits)
        if decision == ADMITTED:
            self._claim(f)
        elif decision == REJECTED:
            self._finish_without_run(f, "failed", "quota_never_fits")
        else:
            f.move(FiringState.WAITING, wait_reason="quota")
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
            if f is None or self.draining:
                if f is not None:   # stopping: claim nothing new (the next owner will)
                    f.move(FiringState.HELD)
                    self._held.append(f)
                work.extend(self.admission.release(k))
                continue
            if f.state == FiringState.RETRYING_ADMISSION:
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
        if self.entries.get(e.job.id) is not e:
            # its entry went (shard lost, job dropped): a fence held now is not the one it
            # was installed under, and the entry installed since decides for the firing
            self._abandon(f, "dropped")
            return
        fence = self.agent.fence_for(e.shard)
        if fence is None:
            if self._session_lapsed(f):
                self.loop.call_later(FENCE_WAIT_S, self._when_current, f, f.state, self._claim, f, retry)
                return
            self._abandon(f, "not_owner")
            return
        if retry:
            f.attempt += 1
        f.move(FiringState.CLAIMING)
        key = self.keys.run(self._st(e.shard), e.job.id, f.fire_id)
        rec = self._record(f, "running", started_at=rfc(max(utcnow(), f.due)), fence=fence.token)
        compare = [Mod(key) == f.record_rev] if retry else [Create(key) == 0]
        ops = self._record_ops(f, key, json.dumps(rec))
        f.run = self._run_spec(f)
        stage = getattr(self.executor, "stage", None)
        spec = f.run[0] if stage is not None and not isinstance(f.run, str) else None

        def op():
            r = fenced_txn(self.client, fence, compare=compare, success=ops)
            staged = None
            if spec is not None and stage is not None and r.succeeded:
                # ours now: its directories and quota container are made here, on this
                # worker, so the loop's spawn does no blocking file-system work
                staged = stage(spec)
            return r, staged

        def done(result, error):
            r: Any
            r, staged = result if error is None else (None, None)
            if f.state != FiringState.CLAIMING:
                if staged is not None:
                    self.executor.unstage(staged)
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
                if f.unsure:
                    # an earlier claim of ours was read back as absent, then landed after
                    # all (it was still queued in etcd): the record may be that one
                    self._resolve_unknown_claim(f, key, rec, fence, "exists after an unknown outcome")
                    return
                FIRINGS.labels("already_claimed").inc()
                self._abandon(f, "already_claimed")
                return
            f.record, f.record_rev, f.staged, f.unsure = rec, r.revision, staged, ()
            self._spawn(f)

        self.workers.submit(op, done)

    def _resolve_unknown_claim(self, f: Firing, key: str, rec: dict, fence: Fence, error: str) -> None:
        def op():
            return self.client.get(key)

        def done(kv, err):
            if f.state != FiringState.CLAIMING:
                return
            lost = self.agent.owns(f.entry.shard) != fence
            if lost or self.entries.get(f.entry.job.id) is not f.entry:
                # the shard was lost since this claim (and maybe held again, under a new
                # fence, its jobs installed anew), or the job was dropped: a record the
                # claim landed was read by the shard's next load, which resolves it.
                # Claiming again here would claim under a fence this firing never had, for
                # an entry that is gone (CI-style run 50: seven records left `running`)
                self._abandon(f, "shard_lost" if lost else "dropped")
                return
            if err is not None:
                # the claim may have landed and the shard is still held (a lapsed session
                # may renew, and the record is ours then): read again
                self.loop.call_later(0.2, self._resolve_unknown_claim, f, key, rec, fence, error)
                return
            if kv is None:
                if f.entry.cancelled:   # no claim landed: the record says cancelled
                    self._discard(f)
                    return
                # not there (yet): claim again; if this create then finds a record, it may be
                # the one read back now, landed late (a request etcd still held)
                f.unsure = (f.unsure + (rec,))[-UNSURE_CLAIMS_MAX:]
                self._claim(f)
                return
            cur = json.loads(kv.value)
            if any(cur.get("agent") == self.cfg.agent_id and cur.get("started_at") == r["started_at"]
                   and cur.get("attempt") == r["attempt"] for r in (rec,) + f.unsure):
                f.record, f.record_rev, f.unsure = cur, kv.mod_revision, ()
                self._spawn(f)
            else:
                self._abandon(f, "already_claimed")

        self.workers.submit(op, done)

    def _resolve_retry_claim(self, f: Firing, key: str, rec: dict) -> None:
        def op():
            return self.client.get(key)

        def done(kv, err):
            if f.state != FiringState.CLAIMING:
                return
            if self.entries.get(f.entry.job.id) is not f.entry or f.entry.cancelled:
                self._discard(f)
                return
            if err is not None:
                if self.agent.owns(f.entry.shard) is not None:
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
                self.loop.call_later(0.2, self._when_current, f, FiringState.CLAIMING, self._claim, f, True)
            else:
                self._abandon(f, "retry_claim_failed")

        self.workers.submit(op, done)

    def _abandon(self, f: Firing, why: str) -> None:
        f.move(FiringState.DONE)
        self._release(f)
        self._forget(f)
        log.debug("firing abandoned", extra={"fields": {"job": f.entry.job.id, "fire_id": f.fire_id, "why": why}})

    def _run_spec(self, f: Firing) -> Any:
        """(RunSpec, argv, template) of the firing's current attempt, or the reason it
        cannot start (its run then fails early, after the claim)."""
        from agent.execute.runs import RunSpec

        e = f.entry
        tpl = self.cfg.templates.get(e.job.template)
        if tpl is None:
            return "unknown_template"
        rid = run_id(f.fire_id, f.attempt)
        try:
            argv = render_argv(e.job, tpl, {"fire_id": f.fire_id, "attempt": f.attempt, "run_id": rid})
        except JobRejected as exc:
            return f"bad_param: {exc.detail}"
        spec = RunSpec(run_key=f"{f.key}.{f.attempt}", argv=argv, user=tpl.user, limits=f.limits or self._limits(e),
                       timeout_s=e.job.timeout_s, kill_grace_s=self.cfg.execute.kill_grace_s,
                       output_max_bytes=self.cfg.execute.output_max_bytes, job_id=e.job.id,
                       run_id=rid, fire_id=f.fire_id, attempt=f.attempt,
                       allow_root=tpl.allow_root, network=tpl.network, capabilities=tuple(tpl.capabilities))
        return spec, argv, tpl

    def _unstage(self, f: Firing) -> None:
        """The staged directories and quota container of a run that will not start go."""
        staged, f.staged = f.staged, None
        if staged is not None:
            self.executor.unstage(staged)

    def _spawn(self, f: Firing) -> None:
        e = f.entry
        if self.agent.fence_for(e.shard) is None:  # fenced while claiming: do not start
            if self._session_lapsed(f):
                self.loop.call_later(FENCE_WAIT_S, self._when_current, f, FiringState.CLAIMING, self._spawn, f)
                return
            self._unstage(f)
            self._abandon(f, "fenced")
            return
        if e.cancelled or self.entries.get(e.job.id) is not e:
            # cancelled, or its job dropped (deleted, key retired, shard lost) while its
            # claim was in flight: it must not start here (it ran, to its end, with nothing
            # to stop it). A job installed again meanwhile came with its shard held again
            # under a new fence: that shard's load read this claim's record (the claim
            # landed before the old fence's key went) and the new entry resolves it
            # (owner_lost), so running it here as well could run the firing twice.
            self._discard(f)
            return
        planned, f.run = f.run, None
        if planned is None or (not isinstance(planned, str) and planned[0].attempt != f.attempt):
            planned = self._run_spec(f)   # claimed by another path (a read-back): built now
        if isinstance(planned, str):
            self._unstage(f)
            self._run_failed_early(f, planned)
            return
        spec, argv, tpl = planned
        if f.staged is not None and f.staged.run_key != spec.run_key:
            self._unstage(f)
        staged, f.staged = f.staged, None
        extra = {"staged": staged} if staged is not None else {}
        session = self.agent.session
        lease = session.lease_id

        def lease_valid() -> bool:
            # checked by the executor's own threads (release, reaper): even with this loop
            # busy, a run is not released, and is killed, once the lease it was claimed
            # under may have run out
            return session.is_valid() and session.lease_id == lease

        f.move(FiringState.RUNNING)
        on_exit = lambda h, r: self.loop.post(self._ended, f, r)  # noqa: E731
        ahead = (f.due - utcnow()).total_seconds()
        if f.lead > 0 and f.attempt == 1:
            self.claim_lead.observe(f.lead - ahead)
        prepare = getattr(self.executor, "prepare", None)
        if ahead > SPAWN_AHEAD_MIN_S and prepare is not None:
            # the lease's local validity only grows while it lives: until then lease_valid()
            # holds, so the launcher may release itself on a kernel timer (no thread of
            # ours on the due time's path)
            valid_until = session.valid_until if session.lease_id == lease else 0.0
            f.handle = prepare(spec, on_exit, release_at=time.monotonic() + ahead,
                               on_release=lambda h, ok: self.loop.post(self._released, f, h, ok, argv, tpl.user),
                               guard=lease_valid, guard_until=valid_until, **extra)
            # listeners (exec policy, sensor attribution) know the run before it can exec
            for l in self.run_listeners:
                l.run_started(f)
            return
        if f.lead > 0 and f.attempt == 1:
            # the claim took longer than its lead: the spawn is on the due time's path
            FIRINGS.labels("claimed_late").inc()
        try:
            f.handle = self.executor.start(spec, on_exit, guard=lease_valid, **extra)
        except TypeError:   # an executor without lease guards (unit-test fakes)
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
        if f.state == FiringState.RUNNING:
            self._status(e, f, "running", pid=getattr(handle, "pid", None))

    def _run_failed_early(self, f: Firing, reason: str) -> None:
        f.move(FiringState.RUNNING)

        self._ended(f, SimpleNamespace(reason="spawn_error", exit_code=None, signal=None, usage=None, error=reason))

    def _ended(self, f: Firing, result: Any) -> None:
        e = f.entry
        self._release(f)
        for l in self.run_listeners:
            l.run_ended(f)
        reason = getattr(result, "reason", "failed")
        state = {"succeeded": "succeeded", "timed_out": "timed_out", "killed": "killed",
                 "cancelled": "cancelled", "replaced": "killed", "exec_policy": "killed",
                 "agent_stopped": "killed"}.get(reason, "failed")
        if reason == "fenced" and self.agent.owns(e.shard) is not None:
            self._resolve_lease_kill(f)
            return
        if reason in ("shard_lost", "fenced", "released", "deleted"):
            f.move(FiringState.DONE)
            self._forget(f)
            RUNS.labels("abandoned").inc()
            return  # we may not write for this shard any more; the new owner resolves it
        usage = getattr(result, "usage", None)
        usage_doc = usage.to_dict() if usage is not None and hasattr(usage, "to_dict") else (usage or {})
        duration = time.monotonic() - f.started_mono if f.started_mono else 0.0
        JOB_DURATION.observe(duration)
        now = utcnow()
        detail = getattr(result, "error", None)
        fields: dict[str, Any] = dict(exit_code=getattr(result, "exit_code", None), reason=reason if detail is None else f"{reason}: {detail}",
                      usage=usage_doc, ended_at=rfc(now), health=f.health)
        tail = getattr(result, "stderr_tail", None)   # kept by the reaper as the output came
        if tail is not None:
            fields["stderr_tail"] = tail
        released = getattr(result, "started_at", None)
        # the claim wrote the planned start; the record keeps the real one (None: never released)
        fields["started_at"] = rfc(datetime.fromtimestamp(released, timezone.utc)) if released else None
        nxt = None
        # a run this agent stopped on its way out was cut short: retried (by the next owner,
        # from the `retrying` record) only where a lost owner's run would be
        outcome = "owner_lost" if reason == "agent_stopped" else state
        if (state in RETRYABLE or outcome == "owner_lost") and e.job.retry.retries(outcome) and not e.cancelled:
            nxt = sch.next_retry_at(e.job, f.fire_id, f.attempt, now)
        RUNS.labels(reason if state != "succeeded" else "succeeded").inc()
        self.agent.record("job", event="run_end", job=e.job.id, fire_id=f.fire_id, attempt=f.attempt,
                          state=state, **{k: v for k, v in fields.items() if k != "usage"})
        if nxt is not None:
            f.move(FiringState.RETRYING)
            self._write_record(f, "retrying", retry_at=rfc(nxt), **fields)
            self._status(e, f, "retrying", retry_at=rfc(nxt), **fields)
            if not self.draining:
                f.timer = self.loop.call_later(max(0.0, (nxt - now).total_seconds()), self._retry_due, f)
        else:
            f.move(FiringState.DONE)
            doc, key = self._final_status(f, state, **fields)
            self._write_record(f, state, answer=(key, doc), **fields)
            self._publish(doc, key)
            self._forget(f)
        if not self.busy(e.shard):
            self.agent.release_idle()

    def _retry_due(self, f: Firing) -> None:
        f.timer = None
        e = f.entry
        if self.entries.get(e.job.id) is not e or e.cancelled or f.state != FiringState.RETRYING or self.draining:
            return
        if f.writing:   # the `retrying` record is still on its way: its revision is the claim's compare
            f.timer = self.loop.call_later(0.05, self._retry_due, f)
            return
        from agent.execute.admission import ADMITTED, REJECTED

        f.limits = self._limits(e)
        decision = self.admission.request(f.key, f.due.timestamp(), f.limits)
        if decision == ADMITTED:
            self._claim(f, retry=True)
        elif decision == REJECTED:
            self._finish_without_run(f, "failed", "quota_never_fits")
        else:
            f.move(FiringState.RETRYING_ADMISSION)
            self.waiting[f.key] = f

    def _finish_without_run(self, f: Firing, state: str, reason: str) -> None:
        """Record a firing that will not run (misfired, cancelled, failed before start)."""
        e = f.entry
        if self._record_waits(e.shard):
            # the record must be written, not skipped, while we keep the shard (a cancelled
            # job's too: its record says cancelled)
            f.move(FiringState.FINISHING)
            self.loop.call_later(FENCE_WAIT_S, self._when_current, f, FiringState.FINISHING, self._finish_without_run,
                                 f, state, reason)
            return
        f.move(FiringState.DONE)
        FIRINGS.labels(reason).inc()
        fence = self.agent.fence_for(e.shard)
        doc, answer_key = self._final_status(f, state, reason=reason)
        if fence is not None:
            key = self.keys.run(self._st(e.shard), e.job.id, f.fire_id)
            rec = self._record(f, state, reason=reason, ended_at=rfc(utcnow()), fence=fence.token)
            if f.record_rev:
                cmp = [Mod(key) == f.record_rev]
            else:
                cmp = [Create(key) == 0]
            ops = self._record_ops(f, key, json.dumps(rec))
            if answer_key:
                ops.append(Put(answer_key, json.dumps(doc)))
            self._submit_write(e.shard, lambda: fenced_txn(self.client, fence, compare=cmp, success=ops),
                               lambda r, err: None)
        else:
            answer_key = None
        self._publish(doc, answer_key)
        self._forget(f)

    def _forget(self, f: Firing) -> None:
        e = f.entry
        if e.firings.get(f.fire_id) is f:
            del e.firings[f.fire_id]
        if e.backlog and self.entries.get(e.job.id) is e and not e.cancelled \
                and not any(g.state in ACTIVE for g in e.firings.values()):
            self.loop.call_later(0, self._fire, e, e.backlog.pop(0))
        # a one-shot job with nothing left to do stays known (cancel may still come)

    # --- records and statuses -----------------------------------------------------------------
    def _record(self, f: Firing, state: str, **fields: Any) -> dict:
        e = f.entry
        base = dict(f.record or {})
        base.update({"v": 1, "job_id": e.job.id, "fire_id": f.fire_id, "due": rfc(f.due), "state": state,
                     "attempt": f.attempt, "agent": self.cfg.agent_id, "shard": self._st(e.shard)})
        if e.job.target:  # the fence of this record is the pool's shard key (contract v1.1)
            base["pool"] = e.job.pool
            if e.job.fanout:
                base["fanout"] = True
        base.setdefault("started_at", None)
        for k in ("ended_at", "exit_code", "reason", "health", "usage", "retry_at"):
            base.setdefault(k, None)
        if state == "running":
            for k in ("ended_at", "exit_code", "reason", "retry_at"):
                base[k] = None
            base["usage"] = None
        base.update(fields)
        return base

    def _record_ops(self, f: Firing, key: str, value: str) -> list:
        """The run record's put, and its copy in latest/<shard>/<job> when this firing is
        the job's newest (in the same fenced transaction, so the two never disagree)."""
        e = f.entry
        ops = [Put(key, value)]
        if f.fire_id >= e.latest_fire:
            e.latest_fire = f.fire_id
            ops.append(Put(self.keys.latest(self._st(e.shard), e.job.id), value))
        return ops

    def _write_record(self, f: Firing, state: str, answer: Optional[tuple] = None, **fields: Any) -> None:
        """``answer``: (marker key or None, status document) of a final state, written in the
        same fenced transaction (agent/cloud/answers.py)."""
        e = f.entry
        fence = self.agent.fence_for(e.shard)
        if fence is None:
            if self._record_waits(e.shard):  # counted as in flight until _rewrite runs
                self._writes[e.shard] = self._writes.get(e.shard, 0) + 1
                f.writing += 1
                self.loop.call_later(FENCE_WAIT_S, self._rewrite, f, state, fields, f.record_rev, answer)
            return
        key = self.keys.run(self._st(e.shard), e.job.id, f.fire_id)
        rec = self._record(f, state, fence=fence.token, **fields)
        rev = f.record_rev
        f.record = rec
        f.writing += 1
        ops = self._record_ops(f, key, json.dumps(rec))
        if answer is not None and answer[0]:
            ops.append(Put(answer[0], json.dumps(answer[1])))

        def op():
            return fenced_txn(self.client, fence, compare=[Mod(key) == rev], success=ops)

        def done(r, error):
            f.writing -= 1
            if error is None and r.succeeded:
                f.record_rev = r.revision
            elif isinstance(error, (EtcdUnavailable, EtcdError)):
                # transient: retry while we still hold the shard (still counted as in flight)
                self._writes[e.shard] = self._writes.get(e.shard, 0) + 1
                f.writing += 1
                self.loop.call_later(0.3, self._rewrite, f, state, fields, rev, answer)
            elif error is not None and not isinstance(error, StaleToken):
                log.warning("run record write failed", extra={"fields": {"job": e.job.id, "error": str(error)}})

        self._submit_write(e.shard, op, done)

    def _rewrite(self, f: Firing, state: str, fields: dict, rev: int, answer: Optional[tuple] = None) -> None:
        f.writing -= 1
        shard = f.entry.shard
        n = self._writes.get(shard, 0) - 1
        if n > 0:
            self._writes[shard] = n
        else:
            self._writes.pop(shard, None)
        if f.record_rev == rev and self.agent.owns(shard) is not None:
            self._write_record(f, state, answer=answer, **fields)

    def _resolve_lease_kill(self, f: Firing) -> None:
        """The executor killed a run because the lease it was claimed under looked lapsed
        (past the renew deadline), but this agent still holds the shard: the keepalive came
        back before the self-fence. The firing is then ours to resolve, as a new owner would
        resolve it: its outcome is unknown (owner_lost; retried only where retry.on allows).
        Abandoning it would leave its record `running` for as long as the shard stays here
        (found merging issues 13 and 14: 5 of 1,000 firings after an etcd leader kill)."""
        e = f.entry
        if self.entries.get(e.job.id) is not e or f.state != FiringState.RUNNING:
            if f.state != FiringState.DONE:
                f.move(FiringState.DONE)
            return
        if self.agent.fence_for(e.shard) is not None:
            self._orphan(f, utcnow())
        elif self._session_lapsed(f):
            self.loop.call_later(FENCE_WAIT_S, self._resolve_lease_kill, f)
        else:  # the shard left after all: its next owner resolves the record
            f.move(FiringState.DONE)
            self._forget(f)
            RUNS.labels("abandoned").inc()

    def _record_waits(self, shard: int) -> bool:
        """A record write for the shard has no fence only because the session is past its
        renew deadline while the shard is still held: it waits for the renewal (or for the
        self-fence, after which the shard's next owner resolves the record). Whatever the
        firing's state: a final record (the run ended, an orphan resolved) dropped here
        stays `running` for as long as the renewed session keeps the shard (a keepalive
        can come back after the renew deadline, before the loop's fence timer runs)."""
        return self.agent.fence_for(shard) is None and self.agent.owns(shard) is not None

    def _session_lapsed(self, f: Firing) -> bool:
        """No fence only because the session is past its renew deadline, while the shard is
        still held (the keepalive may yet succeed; if not, the self-fence drops the shard
        and its entries). Dropping the firing here would lose it until the shard changes
        owner (found by the fault test: a firing left unrun for 17 s on a live owner)."""
        e = f.entry
        return (self.entries.get(e.job.id) is e and not e.cancelled and f.state != FiringState.DONE
                and self.agent.owns(e.shard) is not None)

    def _when_current(self, f: Firing, state: FiringState, fn: Any, *args: Any) -> None:
        """Call fn(*args) later only if the firing is still where it was (same entry, same state)."""
        here = self.entries.get(f.entry.job.id) is f.entry
        if f.state == state and here and (not f.entry.cancelled or state == FiringState.FINISHING):
            fn(*args)   # (a record being finished is written as it was, even for a job cancelled since)
        elif f.state == state and f.state != FiringState.DONE:
            self._discard(f)   # its job went meanwhile: it ends here, not never
        else:
            self._unstage(f)   # it will not be spawned: its staged run goes

    def _discard(self, f: Firing) -> None:
        """A firing whose job was cancelled or dropped (deleted, key retired, shard lost)
        after its admission and before its spawn. _cancel_entry and _drop_entry do not end
        one that is claiming or waiting to claim again: its staged run and its admission
        are given back here (kept, they would hold node budget and keep its shard busy)."""
        self._unstage(f)
        if self.entries.get(f.entry.job.id) is f.entry:   # cancelled: its record says so
            self._release(f)
            self._finish_without_run(f, "cancelled", "cancelled")
        else:
            self._abandon(f, "dropped")

    def _final_status(self, f: Firing, state: str, **fields: Any) -> tuple[dict, Optional[str]]:
        """A run's final status document and the key of its durable answer marker (None when
        no cloud component asked for markers: agent.answer_markers)."""
        doc = self._status_doc(f.entry, f, state, **fields)
        key = None
        if self.agent.answer_markers:
            key = self.keys.answer(self._st(f.entry.shard), f.entry.job.id, "run." + f.fire_id)
        return doc, key

    def _publish(self, doc: dict, answer_key: Optional[str] = None) -> None:
        if answer_key:
            doc = dict(doc, _answer=answer_key)  # the sink keeps it with the outbox row
        self.agent.publish_status(doc)

    def _status(self, e: JobEntry, f: Optional[Firing], state: str, **fields: Any) -> None:
        self.agent.publish_status(self._status_doc(e, f, state, **fields))

    def _status_doc(self, e: JobEntry, f: Optional[Firing], state: str, **fields: Any) -> dict:
        doc = {"v": 1, "job_id": e.job.id, "run_id": f.fire_id if f else None, "state": state,
               "attempt": f.attempt if f else None, "agent": self.cfg.agent_id, "shard": self._st(e.shard),
               "ts": rfc(utcnow()), "exit_code": None, "reason": None, "usage": None}
        if f is not None:
            doc["due"] = rfc(f.due)
            doc["health"] = f.health
        doc.update(fields)
        return doc

    # --- status ---------------------------------------------------------------------------
    def status(self) -> dict:
        now = utcnow()
        running, due = [], []
        for e in self.entries.values():
            for f in e.firings.values():
                if f.state == FiringState.RUNNING and f.started_mono:
                    running.append({"job_id": e.job.id, "fire_id": f.fire_id, "attempt": f.attempt,
                                    "pid": getattr(f.handle, "pid", None), "health": f.health,
                                    "age_s": round(time.monotonic() - f.started_mono, 1)})
            if e.next_due is not None:
                due.append((e.next_due, e.job.id))
        due.sort()
        return {"owned_jobs": len(self.entries), "running": running,
                "waiting": sum(1 for e in self.entries.values() for f in e.firings.values()
                               if f.state in (FiringState.WAITING, FiringState.RETRYING_ADMISSION)),
                "due": [{"job_id": j, "due": rfc(d), "in_s": round((d - now).total_seconds(), 3)} for d, j in due[:50]],
                "loading_shards": sorted(self.loading),
                "admission": {"running": len(self.admission.running), "waiting": len(self.admission)}}

    def stop(self) -> None:
        self.gc.stop()
        for e in self.entries.values():
            for f in e.firings.values():
                if f.state == FiringState.RUNNING and f.handle is not None:
                    f.handle.terminate("agent_stopped")

    def _quiet_for(self) -> Optional[float]:
        """Seconds until a process is due to be released: the next armed due time, or a
        prepared run waiting for its due time (for GcPolicy's full collections)."""
        soonest = None
        for e in self.entries.values():
            if e.next_due is not None and (soonest is None or e.next_due < soonest):
                soonest = e.next_due
            for f in e.firings.values():
                if f.state in ACTIVE and not f.started_mono and (soonest is None or f.due < soonest):
                    soonest = f.due
        if soonest is None:
            return None
        return (soonest - utcnow()).total_seconds() - self.cfg.execute.claim_lead_s


def _load_keyring(path: str):
    from agent.jobs.signing import KeyFileError, KeyRing

    try:
        return KeyRing.load(path)
    except KeyFileError as exc:
        for line in exc.problems:
            log.error("signing keys unusable: no stored job will run", extra={"fields": {"problem": line}})
        return KeyRing({}, source=path)
def _records_by_job(client: Any, prefix: str, revision: int) -> dict[str, dict[str, tuple[dict, int]]]:
    """Run records under a shard's runs/ prefix, read in pages at `revision`:
    {job_id: {fire_id: (record, mod_revision)}}. Unparseable records are skipped."""
    by_job: dict[str, dict[str, tuple[dict, int]]] = {}
    for kvs, _ in client.range_pages(prefix, revision=revision):
        for kv in kvs:
            try:
                job_id, fire_id = kv.key[len(prefix):].split("/", 1)
                rec = json.loads(kv.value)
            except ValueError:
                continue
            by_job.setdefault(job_id, {})[fire_id] = (rec, kv.mod_revision)
    return by_job


def _parse_or(text: Optional[str], default: datetime) -> datetime:
    try:
        return parse_rfc3339(text) if text else default
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
