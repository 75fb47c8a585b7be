"""Push and cancel ingest: validate, store durably in etcd, answer with a status.

``Ingest`` is the pipeline for one message (no threads, no MQTT): tests drive it directly
against a real etcd. It returns an :class:`Outcome`; by the time it returns, everything
that must be durable before the broker's PUBACK is durable (the job in etcd, the status in
the outbox). It raises EtcdUnavailable when etcd cannot be reached: then nothing may be
acknowledged and the caller retries (the broker redelivers if the connection drops).

Per push:
 0. the screen (``Ingest.screen``, on arrival): size, JSON, signature, cluster and kind
    binding. Anything that fails is dropped and acknowledged at once and counted; the agent
    responsible for it (the owner of the shard of the payload's digest) reports the reason,
    and nothing else, on its own ``agents/<id>/rejected`` topic, rate-limited. Such a
    document never produces a status on a job's topic: its id is not to be believed;
 1. fields, template, params, not_after, issued_at age and skew (parse_job); a push
    refused only for expiry, age or skew whose identical job is already stored is a
    redelivery, not a rejection;
 2. JobStore.create (idempotent): created, exists, conflict or cancelled;
 3. the status: ``accepted`` (with ``"redelivery": true`` when this agent has answered
    this job before), or ``rejected`` with reason and detail; exactly one agent answers:
    the one that created the job (or, for a repeat, the shard's owner).

``Dispatcher`` routes messages from MQTT: the owner of the job's shard ingests at once;
other agents hold the (authenticated) message unacknowledged and release it as soon as an
etcd watch shows the job stored (or cancelled), or ingest it themselves after
``ingest_grace_s``. Unauthenticated input is never held. With a paho that cannot withhold
the PUBACK (``link.deferred_ack`` False), every agent ingests inside on_message instead,
so nothing is acknowledged before it is durable.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import heapq
import itertools
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Optional

from agent.coordination.etcd import EtcdError, EtcdUnavailable, Put
from agent.coordination.jobstore import CREATED, JobCancelled, JobConflict, JobStore
from agent.coordination.keys import shard_of
from agent.jobs import envelope as jobs
from agent.jobs.document import parse_cancel, parse_job
from agent.jobs.envelope import KIND_CANCEL, KIND_JOB, JobRejected, authenticate
from agent.runtime.metrics import counter, histogram
from agent.runtime.recent import RecentMemory
from agent.runtime.timefmt import now_rfc3339

from .topics import ID_RE, Topics

log = logging.getLogger(__name__)

REJECTED = counter("millwright_mqtt_rejected_total", "Pushes and cancels refused, by reason", ("reason",))
INGESTED = counter("millwright_mqtt_ingested_total", "Pushes and cancels handled, by kind and result",
                   ("kind", "result"))
INGEST_SECONDS = histogram("millwright_mqtt_ingest_seconds", "Arrival to durable answer of a push",
                           buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
UNAUTHENTICATED = counter("millwright_mqtt_unauthenticated_total",
                          "Pushes and cancels dropped at once for failing size, JSON, signature or binding",
                          ("kind", "reason"))
UNAUTH_REPORTS_SUPPRESSED = counter("millwright_mqtt_unauthenticated_reports_suppressed_total",
                                    "Rejections of unauthenticated input not reported (rate limit)")
ETCD_RETRIES = counter("millwright_mqtt_ingest_etcd_retries_total", "Ingest attempts retried because etcd was unreachable")

CANCELLED = "cancelled"
CONFLICT = "conflict"
RETRY_TIME_REASONS = (jobs.EXPIRED, jobs.SKEW, jobs.TOO_OLD)
REPORTS_PER_S = 5.0      # reports of unauthenticated input (status + audit), per agent
REPORTS_BURST = 20.0
# The group commit's bounds: etcd refuses a transaction of more than --max-txn-ops (128 by
# default) ops per level, or larger than --max-request-bytes (1.5 MiB by default); a
# push is one nested op, its stored value about its payload's size plus ~0.5 KiB of marker.
BATCH_MAX = 64
BATCH_BYTES = 512 * 1024
# refused before (or by) the signature check: the sender is not known to be the cloud
UNAUTHENTICATED_REASONS = frozenset({jobs.TOO_LARGE, jobs.BAD_JSON, jobs.UNSIGNED, jobs.UNKNOWN_KID,
                                     jobs.BAD_SIGNATURE, jobs.UNSUPPORTED_ALG})


class TokenBucket:
    """Thread-safe rate limit: take() is True while tokens last."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens, self.at = burst, clock()
        self.lock = threading.Lock()

    def take(self) -> bool:
        with self.lock:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
            if self.tokens >= 1.0:
                self.tokens -= 1.0
                return True
            return False


def push_digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()[:16]


def peek_id(payload: bytes, max_bytes: int) -> Optional[str]:
    """The document's id if it can be read at all (for routing and the status topic)."""
    if len(payload) > max_bytes:
        return None
    try:
        doc = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    if isinstance(doc, dict):
        v = doc.get("id")
        if isinstance(v, str) and ID_RE.fullmatch(v) and not v.startswith("."):
            return v
    return None


@dataclass
class Outcome:
    kind: str                 # push | cancel
    result: str               # accepted | redelivery | rejected | cancelled | silent | dropped
    job_id: Optional[str]
    reason: Optional[str] = None
    detail: Optional[str] = None
    status: Optional[dict] = None  # the status document queued, if any
    stored: Any = None
    authenticated: bool = False    # a rejection of a correctly signed push (owed an answer)


class Ingest:
    def __init__(self, *, store: JobStore, keyring, templates: dict, topics: Topics, agent_id: str,
                 max_bytes: int, max_skew_s: float, cluster: str, max_age_s: float = 86400.0, outbox=None,
                 record: Callable[..., None] = lambda *a, **k: None,
                 notify: Callable[[str, Any], None] = lambda kind, obj: None,
                 has_other_owner: Optional[Callable[[int], bool]] = None,
                 reports: Optional[TokenBucket] = None, answers=None,
                 members: Optional[Callable[[], Optional[dict]]] = None):
        self.store = store
        # live members' records (labels, templates): an accepted targeted push says whether
        # any agent can run it yet (agent/jobs/view.py placement_view)
        self.members = members or (lambda: None)
        self.keyring = keyring
        self.templates = templates
        self.topics = topics if topics.agent_id else Topics(topics.cluster, agent_id)
        self.agent_id = agent_id
        self.cluster = cluster
        self.max_bytes = max_bytes
        self.max_skew_s = max_skew_s
        self.max_age_s = max_age_s
        self.reports = reports or TokenBucket(REPORTS_PER_S, REPORTS_BURST)
        self.outbox = outbox
        self.record = record
        self.notify = notify
        self.shards = store.shards
        self.has_other_owner = has_other_owner or self._has_other_owner
        self.answers = answers  # agent/cloud/answers.py: durable markers of the answers (None: off)
        self._tl = threading.local()  # the outbox reservation of the push this thread is handling

    # --- helpers ----------------------------------------------------------------
    def _has_other_owner(self, shard: int) -> bool:
        kv = self.store.client.get(self.store.keys.shard(shard))
        return kv is not None and kv.value.decode() != self.agent_id

    def _status(self, job_id: Optional[str], state: str, payload: bytes, **extra: Any) -> dict:
        doc = {"v": 1, "job_id": job_id, "run_id": None, "state": state, "attempt": 0, "agent": self.agent_id,
               "shard": shard_of(job_id, self.shards) if job_id else None, "ts": now_rfc3339(),
               "exit_code": None, "reason": None, "usage": None, "push_sha256": push_digest(payload)}
        doc.update({k: v for k, v in extra.items() if v is not None})
        return doc

    def _emit(self, doc: dict, ledger: Optional[str] = None, marker: Optional[str] = None) -> None:
        if self.outbox is None:
            return
        topic = self.topics.status(doc.get("job_id"))
        seq, self._tl.reserved = getattr(self._tl, "reserved", None), None
        collect = getattr(self._tl, "collect", None)
        if seq is not None and collect is not None:  # a batch: filled in one transaction (push_many)
            collect.append((seq, topic, doc, ledger, marker))
        elif seq is not None:
            self.outbox.fill(seq, topic, doc, ledger_job_id=ledger, marker=marker)
        else:
            self.outbox.enqueue(topic, doc, ledger_job_id=ledger, marker=marker)

    def _authenticated(self, payload: bytes, reason: str) -> bool:
        """A rejection owed an answer: the push carries a valid signature of a known key."""
        if reason in UNAUTHENTICATED_REASONS:
            return False
        try:
            doc = json.loads(payload)
            self.keyring.verify(doc)
            return True
        except Exception:
            return False

    # --- the screen ---------------------------------------------------------------
    def screen(self, kind: str, payload: bytes, responsible: Callable[[int], bool]) -> Optional[Outcome]:
        """Size, JSON, signature and binding, in that order (cheap; paho's thread). None when
        the document is authentic and bound to this cluster; else it is dropped: counted, and
        reported (reason only, on this agent's rejections topic, rate-limited) when
        ``responsible(shard of the payload digest)``; the caller acknowledges it at once."""
        payload = bytes(payload)
        try:
            authenticate(payload, keyring=self.keyring, max_bytes=self.max_bytes, cluster=self.cluster,
                         kind=KIND_JOB if kind == "push" else KIND_CANCEL, now=datetime.now(timezone.utc))
            return None
        except JobRejected as exc:
            return self._drop(kind, payload, exc.reason, responsible)

    def _drop(self, kind: str, payload: bytes, reason: str, responsible: Callable[[int], bool]) -> Outcome:
        UNAUTHENTICATED.labels(kind, reason).inc()
        INGESTED.labels(kind, "dropped").inc()
        digest = push_digest(payload)
        if not responsible(shard_of(digest, self.shards)):
            return Outcome(kind, "dropped", None, reason)
        if not self.reports.take():
            UNAUTH_REPORTS_SUPPRESSED.inc()
            return Outcome(kind, "dropped", None, reason)
        REJECTED.labels(reason).inc()
        self.record("job", event="rejected_unauthenticated", kind=kind, reason=reason, push_sha256=digest,
                    agent=self.agent_id)
        doc = {"v": 1, "state": "rejected", "kind": kind, "reason": reason, "agent": self.agent_id,
               "ts": now_rfc3339(), "push_sha256": digest}
        if self.outbox is not None:
            self.outbox.enqueue(self.topics.rejections(), doc)
        return Outcome(kind, "dropped", None, reason, status=doc)

    def _reject(self, kind: str, payload: bytes, job_id: Optional[str], reason: str, detail: str,
                as_owner: bool) -> Outcome:
        shard = shard_of(job_id, self.shards) if job_id else shard_of(push_digest(payload), self.shards)
        authenticated = kind == "push" and job_id is not None and self._authenticated(payload, reason)
        if not as_owner and self.has_other_owner(shard):
            INGESTED.labels(kind, "left_to_owner").inc()
            return Outcome(kind, "silent", job_id, reason, detail, authenticated=authenticated)
        REJECTED.labels(reason).inc()
        INGESTED.labels(kind, "rejected").inc()
        self.record("job", event="rejected", kind=kind, job_id=job_id, reason=reason, detail=detail,
                    push_sha256=push_digest(payload), agent=self.agent_id)
        log.info("push rejected" if kind == "push" else "cancel rejected",
                 extra={"fields": {"job_id": job_id, "reason": reason, "detail": detail}})
        doc = self._status(job_id, "rejected", payload, reason=reason, detail=detail,
                           kind=None if kind == "push" else "cancel")
        marker = None
        if authenticated and self.answers is not None:
            marker = self.answers.write_rejection(shard, job_id, push_digest(payload), doc)
        self._emit(doc, marker=marker)
        return Outcome(kind, "rejected", job_id, reason, detail, doc, authenticated=authenticated)

    # --- push -------------------------------------------------------------------
    def push(self, payload: bytes, as_owner: bool = True, screened: bool = False) -> Outcome:
        """Raises EtcdUnavailable (retry; do not acknowledge). Never anything else for any payload.
        ``screened``: these very bytes passed :meth:`screen` (signature and binding checked at
        arrival), so parse_job does not verify the signature a second time (an ed25519
        verify costs ~0.1 ms: measured in bench/bench_ingest.py's notes)."""
        payload = bytes(payload)
        job_id = peek_id(payload, self.max_bytes)
        try:
            job = parse_job(payload, templates=self.templates, keyring=self.keyring,
                            now=datetime.now(timezone.utc), max_skew_s=self.max_skew_s, max_bytes=self.max_bytes,
                            cluster=self.cluster, max_age_s=self.max_age_s, verify_signature=not screened)
        except JobRejected as exc:
            if not exc.bound:  # never a status on the job's topic for what is not authentic
                return self._drop("push", payload, exc.reason, lambda shard: as_owner)
            if exc.reason in RETRY_TIME_REASONS and job_id is not None:
                again = self._stored_twin(payload)
                if again is not None:
                    return self._exists(payload, again, as_owner)
            return self._reject("push", payload, job_id, exc.reason, exc.detail, as_owner)
        except Exception:  # parse_job promises not to; never crash on a payload anyway
            log.exception("parse_job raised unexpectedly")
            return self._drop("push", payload, jobs.BAD_FIELD, lambda shard: as_owner)
        return self._with_reservation(job.id, self._push_store, payload, job, as_owner)

    def _with_reservation(self, job_id, fn, *args):
        """Reserve the status's place before the etcd write (see Outbox.reserve); a path that
        ends without a status, or an exception, gives the reservation back."""
        if self.outbox is None:
            return fn(*args)
        self._tl.reserved = self.outbox.reserve(self.topics.status(job_id))
        try:
            return fn(*args)
        finally:
            seq, self._tl.reserved = self._tl.reserved, None
            if seq is not None:
                self.outbox.release(seq)

    def _answer_of(self, payload: bytes, job) -> tuple[dict, Optional[str], tuple]:
        """The accepted status of a push, its marker key, and the marker's put (if markers are on)."""
        shard = shard_of(job.id, self.shards)
        doc = self._status(job.id, "accepted", payload, shard=shard)
        if job.target is not None:
            from agent.jobs.view import placement_view

            where = placement_view(job.doc, self.members())
            if where is not None:
                doc["placement"] = where
        if self.answers is None:
            return doc, None, ()
        marker = self.store.keys.answer(shard, job.id, "accepted")  # durable with the job (answers.py)
        return doc, marker, (Put(marker, json.dumps(doc, separators=(",", ":"))),)

    def _push_store(self, payload: bytes, job, as_owner: bool) -> Outcome:
        doc, marker, also = self._answer_of(payload, job)
        try:
            created: Any = self.store.create(job.doc, also)
        except (JobCancelled, JobConflict) as exc:
            created = exc
        return self._push_result(payload, job, as_owner, created, doc, marker)

    def _push_result(self, payload: bytes, job, as_owner: bool, created: Any, doc: dict,
                     marker: Optional[str]) -> Outcome:
        """The answer once the create's outcome is known: (CREATED|EXISTS, stored) or the
        JobCancelled/JobConflict it raised."""
        if isinstance(created, JobCancelled):
            return self._reject("push", payload, job.id, CANCELLED, f"id: job {job.id} was cancelled; "
                                "a cancelled id cannot be pushed again", as_owner)
        if isinstance(created, JobConflict):
            return self._reject("push", payload, job.id, CONFLICT, f"id: job {job.id} already exists with "
                                "different content", as_owner)
        result, stored = created
        if result == CREATED:
            self._emit(doc, ledger=job.id, marker=marker)
            INGESTED.labels("push", "accepted").inc()
            self.record("job", event="accepted", job_id=job.id, shard=stored.shard, template=job.template,
                        push_sha256=push_digest(payload), agent=self.agent_id)
            self.notify("stored", self._with_parsed(stored, job))
            return Outcome("push", "accepted", job.id, status=doc, stored=stored)
        return self._exists(payload, stored, as_owner)

    def _with_parsed(self, stored, job):
        """``stored`` carrying the verified job for the scheduler (StoredJob.parsed): the
        document this agent itself just verified and stored, with the key that signed it
        (the screen verified it: parse_job then left ``kid`` unset)."""
        if job.kid is None:
            sig = job.doc.get("sig")
            key = self.keyring.get(sig.get("kid")) if isinstance(sig, dict) and isinstance(sig.get("kid"), str) else None
            if key is None:
                return stored  # (keys reloaded meanwhile) the scheduler verifies it itself
            job = dataclasses.replace(job, kid=key.kid, key_retired_after=key.retired_after)
        return dataclasses.replace(stored, parsed=job)

    # --- push: group commit -------------------------------------------------------------
    def push_many(self, items: list[tuple[bytes, bool]], screened: bool = False) -> list:
        """Several pushes (payload, as_owner) with ONE etcd transaction for their creates and
        one outbox transaction each for reserving and filling their statuses (the group
        commit). Returns, per item, its Outcome or the EtcdUnavailable/EtcdError that stopped
        it (that item is not durable: do not acknowledge it, retry it). Each item's outcome
        is its own: a rejection, a duplicate or a conflict does not touch the others. Pushes
        refused by parse_job, and a second push of an id already in the batch, take the
        one-push path (after the batch)."""
        out: list = [None] * len(items)
        batch: list = []
        later: list[int] = []
        ids: set = set()
        now = datetime.now(timezone.utc)
        for i, (payload, as_owner) in enumerate(items):
            try:
                job = parse_job(bytes(payload), templates=self.templates, keyring=self.keyring, now=now,
                                max_skew_s=self.max_skew_s, max_bytes=self.max_bytes, cluster=self.cluster,
                                max_age_s=self.max_age_s, verify_signature=not screened)
            except Exception:  # rejected (or a bug): the one-push path answers it as before
                later.append(i)
                continue
            if job.id in ids:
                later.append(i)
                continue
            ids.add(job.id)
            batch.append((i, bytes(payload), job, as_owner))
        if batch:
            self._commit_batch(batch, out)
        for i in later:
            try:
                out[i] = self.push(*items[i], screened=screened)
            except (EtcdUnavailable, EtcdError) as exc:
                out[i] = exc
        return out

    def _commit_batch(self, batch: list, out: list) -> None:
        answers = [self._answer_of(payload, job) for _, payload, job, _ in batch]
        seqs: list = (self.outbox.reserve_many([self.topics.status(job.id) for _, _, job, _ in batch])
                      if self.outbox is not None else [None] * len(batch))
        unfilled: list[int] = []
        try:
            try:
                created = self.store.create_many([(job.doc, also) for (_, _, job, _), (_, _, also)
                                                  in zip(batch, answers)])
            except (EtcdUnavailable, EtcdError) as exc:
                unfilled = [q for q in seqs if q is not None]
                for i, _, _, _ in batch:
                    out[i] = exc
                return
            fills: list = []
            self._tl.collect = fills
            try:
                for (i, payload, job, as_owner), (doc, marker, _), result, seq in zip(batch, answers, created, seqs):
                    self._tl.reserved = seq
                    try:
                        out[i] = self._push_result(payload, job, as_owner, result, doc, marker)
                    except (EtcdUnavailable, EtcdError) as exc:  # e.g. writing a rejection's marker
                        out[i] = exc
                    if self._tl.reserved is not None:
                        unfilled.append(self._tl.reserved)
                    self._tl.reserved = None
            finally:
                self._tl.collect = None
            if self.outbox is not None:
                self.outbox.fill_many(fills)  # before any of them is acknowledged
        except BaseException:
            unfilled = [q for q in seqs if q is not None]  # fill_many is one transaction: none filled
            raise
        finally:
            if self.outbox is not None:
                self.outbox.release_many(unfilled)

    def _stored_twin(self, payload: bytes):
        """The stored job if this payload is a valid, signed copy of it (ignoring the clock)."""
        try:
            job = parse_job(payload, templates=self.templates, keyring=self.keyring, now=None,
                            max_skew_s=None, max_bytes=self.max_bytes, cluster=self.cluster)
        except JobRejected:
            return None
        stored = self.store.get(job.id)
        if stored is None or stored.cancelled or (stored.tombstone and not stored.finished):
            return None
        return stored if stored.same_content(job.doc) else None

    def _exists(self, payload: bytes, stored, as_owner: bool) -> Outcome:
        by = (stored.doc.get("_accepted") or {}).get("by")
        job_id = stored.id
        if by == self.agent_id and self.outbox is not None and not self.outbox.in_ledger(job_id):
            # created by us, but we died before the status was written: this is its first answer
            doc = self._status(job_id, "accepted", payload, shard=stored.shard)
            self._emit(doc, ledger=job_id, marker=None if self.answers is None else
                       self.store.keys.answer(stored.shard, job_id, "accepted"))
            INGESTED.labels("push", "accepted").inc()
            self.notify("stored", stored)
            return Outcome("push", "accepted", job_id, status=doc, stored=stored)
        if by == self.agent_id or as_owner:
            doc = self._status(job_id, "accepted", payload, shard=stored.shard, redelivery=True)
            self._emit(doc)
            INGESTED.labels("push", "redelivery").inc()
            return Outcome("push", "redelivery", job_id, status=doc, stored=stored)
        INGESTED.labels("push", "exists").inc()
        return Outcome("push", "silent", job_id, stored=stored)

    # --- cancel -----------------------------------------------------------------
    def cancel(self, payload: bytes, as_owner: bool = True) -> Outcome:
        payload = bytes(payload)
        job_id = peek_id(payload, self.max_bytes)
        try:
            job_id = parse_cancel(payload, self.keyring, self.max_bytes, cluster=self.cluster,
                                  now=datetime.now(timezone.utc), max_skew_s=self.max_skew_s,
                                  max_age_s=self.max_age_s)
        except JobRejected as exc:
            if not exc.bound:
                return self._drop("cancel", payload, exc.reason, lambda shard: as_owner)
            return self._reject("cancel", payload, job_id, exc.reason, exc.detail, as_owner)
        except Exception:  # pragma: no cover - parse_cancel promises not to
            return self._drop("cancel", payload, jobs.BAD_FIELD, lambda shard: as_owner)
        for attempt in range(5):
            try:
                state, stored = self.store.cancel(job_id, reason="cloud")
                break
            except JobConflict:
                time.sleep(0.01 * (attempt + 1))
        else:
            raise EtcdUnavailable(f"job {job_id} kept changing while cancelling")
        ledger_key = "cancel:" + job_id
        if state == "already_cancelled":
            mark = (stored.doc.get("_cancelled") or {}) if stored else {}
            if mark.get("by") == self.agent_id and self.outbox is not None and not self.outbox.in_ledger(ledger_key):
                pass  # ours, status never written: answer now, unmarked
            elif as_owner or mark.get("by") == self.agent_id:
                doc = self._status(job_id, "cancelled", payload, reason="cancelled_by_cloud", redelivery=True)
                self._emit(doc)
                INGESTED.labels("cancel", "redelivery").inc()
                return Outcome("cancel", "redelivery", job_id, status=doc)
            else:
                INGESTED.labels("cancel", "exists").inc()
                return Outcome("cancel", "silent", job_id)
        detail = "cancelled before the push arrived; a later push of this id is refused" if state == "tombstone" else None
        doc = self._status(job_id, "cancelled", payload, reason="cancelled_by_cloud", detail=detail)
        self._emit(doc, ledger=ledger_key)
        INGESTED.labels("cancel", "cancelled").inc()
        self.record("job", event="cancelled", job_id=job_id, by="cloud", agent=self.agent_id, state=state)
        self.notify("cancelled", job_id)
        return Outcome("cancel", "cancelled", job_id, status=doc)


def _is_cancelled(value: bytes) -> bool:
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


# --------------------------------------------------------------------------- dispatcher


@dataclass(order=True)
class _Pending:
    due: float
    n: int
    kind: str = field(compare=False)
    msg: Any = field(compare=False)
    job_id: Optional[str] = field(compare=False)
    shard: int = field(compare=False)
    done: bool = field(default=False, compare=False)


class Dispatcher:
    """Threads between paho and Ingest: routing by shard ownership, grace, retries, acks."""

    def __init__(self, ingest: Ingest, link, topics: Topics, owned: Callable[[], frozenset], grace_s: float,
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

    # --- paho thread ----------------------------------------------------------------
    def on_message(self, msg) -> None:
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
        if not getattr(self.link, "deferred_ack", True):
            # this paho acknowledges when the callback returns and the ack cannot be
            # withheld: store the job and its status here, on paho's thread, before
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
                cancelled = _is_cancelled(ev.kv.value)
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

    def _hold_rejection(self, msg, out: Outcome) -> bool:
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

    def process(self, kind: str, msg, as_owner: bool) -> Optional[Outcome]:
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

    def _finish(self, kind: str, msg, out: Outcome) -> Outcome:
        """After the durable write: acknowledge (or hold a rejection for the shard's owner)."""
        if kind == "push" and out.result in ("accepted", "redelivery"):
            INGEST_SECONDS.observe(time.monotonic() - msg.received)
        if kind == "push" and out.result == "silent" and out.authenticated and self._hold_rejection(msg, out):
            return out  # not acknowledged yet: see _hold_rejection
        self.link.ack(msg)
        return out
