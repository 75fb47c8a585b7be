"""Staged fleet rollouts, enforced by the edge cluster through etcd: the StartPolicy that
holds each agent's firing of a fan-out job until its rollout lets it start, and the
RunListener that stops runs when the rollout is aborted (``abort_action: stop``).

What may happen is decided by agent/jobs/rollout.py (pure) from the job's rollout keys,
which every agent that takes part reads once and then follows with one watch on
``rollouts/`` (every agent's keys). This agent writes only its own keys,
``rollouts/<me>/<shard>/<job>/``: a firing first puts its claim (bound to this agent's
session lease, so a dead agent's place frees itself), then, once the watch shows the state
at or after the claim's revision, starts when that state allows it (with a claim, after
writing its start key in a fenced transaction that compares the claim). A firing's outcome
is written with its final run record, in the same transaction (RunRecords asks
``final_ops``), together with the release of its claim.

Once a job is aborted, its waiting firings end ``aborted`` (a retry after a run: ``failed``),
its running runs finish or are stopped, and each agent whose run of the aborted firing
ended runs the template's ``rollback`` once, as a firing of its own
(``<due>+rollback@<agent>``, claimed like any run: exactly once).

Everything here runs on the loop thread; etcd calls go through the workers.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from agent.coordination.etcd import Create, Delete, EtcdError, EtcdUnavailable, Get, Put, Txn, Version
from agent.coordination.fencing import StaleToken, fenced_txn
from agent.coordination.watch import OnDemandWatch, PrefixWatch, WatchEvent
from agent.jobs import bounded
from agent.jobs import rollout as ro
from agent.jobs.firing import Firing, FiringState
from agent.jobs.metrics import ROLLOUT_DECISIONS
from agent.jobs.startpolicy import GO, Verdict, end, wait
from agent.jobs.states import EndReason, RecordState
from agent.jobs.statuses import Statuses
from agent.runtime.timefmt import format_rfc3339, utcnow

if TYPE_CHECKING:
    from agent.config import Config
    from agent.coordination.keys import Keys
    from agent.coordination.worker import EtcdWorkers
    from agent.jobs.catalog import JobEntry, Records
    from agent.jobs.seams import AuditSink, Fencing, Lease, StatusSink
    from agent.runtime.loop import EventLoop

log = logging.getLogger(__name__)

REASON = "rollout"
# a claim or start in flight, or the watch catching up with it: a moment, no status nor
# waiting mark (its own reason, so a real wait after it is still reported)
STARTING = wait("rollout_starting", "starting", quiet=True)
RETRY_S = 0.3               # a read or start etcd did not answer is made again after this
RELEASE_CHECK_S = 10.0      # a claim whose release rode on the final record is checked after this
SWEEP_S = 30.0              # trackers of jobs no longer held here are dropped this often
MARK_AUDIT_BYTES = 2048     # of an abort mark (read from etcd) in an audit record at most
WATCH_IDLE_S = 60.0         # the watch stops this long after the last tracker went


@dataclass
class Grant:
    """This agent's claim for one firing: its key and create revision."""

    key: Optional[str]
    create_revision: int
    in_final: bool = False      # its release rides on the firing's final record
    started: bool = False       # its start key is written: the firing may go


@dataclass
class _Tracker:
    """One job's rollout as this agent follows it."""

    entry: JobEntry
    shard: int                                   # storage shard (the keys' NNNN)
    data: ro.JobRollout = field(default_factory=ro.JobRollout)
    rev: int = 0                                 # the revision data reflects (0: not read yet)
    reading: bool = False
    waiters: dict[str, tuple[Firing, Callable[[], None]]] = field(default_factory=dict)
    timers: dict[str, Any] = field(default_factory=dict)
    wake_at: dict[str, float] = field(default_factory=dict)      # firing key -> when to judge it again
    grants: dict[str, Grant] = field(default_factory=dict)       # fire id -> claim held
    acquiring: set = field(default_factory=set)                  # fire ids with a claim or start in flight
    running: dict[str, Firing] = field(default_factory=dict)     # fire id -> run (abort_action: stop)
    ending: dict[str, float] = field(default_factory=dict)   # base -> since: our outcome is on its way
    rollback_due: set = field(default_factory=set)   # bases whose run here ended: rolled back if aborted there
    told: set = field(default_factory=set)       # (fire id, decision) audited already
    marking: bool = False

    def idle(self) -> bool:
        return not (self.waiters or self.grants or self.acquiring or self.running or self.ending
                    or self.rollback_due or self.marking)


class RolloutGate:
    """Implements StartPolicy (agent/jobs/startpolicy.py), RunListener (agent/jobs/firing.py)
    and the pipeline's final-record and firing-done hooks."""

    name = "rollout"

    def __init__(self, cfg: Config, client: Any, keys: Keys, loop: EventLoop, workers: EtcdWorkers, *,
                 fencing: Fencing, lease: Lease, audit: AuditSink, sink: StatusSink,
                 is_current: Callable[[JobEntry], bool], adopt: Callable[[Firing], None] = lambda f: None):
        self.me = cfg.agent_id
        self.shards = cfg.shards
        self.templates = cfg.templates
        self.client = client
        self.keys = keys
        self.loop = loop
        self.workers = workers
        self.fencing = fencing
        self.lease = lease
        self.audit = audit
        self.statuses = Statuses(sink, keys, cfg.agent_id, cfg.shards)
        self.is_current = is_current
        self.clock: Callable[[], float] = time.time
        self.adopt = adopt   # the scheduler's: run a firing it did not make (a rollback)
        self.trackers: dict[str, _Tracker] = {}
        self.watch = OnDemandWatch(self.loop.call_later, self._start_watch, lambda: bool(self.trackers),
                                   WATCH_IDLE_S)
        self._sweep_timer: Any = None

    # --- StartPolicy ------------------------------------------------------------------------
    def judge(self, f: Firing) -> Verdict:
        spec = f.entry.job.rollout
        if spec is None or f.rollback:
            return GO
        tr = self._track(f.entry)
        if not tr.rev:
            return wait(REASON, "reading the rollout's state")
        base = ro.base_of(f.fire_id)
        fr = tr.data.firing(base)
        g = tr.grants.get(f.fire_id)
        if g is not None and tr.rev < g.create_revision:
            return STARTING   # the watch shows the claim next: judged at or after it
        if g is not None and not g.started and self.me not in fr.claims:
            tr.grants.pop(f.fire_id, None)    # (its claim went: its lease ended) claimed again
            g = None
        d = ro.decide(spec, tr.data, fr, self.me, g.create_revision if g is not None else 0, self.clock())
        if d.kind == "abort":
            self._mark(tr, base, d.detail)
        if d.kind in ("abort", "aborted"):
            return self._refused(tr, f, d.detail)
        if d.kind == "go" and (not d.start or (g is not None and g.started)):
            self._tell(tr, f, "start", claim=g.create_revision if g is not None else None,
                       **ro.tally(spec, fr).to_dict())
            return GO
        tr.wake_at.pop(f.key, None)
        if d.kind == "wait":
            self._tell(tr, f, "wait", detail=d.detail)
            if d.until is not None:
                tr.wake_at[f.key] = d.until
            return wait(REASON, d.detail)
        if f.fire_id not in tr.acquiring:
            if d.kind == "claim":
                self._claim(tr, f)
            elif g is not None:
                self._start(tr, f, g)
        return STARTING

    def subscribe(self, f: Firing, wake: Callable[[], None]) -> Callable[[], None]:
        tr = self.trackers.get(f.entry.job.id)
        if tr is None:   # (judge made it; a tracker dropped since has nothing to wake it for)
            return lambda: None
        tr.waiters[f.key] = (f, wake)
        at = tr.wake_at.get(f.key)
        if at is not None:   # the rate's next start
            tr.timers[f.key] = self.loop.call_later(max(0.0, at - self.clock()), self._wake_one, tr, f.key)

        def cancel() -> None:
            tr.waiters.pop(f.key, None)
            t = tr.timers.pop(f.key, None)
            if t is not None:
                t.cancel()
        return cancel

    def _refused(self, tr: _Tracker, f: Firing, detail: str) -> Verdict:
        self._tell(tr, f, "aborted", detail=detail)
        ran = f.state == FiringState.RETRYING or bool(f.claim.rev)
        return end(RecordState.FAILED if ran else RecordState.ABORTED, "rollout_aborted", detail)

    def _tell(self, tr: _Tracker, f: Firing, decision: str, **fields: Any) -> None:
        """Audit a decision about a firing, once per firing and kind."""
        if (f.fire_id, decision) in tr.told:
            return
        tr.told.add((f.fire_id, decision))
        ROLLOUT_DECISIONS.labels(decision).inc()
        self.audit.record("job", event=f"rollout_{decision}", job=f.entry.job.id, fire_id=f.fire_id, **fields)

    # --- the pipeline's hooks ---------------------------------------------------------------
    def final_ops(self, f: Firing, state: str) -> list:
        """What goes into the firing's final record transaction: its outcome (created once),
        and the release of its claim."""
        spec = f.entry.job.rollout
        if spec is None or f.rollback:
            return []
        e, base = f.entry, ro.base_of(f.fire_id)
        prefix = self.keys.rollout_firing(self.me, e.shard % self.shards, e.job.id, base)
        now = self.clock()
        outcome = prefix + ro.OUTCOME
        doc = json.dumps({"agent": self.me, "fire_id": f.fire_id, "state": str(state), "attempt": f.attempt,
                          "at": now})
        ops: list = [Txn([Version(outcome) == 0], [Put(outcome, doc)], [])]
        tr = self._track(e)
        if state in ro.RUN_STATES:
            if self._rollback_template(e) is not None:
                tr.rollback_due.add(base)
        tr.ending[base] = now
        g = tr.grants.get(f.fire_id)
        if g is not None and g.key:
            g.in_final = True
            ops.append(Txn([Create(g.key) == g.create_revision], [Delete(g.key)], []))
        return ops

    def done(self, f: Firing) -> None:
        """The firing is DONE (recorded, abandoned or handed over): its claim goes (at
        once when no final record carries its release)."""
        tr = self.trackers.get(f.entry.job.id)
        if tr is None:
            return
        tr.running.pop(f.fire_id, None)
        tr.wake_at.pop(f.key, None)
        g = tr.grants.get(f.fire_id)
        if g is not None and not g.in_final:
            self._release(tr, f.fire_id)
        elif g is not None:
            self.loop.call_later(RELEASE_CHECK_S, self._release_late, tr, f)
        self._maybe_drop(tr)

    def installed(self, e: JobEntry, records: Records) -> None:
        """A job (re)installed here: the runs of this agent that ended before it came back
        are rolled back if their rollout is (or gets) aborted."""
        if e.job.rollout is None or self._rollback_template(e) is None:
            return
        mine = "@" + self.me
        ours = [fid for fid in records if fid.endswith(mine)]
        undone = {ro.rolled_back(fid) for fid in ours} - {None}
        due = {ro.base_of(fid) for fid in ours if ro.rolled_back(fid) is None
               and isinstance(records[fid][0], dict) and records[fid][0].get("state") in ro.RUN_STATES}
        if due - undone:
            tr = self._track(e)
            tr.rollback_due |= due - undone

    # --- RunListener ------------------------------------------------------------------------
    def run_started(self, f: Firing) -> None:
        if f.entry.job.rollout is not None and not f.rollback:
            self._track(f.entry).running[f.fire_id] = f

    def run_ended(self, f: Firing) -> None:
        tr = self.trackers.get(f.entry.job.id)
        if tr is not None:
            tr.running.pop(f.fire_id, None)

    # --- trackers -----------------------------------------------------------------------------
    def _track(self, e: JobEntry) -> _Tracker:
        tr = self.trackers.get(e.job.id)
        if tr is None:
            shard = e.shard % self.shards
            tr = self.trackers[e.job.id] = _Tracker(e, shard)
            if self._sweep_timer is None:
                self._sweep_timer = self.loop.call_later(SWEEP_S, self._sweep)
        tr.entry = e
        if not tr.rev and not tr.reading:
            self._read(tr)
        return tr

    def _read(self, tr: _Tracker) -> None:
        tr.reading = True

        def done(result: Any, error: Optional[BaseException]) -> None:
            tr.reading = False
            if self.trackers.get(tr.entry.job.id) is not tr:
                return
            if error is not None:
                self.loop.call_later(RETRY_S, self._reread, tr)
                return
            kvs, rev = result
            self._replace(tr, kvs, rev)
            self.watch.need_from(rev + 1)
            self._changed(tr)

        # every agent's keys: one read of rollouts/ (bounded by retention: each agent keeps
        # its keys of a job's newest firings only), the job's picked out
        self.workers.submit(lambda: self.client.get_prefix(self.keys.rollouts_prefix()), done)

    def _reread(self, tr: _Tracker) -> None:
        if self.trackers.get(tr.entry.job.id) is tr and not tr.rev and not tr.reading:
            self._read(tr)

    def _replace(self, tr: _Tracker, kvs: list, rev: int) -> None:
        if rev < tr.rev:
            return
        tr.data = ro.JobRollout()
        for kv in kvs:
            where = self.keys.split_rollout_key(kv.key)
            if where is not None and where[1] == tr.shard and where[2] == tr.entry.job.id:
                tr.data.put(where[0], where[3], kv)
        tr.rev = rev

    def _maybe_drop(self, tr: _Tracker) -> None:
        if tr.idle() and self.trackers.get(tr.entry.job.id) is tr:
            for t in tr.timers.values():
                t.cancel()
            del self.trackers[tr.entry.job.id]
            self.watch.maybe_idle()

    def _sweep(self) -> None:
        """Trackers of jobs no longer installed here: their claims go. An outcome of ours
        not seen for a long while (its write's compare failed) is not waited for."""
        self._sweep_timer = None
        for tr in list(self.trackers.values()):
            tr.ending = {b: t for b, t in tr.ending.items() if self.clock() - t < SWEEP_S}
            if not self.is_current(tr.entry) and not tr.running:
                for fid in list(tr.grants):
                    self._release(tr, fid)
                tr.waiters.clear()
                tr.rollback_due.clear()
                tr.ending.clear()
            self._maybe_drop(tr)
        if self.trackers:
            self._sweep_timer = self.loop.call_later(SWEEP_S, self._sweep)

    # --- the watch on rollouts/ -------------------------------------------------------------
    def _start_watch(self, revision: int) -> PrefixWatch:
        post = self.loop.post
        return PrefixWatch(self.client, self.keys.rollouts_prefix(), "rollouts",
                           on_snapshot=lambda kvs, rev: post(self._snapshot, kvs, rev),
                           on_events=lambda evs, rev: post(self._events, evs),
                           start_revision=revision).start()

    def _events(self, events: list[WatchEvent]) -> None:
        """Watched changes, applied to the trackers whose state is older (the events of one
        revision, a transaction's, come in one batch and are applied together)."""
        changed: dict[str, tuple[_Tracker, int]] = {}
        for ev in events:
            where = self.keys.split_rollout_key(ev.kv.key)
            if where is None:
                continue
            agent, shard, job_id, rel = where
            tr = self.trackers.get(job_id)
            if tr is None or not tr.rev or shard != tr.shard:
                continue
            before = changed[job_id][1] if job_id in changed else tr.rev
            if ev.kv.mod_revision <= before:
                continue
            if ev.kind == "delete":
                tr.data.delete(agent, rel)
            else:
                tr.data.put(agent, rel, ev.kv)
            changed[job_id] = (tr, before)
            tr.rev = max(tr.rev, ev.kv.mod_revision)
        for tr, _ in changed.values():
            self._changed(tr)

    def _snapshot(self, kvs: list, rev: int) -> None:
        """The watch listed again (its revision was compacted): every tracker starts over."""
        for tr in list(self.trackers.values()):
            self._replace(tr, kvs, rev)
            self._changed(tr)

    def stop(self) -> None:
        self.watch.stop()

    # --- what a change means ------------------------------------------------------------------
    def _changed(self, tr: _Tracker) -> None:
        spec = tr.entry.job.rollout
        if spec is None:
            return
        mark = tr.data.aborted
        if mark is None:
            for base in list(tr.ending) + [ro.base_of(f.fire_id) for f in tr.running.values()]:
                fr = tr.data.firings.get(base)
                if fr is not None and ro.crossed(spec, ro.tally(spec, fr)):
                    t = ro.tally(spec, fr)
                    self._mark(tr, base, f"{t.failed} of {t.finished} finished runs failed (abort at "
                                         f"{spec.failed_pct:g} % after {spec.min_finished})")
        tr.ending = {b: t for b, t in tr.ending.items() if self.me not in tr.data.firing(b).outcomes}
        if mark is not None:
            self._aborted(tr, mark)
        for key in list(tr.waiters):
            self._wake_one(tr, key)
        self._maybe_drop(tr)

    def _wake_one(self, tr: _Tracker, key: str) -> None:
        tr.timers.pop(key, None)
        w = tr.waiters.get(key)
        if w is not None:
            w[1]()

    def _aborted(self, tr: _Tracker, mark: dict) -> None:
        """Stop runs (abort_action: stop) and roll back this agent's runs of the aborted firing."""
        spec = tr.entry.job.rollout
        if spec is not None and spec.abort_action == "stop":
            for f in list(tr.running.values()):
                if f.state == FiringState.RUNNING and f.handle is not None and (f.fire_id, "stop") not in tr.told:
                    self._tell(tr, f, "stop", mark=bounded.shrink(mark, MARK_AUDIT_BYTES)[0])   # from etcd: any size
                    f.handle.terminate(EndReason.ABORTED)
        where = mark.get("fire")
        for base in sorted(tr.rollback_due):
            if base in tr.ending:
                continue   # its outcome is still on its way
            tr.rollback_due.discard(base)
            if where in (None, base):
                self._rollback(tr, base)

    def _rollback(self, tr: _Tracker, base: str) -> None:
        e = tr.entry
        fid = ro.rollback_fire_id(base, self.me)
        if not self.is_current(e) or fid in e.firings or e.cancelled:
            return
        f = Firing(e, utcnow(), fid, rollback=True)
        ROLLOUT_DECISIONS.labels("rollback").inc()
        self.audit.record("job", event="rollout_rollback", job=e.job.id, fire_id=fid, of=f"{base}@{self.me}",
                          template=self._rollback_template(e))
        self.adopt(f)

    def _rollback_template(self, e: JobEntry) -> Optional[str]:
        t = self.templates.get(e.job.template)
        return t.rollback if t is not None else None

    # --- etcd -------------------------------------------------------------------------------
    def _claim(self, tr: _Tracker, f: Firing) -> None:
        """Put this agent's claim on the firing (bound to its session lease): its place in
        the queue is the claim's create revision. A claim of ours left by an earlier session
        is deleted first (a new place, behind those who came meanwhile)."""
        e, base = f.entry, ro.base_of(f.fire_id)
        fence, lease = self.fencing.fence_for(e.shard), self.lease.lease_id
        if fence is None or not lease:
            self.loop.call_later(RETRY_S, self._wake_one, tr, f.key)
            return
        key = self.keys.rollout_firing(self.me, tr.shard, e.job.id, base) + ro.CLAIM
        doc = json.dumps({"agent": self.me, "fire_id": f.fire_id, "at": self.clock()})
        tr.acquiring.add(f.fire_id)

        def done(r: Any, error: Optional[BaseException]) -> None:
            tr.acquiring.discard(f.fire_id)
            if error is not None:
                if not isinstance(error, (StaleToken, EtcdUnavailable, EtcdError)):
                    log.warning("rollout claim failed", extra={"fields": {"job": e.job.id, "error": str(error)}})
                self.loop.call_later(RETRY_S, self._wake_one, tr, f.key)
            elif r.succeeded:
                tr.grants[f.fire_id] = Grant(key, r.revision)
                if self.trackers.get(e.job.id) is not tr:   # (dropped meanwhile: the claim goes back)
                    self._release(tr, f.fire_id)
                self._wake_one(tr, f.key)
            else:
                old = (r.responses[0] if r.responses else []) or []
                if old and old[0].lease == lease:   # ours, from this session
                    tr.grants[f.fire_id] = Grant(key, old[0].create_revision)
                    self._wake_one(tr, f.key)
                elif old:
                    rev = old[0].create_revision

                    def deleted(_r: Any, _err: Optional[BaseException]) -> None:
                        self.loop.call_later(RETRY_S, self._wake_one, tr, f.key)
                    self.workers.submit(lambda: self.client.txn([Create(key) == rev], [Delete(key)], []), deleted)
                else:
                    self.loop.call_later(RETRY_S, self._wake_one, tr, f.key)
            self._maybe_drop(tr)

        self.workers.submit(lambda: fenced_txn(self.client, fence, compare=[Version(key) == 0],
                                               success=[Put(key, doc, lease=lease)], failure=[Get(key)]), done)

    def _start(self, tr: _Tracker, f: Firing, g: Grant) -> None:
        """Write this agent's start key (created once; fenced, and only while its claim
        holds): the firing goes, judged on the state at ``tr.rev``."""
        e, base = f.entry, ro.base_of(f.fire_id)
        fence = self.fencing.fence_for(e.shard)
        if fence is None or not g.key:
            self.loop.call_later(RETRY_S, self._wake_one, tr, f.key)
            return
        key = self.keys.rollout_firing(self.me, tr.shard, e.job.id, base) + ro.START
        doc = json.dumps({"agent": self.me, "fire_id": f.fire_id, "at": self.clock(), "judged_at": tr.rev})
        claim, rev = g.key, g.create_revision
        tr.acquiring.add(f.fire_id)

        def done(r: Any, error: Optional[BaseException]) -> None:
            tr.acquiring.discard(f.fire_id)
            if error is not None:
                if not isinstance(error, (StaleToken, EtcdUnavailable, EtcdError)):
                    log.warning("rollout start failed", extra={"fields": {"job": e.job.id, "error": str(error)}})
                self.loop.call_later(RETRY_S, self._wake_one, tr, f.key)
            elif r.succeeded:
                g.started = True
                self._wake_one(tr, f.key)
            else:   # the claim went, or a start of ours exists: judged again on what the watch shows
                ROLLOUT_DECISIONS.labels("conflict").inc()
                self.loop.call_later(RETRY_S, self._wake_one, tr, f.key)
            self._maybe_drop(tr)

        self.workers.submit(lambda: fenced_txn(self.client, fence, compare=[Create(claim) == rev, Version(key) == 0],
                                               success=[Put(key, doc)]), done)

    def _mark(self, tr: _Tracker, base: str, detail: str) -> None:
        """Write the job's abort mark (once: whoever is first); the writer reports it."""
        e, spec = tr.entry, tr.entry.job.rollout
        fence = self.fencing.fence_for(e.shard)
        if tr.marking or tr.data.aborted is not None or fence is None or spec is None:
            return
        tr.marking = True
        t = ro.tally(spec, tr.data.firing(base))
        mark = {"at": format_rfc3339(utcnow()), "by": self.me, "fire": base, "detail": detail, **t.to_dict()}
        key = self.keys.rollout_aborted(self.me, tr.shard, e.job.id)

        def done(r: Any, error: Optional[BaseException]) -> None:
            tr.marking = False
            if error is None and r.succeeded:
                ROLLOUT_DECISIONS.labels("abort").inc()
                log.warning("rollout aborted", extra={"fields": {"job": e.job.id, "fire": base, "detail": detail}})
                self.audit.record("job", event="rollout_abort", job=e.job.id, fire=base, detail=detail,
                                  **t.to_dict())
                self.statuses.send(e, None, RecordState.ABORTED, reason="rollout_aborted", detail=detail,
                                   rollout=t.to_dict())
            self._maybe_drop(tr)

        self.workers.submit(lambda: fenced_txn(self.client, fence, compare=[Version(key) == 0],
                                               success=[Put(key, json.dumps(mark))]), done)

    def _release(self, tr: _Tracker, fire_id: str) -> None:
        g = tr.grants.pop(fire_id, None)
        if g is None or not g.key:
            return
        key, rev = g.key, g.create_revision
        self.workers.submit(lambda: self.client.txn([Create(key) == rev], [Delete(key)], []),
                            lambda r, err: self._maybe_drop(tr))

    def _release_late(self, tr: _Tracker, f: Firing) -> None:
        """A claim whose release went with the final record: if that write did not land (its
        compare failed), the claim goes now, once no write of the record is in flight."""
        if f.fire_id not in tr.grants:
            return
        if f.claim.writing:
            self.loop.call_later(RELEASE_CHECK_S, self._release_late, tr, f)
            return
        self._release(tr, f.fire_id)
