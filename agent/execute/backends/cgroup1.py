"""The cgroup v1 quota backend: memory, cpu, pids (and cpuacct for usage) hierarchies."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from typing import Any, Iterable, Optional

from agent.execute.backends.cgroup import CPU_PERIOD_US, DEFAULT_ROOT, NEEDED, CgroupBackend
from agent.execute.backends.cgroupfs import CgroupFS, mountinfo, self_cgroups
from agent.execute.backends.interface import BackendUnavailable, Slot, Usage
from agent.execute.limits import Limits

log = logging.getLogger(__name__)

KERNEL_CFS_PERIOD_US = 100_000   # what a new cgroup v1 cpu.cfs_period_us holds (not inherited)


class Cgroup1Backend(CgroupBackend):
    """memory, cpu, pids (and cpuacct for usage) v1 hierarchies: <mount>/<root_name>/<run>
    directories in memory and pids, and top-level <mount>/<root_name>@<run> directories in
    cpu and cpuacct.

    Why the cpu cgroups are not under the root: the kernel gives a cgroup the weight of
    one ordinary process (cpu.shares 1024) and divides it among its members, and the
    root's scheduling entity lives on, carrying the CPU time all runs took. Under one
    root, N busy runs together would weigh one process, and a run waking at its due time
    would queue behind the agent, etcd and the rest of the host. A top-level cgroup per
    run weighs exactly what a process started by hand weighs and starts with no history,
    like a new process; the quota (cpu.cfs_quota_us) still caps it (docs/execution.md:
    a run weighs one ordinary process)."""

    name = "cgroup1"
    FLAT = ("cpu", "cpuacct")    # hierarchies whose run cgroups are top-level <root_name>@<run>

    def __init__(self, mounts: Optional[dict[str, str]] = None, root_name: str = DEFAULT_ROOT,
                 fs: Optional[CgroupFS] = None):
        super().__init__(root_name, fs)
        if mounts is None:
            mounts = {}
            for mnt, fstype, opts, _root in mountinfo():
                if fstype == "cgroup":
                    for c in ("memory", "cpu", "pids", "cpuacct"):
                        if c in opts:
                            mounts.setdefault(c, mnt)
        self.mounts = mounts
        self.flat: dict[str, str] = {}      # hierarchy -> mount, for the FLAT ones
        self._thread_homes: dict[int, dict[str, str]] = {}
        self._home_fds: dict[tuple[int, str], int] = {}   # (thread, hierarchy) -> its home's `tasks`, for leave()
        self._home_lock = threading.Lock()
        self._memsw: Optional[bool] = None   # memory.memsw.* present (swap accounting on)
        self._cpuacct_usage: Optional[bool] = None

    def check_available(self) -> None:
        missing = [c for c in NEEDED if c not in self.mounts]
        if missing:
            raise BackendUnavailable(f"no cgroup v1 hierarchy for {', '.join(missing)}")
        for c in NEEDED:
            if not self.fs.writable(self.mounts[c]):
                raise BackendUnavailable(f"cgroup v1 {c} hierarchy {self.mounts[c]} is not writable (run as root)")

    def _hierarchies(self) -> dict[str, str]:
        # controller -> mount, de-duplicated by mount (cpu,cpuacct are often co-mounted)
        out: dict[str, str] = {}
        for c in ("memory", "cpu", "pids", "cpuacct"):
            if c in self.mounts and self.mounts[c] not in out.values():
                out[c] = self.mounts[c]
        return out

    def setup(self) -> None:
        self.check_available()
        for c, mnt in self._hierarchies().items():
            if c in self.FLAT:
                self.flat[c] = mnt
                continue
            root = os.path.join(mnt, self.root_name)
            self.fs.mkdir(root)
            self.roots[c] = root
        self.why = self.location()

    def location(self) -> str:
        return (f"cgroup v1 hierarchies {', '.join(sorted(set(self.mounts[c] for c in NEEDED)))}"
                f", runs under /{self.root_name}/ (cpu: /{self.root_name}@<run>)")

    def hierarchies(self) -> list[str]:
        return list(self.roots) + list(self.flat)

    def run_dir(self, hierarchy: str, name: str) -> str:
        if hierarchy in self.flat:
            return os.path.join(self.flat[hierarchy], f"{self.root_name}@{name}")
        return super().run_dir(hierarchy, name)

    def stale_names(self) -> set[str]:
        names = super().stale_names()
        prefix = f"{self.root_name}@"
        for mnt in self.flat.values():
            try:
                names.update(n[len(prefix):] for n in self.fs.listdir(mnt)
                             if n.startswith(prefix) and self.fs.isdir(os.path.join(mnt, n)))
            except OSError:
                pass
        return names

    def _path(self, slot: Slot, ctrl: str) -> Optional[str]:
        mnt = self.mounts.get(ctrl)
        for h, d in slot.paths.items():
            if self.mounts.get(h) == mnt:
                return d
        return None

    def _need(self, slot: Slot, ctrl: str) -> str:
        d = self._path(slot, ctrl)
        if d is None:
            raise OSError(errno.ENOENT, f"no {ctrl} hierarchy for run cgroup {slot.name}")
        return d

    def create(self, name: str, limits: Limits) -> Slot:
        slot = Slot(name, limits)
        try:
            for h in self.hierarchies():
                d = self.run_dir(h, name)
                self.fs.mkdir(d)
                slot.paths[h] = d
            mem = self._need(slot, "memory")
            if limits.memory_bytes:
                self.fs.write(os.path.join(mem, "memory.limit_in_bytes"), str(limits.memory_bytes))
                if self._memsw is None:   # swap accounting is a boot option: look once
                    self._memsw = self.fs.exists(os.path.join(mem, "memory.memsw.limit_in_bytes"))
                if self._memsw:   # no swap beyond the limit
                    try:
                        self.fs.write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(limits.memory_bytes))
                    except OSError:
                        pass
            cpu = self._need(slot, "cpu")
            if limits.cpu:
                if CPU_PERIOD_US != KERNEL_CFS_PERIOD_US:   # a new v1 cpu cgroup starts with the kernel's
                    self.fs.write(os.path.join(cpu, "cpu.cfs_period_us"), str(CPU_PERIOD_US))
                self.fs.write(os.path.join(cpu, "cpu.cfs_quota_us"), str(max(1000, int(limits.cpu * CPU_PERIOD_US))))
            if limits.pids:
                self.fs.write(os.path.join(self._need(slot, "pids"), "pids.max"), str(int(limits.pids)))
            # opened here (a staged run: on the claim's worker), so that enter() on the
            # spawning thread only writes; enter() opens by path what is missing
            for h in self.joinable(slot):
                try:
                    slot.join_fds[h] = self.fs.open_writer(os.path.join(slot.paths[h], "tasks"))
                except OSError:
                    break
        except OSError:
            self.remove(slot)
            raise
        return slot

    HOME_FDS_MAX = 256   # home `tasks` files kept open (per spawning thread and hierarchy)

    # The launcher is born in its cgroups: the spawning thread moves *itself* into them
    # (writing 0 to a v1 `tasks` file), forks, and moves back. A thread moving itself does
    # not take the kernel's global cgroup_threadgroup_rwsem for writing, which writing the
    # child's pid to cgroup.procs does, once per hierarchy: that write stalls every fork and
    # exit on the host (and waits for an RCU grace period). Each hierarchy is joined only
    # where the thread cannot trip the run's limit while inside (about a millisecond):
    # memory at least JOIN_MIN_MEMORY (else a memcg OOM could pick the agent), pids at
    # least JOIN_MIN_PIDS (the thread counts while inside), cpu at least JOIN_MIN_CPU (its
    # quota must not throttle the thread); cpuacct together with cpu, whose move flushes
    # the scheduler's accounting, so that the thread's own cpu time inside is known and
    # subtracted (Slot.cpu_offset_s). The others get the child's pid as before.
    JOIN_MIN_MEMORY = 64 << 20
    JOIN_MIN_PIDS = 8
    JOIN_MIN_CPU = 0.5

    def joinable(self, slot: Slot) -> list[str]:
        """The hierarchies the spawning thread joins for this slot (enter), in order."""
        lim = slot.limits
        ok = {"memory": lim.memory_bytes is None or lim.memory_bytes >= self.JOIN_MIN_MEMORY,
              "pids": lim.pids is None or lim.pids >= self.JOIN_MIN_PIDS,
              "cpu": lim.cpu is None or lim.cpu >= self.JOIN_MIN_CPU}
        ok["cpuacct"] = ok["cpu"] and "cpu" in slot.paths
        # cpu right before cpuacct: the cpu move accounts the thread's time so far where it was
        order = [h for h in ("memory", "pids") if h in slot.paths] + [h for h in ("cpu", "cpuacct") if h in slot.paths]
        return [h for h in order if ok.get(h, False)]

    def _homes(self) -> dict[str, str]:
        """hierarchy -> cgroup dir of the calling thread."""
        tid = threading.get_native_id()
        home = self._thread_homes.get(tid)
        if home is None:
            mine = self_cgroups(f"/proc/self/task/{tid}/cgroup")
            home = {h: os.path.join(self.mounts[h], mine.get(h, "/").lstrip("/")) for h in self.hierarchies()}
            if len(self._thread_homes) > 64:
                self._thread_homes.clear()
            self._thread_homes[tid] = home
        return home

    def enter(self, slot: Slot) -> Any:
        hs = self.joinable(slot)
        if not hs:
            return None
        home = self._homes()
        joined: list[str] = []
        t_in = None
        try:
            for h in hs:
                if h in ("cpu", "cpuacct") and t_in is None:
                    t_in = time.thread_time()
                fd = slot.join_fds.pop(h, None)
                if fd is None:
                    self.fs.write(os.path.join(slot.paths[h], "tasks"), "0")
                else:
                    try:
                        self.fs.write_fd(fd, "0")
                    finally:
                        self.fs.close_fd(fd)
                joined.append(h)
        except OSError:
            self.leave(slot, (joined, home, t_in))
            raise
        return joined, home, t_in

    def leave(self, slot: Slot, token: Any) -> None:
        if token is None:
            return
        joined, home, t_in = token
        err: Optional[OSError] = None
        t_out = None
        # cpu first (its move accounts the thread's time inside to the run), cpuacct next
        for h in sorted(joined, key=lambda h: {"cpu": 0, "cpuacct": 1}.get(h, 2)):
            if t_out is None and h not in ("cpu", "cpuacct"):
                t_out = time.thread_time()
            try:
                self._go_home(h, home[h])
            except OSError as exc:
                try:   # our own cgroup went away: the hierarchy's root, never a run's cgroup
                    self.fs.write(os.path.join(self.mounts[h], "tasks"), "0")
                except OSError:
                    err = exc
        if t_in is not None:
            slot.cpu_offset_s += (t_out if t_out is not None else time.thread_time()) - t_in
        slot.joined.update(joined)
        if err is not None:
            log.error("a thread of the agent could not leave a run's cgroup", extra={"fields": {
                "run": slot.name, "error": err.strerror}})
            raise err

    def _go_home(self, h: str, home: str) -> None:
        """The calling thread back to its own cgroup of hierarchy h, through an fd kept
        open per thread (one write(2) instead of open, write and close at every spawn)."""
        key = (threading.get_native_id(), h)
        with self._home_lock:   # (spawning threads are few: the loop, and tests' own)
            fd = self._home_fds.get(key)
            if fd is None:
                if len(self._home_fds) >= self.HOME_FDS_MAX:   # threads come and go: the cache stays small
                    for old in self._home_fds.values():
                        self.fs.close_fd(old)
                    self._home_fds.clear()
                fd = self._home_fds[key] = self.fs.open_writer(os.path.join(home, "tasks"))
            try:
                self.fs.write_fd(fd, "0")
            except OSError:
                self._home_fds.pop(key, None)   # the home went away: the caller goes to the root
                self.fs.close_fd(fd)
                raise

    def close(self) -> None:
        with self._home_lock:
            for fd in self._home_fds.values():
                self.fs.close_fd(fd)
            self._home_fds.clear()
        super().close()

    def home_fds_open(self) -> int:
        """How many home `tasks` files are kept open (at most HOME_FDS_MAX)."""
        with self._home_lock:
            return len(self._home_fds)

    def check_all(self, slots: Iterable[Slot]) -> dict[str, str]:
        out = {}
        for s in slots:
            mem = self._path(s, "memory")
            if mem and self.read_kv(os.path.join(mem, "memory.oom_control")).get("oom_kill", 0) > 0:
                out[s.name] = "oom"
                continue
            pids = self._path(s, "pids")
            if pids and self.read_kv(os.path.join(pids, "pids.events")).get("max", 0) > 0:
                out[s.name] = "pids_limit"
        return out

    def usage(self, slot: Slot, rusage: Any = None) -> Usage:
        u = super().usage(slot, rusage)
        acct = self._path(slot, "cpuacct")
        if acct and not self._cpuacct_usage:   # remembered once seen (a run's end reads usage)
            self._cpuacct_usage = self.fs.exists(os.path.join(acct, "cpuacct.usage"))
        if acct and self._cpuacct_usage:
            u.cpu_s = max(0.0, self.read_int(os.path.join(acct, "cpuacct.usage")) / 1e9 - slot.cpu_offset_s)
        mem = self._path(slot, "memory")
        if mem:
            u.max_rss_bytes = max(u.max_rss_bytes, self.read_int(os.path.join(mem, "memory.max_usage_in_bytes")))
            u.oom_kills = self.read_kv(os.path.join(mem, "memory.oom_control")).get("oom_kill", 0)
        cpu = self._path(slot, "cpu")
        if cpu:
            u.throttled_s = self.read_kv(os.path.join(cpu, "cpu.stat")).get("throttled_time", 0) / 1e9
        pids = self._path(slot, "pids")
        if pids:
            u.pids_max_events = self.read_kv(os.path.join(pids, "pids.events")).get("max", 0)
        return u

