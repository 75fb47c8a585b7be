#!/usr/bin/python3
"""Runs die with their agent: how fast, and what the run guard costs per spawn.

1. Death latency, per quota backend usable here: an "agent" child process starts an
   Executor and one run whose tree ignores SIGTERM (sh, a subshell, a sleep); we open a
   pidfd on every process of the tree, SIGKILL the agent and time until the last of them
   exited (poll() on the pidfds: microsecond precision, no /proc scanning on the path).
2. Spawn cost with the guard and without it (Executor(guard=False)), same backend, same
   process, interleaved rounds: the time start() blocks its caller and the full life of a
   /bin/true run (start -> on_exit); and the guard's own bookkeeping per run (the
   three pipe writes), which the spawn figures' noise hides.

    /usr/bin/python3 bench/bench_guard.py [--trials 30] [--runs 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from agent.execute import Executor, Limits, RunSpec  # noqa: E402
from agent.execute.backends import BackendUnavailable, Cgroup1Backend, Cgroup2Backend, RlimitBackend  # noqa: E402
from agent.execute.guard import group_members  # noqa: E402

TREE = "trap '' TERM; (trap '' TERM; sleep 60) & (trap '' TERM; sh -c 'sleep 60') & sleep 60"

AGENT = r"""
import os, sys, time
sys.path.insert(0, {root!r})
from agent.execute import Executor, RunSpec
from agent.execute.backends import Cgroup1Backend, Cgroup2Backend, RlimitBackend
cls = {{"cgroup2": Cgroup2Backend, "cgroup1": Cgroup1Backend, "rlimit": RlimitBackend}}[sys.argv[1]]
b = cls() if cls is RlimitBackend else cls(root_name=sys.argv[2])
b.setup() if cls is not RlimitBackend else None
ex = Executor(b, sys.argv[3])
h = ex.start(RunSpec("t", ["/bin/sh", "-c", {tree!r}]), lambda h, r: None)
print(h.pgid, flush=True)
time.sleep(120)
"""


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def group(pgid: int) -> list[int]:
    return group_members({pgid})


def usable(root: str) -> list[str]:
    out = []
    for cls in (Cgroup2Backend, Cgroup1Backend):
        b = cls(root_name=root)
        try:
            b.setup()
            b.close()
            out.append(cls.name)
        except (BackendUnavailable, OSError) as exc:
            print(f"# {cls.name}: not measured here ({str(exc)[:160]})")
    return out + ["rlimit"]


def death_trial(backend: str, root: str, base: str) -> float:
    code = AGENT.format(root=ROOT, tree=TREE)
    agent = subprocess.Popen([sys.executable, "-c", code, backend, root, base], stdout=subprocess.PIPE, text=True)
    pgid = int(agent.stdout.readline())
    deadline = time.monotonic() + 10
    while len(group(pgid)) < 5 and time.monotonic() < deadline:   # sh, 2 subshells, sh -c, sleeps
        time.sleep(0.01)
    fds = []
    for pid in group(pgid):
        try:
            fds.append(os.pidfd_open(pid))
        except OSError:
            pass
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    t0 = time.monotonic()
    agent.kill()
    left = set(fds)
    while left and time.monotonic() - t0 < 30:
        for fd, _ in poller.poll(1000):
            left.discard(fd)
            poller.unregister(fd)
    dt = time.monotonic() - t0
    agent.wait()
    for fd in fds:
        os.close(fd)
    if left:
        raise RuntimeError(f"{len(left)} processes of the run outlived the agent by 30 s")
    return dt


def spawn_cost(backend, guard: bool, runs: int, base: str, ev: threading.Event) -> tuple[list, list]:
    ex = Executor(backend, base, guard=guard)
    life, block = [], []
    try:
        for i in range(runs):
            ev.clear()
            t = time.perf_counter()
            ex.start(RunSpec(f"r{i}", ["/bin/true"], limits=Limits(cpu=0.5, memory_mb=64, pids=16)),
                     lambda h, r: ev.set())
            block.append(time.perf_counter() - t)
            ev.wait(30)
            life.append(time.perf_counter() - t)
    finally:
        ex.close(close_backend=False)
    return life, block


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"# {os.cpu_count()} cpus, loadavg {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    root = f"mw-bench-guard-{os.getpid()}"
    base = tempfile.mkdtemp(prefix="mw-bench-guard-", dir="/tmp")
    try:
        names = usable(root) if os.geteuid() == 0 else ["rlimit"]
        print(f"\n## agent kill -9 -> last process of its run gone ({args.trials} trials, run tree of 5+ processes "
              "ignoring SIGTERM)")
        for name in names:
            ds = [death_trial(name, root, os.path.join(base, f"d-{name}")) for _ in range(args.trials)]
            print(f"{name:8s} p50 {pct(ds, 50) * 1000:7.1f} ms  p99 {pct(ds, 99) * 1000:7.1f} ms  "
                  f"max {max(ds) * 1000:7.1f} ms")
        print(f"\n## spawn cost, guard vs none ({args.rounds} rounds x {args.runs} runs of /bin/true, interleaved)")
        ev = threading.Event()
        for name in names:
            cls = {"cgroup2": Cgroup2Backend, "cgroup1": Cgroup1Backend, "rlimit": RlimitBackend}[name]
            b = cls() if cls is RlimitBackend else cls(root_name=root)
            if cls is not RlimitBackend:
                b.setup()
            res = {True: ([], []), False: ([], [])}
            for _ in range(args.rounds):
                for guard in (False, True):
                    life, block = spawn_cost(b, guard, args.runs, os.path.join(base, f"s-{name}"), ev)
                    res[guard][0].extend(life)
                    res[guard][1].extend(block)
            b.close()
            for guard in (False, True):
                life, block = res[guard]
                print(f"{name:8s} {'guard' if guard else 'none ':5s} start() p50 {pct(block, 50) * 1e3:6.3f} ms "
                      f"p99 {pct(block, 99) * 1e3:6.3f} ms | life p50 {pct(life, 50) * 1e3:6.2f} ms "
                      f"p99 {pct(life, 99) * 1e3:6.2f} ms")
            d50 = pct(res[True][1], 50) - pct(res[False][1], 50)
            print(f"{name:8s} guard adds {d50 * 1e6:+.0f} us to start() at p50")
        # the guard's own work per run, without the noise of a spawn: three pipe writes
        from agent.execute.guard import RunGuard

        g = RunGuard()
        n = 20000
        t = time.perf_counter()
        for i in range(n):
            g.add(1000000 + i, ("/sys/fs/cgroup/memory/x/run", "/sys/fs/cgroup/pids/x/run"))
            g.leader_exited(1000000 + i)
            g.remove(1000000 + i)
        per = (time.perf_counter() - t) / n
        g.close()
        print(f"\nguard bookkeeping per run (add + leader_exited + remove, {n} runs): {per * 1e6:.1f} us")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"# loadavg after {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
