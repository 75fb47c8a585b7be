"""Quota backends: cgroup v2, cgroup v1 and rlimits, behind one interface.

The executor asks a backend for a *slot* per run (a cgroup, or just bookkeeping for
rlimits), attaches the forked child to it before the child execs, polls it for quota
events while the run lives, reads its usage when it ends and removes it.

Choice (`probe`): the preferred backend if it is usable, else the next one in the order
cgroup2 -> cgroup1 -> rlimit; `.why` says what was chosen and why the better ones were
not. A cgroup backend is usable when its controllers (memory, cpu, pids) are present
and writable here; rlimit always is (and is the weakest: see docs/execution.md).

All cgroup file access goes through :class:`CgroupFS`, so the cgroup v2 code paths can
be exercised on a plain directory tree on machines that have no usable cgroup2
hierarchy (this dev machine is a v1 hybrid whose cgroup2 mount has no controllers).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import resource
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from agent.execute.limits import Limits

log = logging.getLogger(__name__)

NEEDED = ("memory", "cpu", "pids")
CPU_PERIOD_US = 100_000
KERNEL_CFS_PERIOD_US = 100_000   # what a new cgroup v1 cpu.cfs_period_us holds (not inherited)
ORDER = ("cgroup2", "cgroup1", "rlimit")
DEFAULT_ROOT = "millwright"


class BackendUnavailable(Exception):
    """The backend cannot work on this machine; the message says why."""


# --------------------------------------------------------------------------- helpers


class CgroupFS:
    """The few filesystem operations the cgroup backends use (overridable in tests)."""

    def read(self, path: str) -> str:
        # os.read, not open(): a run's end reads a dozen small cgroup files, and the text
        # layer costs several times the syscalls' own time on the reaper's path
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            chunks = []
            while True:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(fd)
        return b"".join(chunks).decode()

    def write(self, path: str, data: str) -> None:
        # one write(2) per call: cgroup files act on each write
        fd = self.open_writer(path)
        try:
            self.write_fd(fd, data)
        finally:
            self.close_fd(fd)

    def open_writer(self, path: str) -> int:
        """An fd of a cgroup file to write again and again (each write(2) acts on its own)."""
        return os.open(path, os.O_WRONLY | os.O_CLOEXEC)

    def write_fd(self, fd: int, data: str) -> None:
        os.write(fd, data.encode())

    def close_fd(self, fd: int) -> None:
        os.close(fd)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def mkdir(self, path: str) -> None:
        try:
            os.mkdir(path)
        except FileExistsError:
            pass

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def writable(self, path: str) -> bool:
        return os.access(path, os.W_OK)


def _proc_state(pid: int) -> Optional[tuple[str, int]]:
    """(state letter, pgid) of a process, None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    rest = data[data.rfind(b")") + 2:].split()
    return rest[0].decode(), int(rest[2])


def alive(pid: int) -> bool:
    st = _proc_state(pid)
    return st is not None and st[0] not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, by scanning /proc."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _proc_state(int(name))
            if st and st[1] == pgid and st[0] not in ("Z", "X"):
                out.append(int(name))
    return out


def _kv(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                out[parts[0]] = int(parts[1])
            except ValueError:
                pass
    return out


def mountinfo(path: str = "/proc/self/mountinfo") -> list[tuple[str, str, set[str], str]]:
    """(mount point, fstype, super options, root) of the cgroup mounts."""
    out: list[tuple[str, str, set[str], str]] = []
    try:
        with open(path) as fh:
            lines = fh.read().splitlines()
    except OSError:
        return out
    for line in lines:
        pre, _, post = line.partition(" - ")
        f = pre.split()
        p = post.split()
        if len(f) < 5 or len(p) < 3 or p[0] not in ("cgroup", "cgroup2"):
            continue
        mnt = f[4].replace("\\040", " ")
        out.append((mnt, p[0], set(p[2].split(",")), f[3]))
    return out


def self_cgroups(path: str = "/proc/self/cgroup") -> dict[str, str]:
    """controller (or '' for cgroup2) -> path of this process."""
    out: dict[str, str] = {}
    try:
        with open(path) as fh:
            for line in fh.read().splitlines():
                _, ctrls, p = line.split(":", 2)
                if ctrls == "":
                    out[""] = p
                for c in ctrls.split(","):
                    if c:
                        out[c] = p
    except OSError:
        pass
    return out


def run_root_name(agent_id: str, state_dir: str) -> str:
    """The agent's cgroup root: one per agent id, so that several agents on one host (tests,
    demo) never reclaim each other's runs; and per state dir unless it is the packaged one,
    so that two test clusters on one host with the same agent ids stay apart too."""
    import hashlib

    name = "millwright-" + re.sub(r"[^A-Za-z0-9._-]", "_", agent_id)[:50]
    state_dir = os.path.abspath(state_dir)
    if state_dir != "/var/lib/millwright":
        name += "-" + hashlib.sha256(state_dir.encode()).hexdigest()[:8]
    return name


def safe_name(key: str) -> str:
    """A cgroup / directory name for a run key: readable prefix + collision-proof hash."""
    import hashlib

    prefix = re.sub(r"[^A-Za-z0-9._-]", "_", key)[:80].lstrip(".") or "run"
    return f"{prefix}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


# --------------------------------------------------------------------------- interface


@dataclass
class Slot:
    """One run's quota container."""

    name: str
    limits: Limits
    paths: dict[str, str] = field(default_factory=dict)   # hierarchy -> cgroup dir
    pid: Optional[int] = None
    pgid: Optional[int] = None
    peak_rss: int = 0
    nprocs: int = 0
    removed: bool = False
    joined: set = field(default_factory=set)   # hierarchies the launcher was born in (QuotaBackend.enter)
    cpu_offset_s: float = 0.0                  # the spawning thread's own cpu time while it was inside
    join_fds: dict = field(default_factory=dict)   # hierarchy -> its `tasks` file, opened by create() for enter()


@dataclass
class Usage:
    cpu_s: float = 0.0
    max_rss_bytes: int = 0
    oom_kills: int = 0
    throttled_s: float = 0.0
    pids_max_events: int = 0

    def to_dict(self) -> dict:
        return {"cpu_s": round(self.cpu_s, 6), "max_rss_bytes": int(self.max_rss_bytes),
                "oom_kills": int(self.oom_kills), "throttled_s": round(self.throttled_s, 6)}


class QuotaBackend:
    name = "none"
    why = ""
    enforces_cpu_rate = False

    def setup(self) -> None:
        """Prepare the backend's root (create cgroups, enable controllers)."""

    def create(self, name: str, limits: Limits) -> Slot:
        return Slot(name, limits)

    def enter(self, slot: Slot) -> Any:
        """Move the calling thread into the slot, so that a process it creates now is born
        there; leave(slot, token) right after the fork/vfork moves it back."""
        return None

    def leave(self, slot: Slot, token: Any) -> None:
        """Undo enter(): the calling thread back where it was."""

    def attach(self, slot: Slot, pid: int) -> None:
        """Put the (not yet exec'ed) child into the slot. Runs in the parent."""
        slot.pid = slot.pgid = pid

    def child_rlimits(self, limits: Limits, timeout_s: Optional[float]) -> list[tuple[int, int]]:
        """(resource, value) pairs the child sets on itself before exec."""
        return []

    def check_all(self, slots: Iterable[Slot]) -> dict[str, str]:
        """slot name -> quota reason ('oom' or 'pids_limit') for runs that hit a limit."""
        return {}

    def usage(self, slot: Slot, rusage: Any = None) -> Usage:
        # ru_maxrss is not used: a forked/vforked child starts with the agent's own
        # resident set, so its high-water mark says more about the agent than the job.
        u = Usage(max_rss_bytes=slot.peak_rss)
        if rusage is not None:
            u.cpu_s = rusage.ru_utime + rusage.ru_stime
        return u

    def members(self, slot: Slot) -> list[int]:
        if not slot.pgid:
            return []
        try:
            os.killpg(slot.pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return group_members(slot.pgid)

    def kill_all(self, slot: Slot) -> None:
        if slot.pgid:
            try:
                os.killpg(slot.pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def remove(self, slot: Slot) -> bool:
        slot.removed = True
        return True

    def close(self) -> None:
        """Remove the backend's root (only when empty)."""

    def describe(self) -> str:
        return f"{self.name} ({self.why})" if self.why else self.name


# --------------------------------------------------------------------------- rlimit


class RlimitBackend(QuotaBackend):
    """Last resort: RLIMIT_AS / RLIMIT_CPU / RLIMIT_NPROC set in the child before exec,
    plus a poll of the process group's RSS and size (psutil) that kills a run over its
    memory or pids limit. Cannot hold a run to a cpu *rate*; RLIMIT_NPROC counts all
    processes of the user, not of the run (see docs/execution.md)."""

    name = "rlimit"
    AS_FACTOR = 2   # virtual address space is always larger than resident memory

    def child_rlimits(self, limits: Limits, timeout_s: Optional[float]) -> list[tuple[int, int]]:
        out = []
        if limits.memory_bytes:
            out.append((resource.RLIMIT_AS, limits.memory_bytes * self.AS_FACTOR))
        if limits.cpu and timeout_s:
            out.append((resource.RLIMIT_CPU, int(math.ceil(limits.cpu * timeout_s)) + 1))
        if limits.pids:
            out.append((resource.RLIMIT_NPROC, int(limits.pids)))
        return out

    def check_all(self, slots: Iterable[Slot]) -> dict[str, str]:
        slots = [s for s in slots if s.pgid]
        if not slots:
            return {}
        import psutil

        by_pgid = {s.pgid: s for s in slots if s.pgid is not None}
        rss: dict[int, int] = {pg: 0 for pg in by_pgid}
        count: dict[int, int] = {pg: 0 for pg in by_pgid}
        for pid in psutil.pids():
            try:
                pg = os.getpgid(pid)
            except OSError:
                continue
            if pg in by_pgid:
                try:
                    p = psutil.Process(pid)
                    rss[pg] += p.memory_info().rss
                    count[pg] += p.num_threads()
                except (psutil.Error, OSError):
                    continue
        out = {}
        for pg, s in by_pgid.items():
            s.peak_rss = max(s.peak_rss, rss[pg])
            s.nprocs = count[pg]
            if s.limits.memory_bytes and rss[pg] > s.limits.memory_bytes:
                out[s.name] = "oom"
            elif s.limits.pids and count[pg] >= s.limits.pids:
                out[s.name] = "pids_limit"
        return out


# --------------------------------------------------------------------------- cgroup common


class _CgroupBackend(QuotaBackend):
    """Runs' cgroups under one root per agent (<root>/<run>), except where a backend puts
    a hierarchy's run cgroups elsewhere (run_dir; cgroup v1's cpu: see Cgroup1Backend)."""

    enforces_cpu_rate = True

    def __init__(self, root_name: str = DEFAULT_ROOT, fs: Optional[CgroupFS] = None):
        if not re.match(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$", root_name or ""):
            raise ValueError(f"bad cgroup root name {root_name!r} (want [A-Za-z0-9._-], not starting with '.')")
        self.root_name = root_name.strip("/")
        self.fs = fs or CgroupFS()
        self.roots: dict[str, str] = {}     # hierarchy -> root cgroup dir

    def hierarchies(self) -> list[str]:
        """Every hierarchy a run has a cgroup in (after setup)."""
        return list(self.roots)

    def run_dir(self, hierarchy: str, name: str) -> str:
        return os.path.join(self.roots[hierarchy], name)

    def _stale_names(self) -> set[str]:
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

    def _read_int(self, path: str, default: int = 0) -> int:
        try:
            return int(self.fs.read(path).split()[0])
        except (OSError, ValueError, IndexError):
            return default

    def _read_kv(self, path: str) -> dict[str, int]:
        try:
            return _kv(self.fs.read(path))
        except OSError:
            return {}

    def attach(self, slot: Slot, pid: int) -> None:
        slot.pid = slot.pgid = pid
        for h, d in slot.paths.items():
            if h not in slot.joined:   # born there already (enter)
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
        for fd in slot.join_fds.values():   # never entered (a staged run that did not start)
            self.fs.close_fd(fd)
        slot.join_fds.clear()
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
                for n in sorted(self._stale_names())]

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


# --------------------------------------------------------------------------- cgroup v1


class Cgroup1Backend(_CgroupBackend):
    """memory, cpu, pids (and cpuacct for usage) v1 hierarchies: <mount>/<root_name>/<run>
    directories in memory and pids, and top-level <mount>/<root_name>@<run> directories in
    cpu and cpuacct.

    Why the cpu cgroups are not under the root: the kernel gives a cgroup the weight of
    one ordinary process (cpu.shares 1024) and divides it among its members, and the
    root's scheduling entity lives on, carrying the CPU time all runs took. With every run
    under one root, N busy runs together weighed one process, and a run waking at its due
    time queued behind the agent, etcd and the rest of the host (issue 18: in the trigger
    bench its processes spent 1.6 ms runnable but not running at p95-p99, APScheduler's
    unconfined ones 0.6 ms). A top-level cgroup per run weighs exactly what a process
    started by hand weighs and starts with no history, like a new process; the quota
    (cpu.cfs_quota_us) still caps it."""

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

    def _stale_names(self) -> set[str]:
        names = super()._stale_names()
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
            for h in self._joinable(slot):
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

    def _joinable(self, slot: Slot) -> list[str]:
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
        hs = self._joinable(slot)
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


    def check_all(self, slots: Iterable[Slot]) -> dict[str, str]:
        out = {}
        for s in slots:
            mem = self._path(s, "memory")
            if mem and self._read_kv(os.path.join(mem, "memory.oom_control")).get("oom_kill", 0) > 0:
                out[s.name] = "oom"
                continue
            pids = self._path(s, "pids")
            if pids and self._read_kv(os.path.join(pids, "pids.events")).get("max", 0) > 0:
                out[s.name] = "pids_limit"
        return out

    def usage(self, slot: Slot, rusage: Any = None) -> Usage:
        u = super().usage(slot, rusage)
        acct = self._path(slot, "cpuacct")
        if acct and not self._cpuacct_usage:   # remembered once seen (a run's end reads usage)
            self._cpuacct_usage = self.fs.exists(os.path.join(acct, "cpuacct.usage"))
        if acct and self._cpuacct_usage:
            u.cpu_s = max(0.0, self._read_int(os.path.join(acct, "cpuacct.usage")) / 1e9 - slot.cpu_offset_s)
        mem = self._path(slot, "memory")
        if mem:
            u.max_rss_bytes = max(u.max_rss_bytes, self._read_int(os.path.join(mem, "memory.max_usage_in_bytes")))
            u.oom_kills = self._read_kv(os.path.join(mem, "memory.oom_control")).get("oom_kill", 0)
        cpu = self._path(slot, "cpu")
        if cpu:
            u.throttled_s = self._read_kv(os.path.join(cpu, "cpu.stat")).get("throttled_time", 0) / 1e9
        pids = self._path(slot, "pids")
        if pids:
            u.pids_max_events = self._read_kv(os.path.join(pids, "pids.events")).get("max", 0)
        return u


# --------------------------------------------------------------------------- cgroup v2


class Cgroup2Backend(_CgroupBackend):
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
        slot = Slot(name, limits, {"unified": d})
        try:
            self.fs.mkdir(d)
            if limits.memory_bytes:
                self.fs.write(os.path.join(d, "memory.max"), str(limits.memory_bytes))
                if self.fs.exists(os.path.join(d, "memory.swap.max")):
                    try:
                        self.fs.write(os.path.join(d, "memory.swap.max"), "0")
                    except OSError:
                        pass
            self.fs.write(os.path.join(d, "memory.oom.group"), "1")
            if limits.cpu:
                self.fs.write(os.path.join(d, "cpu.max"), f"{max(1000, int(limits.cpu * CPU_PERIOD_US))} {CPU_PERIOD_US}")
            if limits.pids:
                self.fs.write(os.path.join(d, "pids.max"), str(int(limits.pids)))
        except OSError:
            self.remove(slot)
            raise
        return slot

    def check_all(self, slots: Iterable[Slot]) -> dict[str, str]:
        out = {}
        for s in slots:
            d = s.paths["unified"]
            ev = self._read_kv(os.path.join(d, "memory.events"))
            if ev.get("oom_kill", 0) > 0 or ev.get("oom_group_kill", 0) > 0:
                out[s.name] = "oom"
            elif self._read_kv(os.path.join(d, "pids.events")).get("max", 0) > 0:
                out[s.name] = "pids_limit"
            elif not self.fs.exists(os.path.join(d, "memory.peak")):
                s.peak_rss = max(s.peak_rss, self._read_int(os.path.join(d, "memory.current")))
        return out

    def usage(self, slot: Slot, rusage: Any = None) -> Usage:
        u = super().usage(slot, rusage)
        d = slot.paths["unified"]
        st = self._read_kv(os.path.join(d, "cpu.stat"))
        if "usage_usec" in st:
            u.cpu_s = st["usage_usec"] / 1e6
        u.throttled_s = st.get("throttled_usec", 0) / 1e6
        peak = self._read_int(os.path.join(d, "memory.peak"), -1)
        u.max_rss_bytes = max(u.max_rss_bytes, peak, slot.peak_rss)
        ev = self._read_kv(os.path.join(d, "memory.events"))
        u.oom_kills = max(ev.get("oom_kill", 0), ev.get("oom_group_kill", 0))
        u.pids_max_events = self._read_kv(os.path.join(d, "pids.events")).get("max", 0)
        return u

    def kill_all(self, slot: Slot) -> None:
        kill = os.path.join(slot.paths["unified"], "cgroup.kill")
        if self.fs.exists(kill):
            try:
                self.fs.write(kill, "1")
            except OSError:
                pass
        super().kill_all(slot)


# --------------------------------------------------------------------------- probing


def _make(name: str, root_name: str, runs_weight: int) -> QuotaBackend:
    if name == "cgroup2":
        return Cgroup2Backend(root_name=root_name, runs_weight=runs_weight)
    if name == "cgroup1":
        return Cgroup1Backend(root_name=root_name)
    if name == "rlimit":
        return RlimitBackend()
    raise ValueError(f"unknown quota backend {name!r} (auto, cgroup2, cgroup1 or rlimit)")


def probe(preferred: str = "auto", root_name: str = DEFAULT_ROOT, setup: bool = True,
          reclaim: bool = False, runs_weight: int = 1) -> QuotaBackend:
    """The best usable backend, starting at `preferred` ('auto' = cgroup2).

    setup=False only checks (nothing is created: for `config check`). reclaim=True kills
    and removes run cgroups a previous agent left under root_name (the daemon at start).
    runs_weight: on cgroup v2, how many ordinary processes the runs' root cgroup weighs
    against the agent's own leaf (the daemon passes execute.max_concurrent).
    The returned backend has `.name` and `.why`.
    """
    if preferred not in ("auto",) + ORDER:
        raise ValueError(f"unknown quota backend {preferred!r} (auto, cgroup2, cgroup1 or rlimit)")
    order = ORDER if preferred == "auto" else ORDER[ORDER.index(preferred):]
    skipped: list[str] = []
    for name in order:
        b = _make(name, root_name, runs_weight)
        try:
            if isinstance(b, _CgroupBackend):
                b.check_available()
                if setup:
                    b.setup()
                    if reclaim:
                        b.reclaim()
                else:
                    b.why = b.location()
            elif not skipped:
                b.why = "requested" if preferred == "rlimit" else "chosen"
        except (BackendUnavailable, OSError) as exc:
            skipped.append(f"{name} unusable: {exc}" if preferred in ("auto", name) else f"{name}: {exc}")
            continue
        notes = [f"requested {n}" if n.startswith(preferred + " ") else n for n in skipped]
        if name == "rlimit":
            b.why = "last resort: no cpu rate limit, pids counted per user" + (f"; {'; '.join(notes)}" if notes else "")
        elif notes:
            b.why = f"{b.why}; {'; '.join(notes)}"
        m = _backend_metric()
        if m is not None and setup:
            m.labels(b.name).set(1)
        return b
    raise BackendUnavailable("; ".join(skipped))  # unreachable: rlimit always works


def _backend_metric():
    try:
        from agent.execute.metrics import BACKEND_INFO

        return BACKEND_INFO
    except Exception:  # pragma: no cover
        return None


def describe_backend(preferred: str = "auto") -> str:
    """One line: which backend the agent would use here and why (creates nothing)."""
    b = probe(preferred, setup=False)
    return f"{b.name} ({b.why})"
