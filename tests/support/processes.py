"""Watching job processes from a test: run results, the executor's own fds, zombies."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Collection, Optional

from agent.execute.guard import group_members
from agent.execute.runs import STDERR_TAIL_BYTES, tail_text

PY = sys.executable if sys.executable.startswith("/usr/bin/") else "/usr/bin/python3"


def stderr_tail(path: Optional[str], limit: int = STDERR_TAIL_BYTES) -> Optional[str]:
    """The reference for RunResult.stderr_tail: the same tail read back from the run's
    stderr file (what the final record carried before the reaper kept it in memory)."""
    if not path:
        return None
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            raw = fh.read(limit)
    except OSError:
        return None
    return tail_text(raw, size, limit)


def group_alive(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    return group_members({pgid})


class Collector:
    """An executor's on_exit callback that keeps each run's result by run key (and the
    threads it was called on); wait() blocks until the given runs ended."""

    def __init__(self):
        self.results = {}
        self.cv = threading.Condition()
        self.threads = set()

    def __call__(self, handle, result):
        with self.cv:
            self.threads.add(threading.current_thread().name)
            self.results[handle.run_key] = result
            self.cv.notify_all()

    def wait(self, keys, timeout=30.0):
        deadline = time.monotonic() + timeout
        with self.cv:
            while not all(k in self.results for k in keys):
                left = deadline - time.monotonic()
                assert left > 0, f"runs did not end: {[k for k in keys if k not in self.results]}"
                self.cv.wait(left)
        return [self.results[k] for k in keys]


def executor_kind(fd: str) -> bool:
    """Whether this process's fd ``fd`` is of a kind the executor opens (pipes, pidfds,
    cgroup files, run files)."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False
    return target.startswith(("pipe:", "anon_inode:[pidfd]", "/sys/fs/cgroup")) or "/runs/" in target


def children_zombies(pgids: Optional[Collection[int]] = None) -> list[str]:
    """Zombie children of this process (of the given process groups only, when given), each
    as 'pid (comm) pgid N' so that a failure says whose."""
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        close = data.rfind(b")")
        rest = data[close + 2:].split()
        if rest[0] == b"Z" and int(rest[1]) == me and (pgids is None or int(rest[2]) in pgids):
            comm = data[data.find(b"(") + 1:close].decode(errors="replace")
            out.append(f"{name} ({comm}) pgid {int(rest[2])}")
    return out


def zombies_left(pgids: Optional[Collection[int]] = None, timeout: float = 5.0) -> list[str]:
    """Zombie children of this process, of the runs' process groups ``pgids``, still there
    after ``timeout``: the executor sweeps a finished run's process group again within 3 s
    (agent/execute/reaper.py REAP_AGAIN_S) for members that were still being re-parented
    to it at its last sweep.

    Pass the runs' groups: once an executor made the test process a child subreaper, every
    process orphaned by an earlier test (a kill -9'd agent's keeper and runs) re-parents to
    it and stays a zombie here; those are not the run's."""
    deadline = time.monotonic() + timeout
    while True:
        left = children_zombies(pgids)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)
