#!/usr/bin/python3
"""Spawn overhead per quota backend, as a ratio against a plain subprocess, and
admission decision latency.

For each backend usable here (and each spawn mode), N runs of /bin/true go through
Executor.start() -> on_exit (the full life: cgroup create, launch, hooks, reap, usage,
cgroup removal). The peer is subprocess.run(["/bin/true"]) in the same process,
interleaved in rounds so that load from other work on the machine hits both alike.
Also reported: the time start() blocks its caller (what the daemon's loop pays).

    /usr/bin/python3 bench/bench_spawn.py [--runs 200] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent.execute import Admission, Budget, Demand, Executor, Limits, RunSpec  # noqa: E402
from agent.execute.backends import BackendUnavailable, Cgroup1Backend, Cgroup2Backend, RlimitBackend  # noqa: E402


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def one_plain():
    t = time.perf_counter()
    subprocess.run(["/bin/true"])
    return time.perf_counter() - t


def one_run(ex, key, ev):
    ev.clear()
    t = time.perf_counter()
    ex.start(RunSpec(key, ["/bin/true"], limits=Limits(cpu=0.5, memory_mb=64, pids=16)), lambda h, r: ev.set())
    started = time.perf_counter() - t
    ev.wait(30)
    return time.perf_counter() - t, started


def backends(root):
    out = []
    if os.geteuid() == 0:
        for cls in (Cgroup2Backend, Cgroup1Backend):
            b = cls(root_name=root)
            try:
                b.setup()
                out.append(b)
            except (BackendUnavailable, OSError) as exc:
                print(f"# {cls.name}: not measured ({exc})")
    out.append(RlimitBackend())
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200, help="runs per configuration and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ballast-mb", type=int, default=80,
                    help="grow this process like a daemon with grpc/paho/bcc loaded (fork cost scales with it)")
    args = ap.parse_args()
    ballast = [bytearray(1 << 20) for _ in range(args.ballast_mb)]  # noqa: F841 - resident ballast
    for b in ballast:
        b[::4096] = b"x" * len(b[::4096])
    import psutil

    print(f"# python {sys.version.split()[0]}, {os.cpu_count()} cpus, loadavg {os.getloadavg()[0]:.1f}, "
          f"process rss {psutil.Process().memory_info().rss >> 20} MiB")
    base = tempfile.mkdtemp(prefix="mw-bench-", dir="/tmp")
    root = f"millwright-bench-{os.getpid()}"
    results = {}
    bks = backends(root)
    try:
        executors = []
        for b in bks:
            for mode in ("shim", "fork"):
                executors.append((f"{b.name}/{mode}", Executor(b, base, spawn_mode=mode)))
        # interleaved one by one: the machine's load (other work) hits peer and subject alike
        plain: dict[str, list[float]] = {}
        ev = threading.Event()
        for rnd in range(args.rounds):
            for name, ex in executors:
                n = args.runs if name.endswith("shim") else max(20, args.runs // 5)
                for i in range(n):
                    plain.setdefault(name, []).append(one_plain())
                    life, start = one_run(ex, f"{name.replace('/', '-')}-{rnd}-{i}", ev)
                    results.setdefault(name, ([], []))
                    results[name][0].append(life)
                    results[name][1].append(start)
        print(f"\n{'backend/spawn mode':<18} {'n':>4} {'peer p50 ms':>11} {'life p50 ms':>11} {'p99 ms':>8} "
              f"{'ratio p50':>9} {'start() p50 ms':>14} {'p99 ms':>8}")
        for name, (life, start) in results.items():
            p50 = statistics.median(plain[name])
            print(f"{name:<18} {len(life):>4} {p50 * 1e3:>11.2f} {statistics.median(life) * 1e3:>11.2f} "
                  f"{pct(life, 99) * 1e3:>8.2f} {statistics.median(life) / p50:>8.2f}x "
                  f"{statistics.median(start) * 1e3:>14.2f} {pct(start, 99) * 1e3:>8.2f}")
        print("(peer: subprocess.run(['/bin/true']) interleaved with each run; life: start() to on_exit,"
              " incl. cgroup create/remove, launcher, reap, usage)")
        for _, ex in executors:
            ex.close(close_backend=False)
    finally:
        for b in bks:
            b.close()
        shutil.rmtree(base, ignore_errors=True)

    # admission decision latency: request (+ a release that admits the head) with a deep queue
    adm = Admission(Budget(max_concurrent=4, memory_mb=1024, cpu=2.0))
    for i in range(4):
        adm.request(f"r{i}", i, Demand(256, 0.5))
    lat_req, lat_rel = [], []
    for i in range(20000):
        t = time.perf_counter()
        adm.request(f"w{i}", 10 + (i * 7919) % 20000, Demand(128 + (i % 3) * 64, 0.25))
        lat_req.append(time.perf_counter() - t)
        if i % 2:
            t = time.perf_counter()
            adm.release(next(iter(adm.running)))
            lat_rel.append(time.perf_counter() - t)
    print(f"\nadmission request():  p50 {statistics.median(lat_req) * 1e6:.1f} us  p99 {pct(lat_req, 99) * 1e6:.1f} us "
          f"(queue depth up to {len(adm)})")
    print(f"admission release():  p50 {statistics.median(lat_rel) * 1e6:.1f} us  p99 {pct(lat_rel, 99) * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
