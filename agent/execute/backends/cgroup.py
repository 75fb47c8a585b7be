"""What the cgroup backends (v1 and v2) share: run cgroups under one root per agent,
membership through cgroup.procs, removal, and reclaiming a dead agent's runs."""

from __future__ import annotations

import logging
import os
import re
import resource
import signal
import threading
import time
from typing import Optional

from agent.execute.backends.cgroupfs import READ_SIZE, CgroupFS, parse_kv
from agent.execute.backends.interface import QuotaBackend, Slot
from agent.execute.limits import Limits
from agent.execute.processes import alive

log = logging.getLogger(__name__)

NEEDED = ("memory", "cpu", "pids")   # the controllers a cgroup backend needs
CPU_PERIOD_US = 100_000               # the cpu quota's period
DEFAULT_ROOT = "millwright"
KEPT_FDS_SHARE = 4    # at most 1/this of the soft RLIMIT_NOFILE goes to slots' kept read fds


def _kept_fds_budget() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 4096 if soft == resource.RLIM_INFINITY else max(0, soft // KEPT_FDS_SHARE)


class CgroupBackend(QuotaBackend):
    """Runs' cgroups under one root per agent (<root>/<slot>), except where a backend puts
    a hierarchy's run cgroups elsewhere (run_dir; cgroup v1's cpu: see Cgroup1Backend)."""

    enforces_cpu_rate = True
    poolable = True
    contains_runs = True

    def __init__(self, root_name: str = DEFAULT_ROOT, fs: Optional[CgroupFS] = None):
        if not re.match(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$", root_name or ""):
            raise ValueError(f"bad cgroup root name {root_name!r} (want [A-Za-z0-9._-], not starting with '.')")
        self.root_name = root_name.strip("/")
        self.fs = fs or CgroupFS()
        self.roots: dict[str, str] = {}     # hierarchy -> root cgroup dir
        # fds of slots' counter files kept open for reading (read_kept): at most this many
        # at once, so that many live slots never starve the runs' own pipes of fds
        self._kept_left = _kept_fds_budget()
        self._kept_lock = threading.Lock()

    def hierarchies(self) -> list[str]:
        """Every hierarchy a run has a cgroup in (after setup)."""
        return list(self.roots)

    def run_dir(self, hierarchy: str, name: str) -> str:
        return os.path.join(self.roots[hierarchy], name)

    def stale_names(self) -> set[str]:
        """Names of the run cgroups found under the roots (a dead agent's: reclaim)."""
        names: set[str] = set()
        for root in self.roots.values():
            try:
                names.update(n for n in self.fs.listdir(root) if self.fs.isdir(os.path.join(root, n)))
            except OSError:
                pass
        return names

    def check_available(self) -> None:
        """Raise BackendUnavailable with the reason when this host cannot use the backend."""
        raise NotImplementedError

    def location(self) -> str:
        """Where the runs' cgroups live (for `why`)."""
        raise NotImplementedError

    def read_int(self, path: str, default: int = 0) -> int:
        try:
            return int(self.fs.read(path).split()[0])
        except (OSError, ValueError, IndexError):
            return default

    def read_kv(self, path: str) -> dict[str, int]:
        try:
            return parse_kv(self.fs.read(path))
        except OSError:
            return {}

    def read_kept(self, slot: Slot, path: str) -> str:
        """A slot's file, read through an fd kept open while the slot lives: a pread from
        offset 0 makes the kernel generate a cgroup file anew, so a read is one system call,
        not three (a run's end reads five of them on the reaper). Plain reads once the fd
        budget is spent. OSError as from a read."""
        fd = slot.keep_fds.get(path)
        if fd is None:
            with self._kept_lock:
                if self._kept_left <= 0:
                    return self.fs.read(path)
                self._kept_left -= 1
            try:
                fd = self.fs.open_reader(path)
            except OSError:
                with self._kept_lock:
                    self._kept_left += 1
                raise
            slot.keep_fds[path] = fd
        return self.fs.pread(fd, READ_SIZE)

    def kept_int(self, slot: Slot, path: str, default: int = 0) -> int:
        try:
            return int(self.read_kept(slot, path).split()[0])
        except (OSError, ValueError, IndexError):
            return default

    def kept_kv(self, slot: Slot, path: str) -> dict[str, int]:
        try:
            return parse_kv(self.read_kept(slot, path))
        except OSError:
            return {}

    def attach(self, slot: Slot, pid: int) -> None:
        slot.pid = slot.pgid = pid
        for h, d in slot.paths.items():
            if h not in slot.joined:   # the launcher joins the others by itself
                self.fs.write(os.path.join(d, "cgroup.procs"), str(pid))

    def members(self, slot: Slot) -> list[int]:
        pids: set[int] = set()
        for d in slot.paths.values():
            try:
                text = self.fs.read(os.path.join(d, "cgroup.procs"))
            except OSError:
                continue
            pids.update(int(x) for x in text.split() if x.isdigit())
        return [p for p in pids if alive(p)]

    def kill_all(self, slot: Slot) -> None:
        super().kill_all(slot)
        for _ in range(20):
            pids = self.members(slot)
            if not pids:
                return
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def remove(self, slot: Slot) -> bool:
        kept = [fd for key, fd in slot.keep_fds.items() if key.startswith("/")]   # read_kept's
        for fd in list(slot.join_fds.values()) + list(slot.keep_fds.values()):
            self.fs.close_fd(fd)
        slot.join_fds.clear()
        slot.keep_fds.clear()
        if kept:
            with self._kept_lock:
                self._kept_left += len(kept)
        ok = True
        for d in list(slot.paths.values()):
            try:
                self.fs.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError as exc:
                ok = False
                log.debug("cgroup rmdir failed", extra={"fields": {"path": d, "error": exc.strerror}})
        slot.removed = ok
        return ok

    def stale_slots(self) -> list[Slot]:
        """Run cgroups left under our root (an agent that died): for reclaim()."""
        return [Slot(n, Limits(), {h: self.run_dir(h, n) for h in self.hierarchies()})
                for n in sorted(self.stale_names())]

    def reclaim(self) -> int:
        """Kill processes in stale run cgroups and remove them; returns how many."""
        n = 0
        for s in self.stale_slots():
            if s.name.endswith(".agent"):
                continue
            self.kill_all(s)
            for _ in range(100):    # the killed tasks leave the cgroup asynchronously
                if self.remove(s):
                    n += 1
                    break
                self.kill_all(s)
                time.sleep(0.02)
        if n:
            log.warning("removed stale run cgroups", extra={"fields": {"count": n, "backend": self.name}})
        return n

    def close(self) -> None:
        for root in self.roots.values():
            try:
                self.fs.rmdir(root)
            except OSError:
                pass

