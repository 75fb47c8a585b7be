"""The main chain as the writer thread extends it: sealing, batched appends, fsync,
rotation, retention and head checkpoints.

Records are sealed (seq, prev, mac) into a pending buffer and written in one ``write``
per batch. A write that fails is cut back off the file and the chain rolls back to the
last record written, so the chain on disk never has a hole; the records lost are
counted and become one ``gap`` record ahead of the next record that is written. At
``rotate_bytes`` the current file is closed with a ``closed`` checkpoint and the next
one starts with a ``checkpoint`` record that links to the last record of the previous.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import time
from typing import Any, Callable, Optional

from agent.audit.checkpoints import CheckpointChain
from agent.audit.files import file_name, fsync_dir, list_files
from agent.audit.metrics import (
    DROPPED,
    FSYNC_SECONDS,
    GAPS,
    RECORDS,
    RECOVERIES,
    ROTATIONS,
    WRITE_ERRORS,
    WRITTEN_BYTES,
)
from agent.audit.record import FORMAT_VERSION, seal
from agent.audit.recovery import Resume, last_record, read_checkpoints, resume_chain, torn_fields
from agent.runtime.timefmt import format_ts

log = logging.getLogger(__name__)

MAX_GAP_TYPES = 32   # record types a gap record counts by name; further types are left out


class ChainAppender:
    """The current file and the head of the chain; only the writer thread (or the writer's
    constructor, before the thread starts) calls it.

    ``stats`` is the writer's counters dict (written, dropped, gaps, recovered, rotations),
    updated in place.
    """

    def __init__(self, directory: str, key: bytes, checkpoints: CheckpointChain, resume: Resume, *,
                 agent_id: Optional[str], fsync_interval_s: float, rotate_bytes: int, keep_files: int,
                 checkpoint_interval_s: float, stats: dict[str, int]):
        self.dir = directory
        self._key = key
        self.checkpoints = checkpoints
        self.agent_id = agent_id
        self.fsync_interval_s = fsync_interval_s
        self.rotate_bytes = rotate_bytes
        self.keep_files = keep_files
        self.checkpoint_interval_s = checkpoint_interval_s
        self.stats = stats
        # the current file and the last record sealed; _committed is the last one written
        self._n = resume.n
        self._fd = resume.fd
        self._size = resume.size
        self._sha = resume.sha
        self._first_seq = resume.first_seq
        self._seq = resume.seq
        self._last_hash = resume.last_hash
        self._committed = (self._seq, self._last_hash)
        self._buf: list[bytes] = []
        self._buf_types: list[tuple[str, int, dict]] = []  # (type, records it stands for, their types)
        self._pending = 0
        self._lost: dict[str, int] = {}   # losses to write errors not yet written as a gap, by type
        self._lost_total = 0
        self._lost_since = 0.0
        self.dirty = False                # written since the last successful fsync
        self.dirty_since = 0.0
        self.next_head = time.monotonic() + self.checkpoint_interval_s
        self._head_seq = -1

    @classmethod
    def open(cls, directory: str, key: bytes, *, agent_id: Optional[str],
             on_checkpoint: Optional[Callable[[dict], Any]], fsync_interval_s: float, rotate_bytes: int,
             keep_files: int, checkpoint_interval_s: float, stats: dict[str, int]) -> "ChainAppender":
        """Resume both chains in a locked directory and record what the last stop left
        (a link to the previous file, a ``recovered`` record), then a ``start`` head.
        Raises OSError when the directory cannot be written."""
        tail = read_checkpoints(directory)
        checkpoints = CheckpointChain(directory, key, tail, agent_id=agent_id, on_checkpoint=on_checkpoint)
        resume = resume_chain(directory, key, tail)
        chain = cls(directory, key, checkpoints, resume, agent_id=agent_id, fsync_interval_s=fsync_interval_s,
                    rotate_bytes=rotate_bytes, keep_files=keep_files, checkpoint_interval_s=checkpoint_interval_s,
                    stats=stats)
        chain._begin(resume)
        return chain

    def _begin(self, resume: Resume) -> None:
        if resume.link is not None:
            if not resume.link_checkpointed:
                self.checkpoints.append("checkpoint", resume.link)
            self._buf.append(self._seal(time.time(), "checkpoint", resume.link))
            self._buf_types.append(("checkpoint", 1, {"checkpoint": 1}))
        if resume.recovered_reason is not None:
            fields = {"reason": resume.recovered_reason, "file": file_name(self._n), "last_seq": self._seq}
            if resume.torn is not None:
                fields.update(torn_fields(file_name(self._n), *resume.torn))
            self._buf.append(self._seal(time.time(), "recovered", fields))
            self._buf_types.append(("recovered", 1, {"recovered": 1}))
            RECOVERIES.inc()
            self.stats["recovered"] += 1
            log.warning("audit log recovered after an unclean stop",
                        extra={"fields": {"reason": resume.recovered_reason, "file": file_name(self._n),
                                          "last_seq": fields["last_seq"]}})
        if not self.commit():
            raise OSError("cannot append to the audit file")
        fsync_dir(self.dir)
        self.sync()
        self.head("start")

    def close(self) -> None:
        """Write what is pending (after a gap for earlier write losses), fsync, record the
        clean-stop head and close both files."""
        self._add_lost_gap()
        self.commit()
        if self.dirty:
            self.sync()
        self.head("stop", clean=True)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = -1
        self.checkpoints.close()

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

    def add(self, t: float, type_: str, fields: dict, is_gap: bool = False) -> bool:
        """Seal one record into the pending buffer (and write it out when due); False
        when a write failed."""
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
            ok = self.commit()
            if ok:
                self.sync()
        elif self._size + self._pending >= self.rotate_bytes:
            ok = self.commit()
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

    def commit(self) -> bool:
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
                    if k in self._lost or len(self._lost) < MAX_GAP_TYPES:
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
        if not self.dirty:
            self.dirty = True
            self.dirty_since = time.monotonic()
        return True

    def sync(self) -> None:
        t0 = time.monotonic()
        try:
            os.fsync(self._fd)
        except OSError as exc:
            WRITE_ERRORS.inc()
            log.error("audit fsync failed", extra={"fields": {"error": exc.strerror or str(exc)}})
            return
        FSYNC_SECONDS.observe(time.monotonic() - t0)
        self.dirty = False

    # ------------------------------------------------------------------ checkpoints
    @property
    def head_pending(self) -> bool:
        """Periodic heads are on and records were written since the last head."""
        return self.checkpoint_interval_s > 0 and self._seq != self._head_seq

    def head(self, reason: str, clean: bool = False) -> None:
        """Record the position of the current file in the checkpoint chain."""
        if self.checkpoints.closed:
            return
        fields = {"kind": "head", "reason": reason, "file": file_name(self._n), "last_seq": self._seq,
                  "last_hash": self._last_hash, "bytes": self._size}
        if clean:
            fields["clean"] = True
        if self.checkpoints.append("checkpoint", fields) is not None:
            self._head_seq = self._seq
        self.next_head = time.monotonic() + self.checkpoint_interval_s

    def _closed_info(self) -> dict:
        return {"kind": "closed", "file": file_name(self._n), "first_seq": self._first_seq,
                "last_seq": self._seq, "last_hash": self._last_hash,
                "records": max(0, self._seq - self._first_seq + 1), "bytes": self._size,
                "sha256": self._sha.hexdigest()}

    def _rotate(self) -> None:
        """Close the current file, checkpoint it, start the next one linked to it."""
        self.sync()
        if self.dirty:
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
        if self.checkpoints.append("checkpoint", info) is None:
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
        self.commit()
        self._retention()

    def _retention(self) -> None:
        try:
            closed = [(n, name) for n, name in list_files(self.dir) if n < self._n]
        except OSError:
            return
        while len(closed) > self.keep_files:
            n, name = closed.pop(0)
            path = os.path.join(self.dir, name)
            last = last_record(path)
            fields: dict[str, Any] = {"kind": "retired", "file": name}
            if last is not None:
                fields.update(last_seq=last[0], last_hash=last[1])
            if self.checkpoints.append("checkpoint", fields) is None:
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
