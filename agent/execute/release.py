"""Releases prepared runs at their due time (``executor.prepare(release_at=...)``) whose
launcher is not armed (an armed one releases itself; the reaper accounts for it)."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from typing import Callable, Optional

from agent.execute.runstate import Run

log = logging.getLogger(__name__)


class Releaser:
    """Releases prepared runs at their time. Its own thread, started on first use: a
    condition wait wakes within microseconds, where the reaper's poll() counts whole
    milliseconds, and nothing else runs on it (a release is one pipe write).

    ``release(run)`` is the executor's: it releases (or discards) one prepared run."""

    def __init__(self, release: Callable[[Run], None]):
        self.release = release
        self.cv = threading.Condition()
        self.heap: list = []
        self.seq = itertools.count()
        self.thread: Optional[threading.Thread] = None
        self.stopping = False

    def at(self, when: float, run: Run) -> None:
        """release(run) at ``when`` (time.monotonic()); nothing once stopped."""
        with self.cv:
            if self.stopping:
                return
            heapq.heappush(self.heap, (when, next(self.seq), run))
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="millwright-release", daemon=True)
                self.thread.start()
            if self.heap[0][2] is run:   # a later one changes nothing for the waiting thread
                self.cv.notify()

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.heap.clear()
            self.cv.notify()
        if self.thread is not None:
            self.thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.stopping and (not self.heap or self.heap[0][0] > time.monotonic()):
                    self.cv.wait(None if not self.heap else self.heap[0][0] - time.monotonic())
                if self.stopping:
                    return
                _, _, run = heapq.heappop(self.heap)
            try:
                self.release(run)
            except Exception:
                log.exception("releasing a prepared run failed", extra={"fields": {"run": run.handle.run_key}})

