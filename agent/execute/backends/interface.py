"""The quota backend interface: what the executor asks of a backend for each run.

The executor takes a *slot* per run (a cgroup, or just bookkeeping for rlimits) from its
pool (agent/execute/backends/pool.py), lets the launcher join it by itself (``join_fds``)
or attaches the child to it before the child execs, polls it for quota events while the
run lives, reads its usage once when it ends, and gives it back to the pool (reset for
the next run) or removes it."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from agent.execute.limits import Limits
from agent.execute.processes import group_members


class BackendUnavailable(Exception):
    """The backend cannot work on this machine; the message says why."""


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
    # hierarchy -> an fd of the file a process joins the cgroup by writing "0" to (v1's
    # `tasks`), open while the slot lives: the launcher inherits them and joins by itself
    join_fds: dict = field(default_factory=dict)
    joined: set = field(default_factory=set)   # hierarchies the current run's launcher joins by itself
    keep_fds: dict = field(default_factory=dict)   # other files of the slot kept open while it lives
    # the cumulative counters as the current run found them (a reused slot's are not zero):
    # name -> value, subtracted from what the run's end reads
    base: dict = field(default_factory=dict)
    runs: int = 0   # runs it has held (more than one: it was reused)


@dataclass
class Usage:
    """What a run used, read from its slot when it ends (or while it lives)."""

    cpu_s: float = 0.0
    max_rss_bytes: int = 0
    oom_kills: int = 0
    throttled_s: float = 0.0
    pids_max_events: int = 0

    def to_dict(self) -> dict:
        return {"cpu_s": round(self.cpu_s, 6), "max_rss_bytes": int(self.max_rss_bytes),
                "oom_kills": int(self.oom_kills), "throttled_s": round(self.throttled_s, 6)}


class QuotaBackend:
    """The interface, and its defaults for a backend without containers: a slot is the
    run's process group (members, kill_all) and usage is the run's rusage."""

    name = "none"
    why = ""
    enforces_cpu_rate = False
    poolable = False   # its slots are worth keeping for another run (cgroups: made and removed on disk)
    contains_runs = False   # a slot holds every process of its run (members() lists them all)

    def setup(self) -> None:
        """Prepare the backend's root (create cgroups, enable controllers)."""

    def create(self, name: str, limits: Limits) -> Slot:
        return Slot(name, limits)

    def reuse(self, slot: Slot, limits: Limits) -> None:
        """Give a pooled slot another run's limits (only the values that differ are
        written). OSError: the slot cannot hold them (the pool removes it)."""
        slot.limits = limits

    def recycle(self, slot: Slot) -> bool:
        """Reset an empty slot whose run ended cleanly for the next run (its usage was read:
        the cumulative counters are its new ``base``). False: it cannot be reused."""
        return True

    def attach(self, slot: Slot, pid: int) -> None:
        """Put the (not yet exec'ed) child into the slot, where it does not join by itself
        (``slot.joined``). Runs in the parent."""
        slot.pid = slot.pgid = pid

    def child_rlimits(self, limits: Limits, timeout_s: Optional[float]) -> list[tuple[int, int]]:
        """(resource, value) pairs the child sets on itself before exec."""
        return []

    def check_all(self, slots: Iterable[Slot]) -> dict[str, str]:
        """slot name -> quota reason ('oom' or 'pids_limit') for runs that hit a limit."""
        return {}

    def usage(self, slot: Slot, rusage: Any = None, final: bool = False) -> Usage:
        """What the slot's current run used so far. ``final`` (its end, read once): the
        cumulative counters read become the slot's base for a next run."""
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

