"""The rlimit quota backend: the last resort, where no cgroup hierarchy is usable."""

from __future__ import annotations

import math
import os
import resource
from typing import Iterable, Optional

from agent.execute.backends.interface import QuotaBackend, Slot
from agent.execute.limits import Limits


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

