#!/usr/bin/env python3
"""Trigger delay: the job's process started minus its due time (issue 3).

Ours: one agent in this process, a real etcd, N one-shot jobs due over D seconds; each
firing creates its fenced run record in etcd *before* the process is released, so the
delay includes the etcd claim (durable, exactly-once). Measured when Executor.start()
returned (the job has exec'd). Peer: APScheduler (in memory, no persistence) with the
same schedule, spawning the same program with subprocess.Popen, measured when Popen
returned. Both run in this script, one after the other, and print p50/p99/max and the
ratio. Also prints run-record writes per second.

Usage: bench_trigger.py [--jobs 10000] [--over 60] [--backend auto|cgroup1|rlimit] [--skip-peer]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timedelta, timezone

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent.config import parse_config  # noqa: E402
from agent.coordination.jobstore import JobStore  # noqa: E402
from agent.devservices import EtcdServer  # noqa: E402
from agent.schedule import format_rfc3339  # noqa: E402


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def summary(name, xs):
    ms = [x * 1000 for x in xs]
    return (f"{name:<28} n={len(xs):6d}  p50 {pct(ms, 50):8.2f} ms  p99 {pct(ms, 99):8.2f} ms  "
            f"max {max(ms):8.2f} ms  mean {statistics.mean(ms):8.2f} ms")


def ours(n: int, over: float, backend: str) -> list[float]:
    from agent.components import _JobsComponent
    from agent.daemon import Agent

    tmp = tempfile.mkdtemp(prefix="mw-bench-")
    etcd = EtcdServer(os.path.join(tmp, "etcd")).start()
    cfg = parse_config(f"""
cluster: bench
agent_id: bench-0
shards: 64
state_dir: {tmp}/state
etcd: {{endpoints: ["{etcd.endpoint}"], lease_ttl_s: 10, renew_deadline_s: 6, retry_period_s: 1}}
audit: {{dir: {tmp}/audit, key_file: {tmp}/audit.key}}
admin: {{socket: {tmp}/admin.sock}}
metrics: {{listen: ""}}
bpf: {{enabled: false}}
execute: {{max_concurrent: 256, memory_mb: 65536, cpu: 256, quota_backend: {backend}}}
templates:
  noop: {{argv: ["/bin/true"], user: root}}
""", "bench")
    agent = Agent(cfg, [_JobsComponent])
    delays: list[float] = []

    class Probe:
        def run_started(self, f):
            delays.append(time.time() - f.due.timestamp())

        def run_ended(self, f):
            pass

    agent.scheduler.run_listeners.append(Probe())
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    while len(agent.shards.mine) < 64:
        time.sleep(0.05)
    store = JobStore(agent.client, agent.keys, 64, "bench")
    t_create = time.monotonic()
    start = datetime.now(timezone.utc) + timedelta(seconds=5 + n * 0.004)
    for i in range(n):
        due = start + timedelta(seconds=over * i / n)
        store.create({"v": 1, "id": f"b{i:06d}", "template": "noop", "params": {},
                      "schedule": {"at": format_rfc3339(due)}})
    create_s = time.monotonic() - t_create
    print(f"created {n} jobs in {create_s:.1f} s ({n / create_s:.0f} job-store writes/s)", flush=True)
    end = start + timedelta(seconds=over + 10)
    while datetime.now(timezone.utc) < end and len(delays) < n:
        time.sleep(0.5)
    t_done = time.monotonic()
    while len(delays) < n and time.monotonic() - t_done < 30:
        time.sleep(0.5)
    # run-record writes: every run writes its record twice (running, then final)
    kvs, _ = agent.client.get_prefix(agent.keys.runs_prefix(), keys_only=True)
    print(f"run records: {len(kvs)} ({2 * len(kvs) / over:.0f} fenced run-record writes/s sustained over {over:.0f} s)")
    agent.request_stop()
    t.join(30)
    etcd.close()
    return delays


def peer(n: int, over: float) -> list[float]:
    from apscheduler.schedulers.background import BackgroundScheduler

    delays: list[float] = []
    procs = []
    lock = threading.Lock()

    def fire(due_ts):
        p = subprocess.Popen(["/bin/true"])
        d = time.time() - due_ts
        with lock:
            delays.append(d)
            procs.append(p)

    sched = BackgroundScheduler(job_defaults={"misfire_grace_time": None, "coalesce": False},
                                executors={"default": {"type": "threadpool", "max_workers": 20}})
    sched.start()
    start = datetime.now(timezone.utc) + timedelta(seconds=5 + n * 0.0005)
    for i in range(n):
        due = start + timedelta(seconds=over * i / n)
        sched.add_job(fire, "date", run_date=due, args=[due.timestamp()])

    def reap():
        while True:
            with lock:
                ps, procs[:] = list(procs), []
            for p in ps:
                p.wait()
            if len(delays) >= n:
                return
            time.sleep(0.2)

    r = threading.Thread(target=reap, daemon=True)
    r.start()
    end = start + timedelta(seconds=over + 10)
    while datetime.now(timezone.utc) < end and len(delays) < n:
        time.sleep(0.5)
    sched.shutdown(wait=True)
    return delays


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=10000)
    ap.add_argument("--over", type=float, default=60.0)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--skip-peer", action="store_true")
    a = ap.parse_args()
    mine = ours(a.jobs, a.over, a.backend)
    print(summary(f"millwright ({a.backend})", mine), flush=True)
    if not a.skip_peer:
        theirs = peer(a.jobs, a.over)
        print(summary("apscheduler (memory)", theirs))
        print(f"ratio p50 {pct(mine, 50) / pct(theirs, 50):.2f}x, p99 {pct(mine, 99) / pct(theirs, 99):.2f}x "
              f"(millwright / apscheduler)")


if __name__ == "__main__":
    main()
