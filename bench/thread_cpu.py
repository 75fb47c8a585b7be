"""CPU of a process over a window, per thread, grouped by thread name (bench only).

Reads /proc/<pid>/task/*/stat (utime, stime) at the window's start, every ``poll()``
while it runs, and at its end. A thread's CPU in the window is its last reading minus
its first (0 for a thread born inside the window); a thread that ended between two
polls is missing its last slice, which shows as ``(threads ended between polls)``: the
process total (/proc/<pid>/stat, which keeps what ended threads used) minus the sum.
Beside the CPU, each thread's voluntary context switches (/proc/<pid>/task/*/status): how
often it went to sleep, i.e. its wake-ups (fewer of them did not mean less CPU per firing:
docs/benchmarks.md).

Names: for this process, the Python thread names (``threading``; a native thread such
as gRPC's by its kernel name, ``[native] comm``); for another process, the kernel names.
Numbered threads of one kind are one row: ``runs-worker-3`` and ``runs-worker-5`` are
``runs-worker-*``. Also: the CPU of children reaped in the window (cutime, cstime: a
scheduler's job processes, including the launcher before its exec).
"""

from __future__ import annotations

import os
import re
import threading
from typing import Optional

_TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(path: str) -> Optional[tuple[str, list[str]]]:
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError:
        return None
    return text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()


def kind(name: str) -> str:
    """'runs-worker-12' -> 'runs-worker-*', 'Thread-3 (run)' -> 'Thread-* (run)'."""
    name = re.sub(r"^Thread-\d+", "Thread-*", name)
    return re.sub(r"-\d+$", "-*", name)


def _py_name(t: threading.Thread) -> str:
    """A thread's name; an unnamed one's with where its target is from."""
    target = getattr(t, "_target", None)
    if t.name.startswith("Thread-") and target is not None:
        return f"{t.name} of {getattr(target, '__module__', '?')}"
    return t.name


def _voluntary_switches(path: str) -> int:
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith("voluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def process_cpu(pid: int) -> tuple[float, float, float, float]:
    """(user, system, children's user, children's system) seconds of a process so far."""
    got = _stat_fields(f"/proc/{pid}/stat")
    if got is None:
        return 0.0, 0.0, 0.0, 0.0
    f = got[1]
    return tuple(int(x) / _TICK for x in f[11:15])  # type: ignore[return-value]


class ThreadCPU:
    """Per-thread CPU of process ``pid`` (default: this one) between start() and stop()."""

    def __init__(self, pid: Optional[int] = None):
        self.pid = pid or os.getpid()
        self.own = self.pid == os.getpid()
        self.first: dict[int, tuple[float, float, int]] = {}
        self.last: dict[int, tuple[float, float, int]] = {}
        self.names: dict[int, str] = {}
        self.total0 = (0.0, 0.0, 0.0, 0.0)
        self.lock = threading.Lock()

    def _read(self) -> dict[int, tuple[str, float, float, int]]:
        out = {}
        try:
            tids = os.listdir(f"/proc/{self.pid}/task")
        except OSError:
            return out
        for tid in tids:
            got = _stat_fields(f"/proc/{self.pid}/task/{tid}/stat")
            if got is not None:
                comm, f = got
                out[int(tid)] = (comm, int(f[11]) / _TICK, int(f[12]) / _TICK,
                                 _voluntary_switches(f"/proc/{self.pid}/task/{tid}/status"))
        return out

    def _names(self, tasks: dict) -> None:
        py = {t.native_id: _py_name(t) for t in threading.enumerate()} if self.own else {}
        for tid, (comm, *_) in tasks.items():
            if tid not in self.names or tid in py:
                self.names[tid] = py.get(tid) or (f"[native] {comm}" if self.own else comm)

    def start(self) -> "ThreadCPU":
        with self.lock:
            tasks = self._read()
            self.total0 = process_cpu(self.pid)
            self._names(tasks)
            self.first = {tid: (u, s, v) for tid, (_, u, s, v) in tasks.items()}
            self.last = dict(self.first)
        return self

    def poll(self) -> None:
        """Read every thread now (call every second or so: keeps what short-lived threads used)."""
        with self.lock:
            tasks = self._read()
            self._names(tasks)
            for tid, (_, u, s, v) in tasks.items():
                self.first.setdefault(tid, (0.0, 0.0, 0))
                self.last[tid] = (u, s, v)

    def stop(self) -> dict:
        """{"threads": {kind: [user_s, sys_s]}, "switches": {kind: voluntary switches},
        "user_s", "sys_s", "children_s"} for the window."""
        self.poll()
        total1 = process_cpu(self.pid)
        rows: dict[str, list[float]] = {}
        switches: dict[str, int] = {}
        with self.lock:
            for tid, (u1, s1, v1) in self.last.items():
                u0, s0, v0 = self.first.get(tid, (0.0, 0.0, 0))
                k = kind(self.names.get(tid, str(tid)))
                row = rows.setdefault(k, [0.0, 0.0])
                row[0] += u1 - u0
                row[1] += s1 - s0
                switches[k] = switches.get(k, 0) + v1 - v0
        user, system = total1[0] - self.total0[0], total1[1] - self.total0[1]
        gone = [user - sum(r[0] for r in rows.values()), system - sum(r[1] for r in rows.values())]
        if gone[0] + gone[1] > 0.0:
            rows["(threads ended between polls)"] = gone
        return {"threads": rows, "switches": switches, "user_s": user, "sys_s": system,
                "children_s": (total1[2] - self.total0[2]) + (total1[3] - self.total0[3])}


def per_firing_table(cpu: dict, firings: int, exclude: tuple[str, ...] = (), width: int = 60) -> list[str]:
    """Lines: ms of CPU per firing per thread kind (user+sys, and the sys share) and its
    wake-ups per firing (voluntary switches; short-lived threads are not seen), largest
    first, then the total (without the ``exclude``d kinds, e.g. the benchmark's own thread)."""
    n = max(1, firings)
    switches = cpu.get("switches", {})
    rows = [(k, u, s) for k, (u, s) in cpu["threads"].items() if k not in exclude]
    rows.sort(key=lambda r: -(r[1] + r[2]))
    lines = []
    for k, u, s in rows:
        ms = (u + s) * 1000 / n
        if ms < 0.005:
            continue
        wakes = f"  wake-ups {switches[k] / n:5.2f}" if k in switches else ""
        lines.append(f"  {k[:width]:<{width}} {ms:7.3f} ms/firing  (sys {s * 1000 / n:6.3f}){wakes}")
    tu, ts = sum(r[1] for r in rows), sum(r[2] for r in rows)
    tw = sum(v for k, v in switches.items() if k not in exclude)
    lines.append(f"  {'total':<{width}} {(tu + ts) * 1000 / n:7.3f} ms/firing  (sys {ts * 1000 / n:6.3f})"
                 f"  wake-ups {tw / n:5.2f}")
    return lines


def total_ms_per_firing(cpu: dict, firings: int, exclude: tuple[str, ...] = ()) -> float:
    return sum(u + s for k, (u, s) in cpu["threads"].items() if k not in exclude) * 1000 / max(1, firings)
