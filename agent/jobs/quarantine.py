"""Job quarantine: a job's own misbehaviour holds that job on this agent, never the agent.

A run killed for an exec outside its template's ``allow_exec`` (``exec_policy``), ended for
its stalled network (``network_stall``) or killed by its quota (``quota``: oom,
pids_limit) is a *strike* against its job. ``quarantine.strikes`` strikes within
``quarantine.window_s`` quarantine the job here: its later firings and retries wait
(status ``waiting``, reason ``quarantined``, a waiting mark for `jobs show`) until
``hold_s`` passes (doubling on each repeat, capped at ``max_hold_s``) or a new signed
version of the job (other signed content) arrives. After a quarantine one strike is
enough for the next, until a run of the job succeeds cleanly.

Before issue 54 these signals fed the lease policy, which handed every shard off: a job
that misbehaves on every agent took the cluster's scheduling down. The lease policy now
hears only about the agent itself (docs/health.md).

Invariants:
* the policy only ever *holds*: ``judge`` answers go or wait, never end, and a wake only
  asks the start gate again, which asks every policy; nothing here starts a run;
* the state is this agent's, in memory, on the loop thread (no locks); a restart forgets
  it and a failover leaves it behind (the next owner judges the job afresh);
* it is bounded: at most ``max_jobs`` entries (the oldest strike-only entry goes first,
  then the quarantine that ends soonest: an eviction releases, never holds longer), at
  most ``strikes`` strike times each, one timer per quarantined job, one entry per live
  run.

:class:`JobQuarantine` is the pure bookkeeping (time passed in); :class:`QuarantinePolicy`
the StartPolicy and RunListener around it (agent/jobs/startpolicy.py).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from agent.jobs.startpolicy import GO, Verdict, wait
from agent.jobs.states import EndReason
from agent.runtime.metrics import counter, gauge

if TYPE_CHECKING:
    from agent.config import QuarantineConfig
    from agent.jobs.document import Job
    from agent.jobs.firing import Firing
    from agent.jobs.seams import AuditSink
    from agent.runtime.loop import EventLoop

log = logging.getLogger(__name__)

REASON = "quarantined"   # the waiting status's reason (docs/contract.md)
CAUSES = ("exec_policy", "network_stall", "quota")
RELEASES = ("expired", "new_version", "evicted")
QUOTA_REASONS = frozenset({EndReason.OOM, EndReason.PIDS_LIMIT})
FACTOR = 2.0   # each repeat doubles the hold

STRIKES = counter("millwright_job_strikes_total", "Runs a job's own misbehaviour ended, by cause", ("cause",))
QUARANTINES = counter("millwright_job_quarantines_total", "Jobs quarantined on this agent, by cause", ("cause",))
RELEASED = counter("millwright_job_quarantine_releases_total", "Quarantines ended, by why", ("why",))
QUARANTINED = gauge("millwright_jobs_quarantined", "Jobs quarantined on this agent now")
for _c in CAUSES:
    STRIKES.labels(_c)
    QUARANTINES.labels(_c)
for _w in RELEASES:
    RELEASED.labels(_w)


def version_of(job: Job) -> str:
    """The identity of a job's signed content: a re-signed or re-approved copy of the same
    content is the same version; an etcd writer cannot make a new one without a key."""
    return hashlib.sha256(job.content or job.id.encode()).hexdigest()[:16]


@dataclass
class Entry:
    version: str
    strikes: collections.deque          # monotonic times of strikes (maxlen: the threshold)
    touched: float
    until: Optional[float] = None       # quarantined until (monotonic), None: not now
    since: Optional[float] = None
    cause: str = ""
    repeats: int = 0                    # quarantines since the last clean run (the back-off)
    evidence: dict = field(default_factory=dict)


class JobQuarantine:
    """Strikes and quarantines per job id (pure: ``now`` is passed in; loop thread)."""

    def __init__(self, *, strikes: int = 3, window_s: float = 300.0, hold_s: float = 300.0,
                 max_hold_s: float = 3600.0, max_jobs: int = 4096):
        if strikes < 1 or max_jobs < 1 or window_s <= 0 or hold_s <= 0 or max_hold_s < hold_s:
            raise ValueError("strikes, max_jobs >= 1; window_s, hold_s > 0; max_hold_s >= hold_s")
        self.threshold = strikes
        self.window_s = window_s
        self.hold_s = hold_s
        self.max_hold_s = max_hold_s
        self.max_jobs = max_jobs
        self.entries: dict[str, Entry] = {}
        self._held = 0

    @classmethod
    def from_config(cls, cfg: QuarantineConfig) -> "JobQuarantine":
        return cls(strikes=cfg.strikes, window_s=cfg.window_s, hold_s=cfg.hold_s, max_hold_s=cfg.max_hold_s,
                   max_jobs=cfg.max_jobs)

    # --- the bookkeeping -------------------------------------------------------------
    def _count(self) -> None:
        QUARANTINED.set(self._held)

    def _entry(self, job_id: str, version: str, now: float, released: list) -> Entry:
        e = self.entries.get(job_id)
        if e is not None and e.version != version:
            if e.until is not None:
                released.append(self._release(job_id, e, "new_version", now))
            e = None   # a new signed version starts clean: no strikes, no back-off
        if e is None:
            if len(self.entries) >= self.max_jobs:
                released.extend(self._evict(now))
            e = Entry(version, collections.deque(maxlen=self.threshold), now)
            self.entries[job_id] = e
        e.touched = now
        return e

    def _evict(self, now: float) -> list:
        """Room for one entry: the least recently touched entry not held, else the hold
        that ends soonest (released: the bound never holds a job longer)."""
        free = [(e.touched, j) for j, e in self.entries.items() if e.until is None]
        if free:
            del self.entries[min(free)[1]]
            return []
        job_id = min(self.entries, key=lambda j: self.entries[j].until or 0.0)
        rel = self._release(job_id, self.entries[job_id], "evicted", now)
        del self.entries[job_id]
        return [rel]

    def _release(self, job_id: str, e: Entry, why: str, now: float) -> dict:
        held_s = round(now - e.since, 3) if e.since is not None else None
        e.until, e.since = None, None
        e.strikes.clear()
        self._held -= 1
        self._count()
        RELEASED.labels(why).inc()
        return {"job": job_id, "why": why, "held_s": held_s, "cause": e.cause, "repeats": e.repeats}

    def strike(self, job_id: str, version: str, cause: str, now: float,
               evidence: Optional[dict] = None) -> tuple[Optional[dict], list]:
        """A run of the job ended by its own misbehaviour. Returns (the quarantine it
        started, or None; releases it caused: a new version's, an eviction's)."""
        if cause not in CAUSES:
            raise ValueError(f"unknown strike cause {cause!r}")
        released: list = []
        e = self._entry(job_id, version, now, released)
        STRIKES.labels(cause).inc()
        if e.until is not None and now >= e.until:   # its timer is late: the hold is over all the same
            released.append(self._release(job_id, e, "expired", now))
        if e.until is not None:
            return None, released   # already held (a run that started before): nothing more
        e.strikes.append(now)
        recent = [t for t in e.strikes if t > now - self.window_s]
        need = 1 if e.repeats > 0 else self.threshold
        if len(recent) < need:
            return None, released
        hold = min(self.max_hold_s, self.hold_s * FACTOR ** e.repeats)
        e.repeats += 1
        e.until, e.since, e.cause = now + hold, now, cause
        e.evidence = dict(evidence or {})
        self._held += 1
        self._count()
        QUARANTINES.labels(cause).inc()
        return {"job": job_id, "cause": cause, "strikes": len(recent), "window_s": self.window_s,
                "hold_s": round(hold, 3), "repeats": e.repeats, "version": version,
                "evidence": dict(e.evidence)}, released

    def clean(self, job_id: str, version: str) -> None:
        """A run of the job succeeded with no offence: its strikes and back-off go (a
        quarantine in force stays: it is a bound in time)."""
        e = self.entries.get(job_id)
        if e is None or e.version != version or e.until is not None:
            return
        del self.entries[job_id]

    def held(self, job_id: str, version: str, now: float) -> tuple[Optional[Entry], Optional[dict]]:
        """(the job's quarantine in force, or None; the release this look caused, if any)."""
        e = self.entries.get(job_id)
        if e is None or e.until is None:
            return None, None
        if e.version != version:
            rel = self._release(job_id, e, "new_version", now)
            del self.entries[job_id]
            return None, rel
        if now >= e.until:
            return None, self._release(job_id, e, "expired", now)
        return e, None

    def expire(self, job_id: str, now: float) -> Optional[dict]:
        """The job's hold may have run out (its timer): the release, or None."""
        e = self.entries.get(job_id)
        if e is None or e.until is None or now < e.until:
            return None
        return self._release(job_id, e, "expired", now)

    def status(self, now: float) -> dict:
        held = {j: {"cause": e.cause, "remaining_s": round(max(0.0, (e.until or now) - now), 3),
                    "repeats": e.repeats}
                for j, e in self.entries.items() if e.until is not None}
        return {"quarantined": len(held), "tracked": len(self.entries), "jobs": dict(sorted(held.items())[:32])}


def strike_cause(f: Firing, flagged: Optional[str]) -> Optional[str]:
    """The cause a run's end is a strike for, or None: a flagged exec kill (even if the
    run exited first), a quota kill, a stalled network."""
    reason = f.end_reason or ""
    if flagged == "exec_policy" or reason == EndReason.EXEC_POLICY:
        return "exec_policy"
    if reason in QUOTA_REASONS:
        return "quota"
    if reason == EndReason.NETWORK_STALL or f.health == "stalled":
        return "network_stall"
    return None


class QuarantinePolicy:
    """StartPolicy (holds a quarantined job's firings) and RunListener (counts strikes at
    each run's end) of the job quarantine; the supervision's JobOffences (an exec kill is
    flagged the moment it is decided). Loop thread."""

    name = "quarantine"

    def __init__(self, cfg: QuarantineConfig, loop: EventLoop, audit: AuditSink,
                 clock: Callable[[], float] = time.monotonic):
        self.q = JobQuarantine.from_config(cfg)
        self.loop = loop
        self.audit = audit
        self.clock = clock
        self.live: dict[str, Optional[str]] = {}                 # firing key -> flagged cause (live runs)
        self.waiters: dict[str, dict[str, Callable[[], None]]] = {}   # job id -> firing key -> wake
        self.timers: dict[str, Any] = {}                          # job id -> its hold's end

    # --- JobOffences ---------------------------------------------------------------------
    def offence(self, f: Firing, cause: str) -> None:
        if f.key in self.live and self.live[f.key] is None:
            self.live[f.key] = cause

    # --- RunListener ---------------------------------------------------------------------
    def run_started(self, f: Firing) -> None:
        self.live[f.key] = None

    def run_ended(self, f: Firing) -> None:
        flagged = self.live.pop(f.key, None)
        job = f.entry.job
        version = version_of(job)
        cause = strike_cause(f, flagged)
        if cause is None:
            if f.end_reason == EndReason.SUCCEEDED and f.health == "healthy":
                self.q.clean(job.id, version)
            return
        now = self.clock()
        started, released = self.q.strike(job.id, version, cause, now,
                                          {"fire_id": f.fire_id, "attempt": f.attempt, "reason": f.end_reason})
        for rel in released:
            self._released(rel)
        if started is None:
            return
        log.warning("job quarantined on this agent", extra={"fields": {"job": job.id, "cause": cause,
                                                                        "hold_s": started["hold_s"]}})
        self.audit.record("quarantine", event="quarantined", **started)
        self._arm(job.id, started["hold_s"])

    # --- StartPolicy ---------------------------------------------------------------------
    def judge(self, f: Firing) -> Verdict:
        job = f.entry.job
        now = self.clock()
        e, rel = self.q.held(job.id, version_of(job), now)
        if rel is not None:
            self._released(rel)
        if e is None:
            return GO
        left = max(0.0, (e.until or now) - now)
        return wait(REASON, f"the job is quarantined on this agent ({e.cause}, {e.repeats}x) for {left:.0f} s more, "
                            "or until a new signed version of it arrives")

    def subscribe(self, f: Firing, wake: Callable[[], None]) -> Callable[[], None]:
        job_id, key = f.entry.job.id, f.key
        self.waiters.setdefault(job_id, {})[key] = wake

        def cancel() -> None:
            w = self.waiters.get(job_id)
            if w is not None and w.pop(key, None) is not None and not w:
                del self.waiters[job_id]

        return cancel

    # --- holds' ends ---------------------------------------------------------------------
    def _arm(self, job_id: str, hold_s: float) -> None:
        old = self.timers.pop(job_id, None)
        if old is not None:
            old.cancel()
        self.timers[job_id] = self.loop.call_later(hold_s, self._expire, job_id)

    def _expire(self, job_id: str) -> None:
        self.timers.pop(job_id, None)
        rel = self.q.expire(job_id, self.clock())
        if rel is not None:
            self._released(rel)
        else:
            e = self.q.entries.get(job_id)
            if e is not None and e.until is not None:   # woken a hair early: again at its end
                self._arm(job_id, max(0.0, e.until - self.clock()))

    def _released(self, rel: dict) -> None:
        job_id = rel["job"]
        timer = self.timers.pop(job_id, None)
        if timer is not None:
            timer.cancel()
        log.info("job quarantine ended", extra={"fields": {"job": job_id, "why": rel["why"]}})
        self.audit.record("quarantine", event="released", **rel)
        for wake in list(self.waiters.get(job_id, {}).values()):
            # posted: a release found inside judge() must not re-enter the start gate; the
            # wake asks the gate again (every policy): a release never starts a run itself
            self.loop.post(wake)

    def status(self) -> dict:
        return self.q.status(self.clock())
