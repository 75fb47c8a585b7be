#!/usr/bin/env python3
"""Where a firing's lead goes (issue 18): the evidence for what bounds bench_trigger.py.

A firing is claimed ``lead`` seconds before its due time (at most execute.claim_lead_s)
and must be claimed *and* its launcher prepared before then, or its spawn lands on the
due time's path ("claimed late"). This runs bench_trigger's workload (bench/trigger_millwright.py: one
agent with the daemon's job path, real etcd, N one-shot jobs) with timers around the
steps of that path, patched into this process, and prints each step's latency:

- ``timer lag``: the claim timer ran this long after its planned moment (due - lead);
- ``timer to claim``: from the planned moment to the claim's etcd write being queued
  (admission; a firing that waits for quota waits here);
- ``runs queue wait`` / ``runs etcd txn``: in the run-record pool's queue, then in etcd
  (a claim's txn includes staging: ``of which staging``, the run's directories and quota
  container made on the worker once the claim landed);
- ``runs result wait on loop``: from the txn's end to the loop running its callback
  (everything queued on the loop before it goes first);
- ``claim to spawn``: the sum of the three, from the claim queued to the spawn starting;
- ``spawn wall`` / ``spawn cpu``: the spawn on the loop (quota container, launcher
  process, poststart hooks), wall time and the loop thread's CPU time;
- ``ahead after spawn``: how far before its due time the prepared launcher was ready
  (negative: late);
- ``run end on loop``: the loop's work when a run ended (records, statuses, listeners).

Figures are per firing (final-record writes also pass through the run-record pool). Then
the same steps for each of the latest firings at the job's clock (``--top``): where a
late firing's time went.
A diagnostic: the headline stays bench_trigger.py's job clock.

    /usr/bin/python3 bench/profile_firing_stages.py [--jobs 3000] [--over 30] [--backend cgroup1] [--bpf] [--peer]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_trigger  # noqa: E402
from trigger_millwright import Options, run_millwright  # noqa: E402
from trigger_workload import Workload, load, pct, summary  # noqa: E402

from agent.coordination.worker import EtcdWorkers  # noqa: E402
from agent.execute.executor import Executor  # noqa: E402
from agent.jobs import scheduler as S  # noqa: E402
from agent.runtime.timefmt import utcnow  # noqa: E402

STAGES: "collections.defaultdict[str, list[float]]" = collections.defaultdict(list)
ORDER = ("timer lag", "timer to claim", "runs queue wait", "runs etcd txn", "  of which staging", "runs result wait on loop",
         "claim to spawn", "spawn wall", "spawn cpu", "ahead after spawn", "run end on loop")
# per job id (one-shot jobs: one firing each), the same steps of its first claim
PER: "collections.defaultdict[str, dict[str, float]]" = collections.defaultdict(dict)
PER_ORDER = ("timer lag", "timer to claim", "runs queue wait", "runs etcd txn", "  of which staging",
             "runs result wait on loop", "spawn wall", "ahead after spawn")


def instrument() -> None:
    """Wrap the scheduler's steps and the run-record pool (this process only)."""
    claimed: dict[str, float] = {}
    claiming: list = [None]     # the job id whose claim is being submitted now (loop thread)
    staging = threading.local()  # the job id whose claim a worker thread is writing now
    lock = threading.Lock()
    due, claim, spawn, ended = S.Scheduler._due, S.Scheduler._claim, S.Scheduler._spawn, S.Scheduler._ended

    def note(jid: Any, stage: str, value: float) -> None:
        STAGES[stage].append(value)
        if jid is not None and stage not in PER[jid]:
            PER[jid][stage] = value

    def _due(self: Any, e: Any, due_at: Any, lead: float = 0.0) -> None:
        note(e.job.id, "timer lag", (utcnow() - due_at).total_seconds() + lead)
        due(self, e, due_at, lead)

    def _claim(self: Any, f: Any, retry: bool = False) -> None:
        if not retry:
            claimed[f.key] = time.monotonic()
            note(f.entry.job.id, "timer to claim", (utcnow() - f.due).total_seconds() + f.lead)
        claiming[0] = f.entry.job.id
        try:
            claim(self, f, retry)
        finally:
            claiming[0] = None

    def _spawn(self: Any, f: Any) -> None:
        t0, c0 = time.monotonic(), time.thread_time()
        at = claimed.pop(f.key, None)
        if at is not None:
            STAGES["claim to spawn"].append(t0 - at)
        spawn(self, f)
        jid = f.entry.job.id
        note(jid, "spawn wall", time.monotonic() - t0)
        STAGES["spawn cpu"].append(time.thread_time() - c0)
        note(jid, "ahead after spawn", (f.due - utcnow()).total_seconds())

    def _ended(self: Any, f: Any, result: Any) -> None:
        t0 = time.monotonic()
        ended(self, f, result)
        STAGES["run end on loop"].append(time.monotonic() - t0)

    S.Scheduler._due, S.Scheduler._claim, S.Scheduler._spawn, S.Scheduler._ended = _due, _claim, _spawn, _ended
    submit = EtcdWorkers.submit

    def timed_submit(self: Any, fn: Any, callback: Any, *args: Any, **kw: Any) -> None:
        if self.name != "runs":
            return submit(self, fn, callback, *args, **kw)
        queued, marks, jid = time.monotonic(), {}, claiming[0]

        def run() -> Any:
            marks["start"] = time.monotonic()
            staging.jid = jid
            try:
                return fn()
            finally:
                staging.jid = None
                marks["end"] = time.monotonic()
                with lock:
                    note(jid, "runs queue wait", marks["start"] - queued)
                    note(jid, "runs etcd txn", marks["end"] - marks["start"])

        def answered(result: Any, error: Any) -> Any:
            if "end" in marks:
                note(jid, "runs result wait on loop", time.monotonic() - marks["end"])
            return callback(result, error)

        return submit(self, run, answered, *args, **kw)

    EtcdWorkers.submit = timed_submit  # type: ignore[method-assign]
    stage = Executor.stage

    def timed_stage(self: Any, spec: Any) -> Any:
        t0 = time.monotonic()
        try:
            return stage(self, spec)
        finally:
            with lock:
                note(getattr(staging, "jid", None), "  of which staging", time.monotonic() - t0)

    Executor.stage = timed_stage  # type: ignore[method-assign]


def report_latest(lateness: dict[str, float], top: int) -> None:
    """The steps of the ``top`` latest firings (at the job's clock), in ms."""
    worst = sorted(lateness.items(), key=lambda kv: -kv[1])[:top]
    print(f"the {len(worst)} latest firings, their steps (ms; '-': not measured for it):")
    print("  " + f"{'job':<9}{'late':>8}" + "".join(f"{name.strip()[:12]:>13}" for name in PER_ORDER))
    for jid, late in worst:
        steps = PER.get(jid, {})
        print("  " + f"{jid:<9}{late * 1000:8.1f}" + "".join(
            f"{steps[name] * 1000:13.1f}" if name in steps else f"{'-':>13}" for name in PER_ORDER))


def report() -> None:
    print("per step (ms):")
    for name in ORDER:
        xs = STAGES.get(name)
        if not xs:
            continue
        p = lambda q: pct(xs, q) * 1000  # noqa: E731
        print(f"  {name:<26} n={len(xs):6d}  p50 {p(50):9.2f}  p90 {p(90):9.2f}  p99 {p(99):9.2f}  "
              f"max {max(xs) * 1000:9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    bench_trigger.add_workload_args(ap, backend="cgroup1")
    ap.add_argument("--peer", action="store_true", help="APScheduler beside the agent, as bench_trigger runs it")
    ap.add_argument("--top", type=int, default=12, help="the latest firings whose steps are listed")
    a = ap.parse_args()
    instrument()
    print(f"{a.jobs} one-shot jobs over {a.over:g} s, backend {a.backend}, BPF {'on' if a.bpf else 'off'}, "
          f"APScheduler {'beside it' if a.peer else 'not running'}; before: {load()}", flush=True)
    w = Workload.even(a.jobs, a.over)
    a.drain, a.slim, a.trace_cgroup = 30.0, False, False
    peer: list = []

    def beside(start_ts: float) -> None:
        if a.peer:   # its due times halfway between ours, as bench_trigger's side-by-side mode
            peer.append(bench_trigger.Child("apscheduler", w, a, start_ts=start_ts + w.offsets[1] / 2))

    res = run_millwright(w, Options(backend=a.backend, lead=a.lead, bpf=a.bpf, user=a.user), on_start=beside)
    print(summary("millwright job clock", list(res["lateness"].values())))
    for child in peer:
        print(summary("apscheduler job clock", list(child.wait()["lateness"].values())))
    print(f"after: {load()}")
    report()
    report_latest(res["lateness"], a.top)


if __name__ == "__main__":
    main()
