"""Millwright's side of the trigger benchmarks: one agent in this process with the daemon's
job path (audit log, scheduler, executor, sensing and supervision; not the cloud
channel), a real etcd, the workload's one-shot jobs stored signed, as the cloud stores
them.

Each firing creates its fenced run record in etcd *before* its process can exec
(durable, exactly-once). The claim and the spawn happen up to execute.claim_lead_s ahead;
the launcher then waits for its due time (agent/execute/launch.py).

Read besides the job clocks: the release time the executor reports (handle.started_at,
the old "go byte" figure); the agent's CPU per firing per thread over the run
(bench/thread_cpu.py), etcd's and the run guard's; the agent's lag gauge
``millwright_scheduler_lag_seconds`` if it has one; every run record (one per job,
its state); with --bpf, the sensor's exec of the job's script as a second witness.
"""

from __future__ import annotations

import bisect
import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from trigger_workload import BENCH_THREADS, Workload, job_script, read_clocks, summary  # noqa: E402
from thread_cpu import ThreadCPU, process_cpu  # noqa: E402

from agent.config import parse_config  # noqa: E402
from agent.coordination.jobstore import JobStore  # noqa: E402
from agent.demo.services import EtcdServer  # noqa: E402
from agent.jobs.schedule import format_rfc3339, parse_rfc3339  # noqa: E402

LAG_GAUGE = "millwright_scheduler_lag_seconds"
CREATE_BATCH = 64            # jobs stored per etcd transaction (JobStore.create_many)
SETUP_S_PER_JOB = 0.002      # store + install (verify, parse, arm) per job, before the first due time


@dataclass
class Options:
    backend: str = "auto"
    lead: float = 0.25
    bpf: bool = False
    slim: bool = False
    user: str = "root"
    drain_s: float = 30.0   # after the last due time, wait this long at most for the runs still to come
    # execute.runtime_dir; None: a fresh one on /dev/shm (a tmpfs, as /run is on a systemd
    # host; this host's /run may be on disk); "": the run directories (the layout before it)
    runtime_dir: Optional[str] = None


def run_listeners_of(jobs_component: Any) -> list:
    """The scheduler's list of run listeners (where a probe is added)."""
    s = jobs_component.scheduler
    return getattr(s, "run_listeners", None) or s.launcher.run_listeners


class GcPauses:
    """The garbage collector's passes in this process (gc.callbacks): (start epoch,
    seconds, generation). A pass holds the GIL: every thread of the agent waits."""

    def __init__(self) -> None:
        import gc

        self.gc = gc
        self.passes: list[tuple[float, float, int]] = []
        self._t0 = 0.0

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            took = time.perf_counter() - self._t0
            self.passes.append((time.time() - took, took, info.get("generation", -1)))

    def __enter__(self) -> "GcPauses":
        self.gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.gc.callbacks.remove(self._cb)


class Lag:
    """The agent's lag gauge, if the agent has one (read from its metrics registry)."""

    def __init__(self) -> None:
        from agent.runtime.metrics import REGISTRY

        self.registry = REGISTRY
        self.samples: list[tuple[float, float]] = []

    def read(self) -> Optional[float]:
        collector = getattr(self.registry, "_names_to_collectors", {}).get(LAG_GAUGE)
        if collector is None:
            return None
        values = [s.value for m in collector.collect() for s in m.samples]
        return max(values) if values else None

    def sample(self, offset: float) -> None:
        v = self.read()
        if v is not None:
            self.samples.append((offset, v))


def counter(name: str, labels: dict) -> float:
    from agent.runtime.metrics import sample

    return sample(name, labels) or 0.0


def records_check(client: Any, keys: Any, ids: set[str]) -> dict:
    """Every run record in etcd: how many per job (one-shot: exactly one) and their states;
    the runs their cpu quota throttled (usage.throttled_s, job id -> seconds)."""
    kvs, _ = client.get_prefix(keys.runs_prefix())
    per_job: collections.Counter = collections.Counter()
    states: collections.Counter = collections.Counter()
    throttled: dict[str, float] = {}
    retried = 0
    for kv in kvs:
        r = json.loads(kv.value)
        per_job[r.get("job_id")] += 1
        states[r.get("state")] += 1
        retried += int(r.get("attempt") or 1) > 1
        t = (r.get("usage") or {}).get("throttled_s") or 0.0
        if t > 0:
            throttled[r.get("job_id")] = t
    return {"records": len(kvs), "states": dict(states), "attempt_gt_1": retried, "throttled": throttled,
            "jobs_without": len(ids - set(per_job)), "jobs_with_more": sum(1 for c in per_job.values() if c > 1)}


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


def window_start(first_due: float, lead: float) -> float:
    """Where the measured CPU window begins (epoch seconds): just before the first claim,
    ``lead`` ahead of the first due time."""
    return first_due - lead - 0.5


def run_millwright(w: Workload, o: Options, on_start: Optional[Callable[[float], None]] = None,
                   trace: Optional[CgroupTrace] = None, say: Callable[[str], None] = print) -> dict:
    """Run the workload on one agent; the figures as a JSON-able dict. ``on_start(ts)`` is
    called with the first due time (epoch seconds) once the jobs are stored."""
    from agent.daemon.core import Daemon
    from agent.daemon.hooks import Hooks, Wired
    from agent.daemon.wiring import JobsParts, SupervisedJobs
    from tests.support.cloudkit import SigningStore, write_keys

    tmp = tempfile.mkdtemp(prefix="mw-bench-")
    # the job's script and clock file apart from the agent's state: a run's mount namespace
    # covers the directories that hold the agent's secrets (agent/execute/namespaces.py)
    job_dir = tempfile.mkdtemp(prefix="mw-bench-job-")
    script, out = job_script(job_dir)
    runtime = o.runtime_dir
    if runtime is None:
        runtime = tempfile.mkdtemp(prefix="mw-bench-run-", dir="/dev/shm") if os.path.isdir("/dev/shm") else ""
    etcd = EtcdServer(os.path.join(tmp, "etcd")).start()
    ring = write_keys(f"{tmp}/keys.yaml")
    audit_dir = "" if o.slim else f"{tmp}/audit"   # slim: no audit log either
    cfg = parse_config(f"""
cluster: bench
signing: {{keys_file: {tmp}/keys.yaml}}
agent_id: bench-0
shards: 64
state_dir: {tmp}/state
etcd: {{endpoints: ["{etcd.endpoint}"], lease_ttl_s: 10, renew_deadline_s: 6, retry_period_s: 1, insecure: true}}
audit: {{dir: "{audit_dir}", key_file: {tmp}/audit.key}}
admin: {{socket: {tmp}/admin/admin.sock}}
metrics: {{listen: ""}}
bpf: {{enabled: {"true" if o.bpf else "false"}, mode: monitor}}
execute: {{max_concurrent: 256, memory_mb: 65536, cpu: 256, quota_backend: {o.backend}, claim_lead_s: {o.lead}, runtime_dir: "{runtime}"}}
templates:
  clock: {{argv: ["{script}"], user: {o.user}, allow_root: true, allow_exec: ["/bin/*", "/usr/bin/*"]}}
""", "bench")
    release: dict[str, float] = {}
    ahead: dict[str, float] = {}
    failed: list[str] = []
    ended = [0]
    jobs_part: list[Any] = []

    class Probe:
        """Counts run ends; per firing, how far ahead of its due time its run was handed
        to the executor, and its release time (the launcher's go byte written; start()
        returned when not prepared ahead), read when the run ends."""

        def run_started(self, f):
            if f.attempt == 1:   # handed to the executor this long before its due time (< 0: late)
                ahead[f.entry.job.id] = f.due.timestamp() - time.time()

        def run_ended(self, f):
            ended[0] += 1
            if f.attempt == 1 and f.handle is not None and f.handle.started_at:
                release[f.entry.job.id] = f.handle.started_at - f.due.timestamp()
            res = getattr(f.handle, "result", None)
            if res is not None and res.reason != "succeeded":
                failed.append(f"{f.entry.job.id}: {res.reason} exit {res.exit_code} signal {res.signal} {res.error or ''}")

    def supervised_jobs(g):
        """The daemon's job path: scheduler, executor, sensing (BPF, or /proc polling
        when BPF is off) and supervision, with the probe as one more run listener."""
        hooks = Hooks()
        c = SupervisedJobs(g, hooks)
        run_listeners_of(c.jobs).append(Probe())
        jobs_part.append(c.jobs)
        return Wired(hooks, [c])

    def slim_jobs(g):
        hooks = Hooks()
        c = JobsParts(g, hooks, run_listeners=[Probe()])
        jobs_part.append(c)
        return Wired(hooks, [c])

    agent = Daemon(cfg, slim_jobs if o.slim else supervised_jobs)
    t = threading.Thread(target=agent.run, name="agent-loop", daemon=True)
    t.start()
    while len(agent.shards.mine) < 64:
        time.sleep(0.05)
    claimed_late0 = counter("millwright_firings_total", {"outcome": "claimed_late"})
    decisions = ("renew_fast", "renew_normal", "pause_runs", "resume_runs", "hand_off", "take_back")
    decisions0 = {d: counter("millwright_lease_decisions_total", {"decision": d}) for d in decisions}
    store = SigningStore(JobStore(agent.client, agent.keys, 64, "bench"), ring, "bench")  # agents run only signed jobs
    t_create = time.monotonic()
    start = datetime.now(timezone.utc) + timedelta(seconds=5 + w.n * SETUP_S_PER_JOB)
    due: dict[str, float] = {}
    due_off: dict[str, float] = {}
    batch: list = []
    for i, off in enumerate(w.offsets):
        jid = f"b{i:06d}"
        at = parse_rfc3339(format_rfc3339(start + timedelta(seconds=off)))  # as stored
        due[jid] = at.timestamp()
        due_off[jid] = due[jid] - start.timestamp()
        batch.append((store.sign({"v": 1, "id": jid, "template": "clock", "params": {},
                                  "schedule": {"at": format_rfc3339(at)}}), ()))
        if len(batch) == CREATE_BATCH or i == w.n - 1:
            for res in store.store.create_many(batch):
                if isinstance(res, Exception):
                    raise res
            batch = []
    create_s = time.monotonic() - t_create
    say(f"stored {w.n} jobs in {create_s:.1f} s ({w.n / max(create_s, 1e-3):.0f}/s, batches of {CREATE_BATCH})")
    start_ts = start.timestamp()
    if on_start is not None:
        on_start(start_ts)
    while counter("millwright_jobs_owned", {}) < w.n and time.time() < start_ts - 0.5:
        time.sleep(0.1)
    owned = counter("millwright_jobs_owned", {})
    say(f"jobs installed: {owned:.0f} of {w.n}, {start_ts - time.time():.1f} s before the first due time"
        + ("" if owned >= w.n else "  (WARNING: installs overlap the run)"))

    # the window: from just before the first claim to the last run's end (+1 s: its final
    # record, status and audit record); before it, the agent's idle CPU for as long as there is
    window_at = window_start(start_ts, o.lead)
    idle = None
    if window_at - time.time() >= 1.5:
        pre = ThreadCPU().start()
        t0 = time.time()
        time.sleep(window_at - t0)
        p = pre.stop()
        idle = (p["user_s"] + p["sys_s"] - sum(sum(v) for k, v in p["threads"].items() if k in BENCH_THREADS)) \
            / (time.time() - t0)
    cpu = ThreadCPU().start()
    batches0 = (counter("millwright_etcd_batch_writes_count", {}), counter("millwright_etcd_batch_writes_sum", {}))
    etcd0 = process_cpu(etcd.proc.pid)
    guard_pid = getattr(getattr(jobs_part[0].executor, "guard", None), "pid", None) if jobs_part else None
    guard0 = process_cpu(guard_pid) if guard_pid else None
    t_window = time.time()
    lag = Lag()
    lag_present = lag.read() is not None
    deadline = start_ts + w.span + o.drain_s
    k = 0
    with GcPauses() as gc_pauses:
        while ended[0] < w.n and time.time() < deadline:
            time.sleep(0.25)
            lag.sample(time.time() - start_ts)
            k += 1
            if k % 4 == 0:
                cpu.poll()
        t_last = time.time()
        time.sleep(1.0)
    lag.sample(time.time() - start_ts)
    cpu_window = cpu.stop()
    window_s = time.time() - t_window
    etcd1 = process_cpu(etcd.proc.pid)
    guard1 = process_cpu(guard_pid) if guard_pid else None
    firings = ended[0]
    lag_present = lag_present or lag.read() is not None
    recs = records_check(agent.client, agent.keys, set(due))
    lead_end = None
    if o.lead > 0:
        from agent.jobs.claimlead import LEAD

        lead_end = LEAD._value.get()
    claimed_late = counter("millwright_firings_total", {"outcome": "claimed_late"}) - claimed_late0
    batches = (counter("millwright_etcd_batch_writes_count", {}) - batches0[0],
               counter("millwright_etcd_batch_writes_sum", {}) - batches0[1])
    lease_decisions = {d: counter("millwright_lease_decisions_total", {"decision": d}) - decisions0[d] for d in decisions}
    agent.request_stop()
    t.join(30)
    etcd.close()
    lateness, counts = read_clocks(out, due)
    witness = None
    if o.bpf and not o.slim:
        seen, after_end, wrong = sensor_witness(f"{tmp}/audit", script, due)
        # job clock minus the kernel's exec of its script: the shell's start and its exec of date
        witness = {"execs": list(seen.values()), "gaps": [lateness[j] - seen[j] for j in seen if j in lateness],
                   "after_end": after_end, "wrong": wrong}
    if trace is not None:
        trace.report([(due[j], d) for j, d in lateness.items()])
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(job_dir, ignore_errors=True)
    if o.runtime_dir is None and runtime:
        shutil.rmtree(runtime, ignore_errors=True)
    return {"scheduler": "millwright", "n": w.n, "start_ts": start_ts, "due_off": due_off,
            "lateness": lateness, "counts": counts, "release": release, "ahead": ahead, "failed": failed,
            "claimed_late": claimed_late, "lead_end": lead_end, "ended": firings,
            "last_end_after_last_due_s": t_last - (start_ts + w.span),
            "cpu": cpu_window, "cpu_window_s": window_s, "cpu_firings": firings, "idle_cpu_per_s": idle,
            "etcd_cpu_s": sum(etcd1[:2]) - sum(etcd0[:2]),
            "guard_cpu_s": (sum(guard1[:2]) - sum(guard0[:2])) if guard0 and guard1 else None,
            "records": recs, "lag": lag.samples if lag_present else None, "witness": witness,
            "gc": gc_pauses.passes, "batches": batches, "lease_decisions": {d: v for d, v in lease_decisions.items() if v}}
