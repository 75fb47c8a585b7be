"""Adapter threads that run blocking etcd calls for the loop and post the results back.

The loop submits `fn` with a callback; a worker thread runs fn() and posts
callback(result, error) to the loop. The loop never blocks on etcd, so its timers (due
jobs, the self-fence deadline) stay precise while etcd is slow or unreachable.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Optional

from agent.runtime.metrics import gauge

log = logging.getLogger(__name__)
QUEUE_DEPTH = gauge("millwright_etcd_worker_queue_depth", "etcd operations waiting for a worker thread", ("pool",))


class EtcdWorkers:
    def __init__(self, post: Callable[..., None], threads: int = 2, name: str = "etcd"):
        self.post = post
        self._q: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-worker-{i}", daemon=True)
                         for i in range(threads)]
        self.pending = 0  # touched only from the loop thread (submit) and via posted decrements
        self._depth = QUEUE_DEPTH.labels(name)

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self, timeout: float = 3.0) -> None:
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(timeout)

    def submit(self, fn: Callable[[], Any], callback: Callable[[Any, Optional[BaseException]], None]) -> None:
        self.pending += 1
        self._depth.set(self.pending)
        self._q.put((fn, callback))

    def _done(self, callback, result, error) -> None:
        self.pending -= 1
        self._depth.set(self.pending)
        callback(result, error)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, callback = item
            try:
                result, error = fn(), None
            except BaseException as exc:  # delivered to the loop, which decides
                result, error = None, exc
            self.post(self._done, callback, result, error)
