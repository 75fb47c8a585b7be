#!/usr/bin/env python3
"""Trigger delay: the job's process started minus its due time (issue 3).

Ours: one agent in this process, a real etcd, N one-shot jobs due over D seconds; each
firing creates its fenced run record in etcd *before* the process is released, so the
delay includes the etcd claim (durable, exactly-once). The claim and the spawn happen
execute.claim_lead_s ahead (default 0.25 s); measured is the release: the launcher's go
byte written at the due time, after which the job execs (--lead 0: claim and spawn at the
due time, measured when Executor.start() returned). Peer: APScheduler (in memory, no persistence) with the
same schedule, spawning the same program with subprocess.Popen, measured when Popen
returned. Both run in this script, one after the other, and print p50/p99/max and the
ratio. Also prints run-record writes per second.

Usage: bench_trigger.py [--jobs 10000] [--over 60] [--backend auto|cgroup1|rlimit] [--lead 0.25] [--skip-peer]
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
from datetime import datetime, timedelta, timezone

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent.config import parse_config  # noqa: E402
from agent.coordination.jobstore import JobStore  # noqa: E402
from agent.demo.services import EtcdServer  # noqa: E402
from agent.jobs.schedule import format_rfc3339  # noqa: E402


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def summary(name, xs):
    ms = [x * 1000 for x in xs]
    return (f"{name:<28} n={len(xs):6d}  p50 {pct(ms, 50):8.2f} ms  p99 {pct(ms, 99):8.2f} ms  "
            f"max {max(ms):8.2f} ms  mean {statistics.mean(ms):8.2f} ms")


def ours(n: int, over: float, backend: str, lead: float) -> list[float]:
    from agent.runtime.components import _JobsComponent
    from agent.runtime.daemon import Agent

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
execute: {{max_concurrent: 256, memory_mb: 65536, cpu: 256, quota_backend: {backend}, claim_lead_s: {lead}}}
templates:
  noop: {{argv: ["/bin/true"], user: root}}
""", "bench")
    agent = Agent(cfg, [_JobsComponent])
    delays: list[float] = []

    class Probe:
        """The release time (the launcher's go byte written; start() returned when not
        prepared ahead), read when the run ends."""

        def run_started(self, f):
            pass

        def run_ended(self, f):
            if f.attempt == 1 and f.handle is not None and f.handle.started_at:
                delays.append(f.handle.started_at - f.due.timestamp())

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
    from agent.jobs.scheduler import FIRINGS

    if lead > 0:
        from agent.jobs.claimlead import LEAD

        print(f"claim lead at the end: {LEAD._value.get() * 1000:.0f} ms (adaptive, at most {lead * 1000:.0f} ms)")
        late = FIRINGS.labels("claimed_late")._value.get()
        print(f"claimed and prepared ahead of the due time: {n - late:.0f} of {n}; claimed late "
              f"(spawned on the due time's path): {late:.0f}")
    agent.request_stop()
    t.join(30)
    etcd.close()
    shutil.rmtree(tmp, ignore_errors=True)
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
    ap.add_argument("--lead", type=float, default=0.25, help="execute.claim_lead_s")
    ap.add_argument("--skip-peer", action="store_true")
    a = ap.parse_args()
    mine = ours(a.jobs, a.over, a.backend, a.lead)
    print(summary(f"millwright ({a.backend}, lead {a.lead:g} s)", mine), flush=True)
    if not a.skip_peer:
        theirs = peer(a.jobs, a.over)
        print(summary("apscheduler (memory)", theirs))
        print(f"ratio p50 {pct(mine, 50) / pct(theirs, 50):.2f}x, p99 {pct(mine, 99) / pct(theirs, 99):.2f}x "
              f"(millwright / apscheduler)")


if __name__ == "__main__":
    main()
