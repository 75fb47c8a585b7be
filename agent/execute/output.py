"""A run's output: one pipe of its stdout or stderr, copied by the reaper thread into a
log file in the run's directory (the first ``output_max_bytes``, the rest counted)."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


class OutputStream:
    """One output pipe of a run and the log file it is copied to (the first ``limit``
    bytes). The file is created when the first byte comes (open()): a run that writes
    nothing has none, and costs the state disk no inode made and later freed by retention.
    ``tail`` > 0 keeps the end of what was written in memory: the final record's
    stderr_tail without reading the file back."""

    __slots__ = ("rfd", "wfd", "path", "written", "dropped", "limit", "tail", "_tail_max", "_unwritable",
                 "created")

    def __init__(self, rfd: int, path: str, limit: int, tail: int = 0):
        self.rfd = rfd
        self.path = path
        self.wfd = -1
        self.written = 0
        self.dropped = 0
        self.limit = limit
        self.tail = bytearray()
        self._tail_max = tail
        self._unwritable = False
        self.created = False   # the log file exists (the run wrote something)

    def open(self) -> bool:
        """Create (truncate) the log file, once; reaper thread. False if it cannot be
        created (logged once; the output is then counted as dropped). The file is the
        agent's only (0600): state files are root-only."""
        if self.wfd < 0 and not self._unwritable:
            try:
                self.wfd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
                                   0o600)
                self.created = True
            except OSError as exc:
                self._unwritable = True
                log.warning("cannot create a run's output file", extra={"fields": {"path": self.path, "error": exc.strerror}})
        return self.wfd >= 0

    def feed(self, data: bytes) -> None:
        keep = max(0, min(len(data), self.limit - self.written)) if self.open() else 0
        if keep:
            view = memoryview(data)[:keep]
            if self._tail_max:
                self.tail += view[-self._tail_max:]
                del self.tail[:-self._tail_max]
            while view:
                n = os.write(self.wfd, view)
                view = view[n:]
            self.written += keep
        self.dropped += len(data) - keep

    def drain(self) -> None:
        """Copy what is still in the pipe (non-blocking reads, at most 4 MiB), as at a
        run's end."""
        if self.rfd < 0:
            return
        for _ in range(64):
            try:
                data = os.read(self.rfd, 65536)
            except (BlockingIOError, OSError):
                return
            if not data:
                return
            self.feed(data)

    def close(self) -> None:
        for fd in (self.rfd, self.wfd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.rfd = self.wfd = -1
        self._unwritable = True   # closed for good: a second (truncating) open would empty the file
