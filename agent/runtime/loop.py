"""The daemon's single-threaded event loop.

All agent state is owned by the thread running :meth:`EventLoop.run`. Adapter threads
(etcd keepalive and watches, paho's network thread, the BPF poller) never touch that
state: they call :meth:`post`, which is the only thread-safe entry point. Timers are one
heap on the loop, not a thread per job.

Past capacity (more due timers and posted callbacks than the thread can run), timers and
posted callbacks take turns of at most ``SLICE_S`` each: due firings keep starting and the
work already started (a claim that landed, a run that ended) keeps finishing, so lateness
grows with the backlog and drains once it is gone; neither side starves the other. How
late the loop runs its due timers, and how late work it was told of started (a firing
that waited for admission, its claim or its spawn behind others: :meth:`EventLoop.note_late`),
is its lag (:meth:`EventLoop.lag`, the ``millwright_scheduler_lag_seconds`` gauge): a
backlog shows there even while the timers themselves run on time.
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

from agent.runtime.metrics import counter, gauge

log = logging.getLogger(__name__)

STALLS = counter("millwright_loop_stalls_total", "Loop handlers that ran longer than the stall threshold")
LAG = gauge("millwright_scheduler_lag_seconds",
            "How late the agent starts what falls due (its loop's timers; its firings' admission, claims and spawns): "
            "the worst of the last second, or how overdue the next timer is")

SLICE_S = 0.005      # past capacity, timers and posted callbacks take turns of this long
LAG_WINDOW_S = 1.0   # the lag is the worst lateness of a due timer over this long


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
        self._lag = (0.0, 0.0, 0.0)   # (window start, worst in the window, worst in the window before)

    # --- thread-safe -------------------------------------------------------------
    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the loop thread. Safe from any thread."""
        self._queue.put((fn, args))

    def stop(self) -> None:
        self.post(self._set_stopping)

    def lag(self) -> float:
        """How late the loop runs its due timers and starts the work noted late: the worst
        lateness over the last second, or, when the loop is stuck, how overdue its next
        timer is. Safe from any thread."""
        start, worst, before = self._lag
        now = self.clock()
        age = now - start
        # the worst of the current window and the one before; a window no timer ran in is over
        recent = max(worst, before) if age < LAG_WINDOW_S else worst if age < 2 * LAG_WINDOW_S else 0.0
        try:
            head = self._heap[0]
        except IndexError:
            head = None
        overdue = now - head[0] if head is not None and not head[2].cancelled else 0.0
        return max(recent, overdue, 0.0)

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

    def note_late(self, late: float) -> None:
        """Work that was due ``late`` seconds before it started (a firing's first run, after
        its claim and spawn): counted in the lag like a timer run that late."""
        self._note(self.clock(), late)

    def _late(self, now: float, when: float) -> None:
        self._note(now, now - when)

    def _note(self, now: float, late: float) -> None:
        start, worst, before = self._lag
        if now - start >= LAG_WINDOW_S:
            start, worst, before = now, 0.0, (worst if now - start < 2 * LAG_WINDOW_S else 0.0)
        self._lag = (start, late if late > worst else worst, before)

    def run(self) -> None:
        self._thread = threading.current_thread()
        LAG.set_function(self.lag)
        clock, heap, q = self.clock, self._heap, self._queue
        while not self._stopping:
            # due timers, for at most SLICE_S while callbacks wait
            now = clock()
            turn_ends = now + SLICE_S
            while heap and (heap[0][2].cancelled or heap[0][0] <= now):
                when, _, t = heapq.heappop(heap)
                if not t.cancelled:
                    self._late(clock(), when)
                    fn, args = t.fn, t.args
                    t.fn, t.args = _noop, ()   # fired: no reference cycle through the handle
                    self._run_one(fn, args)
                    if self._stopping:
                        return
                    if not q.empty() and clock() >= turn_ends:
                        break
            timeout = None
            if heap:
                timeout = max(0.0, heap[0][0] - clock())
            try:
                fn, args = q.get(timeout=timeout if timeout is None or timeout < 3600 else 3600)
            except queue.Empty:
                continue
            self._run_one(fn, args)
            # drain what is already queued; a timer that fell due meanwhile goes first once
            # this turn had SLICE_S (a burst of callbacks must not hold back due firings,
            # nor a stream of due timers the work they started)
            turn_ends = clock() + SLICE_S
            for _ in range(256):
                if heap and heap[0][0] <= (now := clock()) and now >= turn_ends:
                    break
                try:
                    fn, args = q.get_nowait()
                except queue.Empty:
                    break
                self._run_one(fn, args)
