"""The checkpoint chain: ``checkpoints.jsonl``, a hash chain of its own beside the records.

It holds one ``checkpoint`` record per closed file (its SHA-256, size and last record),
per retired file and per head (the position of the current file, periodically and at
stop), and a ``recovered`` record when its own last line was torn. Each record is
fsynced on its own: a checkpoint that is reported must be on disk. Every checkpoint is
handed to ``on_checkpoint`` (the cloud anchor).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Optional

from agent.audit.files import CHECKPOINTS
from agent.audit.metrics import CHECKPOINTS_TOTAL, WRITE_ERRORS
from agent.audit.record import FORMAT_VERSION, seal
from agent.audit.recovery import CheckpointTail, torn_fields
from agent.runtime.timefmt import format_ts

log = logging.getLogger(__name__)


class CheckpointChain:
    """Appends to the checkpoints file from where ``tail`` (read at open) left it; only
    the writer thread (or the constructor of the writer) calls it."""

    def __init__(self, directory: str, key: bytes, tail: CheckpointTail, *, agent_id: Optional[str],
                 on_checkpoint: Optional[Callable[[dict], Any]]):
        self._key = key
        self.agent_id = agent_id
        self.on_checkpoint = on_checkpoint
        self.seq, self.hash, self.size = tail.seq, tail.hash, tail.size
        self.fd = os.open(os.path.join(directory, CHECKPOINTS), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        if tail.torn is not None:
            os.write(self.fd, b"\n")
            self.size += 1
            self.append("recovered", torn_fields(CHECKPOINTS, *tail.torn) | {"last_seq": self.seq})

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def append(self, type_: str, fields: dict) -> Optional[dict]:
        """Append a record (fsynced) and hand a checkpoint to on_checkpoint; the record
        as written, or None when the write failed (the file is cut back to before it)."""
        body = dict(fields)
        if self.agent_id is not None:
            body["agent"] = self.agent_id
        body.update(v=FORMAT_VERSION, seq=self.seq + 1, ts=format_ts(time.time()), type=type_, prev=self.hash)
        line, h = seal(body, self._key)
        try:
            os.write(self.fd, line)
            os.fsync(self.fd)
        except OSError as exc:
            WRITE_ERRORS.inc()
            log.error("audit checkpoint write failed", extra={"fields": {"error": exc.strerror or str(exc)}})
            try:
                os.ftruncate(self.fd, self.size)
            except OSError:
                pass
            return None
        self.seq += 1
        self.hash = h
        self.size += len(line)
        body["mac"] = line[-67:-3].decode("ascii")
        if type_ == "checkpoint":
            CHECKPOINTS_TOTAL.labels(body.get("kind", "")).inc()
            if self.on_checkpoint is not None:
                try:
                    self.on_checkpoint(dict(body))
                except Exception:
                    log.exception("audit on_checkpoint callback failed")
        return body

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = -1
