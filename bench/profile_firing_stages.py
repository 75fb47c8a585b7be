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
- ``runs queue wait`` / ``runs etcd txn``: in the run-record pool's queue, then in etcd;
- ``runs result wait on loop``: from the txn's end to the loop running its callback
  (everything queued on the loop before it goes first);
- ``claim to spawn``: the sum of the three, from the claim queued to the spawn starting;
- ``spawn wall`` / ``spawn cpu``: the spawn on the loop (quota container, launcher
  process, poststart hooks), wall time and the loop thread's CPU time;
- ``ahead after spawn``: how far before its due time the prepared launcher was ready
  (negative: late);
- ``run end on loop``: the loop's work when a run ended (records, statuses, listeners).

Figures are per firing (final-record writes also pass through the run-record pool).
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
from agent.jobs import scheduler as S  # noqa: E402
from agent.runtime.timefmt import utcnow  # noqa: E402

STAGES: "collections.defaultdict[str, list[float]]" = collections.defaultdict(list)
ORDER = ("timer lag", "timer to claim", "runs queue wait", "runs etcd txn", "runs result wait on loop",
         "claim to spawn", "spawn wall", "spawn cpu", "ahead after spawn", "run end on loop")


def instrument() -> None:
    """Wrap the scheduler's steps and the run-record pool (this process only)."""
    claimed: dict[str, float] = {}
    lock = threading.Lock()
    due, claim, spawn, ended = S.Scheduler._due, S.Scheduler._claim, S.Scheduler._spawn, S.Scheduler._ended

    def _due(self: Any, e: Any, due_at: Any, lead: float = 0.0) -> None:
        STAGES["timer lag"].append((utcnow() - due_at).total_seconds() + lead)
        due(self, e, due_at, lead)

    def _claim(self: Any, f: Any, retry: bool = False) -> None:
        if not retry:
            claimed[f.key] = time.monotonic()
            STAGES["timer to claim"].append((utcnow() - f.due).total_seconds() + f.lead)
        claim(self, f, retry)

    def _spawn(self: Any, f: Any) -> None:
        t0, c0 = time.monotonic(), time.thread_time()
        at = claimed.pop(f.key, None)
        if at is not None:
            STAGES["claim to spawn"].append(t0 - at)
        spawn(self, f)
        STAGES["spawn wall"].append(time.monotonic() - t0)
        STAGES["spawn cpu"].append(time.thread_time() - c0)
        STAGES["ahead after spawn"].append((f.due - utcnow()).total_seconds())

    def _ended(self: Any, f: Any, result: Any) -> None:
        t0 = time.monotonic()
        ended(self, f, result)
        STAGES["run end on loop"].append(time.monotonic() - t0)

    S.Scheduler._due, S.Scheduler._claim, S.Scheduler._spawn, S.Scheduler._ended = _due, _claim, _spawn, _ended
    submit = EtcdWorkers.submit

    def timed_submit(self: Any, fn: Any, callback: Any, *args: Any, **kw: Any) -> None:
        if self.name != "runs":
            return submit(self, fn, callback, *args, **kw)
        queued, marks = time.monotonic(), {}

        def run() -> Any:
            marks["start"] = time.monotonic()
            try:
                return fn()
            finally:
                marks["end"] = time.monotonic()
                with lock:
                    STAGES["runs queue wait"].append(marks["start"] - queued)
                    STAGES["runs etcd txn"].append(marks["end"] - marks["start"])

        def answered(result: Any, error: Any) -> Any:
            if "end" in marks:
                STAGES["runs result wait on loop"].append(time.monotonic() - marks["end"])
            return callback(result, error)

        return submit(self, run, answered, *args, **kw)

    EtcdWorkers.submit = timed_submit  # type: ignore[method-assign]


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
    report()


if __name__ == "__main__":
    main()
