#!/usr/bin/env python3
"""Where an armed launcher's delay goes (issue 18): CPU run-queue wait.

Prepares N armed runs per quota backend (cgroup1 and rlimit, interleaved, 50 ms apart,
at most ~1 s ahead like the claim lead); the job is a shell script that reads its own
/proc/$$/schedstat (field 2: nanoseconds spent waiting on a run queue, for this pid over
the launcher's and the job's execs, so including the launcher's start before the due time:
an upper bound of the wait after it) and execs date. Prints, per backend, the delay at the
job's clock next to that run-queue wait: when they are about equal, what bounds the delay
is CPU contention on the machine, not the launch path.

Usage: profile_launch_wait.py [N]   (root; default N=100)
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent.execute import Executor, Limits, RunSpec  # noqa: E402
from agent.execute.backends import probe  # noqa: E402


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    tmp = tempfile.mkdtemp(prefix="mw-launch-wait-")
    os.chmod(tmp, 0o755)
    out, job = os.path.join(tmp, "clock.txt"), os.path.join(tmp, "job.sh")
    with open(job, "w") as fh:
        fh.write('#!/bin/sh\nread a b c </proc/$$/schedstat\nexec /bin/date "+$MILLWRIGHT_JOB_ID $b %s.%N" >>'
                 + out + "\n")
    os.chmod(job, 0o755)
    exs = {name: Executor(probe(name, root_name=f"mw-launch-wait-{os.getpid()}"), os.path.join(tmp, name))
           for name in ("cgroup1", "rlimit")}
    due: dict[str, float] = {}
    done: list = []
    t0 = time.monotonic() + 2.0
    for i in range(n):
        for k, (name, ex) in enumerate(exs.items()):
            at = t0 + i * 0.05 + k * 0.025
            jid = f"{name}-{i}"
            due[jid] = time.time() + (at - time.monotonic())
            ex.prepare(RunSpec(jid, [job], job_id=jid, limits=Limits(1.0, 64, 16)), lambda h, r: done.append(r),
                       release_at=at, guard=lambda: True, guard_until=at + 60)
        while time.monotonic() < t0 + i * 0.05 - 1.0:
            time.sleep(0.01)
    while len(done) < 2 * n:
        time.sleep(0.1)
    rows: dict[str, list[tuple[float, float]]] = {}
    with open(out) as fh:
        for line in fh:
            jid, wait_ns, ts = line.split()
            rows.setdefault(jid.split("-")[0], []).append(((float(ts) - due[jid]) * 1000, int(wait_ns) / 1e6))
    print(f"load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name, xs in rows.items():
        d, w = sorted(x[0] for x in xs), sorted(x[1] for x in xs)
        print(f"{name:8s} n={len(xs)} job clock p50 {d[len(d) // 2]:.2f} ms p90 {d[int(len(d) * .9)]:.2f} ms "
              f"max {d[-1]:.2f} ms | run-queue wait (launcher + job) p50 {w[len(w) // 2]:.2f} ms "
              f"p90 {w[int(len(w) * .9)]:.2f} ms max {w[-1]:.2f} ms")
    for ex in exs.values():
        ex.close()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
