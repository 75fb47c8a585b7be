"""The jobs this agent may run: loaded with each unit (cluster or pool shard) it acquires,
kept current from the jobs/ watch and the ingest shortcut, dropped with the unit.

Trust: a stored job is installed only if its signature verifies against the agent's key
ring and it is bound to this cluster, checked at every load (etcd is writable by more
than ingest). A stored document that fails is never run: log, metric, audit
``rejected_stored``, status. A job signed by a key with ``retired_after`` stops at that
instant (status ``rejected``, reason ``key_retired``).

What a job's firings do is the scheduler's: the catalog tells it through
``CatalogListener`` when a job is installed (with the run records earlier owners left),
cancelled, or dropped.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, cast

from agent.coordination import placement
from agent.coordination.etcd import EtcdClient, Put
from agent.coordination.fencing import Fence, fenced_txn
from agent.coordination.jobstore import JobStore, StoredJob, public_doc
from agent.coordination.keys import Keys, shard_of
from agent.coordination.watch import PrefixWatch, WatchEvent
from agent.jobs import schedule as sch
from agent.jobs.document import Job
from agent.jobs.envelope import JobRejected
from agent.jobs.firing import ACTIVE, FiringState
from agent.jobs.metrics import JOBS_OWNED, REJECTED_STORED
from agent.jobs.states import EndReason, JobState
from agent.runtime.gcpolicy import GcPolicy
from agent.runtime.recent import RecentMemory
from agent.runtime.timefmt import format_optional as rfc
from agent.runtime.timefmt import parse_rfc3339, utcnow

if TYPE_CHECKING:
    from agent.config import Config
    from agent.coordination.worker import EtcdWorkers
    from agent.jobs.firing import Firing
    from agent.jobs.seams import AuditSink, Fencing, StatusSink, Units
    from agent.jobs.signing import KeyRing
    from agent.runtime.loop import EventLoop

log = logging.getLogger(__name__)


REJECTED_STORED_MEMORY = 10000  # (job, revision) pairs already reported, so reloads do not repeat them
RETIRE_CHECK_MAX_S = 3600.0     # a retirement far ahead is re-armed at most this far out
TEMPLATE_RECHECK_S = 5.0        # a job of a removed template with a live run is checked again this often
LOAD_RETRY_S = 0.5
USAGE_PUBLISH_S = 1.0

Records = dict[str, tuple[dict, int]]   # fire_id -> (run record, its mod revision)


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
    foreign_ahead: dict[str, int] = field(default_factory=dict)   # fire_id -> revision of a foreign record found ahead
    at_load: bool = False    # installed by its unit's load (a takeover: its missed firings are paced)

    def fire_id(self, due: datetime, agent_id: str) -> str:
        """A fan-out job's firing on this agent names the agent: ``<fire id>@<agent>``."""
        fid = sch.fire_id(self.job.id, due)
        return f"{fid}@{agent_id}" if self.job.fanout else fid


class CatalogListener(Protocol):
    """The scheduler: what happens to a job's firings when the job comes and goes."""

    def job_installed(self, e: JobEntry, records: Records) -> None: ...

    def job_cancelled(self, e: JobEntry, reason: str) -> None: ...

    def job_dropped(self, e: JobEntry, reason: str) -> None: ...


class JobCatalog:
    """Implements the daemon's ShardListener and the cloud's JobListener (loop thread)."""

    def __init__(self, cfg: Config, client: Any, keys: Keys, fencing: Fencing, units: Units, loop: EventLoop,
                 workers: EtcdWorkers, keyring: KeyRing, audit: AuditSink, statuses: StatusSink):
        self.client = client
        self.keys = keys
        self.fencing = fencing
        self.units = units
        self.loop = loop
        self.workers = workers
        self.agent_id = cfg.agent_id
        self.cluster = cfg.cluster
        self.shards = cfg.shards
        self.keyring = keyring
        self.audit = audit
        self.statuses = statuses
        self.claim_lead_s = cfg.execute.claim_lead_s
        self.max_age_s = cfg.mqtt.max_age_s
        self.listener: Optional[CatalogListener] = None
        # told when an installed job's document gained approvals (agent/jobs/approvalgate.py)
        self.changed_listeners: list[Callable[[JobEntry], None]] = []
        self.store = JobStore(client, keys, cfg.shards, cfg.agent_id)
        self.entries: dict[str, JobEntry] = {}
        self.by_shard: dict[int, dict[str, JobEntry]] = {}   # the same entries, by unit
        self.loaded: dict[int, int] = {}          # unit -> revision its jobs were listed at
        self.loading: dict[int, Fence] = {}
        self._dirty: dict[int, int] = {}          # unit -> newest job revision seen while loading
        self._rejected_seen: RecentMemory[tuple, None] = RecentMemory(REJECTED_STORED_MEMORY)
        # what the job documents of each cluster shard held here take: [documents, bytes],
        # published to usage/<shard> for ingest's cluster quotas (agent/coordination/quota.py)
        self.usage: dict[int, list[int]] = {}
        self._usage_dirty: set[int] = set()
        self._usage_timer: Any = None
        # job entries are long-lived: keep them out of full collections
        self.gc = GcPolicy(loop, self.quiet_for).start()

    def stop(self) -> None:
        self.gc.stop()

    def status(self) -> dict:
        """What the jobs held here are doing (the admin socket's ``jobs``)."""
        now, mono = utcnow(), time.monotonic()
        running, due, waiting = [], [], 0
        for e in self.entries.values():
            for f in e.firings.values():
                if f.state == FiringState.RUNNING and f.started_mono:
                    running.append({"job_id": e.job.id, "fire_id": f.fire_id, "attempt": f.attempt,
                                    "pid": f.handle.pid if f.handle else None, "health": f.health,
                                    "age_s": round(mono - f.started_mono, 1)})
                waiting += f.state in (FiringState.WAITING, FiringState.RETRYING_ADMISSION)
            if e.next_due is not None:
                due.append((e.next_due, e.job.id))
        due.sort()
        return {"owned_jobs": len(self.entries), "running": running, "waiting": waiting,
                "due": [{"job_id": j, "due": rfc(d), "in_s": round((d - now).total_seconds(), 3)} for d, j in due[:50]],
                "loading_shards": sorted(self.loading)}

    def quiet_for(self) -> Optional[float]:
        """Seconds until a process may be due to be released: the next armed due time, or a
        firing prepared or claimed ahead of its due time (GcPolicy's full collections)."""
        soonest = None
        for e in self.entries.values():
            if e.next_due is not None and (soonest is None or e.next_due < soonest):
                soonest = e.next_due
            for f in e.firings.values():
                if f.state in ACTIVE and not f.started_mono and (soonest is None or f.due < soonest):
                    soonest = f.due
        if soonest is None:
            return None
        return (soonest - utcnow()).total_seconds() - self.claim_lead_s

    def current(self, e: JobEntry) -> bool:
        """Whether ``e`` is still the job's installed entry."""
        return self.entries.get(e.job.id) is e

    def in_unit(self, unit: int) -> list[JobEntry]:
        return list(self.by_shard.get(unit, {}).values())

    def active_in(self, unit: int) -> bool:
        """Whether a firing of the unit may have a live run or a record to write."""
        return any(f.state in ACTIVE for e in self.in_unit(unit) for f in e.firings.values())

    def running(self) -> list:
        """The firings with a live run here."""
        return [f for e in self.entries.values() for f in e.firings.values()
                if f.state == FiringState.RUNNING and f.handle is not None]

    def start_watches(self) -> list[PrefixWatch]:
        post = self.loop.post
        w = PrefixWatch(self.client, self.keys.jobs_prefix(), "jobs",
                        on_snapshot=lambda kvs, rev: None,   # units list their own jobs when acquired
                        on_events=lambda evs, rev: post(self._jobs_events, evs, rev),
                        start_revision=None)
        # the snapshot of all jobs is not needed: list keys only
        w.client = cast(EtcdClient, _KeysOnly(self.client))
        return [w.start()]

    def _pop(self, job_id: str) -> Optional[JobEntry]:
        e = self.entries.pop(job_id, None)
        if e is not None:
            in_shard = self.by_shard.get(e.shard)
            if in_shard is not None and in_shard.get(job_id) is e:
                del in_shard[job_id]
                if not in_shard:
                    del self.by_shard[e.shard]
        return e

    def _drop(self, job_id: str, reason: str) -> None:
        e = self._pop(job_id)
        if e is not None and self.listener is not None:
            self.listener.job_dropped(e, reason)
        JOBS_OWNED.set(len(self.entries))

    # --- units ------------------------------------------------------------------------
    def shard_acquired(self, fence: Fence) -> None:
        self.loading[fence.shard] = fence
        self._load(fence)

    def _load(self, fence: Fence) -> None:
        unit = fence.shard
        storage, pool = unit % self.shards, self.units.pool_of_unit(unit)

        def op() -> Any:
            # paged reads at one revision; records are parsed here, off the loop thread, so
            # a shard with many records never delays due timers of the shards already held.
            # A unit holds the jobs of its storage shard that are in its placement pool.
            listed, rev = self.store.list_shard(storage)
            jobs = [j if unit == storage else replace(j, shard=unit)
                    for j in listed if placement.pool_of_doc(j.doc) == pool]
            usage = [len(listed), sum(j.size for j in listed)]
            return jobs, records_by_job(self.client, self.keys.runs_prefix(storage), rev), rev, usage

        def done(result: Any, error: Optional[BaseException]) -> None:
            if self.loading.get(unit) != fence:
                return
            if error is not None:
                log.warning("loading shard failed; retrying", extra={"fields": {"shard": unit, "error": str(error)}})
                self.loop.call_later(LOAD_RETRY_S, self._retry_load, fence)
                return
            jobs, runs, rev, usage = result
            del self.loading[unit]
            self.loaded[unit] = rev
            if unit < self.shards:   # the cluster shard's owner accounts for its storage shard
                self.usage[unit] = usage
                self._usage_changed(unit)
            for stored in jobs:
                if not (self._misplaced(stored) or stored.cancelled or stored.tombstone or stored.id in self.entries):
                    self._install(stored, runs.get(stored.id, {}), at_load=True)
            JOBS_OWNED.set(len(self.entries))
            if self._dirty.pop(unit, 0) > rev:
                self._reload(unit)

        self.workers.submit(op, done)

    def _retry_load(self, fence: Fence) -> None:
        if self.loading.get(fence.shard) == fence and self.fencing.held(fence.shard) == fence:
            self._load(fence)

    def _reload(self, unit: int) -> None:
        """List the unit's jobs again (installed ones stay as they are; new ones install)."""
        fence = self.fencing.held(unit)
        if fence is None:
            return
        self.loading[unit] = fence
        self.loaded.pop(unit, None)
        self._load(fence)

    def shard_lost(self, shard: int, reason: str) -> None:
        self.usage.pop(shard, None)
        self.loading.pop(shard, None)
        self.loaded.pop(shard, None)
        self._dirty.pop(shard, None)
        why = EndReason.RELEASED if reason == EndReason.RELEASED else EndReason.SHARD_LOST
        for jid in list(self.by_shard.get(shard, ())):
            self._drop(jid, why)

    # --- usage --------------------------------------------------------------------------
    def _account(self, storage: int, ev: WatchEvent) -> None:
        u = self.usage[storage]
        before = len(ev.prev.value) if ev.prev is not None else 0
        if ev.kind == "delete":
            u[0], u[1] = max(0, u[0] - 1), max(0, u[1] - before)
        else:
            u[0] += ev.prev is None
            u[1] = max(0, u[1] + len(ev.kv.value) - before)
        self._usage_changed(storage)

    def _usage_changed(self, storage: int) -> None:
        self._usage_dirty.add(storage)
        if self._usage_timer is None:
            self._usage_timer = self.loop.call_later(USAGE_PUBLISH_S, self._publish_usage)

    def _publish_usage(self) -> None:
        """usage/<shard> for each cluster shard whose account changed, fenced (at most one
        write a shard per USAGE_PUBLISH_S)."""
        self._usage_timer = None
        dirty, self._usage_dirty = self._usage_dirty, set()
        for shard in sorted(dirty):
            fence, u = self.fencing.fence_for(shard), self.usage.get(shard)
            if fence is None or u is None:
                continue
            value = json.dumps({"jobs": u[0], "bytes": u[1], "agent": self.agent_id})
            self.workers.submit(functools.partial(fenced_txn, self.client, fence, success=[Put(self.keys.usage(shard), value)]),
                                lambda r, e: None)

    # --- job store input --------------------------------------------------------------
    def _jobs_events(self, events: list[WatchEvent], rev: int) -> None:
        for ev in events:
            rest = ev.kv.key[len(self.keys.jobs_prefix()):]
            try:
                shard_s, job_id = rest.split("/", 1)
                storage = int(shard_s)
            except ValueError:
                continue
            if storage in self.usage and ev.kv.mod_revision > self.loaded.get(storage, ev.kv.mod_revision):
                self._account(storage, ev)
            doc = None
            if ev.kind == "put" and job_id not in self.entries and b'"target"' in ev.kv.value:
                # maybe targeted: its unit depends on its pool (untargeted documents, the
                # common case, are parsed only if their shard is ours)
                try:
                    doc = json.loads(ev.kv.value)
                except ValueError:
                    continue
            unit = self._unit_for(job_id, storage, doc)
            if unit is None:
                continue  # a pool this agent does not know (yet): its units load it
            if unit in self.loading:
                self._dirty[unit] = max(self._dirty.get(unit, 0), ev.kv.mod_revision)
                continue
            if unit not in self.loaded or ev.kv.mod_revision <= self.loaded[unit]:
                continue
            if ev.kind == "delete":
                if job_id in self.entries and ev.kv.key == self.keys.job(shard_of(job_id, self.shards), job_id):
                    self._deleted(job_id)
                continue
            if doc is None:
                try:
                    doc = json.loads(ev.kv.value)
                except ValueError:
                    continue
            self.job_stored(StoredJob(unit, doc, ev.kv.mod_revision, ev.kv.create_revision, key=ev.kv.key))

    def job_stored(self, stored: StoredJob) -> None:
        """A job was created or changed in etcd (watch, or the ingest shortcut)."""
        if self._misplaced(stored):
            return
        if stored.shard < self.shards:  # a storage shard: find the job's unit
            unit = self._unit_for(stored.id, stored.shard, stored.doc)
            if unit is None:
                return
            stored = replace(stored, shard=unit)
        unit = stored.shard
        if unit not in self.loaded:
            if unit in self.loading:
                self._dirty[unit] = max(self._dirty.get(unit, 0), stored.revision)
            return
        e = self.entries.get(stored.id)
        if stored.finished and not stored.cancelled:
            # retention replaces a job that can never fire again by its tombstone: forget it
            # quietly (it is not a cancel). A tombstone over a job with firings to come was
            # not retention's: the job stops, and says so
            if e is not None and e.next_due is None and all(f.state == FiringState.DONE for f in e.firings.values()):
                self._drop(stored.id, EndReason.FINISHED)
            elif e is not None:
                self.job_cancelled(stored.id, "tombstoned")
            return
        if stored.cancelled or stored.tombstone:
            if e is not None:
                self.job_cancelled(stored.id)
            return
        if e is not None:
            self._approved(e, stored)  # same id: content never changes; approvals may be added
            return
        self._install(stored, {})
        JOBS_OWNED.set(len(self.entries))

    def _approved(self, e: JobEntry, stored: StoredJob) -> None:
        """A newer revision of an installed job whose signed content is the same and whose
        approvals differ (the job store merged more): verified again, it replaces the job."""
        doc = public_doc(stored.doc)
        if stored.revision <= e.stored.revision or doc.get("approvals") == e.job.doc.get("approvals"):
            return
        try:
            job = Job.from_stored(doc, keyring=self.keyring, cluster=self.cluster, now=utcnow())
        except JobRejected as exc:
            self._reject_stored(stored, exc.reason, exc.detail)
            return
        if job.content != e.job.content:
            return   # not the job that was installed: conflicts are refused at ingest
        e.job, e.stored = job, StoredJob(e.shard, {"id": job.id}, stored.revision, stored.create_revision)
        self.audit.record("job", event="approvals_changed", job=job.id, revision=stored.revision,
                          signers=[{"kid": k, "role": r} for k, r in job.signers])
        for listener in self.changed_listeners:
            listener(e)

    def job_cancelled(self, job_id: str, reason: str = EndReason.CANCELLED) -> None:
        e = self.entries.get(job_id)
        if e is not None and self.listener is not None:
            self.listener.job_cancelled(e, reason)

    def cancel_here(self, e: JobEntry, reason: str) -> None:
        """The job's own signed document asks for its cancel (a window with ``end: cancel``
        closed on a run): its cancel mark goes into the store, as a cloud cancel's does, and
        it stops here now."""
        if not self.current(e) or e.cancelled:
            return

        def done(result: Any, error: Optional[BaseException]) -> None:
            if error is not None:
                log.warning("cannot write the job's cancel mark", extra={"fields": {"job": e.job.id,
                                                                                   "error": str(error)}})

        self.workers.submit(lambda: self.store.cancel(e.job.id, reason), done)
        self.job_cancelled(e.job.id, reason)

    def _deleted(self, job_id: str) -> None:
        """The job's key was deleted. Retention deletes only tombstones (of cancelled or
        finished jobs): a live job deleted is stopped like a cancel, with its final
        statuses and an audit record saying so, then forgotten."""
        self.job_cancelled(job_id, "deleted")
        self._drop(job_id, EndReason.DELETED)

    def _unit_for(self, job_id: str, storage: int, doc: Optional[dict]) -> Optional[int]:
        """The unit a job belongs to: its entry's if installed (tombstones carry no target),
        else from its document's placement pool."""
        e = self.entries.get(job_id)
        if e is not None:
            return e.shard
        if doc is None:
            return storage
        return self.units.unit_of(placement.pool_of_doc(doc), storage)

    # --- install ----------------------------------------------------------------------
    def _install(self, stored: StoredJob, records: Records, at_load: bool = False) -> None:
        self.gc.settle()
        job = stored.parsed  # verified by this agent's ingest from the pushed bytes (StoredJob.parsed)
        if job is None or (job.key_retired_after is not None and utcnow() >= job.key_retired_after):
            try:
                job = Job.from_stored(public_doc(stored.doc), keyring=self.keyring, cluster=self.cluster,
                                      now=utcnow())
            except JobRejected as exc:
                self._reject_stored(stored, exc.reason, exc.detail)
                return
        try:
            accepted_at = parse_rfc3339(stored.accepted_at) if stored.accepted_at else utcnow()
        except Exception:
            accepted_at = utcnow()
        stale = self._replayed(job, accepted_at, records)
        if stale is not None:
            self._reject_stored(stored, "too_old", stale)
            return
        # the entry keeps the parsed job, not a second copy of the stored document (~2 KB
        # a job: bench_scale.py memory)
        slim = StoredJob(stored.shard, {"id": stored.id}, stored.revision, stored.create_revision)
        e = JobEntry(job, slim, stored.shard, accepted_at, at_load=at_load)
        self._pop(job.id)
        self.entries[job.id] = e
        self.by_shard.setdefault(e.shard, {})[job.id] = e
        if job.key_retired_after is not None:
            self._arm_retirement(e)
        if self.listener is not None:
            self.listener.job_installed(e, records)

    # --- trust ------------------------------------------------------------------------
    def _misplaced(self, stored: StoredJob) -> bool:
        """A document read from a key that is not its own is reported and never acted on:
        a signed job copied under another key or shard would run beside the real one under
        another fence, and a copy's cancel mark must not stop the real one."""
        if not stored.key:
            return False   # written by this agent's own ingest, at the key it computed
        job_id = stored.id if isinstance(stored.id, str) else ""
        expected = self.keys.job(shard_of(job_id, self.shards), job_id)
        if stored.key == expected:
            return False
        self._reject_stored(stored, "misplaced", f"stored at {stored.key}, but job {job_id!r} lives at {expected}")
        return True

    def _replayed(self, job: Job, accepted_at: datetime, records: Records) -> Optional[str]:
        """Why a stored one-shot can only be a replay, or None. A one-shot signed longer ago
        than mqtt.max_age_s, already due and without any run record never ran in its
        lifetime: re-put after retention removed it, it would run now (misfire recovery)."""
        if records or job.schedule.kind == "cron" or job.issued_at is None:
            return None
        now = utcnow()
        if (now - job.issued_at).total_seconds() <= self.max_age_s:
            return None
        due = sch.first_due(job, accepted_at)
        if due is None or due > now:
            return None
        return (f"issued_at: a one-shot signed at {rfc(job.issued_at)}, due at {rfc(due)}, with no run record, is "
                f"older than mqtt.max_age_s ({self.max_age_s:g} s): a replay is never run")

    def _reject_stored(self, stored: StoredJob, reason: str, detail: str) -> None:
        """A stored document that may not run: never installed; reported once per revision."""
        job_id = stored.id if isinstance(stored.id, str) else ""
        seen = (job_id, stored.key, stored.revision, reason)
        if seen in self._rejected_seen:
            return
        self._rejected_seen.remember(seen, None)
        REJECTED_STORED.labels(reason).inc()
        log.error("stored job refused: it is never run", extra={"fields": {
            "job": job_id, "shard": stored.shard, "reason": reason, "detail": detail}})
        self.audit.record("job", event="rejected_stored", job=job_id, shard=stored.shard, reason=reason,
                          detail=detail, revision=stored.revision)
        self.statuses.publish_status({
            "v": 1, "job_id": job_id, "run_id": None, "fire_id": None, "state": JobState.REJECTED, "attempt": None,
            "agent": self.agent_id, "shard": stored.shard, "ts": rfc(utcnow()), "exit_code": None,
            "reason": reason, "detail": f"stored job refused: {detail}", "usage": None, "source": "store"})

    # --- reload (agent/daemon/reload.py; the loop thread) ------------------------------------
    def keys_changed(self) -> None:
        """The key ring was replaced in place: each held job's signing key is looked up
        again, so a retirement (or a removed kid) is enforced now, as at load."""
        for e in list(self.entries.values()):
            key = self.keyring.get(e.job.kid or "")
            if key is None:
                self._drop(e.job.id, EndReason.KEY_RETIRED)
                self._reject_stored(e.stored, "unknown_kid", f"sig: key {e.job.kid} is no longer in the keys file")
                continue
            if key.retired_after != e.job.key_retired_after:
                e.job = replace(e.job, key_retired_after=key.retired_after)
                self._arm_retirement(e)

    def templates_changed(self, templates: dict) -> None:
        """Templates were swapped: a held job whose template is gone is rejected
        ``unknown_template`` (source store); a run of it that is live keeps its staged spec
        and ends first, the job is checked again then."""
        for e in list(self.entries.values()):
            if e.job.template in templates or not self.current(e):
                continue
            if any(f.state == FiringState.RUNNING for f in e.firings.values()):
                self.loop.call_later(TEMPLATE_RECHECK_S, self.templates_changed, templates)
                return
            self._drop(e.job.id, "unknown_template")
            self._reject_stored(e.stored, "unknown_template",
                                f"template: {e.job.template!r} is no longer configured on this agent")

    def _arm_retirement(self, e: JobEntry) -> None:
        if e.job.key_retired_after is None:
            return
        left = (e.job.key_retired_after - utcnow()).total_seconds()
        if left <= 0:
            self._retire(e)
            return
        self.loop.call_later(min(left, RETIRE_CHECK_MAX_S), self._check_retirement, e)

    def _check_retirement(self, e: JobEntry) -> None:
        if self.current(e):
            self._arm_retirement(e)

    def _retire(self, e: JobEntry) -> None:
        """The key that signed this job was retired: it stops here (runs included)."""
        if not self.current(e):
            return
        self._drop(e.job.id, EndReason.KEY_RETIRED)
        when = rfc(e.job.key_retired_after)
        self._reject_stored(e.stored, "key_retired", f"sig: key {e.job.kid} was retired at {when}")


def records_by_job(client: Any, prefix: str, revision: int) -> dict[str, Records]:
    """Run records under a shard's runs/ prefix, read in pages at `revision`:
    {job_id: {fire_id: (record, mod_revision)}}. Unparseable records are skipped."""
    by_job: dict[str, Records] = {}
    for kvs, _ in client.range_pages(prefix, revision=revision):
        for kv in kvs:
            try:
                job_id, fire_id = kv.key[len(prefix):].split("/", 1)
                rec = json.loads(kv.value)
            except ValueError:
                continue
            by_job.setdefault(job_id, {})[fire_id] = (rec, kv.mod_revision)
    return by_job


class _KeysOnly:
    """Client view whose prefix listing returns keys only (the jobs watch needs no values
    at start: each unit lists its own jobs when acquired)."""

    def __init__(self, client: Any):
        self._c = client

    def get_prefix(self, prefix: str, **kw: Any) -> Any:
        kw["keys_only"] = True
        return self._c.get_prefix(prefix, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._c, name)
