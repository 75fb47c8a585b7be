#!/usr/bin/python3
"""The price of job isolation per run (docs/security.md, "Job isolation"): the same runs
with and without it, interleaved in rounds in one process, on each quota backend here.

Modes: ``plain`` (no isolation: the template user's own uid, the agent's namespaces),
``isolated`` (a uid of its own, the jobs' mount namespace, the nftables rules) and
``isolated-root`` (allow_root: a thread of its own in a Landlock domain, capabilities
dropped) and ``isolated-none`` (network none: the empty network namespace too).

Each run is prepared (armed launcher) for a due time 30 ms ahead, like the scheduler does;
the job is ``lksh -c 'echo $EPOCHREALTIME'``, so its first output is its own clock right
after its exec. Reported per run: the agent's CPU (process CPU time of the whole agent,
all threads, over the batch / runs), the time prepare() blocks its caller, the run's own
CPU (launcher chain + job, from its cgroup), and the job's start latency after its due
time (p50/p95).

    /usr/bin/python3 bench/bench_isolation.py [--runs 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent.execute import Executor, Limits, RunSpec  # noqa: E402
from agent.execute.backends import probe  # noqa: E402
from agent.execute.isolation import Isolation  # noqa: E402

JOB = ["/bin/lksh", "-c", "echo $EPOCHREALTIME"]


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def batch(ex, mode, n, tag):
    done = threading.Semaphore(0)
    lat, block, run_cpu = [], [], []
    user, kw = ("root", {"allow_root": True}) if mode == "isolated-root" else ("millwright-jobs", {})
    if mode == "isolated-none":
        kw["network"] = "none"
    c0 = time.process_time()
    handles = []
    for i in range(n):
        due = time.monotonic() + 0.03
        wall_due = time.time() + 0.03
        t = time.perf_counter()
        h = ex.prepare(RunSpec(f"{tag}-{i}", JOB, user=user, limits=Limits(cpu=0.5, memory_mb=64, pids=16), **kw),
                       lambda h, r: done.release(), release_at=due, guard=lambda: True,
                       guard_until=time.monotonic() + 10)
        block.append(time.perf_counter() - t)
        handles.append((h, wall_due))
        done.acquire(timeout=30)
    cpu = (time.process_time() - c0) / n
    for h, wall_due in handles:
        r = h.result
        if r is None or r.reason != "succeeded" or not r.stdout_path:
            continue
        with open(r.stdout_path) as fh:
            lat.append(float(fh.read().strip()) - wall_due)
        run_cpu.append(r.usage.cpu_s)
    return cpu, block, lat, run_cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root")
    for name in ("cgroup1", "rlimit"):
        backend = probe(name, root_name=f"millwright-bench-iso-{os.getpid()}")
        if backend.name != name:
            print(f"{name}: unusable ({backend.why})")
            continue
        top = tempfile.mkdtemp(prefix="mw-bench-iso-")
        state = os.path.join(top, "state")
        base = os.path.join(state, "runs")
        iso = Isolation(f"millwright-bench-{os.getpid()}", [state], [base], ["http://127.0.0.1:2379"])
        exs = {"plain": Executor(backend, os.path.join(top, "plain")), "isolated": Executor(backend, base, isolation=iso)}
        exs["isolated-root"] = exs["isolated-none"] = exs["isolated"]
        stats: dict = {m: ([], [], [], []) for m in ("plain", "isolated", "isolated-root", "isolated-none")}
        for rnd in range(a.rounds + 1):
            for mode, ex in exs.items():
                cpu, block, lat, run_cpu = batch(ex, mode, a.runs, f"{mode}-{rnd}")
                if rnd:   # the first round warms caches up
                    s = stats[mode]
                    s[0].append(cpu)
                    s[1].extend(block)
                    s[2].extend(lat)
                    s[3].extend(run_cpu)
        print(f"== {name} ({a.rounds} x {a.runs} runs per mode)")
        print(f"{'mode':14} {'agent CPU/run':>14} {'prepare() p50/p95':>20} {'run CPU/run':>12} {'start after due p50/p95':>26}")
        for mode, (cpu, block, lat, run_cpu) in stats.items():
            print(f"{mode:14} {statistics.mean(cpu) * 1e3:11.2f} ms {pct(block, 50) * 1e3:9.2f}/{pct(block, 95) * 1e3:.2f} ms "
                  f"{statistics.mean(run_cpu) * 1e3 if run_cpu else float('nan'):9.2f} ms "
                  f"{pct(lat, 50) * 1e3:14.2f}/{pct(lat, 95) * 1e3:.2f} ms  (n={len(lat)})")
        exs["plain"].close(close_backend=False)
        exs["isolated"].close()


if __name__ == "__main__":
    main()
