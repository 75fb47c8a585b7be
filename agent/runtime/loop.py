"""The daemon's single-threaded event loop.

All agent state is owned by the thread running :meth:`EventLoop.run`. Adapter threads
(etcd keepalive and watches, paho's network thread, the BPF poller) never touch that
state: they call :meth:`post`, which is the only thread-safe entry point. Timers are one
heap on the loop, not a thread per job.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

from agent.runtime.metrics import counter

log = logging.getLogger(__name__)

STALLS = counter("millwright_loop_stalls_total", "Loop handlers that ran longer than the stall threshold")


class Timer:
    """Handle of a scheduled callback; cancel() is O(1) (lazy deletion)."""

    __slots__ = ("when", "fn", "args", "cancelled")

    def __init__(self, when: float, fn: Callable[..., Any], args: tuple):
        self.when = when
        self.fn = fn
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        """Also drops the callback and its arguments: a timer held by what it refers to
        (a firing's retry timer, say) must not keep a reference cycle alive."""
        self.cancelled = True
        self.fn, self.args = _noop, ()


def _noop(*_: Any) -> None:
    pass


class EventLoop:
    """A queue of callbacks plus a monotonic timer heap, run by one thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._queue: "queue.SimpleQueue[tuple[Callable[..., Any], tuple]]" = queue.SimpleQueue()
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self._busy: Optional[tuple[float, Callable[..., Any]]] = None   # (since, handler) while one runs

    # --- thread-safe -------------------------------------------------------------
    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the loop thread. Safe from any thread."""
        self._queue.put((fn, args))

    def stop(self) -> None:
        self.post(self._set_stopping)

    # --- loop thread only ----------------------------------------------------------
    def call_at(self, when: float, fn: Callable[..., Any], *args: Any) -> Timer:
        """Run fn at monotonic time `when`."""
        t = Timer(when, fn, args)
        heapq.heappush(self._heap, (when, next(self._seq), t))
        return t

    def call_later(self, delay: float, fn: Callable[..., Any], *args: Any) -> Timer:
        return self.call_at(self.clock() + max(0.0, delay), fn, *args)

    def in_loop_thread(self) -> bool:
        return self._thread is threading.current_thread()

    def _set_stopping(self) -> None:
        self._stopping = True

    def _run_one(self, fn: Callable[..., Any], args: tuple) -> None:
        self._busy = (time.monotonic(), fn)
        try:
            fn(*args)
        except Exception:  # a bug in one handler must not kill the agent
            log.exception("event handler %s failed", getattr(fn, "__qualname__", fn))
        finally:
            self._busy = None

    def watch_stalls(self, threshold_s: float = 2.0) -> threading.Thread:
        """Start a monitor thread: a handler that holds the loop longer than
        ``threshold_s`` (everything else waits meanwhile: timers, statuses, renewals) is
        logged once, with the loop thread's stack, and counted. Diagnosis, not control."""
        def monitor() -> None:
            reported = None
            while not self._stopping:
                time.sleep(min(0.5, threshold_s / 2))
                busy, thread = self._busy, self._thread
                if busy is None or busy is reported or thread is None:
                    continue
                held = time.monotonic() - busy[0]
                if held < threshold_s:
                    continue
                reported = busy
                STALLS.inc()
                frame = sys._current_frames().get(thread.ident or 0)
                stack = "".join(traceback.format_stack(frame)[-12:]) if frame is not None else "?"
                log.warning("event loop stalled", extra={"fields": {
                    "handler": getattr(busy[1], "__qualname__", repr(busy[1])), "held_s": round(held, 2),
                    "stack": stack}})
        t = threading.Thread(target=monitor, name="loop-stall-monitor", daemon=True)
        t.start()
        return t

    def run(self) -> None:
        self._thread = threading.current_thread()
        while not self._stopping:
            now = self.clock()
            while self._heap and (self._heap[0][2].cancelled or self._heap[0][0] <= now):
                _, _, t = heapq.heappop(self._heap)
                if not t.cancelled:
                    fn, args = t.fn, t.args
                    t.fn, t.args = _noop, ()   # fired: no reference cycle through the handle
                    self._run_one(fn, args)
                if self._stopping:
                    return
            timeout = None
            if self._heap:
                timeout = max(0.0, self._heap[0][0] - self.clock())
            try:
                fn, args = self._queue.get(timeout=timeout if timeout is None or timeout < 3600 else 3600)
            except queue.Empty:
                continue
            self._run_one(fn, args)
            # drain what is already queued, but let a timer that fell due meanwhile go first:
            # a burst of callbacks must not hold back due firings
            for _ in range(256):
                if self._heap and self._heap[0][0] <= self.clock():
                    break
                try:
                    fn, args = self._queue.get_nowait()
                except queue.Empty:
                    break
                self._run_one(fn, args)
