"""Retention: what a gateway deletes so that months of operation stay bounded.

Without it, run records and finished jobs stay in etcd for ever (a shard's records
outgrow gRPC's 4 MiB response and etcd's space quota) and every run leaves its output
directory on disk. The shard owner trims its own shards in the background:

- run records beyond ``retention.keep_runs`` per job (newest by fire_id kept);
- jobs that can never fire again (one-shot done, cancelled, expired) once
  ``retention.finished_job_s`` has passed: the job becomes a *finished tombstone*
  (jobstore.finished_tombstone, ~300 bytes, so a redelivered push is answered as before)
  and its run records and latest/ copy go; tombstones go after ``retention.tombstone_s``;
- run directories on disk older than ``retention.run_output_s``, beyond ``keep_runs`` per
  job, or beyond the ``retention.run_output_max_mb`` budget (oldest first);
- a job's rollout keys (rollouts/<agent>/<shard>/<job>/, agent/jobs/rollouts.py) once it is
  gone or a tombstone; of a live job, those of firings older than its newest
  ``ROLLOUT_FIRINGS_KEPT`` (not its abort mark, nor a claim still held: it goes with its
  holder's lease). Each agent deletes only its own (etcd RBAC lets it write nothing else),
  in every shard, whoever owns it (``run_own_rollouts``). An aborted job can never fire
  again: it finishes from any agent's abort mark.

Never deleted: a job's newest record (misfire recovery, depends_on), any record not in a
terminal state (running, retrying: the scheduler still needs it), the directory of a run
that is still going. Every etcd delete is a fenced transaction that also compares each
key's mod revision, so nothing changed since it was read is removed, and an agent that
lost the shard deletes nothing. Work runs on its own thread (never the run-record
writers), one shard per tick, at most ``retention.max_deletes_per_s``. Each pass that
deleted something leaves one summary audit record (type ``retention``), not one per key.

``plan_shard`` is the pure decision (unit-tested); ``Retention`` applies it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable, Optional

from agent.coordination import placement
from agent.coordination.etcd import Delete, Mod, Put
from agent.coordination.fencing import Fence, StaleToken, fenced_txn
from agent.coordination.jobstore import finished_tombstone
from agent.coordination.worker import EtcdWorkers
from agent.jobs import schedule as sch
from agent.runtime.metrics import counter

if TYPE_CHECKING:
    from agent.config import Config
    from agent.coordination.etcd import EtcdClient
    from agent.coordination.keys import Keys
    from agent.execute.executor import Executor
    from agent.jobs.catalog import JobCatalog
    from agent.jobs.seams import AuditSink, Fencing
    from agent.runtime.loop import EventLoop, Timer

log = logging.getLogger(__name__)

DELETED = counter("millwright_retention_deleted_total", "Keys and run directories removed by retention", ("kind",))
PASSES = counter("millwright_retention_passes_total", "Retention passes by result", ("result",))

TERMINAL = ("succeeded", "failed", "timed_out", "killed", "cancelled", "misfired", "aborted")
OWN_ROLLOUTS_TICKS = 4   # this agent's own rollout keys, in every shard: once per this many ticks
BATCH_OPS = 64  # deletes per transaction (etcd refuses more than --max-txn-ops, 128 by default)
ROLLOUT_FIRINGS_KEPT = 3   # a live job keeps the rollout keys of this many of its newest firings


@dataclass
class Plan:
    """What one pass over a shard removes. Each item carries the mod revision it was read at."""

    finish: list = field(default_factory=list)      # (job_key, mod_rev, tombstone dict, latest_key, reason)
    tombstones: list = field(default_factory=list)  # (job_key, mod_rev)
    runs: list = field(default_factory=list)        # (run_key, mod_rev)
    latest: list = field(default_factory=list)      # (latest_key, mod_rev) of jobs that are gone
    rollouts: list = field(default_factory=list)    # (rollout key, mod_rev)

    def empty(self) -> bool:
        return not (self.finish or self.tombstones or self.runs or self.latest or self.rollouts)


def _ts(text: Any) -> Optional[float]:
    try:
        return sch.parse_rfc3339(text).timestamp() if text else None
    except Exception:
        return None


def _terminal(raw: bytes) -> bool:
    try:
        return json.loads(raw).get("state") in TERMINAL
    except (ValueError, AttributeError):
        return True  # unreadable: nothing can resume it


def finished_since(doc: dict, latest: Optional[dict], all_terminal: bool,
                   now: Optional[float] = None) -> Optional[tuple[float, str]]:
    """When (epoch s) and why a stored job can never fire again, or None while it still can.

    Cancelled: from the cancel; expired (not_after passed): from not_after; a one-shot
    (no cron) whose newest record is terminal: from that record's end, if that record
    could be its run's (it names the job, a firing already due, and an end not in the
    future: records are not signed, and a forged one must not finish a job). A job with a
    record still running or retrying is never finished."""
    if not all_terminal:
        return None
    if "_cancelled" in doc:
        return (_ts(doc["_cancelled"].get("at")) or 0.0), "cancelled"
    schedule = doc.get("schedule") or {}
    one_shot = "cron" not in schedule
    if one_shot and latest is not None and latest.get("state") in TERMINAL and _ran(doc, latest, now):
        return _ts(latest.get("ended_at")) or 0.0, "done"
    not_after = _ts(doc.get("not_after"))
    if not_after is not None:
        return not_after, "expired"
    return None


def _ran(doc: dict, rec: dict, now: Optional[float]) -> bool:
    """Could ``rec`` be the end of a run of the job stored as ``doc``?"""
    ended = _ts(rec.get("ended_at"))
    try:
        due = sch.parse_fire_id(str(rec.get("fire_id", "")).split("@", 1)[0]).timestamp()
    except Exception:
        return False
    return (rec.get("job_id") == doc.get("id") and ended is not None
            and (now is None or (due <= now and ended <= now)))


def plan_shard(jobs: dict[str, tuple[dict, str, int]], runs: dict[str, list[tuple[str, str, bytes, int]]],
               latest: dict[str, tuple[str, int]], now: float, keep_runs: int, finished_job_s: float,
               tombstone_s: float, rollouts: Optional[dict[str, list[tuple[str, str, bytes, int]]]] = None) -> Plan:
    """Decide what to delete in one shard.

    jobs: job_id -> (stored doc, job key, mod_rev); runs: job_id -> [(fire_id, key, value,
    mod_rev)] sorted by fire_id; latest: job_id -> (latest key, mod_rev); rollouts: job_id ->
    [(name under the job's rollout prefix, key, value, mod_rev)]."""
    rollouts = rollouts or {}
    plan = Plan()
    gone: set[str] = set()  # jobs whose records may all go (missing, tombstoned or finishing now)
    for job_id, (doc, key, rev) in jobs.items():
        if doc.get("_tombstone"):
            gone.add(job_id)
            at = _ts((doc.get("_finished") or {}).get("at")) or _ts((doc.get("_cancelled") or {}).get("at"))
            if at is not None and now - at > tombstone_s:
                plan.tombstones.append((key, rev))
            continue
        records = runs.get(job_id, [])
        newest = None
        if records:
            try:
                newest = json.loads(records[-1][2])
            except ValueError:
                newest = None
        all_terminal = all(_terminal(value) for _, _, value, _ in records)
        fin = finished_since(doc, newest, all_terminal, now) or _aborted_since(rollouts.get(job_id, []), all_terminal)
        if fin is not None and now - fin[0] > finished_job_s:
            tomb = finished_tombstone(doc, sch.format_rfc3339(datetime.fromtimestamp(now, timezone.utc)), fin[1])
            plan.finish.append((key, rev, tomb, latest.get(job_id, (None, 0))[0], fin[1]))
            gone.add(job_id)
    for job_id, records in runs.items():
        if job_id in gone or job_id not in jobs:
            plan.runs.extend((key, rev) for _, key, value, rev in records
                             if job_id in gone or _terminal(value))
            continue
        # newest keep_runs stay (the newest of all among them); older terminal ones go
        for _, key, value, rev in records[:max(0, len(records) - keep_runs)]:
            if _terminal(value):
                plan.runs.append((key, rev))
    for job_id, (key, rev) in latest.items():
        if job_id not in jobs or jobs[job_id][0].get("_tombstone"):
            plan.latest.append((key, rev))
    for job_id, items in rollouts.items():
        if job_id in gone or job_id not in jobs:
            plan.rollouts.extend((key, rev) for _, key, _, rev in items)
            continue
        firings = sorted({name.split("/", 1)[0] for name, _, _, _ in items if "/" in name})
        old = set(firings[:max(0, len(firings) - ROLLOUT_FIRINGS_KEPT)])
        plan.rollouts.extend((key, rev) for name, key, _, rev in items
                             if name.split("/", 1)[0] in old and not name.endswith("/claim"))
    return plan


def _aborted_since(items: list[tuple[str, str, bytes, int]], all_terminal: bool) -> Optional[tuple[float, str]]:
    """A job whose rollout was aborted never starts again: finished from its abort mark."""
    for name, _, value, _ in items:
        if name == "aborted" and all_terminal:
            try:
                at = json.loads(value).get("at")
            except (ValueError, AttributeError):
                at = None
            return _ts(at) or 0.0, "aborted"
    return None


# --- run directories on disk ----------------------------------------------------------------

_RUN_DIR = re.compile(r"^(?P<job>.+)_(?P<fire>\d{8}T\d{6}\.\d{3}Z)_\d+\.\d+-[0-9a-f]{10}$")


def _dir_size(path: str, max_entries: int = 200_000) -> int:
    """Bytes of the files under ``path``, from at most ``max_entries`` entries: an explicit
    stack (any depth: a job's 5,000-deep chain is no RecursionError), symbolic links not
    followed; what cannot be read (a path past PATH_MAX) counts for nothing."""
    total, seen, stack = 0, 0, [path]
    while stack and seen < max_entries:
        try:
            with os.scandir(stack.pop()) as it:
                for de in it:
                    seen += 1
                    try:
                        if de.is_dir(follow_symlinks=False):
                            stack.append(de.path)
                        else:
                            total += de.stat(follow_symlinks=False).st_size
                    except OSError:
                        pass
        except OSError:
            continue
    return total


def plan_run_dirs(entries: list[tuple[str, float, int]], in_use: set[str], now: float, keep_runs: int,
                  max_age_s: float, budget_bytes: int, min_age_s: float = 5.0) -> list[str]:
    """Which run directories go. entries: (name, mtime, bytes). A directory in use always
    stays. Order: older than max_age_s; beyond keep_runs per job, newest firings kept (job
    parsed from the name; names too long to parse count only for age and budget); then
    oldest first, except those younger than min_age_s, until the rest fits the budget."""
    candidates = [(n, m, b) for n, m, b in entries if n not in in_use]
    doomed: set[str] = {n for n, m, _ in candidates if now - m > max_age_s}
    per_job: dict[str, list[tuple[str, str]]] = {}
    for n, _m, _b in entries:
        mt = _RUN_DIR.match(n)
        if mt:
            per_job.setdefault(mt.group("job"), []).append((mt.group("fire"), n))
    removable = {n for n, _m, _b in candidates}
    for _job, runs in per_job.items():
        runs.sort(reverse=True)
        for _fire, n in runs[keep_runs:]:
            if n in removable:
                doomed.add(n)
    total = sum(b for n, _m, b in entries if n not in doomed)
    for n, m, b in sorted(candidates, key=lambda x: x[1]):
        if total <= budget_bytes:
            break
        if n not in doomed and now - m >= min_age_s:
            doomed.add(n)
            total -= b
    return sorted(doomed)


# --- the background worker --------------------------------------------------------------------

class _Throttle:
    """At most `rate` deletions per second, by sleeping on the retention thread."""

    def __init__(self, rate: float, stop: threading.Event):
        self.interval = 1.0 / rate if rate > 0 else 0.0
        self.next = time.monotonic()
        self.stop = stop

    def take(self, n: int) -> bool:
        now = time.monotonic()
        if self.next > now:
            if self.stop.wait(self.next - now):
                return False
        self.next = max(self.next, now) + n * self.interval
        return True


class Retention:
    """Runs retention for the shards this agent holds; a daemon component (loop thread).
    It acts for a shard only while ``ownership`` gives its fence, and leaves one audit
    record per pass that deleted something."""

    def __init__(self, cfg: Config, loop: EventLoop, client: EtcdClient, keys: Keys, ownership: Fencing,
                 audit: AuditSink, catalog: JobCatalog, executor: Optional[Executor] = None,
                 clock: Callable[[], float] = time.time):
        self.cfg = cfg.retention
        self.shards = cfg.shards
        self.agent_id = cfg.agent_id
        self.ownership = ownership
        self.audit = audit
        self.catalog = catalog
        self.executor = executor
        self.keys = keys
        self.client = client
        self.loop = loop
        self.clock = clock
        self.workers = EtcdWorkers(self.loop.post, threads=1, name="retention")
        self._stop = threading.Event()
        self._throttle = _Throttle(self.cfg.max_deletes_per_s, self._stop)
        self._timer: Optional[Timer] = None
        self._busy = False
        self._started = False
        self._cursor = 0
        self._disk_at = 0.0
        self._pools_at = time.monotonic()
        self._own_at = time.monotonic()
        self.last: dict = {}
        self.totals = {"runs": 0, "jobs_finished": 0, "tombstones": 0, "latest": 0, "answers": 0, "run_dirs": 0,
                       "pools": 0, "rollouts": 0}

    def start(self) -> None:
        self._started = True
        self.workers.start()
        if self.cfg.interval_s > 0:
            self._timer = self.loop.call_later(self.cfg.interval_s, self._tick)

    def stop(self) -> None:
        self._stop.set()
        if self._timer is not None:
            self._timer.cancel()
        if self._started:
            self.workers.stop()

    def status(self) -> dict:
        return {"totals": dict(self.totals), "last": self.last}

    # --- loop thread -------------------------------------------------------------------
    def _tick(self) -> None:
        self._timer = self.loop.call_later(self.cfg.interval_s, self._tick)
        if self._busy:
            return
        # cluster shards only: a storage shard's records (targeted jobs' too) are trimmed by
        # the cluster shard's owner; pool units (>= shards) share their storage shard
        fences = {s: f for s in self.catalog.loaded if s < self.shards and (f := self.ownership.fence_for(s)) is not None}
        loaded = sorted(fences)
        if loaded:  # one shard per tick, round robin
            shard = next((s for s in loaded if s >= self._cursor), loaded[0])
            self._cursor = shard + 1
            fence = fences[shard]
            self._busy = True
            self.workers.submit(lambda: self.run_shard(fence), lambda r, e: self._shard_done(fence, r, e))
        now = time.monotonic()
        fence0 = self.ownership.fence_for(0)
        if fence0 is not None and self.cfg.pools_interval_s > 0 and now - self._pools_at >= self.cfg.pools_interval_s:
            self._pools_at = now
            self.workers.submit(lambda: self.run_pools(fence0), lambda r, e: self._shard_done(fence0, r, e, busy=False))
        if now - self._own_at >= self.cfg.interval_s * OWN_ROLLOUTS_TICKS:
            self._own_at = now
            self.workers.submit(self.run_own_rollouts, self._own_done)
        if self.executor is not None and now - self._disk_at >= self.cfg.disk_interval_s:
            self._disk_at = now
            in_use = self._dirs_in_use()
            self.workers.submit(lambda: self.run_disk(in_use), self._disk_done)

    def _dirs_in_use(self) -> set[str]:
        used = set()
        for e in self.catalog.entries.values():
            for f in e.firings.values():
                d = f.handle.run_dir if f.handle is not None else None
                if d:
                    used.add(os.path.basename(d))
        return used

    def _shard_done(self, fence: Fence, result: Optional[dict], error: Optional[BaseException],
                    busy: bool = True) -> None:
        if busy:
            self._busy = False
        if error is not None:
            PASSES.labels("stale" if isinstance(error, StaleToken) else "error").inc()
            if not isinstance(error, StaleToken):
                log.warning("retention pass failed", extra={"fields": {"shard": fence.shard, "error": str(error)}})
            return
        PASSES.labels("ok").inc()
        self._summarise(result, shard=fence.shard, token=fence.token)

    def _own_done(self, result: Optional[dict], error: Optional[BaseException]) -> None:
        if error is not None:
            log.warning("rollout key retention failed", extra={"fields": {"error": str(error)}})
            return
        self._summarise(result)

    def _disk_done(self, result: Optional[dict], error: Optional[BaseException]) -> None:
        if error is not None:
            log.warning("run directory retention failed", extra={"fields": {"error": str(error)}})
            return
        self._summarise(result)

    def _summarise(self, result: Optional[dict], **where: Any) -> None:
        if not result:
            return
        counts = {k: v for k, v in result.items() if isinstance(v, int) and v}
        if not counts:
            return
        for k, v in counts.items():
            if k in self.totals:
                self.totals[k] += v
        self.last = {**where, **result, "at": sch.format_rfc3339(datetime.now(timezone.utc))}
        self.audit.record("retention", **where, **result)
        log.info("retention pass", extra={"fields": {**where, **result}})

    # --- retention thread ------------------------------------------------------------------
    def run_shard(self, fence: Fence) -> dict:
        """One pass over one shard: read (paged, one revision), plan, delete (fenced)."""
        shard = fence.shard
        jobs_prefix = self.keys.jobs_prefix(shard)
        runs_prefix = self.keys.runs_prefix(shard)
        latest_prefix = self.keys.latest_prefix(shard)
        jobs: dict[str, tuple[dict, str, int]] = {}
        rev = 0
        for kvs, page_rev in self.client.range_pages(jobs_prefix):
            rev = page_rev
            for kv in kvs:
                try:
                    jobs[kv.key[len(jobs_prefix):]] = (json.loads(kv.value), kv.key, kv.mod_revision)
                except ValueError:
                    continue
        runs: dict[str, list[tuple[str, str, bytes, int]]] = {}
        for kvs, _ in self.client.range_pages(runs_prefix, revision=rev):
            for kv in kvs:
                job_id, _, fire_id = kv.key[len(runs_prefix):].partition("/")
                runs.setdefault(job_id, []).append((fire_id, kv.key, kv.value, kv.mod_revision))
        latest: dict[str, tuple[str, int]] = {}
        for kvs, _ in self.client.range_pages(latest_prefix, revision=rev, keys_only=True):
            for kv in kvs:
                latest[kv.key[len(latest_prefix):]] = (kv.key, kv.mod_revision)
        # every agent's rollout keys of the shard (its abort marks finish a job); only this
        # agent's own are deleted here, and by run_own_rollouts in every shard
        rollouts: dict[str, list[tuple[str, str, bytes, int]]] = {}
        for kvs, _ in self.client.range_pages(self.keys.rollouts_prefix(), revision=rev):
            for kv in kvs:
                where = self.keys.split_rollout_key(kv.key)
                if where is not None and where[1] == shard:
                    rollouts.setdefault(where[2], []).append((where[3], kv.key, kv.value, kv.mod_revision))
        plan = plan_shard(jobs, runs, latest, self.clock(), self.cfg.keep_runs, self.cfg.finished_job_s,
                          self.cfg.tombstone_s, rollouts)
        own = self.keys.rollouts_prefix(self.agent_id)
        plan.rollouts = [(k, m) for k, m in plan.rollouts if k.startswith(own)]
        # answers still owed for a job that is gone or a tombstone (it finished finished_job_s
        # ago, as long as the cloud channel keeps them at all): they go with its records
        answers_prefix = self.keys.answers_prefix(shard)
        answers: list[tuple[str, int]] = []
        for kvs, _ in self.client.range_pages(answers_prefix, revision=rev, keys_only=True):
            for kv in kvs:
                job_id = kv.key[len(answers_prefix):].partition("/")[0]
                if job_id not in jobs or jobs[job_id][0].get("_tombstone"):
                    answers.append((kv.key, kv.mod_revision))
        result = {"runs": 0, "jobs_finished": 0, "tombstones": 0, "latest": 0, "answers": 0, "rollouts": 0,
                  "conflicts": 0, "read_revision": rev}
        if plan.empty() and not answers:
            return result
        for key, mrev, tomb, latest_key, _reason in plan.finish:
            if not self._throttle.take(1):
                return result
            ops = [Put(key, json.dumps(tomb, sort_keys=True, separators=(",", ":")))]
            if latest_key:
                ops.append(Delete(latest_key))
            r = fenced_txn(self.client, fence, compare=[Mod(key) == mrev], success=ops)
            if r.succeeded:
                result["jobs_finished"] += 1
                DELETED.labels("job_finished").inc()
            else:
                result["conflicts"] += 1
        for kind, items in (("tombstones", plan.tombstones), ("runs", plan.runs), ("latest", plan.latest),
                            ("answers", answers), ("rollouts", plan.rollouts)):
            for i in range(0, len(items), BATCH_OPS):
                batch = items[i:i + BATCH_OPS]
                if not self._throttle.take(len(batch)):
                    return result
                r = fenced_txn(self.client, fence, compare=[Mod(k) == m for k, m in batch],
                               success=[Delete(k) for k, _ in batch])
                if r.succeeded:
                    result[kind] += len(batch)
                    DELETED.labels(kind).inc(len(batch))
                else:  # something changed since the read: the next pass decides again
                    result["conflicts"] += 1
        return result

    def run_own_rollouts(self) -> dict:
        """Delete this agent's own rollout keys that retention no longer keeps, in every
        shard (the shard owner cannot: each agent may write only its own rollout keys).
        Each delete compares the key's mod revision; no fence: nobody else writes them."""
        own = self.keys.rollouts_prefix(self.agent_id)
        by_shard: dict[int, dict[str, list[tuple[str, str, bytes, int]]]] = {}
        for kvs, _ in self.client.range_pages(own):
            for kv in kvs:
                where = self.keys.split_rollout_key(kv.key)
                if where is not None:
                    by_shard.setdefault(where[1], {}).setdefault(where[2], []).append(
                        (where[3], kv.key, kv.value, kv.mod_revision))
        result = {"rollouts": 0, "conflicts": 0}
        for shard, rollouts in sorted(by_shard.items()):
            jobs: dict[str, tuple[dict, str, int]] = {}
            for job_id in rollouts:
                kv = self.client.get(self.keys.job(shard, job_id))
                if kv is not None:
                    try:
                        jobs[job_id] = (json.loads(kv.value), kv.key, kv.mod_revision)
                    except ValueError:
                        continue
            # no records read: a job is gone here only when missing, a tombstone, or finished
            # by its document alone; the shard's owner judges the rest with its records
            plan = plan_shard(jobs, {}, {}, self.clock(), self.cfg.keep_runs, self.cfg.finished_job_s,
                              self.cfg.tombstone_s, rollouts)
            items = [(k, m) for k, m in plan.rollouts if k.startswith(own)]
            for i in range(0, len(items), BATCH_OPS):
                batch = items[i:i + BATCH_OPS]
                if not self._throttle.take(len(batch)):
                    return result
                r = self.client.txn([Mod(k) == m for k, m in batch], [Delete(k) for k, _ in batch], [])
                if r.succeeded:
                    result["rollouts"] += len(batch)
                    DELETED.labels("rollouts").inc(len(batch))
                else:
                    result["conflicts"] += 1
        return result

    def run_pools(self, fence: Fence) -> dict:
        """Remove the spec of every placement pool without a job (pools/<pool>/spec), fenced by
        shard 0. Jobs are read at the revision the specs were read at, and each delete
        compares the spec's mod revision: a job created since re-put its pool's spec in its
        own transaction (jobstore), so its pool is never removed under it."""
        result = {"pools": 0, "conflicts": 0}
        specs: dict[str, tuple[str, int]] = {}
        rev = 0
        prefix = self.keys.pools_prefix()
        for kvs, page_rev in self.client.range_pages(prefix, keys_only=True):
            rev = rev or page_rev
            for kv in kvs:
                pool, _, tail = kv.key[len(prefix):].partition("/")
                if tail == "spec":
                    specs[pool] = (kv.key, kv.mod_revision)
        if not specs:
            return result
        live: set[str] = set()
        jobs_prefix = self.keys.jobs_prefix()
        for kvs, _ in self.client.range_pages(jobs_prefix, revision=rev):
            for kv in kvs:
                try:
                    doc = json.loads(kv.value)
                except ValueError:
                    continue
                if isinstance(doc, dict) and doc.get("target") is not None:
                    live.add(placement.pool_of_doc(doc))
        for pool, (key, mrev) in sorted(specs.items()):
            if pool in live or not self._throttle.take(1):
                continue
            r = fenced_txn(self.client, fence, compare=[Mod(key) == mrev], success=[Delete(key)])
            if r.succeeded:
                result["pools"] += 1
                DELETED.labels("pools").inc()
            else:
                result["conflicts"] += 1
        return result

    def run_disk(self, in_use: set[str]) -> dict:
        """One pass over the run directories of this agent."""
        result = {"run_dirs": 0, "run_dir_bytes": 0}
        if self.executor is None:
            return result
        base = self.executor.base_dir
        cleaner = self.executor.cleaner
        if not base or not os.path.isdir(base):
            return result
        entries = []
        sizes = {}
        for de in os.scandir(base):
            try:
                if de.name.startswith(".") or not de.is_dir(follow_symlinks=False):   # .cleanup: the executor's
                    continue
                size = _dir_size(de.path)
                entries.append((de.name, de.stat(follow_symlinks=False).st_mtime, size))
                sizes[de.name] = size
            except OSError:
                continue
        doomed = plan_run_dirs(entries, in_use, self.clock(), self.cfg.keep_runs, self.cfg.run_output_s,
                               int(self.cfg.run_output_max_mb * 1024 * 1024))
        for name in doomed:
            if not self._throttle.take(1):
                break
            if not cleaner.discard(os.path.join(base, name)):   # a rename: its removal is the cleaner's, bounded per pass
                continue
            result["run_dirs"] += 1
            result["run_dir_bytes"] += sizes.get(name, 0)
            DELETED.labels("run_dir").inc()
        return result
