"""The kernel sensor as the agent sees it: job-slot tracking in, signals and events out.

Life cycle (see docs/bpf.md):
- ``start()`` spawns the short-lived loader (agent.signals.loader), which compiles and
  attaches bpf/sensor.c with BCC and hands the map and attachment fds back over a Unix
  socket; the agent itself never imports bcc. If anything is missing the sensor runs
  degraded (node-level counters from /proc, /proc polling for processes) and ``mode``
  says why.
- A poll thread reads the perf buffers and samples the kernel's per-slot and
  per-endpoint counters; it never touches agent state, it only calls ``post(fn, *args)``.
- Everything else (track/untrack, watches, the signal queries, the callbacks) runs on
  the daemon's event-loop thread.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes as ct
import json
import logging
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from agent.runtime import metrics
from agent.signals import abi, check, procfs
from agent.signals.model import ConnEvent, EndpointSignals, ExecEvent, Gap, NodeSignals, SlotSignals

if TYPE_CHECKING:
    from agent.signals import bpfsys

log = logging.getLogger(__name__)

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LOST_EVENTS = metrics.counter("millwright_bpf_lost_events_total", "Sensor events lost in the perf buffer (gaps).")
EVENTS = metrics.counter("millwright_bpf_events_total", "Sensor events delivered, by kind.", ("kind",))
DEGRADED = metrics.gauge("millwright_bpf_degraded", "1 when the sensor runs without BPF (node-level /proc signals only).")
LOAD_SECONDS = metrics.gauge("millwright_bpf_load_seconds", "Time the last sensor load took (loader process, compile, attach).")
TRACKED_SLOTS = metrics.gauge("millwright_bpf_tracked_slots", "Job slots currently tracked by the sensor.")

PostFn = Callable[..., None]


class LoadError(RuntimeError):
    """The BPF program could not be loaded; the message is the degraded-mode reason."""


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
        self._post = post
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
        # kernel objects (BPF mode)
        self._maps: dict[str, Any] = {}
        self._tp_fds: list[int] = []
        self._map_fds: list[int] = []
        self._perf: Optional[bpfsys.PerfBuffers] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        # poll-thread-only state
        self._proc_stall_seen: dict[int, float] = {}  # degraded mode: socket inode -> first seen stalled
        self._lost_total = 0
        self._last_sample: Any = None
        self._proc_known: Optional[set[int]] = None
        self._proc_slots: dict[int, int] = {}
        self._exec_seen: dict[int, list] = {}   # slot -> [gen, delivered, last kernel count, reported]
        # immutable snapshots the loop thread publishes for the poll thread
        self._slot_gens: dict[int, int] = {}
        self._eps_snapshot: dict[int, tuple[tuple[str, ...], int]] = {}
        self._tracked_snapshot: dict[int, int] = {}
        # loop-thread state
        self._gen = 0
        self._slot_hist: dict[int, collections.deque] = {}
        self._slot_latest: dict[int, tuple] = {}
        self._slot_stall: dict[int, tuple[int, int]] = {}
        self._slot_start: dict[int, float] = {}
        self._eps: dict[tuple[str, int], int] = {}          # (host, port) -> endpoint id
        self._ep_addrs: dict[int, tuple[str, ...]] = {}
        self._ep_hist: dict[int, collections.deque] = {}
        self._ep_latest: dict[int, tuple] = {}
        self._ep_stalled: dict[int, int] = {}
        self._ep_start: dict[int, float] = {}
        self._node: NodeSignals = NodeSignals()
        self._proc_stall: dict[int, tuple[int, float]] = {}
        self._node_prev: Optional[tuple[float, int]] = None
        self._tracked_pids: dict[int, int] = {}

    @classmethod
    def from_config(cls, bpf_cfg: Any, post: PostFn, **kw: Any) -> "Sensor":
        """Build from agent.config.BpfConfig (enabled, node_activity, perf_pages, ...)."""
        for name in ("enabled", "node_activity", "perf_pages", "window_s", "sample_interval_s"):
            if hasattr(bpf_cfg, name) and name not in kw:
                kw[name] = getattr(bpf_cfg, name)
        return cls(post, **kw)

    # ------------------------------------------------------------------ life cycle
    @property
    def is_bpf(self) -> bool:
        return self.mode == "bpf"

    @property
    def lost_events(self) -> int:
        return self._lost_total

    def start(self) -> str:
        """Load the program (blocking, about 1-2 s) or fall back to degraded mode.
        Returns and sets ``mode``: "bpf" or "degraded: <why>"."""
        if self._thread:
            return self.mode
        t0 = time.monotonic()
        if not self.enabled:
            self._set_degraded("bpf.enabled is false")
        else:
            try:
                self._load()
                self.mode = "bpf"
                DEGRADED.set(0)
                for slot in self._slot_gens:       # tracked before start(): hand over to the kernel
                    self._maps["slot_stats"].set(slot, abi.SlotStats())
                for pid, slot in self._tracked_pids.items():
                    self._maps["tracked"].set(pid, slot)
                for (_host, port), epid in self._eps.items():
                    self._maps["ep_stats"].set(epid, abi.EpStats())
                    for k in self._ep_keys(self._ep_addrs[epid], port):
                        self._maps["endpoints"].set(k, epid)
            except LoadError as exc:
                self._close_kernel()
                self._set_degraded(str(exc))
        self.info["start_s"] = round(time.monotonic() - t0, 3)
        if self.is_bpf:
            LOAD_SECONDS.set(self.info["start_s"])
        log.info("sensor started", extra={"fields": {"mode": self.mode, **{k: v for k, v in self.info.items()
                                                                              if k in ("start_s", "compile_s", "loader_maxrss_kb")}}})
        self._stop.clear()
        if not self.is_bpf:
            self._scan_processes()  # the baseline: only processes started from now on are reported
        self._thread = threading.Thread(target=self._poll_main, name="bpf-poll", daemon=True)
        self._thread.start()
        return self.mode

    def _set_degraded(self, why: str) -> None:
        self.mode = f"degraded: {why}"
        DEGRADED.set(1)
        log.warning("sensor degraded", extra={"fields": {"why": why}})

    def stop(self) -> None:
        """Stop polling and detach the programs (closing the last fds unloads them)."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
            self._thread = None
        self._close_kernel()
        self.mode = "stopped"

    def _close_kernel(self) -> None:
        if self._perf is not None:
            self._perf.close()
            self._perf = None
        for fd in self._tp_fds + self._map_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._tp_fds, self._map_fds, self._maps = [], [], {}

    def _load(self) -> None:
        reason = check.preflight(self.tracefs)
        if reason:
            raise LoadError(reason)
        try:
            from agent.signals import bpfsys

            bpfsys.lib()
        except OSError as exc:
            raise LoadError(str(exc)) from None
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        errf = tempfile.TemporaryFile()
        from agent.signals.loader import environment

        env = environment(PACKAGE_ROOT)
        config = {"node_activity": self.node_activity, "tracefs": self.tracefs}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "agent.signals.loader", "--sock-fd", str(child.fileno()),
                 "--config", json.dumps(config)],
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errf,
                env=env, cwd=PACKAGE_ROOT)
        except OSError as exc:
            raise LoadError(f"cannot start the loader: {exc}") from None
        finally:
            child.close()
        fds: list[int] = []
        try:
            parent.settimeout(self.load_timeout_s)
            try:
                msg, fds, _flags, _addr = socket.recv_fds(parent, 1 << 16, 128)
            except socket.timeout:
                proc.kill()
                raise LoadError(f"loader did not answer within {self.load_timeout_s:.0f}s") from None
            for fd in fds:
                os.set_inheritable(fd, False)
            doc = json.loads(msg.decode() or "{}") if msg else {}
            if not doc.get("ok"):
                errf.seek(0)
                tail = [ln for ln in errf.read().decode(errors="replace").splitlines() if ln.strip()][-3:]
                why = doc.get("error") or (f"loader exited: {' | '.join(tail)}" if tail else "loader exited")
                if tail and doc.get("error"):
                    log.warning("loader stderr", extra={"fields": {"tail": " | ".join(tail)}})
                for fd in fds:
                    os.close(fd)
                raise LoadError(why)
            try:
                parent.send(b"ok")
            except OSError:
                pass
        finally:
            parent.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
            errf.close()
        self.info.update({k: doc[k] for k in ("bcc_version", "import_s", "compile_s", "loader_maxrss_kb", "cflags")})
        self._map_fds = [fds[i] for i in doc["maps"].values()]
        self._tp_fds = [fds[i] for i in doc["tracepoints"].values()]
        from agent.signals import bpfsys

        for name, (k, v) in abi.MAPS.items():
            self._maps[name] = bpfsys.Map(name, fds[doc["maps"][name]], k, v)
        try:
            self._perf = bpfsys.PerfBuffers(fds[doc["maps"]["events"]], bpfsys.online_cpus(), self.perf_pages,
                                            self._on_raw, self._on_lost)
        except OSError as exc:
            raise LoadError(f"perf buffers: {exc}") from None

    # ----------------------------------------------------------- tracking (loop thread)
    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 < slot < abi.MAX_SLOTS:
            raise ValueError(f"slot must be an int in 1..{abi.MAX_SLOTS - 1}, got {slot!r}")

    def _activate(self, slot: int) -> None:
        if slot in self._slot_gens:
            return
        self._gen += 1
        if self.is_bpf:
            self._maps["slot_stats"].set(slot, abi.SlotStats())
        now = time.monotonic()
        self._slot_hist[slot] = collections.deque([(now, 0, 0)])
        self._slot_latest[slot] = (0, 0, 0, 0, 0, 0)
        self._slot_stall[slot] = (0, 0)
        self._slot_start[slot] = now
        self._slot_gens = {**self._slot_gens, slot: self._gen}
        TRACKED_SLOTS.set(len(self._slot_gens))

    def track(self, pid: int, slot: int) -> None:
        """Attribute process `pid` (and every process it forks from now on) to `slot`.
        The first track of a slot resets its counters."""
        self._check_slot(slot)
        self._activate(slot)
        self._tracked_pids[pid] = slot
        self._tracked_snapshot = dict(self._tracked_pids)
        if self.is_bpf:
            self._maps["tracked"].set(pid, slot)

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
            self._maps["spawner"].set(tid, slot)
        try:
            yield
        finally:
            if self.is_bpf:
                self._maps["spawner"].delete(tid)

    def untrack(self, slot: int) -> None:
        """Forget a slot: its processes and sockets stop being attributed. Query
        slot_signals(slot) before this if you need the final figures."""
        self._check_slot(slot)
        if self.is_bpf:
            tracked, socks = self._maps["tracked"], self._maps["socks"]
            for k, v in list(tracked.items()):
                if v.value == slot:
                    tracked.delete(k)
            for k, v in list(socks.items()):
                if v.slot == slot:
                    socks.delete(k)
        self._tracked_pids = {p: s for p, s in self._tracked_pids.items() if s != slot}
        self._tracked_snapshot = dict(self._tracked_pids)
        gens = dict(self._slot_gens)
        gens.pop(slot, None)
        self._slot_gens = gens
        for d in (self._slot_hist, self._slot_latest, self._slot_stall, self._slot_start, self._proc_stall):
            d.pop(slot, None)
        TRACKED_SLOTS.set(len(self._slot_gens))

    def tracked_slots(self) -> list[int]:
        return sorted(self._slot_gens)

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
            self._maps["ep_stats"].set(epid, abi.EpStats())
            for k in self._ep_keys(addrs, int(port)):
                self._maps["endpoints"].set(k, epid)
        now = time.monotonic()
        self._eps[key] = epid
        self._ep_addrs[epid] = addrs
        self._ep_hist[epid] = collections.deque([(now, 0, 0)])
        self._ep_latest[epid] = (0, 0, 0, 0)
        self._ep_start[epid] = now
        self._eps_snapshot = {**self._eps_snapshot, epid: (addrs, int(port))}
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
            for k in self._ep_keys(addrs, int(port)):
                self._maps["endpoints"].delete(k)
        snap = dict(self._eps_snapshot)
        snap.pop(epid, None)
        self._eps_snapshot = snap
        for d in (self._ep_hist, self._ep_latest, self._ep_start, self._ep_stalled):
            d.pop(epid, None)

    @staticmethod
    def _ep_keys(addrs: tuple[str, ...], port: int) -> list[abi.EpKey]:
        keys = []
        for a in addrs:
            if ":" in a:
                fam, raw = abi.AF_INET6, socket.inet_pton(socket.AF_INET6, a)
                keys.append(_ep_key(fam, raw, port))
            else:
                raw4 = socket.inet_pton(socket.AF_INET, a)
                keys.append(_ep_key(abi.AF_INET, raw4, port))
                # dual-stack sockets talk to IPv4 peers through v4-mapped IPv6 addresses
                keys.append(_ep_key(abi.AF_INET6, b"\0" * 10 + b"\xff\xff" + raw4, port))
        return keys

    # ------------------------------------------------------------ queries (loop thread)
    def slot_signals(self, slot: int) -> SlotSignals:
        if not self.is_bpf:
            n, since = self._proc_stall.get(slot, (0, 0.0))
            return SlotSignals(slot=slot, available=False, stalled_connections=n,
                               oldest_stall_age_s=max(0.0, time.monotonic() - since) if n else 0.0)
        latest = self._slot_latest.get(slot)
        if latest is None:
            return SlotSignals(slot=slot, available=True)
        now = time.monotonic()
        hist = self._slot_hist[slot]
        rate, fails_w = _window(hist, now, self.window_s, self._slot_start[slot])
        retrans, rrx, rtx, connects, fails, execs = latest
        n, oldest_ns = self._slot_stall.get(slot, (0, 0))
        age = max(0.0, time.monotonic_ns() / 1e9 - oldest_ns / 1e9) if oldest_ns else 0.0
        return SlotSignals(slot=slot, available=True, retransmits=retrans, retrans_per_s=rate,
                           resets=rrx + rtx, resets_rx=rrx, resets_tx=rtx, connects=connects,
                           failed_connects=fails, failed_connects_in_window=fails_w, execs=execs,
                           stalled_connections=n, oldest_stall_age_s=age)

    def endpoint_signals(self, host: str, port: int) -> EndpointSignals:
        epid = self._eps.get((host, int(port)))
        if epid is None:
            raise KeyError(f"endpoint {host}:{port} is not watched")
        addrs = self._ep_addrs[epid]
        if not self.is_bpf:
            return EndpointSignals(host=host, port=int(port), available=False, addresses=addrs,
                                   stalled_sockets=self._ep_stalled.get(epid, 0))
        now = time.monotonic()
        rate, fails_w = _window(self._ep_hist[epid], now, self.window_s, self._ep_start[epid])
        retrans, resets, fails, last_ns = self._ep_latest[epid]
        age = max(0.0, time.monotonic_ns() / 1e9 - last_ns / 1e9) if last_ns else None
        return EndpointSignals(host=host, port=int(port), available=True, addresses=addrs, retransmits=retrans,
                               retrans_per_s=rate, resets=resets, failed_connects=fails,
                               last_retransmit_age_s=age, stalled_sockets=self._ep_stalled.get(epid))

    def node_signals(self) -> NodeSignals:
        return self._node

    def status(self) -> dict:
        """For `millwright status` and the admin socket."""
        return {"mode": self.mode, "tracked_slots": len(self._slot_gens), "watched_endpoints": len(self._eps),
                "lost_events": self._lost_total, **{k: v for k, v in self.info.items() if k != "cflags"}}

    # ------------------------------------------------------------------ poll thread
    def _poll_main(self) -> None:
        next_sample = time.monotonic()
        next_proc = time.monotonic()
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if self._perf is not None:
                    wait = max(0.0, min(next_sample, next_proc) - now)
                    # round up: a timeout rounded down ends short of the tick, which turns
                    # the last millisecond before every tick into a busy loop of poll(0)
                    self._perf.poll(math.ceil(wait * 1000))
                else:
                    self._stop.wait(max(0.0, next_proc - now))
                now = time.monotonic()
                if self._perf is not None and now >= next_sample:
                    next_sample = now + self.sample_interval_s
                    self._sample_kernel(now)
                if now >= next_proc:
                    next_proc = now + self.proc_interval_s
                    self._sample_proc(now)
            except Exception:  # the sensor must keep going; the next tick retries
                log.exception("sensor poll failed")
                self._stop.wait(1.0)

    def _sample_kernel(self, now: float) -> None:
        now_ns = time.monotonic_ns()
        gens = self._slot_gens
        stats = self._maps["slot_stats"]
        slots = {}
        for slot, gen in gens.items():
            v = stats.get(slot)
            if v is not None:
                slots[slot] = (gen, (v.retrans, v.resets_rx, v.resets_tx, v.connects, v.connect_failures, v.execs))
        stalls: dict[int, tuple[int, int]] = {}
        if gens:
            for _k, si in self._maps["socks"].items():
                start = abi.sock_stall_start_ns(si, now_ns)
                if start and si.slot in gens:
                    n, oldest = stalls.get(si.slot, (0, 0))
                    stalls[si.slot] = (n + 1, min(oldest, start) if oldest else start)
        eps = {}
        ep_stats = self._maps["ep_stats"]
        for epid in self._eps_snapshot:
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
                self._post(self._deliver, self.on_gap, Gap(lost=missing, cpu=-1, ts=time.time(),
                                                           total_lost=self._lost_total, inferred=True, slot=slot))
        for slot in [s for s in self._exec_seen if s not in slots]:
            del self._exec_seen[slot]

    def _sample_proc(self, now: float) -> None:
        counters = procfs.read_tcp_counters()
        eps = self._eps_snapshot
        stalled = {}
        if eps and self._perf is None:
            ids = list(eps)
            for epid, n in zip(ids, procfs.stalled_sockets_towards([eps[i] for i in ids])):
                stalled[epid] = n
        slot_stalls = None
        if self._perf is None:
            self._scan_processes()
            slot_stalls = self._proc_slot_stalls(now)
        self._post(self._apply_node_sample, now, counters, stalled, slot_stalls)

    def _proc_slot_stalls(self, now: float) -> dict[int, tuple[int, float]]:
        """Degraded mode: per slot, sockets of its processes that sit in SYN_SENT or have
        unrecovered retransmits (/proc/<pid>/fd + /proc/net/tcp), with the monotonic time
        the oldest was first seen so (accurate to the polling interval)."""
        pid_slots = {**self._proc_slots, **self._tracked_snapshot}
        inode_slot: dict[int, int] = {}
        for pid, slot in pid_slots.items():
            for ino in procfs.socket_inodes(pid):
                inode_slot[ino] = slot
        first_seen = self._proc_stall_seen
        seen_now: dict[int, float] = {}
        out: dict[int, tuple[int, float]] = {}
        if inode_slot:
            for row in procfs.read_tcp_sockets():
                ino, state, retrans = row[6], row[4], row[5]
                owner = inode_slot.get(ino)
                if owner is None or not (state == 2 or retrans > 0):
                    continue
                t = first_seen.get(ino, now)
                seen_now[ino] = t
                n, oldest = out.get(owner, (0, now))
                out[owner] = (n + 1, min(oldest, t))
        self._proc_stall_seen = seen_now
        return out

    def _scan_processes(self) -> None:
        """Degraded mode: report processes that appeared since the last scan. A process
        is read when first seen (it may be short-lived) but reported one scan later, so
        that a track() made right after spawning it is already in place; its slot comes
        from the nearest tracked ancestor."""
        pids = procfs.list_pids()
        if self._proc_known is None:
            self._proc_known = pids
            self._proc_pending: list[tuple] = []
            self._proc_parent: dict[int, int] = {}
            self._proc_cmd: dict[int, tuple] = {}
            return
        new = sorted(pids - self._proc_known)
        self._proc_known = pids
        tracked = self._tracked_snapshot
        ready, self._proc_pending = self._proc_pending, []
        offset = time.time() - time.monotonic()
        for pid in new:
            st = procfs.proc_status(pid)
            argv = procfs.proc_cmdline(pid)
            if st is None or argv is None:  # gone already, or a kernel thread
                continue
            try:
                filename = os.readlink(f"/proc/{pid}/exe")
            except OSError:
                filename = argv[0] if argv else ""
            ppid = int(st.get("PPid", "0").strip() or 0)
            self._proc_parent[pid] = ppid
            self._proc_pending.append((pid, ppid, int(st.get("Uid", "0").split()[0]), int(st.get("Gid", "0").split()[0]),
                                       filename, argv, offset + time.monotonic()))
        # execs in place (same pid) by tracked processes: compare exe and cmdline
        for pid in list(self._proc_slots):
            prev = self._proc_cmd.get(pid)
            argv = procfs.proc_cmdline(pid)
            try:
                filename = os.readlink(f"/proc/{pid}/exe")
            except OSError:
                continue
            if prev is not None and argv is not None and (filename, argv) != prev:
                st = procfs.proc_status(pid) or {}
                ready.append((pid, self._proc_parent.get(pid, 0), int(st.get("Uid", "0").split()[0]),
                              int(st.get("Gid", "0").split()[0]), filename, argv, offset + time.monotonic()))
        for pid, ppid, uid, gid, filename, argv, ts in ready:
            slot, cur = None, pid
            for _ in range(64):  # nearest tracked ancestor
                slot = tracked.get(cur) or self._proc_slots.get(cur)
                if slot or cur not in self._proc_parent:
                    break
                cur = self._proc_parent[cur]
            if slot:
                self._proc_slots[pid] = slot
                self._proc_cmd[pid] = (filename, argv)
            elif not self.node_activity:
                continue
            ev = ExecEvent(pid=pid, ppid=ppid, uid=uid, gid=gid, filename=filename, argv=argv, slot=slot or None,
                           ts=ts, argv_source="proc", source="proc")
            EVENTS.labels("exec" if slot else "node_exec").inc()
            self._post(self._deliver, self.on_exec, ev)
        self._proc_slots = {p: s for p, s in self._proc_slots.items() if p in pids}
        self._proc_parent = {p: pp for p, pp in self._proc_parent.items() if p in pids}
        self._proc_cmd = {p: c for p, c in self._proc_cmd.items() if p in pids}

    # perf callbacks (poll thread)
    def _on_raw(self, cpu: int, data: bytes) -> None:
        if len(data) < 4:
            return
        kind = int.from_bytes(data[:4], sys.byteorder)
        offset = time.time() - time.monotonic()
        if kind == abi.EV_EXEC:
            ev = decode_exec(data, offset)
            if ev.slot is None and not self.node_activity:
                return
            slot = ev.slot
            gen = self._slot_gens.get(slot) if slot is not None else None
            if gen is not None and slot is not None:
                seen = self._exec_seen.get(slot)
                if seen is None or seen[0] != gen:
                    seen = self._exec_seen[slot] = [gen, 0, 0, 0]
                seen[1] += 1
            EVENTS.labels("exec" if ev.slot is not None else "node_exec").inc()
            self._post(self._deliver, self.on_exec, ev)
        elif kind == abi.EV_CONN:
            cev = decode_conn(data, offset)
            EVENTS.labels(cev.kind).inc()
            self._post(self._deliver, self.on_conn, cev)

    def _on_lost(self, cpu: int, n: int) -> None:
        self._lost_total += n
        LOST_EVENTS.inc(n)
        log.warning("sensor events lost", extra={"fields": {"lost": n, "cpu": cpu, "total": self._lost_total}})
        self._post(self._deliver, self.on_gap, Gap(lost=n, cpu=cpu, ts=time.time(), total_lost=self._lost_total))

    # ------------------------------------------------------ applied on the loop thread
    @staticmethod
    def _deliver(cb: Optional[Callable[[Any], None]], ev: Any) -> None:
        if cb is not None:
            cb(ev)

    def _apply_kernel_sample(self, now: float, slots: dict, stalls: dict, eps: dict) -> None:
        changed_slots, changed_eps = set(), set()
        for slot, (gen, counts) in slots.items():
            if self._slot_gens.get(slot) != gen:
                continue  # sampled before an untrack/re-track of this slot
            stall = stalls.get(slot, (0, 0))
            if counts != self._slot_latest.get(slot) or stall != self._slot_stall.get(slot):
                changed_slots.add(slot)
            if counts != self._slot_latest.get(slot):
                self._slot_hist[slot].append((now, counts[0], counts[4]))
                _trim(self._slot_hist[slot], now, self.window_s)
            self._slot_latest[slot] = counts
            self._slot_stall[slot] = stall
        for epid, counts in eps.items():
            if epid not in self._ep_latest:
                continue
            if counts != self._ep_latest[epid]:
                changed_eps.add(epid)
                self._ep_hist[epid].append((now, counts[0], counts[2]))
                _trim(self._ep_hist[epid], now, self.window_s)
                self._ep_latest[epid] = counts
        if (changed_slots or changed_eps) and self.on_signals is not None:
            names = {v: k for k, v in self._eps.items()}
            self.on_signals(changed_slots, {names[e] for e in changed_eps if e in names})

    def _apply_node_sample(self, now: float, counters: dict, stalled: dict,
                           slot_stalls: Optional[dict] = None) -> None:
        retrans = counters.get("RetransSegs", 0)
        rate = 0.0
        if self._node_prev is not None and now > self._node_prev[0]:
            rate = max(0, retrans - self._node_prev[1]) / (now - self._node_prev[0])
        self._node_prev = (now, retrans)
        self._node = NodeSignals(retrans_segs=retrans, retrans_per_s=rate, syn_retrans=counters.get("TCPSynRetrans", 0),
                                 active_opens=counters.get("ActiveOpens", 0),
                                 attempt_fails=counters.get("AttemptFails", 0),
                                 estab_resets=counters.get("EstabResets", 0), out_rsts=counters.get("OutRsts", 0),
                                 ts=time.time())
        if slot_stalls is not None:
            changed_slots = set()
            for slot in self._slot_gens:
                val = slot_stalls.get(slot, (0, 0.0))
                if self._proc_stall.get(slot) != val:
                    self._proc_stall[slot] = val
                    changed_slots.add(slot)
            if changed_slots and self.on_signals is not None:
                self.on_signals(changed_slots, set())
        changed = set()
        for epid, n in stalled.items():
            if epid in self._ep_addrs and self._ep_stalled.get(epid) != n:
                self._ep_stalled[epid] = n
                changed.add(epid)
        if changed and self.on_signals is not None:
            names = {v: k for k, v in self._eps.items()}
            self.on_signals(set(), {names[e] for e in changed if e in names})


# ----------------------------------------------------------------------- helpers


def _ep_key(family: int, raw: bytes, port: int) -> abi.EpKey:
    k = abi.EpKey()
    ct.memmove(k.addr, raw, len(raw))
    k.port = port
    k.family = family
    return k


def _trim(hist: collections.deque, now: float, window: float) -> None:
    """Keep the samples inside the window plus the newest one before it (the baseline)."""
    cutoff = now - window
    while len(hist) >= 2 and hist[1][0] <= cutoff:
        hist.popleft()


def _window(hist: collections.deque, now: float, window: float, start: float) -> tuple[float, int]:
    """(events per second, second counter's increase) over the window; a young series is
    divided by its age (at least 1 s) so a fresh stall shows without waiting a window."""
    cutoff = now - window
    base = hist[0]
    for h in hist:
        if h[0] <= cutoff:
            base = h
        else:
            break
    last = hist[-1]
    dt = max(1.0, min(window, now - start))
    return (last[1] - base[1]) / dt, last[2] - base[2]


def decode_exec(data: bytes, wall_offset: float) -> ExecEvent:
    """Bytes of a struct exec_event (possibly cut after args_len) -> ExecEvent."""
    raw = abi.ExecEventRaw()
    n = min(len(data), ct.sizeof(raw))
    ct.memmove(ct.addressof(raw), data, n)
    args_off = abi.ExecEventRaw.args.offset
    argbuf = data[args_off:args_off + raw.args_len]
    argv = abi.split_args(argbuf, raw.argc)
    argv_source = "kernel"
    if not argv:
        argv = procfs.proc_cmdline(raw.pid) or []
        argv_source = "proc" if argv else "none"
    ppid = raw.ppid or procfs.proc_ppid(raw.pid)
    return ExecEvent(pid=raw.pid, ppid=ppid, uid=raw.uid, gid=raw.gid,
                     filename=raw.filename.decode("utf-8", "backslashreplace"), argv=argv,
                     slot=raw.slot or None, ts=wall_offset + raw.ts_ns / 1e9, mono_ns=raw.ts_ns, tid=raw.tid,
                     argv_truncated=bool(raw.flags & abi.EXEC_ARGV_TRUNCATED), argv_source=argv_source)


def decode_conn(data: bytes, wall_offset: float) -> ConnEvent:
    raw = abi.ConnEventRaw()
    ct.memmove(ct.addressof(raw), data, min(len(data), ct.sizeof(raw)))
    if raw.newstate == abi.TCP_SYN_SENT:
        kind = "connect"
    elif raw.oldstate == abi.TCP_SYN_SENT and raw.newstate == abi.TCP_ESTABLISHED:
        kind = "established"
    elif raw.oldstate == abi.TCP_SYN_SENT and raw.newstate == abi.TCP_CLOSE:
        kind = "connect_failed"
    else:
        kind = "close"
    return ConnEvent(kind=kind, slot=raw.slot, pid=raw.pid, saddr=abi.addr_text(raw.family, bytes(raw.saddr)),
                     sport=raw.sport, daddr=abi.addr_text(raw.family, bytes(raw.daddr)), dport=raw.dport,
                     duration_s=raw.duration_ns / 1e9, retransmits=raw.retrans, ts=wall_offset + raw.ts_ns / 1e9,
                     mono_ns=raw.ts_ns)
