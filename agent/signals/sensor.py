"""The kernel sensor as the agent sees it: job-slot tracking in, signals and events out.

Life cycle (see docs/bpf.md):
- ``start()`` attaches bpf/sensor.c through the short-lived loader process
  (agent.signals.attach); the agent itself never imports bcc. If anything is missing
  the sensor runs degraded (node-level counters from /proc, /proc polling for
  processes) and ``mode`` says why.
- A poll thread (agent.signals.polling) reads the perf buffers and samples the kernel's
  per-slot and per-endpoint counters; it never touches agent state, it only calls
  ``post(fn, *args)``.
- Everything else (track/untrack, watches, the signal queries, the callbacks) runs on
  the daemon's event-loop thread; the sampled counters live in agent.signals.history.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from agent.runtime import metrics
from agent.signals import abi
from agent.signals.attach import KernelObjects, LoadError, attach
from agent.signals.history import SignalHistory
from agent.signals.model import ConnEvent, EndpointSignals, ExecEvent, Gap, NodeSignals, SlotSignals
from agent.signals.polling import Poller, PostFn, Published, node_wakeup

if TYPE_CHECKING:
    from agent.config import BpfConfig

log = logging.getLogger(__name__)

DEGRADED = metrics.gauge("millwright_bpf_degraded", "1 when the sensor runs without BPF (node-level /proc signals only).")
LOAD_SECONDS = metrics.gauge("millwright_bpf_load_seconds", "Time the last sensor load took (loader process, compile, attach).")
TRACKED_SLOTS = metrics.gauge("millwright_bpf_tracked_slots", "Job slots currently tracked by the sensor.")


class Sensor:
    """Exec and TCP signals from kernel tracepoints, attributed to job slots.

    Slots are small integers 1..1023 chosen by the daemon (one per live run, reusable
    after untrack). Typical use on the loop thread::

        sensor = Sensor.from_config(cfg.bpf, loop.post, on_exec=..., on_gap=...)
        sensor.start()
        with sensor.spawning(slot):
            proc = subprocess.Popen(argv, ...)
        sensor.track(proc.pid, slot)
        ...
        sig = sensor.slot_signals(slot)
        sensor.untrack(slot)
    """

    def __init__(self, post: PostFn, *, on_exec: Optional[Callable[[ExecEvent], None]] = None,
                 on_conn: Optional[Callable[[ConnEvent], None]] = None,
                 on_gap: Optional[Callable[[Gap], None]] = None,
                 on_signals: Optional[Callable[[set, set], None]] = None,
                 enabled: bool = True, node_activity: bool = True, perf_pages: int = 64,
                 window_s: float = 5.0, sample_interval_s: float = 0.25, proc_interval_s: float = 1.0,
                 tracefs: Optional[str] = None, load_timeout_s: float = 60.0):
        if perf_pages < 1 or perf_pages & (perf_pages - 1):
            raise ValueError("perf_pages must be a power of two")
        self.on_exec = on_exec
        self.on_conn = on_conn
        self.on_gap = on_gap
        self.on_signals = on_signals
        self.enabled = enabled
        self.node_activity = node_activity
        self.perf_pages = perf_pages
        self.window_s = window_s
        self.sample_interval_s = sample_interval_s
        self.proc_interval_s = proc_interval_s
        self.tracefs = tracefs
        self.load_timeout_s = load_timeout_s
        self.mode = "stopped"
        self.info: dict[str, Any] = {}
        self._kernel: Optional[KernelObjects] = None   # BPF mode only
        self._published = Published()
        self._poller = Poller(post, self._published, self, apply_kernel_sample=self._apply_kernel_sample,
                              apply_node_sample=self._apply_node_sample, node_activity=node_activity,
                              sample_interval_s=sample_interval_s, proc_interval_s=proc_interval_s)
        self._history = SignalHistory(window_s)
        self._gen = 0
        self._tracked_pids: dict[int, int] = {}
        self._eps: dict[tuple[str, int], int] = {}          # (host, port) -> endpoint id
        self._ep_addrs: dict[int, tuple[str, ...]] = {}

    @classmethod
    def from_config(cls, bpf_cfg: BpfConfig, post: PostFn, **kw: Any) -> "Sensor":
        """Build from the bpf section; a keyword given here wins over its setting."""
        settings = {"enabled": bpf_cfg.enabled, "node_activity": bpf_cfg.node_activity,
                    "perf_pages": bpf_cfg.perf_pages, "window_s": bpf_cfg.window_s,
                    "sample_interval_s": bpf_cfg.sample_interval_s}
        return cls(post, **{**settings, **kw})

    # ------------------------------------------------------------------ life cycle
    @property
    def is_bpf(self) -> bool:
        return self.mode == "bpf"

    @property
    def lost_events(self) -> int:
        return self._poller.lost_total

    def start(self) -> str:
        """Load the program (blocking, about 1-2 s) or fall back to degraded mode.
        Returns and sets ``mode``: "bpf" or "degraded: <why>"."""
        if self._poller.running:
            return self.mode
        t0 = time.monotonic()
        if not self.enabled:
            self._set_degraded("bpf.enabled is false")
        else:
            try:
                self._kernel = attach(tracefs=self.tracefs, node_activity=self.node_activity,
                                      perf_pages=self.perf_pages, timeout_s=self.load_timeout_s,
                                      on_raw=self._poller.on_raw, on_lost=self._poller.on_lost, info=self.info,
                                      node_wakeup=node_wakeup(self.perf_pages, mmap.PAGESIZE))
                self.mode = "bpf"
                DEGRADED.set(0)
                maps = self._kernel.maps
                for slot in self._published.slot_gens:   # tracked before start(): hand over to the kernel
                    maps["slot_stats"].set(slot, abi.SlotStats())
                for pid, slot in self._tracked_pids.items():
                    maps["tracked"].set(pid, slot)
                for (_host, port), epid in self._eps.items():
                    maps["ep_stats"].set(epid, abi.EpStats())
                    for k in abi.endpoint_keys(self._ep_addrs[epid], port):
                        maps["endpoints"].set(k, epid)
            except LoadError as exc:
                self._close_kernel()
                self._set_degraded(str(exc))
        self.info["start_s"] = round(time.monotonic() - t0, 3)
        if self.is_bpf:
            LOAD_SECONDS.set(self.info["start_s"])
        log.info("sensor started", extra={"fields": {"mode": self.mode, **{k: v for k, v in self.info.items()
                                                                              if k in ("start_s", "compile_s", "loader_maxrss_kb")}}})
        if not self.is_bpf:
            self._poller.scan_processes()  # the baseline: only processes started from now on are reported
        self._poller.start(self._kernel)
        return self.mode

    def _set_degraded(self, why: str) -> None:
        self.mode = f"degraded: {why}"
        DEGRADED.set(1)
        log.warning("sensor degraded", extra={"fields": {"why": why}})

    def stop(self) -> None:
        """Stop polling and detach the programs (closing the last fds unloads them)."""
        self._poller.stop()
        self._close_kernel()
        self.mode = "stopped"

    def _close_kernel(self) -> None:
        if self._kernel is not None:
            self._kernel.close()
            self._kernel = None

    def _map(self, name: str) -> Any:
        """A kernel map; only in BPF mode."""
        assert self._kernel is not None
        return self._kernel.maps[name]

    # ----------------------------------------------------------- tracking (loop thread)
    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 < slot < abi.MAX_SLOTS:
            raise ValueError(f"slot must be an int in 1..{abi.MAX_SLOTS - 1}, got {slot!r}")

    def _activate(self, slot: int) -> None:
        if slot in self._published.slot_gens:
            return
        self._gen += 1
        if self.is_bpf:
            self._map("slot_stats").set(slot, abi.SlotStats())
        self._history.add_slot(slot, time.monotonic())
        self._published.slot_gens = {**self._published.slot_gens, slot: self._gen}
        TRACKED_SLOTS.set(len(self._published.slot_gens))

    def track(self, pid: int, slot: int) -> None:
        """Attribute process `pid` (and every process it forks from now on) to `slot`.
        The first track of a slot resets its counters."""
        self._check_slot(slot)
        self._activate(slot)
        self._tracked_pids[pid] = slot
        self._published.tracked = dict(self._tracked_pids)
        if self.is_bpf:
            self._map("tracked").set(pid, slot)

    @contextlib.contextmanager
    def spawning(self, slot: int) -> Iterator[None]:
        """Race-free tracking of a child: every fork made by the calling thread inside
        this block is tracked under `slot` in the kernel at fork time, before the child
        can exec anything. Call track(proc.pid, slot) afterwards as well (it is what the
        degraded mode uses)."""
        self._check_slot(slot)
        self._activate(slot)
        tid = threading.get_native_id()
        if self.is_bpf:
            self._map("spawner").set(tid, slot)
        try:
            yield
        finally:
            if self.is_bpf:
                self._map("spawner").delete(tid)

    def untrack(self, slot: int) -> None:
        """Forget a slot: its processes and sockets stop being attributed. Query
        slot_signals(slot) before this if you need the final figures."""
        self._check_slot(slot)
        if self.is_bpf:
            tracked, socks = self._map("tracked"), self._map("socks")
            for k, v in list(tracked.items()):
                if v.value == slot:
                    tracked.delete(k)
            for k, v in list(socks.items()):
                if v.slot == slot:
                    socks.delete(k)
        self._tracked_pids = {p: s for p, s in self._tracked_pids.items() if s != slot}
        self._published.tracked = dict(self._tracked_pids)
        gens = dict(self._published.slot_gens)
        gens.pop(slot, None)
        self._published.slot_gens = gens
        self._history.drop_slot(slot)
        TRACKED_SLOTS.set(len(self._published.slot_gens))

    def tracked_slots(self) -> list[int]:
        return sorted(self._published.slot_gens)

    # ---------------------------------------------------------- endpoints (loop thread)
    def watch_endpoint(self, host: str, port: int) -> tuple[str, ...]:
        """Count retransmits, resets and failed connects towards host:port for every
        socket on the node (the agent's own etcd and MQTT connections). The host is
        resolved now (getaddrinfo); returns the addresses watched."""
        key = (host, int(port))
        if key in self._eps:
            return self._ep_addrs[self._eps[key]]
        used = set(self._eps.values())
        free = [i for i in range(abi.MAX_EPS) if i not in used]
        if not free:
            raise ValueError(f"at most {abi.MAX_EPS} watched endpoints")
        try:
            infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
        except socket.gaierror as exc:
            raise ValueError(f"cannot resolve {host}: {exc}") from None
        addrs = tuple(sorted({str(i[4][0]) for i in infos}))
        epid = free[0]
        if self.is_bpf:
            self._map("ep_stats").set(epid, abi.EpStats())
            for k in abi.endpoint_keys(addrs, int(port)):
                self._map("endpoints").set(k, epid)
        now = time.monotonic()
        self._eps[key] = epid
        self._ep_addrs[epid] = addrs
        self._history.add_endpoint(epid, now)
        self._published.endpoints = {**self._published.endpoints, epid: (addrs, int(port))}
        return addrs

    def watch_url(self, url: str) -> tuple[str, int]:
        """watch_endpoint for a config URL (etcd endpoint or MQTT URL); returns (host, port)."""
        from urllib.parse import urlsplit

        u = urlsplit(url if "://" in url else "tcp://" + url)
        defaults = {"mqtt": 1883, "mqtts": 8883, "http": 80, "https": 443}
        try:
            port = u.port or defaults.get(u.scheme)
        except ValueError:
            port = None
        if not u.hostname or not port:
            raise ValueError(f"cannot tell host and port from {url!r}")
        self.watch_endpoint(u.hostname, port)
        return u.hostname, port

    def unwatch_endpoint(self, host: str, port: int) -> None:
        epid = self._eps.pop((host, int(port)), None)
        if epid is None:
            return
        addrs = self._ep_addrs.pop(epid)
        if self.is_bpf:
            for k in abi.endpoint_keys(addrs, int(port)):
                self._map("endpoints").delete(k)
        snap = dict(self._published.endpoints)
        snap.pop(epid, None)
        self._published.endpoints = snap
        self._history.drop_endpoint(epid)

    def _endpoint_names(self, epids: set[int]) -> set[tuple[str, int]]:
        names = {v: k for k, v in self._eps.items()}
        return {names[e] for e in epids if e in names}

    # ------------------------------------------------------------ queries (loop thread)
    def slot_signals(self, slot: int) -> SlotSignals:
        return self._history.slot_signals(slot, kernel=self.is_bpf)

    def endpoint_signals(self, host: str, port: int) -> EndpointSignals:
        epid = self._eps.get((host, int(port)))
        if epid is None:
            raise KeyError(f"endpoint {host}:{port} is not watched")
        return self._history.endpoint_signals(host, port, epid, self._ep_addrs[epid], kernel=self.is_bpf)

    def node_signals(self) -> NodeSignals:
        return self._history.node

    def status(self) -> dict:
        """For `millwright status` and the admin socket."""
        return {"mode": self.mode, "tracked_slots": len(self._published.slot_gens),
                "watched_endpoints": len(self._eps), "lost_events": self._poller.lost_total,
                **{k: v for k, v in self.info.items() if k != "cflags"}}

    # -------------------------------------- samples from the poll thread (loop thread)
    def _apply_kernel_sample(self, now: float, slots: dict, stalls: dict, eps: dict) -> None:
        changed_slots, changed_eps = self._history.apply_kernel_sample(now, slots, stalls, eps,
                                                                       self._published.slot_gens)
        if (changed_slots or changed_eps) and self.on_signals is not None:
            self.on_signals(changed_slots, self._endpoint_names(changed_eps))

    def _apply_node_sample(self, now: float, counters: dict, stalled: dict,
                           slot_stalls: Optional[dict] = None) -> None:
        self._history.apply_node_counters(now, counters)
        if slot_stalls is not None:
            changed_slots = self._history.apply_proc_stalls(slot_stalls, self._published.slot_gens)
            if changed_slots and self.on_signals is not None:
                self.on_signals(changed_slots, set())
        changed = self._history.apply_endpoint_stalls(stalled)
        if changed and self.on_signals is not None:
            self.on_signals(set(), self._endpoint_names(changed))
