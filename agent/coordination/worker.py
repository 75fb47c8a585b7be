"""Adapter threads that run blocking etcd calls for the loop and post the results back.

The loop submits `fn` with a callback; a worker thread runs fn() and posts
callback(result, error) to the loop. The loop never blocks on etcd, so its timers (due
jobs, the self-fence deadline) stay precise while etcd is slow or unreachable.

Threads are started on demand: a submission that finds no idle worker starts one (up to
``threads``), and a worker idle for ``linger_s`` ends. A burst gets the whole pool at
once; an idle agent keeps no worker threads, so idling costs no thread wake-ups.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Optional

from agent.runtime.metrics import gauge

log = logging.getLogger(__name__)
QUEUE_DEPTH = gauge("millwright_etcd_worker_queue_depth", "etcd operations waiting for a worker thread", ("pool",))
WORKER_THREADS = gauge("millwright_etcd_worker_threads", "Live etcd worker threads", ("pool",))

LINGER_S = 10.0  # a worker idle this long ends (the next submission starts one again)


class EtcdWorkers:
    def __init__(self, post: Callable[..., None], threads: int = 2, name: str = "etcd",
                 linger_s: float = LINGER_S):
        if threads < 1:
            raise ValueError("threads must be at least 1")
        self.post = post
        self.name = name
        self.max_threads = threads
        self.linger_s = linger_s
        self._q: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        # waiting workers not yet matched to a queued item, and queued items no waiting
        # worker was matched to (they go to the next worker that comes back for work)
        self._spare = 0
        self._unmatched = 0
        self._threads: list[threading.Thread] = []
        self._started = False
        self._stopping = False
        self._seq = 0
        self.pending = 0  # touched only from the loop thread (submit) and via posted decrements
        self._depth = QUEUE_DEPTH.labels(name)
        self._live = WORKER_THREADS.labels(name)

    @property
    def threads(self) -> int:
        """Worker threads alive now (0 when idle for linger_s)."""
        with self._lock:
            return len(self._threads)

    def start(self) -> None:
        """Work submitted before start() waits; it runs from now on."""
        with self._lock:
            self._started = True
            while self._unmatched and len(self._threads) < self.max_threads:
                self._spawn()

    def stop(self, timeout: float = 3.0) -> None:
        with self._lock:
            self._stopping = True
            threads = list(self._threads)
        for _ in threads:
            self._q.put(None)
        for t in threads:
            t.join(timeout)

    def submit(self, fn: Callable[[], Any], callback: Callable[[Any, Optional[BaseException]], None]) -> None:
        self.pending += 1
        self._depth.set(self.pending)
        self._q.put((fn, callback))
        with self._lock:
            if self._spare:
                self._spare -= 1          # a waiting worker takes it
            else:
                self._unmatched += 1
                if self._started and not self._stopping and len(self._threads) < self.max_threads:
                    self._spawn()

    def _spawn(self) -> None:
        """Start one worker (lock held)."""
        self._seq += 1
        t = threading.Thread(target=self._run, name=f"{self.name}-worker-{self._seq}", daemon=True)
        self._threads.append(t)
        self._live.set(len(self._threads))
        t.start()

    def _done(self, callback, result, error) -> None:
        self.pending -= 1
        self._depth.set(self.pending)
        callback(result, error)

    def _next(self) -> Optional[tuple]:
        """The next item, or None when this worker should end (stop, or idle for linger_s)."""
        with self._lock:
            owed = self._unmatched > 0
            if owed:
                self._unmatched -= 1
            else:
                self._spare += 1
        if owed:
            return self._q.get()  # already queued
        while True:
            try:
                return self._q.get(timeout=self.linger_s)
            except queue.Empty:
                with self._lock:
                    if self._spare:       # more waiting workers than queued work: leave
                        self._spare -= 1
                        self._forget(threading.current_thread())  # in the same step: submit() may start another
                        return None
                # a submission counted on this worker meanwhile: its item is queued

    def _run(self) -> None:
        try:
            while True:
                item = self._next()
                if item is None:
                    return
                fn, callback = item
                try:
                    result, error = fn(), None
                except BaseException as exc:  # delivered to the loop, which decides
                    result, error = None, exc
                self.post(self._done, callback, result, error)
        finally:
            with self._lock:
                self._forget(threading.current_thread())

    def _forget(self, t: threading.Thread) -> None:
        """This worker ends (lock held)."""
        if t in self._threads:
            self._threads.remove(t)
            self._live.set(len(self._threads))
