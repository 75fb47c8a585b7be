"""The durable job store: jobs/<NNNN>/<job_id> in etcd.

Values are the job document as pushed (signature included), plus reserved keys that
start with "_": `_accepted` {at, by} written once at creation (the anchor for relative
schedules, identical on every agent) and `_cancelled` {at, by} once cancelled. A cancel
that arrives before its push leaves a tombstone, so a later push of that id is refused.

Retention (agent/jobs/retention.py) replaces a job that can never fire again, once
``retention.finished_job_s`` has passed, by a *finished tombstone*: ``{id, _tombstone,
_finished {at, reason}, _digest, _accepted[, _cancelled]}`` (~300 bytes), so that a
redelivered push is still answered as before (same content: exists; other content:
conflict; cancelled: cancelled). Tombstones go after ``retention.tombstone_s``.

Create is idempotent and needs one round trip: a create-revision==0 transaction that
reads the existing value in its failure branch. Same id + same canonical content is a
no-op; different content is a conflict. ``create_many`` groups several such creates into
one transaction (the ingest group commit: one etcd round trip and fsync for a batch of
pushes). Thread-safe: the MQTT ingest path calls it from
paho's thread (the durable write must finish before the PUBACK).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from agent.coordination import placement
from agent.coordination.etcd import KV, Create, EtcdClient, Get, Mod, Put, Txn
from agent.coordination.keys import Keys, shard_of
from agent.runtime.metrics import counter
from agent.runtime.timefmt import now_rfc3339

STORE_OPS = counter("millwright_job_store_ops_total", "Job store operations by result", ("op", "result"))

CREATED = "created"
EXISTS = "exists"
APPROVED = "approved"   # the stored document gained approvals (a push of it with more signatures)


class JobConflict(Exception):
    """Same id, different content."""


class JobCancelled(Exception):
    """The id was cancelled: a replay is refused."""


def public_doc(stored: dict) -> dict:
    """The job document without the store's reserved keys."""
    return {k: v for k, v in stored.items() if not k.startswith("_")}


def _canonical(doc: dict) -> bytes:
    return json.dumps(public_doc(doc), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def with_approvals(stored: dict, pushed: dict) -> Optional[dict]:
    """``stored`` with the approvals of ``pushed`` it lacks (by key id), when the two are the
    same document apart from ``approvals``; ``stored`` itself when nothing is new; None
    when they differ in anything else (a conflict). The approvals were verified by the
    push's parse (agent/jobs/approvals.py); the agents verify the merged document again."""
    bare = lambda d: {k: v for k, v in d.items() if k != "approvals"}   # noqa: E731
    if _canonical(bare(stored)) != _canonical(bare(pushed)):
        return None
    raw = stored.get("approvals")
    have: list = raw if isinstance(raw, list) else []
    kids = {a.get("kid") for a in have if isinstance(a, dict)}
    new = [a for a in pushed.get("approvals") or [] if isinstance(a, dict) and a.get("kid") not in kids]
    return {**stored, "approvals": [*have, *new]} if new else stored


def content_digest(doc: dict) -> str:
    return hashlib.sha256(_canonical(doc)).hexdigest()


def finished_tombstone(stored: dict, at: str, reason: str) -> dict:
    """What stays of a finished job: enough to answer a redelivered push as before."""
    tomb = {"id": stored.get("id"), "_tombstone": True, "_finished": {"at": at, "reason": reason},
            "_digest": content_digest(stored)}
    for k in ("_accepted", "_cancelled"):
        if k in stored:
            tomb[k] = stored[k]
    return tomb


@dataclass(frozen=True)
class StoredJob:
    shard: int
    doc: dict            # as stored, reserved keys included
    revision: int        # mod revision (for compare-and-swap)
    create_revision: int
    # the verified Job this agent just stored (set by ingest on the create path only, never
    # for a document read back from etcd): the scheduler installs it without parsing and
    # verifying the same bytes a second time
    parsed: Any = field(default=None, compare=False, repr=False)
    # the etcd key it was read from ("" when written by this agent): a document runs only
    # under its own key (agent/jobs/catalog.py), so a copy elsewhere is refused
    key: str = field(default="", compare=False)
    size: int = field(default=0, compare=False)   # bytes of the stored value (0: not read from etcd)

    @property
    def id(self) -> str:
        return self.doc.get("id", "")

    @property
    def cancelled(self) -> bool:
        return "_cancelled" in self.doc

    @property
    def tombstone(self) -> bool:
        return self.doc.get("_tombstone", False)

    @property
    def finished(self) -> bool:
        """A finished tombstone: the job ran to its end and retention removed its body."""
        return "_finished" in self.doc

    def same_content(self, doc: dict) -> bool:
        """Is doc (a job document) the content stored here (also for a finished tombstone)?"""
        if self.finished:
            return self.doc.get("_digest") == content_digest(doc)
        return _canonical(self.doc) == _canonical(doc)

    @property
    def accepted_at(self) -> Optional[str]:
        return (self.doc.get("_accepted") or {}).get("at")


def _stored(shard: int, kv: KV) -> StoredJob:
    return StoredJob(shard, json.loads(kv.value), kv.mod_revision, kv.create_revision, key=kv.key,
                     size=len(kv.value))


class JobStore:
    def __init__(self, client: EtcdClient, keys: Keys, shards: int, agent_id: str):
        self.client = client
        self.keys = keys
        self.shards = shards
        self.agent_id = agent_id

    def key(self, job_id: str) -> tuple[int, str]:
        s = shard_of(job_id, self.shards)
        return s, self.keys.job(s, job_id)

    def create(self, doc: dict, also: tuple = ()) -> tuple[str, StoredJob]:
        """Store a validated job document. Returns (CREATED|EXISTS, stored).
        ``also``: more puts done in the same transaction only if the job is created (the
        answer marker, agent/cloud/answers.py). Raises JobConflict, JobCancelled, EtcdUnavailable."""
        shard, key = self.key(doc["id"])
        stored, value = self._accepted(doc)
        r = self.client.txn([Create(key) == 0], [Put(key, value), *self._pool_puts(doc), *also], [Get(key)])
        if r.succeeded:
            STORE_OPS.labels("create", "created").inc()
            return CREATED, StoredJob(shard, stored, r.revision, r.revision)
        kvs = r.responses[0]
        if not kvs:  # deleted between compare and read: cannot happen in one txn, but be safe
            return self.create(doc, also)
        return self._judge(doc, _stored(shard, kvs[0]))

    def create_many(self, items: list[tuple[dict, tuple]]) -> list:
        """Group commit: store several validated job documents in ONE etcd transaction, each
        as its own nested create-if-absent transaction, so each keeps its own outcome (one
        id that exists, conflicts or was cancelled does not fail the others). Returns, per
        item, (CREATED|EXISTS, stored) or the JobConflict/JobCancelled it raised. The ids
        must be distinct (etcd refuses two puts of one key in a transaction) and the batch
        within etcd's limits (--max-txn-ops, --max-request-bytes): the caller bounds it.
        Raises EtcdUnavailable/EtcdError for the whole batch: then nothing was stored."""
        if not items:
            return []
        prepared, ops, pools = [], [], {}
        for doc, also in items:
            shard, key = self.key(doc["id"])
            stored, value = self._accepted(doc)
            prepared.append((shard, key, stored))
            ops.append(Txn([Create(key) == 0], [Put(key, value), *also], [Get(key)]))
            for put in self._pool_puts(doc):  # once per batch: etcd refuses a key put twice in one txn
                pools[put.key] = put
        r = self.client.txn([], [*pools.values(), *ops], [])
        responses = r.responses[len(pools):]
        out: list = []
        for (doc, also), (shard, _key, stored), resp in zip(items, prepared, responses):
            if resp.succeeded:
                STORE_OPS.labels("create", "created").inc()
                out.append((CREATED, StoredJob(shard, stored, r.revision, r.revision)))
                continue
            kvs = resp.responses[0] if resp.responses else []
            try:
                if not kvs:  # as in create(): cannot happen within one transaction
                    out.append(self.create(doc, also))
                else:
                    out.append(self._judge(doc, _stored(shard, kvs[0])))
            except (JobConflict, JobCancelled) as exc:
                out.append(exc)
        return out

    def _accepted(self, doc: dict) -> tuple[dict, str]:
        stored = dict(doc)
        stored["_accepted"] = {"at": now_rfc3339(), "by": self.agent_id}
        return stored, json.dumps(stored, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    def _judge(self, doc: dict, existing: StoredJob) -> tuple[str, StoredJob]:
        """The answer to a create whose id is already stored: exists, conflict or cancelled."""
        if existing.finished and not existing.cancelled:
            if not existing.same_content(doc):
                STORE_OPS.labels("create", "conflict").inc()
                raise JobConflict(f"job {doc['id']} exists with different content")
            STORE_OPS.labels("create", "exists").inc()
            return EXISTS, existing
        if existing.cancelled or existing.tombstone:
            STORE_OPS.labels("create", "cancelled").inc()
            raise JobCancelled(f"job {doc['id']} was cancelled at {existing.doc['_cancelled'].get('at')}")
        if _canonical(existing.doc) != _canonical(doc):
            merged = with_approvals(existing.doc, doc)
            if merged is None:
                STORE_OPS.labels("create", "conflict").inc()
                raise JobConflict(f"job {doc['id']} exists with different content")
            if merged is not existing.doc:
                return self._approve(doc, existing, merged)
        STORE_OPS.labels("create", "exists").inc()
        return EXISTS, existing

    def _approve(self, doc: dict, existing: StoredJob, merged: dict) -> tuple[str, StoredJob]:
        """Store the document with its added approvals, unless it changed since it was read
        (then the push is judged again against what is there now)."""
        key = self.keys.job(existing.shard, existing.id)
        value = json.dumps(merged, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        r = self.client.txn([Mod(key) == existing.revision], [Put(key, value)], [Get(key)])
        if r.succeeded:
            STORE_OPS.labels("create", "approved").inc()
            return APPROVED, StoredJob(existing.shard, merged, r.revision, existing.create_revision)
        kvs = r.responses[0]
        if not kvs:
            return self.create(doc)
        return self._judge(doc, _stored(existing.shard, kvs[0]))

    def _pool_puts(self, doc: dict) -> list:
        """A targeted job registers its placement pool (pools/<pool>/spec), in the job's own
        create transaction: agents learn of the pool before any could miss its jobs."""
        spec = placement.pool_spec(doc.get("target"), str(doc.get("template", "")))
        if spec is None:
            return []
        try:
            spec = placement.pool_spec(placement.check_target(doc["target"]), str(doc.get("template", "")))
        except placement.TargetError:
            return []
        text = json.dumps(spec, sort_keys=True, separators=(",", ":"))
        return [Put(self.keys.pool_spec(placement.pool_id(spec)), text)]

    def get(self, job_id: str) -> Optional[StoredJob]:
        shard, key = self.key(job_id)
        kv = self.client.get(key)
        return _stored(shard, kv) if kv else None

    def exists(self, job_id: str) -> bool:
        return self.get(job_id) is not None

    def cancel(self, job_id: str, reason: str = "cancelled") -> tuple[str, Optional[StoredJob]]:
        """Mark a job cancelled (or leave a tombstone). Returns (state, stored):
        'cancelled', 'already_cancelled' or 'tombstone'."""
        shard, key = self.key(job_id)
        mark = {"at": now_rfc3339(), "by": self.agent_id, "reason": reason}
        for _ in range(5):
            kv = self.client.get(key)
            if kv is None:
                tomb = json.dumps({"id": job_id, "_tombstone": True, "_cancelled": mark}, sort_keys=True)
                r = self.client.txn([Create(key) == 0], [Put(key, tomb)], [])
                if r.succeeded:
                    STORE_OPS.labels("cancel", "tombstone").inc()
                    return "tombstone", None
                continue
            cur = _stored(shard, kv)
            if cur.cancelled:
                return "already_cancelled", cur
            doc = dict(cur.doc)
            doc["_cancelled"] = mark
            value = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            r = self.client.txn([Mod(key) == kv.mod_revision], [Put(key, value)], [])
            if r.succeeded:
                STORE_OPS.labels("cancel", "cancelled").inc()
                return "cancelled", StoredJob(shard, doc, r.revision, cur.create_revision)
        raise JobConflict(f"job {job_id} changed while cancelling; retry")

    def list_shard(self, shard: int, revision: int = 0) -> tuple[list[StoredJob], int]:
        """The shard's jobs (paged reads: see EtcdClient.range_pages)."""
        kvs, rev = self.client.get_prefix(self.keys.jobs_prefix(shard), revision=revision)
        out = []
        for kv in kvs:
            try:
                out.append(_stored(shard, kv))
            except ValueError:
                continue
        return out, rev
