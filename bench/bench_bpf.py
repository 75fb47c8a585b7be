#!/usr/bin/env python3
"""Sensor costs, printed as comparable figures (no assertions).

1. Exec storm: N runs of /bin/true from one shell loop, wall time
   - with no tracing,
   - with our program loaded (node_activity on: every exec becomes an event),
   - with a peer BPF tracer from the distribution on the same tracepoint
     (bpfcc-tools' trace-bpfcc on syscalls:sys_enter_execve; execsnoop-bpfcc needs
     kprobes, which this kernel lacks).
2. Agent process: RSS and start-up time with the sensor loaded vs without, after
   importing what the agent imports (etcd3, paho, psutil, prometheus_client), plus the
   loader's peak RSS and, for reference, BCC loaded in-process.

Usage: bench_bpf.py [--execs N]   (root; default N=20000, MW_BENCH_EXECS overrides)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PY = "/usr/bin/python3"


def storm(n: int) -> tuple[float, float]:
    """(wall s, CPU s of the storm's processes: the shell and every /bin/true, user+sys).
    Tracepoint programs run in the exec'ing task's context, so their cost lands in the
    storm's system time: CPU time is the comparator that survives a shared, loaded host."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.monotonic()
    subprocess.run(["/bin/sh", "-c", f"i=0; while [ $i -lt {n} ]; do /bin/true; i=$((i+1)); done"], check=True)
    wall = time.monotonic() - t
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def with_sensor(n: int) -> tuple[float, float, dict]:
    import queue
    import threading

    from agent.signals import Sensor

    q: "queue.SimpleQueue" = queue.SimpleQueue()
    stats = {"exec": 0}

    def consume():
        while True:
            fn, args = q.get()
            if fn is None:
                return
            fn(*args)

    th = threading.Thread(target=consume, daemon=True)
    th.start()
    s = Sensor(lambda fn, *a: q.put((fn, a)), on_exec=lambda e: stats.__setitem__("exec", stats["exec"] + 1))
    s.start()
    if not s.is_bpf:
        raise SystemExit(f"sensor not loaded: {s.mode}")
    try:
        time.sleep(0.5)
        c0 = _self_cpu()
        wall, cpu = storm(n)
        time.sleep(1.0)
        stats["agent_cpu_s"] = _self_cpu() - c0
    finally:
        s.stop()
        q.put((None, ()))
    stats["lost"] = s.lost_events
    return wall, cpu, stats


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def with_peer(n: int) -> tuple[float, float, dict]:
    tool = "/usr/sbin/trace-bpfcc"
    if not os.path.exists(tool):
        return float("nan"), float("nan"), {"what": "trace-bpfcc not installed"}
    p = subprocess.Popen([tool, "t:syscalls:sys_enter_execve"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    p.stdout.readline()  # its header: attached
    drain = subprocess.Popen(["cat"], stdin=p.stdout, stdout=subprocess.DEVNULL)
    try:
        c0 = _proc_cpu(p.pid)
        wall, cpu = storm(n)
        time.sleep(1.0)
        tracer_cpu = _proc_cpu(p.pid) - c0
    finally:
        p.terminate()
        p.wait(timeout=10)
        drain.wait(timeout=10)
    return wall, cpu, {"tracer_cpu_s": tracer_cpu}


AGENT_PROBE = r"""
import json, os, sys, time
sys.path.insert(0, %(root)r)
import etcd3, paho.mqtt.client, psutil, prometheus_client  # what the agent imports anyway
import agent.config, agent.runtime.loop, agent.runtime.metrics
def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
out = {"rss_base_mb": rss()}
mode = sys.argv[1]
t = time.monotonic()
if mode == "sensor":
    from agent.signals import Sensor
    events = []
    s = Sensor(lambda fn, *a: fn(*a), on_exec=lambda e: events.append(1))
    out["mode"] = s.start()
    out["start_s"] = round(time.monotonic() - t, 3)
    out["loader_maxrss_mb"] = s.info.get("loader_maxrss_kb", 0) // 1024
    out["compile_s"] = s.info.get("compile_s")
    out["rss_after_start_mb"] = rss()
    s.track(os.getpid(), 1)
    for _ in range(200):   # some load: execs become events, sampling runs
        os.spawnv(os.P_WAIT, "/bin/true", ["/bin/true", "x"])
    time.sleep(3)
    out["events"] = len(events)
    out["rss_steady_mb"] = rss()
    s.stop()
elif mode == "inprocess":
    from bcc import BPF
    out["rss_after_import_bcc_mb"] = rss()
    from agent.signals import abi, check
    b = BPF(src_file=abi.SOURCE.encode(), cflags=check.compile_flags(check.find_tracefs()) + ["-Wno-macro-redefined"])
    out["start_s"] = round(time.monotonic() - t, 3)
    out["rss_steady_mb"] = rss()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        out["rss_after_malloc_trim_mb"] = rss()
    except OSError:
        pass
else:
    out["rss_steady_mb"] = rss()
print(json.dumps(out))
"""


def agent_probe(mode: str) -> dict:
    r = subprocess.run([PY, "-c", AGENT_PROBE % {"root": ROOT}, mode], capture_output=True, text=True, timeout=180)
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-1:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--execs", type=int, default=int(os.environ.get("MW_BENCH_EXECS", "20000")))
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench_bpf needs root")
    n = a.execs
    half = n // 2
    print(f"exec storm: N={2 * half} runs of /bin/true from one /bin/sh loop, in two interleaved passes of "
          f"{half} (none, ours, peer, none, ours, peer); {os.cpu_count()} CPUs, kernel {os.uname().release}, "
          f"load average {os.getloadavg()[0]:.1f}")
    storm(min(500, half))  # warm-up (page cache, dentries), not counted
    tot = {k: [0.0, 0.0] for k in ("none", "ours", "peer")}
    extra = {"events": 0, "lost": 0, "agent_cpu_s": 0.0, "tracer_cpu_s": 0.0}
    for _ in range(2):
        for k in ("none", "ours", "peer"):
            if k == "none":
                w, c = storm(half)
            elif k == "ours":
                w, c, st = with_sensor(half)
                extra["events"] += st["exec"]
                extra["lost"] += st["lost"]
                extra["agent_cpu_s"] += st["agent_cpu_s"]
            else:
                w, c, st = with_peer(half)
                extra["tracer_cpu_s"] += st.get("tracer_cpu_s", float("nan"))
            tot[k][0] += w
            tot[k][1] += c
    (bw, bc) = tot["none"]
    n2 = 2 * half
    for k, label in (("none", "no tracing"), ("ours", "millwright sensor"),
                     ("peer", "peer: trace-bpfcc")):
        w, c = tot[k]
        print(f"  {label:18s}: wall {w:7.2f} s ({n2 / w:6.0f} exec/s, x{w / bw:.2f})   "
              f"storm CPU {c:7.2f} s ({1e6 * c / n2:5.0f} us/exec, x{c / bc:.2f})")
    print(f"  ours: {extra['events']} exec events delivered (node activity on), {extra['lost']} lost, "
          f"agent-side CPU {extra['agent_cpu_s']:.2f} s ({1e6 * extra['agent_cpu_s'] / n2:.0f} us/exec)")
    print(f"  peer: trace-bpfcc t:syscalls:sys_enter_execve (BCC, one perf event per exec; execsnoop-bpfcc "
          f"needs kprobes, absent here); tracer CPU {extra['tracer_cpu_s']:.2f} s")
    print()
    print("agent process (python3 + etcd3, paho, psutil, prometheus_client, agent core):")
    for mode in ("none", "sensor", "inprocess"):
        print(f"  {mode:10s}", json.dumps(agent_probe(mode)))


if __name__ == "__main__":
    main()
