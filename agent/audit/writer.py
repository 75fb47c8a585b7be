"""The audit writer: one thread, a bounded queue, batched appends, rotation, checkpoints.

Callers (the event loop, adapter threads) only ever call :meth:`AuditLog.append`, which
takes a short lock, puts a tuple on a bounded deque and returns: it never touches the
disk, so a stalled disk can never stall the agent. When the queue is full the record is
dropped and counted; the next record that finds room is preceded by a ``gap`` record
carrying the count, at the place in the chain where the loss happened.

The writer thread hands the records to the chain (agent.audit.appender), which seals
them (seq, prev, mac), appends them in batches and rotates at ``rotate_bytes``; this
module decides when: the first record queued wakes it and what arrives within
``BATCH_WINDOW_S`` goes along (at a hundred runs a second, one wake-up per record was
most of its CPU; a flush, a close or a long queue cuts the window short). It fsyncs at most every
``fsync_interval_s`` (0: after every record) and on close, and records a ``head``
checkpoint every ``checkpoint_interval_s`` and at close, which lets ``verify`` detect a
truncated tail. Opening the directory recovers from a crash first (agent.audit.recovery).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from agent.audit.appender import MAX_GAP_TYPES, ChainAppender
from agent.audit.events import RecordHelpers
from agent.audit.keyfile import KeyFileError, load_key
from agent.audit.metrics import DROPPED, QUEUE_DEPTH
from agent.audit.record import RESERVED, TYPE_RE
from agent.audit.recovery import AuditError, lock_directory
from agent.runtime.timefmt import format_ts

if TYPE_CHECKING:
    from agent.config import AuditConfig

log = logging.getLogger(__name__)

_REC, _GAP, _FLUSH = 0, 1, 2
_BATCH_MAX = 4096
BATCH_WINDOW_S = 0.02   # records that arrive within this of the first of a batch are written with it
_HURRY_AT = 1024        # this many queued: write now


class AuditLog(RecordHelpers):
    """Append-only, hash-chained, HMAC'd audit log in ``directory``.

    ``append`` is thread-safe and never blocks on I/O. ``close`` drains, fsyncs and
    writes the clean-stop checkpoint. ``on_checkpoint(record: dict)`` is called on the
    writer thread for every checkpoint (``kind`` closed, head, retired); it must not
    block (post it to your own thread) and its exceptions are logged and ignored.
    """

    def __init__(self, directory: str, key_file: str, *, fsync_interval_s: float = 1.0,
                 queue_max: int = 10000, rotate_bytes: int = 16 * 1024 * 1024, keep_files: int = 64,
                 checkpoint_interval_s: float = 60.0, agent_id: Optional[str] = None,
                 on_checkpoint: Optional[Callable[[dict], Any]] = None, key: Optional[bytes] = None):
        self.dir = directory
        self.key_file = key_file
        self.fsync_interval_s = max(0.0, float(fsync_interval_s))
        self.queue_max = max(1, int(queue_max))
        self.rotate_bytes = int(rotate_bytes)
        self.keep_files = max(1, int(keep_files))
        self.checkpoint_interval_s = float(checkpoint_interval_s)
        self.agent_id = agent_id
        self.on_checkpoint = on_checkpoint
        try:
            self._key = key if key is not None else load_key(key_file, create=True)
        except KeyFileError as exc:
            raise AuditError(str(exc)) from None

        # caller side
        self._q: collections.deque = collections.deque()
        self._qlock = threading.Lock()
        self._wake = threading.Event()     # set for the first record of a batch (the queue was empty)
        self._hurry = threading.Event()    # set by flush, close or a long queue: the batch goes now
        self._closing = False
        self._dropped = 0
        self._drop_first = 0.0
        self._drop_last = 0.0
        self._drop_types: dict[str, int] = {}

        # writer side (writer thread, or the constructor before the thread starts)
        self._io_lock = threading.Lock()  # held while the files are touched; tests hold it to stall the writer
        self.stats = {"written": 0, "dropped": 0, "gaps": 0, "recovered": 0, "rotations": 0}
        self._lock_fd = lock_directory(self.dir)
        try:
            self._chain = ChainAppender.open(
                self.dir, self._key, agent_id=agent_id, on_checkpoint=on_checkpoint,
                fsync_interval_s=self.fsync_interval_s, rotate_bytes=self.rotate_bytes, keep_files=self.keep_files,
                checkpoint_interval_s=self.checkpoint_interval_s, stats=self.stats)
        except OSError as exc:
            os.close(self._lock_fd)
            raise AuditError(f"cannot open the audit log in {self.dir}: {exc.strerror or exc}") from None
        QUEUE_DEPTH.set_function(lambda: len(self._q))
        self._thread = threading.Thread(target=self._run, name="audit-writer", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, acfg: AuditConfig, agent_id: Optional[str] = None,
                    on_checkpoint: Optional[Callable[[dict], Any]] = None) -> "AuditLog":
        """Build from an :class:`agent.config.AuditConfig`."""
        return cls(acfg.dir, acfg.key_file, fsync_interval_s=acfg.fsync_interval_s, queue_max=acfg.queue_max,
                   rotate_bytes=acfg.rotate_bytes, keep_files=acfg.keep_files,
                   checkpoint_interval_s=acfg.checkpoint_interval_s,
                   agent_id=agent_id, on_checkpoint=on_checkpoint)

    # ------------------------------------------------------------------ caller API
    def append(self, type: str, **fields: Any) -> bool:
        """Queue a record; False when it was dropped (queue full or log closed). Never blocks on I/O."""
        if not TYPE_RE.match(type):
            raise ValueError(f"audit record type {type!r} must match {TYPE_RE.pattern}")
        if RESERVED.intersection(fields):
            raise ValueError(f"audit fields {sorted(RESERVED.intersection(fields))} are reserved")
        t = time.time()
        with self._qlock:
            q = self._q
            if self._closing or len(q) >= self.queue_max:
                if not self._dropped:
                    self._drop_first = t
                self._dropped += 1
                self._drop_last = t
                if type in self._drop_types or len(self._drop_types) < MAX_GAP_TYPES:
                    self._drop_types[type] = self._drop_types.get(type, 0) + 1
                ok = False
            else:
                first = not q
                if self._dropped:
                    q.append((_GAP, self._drop_first, "gap", self._take_drops()))
                q.append((_REC, t, type, fields))
                ok = True
                depth = len(q)
        if not ok:
            DROPPED.labels("queue_full").inc()
            self.stats["dropped"] += 1
            return False
        if first:   # the writer drained the queue: it waits for this one
            self._wake.set()
        elif depth >= _HURRY_AT and not self._hurry.is_set():
            self._hurry.set()
        return True

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued before this call is written and fsynced."""
        ev = threading.Event()
        with self._qlock:
            if self._closing:
                return False
            self._q.append((_FLUSH, 0.0, "", ev))
        self._hurry.set()
        self._wake.set()
        return ev.wait(timeout)

    def close(self, timeout: float = 10.0) -> bool:
        """Drain the queue, fsync, write the clean-stop checkpoint and release the directory."""
        with self._qlock:
            if self._closing:
                already = True
            else:
                already = False
                self._closing = True
        self._hurry.set()
        self._wake.set()
        if not already or self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("audit writer did not finish within %.1fs; records still queued are lost", timeout,
                      extra={"fields": {"queued": len(self._q)}})
            return False
        return True

    def __enter__(self) -> "AuditLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def queue_depth(self) -> int:
        return len(self._q)

    # ------------------------------------------------------------------ writer thread
    def _take_drops(self) -> dict:
        """Gap fields for the pending queue drops (caller holds _qlock)."""
        fields = {"source": "audit", "reason": "queue_full", "dropped": self._dropped,
                  "since": format_ts(self._drop_first), "until": format_ts(self._drop_last),
                  "types": dict(self._drop_types)}
        self._dropped = 0
        self._drop_types = {}
        return fields

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:  # never expected; the queue then fills and drops are counted
            log.exception("audit writer thread failed")
            with self._qlock:
                self._closing = True

    def _loop(self) -> None:
        interval = self.fsync_interval_s
        # with an fsync after every record, a record is not held back for others either
        window = min(BATCH_WINDOW_S, interval)
        chain = self._chain
        backoff = 0.0
        full = False
        while True:
            now = time.monotonic()
            deadline = now + 1.0
            if chain.dirty:
                deadline = min(deadline, chain.dirty_since + interval)
            if chain.head_pending:
                deadline = min(deadline, chain.next_head)
            if not self._q and not self._closing:
                self._wake.wait(max(0.0, deadline - now))
            self._wake.clear()
            if window and self._q and not full and not self._closing:
                self._hurry.wait(window)   # what arrives meanwhile goes with this batch
            self._hurry.clear()
            batch = []
            q = self._q
            try:
                for _ in range(_BATCH_MAX):
                    batch.append(q.popleft())
            except IndexError:
                pass
            full = len(batch) == _BATCH_MAX
            flushes = []
            with self._io_lock:
                ok = True
                for kind, t, type_, fields in batch:
                    if kind == _FLUSH:
                        flushes.append(fields)
                        continue
                    ok = chain.add(t, type_, fields, kind == _GAP) and ok
                ok = chain.commit() and ok
                now = time.monotonic()
                if chain.dirty and (flushes or now >= chain.dirty_since + interval):
                    chain.sync()
                if chain.head_pending and now >= chain.next_head and not chain.dirty:
                    chain.head("interval")
            for ev in flushes:
                ev.set()
            if not ok:  # disk trouble: do not spin; later records queue up (and drop, counted)
                backoff = min(1.0, backoff * 2 or 0.05)
                time.sleep(backoff)
            else:
                backoff = 0.0
            if self._closing and not self._q:
                break
        with self._io_lock:
            self._finish()

    def _finish(self) -> None:
        with self._qlock:
            pending = self._take_drops() if self._dropped else None
        if pending:
            self._chain.add(time.time(), "gap", pending, True)
        self._chain.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1
        QUEUE_DEPTH.set_function(lambda: 0)
