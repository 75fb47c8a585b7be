"""The durable status outbox: SQLite in the state dir, published in order, deleted on PUBACK.

Every status document (and every audit checkpoint) is first inserted here, then a publisher
thread sends the rows in sequence order with QoS 1 and deletes a row only when the broker
has acknowledged it (paho's on_publish). Rows survive agent restarts (kill -9 included:
WAL with synchronous=NORMAL makes every commit survive a process crash) and broker outages:
on reconnect paho retransmits what was in flight (same connection state, clean_session=False)
and the publisher continues after it, so the order per job is the insertion order.

Each published document carries ``seq`` (this agent's outbox sequence, never reused) so a
consumer can drop transport duplicates by (agent, seq). A row that had already been handed
to the broker by an earlier process is sent again with ``"redelivery": true``.

Bounded: at most ``outbox_max`` rows. When full, the configured policy applies:
- ``drop_oldest_terminal`` (default): keep the answers that matter - final run states
  (succeeded, failed, timed_out, killed, cancelled, misfired), accepted, rejected and audit
  checkpoints - and drop the oldest *intermediate* status (scheduled, waiting, running,
  retrying) first; only when none is left, drop the oldest row of any kind;
- ``drop_oldest``: drop the oldest row, whatever it is;
- ``reject_new``: keep the backlog, drop the new document.
Every drop is counted (millwright_mqtt_outbox_dropped_total) and reported as an audit
``gap`` record (source mqtt_outbox), aggregated at most once per second.

Coalescing, on a paced link (agent/cloud/pacing.py) while the outbox is behind (more than
``coalesce_above`` rows, twice the broker's publish rate): an intermediate status
(scheduled, waiting, running, retrying, in_progress) without an answer marker carries the
key ``<job_id>/<fire_id>``; a new status of that firing (intermediate, or its final)
deletes the older unsent rows of the key, superseded before they could go out. Final
statuses, answers (rows with a marker), accepted and rejected, audit checkpoints and rows
already handed to the broker have no key or are never touched. Counted in
millwright_mqtt_outbox_coalesced_total and reported by ``on_coalesce`` (an aggregated
``gap`` record with reason ``coalesced``).

A write the state disk refuses (full, I/O error, read-only) raises here; the component's
writes go through agent/cloud/outboxwriter.py, which holds them in memory and retries. The
publisher sends nothing meanwhile (a row is marked sent before it goes out): one warning
per outage, each attempt counted in millwright_mqtt_outbox_write_errors_total{error}.

Also holds the ingest ledger: ids of the jobs this agent has published ``accepted`` for,
written in the same transaction as that status, so that a redelivered push is answered
with a status marked as a redelivery, and a push whose status never got written (a crash
between the etcd write and the outbox) is answered with its first, unmarked status.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import logging
import os
import sqlite3
import threading
import time
from typing import Callable, Iterator, Optional

from agent.jobs.states import TERMINAL, JobState, RecordState
from agent.runtime.metrics import counter, gauge

from .link import Link
from .pacing import Pacer

log = logging.getLogger(__name__)

DEPTH = gauge("millwright_mqtt_outbox_depth", "Status documents waiting in the outbox")
DROPPED = counter("millwright_mqtt_outbox_dropped_total", "Outbox documents dropped because it was full",
                  ("policy",))
PUBLISHED = counter("millwright_mqtt_outbox_published_total", "Outbox documents acknowledged by the broker")
COALESCED = counter("millwright_mqtt_outbox_coalesced_total",
                    "Intermediate statuses deleted unsent because a newer one of the same firing superseded them "
                    "while the outbox was behind")
WRITE_ERRORS = counter("millwright_mqtt_outbox_write_errors_total",
                       "Outbox writes SQLite refused (each attempt), by error", ("error",))

KEEP_STATES = TERMINAL | {JobState.ACCEPTED, JobState.REJECTED}
# superseded by the next status of the same firing: coalesced while the outbox is behind
COALESCING_STATES = frozenset({JobState.SCHEDULED, JobState.WAITING, RecordState.RUNNING, RecordState.RETRYING,
                               JobState.IN_PROGRESS})
POLICIES = ("drop_oldest_terminal", "drop_oldest", "reject_new")
LEDGER_KEEP_S = 7 * 86400
# what a write the state disk refuses raises: SQLite's errors, and the file system's through it
WRITE_FAILURES = (sqlite3.Error, OSError)


MAX_WINDOW = 256


def window_for(max_inflight: int) -> int:
    """The publisher's window: the broker's in-flight limit, at most MAX_WINDOW."""
    return max(1, min(MAX_WINDOW, max_inflight))


def keep_state(doc: dict) -> bool:
    """Rows the default policy keeps longest: final answers (not intermediate states)."""
    state = doc.get("state")
    return state is None or state in KEEP_STATES


def coalesce_key(doc: dict, marker: Optional[str]) -> Optional[str]:
    """``<job_id>/<fire_id>`` for an intermediate status that a later one of its firing
    supersedes; None for everything that must arrive (finals, answers, the rest)."""
    if marker is not None or doc.get("state") not in COALESCING_STATES:
        return None
    job, fire = doc.get("job_id"), doc.get("fire_id")
    if not isinstance(job, str) or not isinstance(fire, str) or not job or not fire:
        return None
    return f"{job}/{fire}"


def supersedes(doc: dict, marker: Optional[str]) -> Optional[str]:
    """The key of the intermediate statuses a new document makes stale: its own key, or its
    firing's for a final status (with or without its answer marker)."""
    key = coalesce_key(doc, marker)
    if key is not None or doc.get("state") not in TERMINAL:
        return key
    job, fire = doc.get("job_id"), doc.get("fire_id")
    return f"{job}/{fire}" if isinstance(job, str) and isinstance(fire, str) and job and fire else None


def error_kind(exc: BaseException) -> str:
    """A bounded label for a refused write: disk_full, read_only, io_error, locked,
    cannot_open or other."""
    name = getattr(exc, "sqlite_errorname", "") or ""   # Python 3.11+
    text = str(exc).lower()
    code = getattr(exc, "errno", None)
    if name.startswith("SQLITE_FULL") or "disk is full" in text or code == errno.ENOSPC:
        return "disk_full"
    if name.startswith("SQLITE_READONLY") or "readonly" in text or code == errno.EROFS:
        return "read_only"
    if name.startswith("SQLITE_IOERR") or "disk i/o error" in text or code == errno.EIO:
        return "io_error"
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "is locked" in text:
        return "locked"
    if name.startswith("SQLITE_CANTOPEN") or "unable to open" in text:
        return "cannot_open"
    return "other"


class Outbox:
    def __init__(self, path: str, max_rows: int, policy: str = "drop_oldest_terminal",
                 on_drop: Optional[Callable[[int, str], None]] = None, coalesce_above: Optional[int] = None,
                 on_coalesce: Optional[Callable[[int], None]] = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown outbox policy {policy!r}")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self.max_rows = max_rows
        self.policy = policy
        self.on_drop = on_drop
        self.coalesce_above = coalesce_above   # depth past which superseded statuses are coalesced
        self.on_coalesce = on_coalesce
        self._lock = threading.Lock()
        # 0600 before SQLite opens it (its -wal and -shm files copy the database's mode):
        # statuses name jobs, agents and reasons, no business of other local users
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        os.close(fd)
        os.chmod(path, 0o600)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS outbox (seq INTEGER PRIMARY KEY, topic TEXT NOT NULL, "
                         "payload BLOB NOT NULL, keep INTEGER NOT NULL, sent INTEGER NOT NULL DEFAULT 0, "
                         "ts REAL NOT NULL, held INTEGER NOT NULL DEFAULT 0)")
        try:  # the etcd key of the row's durable answer marker (agent/cloud/answers.py)
            self._db.execute("ALTER TABLE outbox ADD COLUMN marker TEXT")
        except sqlite3.OperationalError:
            pass  # already there
        self._db.execute("CREATE INDEX IF NOT EXISTS outbox_marker ON outbox (marker) WHERE marker IS NOT NULL")
        try:  # coalesce_key() of an intermediate status (files written before issue 50 lack it)
            self._db.execute("ALTER TABLE outbox ADD COLUMN coalesce TEXT")
        except sqlite3.OperationalError:
            pass  # already there
        self._db.execute("CREATE INDEX IF NOT EXISTS outbox_coalesce ON outbox (coalesce) WHERE coalesce IS NOT NULL")
        self._db.execute("CREATE TABLE IF NOT EXISTS ledger (job_id TEXT PRIMARY KEY, ts REAL NOT NULL)")
        self._db.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v INTEGER NOT NULL)")
        self._db.execute("DELETE FROM ledger WHERE ts < ?", (time.time() - LEDGER_KEEP_S,))
        # a reservation left by a crash: its push was never acknowledged and will be redelivered
        self._db.execute("DELETE FROM outbox WHERE held=1")
        row = self._db.execute("SELECT v FROM meta WHERE k='seq'").fetchone()
        top = self._db.execute("SELECT MAX(seq) FROM outbox").fetchone()[0] or 0
        self._seq = max(row[0] if row else 0, top)
        self._depth = self._db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0]
        self.wake = threading.Event()
        DEPTH.set(self._depth)

    # --- writers ------------------------------------------------------------------
    def reserve(self, topic: str) -> int:
        """Hold a place in the sequence for a status that is not decided yet (the answer to a
        push whose etcd write is in flight): the publisher does not pass a held row, so
        statuses others produce meanwhile for the same job (e.g. ``scheduled``) stay after it.
        Settle it with :meth:`fill` or :meth:`release`."""
        with self._lock:
            with self._transaction():
                self._seq += 1
                seq = self._seq
                self._db.execute("INSERT INTO outbox (seq, topic, payload, keep, ts, held) VALUES (?, ?, ?, 1, ?, 1)",
                                 (seq, topic, b"", time.time()))
                self._db.execute("INSERT OR REPLACE INTO meta VALUES ('seq', ?)", (seq,))
            self._depth += 1
            DEPTH.set(self._depth)
        return seq

    def reserve_many(self, topics: list[str]) -> list[int]:
        """:meth:`reserve` for a batch of pushes (the ingest group commit), in one transaction."""
        if not topics:
            return []
        with self._lock:
            with self._transaction():
                first = self._seq + 1
                now = time.time()
                self._db.executemany("INSERT INTO outbox (seq, topic, payload, keep, ts, held) VALUES (?, ?, ?, 1, ?, 1)",
                                     [(first + i, t, b"", now) for i, t in enumerate(topics)])
                self._db.execute("INSERT OR REPLACE INTO meta VALUES ('seq', ?)", (first + len(topics) - 1,))
            self._seq = first + len(topics) - 1
            self._depth += len(topics)
            DEPTH.set(self._depth)
        return list(range(first, first + len(topics)))

    def fill_many(self, items: list[tuple[int, str, dict, Optional[str], Optional[str]]]) -> None:
        """:meth:`fill` for a batch, in one transaction: (seq, topic, doc, ledger_job_id, marker)."""
        if not items:
            return
        now = time.time()
        rows, ledger = [], []
        for seq, topic, doc, ledger_job_id, marker in items:
            body = dict(doc)
            body["seq"] = seq
            payload = json.dumps(body, separators=(",", ":"), ensure_ascii=False, default=str).encode()
            rows.append((topic, payload, 1 if keep_state(doc) else 0, now, marker, seq))
            if ledger_job_id:
                ledger.append((ledger_job_id, now))
        with self._lock, self._transaction():
            self._db.executemany("UPDATE outbox SET topic=?, payload=?, keep=?, held=0, ts=?, marker=? WHERE seq=?",
                                 rows)
            self._db.executemany("INSERT OR REPLACE INTO ledger VALUES (?, ?)", ledger)
        self.wake.set()

    def release_many(self, seqs: list[int]) -> None:
        """:meth:`release` for a batch."""
        if not seqs:
            return
        with self._lock:
            with self._transaction():
                n = sum(self._db.execute("DELETE FROM outbox WHERE seq=? AND held=1", (s,)).rowcount for s in seqs)
            self._depth -= n
            DEPTH.set(self._depth)
        self.wake.set()

    def fill(self, seq: int, topic: str, doc: dict, ledger_job_id: Optional[str] = None,
             marker: Optional[str] = None) -> int:
        """Turn a reservation into a publishable row (ledger entry in the same transaction)."""
        body = dict(doc)
        body["seq"] = seq
        payload = json.dumps(body, separators=(",", ":"), ensure_ascii=False, default=str).encode()
        with self._lock, self._transaction():
            self._db.execute("UPDATE outbox SET topic=?, payload=?, keep=?, held=0, ts=?, marker=? WHERE seq=?",
                             (topic, payload, 1 if keep_state(doc) else 0, time.time(), marker, seq))
            self._ledger(ledger_job_id)
        self.wake.set()
        return seq

    def release(self, seq: int) -> None:
        """Give a reservation up (no status after all, or the attempt will be retried)."""
        with self._lock:
            n = self._db.execute("DELETE FROM outbox WHERE seq=? AND held=1", (seq,)).rowcount
            self._depth -= n
            DEPTH.set(self._depth)
        self.wake.set()

    def enqueue(self, topic: str, doc: dict, ledger_job_id: Optional[str] = None,
                marker: Optional[str] = None) -> Optional[int]:
        """Insert one document (adds ``seq``); returns its seq, or None if the policy dropped it.
        With ``ledger_job_id`` the ledger entry is written in the same transaction. ``marker``:
        the etcd key of its durable answer, deleted once the broker has the document."""
        keep = 1 if keep_state(doc) else 0
        # no key where nothing is coalesced (no publish_rate): not a byte more per row
        key = None if self.coalesce_above is None else coalesce_key(doc, marker)
        dropped = coalesced = 0
        with self._lock:
            if self._depth >= self.max_rows and self.policy == "reject_new":
                with self._transaction():
                    self._ledger(ledger_job_id)   # the push was answered; only its status is lost
                self._dropped(1)
                return None
            with self._transaction():
                if self._depth >= self.max_rows:
                    dropped = self._drop_locked(self._depth - self.max_rows + 1)
                self._seq += 1
                seq = self._seq
                body = dict(doc)
                body["seq"] = seq
                payload = json.dumps(body, separators=(",", ":"), ensure_ascii=False, default=str).encode()
                self._db.execute("INSERT INTO outbox (seq, topic, payload, keep, ts, marker, coalesce) "
                                 "VALUES (?, ?, ?, ?, ?, ?, ?)", (seq, topic, payload, keep, time.time(), marker, key))
                self._db.execute("INSERT OR REPLACE INTO meta VALUES ('seq', ?)", (seq,))
                self._ledger(ledger_job_id)
                stale = None if self.coalesce_above is None else supersedes(doc, marker)
                if stale is not None and self._behind(self._depth - dropped):
                    coalesced = self._coalesce_locked(stale, seq)
            self._depth += 1 - dropped - coalesced
            DEPTH.set(self._depth)
        if dropped:
            self._dropped(dropped)
        if coalesced:
            self._coalesced(coalesced)
        self.wake.set()
        return seq

    def enqueue_many(self, items: list[tuple[str, dict, Optional[str]]]) -> None:
        """:meth:`enqueue` for several documents (topic, doc, marker), in order, in ONE
        transaction (the loop's statuses of a burst of pushes: one commit, not one each)."""
        if not items:
            return
        dropped = coalesced = 0
        with self._lock:
            seq0, depth0 = self._seq, self._depth
            try:
                with self._transaction():
                    now = time.time()
                    for topic, doc, marker in items:
                        if self._depth >= self.max_rows:
                            if self.policy == "reject_new":
                                dropped += 1
                                continue
                            n = self._drop_locked(self._depth - self.max_rows + 1)
                            dropped += n
                            self._depth -= n
                        self._seq += 1
                        body = dict(doc)
                        body["seq"] = self._seq
                        payload = json.dumps(body, separators=(",", ":"), ensure_ascii=False, default=str).encode()
                        key = None if self.coalesce_above is None else coalesce_key(doc, marker)
                        self._db.execute("INSERT INTO outbox (seq, topic, payload, keep, ts, marker, coalesce) "
                                         "VALUES (?, ?, ?, ?, ?, ?, ?)",
                                         (self._seq, topic, payload, 1 if keep_state(doc) else 0, now, marker, key))
                        stale = None if self.coalesce_above is None else supersedes(doc, marker)
                        if stale is not None and self._behind(self._depth):
                            n = self._coalesce_locked(stale, self._seq)
                            coalesced += n
                            self._depth -= n
                        self._depth += 1
                    self._db.execute("INSERT OR REPLACE INTO meta VALUES ('seq', ?)", (self._seq,))
            except BaseException:
                self._seq, self._depth = seq0, depth0
                raise
            DEPTH.set(self._depth)
        if dropped:
            self._dropped(dropped)
        if coalesced:
            self._coalesced(coalesced)
        self.wake.set()

    def _drop_locked(self, n: int) -> int:
        victims: list[int] = []
        if self.policy == "drop_oldest_terminal":
            victims = [r[0] for r in self._db.execute(
                "SELECT seq FROM outbox WHERE keep=0 AND held=0 ORDER BY seq LIMIT ?", (n,))]
        if len(victims) < n:
            have = set(victims)
            for (seq,) in self._db.execute("SELECT seq FROM outbox WHERE held=0 ORDER BY seq LIMIT ?",
                                           (n + len(victims),)):
                if seq not in have and len(victims) < n:
                    victims.append(seq)
        self._db.executemany("DELETE FROM outbox WHERE seq=?", [(s,) for s in victims])
        return len(victims)

    def _behind(self, depth: int) -> bool:
        return self.coalesce_above is not None and depth > self.coalesce_above

    def _coalesce_locked(self, key: str, seq: int) -> int:
        """Delete the unsent rows ``key`` supersedes (older than ``seq``); how many."""
        return self._db.execute("DELETE FROM outbox WHERE coalesce=? AND sent=0 AND held=0 AND seq<?",
                                (key, seq)).rowcount

    def _coalesced(self, n: int) -> None:
        COALESCED.inc(n)
        if self.on_coalesce:
            try:
                self.on_coalesce(n)
            except Exception:
                log.exception("outbox coalesce callback failed")

    def _dropped(self, n: int) -> None:
        DROPPED.labels(self.policy).inc(n)
        if self.on_drop:
            try:
                self.on_drop(n, self.policy)
            except Exception:
                log.exception("outbox drop callback failed")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction (caller holds _lock): committed, or rolled back on any error."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            raise

    def _ledger(self, job_id: Optional[str]) -> None:
        if job_id:
            self._db.execute("INSERT OR REPLACE INTO ledger VALUES (?, ?)", (job_id, time.time()))

    def has_marker(self, marker: str) -> bool:
        """Whether a row for this answer marker is still waiting here."""
        with self._lock:
            return self._db.execute("SELECT 1 FROM outbox WHERE marker=? LIMIT 1", (marker,)).fetchone() is not None

    def in_ledger(self, job_id: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM ledger WHERE job_id=?", (job_id,)).fetchone() is not None

    # --- publisher side --------------------------------------------------------------
    def batch(self, after_seq: int, limit: int) -> list[tuple[int, str, bytes, int]]:
        """The next rows in order, stopping before the first held (undecided) row."""
        with self._lock:
            rows = list(self._db.execute("SELECT seq, topic, payload, sent, held FROM outbox WHERE seq > ? "
                                         "ORDER BY seq LIMIT ?", (after_seq, limit)))
        out = []
        for seq, topic, payload, sent, held in rows:
            if held:
                break
            out.append((seq, topic, payload, sent))
        return out

    def markers_of(self, seqs: list[int]) -> list[tuple[str, bytes]]:
        """(marker, payload) of these rows that have an answer marker."""
        if not seqs:
            return []
        with self._lock:
            out = []
            for s in seqs:
                row = self._db.execute("SELECT marker, payload FROM outbox WHERE seq=? AND marker IS NOT NULL",
                                       (s,)).fetchone()
                if row:
                    out.append((row[0], row[1]))
            return out

    def mark_sent(self, seqs: list[int]) -> None:
        """One transaction for the batch (in autocommit mode each UPDATE was its own commit)."""
        if not seqs:
            return
        with self._lock, self._transaction():
            self._db.executemany("UPDATE outbox SET sent=1 WHERE seq=? AND sent=0", [(s,) for s in seqs])

    def delete(self, seqs: list[int]) -> list[str]:
        """Remove acknowledged rows; returns their answer markers (to delete in etcd)."""
        if not seqs:
            return []
        markers = []
        with self._lock:
            with self._transaction():
                n = 0
                for s in seqs:
                    row = self._db.execute("SELECT marker FROM outbox WHERE seq=?", (s,)).fetchone()
                    if row and row[0]:
                        markers.append(row[0])
                    n += self._db.execute("DELETE FROM outbox WHERE seq=?", (s,)).rowcount
            self._depth -= n
            DEPTH.set(self._depth)
        PUBLISHED.inc(n)
        return markers

    @property
    def depth(self) -> int:
        return self._depth

    def close(self) -> None:
        with self._lock:
            self._db.close()


class OutboxPublisher:
    """Sends outbox rows in order over a link, at most ``window`` unacknowledged (the
    profile's ``max_inflight``, at most 256: :func:`window_for`) and, with a ``pacer``
    (agent/cloud/pacing.py: the link is a PacedLink on it), no more than the pacer has room
    for: the publisher then waits for the next slot instead of blocking in publish. On a
    paced link the window is also at most a second's slots (paho resends what is in flight
    at a reconnect without asking), and those resends are charged to the pacer."""

    def __init__(self, outbox: Outbox, link: Link, window: int = 256, resend_after_s: float = 60.0,
                 on_tick: Optional[Callable[[], None]] = None,
                 on_delivered: Optional[Callable[[list[str]], None]] = None,
                 on_handing: Optional[Callable[[list[tuple[str, bytes]]], bool]] = None, hold: bool = False,
                 pacer: Optional[Pacer] = None):
        self.outbox = outbox
        self.pacer = pacer
        self._wait_s = 1.0   # the next wait for wake: shorter while the pacer has no room
        self._down = False   # the link was seen disconnected since the last step that sent
        self.link = link
        self.window = window
        if pacer is not None:   # what paho resends at a reconnect fits in one second's slots
            self.window = max(1, min(window, pacer.cap - pacer.reserve))
        self.resend_after_s = resend_after_s
        self.on_tick = on_tick
        self.on_delivered = on_delivered
        # called before rows with answer markers are first sent; False: hold them (not stamped)
        self.on_handing = on_handing
        # test knob (MILLWRIGHT_TEST_HOLD_OUTBOX=1): publish nothing, so a test can kill the
        # agent "before its outbox drained"
        self.hold = hold
        self._lock = threading.Lock()
        self._inflight: dict[int, tuple[int, float]] = {}  # mid -> (seq, sent_at)
        self._acked_mids: "collections.deque[int]" = collections.deque()
        self._cursor = 0
        self._replaced = threading.Event()   # the link's client was replaced: its mids start again
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._refused: Optional[str] = None   # the error while the state disk refuses writes

    def start(self) -> "OutboxPublisher":
        self._thread = threading.Thread(target=self._run, name="mqtt-outbox", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self.outbox.wake.set()
        if self._thread:
            self._thread.join(timeout)

    def flush(self, timeout: float) -> bool:
        """Wait until the outbox is empty (for a clean stop); True if it is."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.outbox.depth == 0:
                return True
            self.outbox.wake.set()
            time.sleep(0.02)
        return self.outbox.depth == 0

    def link_replaced(self) -> None:
        """The link got a new client (a reload), before it connects: what the old one had in
        flight is never resent by it, and its message ids start again. The next step forgets
        them and sends every unacknowledged row again (marked redelivery)."""
        self._replaced.set()
        self.outbox.wake.set()

    def on_publish(self, mid: int) -> None:
        """paho's thread, which holds paho's message lock here: never take a lock that is
        held around link.publish() (that deadlocks); a deque append is atomic."""
        self._acked_mids.append(mid)
        self.outbox.wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            # new rows and PUBACKs set wake; the timeout only paces the tick (gap reports,
            # aggregated at most once a second) and the resend check (resend_after_s)
            wait_s, self._wait_s = self._wait_s, 1.0
            self.outbox.wake.wait(wait_s)
            self.outbox.wake.clear()
            try:
                self.step()
            except WRITE_FAILURES as exc:
                self._write_refused(exc)
                time.sleep(0.5)
            except Exception:
                log.exception("outbox publisher step failed")
                time.sleep(0.5)
            else:
                if self._refused is not None:
                    log.info("status outbox writable again: publishing", extra={"fields": {"error": self._refused}})
                    self._refused = None
            if self.on_tick:
                try:
                    self.on_tick()
                except Exception:
                    log.exception("outbox tick failed")

    def _write_refused(self, exc: BaseException) -> None:
        """Rows are marked sent before they go out and deleted after their PUBACK: while the
        disk refuses those writes nothing is published (no row may go out unmarked); one
        warning per outage, every attempt counted."""
        kind = error_kind(exc)
        WRITE_ERRORS.labels(kind).inc()
        if self._refused is None:
            log.warning("status outbox cannot be written: nothing is published until it can be",
                        extra={"fields": {"error": kind, "detail": str(exc)[:200], "path": self.outbox.path}})
        self._refused = kind

    def step(self) -> None:
        """One pass (the publisher thread's loop body): delete what the broker acknowledged,
        then send what the window allows, in order."""
        if self._replaced.is_set():   # first: an ack of the new client must not match an old mid
            self._replaced.clear()
            self._inflight.clear()
            self._acked_mids.clear()
            self._cursor = 0
        acked = []
        while self._acked_mids:
            entry = self._inflight.pop(self._acked_mids.popleft(), None)
            if entry is not None:
                acked.append(entry[0])
        markers = self.outbox.delete(acked)
        if markers and self.on_delivered:
            self.on_delivered(markers)
        if not self.link.connected or self.hold:
            self._down = self._down or not self.link.connected
            return
        if self._down:
            # back: paho has sent what was in flight again, without asking the pacer
            self._down = False
            if self.pacer is not None:
                self.pacer.charge(len(self._inflight))
        if self._inflight:
            oldest = min(t for _, t in self._inflight.values())
            if time.monotonic() - oldest > self.resend_after_s:
                # the link lost track of them (should not happen): send again from the table
                log.warning("outbox: unacknowledged messages re-sent",
                            extra={"fields": {"count": len(self._inflight)}})
                self._inflight.clear()
                self._cursor = 0
        room = self.window - len(self._inflight)
        if room <= 0:
            return
        if self.pacer is not None:
            room = min(room, self.pacer.room())
            if room <= 0:   # the broker's rate: again when the oldest slot leaves the window
                self._wait_s = min(1.0, max(0.001, self.pacer.free_in()))
                return
        rows = self.outbox.batch(self._cursor, room)
        if not rows:
            return
        first = [r[0] for r in rows if not r[3]]
        if self.on_handing:
            handing = self.outbox.markers_of(first)
            if handing and not self.on_handing(handing):
                return   # not stamped handed: held (no stamp means never sent), asked again next pass
        self.outbox.mark_sent(first)
        for seq, topic, payload, sent in rows:
            if sent:
                try:
                    doc = json.loads(payload)
                    doc["redelivery"] = True
                    payload = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
                except ValueError:
                    pass
            rc, mid = self.link.publish(topic, payload, qos=1)
            self._inflight[mid] = (seq, time.monotonic())  # only this thread touches _inflight
            self._cursor = seq
        if len(rows) == room:
            self.outbox.wake.set()
