#!/usr/bin/env python3
"""Idle cost of one agent: CPU % of a core, RSS/USS, threads, and what wakes it up.

One real agent (`millwright run`) with the cloud channel on (real etcd, real mosquitto),
default timings (lease TTL 10 s, keepalive every 1 s), no jobs, once with the BPF sensor
on and once off. After it owns every shard and has settled (BENCH_SETTLE_S, 15 s), it is
measured for BENCH_IDLE_S (60 s): CPU time from /proc (user+system, all threads) over
wall time, RSS and USS at the end (psutil), the thread count, and per thread the CPU
ticks and the voluntary context switches (each one a sleep that ended: a wake-up).
Thread names: the bench puts a sitecustomize on the agent's PYTHONPATH that lists the
agent's threads (native id, Python name) into a file every 5 s (its own thread is left out
of the figures; it adds 0.2 wake-ups/s). Each thread is listed as "Python name [comm]"
(threads of gRPC's C core have no Python name).

    /usr/bin/python3 bench/bench_idle.py            # BPF on, then off
    BENCH_ROUNDS=2 bench/bench_idle.py              # alternated on/off rounds (shared host)
    BENCH_NODE_ACTIVITY=0 bench/bench_idle.py       # bpf.node_activity off: host execs are no events
    BENCH_MODES=off bench/bench_idle.py             # only BPF off (or: on)
    BENCH_ALL_THREADS=0 bench/bench_idle.py         # list only the threads that woke up

The load average is printed with each figure: the host is shared. With BPF on and
``bpf.node_activity`` (the default), every exec on the host is an event for the agent,
so its "idle" CPU also follows what else runs on the machine: the host's fork rate over
the window is printed with each figure.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from agent.demo.services import EtcdServer, MosquittoServer  # noqa: E402
from tests.support.cluster import Cluster  # noqa: E402
from tests.support.waiting import wait_for  # noqa: E402

IDLE_S = float(os.environ.get("BENCH_IDLE_S", "60"))
SETTLE_S = float(os.environ.get("BENCH_SETTLE_S", "15"))
CLK = os.sysconf("SC_CLK_TCK")
NODE_ACTIVITY = os.environ.get("BENCH_NODE_ACTIVITY", "1") != "0"
ALL_THREADS = os.environ.get("BENCH_ALL_THREADS", "1") != "0"  # also list threads that never woke


def host_forks() -> int:
    """Processes created on the host since boot (/proc/stat)."""
    with open("/proc/stat") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("processes "))


def threads(pid: int) -> dict[int, tuple[str, int, int]]:
    """tid -> (comm, cpu ticks, voluntary context switches)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                st = fh.read()
            with open(f"/proc/{pid}/task/{tid}/status") as fh:
                vol = next(int(line.split()[1]) for line in fh if line.startswith("voluntary_ctxt_switches"))
        except (OSError, StopIteration):
            continue
        comm = st[st.index("(") + 1:st.rindex(")")]
        f = st[st.rindex(")") + 2:].split()
        out[int(tid)] = (comm, int(f[11]) + int(f[12]), vol)
    return out


NAMES_HOOK = """
import os, sys, threading, time
if b"\\0agent\\0run\\0" in open("/proc/self/cmdline", "rb").read():
    def _names(path=os.environ["MW_BENCH_THREAD_NAMES"]):
        while True:
            time.sleep(5)
            with open(path + ".tmp", "w") as fh:
                for t in threading.enumerate():
                    fh.write(f"{t.native_id} {t.name}\\n")
            os.replace(path + ".tmp", path)
    threading.Thread(target=_names, name="bench-thread-names", daemon=True).start()
"""


def measure(bpf: bool) -> dict:
    base = tempfile.mkdtemp(prefix="mw-bench-idle-")
    etcd = EtcdServer(os.path.join(base, "etcd"))
    mq = MosquittoServer(os.path.join(base, "mq"))
    for s in (etcd, mq):
        os.makedirs(s.dir, exist_ok=True)
        s.start()
    names_file = os.path.join(base, "threads.txt")
    hook = os.path.join(base, "hook")
    os.makedirs(hook)
    with open(os.path.join(hook, "sitecustomize.py"), "w") as fh:
        fh.write(NAMES_HOOK)
    cl = Cluster(etcd, os.path.join(base, "agents"), shards=64, ttl=10, renew_deadline=6, retry_period=1,
                 extra={"mqtt": {"url": mq.url}, "bpf": {"enabled": bpf, "node_activity": NODE_ACTIVITY}},
                 env={"MW_BENCH_THREAD_NAMES": names_file, "PYTHONPATH": hook + os.pathsep + ROOT})
    try:
        a = cl.start("a0")
        wait_for(lambda: cl.all_owned_by({"a0"}), 90, interval=0.2, what="the agent owns the shards")
        time.sleep(SETTLE_S)
        p = psutil.Process(a.proc.pid)
        load0 = os.getloadavg()[0]
        t0, c0, th0, f0 = time.monotonic(), p.cpu_times(), threads(p.pid), host_forks()
        time.sleep(IDLE_S)
        t1, c1, th1, f1 = time.monotonic(), p.cpu_times(), threads(p.pid), host_forks()
        mem = p.memory_full_info()
        names: dict[int, str] = {}
        try:
            with open(names_file) as fh:
                for line in fh:
                    tid, _, name = line.rstrip("\n").partition(" ")
                    names[int(tid)] = name
        except (OSError, ValueError):
            pass
        per = []
        for tid, (comm, ticks, vol) in th1.items():
            if names.get(tid) == "bench-thread-names":
                continue
            _, ticks0, vol0 = th0.get(tid, (comm, 0, 0))
            name = names.get(tid)
            per.append((ticks - ticks0, vol - vol0, f"{name} [{comm}]" if name else f"[{comm}]", tid))
        wall = t1 - t0
        cpu = (c1.user - c0.user) + (c1.system - c0.system)
        return {"bpf": bpf, "cpu_pct": 100 * cpu / wall, "rss_mib": mem.rss / 2 ** 20, "uss_mib": mem.uss / 2 ** 20,
                "threads": p.num_threads() - ("bench-thread-names" in names.values()), "wakeups_per_s": sum(v for _, v, _, _ in per) / wall,
                "per": sorted(per, reverse=True), "wall": wall, "forks_per_s": (f1 - f0) / wall, "load": (load0, os.getloadavg()[0])}
    finally:
        cl.close()
        mq.close()
        etcd.close()
        shutil.rmtree(base, ignore_errors=True)


def report(r: dict) -> None:
    print(f"BPF {'on ' if r['bpf'] else 'off'}: CPU {r['cpu_pct']:.2f}% of a core over {r['wall']:.0f} s, "
          f"RSS {r['rss_mib']:.1f} MiB, USS {r['uss_mib']:.1f} MiB, {r['threads']} threads, "
          f"{r['wakeups_per_s']:.0f} wake-ups/s; host forks {r['forks_per_s']:.0f}/s "
          f"(load {r['load'][0]:.2f} -> {r['load'][1]:.2f})", flush=True)
    print(f"    {'cpu ms':>7} {'wake/s':>7}  thread")
    for ticks, vol, name, tid in sorted(r["per"], key=lambda x: (x[0], x[1]), reverse=True):
        if ticks or vol or ALL_THREADS:
            print(f"    {ticks * 1000 / CLK:7.0f} {vol / r['wall']:7.1f}  {name} ({tid})")


def main() -> int:
    rounds = int(os.environ.get("BENCH_ROUNDS", "1"))
    modes = {"on": (True,), "off": (False,)}.get(os.environ.get("BENCH_MODES", ""), (True, False))
    print(f"idle benchmark: one agent, cloud on, no jobs, {IDLE_S:g} s after {SETTLE_S:g} s settling; "
          f"bpf.node_activity {'on' if NODE_ACTIVITY else 'off'}; cpus={os.cpu_count()} "
          f"load={os.getloadavg()[0]:.2f}", flush=True)
    for _ in range(rounds):
        for bpf in modes:
            report(measure(bpf))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
