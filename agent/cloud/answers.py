"""Durable answers: every answer the cloud is owed is in etcd until the broker has it.

An *answer* is the ``accepted`` status of a stored push, the ``rejected`` status of an
authenticated push, or the final status of a run. Each is written to etcd as a marker,
``answers/<NNNN>/<job_id>/<name>`` (name ``accepted``, ``rejected.<push_sha256>`` or
``run.<fire_id>``; value: the status document), in the same transaction as the fact it
answers:

- ``accepted``: in the job's create transaction (JobStore.create ``also``);
- ``rejected.<digest>``: its own put, fenced with the shard's token when the rejecting
  agent owns the shard (a non-owner only answers when nobody owns it);
- ``run.<fire_id>``: in the fenced transaction that writes the final run record.

The agent that wrote it also puts the status in its outbox with the marker's key. When
the broker acknowledges that status (PUBACK), the marker is deleted (:meth:`Answers.delivered`,
batched: up to CLEAR_BATCH deletes, gathered for at most CLEAR_LINGER_S, in one transaction).
A marker therefore exists only while its answer may not have reached the broker (or for
those CLEAR_LINGER_S more): the set is as small as the outbox, and empties itself as
statuses flow. Deleting needs no fence: it states a fact about the broker ("this document was delivered"), not a right to
act for the shard; a stale delete can at worst remove a marker whose twin was delivered.

Before a status with a marker is first handed to paho, its marker is stamped ``handed``
(:meth:`Answers.handing`; a republished copy also stamps its ``published_by``). No stamp
means never sent: while etcd refuses the stamp the publisher holds those rows (and what
follows them, the outbox publishes in order) and retries, 0.25 s doubling to 5 s (counted
``millwright_answers_total{event="hand_held"}``); it never sends an unstamped answer.

Agents do not read each other's statuses on the broker (one connection per agent; the ACL
lets an agent read only the cluster's push, cancel and get topics): what an agent knows of
another's answers is etcd alone. The shard's owner sweeps its shards' markers (see
:meth:`sweep`): one whose writer is gone (no ``members/<writer>`` key: kill -9, power loss)
or that is older than ``republish_after_s`` and not in its own outbox is published with
``"published_by": <its id>``, rebuilt from the fact it answers (agent/cloud/facts.py; a
marker without one is deleted, counted ``unfounded`` and audited): unmarked (the first
answer) only if the marker has no ``handed`` stamp, since then the first answer was never
sent; else marked ``"redelivery": true`` (it may have reached the broker). So after a
takeover the new owner publishes what the dead agent left undelivered, within a sweep: the
cloud gets every answer at least once, unmarked at most once (but for a writer alive and
stuck past ``republish_after_s`` that hands its unstamped copy after all), and dedupes on
``job_id`` and ``answer`` (docs/contract.md).

Bounded: markers older than ``keep_s`` (7 days) are deleted by the sweep without being
published (counted in millwright_answers_expired_total, audit ``gap`` record).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from datetime import datetime, timezone
from typing import Callable, Optional

from agent.coordination.etcd import Delete, EtcdError, EtcdUnavailable, Put, Version
from agent.coordination.fencing import Fence, StaleToken, fenced_txn
from agent.coordination.keys import Keys
from agent.jobs.states import TERMINAL, JobState
from agent.jobs.view import read_prefix
from agent.runtime.metrics import counter

from .facts import Unfounded, marker_writer, rebuild

log = logging.getLogger(__name__)

MARKERS = counter("millwright_answers_total", "Durable answer markers by event (written, handed, hand_held, "
                  "cleared, republished, unfounded, expired)", ("event",))

KEEP_S = 7 * 86400
CLEAR_BATCH = 64
CLEAR_LINGER_S = 0.25  # how long delivered markers wait for company before their delete
HOLD_MIN_S = 0.25   # a refused ``handed`` stamp is retried after this, doubling
HOLD_MAX_S = 5.0    # up to this
HOLD_CALL_S = 5.0   # one handing() call waits at most this long, then the publisher goes round


def answer_name(doc: dict) -> Optional[str]:
    """The marker name a status document answers (accepted, rejected.<digest>, run.<fire_id>)."""
    state = doc.get("state")
    if state == JobState.ACCEPTED and doc.get("push_sha256"):
        return "accepted"
    if state == JobState.REJECTED and doc.get("push_sha256") and doc.get("kind") is None:
        return "rejected." + doc["push_sha256"]
    if state in TERMINAL and isinstance(doc.get("fire_id"), str) and doc["fire_id"]:
        return "run." + doc["fire_id"]
    return None


def marker_value(doc: dict) -> str:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, default=str)


def _age_s(doc: dict, now: float) -> float:
    ts = doc.get("ts")
    try:
        t = datetime.strptime(str(ts), "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()
    except (TypeError, ValueError):
        try:
            from agent.jobs.schedule import parse_rfc3339

            t = parse_rfc3339(ts).timestamp()
        except Exception:
            return 0.0
    return max(0.0, now - t)


def decide(doc: dict, writer_alive: bool, in_my_outbox: bool, age_s: float, republish_after_s: float,
           keep_s: float = KEEP_S) -> str:
    """What the shard's owner does with a marker: ``expire``, ``republish`` or ``skip``.
    Whether a republished copy is marked ``redelivery`` is :func:`redelivery`'s."""
    if age_s > keep_s:
        return "expire"
    if in_my_outbox:
        return "skip"          # ours, still on its way
    if not writer_alive:
        return "republish"     # the writer died before its outbox delivered it
    if age_s > republish_after_s:
        return "republish"     # the writer is alive but has not delivered it for too long
    return "skip"


def redelivery(doc: dict) -> bool:
    """A republished copy is a redelivery unless its marker has no ``handed`` stamp: no
    stamp means the first answer was never sent (:meth:`Answers.handing` sends nothing it
    could not stamp)."""
    return bool(doc.get("handed"))


class Answers:
    """Marker writes for the ingest path, deletes after PUBACK, and the owner's sweep."""

    def __init__(self, client, keys: Keys, agent_id: str, *, enqueue: Callable[[str, dict, str], None],
                 in_outbox: Callable[[str], bool], owned: Callable[[], frozenset],
                 fence_for: Callable[[int], Optional[Fence]], sweep_s: float = 1.0, republish_after_s: float = 30.0,
                 keep_s: float = KEEP_S, record: Callable[..., None] = lambda *a, **k: None,
                 connected: Callable[[], bool] = lambda: True, full_every_s: float = 10.0):
        self.client = client
        self.keys = keys
        self.agent_id = agent_id
        self.enqueue = enqueue          # (job_id, doc, marker_key) -> outbox
        self.in_outbox = in_outbox
        self.owned = owned
        self.fence_for = fence_for
        self.sweep_s = sweep_s
        self.republish_after_s = republish_after_s
        self.keep_s = keep_s
        self.record = record
        self.connected = connected
        self.full_every_s = full_every_s
        self._last_view: Optional[tuple] = None
        self._last_full = 0.0
        self._cleared: "queue.Queue[str]" = queue.Queue()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._republished: dict[str, float] = {}   # marker key -> when we last enqueued it
        self._hold_s = 0.0   # publisher thread: the wait before the next stamp attempt (0: none failed)

    # --- ingest side (worker threads) -------------------------------------------------
    def write_rejection(self, shard: int, job_id: str, digest: str, doc: dict) -> str:
        """Record an authenticated push's rejection before it is acknowledged. Raises
        EtcdUnavailable (the caller retries; nothing is acknowledged)."""
        key = self.keys.answer(shard, job_id, "rejected." + digest)
        fence = self.fence_for(shard)
        if fence is not None:
            try:
                fenced_txn(self.client, fence, success=[Put(key, marker_value(doc))])
                MARKERS.labels("written").inc()
                return key
            except StaleToken:
                pass  # lost the shard meanwhile: answered as a non-owner (nobody else will)
        self.client.put(key, marker_value(doc))
        MARKERS.labels("written").inc()
        return key

    # --- publisher side -------------------------------------------------------------
    def handing(self, items: list[tuple[str, bytes]]) -> bool:
        """Publisher thread, before it first hands these answers to the broker: stamp their
        markers ``"handed": true`` (only those that still exist), so a peer that publishes
        them later knows whether this is their first publication (no ``redelivery``) or may
        repeat one. True once every marker is stamped: only then may the rows go out. While
        etcd refuses, retried after 0.25 s doubling to 5 s (each refusal counted
        ``hand_held``); False after HOLD_CALL_S or at stop, and the publisher holds the rows
        and asks again (a marker never stamped is an answer never sent)."""
        from etcd3 import transactions as tx

        ops = []
        for key, payload in dict(items).items():
            try:
                doc = json.loads(payload)
            except ValueError:
                continue
            doc.pop("seq", None)
            doc.pop("redelivery", None)
            doc["handed"] = True
            ops.append(tx.Txn(compare=[Version(key) > 0], success=[Put(key, marker_value(doc))], failure=[]))
        deadline = time.monotonic() + HOLD_CALL_S
        while ops:
            if self._hold_s and self._stop.wait(self._hold_s) or self._stop.is_set():
                return False
            batch = ops[:CLEAR_BATCH]
            try:
                self.client.txn([], batch, [], timeout=1.0)
            except (EtcdUnavailable, EtcdError) as exc:
                MARKERS.labels("hand_held").inc(len(batch))
                if not self._hold_s:
                    log.warning("answers held: their markers cannot be stamped handed in etcd; retrying",
                                extra={"fields": {"count": len(ops), "error": str(exc)[:200]}})
                self._hold_s = min(HOLD_MAX_S, max(HOLD_MIN_S, 2 * self._hold_s))
                if time.monotonic() >= deadline:
                    return False
                continue
            MARKERS.labels("handed").inc(len(batch))
            ops = ops[CLEAR_BATCH:]
            if self._hold_s:
                log.info("answers stamped handed again: publishing")
            self._hold_s = 0.0
        return True

    def delivered(self, markers: list[str]) -> None:
        """The broker acknowledged these answers (publisher thread): delete their markers."""
        for m in markers:
            if m:
                self._cleared.put(m)

    # --- thread -------------------------------------------------------------------------
    def start(self) -> "Answers":
        self._thread = threading.Thread(target=self._run, name="mqtt-answers", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._cleared.put("")
        if self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        next_sweep = time.monotonic() + self.sweep_s
        pending: list[str] = []
        while not self._stop.is_set():
            try:
                m = self._cleared.get(timeout=max(0.01, next_sweep - time.monotonic()))
                if m:
                    pending.append(m)
                self._take(pending)
                if m and len(pending) < CLEAR_BATCH and not self._stop.wait(CLEAR_LINGER_S):
                    # off the answer's path (it is delivered): a trickle of answers costs one
                    # etcd write per CLEAR_LINGER_S, not one each; a full batch goes at once
                    self._take(pending)
            except queue.Empty:
                pass
            if pending:
                pending = self._clear(pending)
            if time.monotonic() >= next_sweep:
                try:
                    self.sweep()
                except (EtcdUnavailable, EtcdError) as exc:
                    log.debug("answer sweep failed; next time", extra={"fields": {"error": str(exc)[:200]}})
                except Exception:
                    log.exception("answer sweep failed")
                next_sweep = time.monotonic() + self.sweep_s

    def _take(self, pending: list[str]) -> None:
        """What is queued, up to a batch (without waiting)."""
        try:
            while len(pending) < CLEAR_BATCH:
                m = self._cleared.get_nowait()
                if m:
                    pending.append(m)
        except queue.Empty:
            pass

    def _clear(self, keys: list[str]) -> list[str]:
        """Delete markers in one transaction; returns what is left to retry."""
        batch = list(dict.fromkeys(keys))[:CLEAR_BATCH]
        rest = keys[len(batch):] if len(set(keys)) == len(keys) else [k for k in keys if k not in set(batch)]
        try:
            self.client.txn([], [Delete(k) for k in batch], [])
        except (EtcdUnavailable, EtcdError) as exc:
            log.debug("clearing answer markers failed; retrying", extra={"fields": {"error": str(exc)[:200]}})
            self._stop.wait(0.3)
            return batch + rest
        MARKERS.labels("cleared").inc(len(batch))
        for k in batch:
            self._republished.pop(k, None)
        return rest

    def sweep(self, force: bool = False) -> int:
        """Republish (or expire) the markers of the shards this agent owns. Returns how many
        were republished.

        Cheap when nothing changed: each call reads only the member ids (keys only); the
        markers are read when the members or this agent's shards changed since the last
        full sweep (a writer died, a takeover), every ``full_every_s``, or when forced, and
        only after one count of all markers says there are any (an idle cluster has none:
        one small request instead of one per owned shard). Nothing is read while the
        broker is unreachable (``connected``): the markers then pile up by design and would
        only be re-queued behind the same outage."""
        owned = self.owned()
        if not owned or not self.connected():
            return 0
        members = frozenset(kv.key.rsplit("/", 1)[-1] for kv in
                            read_prefix(self.client, self.keys.members_prefix(), keys_only=True))
        mono = time.monotonic()
        view = (owned, members)
        if not force and view == self._last_view and mono - self._last_full < self.full_every_s:
            return 0
        self._last_view, self._last_full = view, mono
        if not self.client.count_prefix(self.keys.answers_prefix()):
            self._republished.clear()
            return 0
        by_shard = sorted(owned)
        candidates: list = []
        for shard in by_shard:
            candidates.extend(read_prefix(self.client, self.keys.answers_prefix(shard)))
        if not candidates:
            self._republished.clear()
            return 0
        now = time.time()
        n = 0
        for kv in candidates:
            try:
                doc = json.loads(kv.value)
            except (ValueError, RecursionError):
                doc = None
            rest = kv.key[len(self.keys.answers_prefix()):].split("/")
            if not isinstance(doc, dict) or len(rest) != 3 or not rest[0].isdigit():
                self._unfounded(kv.key, None, "bad_marker")
                continue
            shard, job_id, name = int(rest[0]), rest[1], rest[2]
            writer = marker_writer(doc)
            last = self._republished.get(kv.key)
            mine = self.in_outbox(kv.key) or (last is not None and now - last < self.republish_after_s)
            what = decide(doc, writer in members, mine, _age_s(doc, now), self.republish_after_s, self.keep_s)
            if what == "expire":
                self.client.delete(kv.key)
                MARKERS.labels("expired").inc()
                self.record("gap", source="answers", count=1, reason="answer_expired", key=kv.key)
            elif what == "republish":
                try:
                    out = rebuild(self.client, self.keys, shard, job_id, name, doc)
                except Unfounded as exc:
                    self._unfounded(kv.key, job_id, exc.reason, writer)
                    continue
                if redelivery(doc):
                    out["redelivery"] = True  # its writer may have delivered it: a re-publication
                out["answer"] = name
                out["published_by"] = self.agent_id
                self._republished[kv.key] = now
                self.enqueue(job_id, out, kv.key)
                MARKERS.labels("republished").inc()
                n += 1
        if n:
            log.info("answers republished after their writer was gone", extra={"fields": {"count": n}})
        return n

    def _unfounded(self, key: str, job_id: Optional[str], reason: str, writer: Optional[str] = None) -> None:
        """A marker that states no fact etcd holds (written by some etcd client, not by an
        agent answering): deleted, never published; counted and audited."""
        self.client.delete(key)
        MARKERS.labels("unfounded").inc()
        log.warning("answer marker without a fact behind it deleted unpublished",
                    extra={"fields": {"key": key, "reason": reason, "writer": writer}})
        self.record("job", event="answer_unfounded", job=job_id, key=key, reason=reason, writer=writer)
