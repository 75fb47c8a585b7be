#!/usr/bin/env python3
"""Trigger delay at the job's own clock: when the job's first command ran minus its due
time (issues 3 and 18).

The job body is one small shell script, identical for both schedulers: it execs
``date +%s.%N`` appending its own clock (and the job id) to one file. Delay = that clock
minus the due time, so it includes everything between the scheduler's decision and the
job running: release, launcher, user switch, exec, the shell's own start.

Ours: one agent in this process with the daemon's job path (audit log, scheduler,
executor, sensing and supervision; not the cloud channel), a real etcd, N one-shot jobs
due over D seconds; each firing creates its fenced run record in etcd *before* its
process can exec (durable, exactly-once). The claim and the spawn happen up to
execute.claim_lead_s ahead; the launcher then waits for its due time
(agent/execute/launch.py). Also printed, as a diagnostic: the release time the executor
reports (handle.started_at, the old "go byte" figure). With --bpf, a second witness: the
sensor's sched_process_exec timestamp of the job's argv[0] (its script), from the audit
log's `exec` records; BPF off, sensing polls /proc like the daemon does. Peer:
APScheduler 3.9 (in memory, no persistence, thread pool) with the same schedule, starting
the same script with subprocess.Popen. Both run from this script, with the load average
before and after; printed are p50/p99/max and the ratios. By default APScheduler runs at
the same time, in its own process, its due times halfway between ours: both see the same
machine load (this VM is shared); --sequential runs it afterwards instead. Also prints
run-record writes per second.

Usage: bench_trigger.py [--jobs 3000] [--over 30] [--backend auto|cgroup1|rlimit] [--lead 0.25] [--bpf] [--user root] [--slim] [--skip-peer | --sequential]
Prerequisite: APScheduler 3.x for the peer (Debian: python3-apscheduler; scripts/setup-host.sh).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent.config import parse_config  # noqa: E402
from agent.coordination.jobstore import JobStore  # noqa: E402
from agent.demo.services import EtcdServer  # noqa: E402
from agent.jobs.schedule import format_rfc3339, parse_rfc3339  # noqa: E402


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def summary(name, xs):
    ms = [x * 1000 for x in xs]
    return (f"{name:<28} n={len(xs):6d}  p50 {pct(ms, 50):8.2f} ms  p99 {pct(ms, 99):8.2f} ms  "
            f"max {max(ms):8.2f} ms  mean {statistics.mean(ms):8.2f} ms")


JOB_SH = """#!/bin/sh
exec /bin/date "+$MILLWRIGHT_JOB_ID %s.%N" >>{out}
"""


def job_script(tmp: str) -> tuple[str, str]:
    """The job body both schedulers run, and the file it appends its clock to."""
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


def job_clock_by_id(out: str, due: dict[str, float]) -> dict[str, float]:
    """Delay per job id: its own clock minus its due time (first line per job id)."""
    seen: dict[str, float] = {}
    try:
        with open(out) as fh:
            for line in fh:
                jid, _, ts = line.strip().partition(" ")
                if jid in due and jid not in seen:
                    seen[jid] = float(ts) - due[jid]
    except FileNotFoundError:
        pass
    return seen


def job_clocks(out: str, due: dict[str, float]) -> list[float]:
    return list(job_clock_by_id(out, due).values())


def sensor_witness(audit_dir: str, script: str, due: dict[str, float]) -> tuple[dict[str, float], int, list[int]]:
    """With BPF on, a second witness of each job's start: the sensor's sched_process_exec
    timestamp of the job's argv[0] (the audit log's `exec` record of the job's own script,
    field exec_ts), minus the due time. First exec per job id. Also: how many of the jobs'
    exec records reached the agent after their run had ended (after_run_ended), and how
    many of its `date` execs were recorded under another job or none (the job body puts its
    own job id in date's argv)."""
    from agent.audit.show import Filter, records

    seen: dict[str, float] = {}
    after_end = 0
    wrong = [0, 0]   # date execs recorded under no job, under another job
    for _, rec in records(audit_dir, Filter(types={"exec"})):
        jid = rec.get("job")
        after_end += jid in due and rec.get("after_run_ended") is True
        argv = rec.get("argv") or []
        if rec.get("filename", "").endswith("/date") and len(argv) > 1 and argv[1].startswith("+b"):
            named = argv[1][1:].split(" ")[0]           # the job body names its job in date's argv
            if named != jid:
                wrong[0 if jid is None else 1] += 1
        if jid in due and jid not in seen and rec.get("filename") == script and "exec_ts" in rec:
            seen[jid] = float(rec["exec_ts"]) - due[jid]
    return seen, after_end, wrong


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


class CgroupTrace:
    """--trace-cgroup: times every cgroup file operation of the agent (CgroupFS, patched in
    this process) and tells whether the late jobs coincide with them."""

    OPS = ("read", "write", "mkdir", "rmdir")

    def __init__(self) -> None:
        from agent.execute.backends import CgroupFS

        self.ops: list[tuple[float, float, str]] = []
        for op in self.OPS:
            setattr(CgroupFS, op, self._wrap(getattr(CgroupFS, op), op))

    def _wrap(self, fn, op):
        ops = self.ops

        def timed(fs, path, *args):
            t0 = time.time()
            try:
                return fn(fs, path, *args)
            finally:
                kind = os.path.basename(path) if op in ("read", "write") else path.split("/")[4]
                ops.append((t0, time.time(), f"{op} {kind} [{threading.current_thread().name}]"))
        return timed

    def report(self, jobs: list[tuple[float, float]]) -> None:
        by: dict[str, list[float]] = {}
        for t0, t1, what in self.ops:
            by.setdefault(what, []).append(t1 - t0)
        print("cgroup operations (duration):")
        for what, xs in sorted(by.items(), key=lambda kv: -sum(kv[1])):
            print("  " + summary(what[:60], xs))
        if not jobs:
            return
        ds = sorted(d for _, d in jobs)
        cut = ds[int(len(ds) * 0.99)]
        starts = sorted(self.ops)
        begins = [op[0] for op in starts]

        def busy(due: float, delay: float) -> tuple[float, dict[str, int]]:
            lo, hi = due - 0.002, due + max(delay, 0.0)
            total, kinds = 0.0, {}
            for t0, t1, what in starts[bisect.bisect_left(begins, lo - 0.1):]:
                if t0 > hi:
                    break
                if t1 >= lo:
                    total += min(t1, hi) - max(t0, lo)
                    k = what.split(" [")[0]
                    kinds[k] = kinds.get(k, 0) + 1
            return total, kinds

        for label, sel in (("late (>= p99)", [j for j in jobs if j[1] >= cut]),
                           ("typical (p40-p60)", [j for j in jobs if ds[int(len(ds) * .4)] <= j[1] <= ds[int(len(ds) * .6)]][:200])):
            agg: dict[str, int] = {}
            tot = []
            for due, d in sel:
                t, kinds = busy(due, d)
                tot.append(t / max(d + 0.002, 1e-6))
                for k, v in kinds.items():
                    agg[k] = agg.get(k, 0) + v
            top = sorted(agg.items(), key=lambda kv: -kv[1])[:6]
            print(f"  {label}: n={len(sel)} share of [due-2ms, job clock] with a cgroup op in flight: "
                  f"mean {statistics.mean(tot) * 100:.1f}%; ops per job: "
                  + ", ".join(f"{k} {v / max(1, len(sel)):.2f}" for k, v in top))


def ours(n: int, over: float, backend: str, lead: float,
         with_peer: bool = False, bpf: bool = False, slim: bool = False,
         trace: Optional[CgroupTrace] = None, user: str = "root"
         ) -> tuple[list[float], list[float], Optional[subprocess.Popen], Optional[tuple[list[float], list[float], int, list[int]]]]:
    from agent.runtime.components import _AuditComponent, _JobsComponent, _SupervisedJobs
    from agent.runtime.daemon import Agent

    tmp = tempfile.mkdtemp(prefix="mw-bench-")
    script, out = job_script(tmp)
    etcd = EtcdServer(os.path.join(tmp, "etcd")).start()
    from tests.support.cloudkit import SigningStore, write_keys

    ring = write_keys(f"{tmp}/keys.yaml")
    cfg = parse_config(f"""
cluster: bench
signing: {{keys_file: {tmp}/keys.yaml}}
agent_id: bench-0
shards: 64
state_dir: {tmp}/state
etcd: {{endpoints: ["{etcd.endpoint}"], lease_ttl_s: 10, renew_deadline_s: 6, retry_period_s: 1, insecure: true}}
audit: {{dir: {tmp}/audit, key_file: {tmp}/audit.key}}
admin: {{socket: {tmp}/admin.sock}}
metrics: {{listen: ""}}
bpf: {{enabled: {"true" if bpf else "false"}, mode: monitor}}
execute: {{max_concurrent: 256, memory_mb: 65536, cpu: 256, quota_backend: {backend}, claim_lead_s: {lead}}}
templates:
  clock: {{argv: ["{script}"], user: {user}, allow_root: true, allow_exec: ["/bin/*", "/usr/bin/*"]}}
""", "bench")
    delays: list[float] = []
    failed: list[str] = []

    class Probe:
        """The release time (the launcher's go byte written; start() returned when not
        prepared ahead), read when the run ends."""

        def run_started(self, f):
            pass

        def run_ended(self, f):
            if f.attempt == 1 and f.handle is not None and f.handle.started_at:
                delays.append(f.handle.started_at - f.due.timestamp())
            res = getattr(f.handle, "result", None)
            if res is not None and res.reason != "succeeded":
                failed.append(f"{f.entry.job.id}: {res.reason} exit {res.exit_code} signal {res.signal} {res.error or ''}")

    def supervised_jobs(a):
        """The daemon's job path: scheduler, executor, sensing (BPF, or /proc polling
        when BPF is off) and supervision, with the probe as one more run listener."""
        c = _SupervisedJobs(a)
        c.jobs.scheduler.run_listeners.append(Probe())
        return c

    parts = ([lambda a: _JobsComponent(a, run_listeners=[Probe()])] if slim
             else [_AuditComponent, supervised_jobs])
    agent = Agent(cfg, parts)
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    while len(agent.shards.mine) < 64:
        time.sleep(0.05)
    store = SigningStore(JobStore(agent.client, agent.keys, 64, "bench"), ring, "bench")  # agents run only signed jobs
    t_create = time.monotonic()
    start = datetime.now(timezone.utc) + timedelta(seconds=5 + n * 0.004)
    peer_proc = None
    if with_peer:
        # APScheduler in its own process, its due times halfway between ours: the same
        # machine load, at the same moments, for both
        peer_start = start.timestamp() + over / n / 2
        peer_proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--peer-child", "--user", user,
                                      "--jobs", str(n), "--over", str(over), "--start-ts", repr(peer_start)],
                                     stdout=subprocess.PIPE, text=True)
    dues: dict[str, float] = {}
    for i in range(n):
        due = start + timedelta(seconds=over * i / n)
        due = parse_rfc3339(format_rfc3339(due))  # as stored
        dues[f"b{i:06d}"] = due.timestamp()
        store.create({"v": 1, "id": f"b{i:06d}", "template": "clock", "params": {},
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
    from agent.jobs.metrics import FIRINGS

    if lead > 0:
        from agent.jobs.claimlead import LEAD

        print(f"claim lead at the end: {LEAD._value.get() * 1000:.0f} ms (adaptive, at most {lead * 1000:.0f} ms)")
        late = FIRINGS.labels("claimed_late")._value.get()
        print(f"claimed and prepared ahead of the due time: {n - late:.0f} of {n}; claimed late "
              f"(spawned on the due time's path): {late:.0f}")
    agent.request_stop()
    t.join(30)
    etcd.close()
    own = job_clock_by_id(out, dues)     # read once: the headline, the witness and the trace
    clocks = list(own.values())
    witness = None
    if bpf and not slim:
        seen, after_end, wrong = sensor_witness(f"{tmp}/audit", script, dues)
        # job clock minus the kernel's exec of its script: the shell's start and its exec of date
        witness = (list(seen.values()), [own[j] - seen[j] for j in seen if j in own], after_end, wrong)
    if trace is not None:
        trace.report([(dues[j], d) for j, d in own.items()])
    if failed:
        print(f"runs that did not succeed: {len(failed)}: {failed[:5]}")
    shutil.rmtree(tmp, ignore_errors=True)
    return clocks, delays, peer_proc, witness


def peer(n: int, over: float, start_ts: Optional[float] = None, user: str = "root") -> tuple[list[float], list[float]]:
    import pwd

    from apscheduler.schedulers.background import BackgroundScheduler

    # the job runs as `user`, switched the way a Python scheduler does it (subprocess's
    # user/group/extra_groups: a fork instead of its vfork), unless this process is that user
    pw = pwd.getpwnam(user)
    switch: dict = {}
    if (pw.pw_uid, pw.pw_gid) != (os.geteuid(), os.getegid()):
        switch = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": os.getgrouplist(user, pw.pw_gid)}
    delays: list[float] = []
    procs = []
    lock = threading.Lock()
    tmp = tempfile.mkdtemp(prefix="mw-bench-peer-")
    script, out = job_script(tmp)
    dues: dict[str, float] = {}

    def fire(jid, due_ts):
        p = subprocess.Popen([script], env={"PATH": "/usr/bin:/bin", "MILLWRIGHT_JOB_ID": jid},
                             stdin=subprocess.DEVNULL, close_fds=True, **switch)
        d = time.time() - due_ts
        with lock:
            delays.append(d)
            procs.append(p)

    sched = BackgroundScheduler(job_defaults={"misfire_grace_time": None, "coalesce": False},
                                executors={"default": {"type": "threadpool", "max_workers": 20}})
    sched.start()
    start = datetime.now(timezone.utc) + timedelta(seconds=5 + n * 0.0005)
    if start_ts is not None:
        start = datetime.fromtimestamp(start_ts, timezone.utc)
    for i in range(n):
        due = start + timedelta(seconds=over * i / n)
        dues[f"p{i:06d}"] = due.timestamp()
        sched.add_job(fire, "date", run_date=due, args=[f"p{i:06d}", due.timestamp()])

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
    r.join(10)
    clocks = job_clocks(out, dues)
    shutil.rmtree(tmp, ignore_errors=True)
    return clocks, delays


def report_peer(theirs: list[float], popen: list[float], n: int) -> None:
    print(summary("apscheduler (memory) job clock", theirs))
    print(summary("  diagnostic: Popen returned", popen))
    if len(theirs) < n:
        print(f"  MISSING: {n - len(theirs)} jobs did not record their clock")


def add_workload_args(ap: argparse.ArgumentParser, backend: str = "auto") -> None:
    """The options of ours()'s workload (also bench/profile_firing_stages.py's)."""
    ap.add_argument("--jobs", type=int, default=3000)
    ap.add_argument("--over", type=float, default=30.0)
    ap.add_argument("--backend", default=backend)
    ap.add_argument("--lead", type=float, default=0.25, help="execute.claim_lead_s")
    ap.add_argument("--bpf", action="store_true", help="the agent's BPF sensor on (exec policy in monitor mode)")
    ap.add_argument("--user", default="root", help="the job's user, for both schedulers (e.g. nobody: a user switch per job)")


def main() -> None:
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--sequential", action="store_true",
                    help="run APScheduler after Millwright instead of at the same time (interleaved due times)")
    ap.add_argument("--trace-cgroup", action="store_true",
                    help="time the agent's cgroup operations and relate the late jobs to them (profile)")
    ap.add_argument("--slim", action="store_true",
                    help="diagnostic: the scheduler and executor only (no audit log, no sensing or supervision; "
                         "the agent these figures were taken with before 2026-12-04, where --bpf loaded nothing)")
    ap.add_argument("--peer-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--start-ts", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.peer_child:
        clocks, popen = peer(a.jobs, a.over, a.start_ts, a.user)
        print(json.dumps({"clocks": clocks, "popen": popen}))
        return
    together = not a.skip_peer and not a.sequential
    print(f"{a.jobs} one-shot jobs over {a.over:g} s, BPF {'on' if a.bpf else 'off'}, run as {a.user}, "
          f"agent: {'scheduler and executor only (--slim)' if a.slim else 'audit, jobs, sensing, supervision'}, job body: sh exec date +%s.%N >> file; "
          f"APScheduler {'at the same time, due times interleaved' if together else 'after'}", flush=True)
    print(f"before: {load()}", flush=True)
    mine, go_byte, child, witness = ours(a.jobs, a.over, a.backend, a.lead, with_peer=together, bpf=a.bpf,
                                         slim=a.slim, trace=CgroupTrace() if a.trace_cgroup else None, user=a.user)
    print(f"after millwright:  {load()}", flush=True)
    name = f"millwright ({a.backend}, lead {a.lead:g} s)"
    print(summary(name + " job clock", mine), flush=True)
    print(summary("  diagnostic: release time", go_byte) + "  (handle.started_at, the old go-byte figure)", flush=True)
    if len(mine) < a.jobs:
        print(f"  MISSING: {a.jobs - len(mine)} jobs did not record their clock")
    if witness is not None:
        execs, gaps, after_end, wrong = witness
        print(f"  jobs' exec records that reached the agent after their run ended: {after_end} "
              f"(audit after_run_ended); date execs recorded under no job: {wrong[0]}, under another job: {wrong[1]}")
        if execs:
            print(summary("  witness: sensor exec of argv[0]", execs) + "  (BPF sched_process_exec, audit exec_ts)")
            print(summary("  job clock - sensor exec", gaps) + "  (the script's shell start and its exec of date)")
        if len(execs) < a.jobs:
            print(f"  the sensor's exec of argv[0] was in the audit log for {len(execs)} of {a.jobs} jobs")
    if a.skip_peer:
        return
    if child is not None:
        got = json.loads(child.communicate()[0].strip().splitlines()[-1])
        theirs, popen = got["clocks"], got["popen"]
    else:
        time.sleep(5)
        print(f"before apscheduler: {load()}", flush=True)
        theirs, popen = peer(a.jobs, a.over, user=a.user)
        print(f"after apscheduler:  {load()}", flush=True)
    report_peer(theirs, popen, a.jobs)
    print(f"ratio at the job's clock (millwright / apscheduler): p50 {pct(mine, 50) / pct(theirs, 50):.2f}x, "
          f"p99 {pct(mine, 99) / pct(theirs, 99):.2f}x, max {max(mine) / max(theirs):.2f}x")


if __name__ == "__main__":
    main()
