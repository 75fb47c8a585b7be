"""The cgroup v1 quota backend: memory, cpu, pids (and cpuacct for usage) hierarchies."""

from __future__ import annotations

import errno
import logging
import os
from typing import Any, Iterable, Optional

from agent.execute.backends.cgroup import CPU_PERIOD_US, DEFAULT_ROOT, NEEDED, CgroupBackend
from agent.execute.backends.cgroupfs import CgroupFS, mountinfo
from agent.execute.backends.interface import BackendUnavailable, Slot, Usage
from agent.execute.limits import Limits
from agent.execute.processes import alive

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
        slot = Slot(name, Limits())
        try:
            for h in self.hierarchies():
                d = self.run_dir(h, name)
                self.fs.mkdir(d)
                slot.paths[h] = d
            self._need(slot, "memory")
            self._need(slot, "cpu")
            self.reuse(slot, limits)
            # opened now (on the staging thread), kept while the slot lives: the launcher
            # inherits them and joins by itself (launch.py)
            for h in slot.paths:
                slot.join_fds[h] = self.fs.open_joiner(os.path.join(slot.paths[h], "tasks"))
        except OSError:
            self.remove(slot)
            raise
        return slot

    def reuse(self, slot: Slot, limits: Limits) -> None:
        old = slot.limits
        if limits.memory_bytes != old.memory_bytes:
            mem = self._need(slot, "memory")
            new = str(limits.memory_bytes or -1)
            if self._memsw is None:   # swap accounting is a boot option: look once
                self._memsw = self.fs.exists(os.path.join(mem, "memory.memsw.limit_in_bytes"))
            # memsw (memory + swap) is never below memory: raised first, lowered last
            order = ["memory.limit_in_bytes"]
            if self._memsw:   # no swap beyond the limit
                growing = old.memory_bytes is not None and (limits.memory_bytes is None
                                                            or limits.memory_bytes > old.memory_bytes)
                order = ["memory.memsw.limit_in_bytes"] + order if growing else order + ["memory.memsw.limit_in_bytes"]
            for f in order:
                try:
                    self.fs.write(os.path.join(mem, f), new)
                except OSError:
                    if f == "memory.limit_in_bytes":
                        raise
        if limits.cpu != old.cpu:
            cpu = self._need(slot, "cpu")
            if CPU_PERIOD_US != KERNEL_CFS_PERIOD_US and not old.cpu:   # a new v1 cpu cgroup starts with the kernel's
                self.fs.write(os.path.join(cpu, "cpu.cfs_period_us"), str(CPU_PERIOD_US))
            self.fs.write(os.path.join(cpu, "cpu.cfs_quota_us"),
                          str(max(1000, int(limits.cpu * CPU_PERIOD_US)) if limits.cpu else -1))
        if limits.pids != old.pids:
            self.fs.write(os.path.join(self._need(slot, "pids"), "pids.max"), str(int(limits.pids)) if limits.pids else "max")
        slot.limits = limits

    def recycle(self, slot: Slot) -> bool:
        mem = self._path(slot, "memory")
        try:   # the peak starts again from what the cgroup holds now (page cache the last run left)
            if mem:
                self.fs.write(os.path.join(mem, "memory.max_usage_in_bytes"), "0")
        except OSError:
            return False
        return True

    def members(self, slot: Slot) -> list[int]:
        # every process of a run is in each of its cgroups (its launcher joined them all, or
        # was attached to all, before anything forked), so one hierarchy lists them all
        d = self._path(slot, "pids") or next(iter(slot.paths.values()), None)
        if d is None:
            return []
        try:
            # (not read_kept: v1 caches a pid list per open file for a second)
            text = self.fs.read(os.path.join(d, "cgroup.procs"))
        except OSError:
            return []
        return [p for p in (int(x) for x in text.split() if x.isdigit()) if alive(p)]

    def check_all(self, slots: Iterable[Slot]) -> dict[str, str]:
        out = {}
        for s in slots:
            mem = self._path(s, "memory")
            if mem and self.kept_kv(s, os.path.join(mem, "memory.oom_control")).get("oom_kill", 0) > s.base.get("oom_kill", 0):
                out[s.name] = "oom"
                continue
            pids = self._path(s, "pids")
            if pids and self.kept_kv(s, os.path.join(pids, "pids.events")).get("max", 0) > s.base.get("pids_max", 0):
                out[s.name] = "pids_limit"
        return out

    def usage(self, slot: Slot, rusage: Any = None, final: bool = False) -> Usage:
        u = super().usage(slot, rusage)
        raw: dict[str, int] = {}
        acct = self._path(slot, "cpuacct")
        if acct and self._cpuacct_usage is None:   # looked up once
            self._cpuacct_usage = self.fs.exists(os.path.join(acct, "cpuacct.usage"))
        if acct and self._cpuacct_usage:
            raw["cpu_ns"] = self.kept_int(slot, os.path.join(acct, "cpuacct.usage"))
        mem = self._path(slot, "memory")
        if mem:
            u.max_rss_bytes = max(u.max_rss_bytes, self.kept_int(slot, os.path.join(mem, "memory.max_usage_in_bytes")))
            raw["oom_kill"] = self.kept_kv(slot, os.path.join(mem, "memory.oom_control")).get("oom_kill", 0)
        cpu = self._path(slot, "cpu")
        if cpu:
            raw["throttled_ns"] = self.kept_kv(slot, os.path.join(cpu, "cpu.stat")).get("throttled_time", 0)
        pids = self._path(slot, "pids")
        if pids:
            raw["pids_max"] = self.kept_kv(slot, os.path.join(pids, "pids.events")).get("max", 0)
        d = {k: max(0, v - slot.base.get(k, 0)) for k, v in raw.items()}
        if "cpu_ns" in d:
            u.cpu_s = d["cpu_ns"] / 1e9
        u.oom_kills = d.get("oom_kill", 0)
        u.throttled_s = d.get("throttled_ns", 0) / 1e9
        u.pids_max_events = d.get("pids_max", 0)
        if final:
            slot.base = raw
        return u
