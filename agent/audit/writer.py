"""The audit writer: one thread, a bounded queue, batched appends, rotation, checkpoints.

Callers (the event loop, adapter threads) only ever call :meth:`AuditLog.append`, which
takes a short lock, puts a tuple on a bounded deque and returns: it never touches the
disk, so a stalled disk can never stall the agent. When the queue is full the record is
dropped and counted; the next record that finds room is preceded by a ``gap`` record
carrying the count, at the place in the chain where the loss happened.

The writer thread seals records (seq, prev, mac), appends them in batches and fsyncs at
most every ``fsync_interval_s`` (0: after every record) and on close. At ``rotate_bytes``
it closes the file, records a ``closed`` checkpoint (the file's SHA-256, size and last
record) in ``checkpoints.jsonl`` and hands it to ``on_checkpoint`` (the cloud anchor),
and starts the next file with a ``checkpoint`` record that links to the last record of
the previous file. Periodically and at close it records a ``head`` checkpoint (the
position of the current file), which lets ``verify`` detect a truncated tail.

On start it recovers from a crash: bytes after the last newline (a torn write) are
terminated, kept as evidence and chained around with a ``recovered`` record naming
their offset, size and hash; any start not preceded by a clean ``stop`` head also gets a
``recovered`` record.
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import logging
import os
import threading
import time
from typing import Any, Callable, Optional

from agent.audit.events import RecordHelpers
from agent.audit.files import (
    CHECKPOINTS,
    LOCK,
    file_name,
    file_number,
    fsync_dir,
    iter_lines,
    list_files,
    read_tail,
)
from agent.audit.keyfile import KeyFileError, load_key
from agent.audit.record import (
    FORMAT_VERSION,
    GENESIS,
    RESERVED,
    TYPE_RE,
    BadRecord,
    line_hash,
    open_record,
    seal,
)
from agent.runtime.metrics import counter, gauge, histogram
from agent.runtime.timefmt import format_ts

log = logging.getLogger(__name__)

RECORDS = counter("millwright_audit_records_total", "Audit records written, by record type.", ("type",))
DROPPED = counter("millwright_audit_dropped_records_total",
                  "Audit records lost (queue full or write error); each loss also becomes a gap record.", ("reason",))
GAPS = counter("millwright_audit_gaps_total", "Gap records written (each stands for one or more lost records).")
QUEUE_DEPTH = gauge("millwright_audit_queue_depth", "Records waiting for the audit writer thread.")
WRITE_ERRORS = counter("millwright_audit_write_errors_total", "Failed writes or fsyncs of audit files.")
FSYNC_SECONDS = histogram("millwright_audit_fsync_seconds", "Duration of audit file fsyncs.",
                          buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
WRITTEN_BYTES = counter("millwright_audit_written_bytes_total", "Bytes appended to audit files.")
ROTATIONS = counter("millwright_audit_rotations_total", "Audit file rotations.")
RECOVERIES = counter("millwright_audit_recoveries_total", "Writer starts after an unclean stop (recovered records).")
CHECKPOINTS_TOTAL = counter("millwright_audit_checkpoints_total", "Checkpoint records written, by kind.", ("kind",))

_REC, _GAP, _FLUSH = 0, 1, 2
_BATCH_MAX = 4096
_MAX_GAP_TYPES = 32


class AuditError(Exception):
    """The audit log cannot be opened (key, directory, lock); one line for the operator."""


class AuditLog(RecordHelpers):
    """Append-only, hash-chained, HMAC'd audit log in ``directory``.

    ``append`` is thread-safe and never blocks on I/O. ``close`` drains, fsyncs and
    writes the clean-stop checkpoint. ``on_checkpoint(record: dict)`` is called on the
    writer thread for every checkpoint (``kind`` closed, head, retired); it must not
    block (post it to your own thread) and its exceptions are logged and ignored.
    """

    # the chain's and the current file's state, set when the directory is opened (_recover)
    _seq: int
    _last_hash: str
    _committed: tuple[int, str]
    _n: int
    _size: int
    _sha: Any
    _cp_seq: int
    _cp_hash: str
    _cp_size: int

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
        self._wake = threading.Event()
        self._closing = False
        self._dropped = 0
        self._drop_first = 0.0
        self._drop_last = 0.0
        self._drop_types: dict[str, int] = {}

        # writer side (writer thread, or the constructor before the thread starts)
        self._io_lock = threading.Lock()  # held while the files are touched; tests hold it to stall the writer
        self._lock_fd = -1
        self._fd = -1
        self._cp_fd = -1
        self._buf: list[bytes] = []
        self._buf_types: list[tuple[str, int, dict]] = []  # (type, records it stands for, their types)
        self._pending = 0
        self._need_newline = False
        self._lost: dict[str, int] = {}   # writer-side losses (write errors) not yet written as a gap, by type
        self._lost_total = 0
        self._lost_since = 0.0
        self._dirty = False
        self._dirty_since = 0.0
        self._next_head = time.monotonic() + self.checkpoint_interval_s
        self._head_seq = -1
        self.stats = {"written": 0, "dropped": 0, "gaps": 0, "recovered": 0, "rotations": 0}

        self._open()
        QUEUE_DEPTH.set_function(lambda: len(self._q))
        self._thread = threading.Thread(target=self._run, name="audit-writer", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, acfg: Any, agent_id: Optional[str] = None,
                    on_checkpoint: Optional[Callable[[dict], Any]] = None) -> "AuditLog":
        """Build from an :class:`agent.config.AuditConfig`."""
        return cls(acfg.dir, acfg.key_file, fsync_interval_s=acfg.fsync_interval_s, queue_max=acfg.queue_max,
                   rotate_bytes=acfg.rotate_bytes, keep_files=acfg.keep_files,
                   checkpoint_interval_s=getattr(acfg, "checkpoint_interval_s", 60.0),
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
                if type in self._drop_types or len(self._drop_types) < _MAX_GAP_TYPES:
                    self._drop_types[type] = self._drop_types.get(type, 0) + 1
                ok = False
            else:
                if self._dropped:
                    q.append((_GAP, self._drop_first, "gap", self._take_drops()))
                q.append((_REC, t, type, fields))
                ok = True
        if not ok:
            DROPPED.labels("queue_full").inc()
            self.stats["dropped"] += 1
            return False
        if not self._wake.is_set():
            self._wake.set()
        return True

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued before this call is written and fsynced."""
        ev = threading.Event()
        with self._qlock:
            if self._closing:
                return False
            self._q.append((_FLUSH, 0.0, "", ev))
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
        backoff = 0.0
        while True:
            now = time.monotonic()
            deadline = now + 1.0
            if self._dirty:
                deadline = min(deadline, self._dirty_since + interval)
            if self.checkpoint_interval_s > 0 and self._seq != self._head_seq:
                deadline = min(deadline, self._next_head)
            if not self._q and not self._closing:
                self._wake.wait(max(0.0, deadline - now))
            self._wake.clear()
            batch = []
            q = self._q
            try:
                for _ in range(_BATCH_MAX):
                    batch.append(q.popleft())
            except IndexError:
                pass
            flushes = []
            with self._io_lock:
                ok = True
                for kind, t, type_, fields in batch:
                    if kind == _FLUSH:
                        flushes.append(fields)
                        continue
                    ok = self._add(t, type_, fields, kind == _GAP) and ok
                ok = self._commit() and ok
                now = time.monotonic()
                if self._dirty and (flushes or now >= self._dirty_since + interval):
                    self._sync()
                if (self.checkpoint_interval_s > 0 and now >= self._next_head and self._seq != self._head_seq
                        and not self._dirty):
                    self._head("interval")
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
            self._add(time.time(), "gap", pending, True)
        self._add_lost_gap()
        self._commit()
        if self._dirty:
            self._sync()
        self._head("stop", clean=True)
        for fd in (self._fd, self._cp_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._cp_fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1
        QUEUE_DEPTH.set_function(lambda: 0)

    # ------------------------------------------------------------------ sealing and writing
    def _seal(self, t: float, type_: str, fields: dict) -> bytes:
        body = dict(fields)
        if self.agent_id is not None and "agent" not in body:
            body["agent"] = self.agent_id
        body.update(v=FORMAT_VERSION, seq=self._seq + 1, ts=format_ts(t), type=type_, prev=self._last_hash)
        try:
            line, h = seal(body, self._key)
        except (TypeError, ValueError, RecursionError):  # a value JSON cannot hold: keep the record, as text
            body = {"v": FORMAT_VERSION, "seq": self._seq + 1, "ts": format_ts(t), "type": type_,
                    "prev": self._last_hash, "unserializable": repr(fields)[:4000]}
            if self.agent_id is not None:
                body["agent"] = self.agent_id
            line, h = seal(body, self._key)
        self._seq += 1
        self._last_hash = h
        return line

    def _add(self, t: float, type_: str, fields: dict, is_gap: bool = False) -> bool:
        """Seal one record into the pending buffer (and write it out when due)."""
        self._add_lost_gap()
        line = self._seal(t, type_, fields)
        self._buf.append(line)
        if is_gap:
            self._buf_types.append(("gap", int(fields.get("dropped", 0)), dict(fields.get("types", {}))))
        else:
            self._buf_types.append((type_, 1, {type_: 1}))
        self._pending += len(line)
        ok = True
        if self.fsync_interval_s == 0:
            ok = self._commit()
            if ok:
                self._sync()
        elif self._size + self._pending >= self.rotate_bytes:
            ok = self._commit()
        if ok and self._size >= self.rotate_bytes:
            self._rotate()
        return ok

    def _add_lost_gap(self) -> None:
        """Records lost to write errors become one gap record, ahead of the next record."""
        if not self._lost_total:
            return
        lost, total = self._lost, self._lost_total
        self._lost, self._lost_total = {}, 0
        gap = self._seal(time.time(), "gap", {
            "source": "audit", "reason": "write_error", "dropped": total,
            "since": format_ts(self._lost_since), "until": format_ts(time.time()), "types": lost})
        self._buf.append(gap)
        self._buf_types.append(("gap", total, lost))
        self._pending += len(gap)

    def _commit(self) -> bool:
        """Write the pending buffer; on failure roll the file and chain back and count the loss."""
        if not self._buf:
            return True
        data = b"".join(self._buf)
        types = self._buf_types
        self._buf, self._buf_types, self._pending = [], [], 0
        try:
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError as exc:
            WRITE_ERRORS.inc()
            if not self._lost_total:  # once per episode, not once per record
                log.error("audit write failed; records are lost until writes succeed again, then a gap "
                          "record counts them", extra={"fields": {"error": exc.strerror or str(exc),
                                                                  "file": file_name(self._n)}})
            try:
                os.ftruncate(self._fd, self._size)
            except OSError:
                pass
            self._seq, self._last_hash = self._committed
            if not self._lost_total:
                self._lost_since = time.time()
            new_losses = 0
            for ty, n, kinds in types:
                self._lost_total += n
                for k, c in kinds.items():
                    if k in self._lost or len(self._lost) < _MAX_GAP_TYPES:
                        self._lost[k] = self._lost.get(k, 0) + c
                if ty != "gap":
                    new_losses += n
            DROPPED.labels("write_error").inc(new_losses)
            self.stats["dropped"] += new_losses
            return False
        self._size += len(data)
        self._sha.update(data)
        self._committed = (self._seq, self._last_hash)
        WRITTEN_BYTES.inc(len(data))
        self.stats["written"] += len(types)
        counts = collections.Counter(ty for ty, _, _ in types)
        for ty, n in counts.items():
            RECORDS.labels(ty).inc(n)
        if "gap" in counts:
            GAPS.inc(counts["gap"])
            self.stats["gaps"] += counts["gap"]
        if not self._dirty:
            self._dirty = True
            self._dirty_since = time.monotonic()
        return True

    def _sync(self) -> None:
        t0 = time.monotonic()
        try:
            os.fsync(self._fd)
        except OSError as exc:
            WRITE_ERRORS.inc()
            log.error("audit fsync failed", extra={"fields": {"error": exc.strerror or str(exc)}})
            return
        FSYNC_SECONDS.observe(time.monotonic() - t0)
        self._dirty = False

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self, type_: str, fields: dict) -> Optional[dict]:
        """Append a record to the checkpoint chain (fsynced) and hand it to on_checkpoint."""
        body = dict(fields)
        if self.agent_id is not None:
            body["agent"] = self.agent_id
        body.update(v=FORMAT_VERSION, seq=self._cp_seq + 1, ts=format_ts(time.time()), type=type_, prev=self._cp_hash)
        line, h = seal(body, self._key)
        try:
            os.write(self._cp_fd, line)
            os.fsync(self._cp_fd)
        except OSError as exc:
            WRITE_ERRORS.inc()
            log.error("audit checkpoint write failed", extra={"fields": {"error": exc.strerror or str(exc)}})
            try:
                os.ftruncate(self._cp_fd, self._cp_size)
            except OSError:
                pass
            return None
        self._cp_seq += 1
        self._cp_hash = h
        self._cp_size += len(line)
        body["mac"] = line[-67:-3].decode("ascii")
        if type_ == "checkpoint":
            CHECKPOINTS_TOTAL.labels(body.get("kind", "")).inc()
            if self.on_checkpoint is not None:
                try:
                    self.on_checkpoint(dict(body))
                except Exception:
                    log.exception("audit on_checkpoint callback failed")
        return body

    def _head(self, reason: str, clean: bool = False) -> None:
        if self._cp_fd < 0:
            return
        fields = {"kind": "head", "reason": reason, "file": file_name(self._n), "last_seq": self._seq,
                  "last_hash": self._last_hash, "bytes": self._size}
        if clean:
            fields["clean"] = True
        if self._checkpoint("checkpoint", fields) is not None:
            self._head_seq = self._seq
        self._next_head = time.monotonic() + self.checkpoint_interval_s

    def _closed_info(self) -> dict:
        return {"kind": "closed", "file": file_name(self._n), "first_seq": self._first_seq,
                "last_seq": self._seq, "last_hash": self._last_hash,
                "records": max(0, self._seq - self._first_seq + 1), "bytes": self._size,
                "sha256": self._sha.hexdigest()}

    def _rotate(self) -> None:
        """Close the current file, checkpoint it, start the next one linked to it."""
        self._sync()
        if self._dirty:
            return  # fsync failed: try again on a later write
        new_n = self._n + 1
        new_path = os.path.join(self.dir, file_name(new_n))
        try:
            new_fd = os.open(new_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o640)
        except OSError as exc:
            WRITE_ERRORS.inc()
            log.error("audit rotation failed; still writing the current file",
                      extra={"fields": {"file": new_path, "error": exc.strerror or str(exc)}})
            return
        info = self._closed_info()
        if self._checkpoint("checkpoint", info) is None:
            os.close(new_fd)
            os.unlink(new_path)
            return
        os.close(self._fd)
        self._fd = new_fd
        try:
            fsync_dir(self.dir)
        except OSError:
            pass
        self._n = new_n
        self._size = 0
        self._sha = hashlib.sha256()
        self._first_seq = self._seq + 1
        ROTATIONS.inc()
        self.stats["rotations"] += 1
        self._buf.append(self._seal(time.time(), "checkpoint", info))
        self._buf_types.append(("checkpoint", 1, {"checkpoint": 1}))
        self._commit()
        self._retention()

    def _retention(self) -> None:
        try:
            closed = [(n, name) for n, name in list_files(self.dir) if n < self._n]
        except OSError:
            return
        while len(closed) > self.keep_files:
            n, name = closed.pop(0)
            path = os.path.join(self.dir, name)
            last = _last_record(path)
            fields: dict[str, Any] = {"kind": "retired", "file": name}
            if last is not None:
                fields.update(last_seq=last[0], last_hash=last[1])
            if self._checkpoint("checkpoint", fields) is None:
                return
            try:
                os.unlink(path)
            except OSError as exc:
                log.error("audit retention could not remove a file",
                          extra={"fields": {"file": path, "error": exc.strerror or str(exc)}})
        try:
            fsync_dir(self.dir)
        except OSError:
            pass

    # ------------------------------------------------------------------ open and recover
    def _open(self) -> None:
        try:
            os.makedirs(self.dir, mode=0o750, exist_ok=True)
            self._lock_fd = os.open(os.path.join(self.dir, LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise AuditError(f"cannot use audit directory {self.dir}: {exc.strerror}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise AuditError(f"audit directory {self.dir} is in use by another writer") from None
        try:
            self._recover()
        except OSError as exc:
            os.close(self._lock_fd)
            raise AuditError(f"cannot open the audit log in {self.dir}: {exc.strerror or exc}") from None

    def _recover(self) -> None:
        # --- checkpoint chain
        cp_path = os.path.join(self.dir, CHECKPOINTS)
        self._cp_seq, self._cp_hash, self._cp_size = 0, GENESIS, 0
        cp_recent: list[dict] = []
        cp_torn = None
        if os.path.exists(cp_path):
            tail = read_tail(cp_path)
            self._cp_size = tail.size
            for ln in tail.lines:
                try:
                    rec = open_record(ln.raw, None)
                except BadRecord:
                    continue
                cp_recent.append(rec)
                self._cp_seq, self._cp_hash = rec["seq"], line_hash(ln.raw)
            if tail.fragment:
                cp_torn = (tail.fragment_offset, tail.fragment)
        self._cp_fd = os.open(cp_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        if cp_torn is not None:
            os.write(self._cp_fd, b"\n")
            self._cp_size += 1
            self._checkpoint("recovered", _torn_fields(CHECKPOINTS, *cp_torn) | {"last_seq": self._cp_seq})

        # --- main chain
        files = list_files(self.dir)
        self._seq, self._last_hash = 0, GENESIS
        self._sha = hashlib.sha256()
        self._size = 0
        torn = None
        recovered_reason = None
        link_prev = None  # (n, info) when the current file must start with a checkpoint of file n
        last_cp = cp_recent[-1] if cp_recent else None
        if not files:
            known = [r for r in cp_recent if isinstance(r.get("last_seq"), int) and isinstance(r.get("last_hash"), str)]
            nums = [n for n in (file_number(str(r.get("file", ""))) for r in cp_recent) if n is not None]
            self._n = max(nums) + 1 if nums else 1
            if known:
                self._seq, self._last_hash = known[-1]["last_seq"], known[-1]["last_hash"]
                recovered_reason = "files_missing"
            self._first_seq = self._seq + 1
            self._fd = os.open(os.path.join(self.dir, file_name(self._n)),
                               os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        else:
            self._n, name = files[-1]
            path = os.path.join(self.dir, name)
            first_seq = None
            last = None
            for ln in iter_lines(path, hasher=self._sha):
                if not ln.complete:
                    torn = (ln.offset, ln.raw)
                    break
                try:
                    rec = open_record(ln.raw, None)
                except BadRecord:
                    continue
                if first_seq is None:
                    first_seq = rec["seq"]
                last = (rec["seq"], line_hash(ln.raw))
            self._size = os.path.getsize(path)
            if torn is not None:
                # a complete record that only lacks its newline is kept as a record
                try:
                    rec = open_record(torn[1], self._key)
                    if last is None or (rec["seq"] == last[0] + 1 and rec["prev"] == last[1]):
                        last = (rec["seq"], line_hash(torn[1]))
                        first_seq = first_seq or rec["seq"]
                        torn = None
                        recovered_reason = "unclean_shutdown"
                        self._need_newline = True
                except BadRecord:
                    pass
            if last is not None:
                self._seq, self._last_hash = last
            elif self._n > 1:
                prev_path = os.path.join(self.dir, file_name(self._n - 1))
                prev_last = _last_record(prev_path) if os.path.exists(prev_path) else None
                if prev_last is not None:
                    self._seq, self._last_hash = prev_last
                    link_prev = self._n - 1
            self._first_seq = first_seq if first_seq is not None else self._seq + 1
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            if self._need_newline or torn is not None:
                os.write(self._fd, b"\n")
                self._size += 1
                self._sha.update(b"\n")
            clean = (torn is None and recovered_reason is None and cp_torn is None and last_cp is not None
                     and last_cp.get("kind") == "head" and last_cp.get("clean") is True
                     and last_cp.get("file") == name and last_cp.get("last_seq") == self._seq
                     and last_cp.get("last_hash") == self._last_hash)
            if torn is not None:
                recovered_reason = "torn_write"
            elif not clean and recovered_reason is None and (self._seq > 0 or link_prev or last_cp is not None):
                recovered_reason = "unclean_shutdown"
        self._committed = (self._seq, self._last_hash)

        if link_prev is not None:
            # crashed during a rotation: make sure the previous file is checkpointed and linked
            prev_name = file_name(link_prev)
            info = _file_info(os.path.join(self.dir, prev_name), prev_name)
            if not any(r.get("kind") == "closed" and r.get("file") == prev_name for r in cp_recent):
                self._checkpoint("checkpoint", info)
            self._buf.append(self._seal(time.time(), "checkpoint", info))
            self._buf_types.append(("checkpoint", 1, {"checkpoint": 1}))
        if recovered_reason is not None:
            fields = {"reason": recovered_reason, "file": file_name(self._n), "last_seq": self._seq}
            if torn is not None:
                fields.update(_torn_fields(file_name(self._n), *torn))
            self._buf.append(self._seal(time.time(), "recovered", fields))
            self._buf_types.append(("recovered", 1, {"recovered": 1}))
            RECOVERIES.inc()
            self.stats["recovered"] += 1
            log.warning("audit log recovered after an unclean stop",
                        extra={"fields": {"reason": recovered_reason, "file": file_name(self._n),
                                          "last_seq": fields["last_seq"]}})
        if not self._commit():
            raise OSError("cannot append to the audit file")
        fsync_dir(self.dir)
        self._sync()
        self._head("start")


def _torn_fields(name: str, offset: int, data: bytes) -> dict:
    return {"torn_file": name, "torn_offset": offset, "torn_bytes": len(data),
            "torn_sha256": hashlib.sha256(data).hexdigest()}


def _last_record(path: str) -> Optional[tuple[int, str]]:
    """(seq, hash) of the last parseable complete record of a file."""
    tail = read_tail(path, want=16)
    for ln in reversed(tail.lines):
        try:
            rec = open_record(ln.raw, None)
        except BadRecord:
            continue
        return rec["seq"], line_hash(ln.raw)
    return None


def _file_info(path: str, name: str) -> dict:
    """A closed checkpoint for an existing file, computed by reading it."""
    sha = hashlib.sha256()
    first = last = None
    for ln in iter_lines(path, hasher=sha):
        if not ln.complete:
            continue
        try:
            rec = open_record(ln.raw, None)
        except BadRecord:
            continue
        if first is None:
            first = rec["seq"]
        last = (rec["seq"], line_hash(ln.raw))
    size = os.path.getsize(path)
    return {"kind": "closed", "file": name, "first_seq": first or 0, "last_seq": last[0] if last else 0,
            "last_hash": last[1] if last else GENESIS, "records": (last[0] - first + 1) if last and first else 0,
            "bytes": size, "sha256": sha.hexdigest()}
