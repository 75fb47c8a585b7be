"""Degraded mode's view of processes, by polling /proc instead of tracepoints.

Without BPF the sensor still reports execs (new processes, and execs in place by the
processes of a job) and per-slot stalled sockets; both are found by scanning /proc, so
they are accurate to the polling interval and a process shorter than it can be missed.
Only the poll thread uses a scanner.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Mapping, Optional

from agent.signals import procfs
from agent.signals.model import ExecEvent


class ProcessScanner:
    """Execs and stalled sockets of the processes in /proc, attributed to job slots.

    ``tracked()`` returns what the agent tracks now (pid -> slot); a process belongs to
    the slot of its nearest tracked ancestor.
    """

    def __init__(self, tracked: Callable[[], Mapping[int, int]], node_activity: bool):
        self._tracked = tracked
        self.node_activity = node_activity
        self._known: Optional[set[int]] = None
        self._slots: dict[int, int] = {}               # pid -> slot, for pids this scanner attributed
        self._pending: list[tuple] = []
        self._parent: dict[int, int] = {}
        self._cmd: dict[int, tuple] = {}
        self._stall_seen: dict[int, float] = {}        # socket inode -> first seen stalled

    def scan(self) -> list[ExecEvent]:
        """The processes that appeared since the last scan; the first scan is the baseline
        and reports nothing. A process is read when first seen (it may be short-lived) but
        reported one scan later, so that a track() made right after spawning it is already
        in place."""
        pids = procfs.list_pids()
        if self._known is None:
            self._known = pids
            self._pending = []
            self._parent = {}
            self._cmd = {}
            return []
        new = sorted(pids - self._known)
        self._known = pids
        tracked = self._tracked()
        ready, self._pending = self._pending, []
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
            self._parent[pid] = ppid
            self._pending.append((pid, ppid, int(st.get("Uid", "0").split()[0]), int(st.get("Gid", "0").split()[0]),
                                  filename, argv, offset + time.monotonic()))
        # execs in place (same pid) by tracked processes: compare exe and cmdline
        for pid in list(self._slots):
            prev = self._cmd.get(pid)
            argv = procfs.proc_cmdline(pid)
            try:
                filename = os.readlink(f"/proc/{pid}/exe")
            except OSError:
                continue
            if prev is not None and argv is not None and (filename, argv) != prev:
                st = procfs.proc_status(pid) or {}
                ready.append((pid, self._parent.get(pid, 0), int(st.get("Uid", "0").split()[0]),
                              int(st.get("Gid", "0").split()[0]), filename, argv, offset + time.monotonic()))
        events = []
        for pid, ppid, uid, gid, filename, argv, ts in ready:
            slot, cur = None, pid
            for _ in range(64):  # nearest tracked ancestor
                slot = tracked.get(cur) or self._slots.get(cur)
                if slot or cur not in self._parent:
                    break
                cur = self._parent[cur]
            if slot:
                self._slots[pid] = slot
                self._cmd[pid] = (filename, argv)
            elif not self.node_activity:
                continue
            events.append(ExecEvent(pid=pid, ppid=ppid, uid=uid, gid=gid, filename=filename, argv=argv,
                                    slot=slot or None, ts=ts, argv_source="proc", source="proc"))
        self._slots = {p: s for p, s in self._slots.items() if p in pids}
        self._parent = {p: pp for p, pp in self._parent.items() if p in pids}
        self._cmd = {p: c for p, c in self._cmd.items() if p in pids}
        return events

    def slot_stalls(self, now: float) -> dict[int, tuple[int, float]]:
        """Per slot, sockets of its processes that sit in SYN_SENT or have unrecovered
        retransmits (/proc/<pid>/fd + /proc/net/tcp), with the monotonic time the oldest
        was first seen so (accurate to the polling interval)."""
        pid_slots = {**self._slots, **self._tracked()}
        inode_slot: dict[int, int] = {}
        for pid, slot in pid_slots.items():
            for ino in procfs.socket_inodes(pid):
                inode_slot[ino] = slot
        first_seen = self._stall_seen
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
        self._stall_seen = seen_now
        return out
