#!/usr/bin/env python3
"""Where the agent's CPU per firing goes (issue 36): per thread (bench/thread_cpu.py, from
/proc) and, within each thread, per function of ours (a sampling profile over the same
window), as milliseconds of CPU per firing.

It runs bench_trigger's Millwright workload in this process (bench/trigger_millwright.py:
one agent with the daemon's job path, real etcd, one-shot jobs spread evenly) and attaches
py-spy to it from the first claim to the last run's end. py-spy samples only threads that
are not idle (on CPU or runnable), so a thread's samples spread its measured CPU over
what it was doing: a function's share = the thread's ms per firing x the share of that
thread's samples in which the function was the innermost frame of agent/ (callees in
libraries included: an etcd call charges the agent function that made it), with the
library the time went into beside it.

py-spy charges a thread's samples in a system call that waits without being one of its
known waits (posix_spawn's vfork wait, a cgroup write waiting for an RCU grace period) as
if on CPU. ``--profiler sampler`` instead uses bench/thread_sampler.py in this process: it
charges each thread's own CPU clock between two samples to the frame it finds, exact CPU
but seen only when the sampler gets the GIL (its caveat). The two side by side bound a
function's cost.

py-spy is not a dependency of the product: install it where this script finds it,
    /usr/bin/python3 -m pip install --target .cache/pyspy py-spy
(or set PYSPY to its path). Without it, the sampler is used.

    /usr/bin/python3 bench/profile_firing_cpu.py [--jobs 3000] [--over 30] [--profiler pyspy|sampler] [--hz 200] [--top 15] [--bpf]
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import bench_trigger  # noqa: E402
from thread_cpu import kind, per_firing_table  # noqa: E402
from trigger_millwright import Options, run_millwright, window_start  # noqa: E402
from trigger_workload import BENCH_THREADS, Workload, load, summary  # noqa: E402

_FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
_LIBS = (("grpc", "grpc"), ("etcd3", "etcd3"), ("google/protobuf", "protobuf"), ("json", "json"),
         ("logging", "logging"), ("prometheus_client", "prometheus"), ("subprocess", "subprocess"),
         ("threading", "threading"), ("queue", "queue"), ("selectors", "selectors"), ("datetime", "datetime"),
         ("hmac", "hmac"), ("hashlib", "hashlib"), ("nacl", "crypto"), ("cryptography", "crypto"))


def find_pyspy() -> Optional[str]:
    for path in (os.environ.get("PYSPY"), os.path.join(ROOT, ".cache", "pyspy", "bin", "py-spy"), shutil.which("py-spy")):
        if path and os.access(path, os.X_OK):
            return path
    return None


def frames_of(stack: str) -> list[tuple[str, str]]:
    """(function, file) per frame of a py-spy raw stack, outermost first."""
    out = []
    for part in stack.split(";"):
        m = _FRAME.match(part)
        out.append((m.group("fn"), m.group("file")) if m else (part, ""))
    return out


def where(frames: list[tuple[str, str]]) -> tuple[str, str]:
    """(innermost function of agent/, the library below it or 'own code')."""
    agent_fn, below = "-", ""
    for i in range(len(frames) - 1, -1, -1):
        fn, path = frames[i]
        if path.startswith("agent/") or "/agent/" in path:
            agent_fn = f"{path.split('agent/', 1)[1] if 'agent/' in path else path}:{fn}"
            inner = frames[i + 1:] if i + 1 < len(frames) else []
            below = "own code"
            for _, p in inner:
                lib = next((name for needle, name in _LIBS if needle in p), None)
                if lib:
                    below = lib
                    break
            else:
                if inner:
                    below = os.path.basename(inner[-1][1]) or "own code"
            break
    return agent_fn, below


def parse_raw(path: str) -> dict[str, collections.Counter]:
    """thread kind -> Counter((agent function, library) -> samples). A line of py-spy's raw
    output: ``thread (TID): NAME;frame;frame COUNT``."""
    by: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    with open(path) as fh:
        for line in fh:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            head, _, rest = stack.partition(";")
            name = head.split("): ", 1)[1] if "): " in head else head
            by[kind(name)][where(frames_of(rest))] += int(count)
    return by


def from_sampler(out: dict) -> dict[str, collections.Counter]:
    """thread kind -> Counter((agent function, library) -> CPU seconds), from
    thread_sampler's cells [thread, leaf category, leaf, agent function, library, cpu_s, n]."""
    by: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for thread, _cat, _leaf, agent_fn, lib, cpu_s, _n in out["cells"]:
        by[kind(re.sub(r"^Thread \(", "Thread-* (", thread))][(agent_fn, lib or "own code")] += cpu_s
    return by


def main() -> None:
    ap = argparse.ArgumentParser()
    bench_trigger.add_workload_args(ap)
    ap.add_argument("--profiler", choices=("pyspy", "sampler"), help="default: py-spy if installed, else the sampler")
    ap.add_argument("--hz", type=int, default=200, help="samples per second")
    ap.add_argument("--top", type=int, default=15, help="functions listed per thread")
    ap.add_argument("--keep", help="keep py-spy's raw output here")
    a = ap.parse_args()
    w = Workload.even(a.jobs, a.over)
    spy = find_pyspy() if a.profiler != "sampler" else None
    if a.profiler == "pyspy" and spy is None:
        raise SystemExit("py-spy not found (see the module docstring)")
    print(f"{w.label()}, backend {a.backend}, BPF {'on' if a.bpf else 'off'}; profiler: {spy or 'bench/thread_sampler.py'}; "
          f"{load()}", flush=True)
    raw = a.keep or os.path.join(tempfile.mkdtemp(prefix="mw-pyspy-"), "stacks.txt")
    runner: list[threading.Thread] = []
    spy_cpu = [0.0]

    def record(at: float, duration: int) -> None:
        time.sleep(max(0.0, at - time.time()))
        p = subprocess.Popen([spy, "record", "-p", str(os.getpid()), "-r", str(a.hz), "-d", str(int(duration)),
                              "--nonblocking", "--threads", "-f", "raw", "-o", raw],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, status, ru = os.wait4(p.pid, 0)   # its own CPU: it is a child, counted with the job processes
        p.returncode = os.waitstatus_to_exitcode(status)
        spy_cpu[0] = ru.ru_utime + ru.ru_stime

    sampled: list[dict] = []
    done = threading.Event()

    def sample(at: float) -> None:
        from thread_sampler import Sampler

        time.sleep(max(0.0, at - time.time()))
        sampled.append(Sampler(tempfile.gettempdir(), 1.0 / a.hz).profile(done.is_set))

    def on_start(ts: float) -> None:
        if spy:
            # whole seconds (py-spy's -d), ending inside the CPU window: its own CPU is then
            # among the window's reaped children, where it is taken out again
            t = threading.Thread(target=record, args=(window_start(ts, a.lead), math.floor(w.span + 0.75)), name="py-spy",
                                 daemon=True)
        else:
            t = threading.Thread(target=sample, args=(window_start(ts, a.lead),), name="bench-sampler", daemon=True)
        t.start()
        runner.append(t)

    res = run_millwright(w, Options(backend=a.backend, lead=a.lead, bpf=a.bpf, user=a.user), on_start=on_start)
    done.set()
    for t in runner:
        t.join(60)
    n = res["cpu_firings"]
    print(summary("millwright job clock", list(res["lateness"].values())))
    print(f"after: {load()}")
    print(f"agent CPU per firing over {n} firings (window {res['cpu_window_s']:.1f} s):")
    for line in per_firing_table(res["cpu"], n, exclude=BENCH_THREADS + ("py-spy", "bench-sampler")):
        print(line)
    print(f"outside the agent: etcd {res['etcd_cpu_s'] * 1000 / max(n, 1):.3f} ms/firing, job processes "
          f"{(res['cpu']['children_s'] - spy_cpu[0]) * 1000 / max(n, 1):.3f}; py-spy itself "
          f"{spy_cpu[0] * 1000 / max(n, 1):.3f} (it takes CPU from the agent: the latencies of this run are not figures)")
    if spy and os.path.exists(raw):
        by = parse_raw(raw)
        how = f"py-spy at {a.hz} Hz, non-idle samples spread over the thread's CPU"
    elif sampled:
        by = from_sampler(sampled[0])
        how = f"thread_sampler at {a.hz} Hz, each thread's CPU clock (the weights below are CPU seconds)"
    else:
        return
    threads = res["cpu"]["threads"]
    overall: collections.Counter = collections.Counter()
    print(f"\nper thread, the functions of agent/ its CPU went to (ms per firing; {how}):")
    for thread, (u, s) in sorted(threads.items(), key=lambda kv: -sum(kv[1])):
        per = (u + s) * 1000 / max(n, 1)
        samples = by.get(thread.split(" of ")[0])   # profilers name a thread without where its target is from
        if per < 0.02 or not samples:
            continue
        total = sum(samples.values())
        print(f"  {thread}: {per:.3f} ms/firing ({total:.4g} {'samples' if spy else 'CPU s sampled'})")
        for (fn, lib), c in samples.most_common(a.top):
            print(f"    {per * c / total:7.3f}  {fn}  [{lib}]")
        for (fn, _lib), c in samples.items():
            overall[(thread, fn)] += per * c / total
    print("\noverall, largest first (thread, function of agent/: ms per firing):")
    for (thread, fn), v in overall.most_common(25):
        print(f"  {v:7.3f}  {thread}  {fn}")
    if a.keep:
        print(f"raw stacks kept in {raw}")


if __name__ == "__main__":
    main()
