#!/usr/bin/env python3
"""Trigger delay at the job's own clock: when the job's first command ran minus its due
time (issues 3, 18 and 36), Millwright against APScheduler 3.9.

Both run the same job body (bench/trigger_workload.py: ``sh`` exec'ing ``date +%s.%N``
into a file, so lateness is read at the job's clock and how often a job ran is its number
of lines), the same one-shot jobs spread evenly, as the same user. Millwright: one agent
with the daemon's job path and a real etcd (bench/trigger_millwright.py); APScheduler:
in memory, thread pool, subprocess.Popen (bench/trigger_peer.py). Each runs in its own
process started from here; this process only waits and prints.

Modes:
- side by side (the default): both at once, APScheduler's due times halfway between
  Millwright's: both see the same machine load;
- ``--alone`` (``--sequential`` is the same): each scheduler alone on the machine, one
  after the other, never both at once: what a user choosing a scheduler sees.
  ``--repeat 3`` alternates them (M A, A M, M A): three alternated runs confirm a figure;
- ``--sweep``: --alone at 100, 167, 333 and 500 firings/s (``--rates``), ``--over`` s each;
- ``--burst``: 1,000/s for 60 s, then 100/s for 20 s (``--segments``), each alone:
  lateness per 5-second bucket of due time, firings started per bucket, the agent's lag
  (the gauge millwright_scheduler_lag_seconds, or "absent"), and every firing checked to
  have run exactly once (its job clock lines; Millwright: its run records too).

Every Millwright run prints the agent's CPU per firing per thread (bench/thread_cpu.py),
etcd's, the run guard's and the job processes'; every run the load average before and
after (the machine is shared: figures under load are pessimistic). At the end: one table
(p50/p99/max at the job's clock, firings run, firings later than --late-ms, CPU per
firing, load) and the p99 ratio Millwright / APScheduler per rate.

Usage: bench_trigger.py [--alone [--repeat 3] | --sweep | --burst] [--jobs 3000 --over 30 | --segments 1000:60,100:20]
                        [--backend auto|cgroup1|rlimit] [--lead 0.25] [--runtime-dir DIR] [--bpf] [--user root] [--slim] [--skip-peer]
Prerequisite: APScheduler 3.x for the peer (Debian: python3-apscheduler; scripts/setup-host.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from trigger_workload import BENCH_THREADS, Workload, backlog_end, buckets, load, once_check, pct, stats, summary  # noqa: E402
from thread_cpu import per_firing_table, total_ms_per_firing  # noqa: E402

DEFAULT_RATES = (100, 167, 333, 500)
BUCKET_S = 5.0


# --- the children -------------------------------------------------------------------
def child_main(a: argparse.Namespace) -> None:
    """One scheduler's run in this process: progress lines, then ``RESULT <json>``."""
    w = Workload.parse(a.segments)
    if a.child == "apscheduler":
        from trigger_peer import run_apscheduler

        res = run_apscheduler(w, a.start_ts, a.user, a.drain)
    else:
        from trigger_millwright import CgroupTrace, Options, run_millwright

        o = Options(backend=a.backend, lead=a.lead, bpf=a.bpf, slim=a.slim, user=a.user, drain_s=a.drain,
                    runtime_dir=a.runtime_dir)
        res = run_millwright(w, o, on_start=lambda ts: print(f"START {ts!r}", flush=True),
                             trace=CgroupTrace() if a.trace_cgroup else None,
                             say=lambda line: print(line, flush=True))
    print("RESULT " + json.dumps(res), flush=True)


class Child:
    """A scheduler's run in its own process; its progress lines are echoed."""

    def __init__(self, which: str, w: Workload, a: argparse.Namespace, start_ts: Optional[float] = None):
        argv = [sys.executable, os.path.abspath(__file__), "--child", which, "--segments", w.spec(),
                "--user", a.user, "--drain", repr(a.drain)]
        if which == "millwright":
            argv += ["--backend", a.backend, "--lead", repr(a.lead)]
            argv += [] if a.runtime_dir is None else ["--runtime-dir", a.runtime_dir]
            argv += [flag for flag, on in (("--bpf", a.bpf), ("--slim", a.slim), ("--trace-cgroup", a.trace_cgroup)) if on]
        if start_ts is not None:
            argv += ["--start-ts", repr(start_ts)]
        self.which = which
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        self.result: Optional[dict] = None

    def lines(self):
        """Progress lines as they come (the result is kept, not yielded)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                self.result = json.loads(line[7:])
            else:
                yield line.rstrip("\n")

    def wait(self) -> dict:
        for line in self.lines():
            print(f"  [{self.which}] {line}", flush=True)
        self.proc.wait()
        if self.result is None:
            raise SystemExit(f"{self.which} run ended without a result (exit {self.proc.returncode})")
        return self.result


def load1() -> float:
    return os.getloadavg()[0]


def run_alone(which: str, w: Workload, a: argparse.Namespace) -> dict:
    before = load1()
    res = Child(which, w, a).wait()
    res["load"] = (before, load1())
    return res


def run_side_by_side(w: Workload, a: argparse.Namespace) -> tuple[dict, Optional[dict]]:
    before = load1()
    mw = Child("millwright", w, a)
    peer = None
    for line in mw.lines():
        if line.startswith("START "):
            if not a.skip_peer:
                # its due times halfway between ours: the same machine load, at the same moments
                start = float(line.split()[1]) + (w.offsets[1] if w.n > 1 else 0.0) / 2
                peer = Child("apscheduler", w, a, start_ts=start)
            continue
        print(f"  [millwright] {line}", flush=True)
    mw.proc.wait()
    res = mw.result
    if res is None:
        raise SystemExit(f"millwright run ended without a result (exit {mw.proc.returncode})")
    theirs = peer.wait() if peer is not None else None
    res["load"] = (before, load1())
    if theirs is not None:
        theirs["load"] = res["load"]
    return res, theirs


# --- printing -----------------------------------------------------------------------
def ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def report_run(res: dict, label: str, late_s: float) -> None:
    n = res["n"]
    late = list(res["lateness"].values())
    once = once_check(n, res["counts"])
    lo, hi = res["load"]
    print(f"{res['scheduler']} {label}: load average (1 min) {lo:.2f} before, {hi:.2f} after")
    print("  " + summary("job clock", late))
    print(f"  ran {len(late)} of {n} (exactly once {once['once']}, not run by the end of the wait {once['never']}, "
          f"more than once {once['more']}); later than {late_s * 1000:g} ms: {sum(1 for x in late if x > late_s)}")
    if res["scheduler"] == "millwright":
        print("  " + summary("diagnostic: release time", list(res["release"].values()))
              + "  (handle.started_at, the go byte)")
        if res.get("lead_end") is not None:
            print(f"  claimed late (spawned on the due time's path): {res['claimed_late']:.0f}; "
                  f"claim lead at the end {res['lead_end'] * 1000:.0f} ms")
        r = res["records"]
        print(f"  run records: {r['records']} {r['states']}; jobs without one {r['jobs_without']}, with more than one "
              f"{r['jobs_with_more']}; attempt > 1: {r['attempt_gt_1']}")
        thr = r.get("throttled") or {}
        print(f"  runs their cpu quota throttled (run records' usage.throttled_s): {len(thr)}"
              + (f", {sum(thr.values()) * 1000:.1f} ms in all, at most {max(thr.values()) * 1000:.1f} ms" if thr else ""))
        if res["failed"]:
            print(f"  runs that did not succeed: {len(res['failed'])}: {res['failed'][:5]}")
        if res.get("witness"):
            wit = res["witness"]
            print(f"  jobs' exec records that reached the agent after their run ended: {wit['after_end']}; date execs "
                  f"recorded under no job: {wit['wrong'][0]}, under another job: {wit['wrong'][1]}")
            if wit["execs"]:
                print("  " + summary("witness: sensor exec of argv[0]", wit["execs"]))
                print("  " + summary("job clock - sensor exec", wit["gaps"]))
        print("  lease policy decisions during the run (pause_runs holds new runs): "
              + (", ".join(f"{d} {v:.0f}" for d, v in res["lease_decisions"].items()) or "none"))
        txns, writes = res.get("batches") or (0, 0)
        if txns:
            print(f"  fenced writes (claims, run records) {writes:.0f} in {txns:.0f} etcd transactions: "
                  f"{writes / txns:.2f} per transaction")
        gcs = res.get("gc") or []
        by_gen = {g: [d for _, d, gg in gcs if gg == g] for g in sorted({g for _, _, g in gcs})}
        print("  garbage collector passes in the window (they hold the GIL): " + (", ".join(
            f"gen{g} {len(ds)}x max {max(ds) * 1000:.1f} ms" for g, ds in by_gen.items()) or "none"))
        lag = res.get("lag")
        print("  lag gauge millwright_scheduler_lag_seconds: "
              + ("absent" if lag is None else f"max {max((v for _, v in lag), default=0) * 1000:.1f} ms"))
        f = res["cpu_firings"]
        idle = res.get("idle_cpu_per_s")
        print(f"  agent CPU per firing over {f} firings, window {res['cpu_window_s']:.1f} s"
              + (f" (idle before: {idle * 1000:.1f} ms/s = {idle * 1000 * res['cpu_window_s'] / max(f, 1):.3f} "
                 f"ms/firing of the window)" if idle is not None else "") + ":")
        for line in per_firing_table(res["cpu"], f, exclude=BENCH_THREADS):
            print("  " + line)
        guard = res.get("guard_cpu_s")
        print(f"  outside the agent process: etcd {res['etcd_cpu_s'] * 1000 / max(f, 1):.3f} ms/firing"
              + (f", run guard {guard * 1000 / max(f, 1):.3f}" if guard is not None else "")
              + f", job processes (launcher + job, reaped) {res['cpu']['children_s'] * 1000 / max(f, 1):.3f}")
    else:
        print("  " + summary("diagnostic: Popen returned", res["popen"]))
        f = res["cpu_firings"]
        print(f"  APScheduler process CPU per firing over {f} firings: "
              f"{total_ms_per_firing(res['cpu'], f, exclude=BENCH_THREADS):.3f} ms; job processes "
              f"{res['cpu']['children_s'] * 1000 / max(f, 1):.3f} ms")
    worst = sorted(res["lateness"].items(), key=lambda kv: -kv[1])[:5]
    rel, ahead = res.get("release") or {}, res.get("ahead") or {}
    thr = (res.get("records") or {}).get("throttled") or {}
    gcs = res.get("gc") or []

    def gc_near(due: float, late: float) -> str:
        """The longest garbage collector pass from the claim lead before the due time to the job's start."""
        near = [d for t, d, _ in gcs if due - 0.3 <= t + d and t <= due + late]
        return f", gc {max(near) * 1000:.1f} ms" if near else ""

    print("  latest firings (job, due +s, due epoch, lateness at the job's clock"
          + (", handed to the executor before its due time, release time, cpu quota throttling, longest gc pass "
             "between due - 0.3 s and the start" if rel else "") + "): "
          + "; ".join(f"{j} +{res['due_off'][j]:.3f} {res['start_ts'] + res['due_off'][j]:.3f} {d * 1000:.1f} ms"
                      + (f" (ahead {ahead[j] * 1000:.1f} ms, released {rel[j] * 1000:.1f} ms, "
                         f"throttled {thr.get(j, 0.0) * 1000:.1f} ms{gc_near(res['start_ts'] + res['due_off'][j], d)})"
                         if j in rel and j in ahead else "")
                      for j, d in worst))
    sys.stdout.flush()


def row(res: dict, rate: str, run: int, late_s: float) -> dict:
    late = list(res["lateness"].values())
    s = stats(late, late_s)
    cpu = total_ms_per_firing(res["cpu"], res["cpu_firings"], exclude=BENCH_THREADS)
    return {"rate": rate, "scheduler": res["scheduler"], "run": run, "ran": len(late), "n": res["n"],
            "late": s["late"], "p50": s["p50"], "p99": s["p99"], "max": s["max"], "cpu": cpu, "load": res["load"]}


def print_table(rows: list[dict], late_s: float, title: str) -> None:
    print(f"\n{title}")
    print(f"| rate | scheduler | run | ran / due | later than {late_s * 1000:g} ms | p50 ms | p99 ms | max ms "
          "| CPU ms/firing | load before → after |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['rate']} | {r['scheduler']} | {r['run']} | {r['ran']} / {r['n']} | {r['late']} | {ms(r['p50'])} "
              f"| {ms(r['p99'])} | {ms(r['max'])} | {r['cpu']:.2f} | {r['load'][0]:.2f} → {r['load'][1]:.2f} |")
    ratios = {}
    for rate in dict.fromkeys(r["rate"] for r in rows):
        mine = [r for r in rows if r["rate"] == rate and r["scheduler"] == "millwright"]
        theirs = [r for r in rows if r["rate"] == rate and r["scheduler"] == "apscheduler"]
        pairs = [m["p99"] / t["p99"] for m, t in zip(mine, theirs) if m["p99"] is not None and t["p99"]]
        if pairs:
            ratios[rate] = pairs
    if ratios:
        print("\np99 ratio at the job's clock (Millwright / APScheduler, run by run): "
              + "; ".join(f"{rate}: " + ", ".join(f"{x:.2f}x" for x in xs) for rate, xs in ratios.items()))
    sys.stdout.flush()


def print_buckets(res: dict) -> None:
    lag = res.get("lag")
    rows = buckets(res["due_off"], res["lateness"], BUCKET_S, lag if res["scheduler"] == "millwright" else None)
    print(f"\n{res['scheduler']}: per {BUCKET_S:g}-second bucket of the run (from the first due time)")
    head = "| from s | due | started | lateness p50 ms | p99 ms | max ms |"
    if res["scheduler"] == "millwright":
        head += " lag gauge max ms |"
    print(head)
    print("| --- " * (head.count("|") - 1) + "|")
    for b in rows:
        s = b["lateness"]
        line = f"| {b['from']:g} | {b['due']} | {b['started']} | {ms(s['p50'])} | {ms(s['p99'])} | {ms(s['max'])} |"
        if res["scheduler"] == "millwright":
            line += " absent |" if lag is None else f" {ms(b.get('lag_max'))} |"
        print(line)
    once = once_check(res["n"], res["counts"])
    verdict = "every firing ran exactly once" if once["once"] == res["n"] else "NOT every firing ran exactly once"
    print(f"exactly once ({res['scheduler']}, job clocks): {verdict}: once {once['once']}, not run by the end of the wait {once['never']}, "
          f"more than once {once['more']} of {res['n']}")
    if res.get("burst_end_s") is not None:
        b = backlog_end(res["due_off"], res["lateness"], res["burst_end_s"])
        print(f"backlog ({res['scheduler']}, job clocks): the last firing due by the burst's end started "
              + ("-" if b["drained"] is None else f"{b['drained']:.1f} s after it")
              + "; every firing due from then on started within 50 ms of its due time "
              + ("from never (late up to the run's last firing)" if b["on_time_from"] is None
                 else f"from {b['on_time_from']:.1f} s after the burst's end"))
    if res["scheduler"] == "millwright":
        r = res["records"]
        ok = r["records"] == res["n"] and not r["jobs_without"] and not r["jobs_with_more"] \
            and r["states"].get("succeeded", 0) == res["n"]
        print(f"exactly once (millwright, run records): {'one succeeded record per job' if ok else 'NOT one succeeded record per job'}: "
              f"{r['records']} records {r['states']}, jobs without {r['jobs_without']}, with more {r['jobs_with_more']}")
        if lag is None:
            print("lag gauge millwright_scheduler_lag_seconds: absent (the agent does not expose it)")
        else:
            burst_end = res["burst_end_s"]
            after = [(t, v) for t, v in lag if t >= burst_end]
            below = next((t for t, v in after if v < 0.05), None)
            print("lag gauge after the burst: " + ("never below 50 ms while sampled (until the run's last firing)"
                                                   if below is None
                                                   else f"below 50 ms {below - burst_end:.1f} s after the burst's end")
                  + " (how late the agent starts firings, admission, claims and spawns included)")
    sys.stdout.flush()


# --- modes --------------------------------------------------------------------------
def rate_label(w: Workload) -> str:
    return f"{w.segments[0][0]:g}/s" if len(w.segments) == 1 else w.spec()


def alone_rounds(w: Workload, a: argparse.Namespace, rows: list[dict], peer: bool = True) -> list[dict]:
    """--repeat rounds of each scheduler alone, alternating which goes first."""
    results = []
    for k in range(a.repeat):
        order = ["millwright", "apscheduler"] if k % 2 == 0 else ["apscheduler", "millwright"]
        for which in order:
            if which == "apscheduler" and not peer:
                continue
            print(f"== {which} alone, {w.label()}, run {k + 1} of {a.repeat}", flush=True)
            res = run_alone(which, w, a)
            report_run(res, f"alone, {rate_label(w)}, run {k + 1}", a.late_ms / 1000)
            rows.append(row(res, rate_label(w), k + 1, a.late_ms / 1000))
            results.append(res)
            time.sleep(2)
    return results


def header(a: argparse.Namespace, what: str) -> None:
    print(f"{what}; BPF {'on' if a.bpf else 'off'}, run as {a.user}, agent: "
          f"{'scheduler and executor only (--slim)' if a.slim else 'audit, jobs, sensing, supervision'}, "
          f"backend {a.backend}, claim lead {a.lead:g} s; job body: sh exec date +%s.%N >> file", flush=True)
    print(f"machine: {os.cpu_count()} CPUs, {load()} (shared: figures under load are not release figures)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--alone", "--sequential", dest="alone", action="store_true",
                      help="each scheduler alone on the machine, one after the other")
    mode.add_argument("--sweep", action="store_true", help="--alone at each of --rates, --over seconds each")
    mode.add_argument("--burst", action="store_true", help="beyond capacity: --segments (default 1000:60,100:20)")
    ap.add_argument("--rates", default=",".join(map(str, DEFAULT_RATES)), help="firings/s of --sweep")
    ap.add_argument("--segments", help="the workload as RATE:SECONDS,...; overrides --jobs/--over")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of --alone/--sweep, alternating the schedulers")
    ap.add_argument("--late-ms", type=float, default=25.0, help="a firing later than this counts as late")
    ap.add_argument("--drain", type=float, help="after the last due time, wait at most this long (default 30 s, burst 300 s)")
    ap.add_argument("--skip-peer", action="store_true", help="Millwright only")
    ap.add_argument("--trace-cgroup", action="store_true",
                    help="time the agent's cgroup operations and relate the late jobs to them (profile)")
    ap.add_argument("--slim", action="store_true",
                    help="diagnostic: the scheduler and executor only (no audit log, no sensing or supervision)")
    ap.add_argument("--child", choices=("millwright", "apscheduler"), help=argparse.SUPPRESS)
    ap.add_argument("--start-ts", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.drain is None:
        a.drain = 300.0 if a.burst else 30.0
    if a.child:
        child_main(a)
        return
    late_s = a.late_ms / 1000
    rows: list[dict] = []
    if a.sweep:
        rates = [float(x) for x in a.rates.split(",")]
        header(a, f"sweep, each scheduler alone: {', '.join(f'{r:g}' for r in rates)} firings/s, {a.over:g} s each, "
                  f"{a.repeat} alternated run(s) each")
        for rate in rates:
            alone_rounds(Workload([(rate, a.over)]), a, rows, peer=not a.skip_peer)
        print_table(rows, late_s, "sweep, each scheduler alone")
        return
    w = Workload.parse(a.segments) if a.segments else (
        Workload.parse("1000:60,100:20") if a.burst else Workload.even(a.jobs, a.over))
    if a.burst:
        header(a, f"burst, each scheduler alone: {w.label()}")
        results = []
        for which in ["millwright"] + ([] if a.skip_peer else ["apscheduler"]):
            print(f"== {which} alone, {w.label()}", flush=True)
            res = run_alone(which, w, a)
            res["burst_end_s"] = w.segments[0][1]
            report_run(res, f"alone, burst {w.spec()}", late_s)
            rows.append(row(res, w.spec(), 1, late_s))
            results.append(res)
            time.sleep(2)
        for res in results:
            print_buckets(res)
        print_table(rows, late_s, "burst, each scheduler alone")
        return
    if a.alone:
        header(a, f"each scheduler alone: {w.label()}, {a.repeat} alternated run(s)")
        alone_rounds(w, a, rows, peer=not a.skip_peer)
        print_table(rows, late_s, "each scheduler alone")
        return
    header(a, f"side by side{'' if a.skip_peer else ' (both at once, due times interleaved)'}: {w.label()}")
    for k in range(a.repeat):
        mine, theirs = run_side_by_side(w, a)
        report_run(mine, f"side by side, run {k + 1}", late_s)
        rows.append(row(mine, rate_label(w), k + 1, late_s))
        if theirs is not None:
            report_run(theirs, f"side by side, run {k + 1}", late_s)
            rows.append(row(theirs, rate_label(w), k + 1, late_s))
            print(f"ratio at the job's clock (millwright / apscheduler): "
                  f"p50 {pct(list(mine['lateness'].values()), 50) / pct(list(theirs['lateness'].values()), 50):.2f}x, "
                  f"p99 {pct(list(mine['lateness'].values()), 99) / pct(list(theirs['lateness'].values()), 99):.2f}x")
    print_table(rows, late_s, "side by side" if not a.skip_peer else "millwright")


def add_workload_args(ap: argparse.ArgumentParser, backend: str = "auto") -> None:
    """The options of the Millwright run (also bench/profile_firing_stages.py's)."""
    ap.add_argument("--jobs", type=int, default=3000)
    ap.add_argument("--over", type=float, default=30.0)
    ap.add_argument("--backend", default=backend)
    ap.add_argument("--lead", type=float, default=0.25, help="execute.claim_lead_s")
    ap.add_argument("--runtime-dir", default=None,
                    help='execute.runtime_dir (default: a fresh dir on /dev/shm; "": the run directories)')
    ap.add_argument("--bpf", action="store_true", help="the agent's BPF sensor on (exec policy in monitor mode)")
    ap.add_argument("--user", default="root", help="the job's user, for both schedulers (e.g. nobody: a user switch per job)")


if __name__ == "__main__":
    main()
