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

What reaches Ingest from MQTT, and when it is acknowledged, is agent/cloud/dispatch.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Optional

from agent.coordination.etcd import EtcdError, EtcdUnavailable, Put
from agent.coordination.jobstore import APPROVED, CREATED, JobCancelled, JobConflict, JobStore, public_doc
from agent.coordination.keys import shard_of
from agent.coordination.quota import ClusterQuota
from agent.jobs.approvals import answer_fields
from agent.jobs.document import Job, parse_cancel, parse_job
from agent.jobs.envelope import (
    BAD_FIELD,
    BAD_JSON,
    BAD_SIGNATURE,
    EXPIRED,
    KIND_CANCEL,
    KIND_JOB,
    SKEW,
    TOO_LARGE,
    TOO_OLD,
    UNKNOWN_KID,
    UNSIGNED,
    UNSUPPORTED_ALG,
    JobRejected,
    authenticate,
)
from agent.jobs.states import JobState, RecordState
from agent.runtime.metrics import counter
from agent.runtime.timefmt import now_rfc3339

from .answers import answer_name
from .ratelimit import TokenBucket
from .topics import ID_RE, Topics

log = logging.getLogger(__name__)

REJECTED = counter("millwright_mqtt_rejected_total", "Pushes and cancels refused, by reason", ("reason",))
INGESTED = counter("millwright_mqtt_ingested_total", "Pushes and cancels handled, by kind and result",
                   ("kind", "result"))
UNAUTHENTICATED = counter("millwright_mqtt_unauthenticated_total",
                          "Pushes, cancels and jobs/get requests dropped at once for failing size, JSON, "
                          "signature or binding",
                          ("kind", "reason"))
UNAUTH_REPORTS_SUPPRESSED = counter("millwright_mqtt_unauthenticated_reports_suppressed_total",
                                    "Rejections of unauthenticated input not reported (rate limit)")

CANCELLED = "cancelled"
CONFLICT = "conflict"
QUOTA_EXCEEDED = "quota_exceeded"
RETRY_TIME_REASONS = (EXPIRED, SKEW, TOO_OLD)
REPORTS_PER_S = 5.0      # reports of unauthenticated input (status + audit), per agent
REPORTS_BURST = 20.0
# refused before (or by) the signature check: the sender is not known to be the cloud
UNAUTHENTICATED_REASONS = frozenset({TOO_LARGE, BAD_JSON, UNSIGNED, UNKNOWN_KID, BAD_SIGNATURE, UNSUPPORTED_ALG})


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


@dataclass
class StatusPlace:
    """Where the one status a push owes goes in the outbox, handed down the calls that
    handle that push: ``seq`` is the place reserved for it before the etcd write (taken by
    the first status written; a later one, and one with no place, is queued at the end),
    and in a group commit ``fills`` collects the filled places, written in one transaction
    for the whole batch (push_many)."""
    seq: Optional[int] = None
    fills: Optional[list] = None

    def take(self) -> Optional[int]:
        seq, self.seq = self.seq, None
        return seq


class Ingest:
    def __init__(self, *, store: JobStore, keyring, templates: dict, topics: Topics, agent_id: str,
                 max_bytes: int, max_skew_s: float, cluster: str, max_age_s: float = 86400.0, outbox=None,
                 record: Callable[..., None] = lambda *a, **k: None,
                 notify: Callable[[str, Any], None] = lambda kind, obj: None,
                 has_other_owner: Optional[Callable[[int], bool]] = None,
                 reports: Optional[TokenBucket] = None, answers=None,
                 members: Optional[Callable[[], Optional[dict]]] = None, quota: Optional[ClusterQuota] = None):
        self.store = store
        self.quota = quota   # the cluster's quotas on stored documents (None: not enforced)
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

    # --- helpers ----------------------------------------------------------------
    def _has_other_owner(self, shard: int) -> bool:
        kv = self.store.client.get(self.store.keys.shard(shard))
        return kv is not None and kv.value.decode() != self.agent_id

    def _status(self, job_id: Optional[str], state: str, payload: bytes, **extra: Any) -> dict:
        doc = {"v": 1, "job_id": job_id, "run_id": None, "fire_id": None, "state": state, "attempt": None,
               "agent": self.agent_id,
               "shard": shard_of(job_id, self.shards) if job_id else None, "ts": now_rfc3339(),
               "exit_code": None, "reason": None, "usage": None, "push_sha256": push_digest(payload)}
        doc.update({k: v for k, v in extra.items() if v is not None})
        name = answer_name(doc)
        if name is not None:
            doc["answer"] = name   # what the cloud dedupes answers on, with job_id (docs/contract.md)
        return doc

    def _emit(self, doc: dict, place: Optional[StatusPlace] = None, ledger: Optional[str] = None,
              marker: Optional[str] = None) -> None:
        if self.outbox is None:
            return
        topic = self.topics.status(doc.get("job_id"))
        seq = place.take() if place is not None else None
        if seq is not None and place is not None and place.fills is not None:  # a batch (push_many)
            place.fills.append((seq, topic, doc, ledger, marker))
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
        INGESTED.labels(kind, "dropped").inc()
        return Outcome(kind, "dropped", None, reason, status=self.report_unauthenticated(kind, payload, reason,
                                                                                         responsible))

    def report_unauthenticated(self, kind: str, payload: bytes, reason: str,
                               responsible: Callable[[int], bool]) -> Optional[dict]:
        """Input that failed the envelope (``kind``: push, cancel or get): counted; reported,
        reason only, on this agent's rejections topic and in the audit log when
        ``responsible(shard of the payload digest)`` and the report rate allows. Returns
        the report, if one was made."""
        UNAUTHENTICATED.labels(kind, reason).inc()
        digest = push_digest(payload)
        if not responsible(shard_of(digest, self.shards)):
            return None
        if not self.reports.take():
            UNAUTH_REPORTS_SUPPRESSED.inc()
            return None
        REJECTED.labels(reason).inc()
        self.record("job", event="rejected_unauthenticated", kind=kind, reason=reason, push_sha256=digest,
                    agent=self.agent_id)
        doc = {"v": 1, "state": JobState.REJECTED, "kind": kind, "reason": reason, "agent": self.agent_id,
               "ts": now_rfc3339(), "push_sha256": digest}
        if self.outbox is not None:
            self.outbox.enqueue(self.topics.rejections(), doc)
        return doc

    def _reject(self, kind: str, payload: bytes, job_id: Optional[str], reason: str, detail: str,
                as_owner: bool, place: Optional[StatusPlace] = None) -> Outcome:
        shard = shard_of(job_id, self.shards) if job_id else shard_of(push_digest(payload), self.shards)
        authenticated = kind == "push" and job_id is not None and self._authenticated(payload, reason)
        if not as_owner and self.has_other_owner(shard):
            INGESTED.labels(kind, "left_to_owner").inc()
            return Outcome(kind, "silent", job_id, reason, detail, authenticated=authenticated)
        REJECTED.labels(reason).inc()
        INGESTED.labels(kind, "rejected").inc()
        self.record("job", event="rejected", kind=kind, job=job_id, reason=reason, detail=detail,
                    push_sha256=push_digest(payload), agent=self.agent_id)
        log.info("push rejected" if kind == "push" else "cancel rejected",
                 extra={"fields": {"job_id": job_id, "reason": reason, "detail": detail}})
        doc = self._status(job_id, JobState.REJECTED, payload, reason=reason, detail=detail,
                           kind=None if kind == "push" else "cancel")
        marker = None
        if authenticated and self.answers is not None:
            marker = self.answers.write_rejection(shard, job_id, push_digest(payload), doc)
        self._emit(doc, place, marker=marker)
        return Outcome(kind, "rejected", job_id, reason, detail, doc, authenticated=authenticated)

    # --- push -------------------------------------------------------------------
    def push(self, payload: bytes, as_owner: bool = True, screened: bool = False) -> Outcome:
        """Raises EtcdUnavailable (retry; do not acknowledge). Never anything else for any payload.
        ``screened``: these very bytes passed :meth:`screen` (signature and binding checked at
        arrival), so parse_job does not verify the signature a second time."""
        payload = bytes(payload)
        job_id = peek_id(payload, self.max_bytes)
        try:
            job = self._parse(payload, datetime.now(timezone.utc), screened)
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
            return self._drop("push", payload, BAD_FIELD, lambda shard: as_owner)
        # the status's place is reserved before the etcd write (see Outbox.reserve); a path
        # that ends without a status, or an exception, gives the reservation back
        place = StatusPlace(self.outbox.reserve(self.topics.status(job.id)) if self.outbox is not None else None)
        try:
            return self._push_store(payload, job, as_owner, place)
        finally:
            seq = place.take()
            if seq is not None and self.outbox is not None:
                self.outbox.release(seq)

    def _parse(self, payload: bytes, now: Optional[datetime], screened: bool = False) -> Job:
        """The push's document, read with this agent's limits (the one parse_job call).
        ``now`` None leaves out the clock's checks (expiry, age, skew); ``screened``: these
        bytes passed :meth:`screen`, so the signature is not verified a second time."""
        return parse_job(payload, templates=self.templates, keyring=self.keyring, now=now,
                         max_skew_s=self.max_skew_s, max_bytes=self.max_bytes, cluster=self.cluster,
                         max_age_s=self.max_age_s, verify_signature=not screened)

    def _answer_of(self, payload: bytes, job) -> tuple[dict, Optional[str], tuple]:
        """The accepted status of a push, its marker key, and the marker's put (if markers are on)."""
        shard = shard_of(job.id, self.shards)
        doc = self._status(job.id, JobState.ACCEPTED, payload, shard=shard)
        doc.update(answer_fields(job.doc, self.keyring, self.templates))   # waiting_approval (four-eyes)
        if job.target is not None:
            from agent.jobs.view import placement_view

            where = placement_view(job.doc, self.members())
            if where is not None:
                doc["placement"] = where
        if self.answers is None:
            return doc, None, ()
        marker = self.store.keys.answer(shard, job.id, "accepted")  # durable with the job (answers.py)
        return doc, marker, (Put(marker, json.dumps(doc, separators=(",", ":"))),)

    def _over_quota(self, payload: bytes, job) -> Optional[str]:
        """Why storing this push would pass a cluster quota (agent/coordination/quota.py),
        or None; a push of a job already stored is answered as before, whatever the quota."""
        if self.quota is None:
            return None
        over = self.quota.check(len(payload))
        return over if over is not None and self.store.get(job.id) is None else None

    def _push_store(self, payload: bytes, job, as_owner: bool, place: StatusPlace) -> Outcome:
        over = self._over_quota(payload, job)
        if over is not None:
            return self._reject("push", payload, job.id, QUOTA_EXCEEDED, f"quotas: {over}", as_owner, place)
        doc, marker, also = self._answer_of(payload, job)
        try:
            created: Any = self.store.create(job.doc, also)
        except (JobCancelled, JobConflict) as exc:
            created = exc
        return self._push_result(payload, job, as_owner, created, doc, marker, place)

    def _push_result(self, payload: bytes, job, as_owner: bool, created: Any, doc: dict,
                     marker: Optional[str], place: StatusPlace) -> Outcome:
        """The answer once the create's outcome is known: (CREATED|EXISTS, stored) or the
        JobCancelled/JobConflict it raised."""
        if isinstance(created, JobCancelled):
            return self._reject("push", payload, job.id, CANCELLED, f"id: job {job.id} was cancelled; "
                                "a cancelled id cannot be pushed again", as_owner, place)
        if isinstance(created, JobConflict):
            return self._reject("push", payload, job.id, CONFLICT, self._conflict(job), as_owner, place)
        result, stored = created
        if result == APPROVED:   # the stored document gained approvals: answered like a new push, unmarked
            doc = {**self._status(job.id, JobState.ACCEPTED, payload, shard=stored.shard),
                   **answer_fields(stored.doc, self.keyring, self.templates)}
            self._emit(doc, place)
            INGESTED.labels("push", "approved").inc()
            for kid, role in job.signers[1:]:
                self.record("job", event="approval", job=job.id, kid=kid, role=role, agent=self.agent_id)
            self.notify("stored", stored)
            return Outcome("push", "accepted", job.id, status=doc, stored=stored)
        if result == CREATED:
            if self.quota is not None:
                self.quota.stored(len(payload))
            self._emit(doc, place, ledger=job.id, marker=marker)
            INGESTED.labels("push", "accepted").inc()
            self.record("job", event="accepted", job=job.id, shard=stored.shard, template=job.template,
                        push_sha256=push_digest(payload), agent=self.agent_id,
                        signers=[{"kid": k, "role": r} for k, r in job.signers])
            self.notify("stored", self._with_parsed(stored, job))
            return Outcome("push", "accepted", job.id, status=doc, stored=stored)
        return self._exists(payload, stored, as_owner, place)

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
                job = self._parse(bytes(payload), now, screened)
            except Exception:  # rejected (or a bug): the one-push path answers it as before
                later.append(i)
                continue
            if job.id in ids or (self.quota is not None and self.quota.check(len(payload)) is not None):
                later.append(i)   # (a push past a quota: the one-push path answers it)
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
            for (i, payload, job, as_owner), (doc, marker, _), result, seq in zip(batch, answers, created, seqs):
                place = StatusPlace(seq, fills)
                try:
                    out[i] = self._push_result(payload, job, as_owner, result, doc, marker, place)
                except (EtcdUnavailable, EtcdError) as exc:  # e.g. writing a rejection's marker
                    out[i] = exc
                if place.seq is not None:
                    unfilled.append(place.seq)
            if self.outbox is not None:
                self.outbox.fill_many(fills)  # before any of them is acknowledged
        except BaseException:
            unfilled = [q for q in seqs if q is not None]  # fill_many is one transaction: none filled
            raise
        finally:
            if self.outbox is not None:
                self.outbox.release_many(unfilled)

    def _conflict(self, job) -> str:
        """The detail of a conflict: which fields differ from the stored job (unknown for a
        finished job's tombstone, which keeps only a digest), and, when only ``issued_at``
        does (the same file pushed again, stamped anew), how to repeat the push."""
        detail = f"id: job {job.id} already exists with different content"
        stored = self.store.get(job.id)
        if stored is None or stored.tombstone:
            return detail
        mine, theirs = job.doc, public_doc(stored.doc)
        differ = sorted(k for k in set(mine) | set(theirs) if k != "sig" and mine.get(k) != theirs.get(k))
        if differ == ["issued_at"]:
            return (f"{detail}: only issued_at differs (stored {theirs.get('issued_at')}, this push "
                    f"{mine.get('issued_at')}); to repeat the push, sign it with the stored issued_at "
                    f"(millwright push --issued-at {theirs.get('issued_at')})")
        return f"{detail} ({', '.join(differ)} differ)" if differ else detail

    def _stored_twin(self, payload: bytes):
        """The stored job if this payload is a valid, signed copy of it (ignoring the clock)."""
        try:
            job = self._parse(payload, None)   # the clock's checks left out
        except JobRejected:
            return None
        stored = self.store.get(job.id)
        if stored is None or stored.cancelled or (stored.tombstone and not stored.finished):
            return None
        return stored if stored.same_content(job.doc) else None

    def _exists(self, payload: bytes, stored, as_owner: bool, place: Optional[StatusPlace] = None) -> Outcome:
        by = (stored.doc.get("_accepted") or {}).get("by")
        job_id = stored.id
        if by == self.agent_id and self.outbox is not None and not self.outbox.in_ledger(job_id):
            # created by us, but we died before the status was written: this is its first answer
            doc = self._status(job_id, JobState.ACCEPTED, payload, shard=stored.shard)
            self._emit(doc, place, ledger=job_id, marker=None if self.answers is None else
                       self.store.keys.answer(stored.shard, job_id, "accepted"))
            INGESTED.labels("push", "accepted").inc()
            self.notify("stored", stored)
            return Outcome("push", "accepted", job_id, status=doc, stored=stored)
        if by == self.agent_id or as_owner:
            doc = self._status(job_id, JobState.ACCEPTED, payload, shard=stored.shard, redelivery=True)
            self._emit(doc, place)
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
            return self._drop("cancel", payload, BAD_FIELD, lambda shard: as_owner)
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
                doc = self._status(job_id, RecordState.CANCELLED, payload, reason="cancelled_by_cloud",
                                   redelivery=True)
                self._emit(doc)
                INGESTED.labels("cancel", "redelivery").inc()
                return Outcome("cancel", "redelivery", job_id, status=doc)
            else:
                INGESTED.labels("cancel", "exists").inc()
                return Outcome("cancel", "silent", job_id)
        detail = "cancelled before the push arrived; a later push of this id is refused" if state == "tombstone" else None
        doc = self._status(job_id, RecordState.CANCELLED, payload, reason="cancelled_by_cloud", detail=detail)
        self._emit(doc, ledger=ledger_key)
        INGESTED.labels("cancel", "cancelled").inc()
        self.record("job", event="cancelled", job=job_id, by="cloud", agent=self.agent_id, state=state)
        self.notify("cancelled", job_id)
        return Outcome("cancel", "cancelled", job_id, status=doc)
