"""A firing with ``depends_on`` starts only once every dependency's newest run succeeded.
Until then it waits (state `waiting`, reason `dependencies`), and is looked at again when a
dependency's newest record changes: one watch on latest/ while any firing waits (started
at the revision the firing's own read saw, so no change in between is missed), with a slow
safety look in case the watch was down.

Records are not signed, so a dependency's record satisfies it only where the dependency's
signed job allows it: the job is stored under its own key and verifies, the record is the
copy of a run record that exists (the same value at runs/…), names a firing on that job's
schedule, and was fenced (its fence older than its write). A record that does not is
reported in the waiting status (``not_believed``) and satisfies nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from agent.coordination.jobstore import public_doc
from agent.coordination.keys import Keys, shard_of
from agent.coordination.watch import OnDemandWatch, PrefixWatch, WatchEvent
from agent.jobs import schedule as sch
from agent.jobs.document import Job
from agent.jobs.envelope import JobRejected
from agent.jobs.firing import Firing, FiringState
from agent.jobs.metrics import FOREIGN_RECORDS
from agent.jobs.states import JobState, RecordState
from agent.runtime.timefmt import parse_rfc3339, utcnow

if TYPE_CHECKING:
    from agent.coordination.worker import EtcdWorkers
    from agent.jobs.catalog import JobEntry
    from agent.jobs.seams import AuditSink
    from agent.jobs.signing import KeyRing
    from agent.jobs.statuses import Statuses
    from agent.runtime.loop import EventLoop

SAFETY_RECHECK_S = 30.0    # a waiting firing looks again this often even without an event
WATCH_IDLE_S = 60.0        # the watch stops this long after the last firing stopped waiting


@dataclass(frozen=True)
class Standing:
    """Where one dependency stands: the state of its newest believed run, or why none is."""

    state: Optional[str]
    not_believed: Optional[str] = None

    @property
    def succeeded(self) -> bool:
        return self.state == RecordState.SUCCEEDED and self.not_believed is None


def read_standing(client: Any, keys: Keys, shards: int, keyring: KeyRing, cluster: str,
                  deps: list[str]) -> tuple[dict[str, Standing], int]:
    """{dependency: Standing} and the revision read at (blocking: a worker thread)."""
    out: dict[str, Standing] = {}
    revision = 0
    for dep in deps:
        s = shard_of(dep, shards)
        kvs, rev = client.get_prefix(keys.latest(s, dep))   # one key (and names it prefixes: skipped)
        revision = max(revision, rev)
        latest = next((kv for kv in kvs if kv.key == keys.latest(s, dep)), None)
        if latest is None:   # records written before latest/ existed: the last of its runs prefix
            latest = client.get_last(keys.runs_prefix(s, dep))
        out[dep] = Standing(None) if latest is None else _judge(client, keys, s, keyring, cluster, dep, latest)
    return out, revision


def _judge(client: Any, keys: Keys, shard: int, keyring: KeyRing, cluster: str, dep: str, latest: Any) -> Standing:
    try:
        rec = json.loads(latest.value)
    except ValueError:
        return Standing(None, "its newest record is not JSON")
    if not isinstance(rec, dict) or rec.get("job_id") != dep or not isinstance(rec.get("fire_id"), str):
        return Standing(None, "its newest record names another job")
    state = rec.get("state")
    fence = rec.get("fence")
    if type(fence) is not int or not 0 < fence <= latest.mod_revision:
        return Standing(state, "its newest record was not written under a fence")
    run = client.get(keys.run(shard, dep, rec["fire_id"]))
    if run is None or run.value != latest.value:
        return Standing(state, "its newest record is not the copy of a run record")
    stored = client.get(keys.job(shard, dep))
    if stored is None:
        return Standing(state, "no such job")
    try:
        doc = json.loads(stored.value)
        job = Job.from_stored(public_doc(doc), keyring=keyring, cluster=cluster, now=utcnow())
        accepted = parse_rfc3339((doc.get("_accepted") or {}).get("at") or rec.get("due"))
        due = sch.parse_fire_id(rec["fire_id"].split("@", 1)[0])
    except (ValueError, JobRejected) as exc:
        return Standing(state, f"its job does not verify: {exc}")
    if not sch.is_firing(job, due, accepted):
        return Standing(state, f"{rec['fire_id']} is not a firing of its schedule")
    return Standing(state)


@dataclass
class _Waiter:
    firing: Firing
    ready: Callable[[Firing], None]
    expired: Callable[[Firing], None]
    reading: bool = False       # a read is in flight
    again: bool = False         # an event came while it was: read once more
    timer: Any = None           # the safety look
    expiry: Any = None          # the job's not_after
    reported: set = field(default_factory=set)   # dependencies whose records were reported not believed


class DependencyCheck:
    """Owns the firings waiting for their dependencies (loop thread)."""

    def __init__(self, client: Any, keys: Keys, shards: int, loop: EventLoop, workers: EtcdWorkers,
                 statuses: Statuses, is_current: Callable[[JobEntry], bool], keyring: KeyRing, cluster: str,
                 audit: AuditSink):
        self.client = client
        self.keys = keys
        self.shards = shards
        self.loop = loop
        self.workers = workers
        self.statuses = statuses
        self.is_current = is_current
        self.keyring = keyring
        self.cluster = cluster
        self.audit = audit
        self.waiting: dict[str, _Waiter] = {}        # firing key -> waiter
        self.by_dep: dict[str, set[str]] = {}        # dependency job id -> firing keys
        self.watch = OnDemandWatch(self.loop.call_later, self._start_watch, lambda: bool(self.waiting),
                                   WATCH_IDLE_S)

    def check(self, f: Firing, ready: Callable[[Firing], None], expired: Callable[[Firing], None]) -> None:
        """``ready(f)`` once every dependency succeeded, ``expired(f)`` if the job expires
        first (its not_after); until then the firing waits."""
        w = self.waiting[f.key] = _Waiter(f, ready, expired)
        for dep in f.entry.job.depends_on:
            self.by_dep.setdefault(dep, set()).add(f.key)
        na = f.entry.job.not_after
        if na is not None:
            w.expiry = self.loop.call_later(max(0.0, (na - utcnow()).total_seconds()), self._look, f.key)
        self._read(f.key)

    def _read(self, key: str) -> None:
        w = self.waiting.get(key)
        if w is None:
            return
        if w.reading:
            w.again = True
            return
        w.reading, w.again = True, False
        deps = list(w.firing.entry.job.depends_on)
        self.workers.submit(lambda: read_standing(self.client, self.keys, self.shards, self.keyring, self.cluster,
                                                  deps), lambda r, err: self._done(key, r, err))

    def _done(self, key: str, result: Any, error: Optional[BaseException]) -> None:
        w = self.waiting.get(key)
        if w is None:
            return
        w.reading = False
        f = w.firing
        if f.state == FiringState.DONE or not self.is_current(f.entry):
            self.forget(f)
            return
        standing, revision = result if error is None else ({}, 0)
        if error is None and all(st.succeeded for st in standing.values()):
            self.forget(f)
            w.ready(f)
            return
        if sch.is_expired(f.entry.job, utcnow()):
            self.forget(f)
            w.expired(f)
            return
        doubts = {k: st.not_believed for k, st in standing.items() if st.not_believed}
        new = sorted(set(doubts) - w.reported)
        for dep in new:
            FOREIGN_RECORDS.labels("dependency").inc()
            self.audit.record("job", event="foreign_record", job=f.entry.job.id, fire_id=f.fire_id, where="dependency",
                              dependency=dep, why=doubts[dep])
        w.reported.update(new)
        if f.wait_reason != "dependencies" or new:
            f.move(FiringState.WAITING, wait_reason="dependencies")
            pending = sorted(k for k, st in standing.items() if not st.succeeded)
            self.statuses.send(f.entry, f, JobState.WAITING, reason="dependencies", waiting_for=pending,
                               **({"not_believed": doubts} if doubts else {}))
        if revision:
            self.watch.need_from(revision + 1)
        if w.again:
            self._read(key)
        elif w.timer is None:
            w.timer = self.loop.call_later(SAFETY_RECHECK_S, self._safety, key)

    def _safety(self, key: str) -> None:
        w = self.waiting.get(key)
        if w is not None:
            w.timer = None
            self._read(key)

    def _look(self, key: str) -> None:
        self._read(key)

    def forget(self, f: Firing) -> None:
        """The firing no longer waits (it starts, expired, or ended otherwise)."""
        w = self.waiting.pop(f.key, None)
        if w is None:
            return
        for t in (w.timer, w.expiry):
            if t is not None:
                t.cancel()
        for dep in f.entry.job.depends_on:
            keys = self.by_dep.get(dep)
            if keys is not None:
                keys.discard(f.key)
                if not keys:
                    del self.by_dep[dep]
        self.watch.maybe_idle()

    # --- the watch on latest/ ----------------------------------------------------------
    def _start_watch(self, revision: int) -> PrefixWatch:
        post = self.loop.post
        return PrefixWatch(self.client, self.keys.latest_prefix(), "dependencies",
                           on_snapshot=lambda kvs, rev: post(self._changed_all),
                           on_events=lambda evs, rev: post(self._changed, evs),
                           start_revision=revision, puts_only=True).start()

    def _changed(self, events: list[WatchEvent]) -> None:
        for ev in events:
            for key in list(self.by_dep.get(ev.kv.key.rsplit("/", 1)[-1], ())):
                self._read(key)

    def _changed_all(self) -> None:
        """The watch listed again (its revision was compacted): anything may have changed."""
        for key in list(self.waiting):
            self._read(key)

    def stop(self) -> None:
        self.watch.stop()
