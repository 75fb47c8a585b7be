"""The cgroup v2 quota backend: a delegated subtree of the agent's own cgroup."""

from __future__ import annotations

import errno
import logging
import os
from typing import Any, Iterable, Optional

from agent.execute.backends.cgroup import CPU_PERIOD_US, DEFAULT_ROOT, NEEDED, CgroupBackend
from agent.execute.backends.cgroupfs import CgroupFS, mountinfo, self_cgroups
from agent.execute.backends.interface import BackendUnavailable, Slot, Usage
from agent.execute.limits import Limits

log = logging.getLogger(__name__)


class Cgroup2Backend(CgroupBackend):
    """A delegated cgroup2 subtree: the agent's own cgroup (systemd Delegate=yes) holds
    a leaf with the agent itself, and <root_name>/<run> cgroups with memory.max,
    memory.oom.group=1, cpu.max and pids.max.

    Delegation keeps every run under the agent's own cgroup, so the runs share one
    weight there, against the agent's leaf: <root_name> gets cpu.weight = 100 (one
    ordinary process) x runs_weight (execute.max_concurrent), so that with every run busy
    each weighs what the agent does. That only orders the service's own CPU between its
    jobs and the agent's preparation work; what the service weighs against the rest of
    the host is the operator's (CPUWeight=), and quotas (cpu.max) still cap each run. An
    agent in "/" (no service cgroup) leaves the weight alone: there the root would weigh
    against the whole host.

    Moving the agent into the leaf first is what makes enabling controllers in its
    cgroup possible ("no internal processes": EBUSY otherwise). The root cgroup is exempt
    from that rule, so an agent in "/" creates <root_name> directly.
    """

    name = "cgroup2"

    WEIGHT_PER_PROCESS = 100         # cpu.weight of an ordinary process's cgroup
    WEIGHT_MAX = 10000

    def __init__(self, mount: Optional[str] = None, self_path: Optional[str] = None,
                 root_name: str = DEFAULT_ROOT, fs: Optional[CgroupFS] = None, runs_weight: int = 1):
        super().__init__(root_name, fs)
        self.runs_weight = max(1, int(runs_weight))
        if mount is None:
            for mnt, fstype, _opts, _root in mountinfo():
                if fstype == "cgroup2":
                    mount = mnt
                    break
        self.mount = mount
        self.self_path = self_path if self_path is not None else self_cgroups().get("", "/")
        if os.path.basename(self.self_path) == f"{self.root_name}.agent":   # moved there by an earlier setup
            self.self_path = os.path.dirname(self.self_path)
        self.base = os.path.join(mount, self.self_path.lstrip("/")) if mount else None
        self.root: Optional[str] = None

    def _base(self) -> str:
        if not self.mount or self.base is None:
            raise BackendUnavailable("no cgroup2 mount")
        return self.base

    def check_available(self) -> None:
        base = self._base()
        try:
            have = set(self.fs.read(os.path.join(base, "cgroup.controllers")).split())
        except OSError as exc:
            raise BackendUnavailable(f"cannot read {self.base}/cgroup.controllers: {exc.strerror}") from None
        missing = [c for c in NEEDED if c not in have]
        if missing:
            raise BackendUnavailable(
                f"cgroup2 at {self.mount} (cgroup {self.self_path}) lacks controllers {', '.join(missing)}"
                f" (available: {', '.join(sorted(have)) or 'none'}; hybrid host or not delegated)")
        if not self.fs.writable(base):
            raise BackendUnavailable(f"cgroup {self.base} is not writable (not delegated; run as root or Delegate=yes)")

    def _enable(self, cg: str) -> None:
        self.fs.write(os.path.join(cg, "cgroup.subtree_control"), " ".join("+" + c for c in NEEDED))

    def setup(self) -> None:
        self.check_available()
        base = self._base()
        enabled = set(self.fs.read(os.path.join(base, "cgroup.subtree_control")).split())
        if self.self_path.strip("/") and not set(NEEDED) <= enabled:
            leaf = os.path.join(base, f"{self.root_name}.agent")
            self.fs.mkdir(leaf)
            for pid in self.fs.read(os.path.join(base, "cgroup.procs")).split():
                try:
                    self.fs.write(os.path.join(leaf, "cgroup.procs"), pid)
                except ProcessLookupError:
                    pass
                except OSError as exc:
                    if exc.errno != errno.ESRCH:
                        raise
            log.info("moved the agent into a leaf cgroup", extra={"fields": {"leaf": leaf}})
        try:
            if not set(NEEDED) <= enabled:
                self._enable(base)
        except OSError as exc:
            raise BackendUnavailable(f"enabling {', '.join(NEEDED)} in {base} failed: {exc.strerror}") from None
        root = os.path.join(base, self.root_name)
        self.fs.mkdir(root)
        self._enable(root)
        if self.self_path.strip("/"):   # beside the agent's leaf; an agent in "/" boosts nothing
            self.fs.write(os.path.join(root, "cpu.weight"),
                          str(min(self.WEIGHT_MAX, self.WEIGHT_PER_PROCESS * self.runs_weight)))
        self.root = root
        self.roots = {"unified": root}
        self.why = self.location()

    def location(self) -> str:
        return f"delegated cgroup2 subtree {os.path.join(self._base(), self.root_name)}/"

    def create(self, name: str, limits: Limits) -> Slot:
        if self.root is None:
            raise BackendUnavailable("cgroup2 backend used before setup()")
        d = os.path.join(self.root, name)
        slot = Slot(name, Limits(), {"unified": d})
        try:
            self.fs.mkdir(d)
            if self.fs.exists(os.path.join(d, "memory.swap.max")):
                try:   # no swap beyond the limit
                    self.fs.write(os.path.join(d, "memory.swap.max"), "0")
                except OSError:
                    pass
            self.fs.write(os.path.join(d, "memory.oom.group"), "1")
            self.reuse(slot, limits)
        except OSError:
            self.remove(slot)
            raise
        return slot

    def reuse(self, slot: Slot, limits: Limits) -> None:
        d = slot.paths["unified"]
        old = slot.limits
        if limits.memory_bytes != old.memory_bytes:
            self.fs.write(os.path.join(d, "memory.max"), str(limits.memory_bytes) if limits.memory_bytes else "max")
        if limits.cpu != old.cpu:
            quota = str(max(1000, int(limits.cpu * CPU_PERIOD_US))) if limits.cpu else "max"
            self.fs.write(os.path.join(d, "cpu.max"), f"{quota} {CPU_PERIOD_US}")
        if limits.pids != old.pids:
            self.fs.write(os.path.join(d, "pids.max"), str(int(limits.pids)) if limits.pids else "max")
        slot.limits = limits

    def recycle(self, slot: Slot) -> bool:
        # memory.peak is cumulative; only kernels that reset it (6.12+: a write resets it for
        # reads through the same fd) can hand the slot to another run with a true peak
        d = slot.paths["unified"]
        if not self.fs.exists(os.path.join(d, "memory.peak")):
            slot.peak_rss = 0   # the polled memory.current peak is ours to reset
            return True
        fd = slot.keep_fds.get("peak")
        try:
            if fd is None:
                fd = slot.keep_fds["peak"] = self.fs.open_rw(os.path.join(d, "memory.peak"))
            self.fs.write_fd(fd, "reset\n")
        except OSError:
            return False
        slot.peak_rss = 0
        return True

    def check_all(self, slots: Iterable[Slot]) -> dict[str, str]:
        out = {}
        for s in slots:
            d = s.paths["unified"]
            ev = self.read_kv(os.path.join(d, "memory.events"))
            if max(ev.get("oom_kill", 0), ev.get("oom_group_kill", 0)) > s.base.get("oom_kill", 0):
                out[s.name] = "oom"
            elif self.read_kv(os.path.join(d, "pids.events")).get("max", 0) > s.base.get("pids_max", 0):
                out[s.name] = "pids_limit"
            elif not self.fs.exists(os.path.join(d, "memory.peak")):
                s.peak_rss = max(s.peak_rss, self.read_int(os.path.join(d, "memory.current")))
        return out

    def usage(self, slot: Slot, rusage: Any = None, final: bool = False) -> Usage:
        u = super().usage(slot, rusage)
        d = slot.paths["unified"]
        st = self.read_kv(os.path.join(d, "cpu.stat"))
        ev = self.read_kv(os.path.join(d, "memory.events"))
        raw = {"throttled_us": st.get("throttled_usec", 0),
               "oom_kill": max(ev.get("oom_kill", 0), ev.get("oom_group_kill", 0)),
               "pids_max": self.read_kv(os.path.join(d, "pids.events")).get("max", 0)}
        if "usage_usec" in st:
            raw["cpu_us"] = st["usage_usec"]
        fd = slot.keep_fds.get("peak")
        if fd is not None:   # reset for this run (recycle): read through the same fd
            try:
                peak = int(self.fs.pread(fd, 64).split()[0])
            except (OSError, ValueError, IndexError):
                peak = -1
        else:
            peak = self.read_int(os.path.join(d, "memory.peak"), -1)
        u.max_rss_bytes = max(u.max_rss_bytes, peak, slot.peak_rss)
        delta = {k: max(0, v - slot.base.get(k, 0)) for k, v in raw.items()}
        if "cpu_us" in delta:
            u.cpu_s = delta["cpu_us"] / 1e6
        u.throttled_s = delta["throttled_us"] / 1e6
        u.oom_kills = delta["oom_kill"]
        u.pids_max_events = delta["pids_max"]
        if final:
            slot.base = raw
        return u

    def kill_all(self, slot: Slot) -> None:
        kill = os.path.join(slot.paths["unified"], "cgroup.kill")
        if self.fs.exists(kill):
            try:
                self.fs.write(kill, "1")
            except OSError:
                pass
        super().kill_all(slot)
