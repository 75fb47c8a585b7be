"""The sensor's poll thread: perf events and counter samples in, posts to the loop out.

The thread reads the perf buffers (exec and connection events, loss records) and every
``sample_interval_s`` the kernel's per-slot and per-endpoint counters; every
``proc_interval_s`` it reads the node's /proc TCP counters and, in degraded mode, scans
/proc for processes. It never touches agent state: whatever it finds it hands to the
loop thread through ``post(fn, *args)``, the events of one wake-up in one post. What it
needs from the loop thread it reads from :class:`Published`.

Execs outside any job (node activity: every exec on the host) come through a perf ring of
their own that wakes this thread only once per NODE_WAKEUP_EVENTS of them; the rest are
read at the next wake-up, at the latest the next sample tick. A job's events wake it at
each (the exec policy acts on them).
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from typing import Any, Callable, Optional, Protocol

from agent.runtime import metrics
from agent.signals import abi, procfs
from agent.signals.attach import KernelObjects
from agent.signals.decode import decode_conn, decode_exec
from agent.signals.model import ConnEvent, ExecEvent, Gap
from agent.signals.procscan import ProcessScanner

log = logging.getLogger(__name__)

LOST_EVENTS = metrics.counter("millwright_bpf_lost_events_total", "Sensor events lost in the perf buffer (gaps).")
EVENTS = metrics.counter("millwright_bpf_events_total", "Sensor events delivered, by kind.", ("kind",))

PostFn = Callable[..., None]

NODE_WAKEUP_EVENTS = 32      # node execs per ring that wake the poll thread
EXEC_RECORD_MAX = 1536       # bytes of one exec record in a ring, at most (with its header)


def node_wakeup(perf_pages: int, page_size: int = 4096) -> int:
    """Node execs per wake-up: NODE_WAKEUP_EVENTS, or what a quarter of a ring holds (a
    ring must never fill before its reader is woken)."""
    return max(1, min(NODE_WAKEUP_EVENTS, perf_pages * page_size // (4 * EXEC_RECORD_MAX)))


class Published:
    """What the loop thread publishes for the poll thread. Each attribute is replaced by
    a new dict, never changed in place, so the poll thread reads a consistent one
    without a lock."""

    def __init__(self) -> None:
        self.slot_gens: dict[int, int] = {}                         # slot -> generation of its tracking
        self.endpoints: dict[int, tuple[tuple[str, ...], int]] = {}  # endpoint id -> (addresses, port)
        self.tracked: dict[int, int] = {}                           # pid -> slot


class Listeners(Protocol):
    """Where events go; each is read when the event is posted and may be None."""

    on_exec: Optional[Callable[[ExecEvent], None]]
    on_conn: Optional[Callable[[ConnEvent], None]]
    on_gap: Optional[Callable[[Gap], None]]


def deliver(cb: Optional[Callable[[Any], None]], ev: Any) -> None:
    """Runs on the loop thread: hand one event to its listener, if there is one."""
    if cb is not None:
        cb(ev)


def deliver_all(batch: list) -> None:
    """Runs on the loop thread: the events of one wake-up of the poll thread, in order,
    each to its listener (read when the event was read)."""
    for cb, ev in batch:
        if cb is not None:
            cb(ev)


class Poller:
    """The poll thread and the state only it touches.

    ``apply_kernel_sample(now, slots, stalls, eps)`` and ``apply_node_sample(now,
    counters, stalled, slot_stalls)`` are posted to the loop thread with each sample
    that differs from the last one (kernel) or every proc interval (node).
    """

    def __init__(self, post: PostFn, published: Published, listeners: Listeners, *,
                 apply_kernel_sample: Callable[..., None], apply_node_sample: Callable[..., None],
                 node_activity: bool, sample_interval_s: float, proc_interval_s: float):
        self._post = post
        self._published = published
        self._listeners = listeners
        self._apply_kernel_sample = apply_kernel_sample
        self._apply_node_sample = apply_node_sample
        self.node_activity = node_activity
        self.sample_interval_s = sample_interval_s
        self.proc_interval_s = proc_interval_s
        self.kernel: Optional[KernelObjects] = None   # None: degraded mode, /proc only
        self.scanner = ProcessScanner(lambda: self._published.tracked, node_activity)
        self.lost_total = 0
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._last_sample: Any = None
        self._exec_seen: dict[int, list] = {}   # slot -> [gen, delivered, last kernel count, reported]
        self._batch: list[tuple[Optional[Callable[[Any], None]], Any]] = []   # events of this wake-up

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, kernel: Optional[KernelObjects]) -> None:
        self.kernel = kernel
        self._stop.clear()
        self._thread = threading.Thread(target=self._main, name="bpf-poll", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
            self._thread = None
        self.kernel = None

    def scan_processes(self) -> None:
        """Degraded mode: post the execs of the processes found since the last scan (the
        first scan is the baseline: only processes started from then on are reported)."""
        for ev in self.scanner.scan():
            EVENTS.labels("exec" if ev.slot is not None else "node_exec").inc()
            self._batch.append((self._listeners.on_exec, ev))
        self._flush()

    def _flush(self) -> None:
        """One post to the loop with the events read since the last."""
        if self._batch:
            batch, self._batch = self._batch, []
            self._post(deliver_all, batch)

    # ------------------------------------------------------------------ the thread
    def _main(self) -> None:
        next_sample = time.monotonic()
        next_proc = time.monotonic()
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                kernel = self.kernel
                if kernel is not None and kernel.perf is not None:
                    wait = max(0.0, min(next_sample, next_proc) - now)
                    # round up: a timeout rounded down ends short of the tick, which turns
                    # the last millisecond before every tick into a busy loop of poll(0)
                    kernel.perf.poll(math.ceil(wait * 1000))
                    if kernel.perf.batched:   # what the batched rings hold below their mark
                        kernel.perf.consume()
                    self._flush()
                else:
                    self._stop.wait(max(0.0, next_proc - now))
                now = time.monotonic()
                if kernel is not None and kernel.perf is not None and now >= next_sample:
                    next_sample = now + self.sample_interval_s
                    self._sample_kernel(now, kernel)
                if now >= next_proc:
                    next_proc = now + self.proc_interval_s
                    self._sample_proc(now)
            except Exception:  # the sensor must keep going; the next tick retries
                log.exception("sensor poll failed")
                self._stop.wait(1.0)

    def _sample_kernel(self, now: float, kernel: KernelObjects) -> None:
        now_ns = time.monotonic_ns()
        gens = self._published.slot_gens
        stats = kernel.maps["slot_stats"]
        slots = {}
        for slot, gen in gens.items():
            v = stats.get(slot)
            if v is not None:
                slots[slot] = (gen, (v.retrans, v.resets_rx, v.resets_tx, v.connects, v.connect_failures, v.execs))
        stalls: dict[int, tuple[int, int]] = {}
        if gens:
            for _k, si in kernel.maps["socks"].items():
                start = abi.sock_stall_start_ns(si, now_ns)
                if start and si.slot in gens:
                    n, oldest = stalls.get(si.slot, (0, 0))
                    stalls[si.slot] = (n + 1, min(oldest, start) if oldest else start)
        eps = {}
        ep_stats = kernel.maps["ep_stats"]
        for epid in self._published.endpoints:
            v = ep_stats.get(epid)
            if v is not None:
                eps[epid] = (v.retrans, v.resets, v.connect_failures, v.last_retrans_ns)
        self._check_exec_accounting(slots)
        sample = (slots, stalls, eps)
        if sample != self._last_sample:
            self._last_sample = sample
            self._post(self._apply_kernel_sample, now, slots, stalls, eps)

    def _check_exec_accounting(self, slots: dict) -> None:
        """The kernel counts each tracked exec in slot_stats even when its event is
        dropped, and writes the perf loss record only in front of the *next* event that
        fits: after a burst and then silence, a loss would stay invisible. So when a
        slot's exec count has been quiet for a whole tick and still exceeds the exec
        events delivered for it, report the difference as an inferred gap."""
        for slot, (gen, counts) in slots.items():
            kernel = counts[5]
            seen = self._exec_seen.get(slot)
            if seen is None or seen[0] != gen:
                self._exec_seen[slot] = [gen, 0, kernel, 0]
                continue
            quiet = kernel == seen[2]
            seen[2] = kernel
            missing = kernel - seen[1] - seen[3]
            if quiet and missing > 0:
                seen[3] += missing
                self._post(deliver, self._listeners.on_gap, Gap(lost=missing, cpu=-1, ts=time.time(),
                                                                total_lost=self.lost_total, inferred=True, slot=slot))
        for slot in [s for s in self._exec_seen if s not in slots]:
            del self._exec_seen[slot]

    def _sample_proc(self, now: float) -> None:
        counters = procfs.read_tcp_counters()
        eps = self._published.endpoints
        degraded = self.kernel is None or self.kernel.perf is None
        stalled = {}
        if eps and degraded:
            ids = list(eps)
            for epid, n in zip(ids, procfs.stalled_sockets_towards([eps[i] for i in ids])):
                stalled[epid] = n
        slot_stalls = None
        if degraded:
            self.scan_processes()
            slot_stalls = self.scanner.slot_stalls(now)
        self._post(self._apply_node_sample, now, counters, stalled, slot_stalls)

    # ------------------------------------------------- perf callbacks (inside perf.poll)
    def on_raw(self, cpu: int, data: bytes) -> None:
        if len(data) < 4:
            return
        kind = int.from_bytes(data[:4], sys.byteorder)
        offset = time.time() - time.monotonic()
        if kind == abi.EV_EXEC:
            ev = decode_exec(data, offset)
            if ev.slot is None and not self.node_activity:
                return
            slot = ev.slot
            gen = self._published.slot_gens.get(slot) if slot is not None else None
            if gen is not None and slot is not None:
                seen = self._exec_seen.get(slot)
                if seen is None or seen[0] != gen:
                    seen = self._exec_seen[slot] = [gen, 0, 0, 0]
                seen[1] += 1
            EVENTS.labels("exec" if ev.slot is not None else "node_exec").inc()
            self._batch.append((self._listeners.on_exec, ev))
        elif kind == abi.EV_CONN:
            cev = decode_conn(data, offset)
            EVENTS.labels(cev.kind).inc()
            self._batch.append((self._listeners.on_conn, cev))

    def on_lost(self, cpu: int, n: int) -> None:
        self.lost_total += n
        LOST_EVENTS.inc(n)
        log.warning("sensor events lost", extra={"fields": {"lost": n, "cpu": cpu, "total": self.lost_total}})
        self._batch.append((self._listeners.on_gap, Gap(lost=n, cpu=cpu, ts=time.time(), total_lost=self.lost_total)))
