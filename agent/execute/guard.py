"""Runs die with their agent, whatever kills it (kill -9, the OOM killer, a crash).

The agent starts one small *keeper* process (this file, run as a script by the system
Python with ``-I -S``: stdlib only, about 8 MB) in its own session, so a signal to the
agent's process group or a Ctrl-C does not reach it. The keeper reads, on a pipe whose
only writer is the agent, one line per run as it is spawned (``+ <pgid> <cgroup dir>...``)
and as it is reaped (``- <pgid>``). When the agent dies the kernel closes that pipe; the
keeper reads EOF and SIGKILLs every run it still knows: its process group, and every
process in its cgroup(s) (``cgroup.kill`` on cgroup v2, ``cgroup.procs`` on v1), until
none is left, then removes the empty run cgroups and exits. A clean executor close ends
the runs first, so the keeper has nothing left to kill.

Why not PR_SET_PDEATHSIG: it reaches only the launcher, not the run's descendants, and
it fires when the *thread* that forked exits. Why not a guard process per run: one more
fork per run and per pids.max, and the exit status and the pid the sensor tracks would
belong to the guard; a run is registered with the keeper by one pipe write (microseconds)
before its launcher may exec, so no run can start unguarded.

The agent side (:class:`RunGuard`) restarts a keeper that died and replays the live runs.
Limits: a run descendant that leaves its process group (setsid) is found only through its
cgroup, so not on the rlimit backend; a keeper killed together with the agent (``kill -9``
of both) protects nothing (systemd's stop kills the whole service cgroup anyway).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Iterable, Optional

KILL_FOR_S = 10.0  # the keeper gives up on processes that survive SIGKILL this long (D state)


class RunGuard:
    """Agent side: keeps a keeper process and tells it about every live run.

    add() and remove() are thread-safe (the loop spawns, the reaper finalises)."""

    def __init__(self, python: Optional[str] = None):
        self.python = python or _system_python()
        self._lock = threading.Lock()
        self._live: dict[int, tuple[tuple[str, ...], bool]] = {}   # pgid -> (cgroup dirs, leader reaped)
        self._pooled: set[str] = set()   # cgroup dirs of the executor's slots (removed at the end)
        self._proc: Optional[subprocess.Popen] = None
        self._w = -1
        self.restarts = 0
        with self._lock:
            self._start()

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def guarded(self) -> set[int]:
        """The process groups of the runs registered now."""
        with self._lock:
            return set(self._live)

    def _start(self) -> None:
        r, w = os.pipe()   # both close-on-exec: no run (or later keeper) inherits the writer
        try:
            self._proc = subprocess.Popen([self.python, "-I", "-S", os.path.abspath(__file__)], stdin=r,
                                          stdout=subprocess.DEVNULL, close_fds=True, start_new_session=True)
        finally:
            os.close(r)
        self._w = w
        if self._pooled:
            self._write(_line("c", 0, tuple(sorted(self._pooled))))
        for pgid, (paths, reaped) in self._live.items():
            self._write(_line("+", pgid, paths))
            if reaped:
                self._write(_line("x", pgid, ()))

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._w, view):]

    def _send(self, data: bytes) -> None:
        if self._proc is None:
            return
        try:   # (no poll of the keeper per line: once it is gone, its pipe has no reader)
            self._write(data)
            return
        except OSError:
            pass
        # the keeper died (killed, OOM): start another and tell it every live run again
        os.close(self._w)
        try:
            self._proc.wait(1.0)
        except subprocess.TimeoutExpired:
            pass
        self.restarts += 1
        self._start()

    def add(self, pgid: int, cgroup_dirs: Iterable[str] = ()) -> None:
        """Register a run before its launcher may exec the job."""
        paths = tuple(d for d in cgroup_dirs if d and " " not in d and "\n" not in d)
        with self._lock:
            self._live[pgid] = (paths, False)
            self._send(_line("+", pgid, paths))

    def pooled(self, cgroup_dirs: Iterable[str]) -> None:
        """Cgroups of a run slot that now exists (reused run after run): removed at the end
        like a run's, once whatever runs in them was killed."""
        paths = tuple(d for d in cgroup_dirs if d and " " not in d and "\n" not in d)
        with self._lock:
            self._pooled.update(paths)
            self._send(_line("c", 0, paths))

    def unpooled(self, cgroup_dirs: Iterable[str]) -> None:
        """The slot's cgroups were removed."""
        paths = tuple(d for d in cgroup_dirs if d in self._pooled)
        with self._lock:
            self._pooled.difference_update(paths)
            self._send(_line("u", 0, paths))

    def leader_exited(self, pgid: int) -> None:
        """Call BEFORE reaping the run's leader: once it is reaped, its pid (= the process
        group id) may be reused by an unrelated process, so from then on the keeper finds
        the run's processes only through its cgroup (the agent SIGKILLs the group itself)."""
        with self._lock:
            if pgid in self._live:
                self._live[pgid] = (self._live[pgid][0], True)
                self._send(_line("x", pgid, ()))

    def remove(self, pgid: int) -> None:
        """The run was reaped (its group and cgroup are empty)."""
        with self._lock:
            if self._live.pop(pgid, None) is not None:
                self._send(_line("-", pgid, ()))

    def set_deadline(self, monotonic_s: Optional[float]) -> None:
        """Deadman: if no later deadline arrives by then (CLOCK_MONOTONIC, shared by all
        processes), the keeper kills every registered run, as if the agent had died. The
        daemon sets it to the session's validity plus kill_grace_s on every lease renewal,
        so the runs of an agent that is frozen (SIGSTOP, a stalled VM, a hung loop and
        reaper) are dead before its lease can expire. None: no deadline."""
        with self._lock:
            self._send(b"D -\n" if monotonic_s is None else f"D {monotonic_s:.6f}\n".encode())

    def close(self, timeout: float = 5.0) -> None:
        """Clean stop: the keeper kills what is still registered (normally nothing) and exits."""
        with self._lock:
            proc, self._proc = self._proc, None
            if self._w >= 0:
                os.close(self._w)
                self._w = -1
        if proc is not None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _line(op: str, pgid: int, paths: tuple) -> bytes:
    return (" ".join((op, str(int(pgid))) + tuple(paths)) + "\n").encode()


def _system_python() -> str:
    exe = sys.executable
    if exe and os.access(exe, os.X_OK):
        return exe
    return "/usr/bin/python3"


# --------------------------------------------------------------------------- the keeper
# The keeper runs this file as a script under -I -S: it imports nothing of the agent's
# package, hence its own /proc readers beside agent/execute/processes.py.


def _stat(pid: str) -> Optional[tuple]:
    """(state, pgid) of a process, None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    rest = data[data.rfind(b")") + 2:].split()
    return rest[0], int(rest[2])


def group_members(pgids: set) -> list:
    """Live (non-zombie) processes whose process group is one of ``pgids`` (also what tests
    and benchmarks use to see that a run's tree is gone)."""
    out: list = []
    if not pgids:
        return out
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(name)
            if st is not None and st[0] not in (b"Z", b"X") and st[1] in pgids:
                out.append(int(name))
    return out


def _cgroup_procs(d: str) -> list:
    """Live processes of a cgroup (zombies are listed on v1 until reaped: skipped)."""
    try:
        with open(os.path.join(d, "cgroup.procs")) as fh:
            pids = fh.read().split()
    except OSError:
        return []
    out = []
    for p in pids:
        st = _stat(p)
        if st is not None and st[0] not in (b"Z", b"X"):
            out.append(int(p))
    return out


def kill_runs(live: dict, give_up_after_s: float = KILL_FOR_S) -> int:
    """SIGKILL every registered run's process group (while its leader is unreaped, so the
    group id cannot have been reused) and its cgroup members until none is left. ``live``
    maps pgid -> (leader_unreaped, cgroup dirs). Returns how many processes were alive at
    the first sweep."""
    if not live:
        return 0
    pgids = {pgid for pgid, (leader, _) in live.items() if leader}
    dirs = [d for _, paths in live.values() for d in paths]
    first = None
    deadline = time.monotonic() + give_up_after_s
    while True:
        left = set(group_members(pgids))
        for d in dirs:
            left.update(_cgroup_procs(d))
            try:   # cgroup v2 (5.14+): the kernel kills the whole subtree, forks included
                with open(os.path.join(d, "cgroup.kill"), "w") as fh:
                    fh.write("1")
            except OSError:
                pass
        if first is None:
            first = len(left)
        if not left:
            break
        for pgid in pgids:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if time.monotonic() > deadline:
            break
        time.sleep(0.005)
    for d in dirs:   # empty now: leave no run cgroup behind (the next agent would reclaim it)
        try:
            os.rmdir(d)
        except OSError:
            pass
    return first


def remove_cgroups(dirs: Iterable[str]) -> None:
    """The agent's run slots (their runs were killed): none left behind. One that still
    holds a process (whatever survived) stays for the next agent's reclaim."""
    for d in dirs:
        for pid in _cgroup_procs(d):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for _ in range(200):
            try:
                os.rmdir(d)
            except FileNotFoundError:
                break
            except OSError:   # the killed tasks leave the cgroup asynchronously
                time.sleep(0.005)
                continue
            break


def keeper_main() -> int:  # pragma: no cover - runs as its own process
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGTSTP):
        signal.signal(s, signal.SIG_IGN)   # only the agent's end of the pipe ends us
    import select

    live: dict[int, tuple] = {}   # pgid -> (leader not reaped yet, cgroup dirs)
    pooled: set = set()           # cgroup dirs of the agent's run slots
    deadline: Optional[float] = None
    buf = b""
    while True:
        timeout = None
        if deadline is not None and live:
            timeout = max(0.0, deadline - time.monotonic())
        try:
            ready, _, _ = select.select([0], [], [], timeout)
        except InterruptedError:
            continue
        if not ready:   # the agent missed its own deadline: frozen or hung
            n = kill_runs(live)
            sys.stderr.write(f"millwright run guard: agent deadline passed, killed {len(live)} run(s), "
                             f"{n} process(es)\n")
            live.clear()
            continue
        try:
            data = os.read(0, 65536)
        except InterruptedError:
            continue
        except OSError:
            data = b""
        if not data:
            break
        buf += data
        *lines, buf = buf.split(b"\n")
        for raw in lines:
            parts = raw.decode(errors="replace").split()
            if len(parts) < 2:
                continue
            if parts[0] == "D":
                try:
                    deadline = None if parts[1] == "-" else float(parts[1])
                except ValueError:
                    pass
            elif not parts[1].isdigit():
                continue
            elif parts[0] == "+":
                live[int(parts[1])] = (True, tuple(parts[2:]))
            elif parts[0] == "x" and int(parts[1]) in live:
                live[int(parts[1])] = (False, live[int(parts[1])][1])
            elif parts[0] == "-":
                live.pop(int(parts[1]), None)
            elif parts[0] == "c":
                pooled.update(parts[2:])
            elif parts[0] == "u":
                pooled.difference_update(parts[2:])
    kill_runs(live)
    remove_cgroups(pooled)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(keeper_main())
