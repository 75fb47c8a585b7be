"""Routing pushes and cancels from MQTT to the ingest pipeline (agent/cloud/ingest.py).

``Dispatcher`` runs between the link's thread and :class:`~agent.cloud.ingest.Ingest`: the
owner of the job's shard ingests at once; other agents hold the (authenticated) message
unacknowledged and release it as soon as an etcd watch shows the job stored (or
cancelled), or ingest it themselves after ``ingest_grace_s``. Unauthenticated input is
never held. With a link that cannot withhold the PUBACK (``Link.deferred_ack`` False),
every agent ingests inside on_message instead, so nothing is acknowledged before it is
durable. A message is acknowledged only after its own durable write (group commit:
several pushes share one etcd transaction, each is acknowledged after it).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from agent.coordination.etcd import EtcdError, EtcdUnavailable
from agent.coordination.keys import shard_of
from agent.runtime.metrics import counter, histogram
from agent.runtime.recent import RecentMemory

from .ingest import INGESTED, Ingest, Outcome, peek_id, push_digest
from .link import Link, Message
from .topics import Topics

log = logging.getLogger(__name__)

INGEST_SECONDS = histogram("millwright_mqtt_ingest_seconds", "Arrival to durable answer of a push",
                           buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
ETCD_RETRIES = counter("millwright_mqtt_ingest_etcd_retries_total", "Ingest attempts retried because etcd was unreachable")

# The group commit's bounds: etcd refuses a transaction of more than --max-txn-ops (128 by
# default) ops per level, or larger than --max-request-bytes (1.5 MiB by default); a
# push is one nested op, its stored value about its payload's size plus ~0.5 KiB of marker.
BATCH_MAX = 64
BATCH_BYTES = 512 * 1024


def stored_cancelled(value: bytes) -> bool:
    """The stored job carries the store's own top-level ``_cancelled`` mark (a job value that
    merely contains the text, e.g. in a param, does not count). Without the text at all it
    is not cancelled: no parse (this runs for every job written in the cluster)."""
    if b'"_cancelled"' not in value:
        return False
    try:
        doc = json.loads(value)
    except (ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and "_cancelled" in doc


@dataclass(order=True)
class _Pending:
    due: float
    n: int
    kind: str = field(compare=False)
    msg: Message = field(compare=False)
    job_id: Optional[str] = field(compare=False)
    shard: int = field(compare=False)
    done: bool = field(default=False, compare=False)


class Dispatcher:
    """Threads between the link and Ingest: routing by shard ownership, grace, retries, acks."""

    def __init__(self, ingest: Ingest, link: Link, topics: Topics, owned: Callable[[], frozenset], grace_s: float,
                 workers: int = 2, recent_max: int = 100000, max_hold_s: float = 60.0):
        self.ingest = ingest
        self.link = link
        self.topics = topics
        self.owned = owned
        self.grace_s = grace_s
        self.nworkers = workers
        self._q: "queue.Queue" = queue.Queue()
        self._lock = threading.Lock()
        self._heap: list[_Pending] = []
        self._by_id: dict[tuple[str, str], list[_Pending]] = collections.defaultdict(list)
        self._recent: RecentMemory[str, bool] = RecentMemory(recent_max)  # job id -> cancelled
        self._answered: RecentMemory[str, bool] = RecentMemory(recent_max)  # "<job>/<digest>" rejected
        self.max_hold_s = max_hold_s
        self._n = itertools.count()
        self._stop = threading.Event()
        self._held_ev = threading.Event()  # set when the heap gets an entry (and on stop)
        self._threads: list[threading.Thread] = []
        self.inflight = 0

    def start(self) -> "Dispatcher":
        for i in range(self.nworkers):
            t = threading.Thread(target=self._work, name=f"mqtt-ingest-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        t = threading.Thread(target=self._timer, name="mqtt-ingest-grace", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._held_ev.set()
        for _ in range(self.nworkers):
            self._q.put(None)
        for t in self._threads:
            t.join(timeout)

    @property
    def pending(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._by_id.values())

    # --- link thread ----------------------------------------------------------------
    def on_message(self, msg: Message) -> None:
        kind = self.topics.kind(msg.topic)
        if kind not in ("push", "cancel"):
            self.link.ack(msg)
            return
        owned = self.owned()
        if self.ingest.screen(kind, msg.payload, lambda shard: shard in owned) is not None:
            self.link.ack(msg)  # unauthenticated or not for this cluster: dropped, never held
            return
        job_id = peek_id(msg.payload, self.ingest.max_bytes)
        shard = shard_of(job_id if job_id else push_digest(msg.payload), self.ingest.shards)
        if not self.link.deferred_ack:
            # the link acknowledges when the callback returns and the ack cannot be
            # withheld: store the job and its status here, on the link's thread, before
            # returning (no grace hold: an unacknowledged hold is impossible)
            self.process(kind, msg, shard in owned or self.grace_s <= 0)
            return
        if shard in owned or self.grace_s <= 0:
            self._q.put((kind, msg, True))
            return
        with self._lock:
            if job_id is not None and job_id in self._recent and (kind == "push" or self._recent[job_id]):
                done_already = True
            else:
                done_already = False
                p = _Pending(msg.received + self.grace_s, next(self._n), kind, msg, job_id, shard)
                heapq.heappush(self._heap, p)
                self._held_ev.set()
                if job_id is not None:
                    self._by_id[(kind, job_id)].append(p)
        if done_already:  # another agent stored it (or cancelled it) already
            INGESTED.labels(kind, "exists").inc()
            self.link.ack(msg)

    # --- etcd watch thread -----------------------------------------------------------------
    def on_job_events(self, events, revision) -> None:
        release = []
        with self._lock:
            for ev in events:
                if ev.kind != "put":
                    continue
                job_id = ev.kv.key.rsplit("/", 1)[-1]
                cancelled = stored_cancelled(ev.kv.value)
                self._recent.remember(job_id, cancelled)
                kinds = ("push", "cancel") if cancelled else ("push",)
                for kind in kinds:
                    for p in self._by_id.pop((kind, job_id), []):
                        p.done = True
                        release.append(p)
        for p in release:
            INGESTED.labels(p.kind, "exists").inc()
            self.link.ack(p.msg)

    def on_answer_events(self, events, revision) -> None:
        """etcd watch on answers/: a rejection marker means that push was answered (by the
        owner): release our held copy of it."""
        release = []
        with self._lock:
            for ev in events:
                if ev.kind != "put":
                    continue
                parts = ev.kv.key.rsplit("/", 2)
                if len(parts) != 3 or not parts[2].startswith("rejected."):
                    continue
                key = parts[1] + "/" + parts[2][len("rejected."):]
                self._answered.remember(key, True)
                for p in self._by_id.pop(("answer", key), []):
                    p.done = True
                    release.append(p)
        for p in release:
            INGESTED.labels(p.kind, "exists").inc()
            self.link.ack(p.msg)

    def _hold_rejection(self, msg: Message, out: Outcome) -> bool:
        """A correctly signed push we would reject, but the shard has another owner: keep it
        (unacknowledged) until that owner's answer shows up in etcd, or the shard becomes ours
        or unowned (its owner died) and we answer it. True if held."""
        assert out.job_id is not None  # only authenticated rejections with a readable id are held
        key = f"{out.job_id}/{push_digest(msg.payload)}"
        shard = shard_of(out.job_id, self.ingest.shards)
        with self._lock:
            if key in self._answered or time.monotonic() - msg.received > self.max_hold_s:
                return False
            p = _Pending(time.monotonic() + self.grace_s, next(self._n), "push", msg, out.job_id, shard)
            heapq.heappush(self._heap, p)
            self._held_ev.set()
            self._by_id[("answer", key)].append(p)
        return True

    # --- grace timer ------------------------------------------------------------------
    def _timer(self) -> None:
        """Every 50 ms while something is held (due holds, shards that became ours); with
        nothing held it sleeps until a hold arrives (no idle wake-ups)."""
        while not self._stop.is_set():
            with self._lock:
                idle = not self._heap
                if idle:
                    self._held_ev.clear()
            if idle:
                self._held_ev.wait()
                continue
            if self._stop.wait(0.05):
                return
            now = time.monotonic()
            owned = self.owned()
            due = []
            with self._lock:
                while self._heap and (self._heap[0].due <= now or self._heap[0].done):
                    p = heapq.heappop(self._heap)
                    if not p.done:
                        due.append((p, False))
                if owned:  # a shard that became ours meanwhile (failover): ingest now, as the owner
                    keep = []
                    for p in self._heap:
                        if not p.done and p.shard in owned:
                            due.append((p, True))
                        else:
                            keep.append(p)
                    if len(keep) != len(self._heap):
                        heapq.heapify(keep)
                        self._heap = keep
                for p, _ in due:
                    p.done = True
                    if p.job_id is not None:
                        for k in ((p.kind, p.job_id), ("answer", f"{p.job_id}/{push_digest(p.msg.payload)}")):
                            lst = self._by_id.get(k)
                            if lst is not None:
                                try:
                                    lst.remove(p)
                                except ValueError:
                                    pass
                                if not lst:
                                    del self._by_id[k]
            for p, as_owner in due:
                self._q.put((p.kind, p.msg, as_owner))

    # --- workers ----------------------------------------------------------------------
    def _work(self) -> None:
        """Group commit: a worker takes what queued up while the other workers' transactions
        were in flight (up to BATCH_MAX pushes, BATCH_BYTES of payload) and stores the pushes
        in one etcd transaction; each is acknowledged once ITS write is durable."""
        while True:
            item = self._q.get()
            if item is None:
                return
            items, size = [item], len(item[1].payload)
            while len(items) < BATCH_MAX and size < BATCH_BYTES:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._q.put(None)  # a stop: this worker's (or another's) exit, after this batch
                    break
                items.append(nxt)
                size += len(nxt[1].payload)
            pushes = [(msg, as_owner) for kind, msg, as_owner in items if kind == "push"]
            if len(pushes) > 1:
                self.process_many(pushes)
            elif pushes:
                self.process("push", *pushes[0])
            for kind, msg, as_owner in items:
                if kind != "push":
                    self.process(kind, msg, as_owner)

    def process_many(self, pushes: list) -> None:
        """Pushes (msg, as_owner) through Ingest.push_many; an item etcd did not take is
        retried alone (process), never acknowledged before its write."""
        try:
            outs = self.ingest.push_many([(msg.payload, as_owner) for msg, as_owner in pushes], screened=True)
        except Exception:
            log.exception("ingest failed unexpectedly")  # a bug: nothing acknowledged (redelivered)
            return
        for (msg, as_owner), out in zip(pushes, outs):
            if isinstance(out, BaseException):
                ETCD_RETRIES.inc()
                self.process("push", msg, as_owner)
            else:
                self._finish("push", msg, out)

    def process(self, kind: str, msg: Message, as_owner: bool) -> Optional[Outcome]:
        backoff = 0.05
        while not self._stop.is_set():
            try:
                out = self.ingest.push(msg.payload, as_owner, screened=True) if kind == "push" else \
                    self.ingest.cancel(msg.payload, as_owner)
            except (EtcdUnavailable, EtcdError) as exc:
                # nothing is acknowledged: retry; if the connection drops meanwhile, the broker
                # redelivers and the ack below is skipped (different connection)
                ETCD_RETRIES.inc()
                if backoff >= 0.4:
                    log.warning("etcd unreachable while ingesting; retrying",
                                extra={"fields": {"kind": kind, "error": str(exc)[:200]}})
                self._stop.wait(backoff)
                backoff = min(2.0, backoff * 2)
                continue
            except Exception:
                # a bug, not a payload problem: do not ack, so the broker redelivers after a
                # reconnect; never let it kill the worker
                log.exception("ingest failed unexpectedly")
                return None
            return self._finish(kind, msg, out)
        return None

    def _finish(self, kind: str, msg: Message, out: Outcome) -> Outcome:
        """After the durable write: acknowledge (or hold a rejection for the shard's owner)."""
        if kind == "push" and out.result in ("accepted", "redelivery"):
            INGEST_SECONDS.observe(time.monotonic() - msg.received)
        if kind == "push" and out.result == "silent" and out.authenticated and self._hold_rejection(msg, out):
            return out  # not acknowledged yet: see _hold_rejection
        self.link.ack(msg)
        return out
