"""What the trigger benchmarks give every scheduler alike, and how they read the result.

The workload: one-shot jobs due evenly over one or more segments (rate per second for so
many seconds, back to back). The job body: one small shell script that execs
``date +%s.%N`` appending its job id and its own clock to one file, so a firing's
lateness is read at the job's own clock (its clock minus its due time), and how often it
ran is the number of its lines.
"""

from __future__ import annotations

import os
import statistics
from typing import Iterable, Optional

BENCH_THREADS = ("MainThread",)   # the benchmark's own thread in a scheduler's process: not the scheduler's CPU

JOB_SH = """#!/bin/sh
exec /bin/date "+$MILLWRIGHT_JOB_ID %s.%N" >>{out}
"""


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def summary(name, xs):
    ms = [x * 1000 for x in xs]
    if not ms:
        return f"{name:<28} n=     0"
    return (f"{name:<28} n={len(xs):6d}  p50 {pct(ms, 50):8.2f} ms  p99 {pct(ms, 99):8.2f} ms  "
            f"max {max(ms):8.2f} ms  mean {statistics.mean(ms):8.2f} ms")


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def job_script(tmp: str) -> tuple[str, str]:
    """The job body every scheduler runs, and the file it appends its clock to."""
    out = os.path.join(tmp, "clock.txt")
    path = os.path.join(tmp, "job.sh")
    with open(path, "w") as fh:
        fh.write(JOB_SH.format(out=out))
    os.chmod(path, 0o755)
    os.chmod(tmp, 0o755)
    with open(out, "a"):
        pass
    os.chmod(out, 0o666)   # a job run as another user (--user) appends to it too
    return path, out


class Workload:
    """One-shot jobs due evenly: ``segments`` of (firings per second, seconds), back to back."""

    def __init__(self, segments: Iterable[tuple[float, float]]):
        self.segments = [(float(r), float(s)) for r, s in segments]
        self.offsets: list[float] = []
        t = 0.0
        for rate, secs in self.segments:
            n = int(round(rate * secs))
            self.offsets += [t + secs * i / n for i in range(n)]
            t += secs
        self.span = t

    @classmethod
    def even(cls, jobs: int, over: float) -> "Workload":
        return cls([(jobs / over, over)])

    @classmethod
    def parse(cls, text: str) -> "Workload":
        """'1000:60,100:20': 1,000/s for 60 s, then 100/s for 20 s."""
        return cls([tuple(float(x) for x in part.split(":")) for part in text.split(",")])  # type: ignore[misc]

    @property
    def n(self) -> int:
        return len(self.offsets)

    def label(self) -> str:
        return " then ".join(f"{r:g}/s for {s:g} s" for r, s in self.segments) + f" ({self.n} one-shot jobs)"

    def spec(self) -> str:
        return ",".join(f"{r:g}:{s:g}" for r, s in self.segments)


def read_clocks(out: str, due: dict[str, float]) -> tuple[dict[str, float], dict[str, int]]:
    """Per job id: its lateness (first clock minus due time) and how many times it ran."""
    first: dict[str, float] = {}
    count: dict[str, int] = {}
    try:
        with open(out) as fh:
            for line in fh:
                jid, _, ts = line.strip().partition(" ")
                if jid in due:
                    count[jid] = count.get(jid, 0) + 1
                    if jid not in first:
                        first[jid] = float(ts) - due[jid]
    except FileNotFoundError:
        pass
    return first, count


def once_check(n: int, count: dict[str, int]) -> dict:
    """How many of the n firings ran exactly once, never, or more than once (job clocks)."""
    more = sum(1 for c in count.values() if c > 1)
    return {"once": sum(1 for c in count.values() if c == 1), "never": n - len(count), "more": more}


def stats(xs: list[float], late_s: float) -> dict:
    """p50/p99/max (seconds) and how many are later than ``late_s``."""
    if not xs:
        return {"n": 0, "p50": None, "p99": None, "max": None, "late": 0}
    return {"n": len(xs), "p50": pct(xs, 50), "p99": pct(xs, 99), "max": max(xs),
            "late": sum(1 for x in xs if x > late_s)}


def backlog_end(due_off: dict[str, float], lateness: dict[str, float], burst_end: float,
                bound: float = 0.05) -> dict:
    """How the backlog of a burst ended, from the firings themselves (offsets from the first
    due time): when the last firing due by ``burst_end`` started (``drained``: seconds after
    burst_end), and from when on every firing due started within ``bound`` of its due time
    (``on_time_from``: seconds after burst_end; None: not by the end of the run)."""
    starts = [due_off[j] + d for j, d in lateness.items() if due_off[j] <= burst_end]
    drained = (max(starts) - burst_end) if starts else None
    after = sorted((due_off[j], d) for j, d in lateness.items())
    on_time = None
    for t, d in reversed(after):   # the latest due time of a firing later than the bound
        if d > bound:
            on_time = t - burst_end if t >= burst_end else 0.0
            break
    else:
        on_time = 0.0
    if after and on_time is not None and on_time + burst_end >= after[-1][0]:
        on_time = None   # late up to the last firing of the run
    return {"drained": drained, "on_time_from": on_time}


def buckets(due_off: dict[str, float], lateness: dict[str, float], width: float,
            lag: Optional[list] = None) -> list[dict]:
    """Per ``width``-second bucket of the run (from the first due time): the firings due in
    it (n, and p50/p99/max of their lateness), how many started in it (at the job clock),
    and the largest lag the agent reported in it (``lag``: [(offset, seconds)])."""
    if not due_off:
        return []
    started = [due_off[j] + d for j, d in lateness.items()]
    end = max(list(due_off.values()) + started + [t for t, _ in (lag or [])])
    out = []
    k = 0
    while k * width <= end:
        lo, hi = k * width, (k + 1) * width
        xs = [lateness[j] for j, t in due_off.items() if lo <= t < hi and j in lateness]
        row = {"from": lo, "due": sum(1 for t in due_off.values() if lo <= t < hi),
               "started": sum(1 for t in started if lo <= t < hi), "lateness": stats(xs, 0.0)}
        if lag is not None:
            vals = [v for t, v in lag if lo <= t < hi]
            row["lag_max"] = max(vals) if vals else None
        out.append(row)
        k += 1
    return out
