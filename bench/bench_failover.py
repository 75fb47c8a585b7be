#!/usr/bin/env python3
"""Coordination benchmarks on a real etcd with real agent processes (issue 2).

1. Failover time over N kill -9 trials: from the kill until every shard of the victim
   is owned by a survivor; p50, p99 and max against the lease TTL.
2. Self-fence lead time: an agent cut off from etcd by nftables; how long before the
   server-side expiry of its lease (its shard keys vanishing) it stopped acting.
3. Shards moved when a member joins or leaves, against the ideal (shards / members),
   over many random member sets (the same function every agent runs) and in one real run.
4. Lateness around a takeover (issue 36): three agents, one-shot jobs due at 10/s (300
   jobs), the job body of bench_trigger.py (its own clock), kill -9 of one agent; the
   lateness at the job's clock of the firings due before the kill, between the kill and
   the takeover's completion (every shard of the dead agent owned again: its firings due
   then wait for the new owner by design), in the 10 s after it (where a takeover must
   leave no tail), and after; the taken-over shards' firings apart. Every firing's runs
   are counted (job clock lines, run records).

Usage: bench_failover.py [--only movement,fence,failover,lateness] [--trials 50] [--ttl 3] [--fence-trials 5]
                         [--lateness-jobs 300 --lateness-rate 10 --kill-at 8]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from trigger_workload import Workload, job_script, load, once_check, read_clocks, stats  # noqa: E402

from agent.coordination import hrw  # noqa: E402
from agent.coordination.keys import shard_of  # noqa: E402
from agent.jobs.schedule import format_rfc3339, parse_rfc3339  # noqa: E402
from agent.demo.services import EtcdServer  # noqa: E402
from tests.support.cluster import Cluster  # noqa: E402
from tests.support.network import NftBlock  # noqa: E402
from tests.support.waiting import wait_for  # noqa: E402


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def failover(trials: int, ttl: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, EtcdServer(os.path.join(tmp, "etcd")) as etcd:
        os.makedirs(etcd.dir, exist_ok=True)
        c = Cluster(etcd, os.path.join(tmp, "agents"), ttl=ttl, renew_deadline=ttl * 0.6, retry_period=ttl * 0.15)
        try:
            live = [f"g{i}" for i in range(3)]
            for a in live:
                c.start(a)
            wait_for(lambda: c.converged({a: 1 for a in live}), 60, what="initial plan")
            times = []
            for t in range(trials):
                victim = live.pop(random.randrange(len(live)))
                shards = {s for s, a in c.owners().items() if a == victim}
                t0 = time.monotonic()
                c.agents[victim].kill()
                wait_for(lambda: all(c.owners().get(s) in live for s in shards), ttl + 30, interval=0.01,
                         what="failover")
                times.append(time.monotonic() - t0)
                new = f"g{3 + t}"
                c.start(new)
                live.append(new)
                wait_for(lambda: c.converged({a: 1 for a in live}), 60, what="rejoin")
                print(f"  trial {t + 1:3d}: failover {times[-1]:.3f} s", flush=True)
            print(f"failover over {trials} kill -9 trials (TTL {ttl} s): p50 {pct(times, 50):.3f} s, "
                  f"p99 {pct(times, 99):.3f} s, max {max(times):.3f} s, mean {statistics.mean(times):.3f} s; "
                  f"max - TTL = {max(times) - ttl:+.3f} s")
        finally:
            c.close()


def fence_lead(trials: int, ttl: int) -> None:
    from agent.daemon.admin import query

    leads = []
    with tempfile.TemporaryDirectory() as tmp, EtcdServer(os.path.join(tmp, "etcd")) as etcd:
        os.makedirs(etcd.dir, exist_ok=True)
        c = Cluster(etcd, os.path.join(tmp, "agents"), ttl=ttl, renew_deadline=ttl * 0.6, retry_period=ttl * 0.15)
        try:
            c.start("peer")
            for t in range(trials):
                cut = c.start(f"cut{t}", endpoint_host="127.0.0.2")
                wait_for(lambda: c.converged({"peer": 1, f"cut{t}": 1}), 60, what="plan")
                held = {s for s, a in c.owners().items() if a == f"cut{t}"}
                with NftBlock("127.0.0.2", etcd.port):
                    t0 = time.monotonic()
                    wait_for(lambda: query(cut.config["admin"]["socket"])["session"]["fenced"], ttl + 10,
                             interval=0.005, what="fence")
                    t_fence = time.monotonic() - t0
                    wait_for(lambda: not (held & {s for s, a in c.owners().items() if a == f"cut{t}"}), ttl + 10,
                             interval=0.005, what="expiry")
                    t_expire = time.monotonic() - t0
                cut.kill()
                leads.append(t_expire - t_fence)
                print(f"  trial {t + 1}: fenced after {t_fence:.3f} s, lease expired after {t_expire:.3f} s, "
                      f"lead {t_expire - t_fence:.3f} s", flush=True)
            print(f"self-fence lead time over {trials} partitions (TTL {ttl} s, renew deadline {ttl * 0.6:.1f} s): "
                  f"min {min(leads):.3f} s, mean {statistics.mean(leads):.3f} s, max {max(leads):.3f} s")
        finally:
            c.close()


def movement() -> None:
    rng = random.Random(1)
    join, leave = [], []
    for _ in range(300):
        names = [f"gw-{rng.randrange(10 ** 9)}" for _ in range(5)]
        m4 = {n: 1.0 for n in names[:4]}
        m5 = {n: 1.0 for n in names}
        a4, a5 = hrw.assignment(64, m4), hrw.assignment(64, m5)
        join.append(sum(a4[s] != a5[s] for s in range(64)))
        m3 = {n: 1.0 for n in names[:3]}
        a3 = hrw.assignment(64, m3)
        leave.append(sum(a4[s] != a3[s] for s in range(64)))
    print(f"shards moved, 64 shards, 300 random member sets: 4->5 join mean {statistics.mean(join):.1f} "
          f"(max {max(join)}, ideal {64 / 5:.1f}); 4->3 leave mean {statistics.mean(leave):.1f} "
          f"(max {max(leave)}, ideal {64 / 4:.1f})")


def takeover_lateness(ttl: int, jobs: int, rate: float, kill_at: float, agents: int = 3) -> None:
    """Lateness at the job's clock around a kill -9 of one of ``agents`` agents (see the
    module docstring, 4)."""
    w = Workload([(rate, jobs / rate)])
    print(f"takeover lateness: {agents} agents, {w.label()}, kill -9 of one {kill_at:g} s after the first due "
          f"time, TTL {ttl} s; {load()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp, EtcdServer(os.path.join(tmp, "etcd")) as etcd:
        os.makedirs(etcd.dir, exist_ok=True)
        os.makedirs(os.path.join(tmp, "job"))
        script, out = job_script(os.path.join(tmp, "job"))
        clock = {"argv": [script], "user": "root", "allow_root": True, "allow_exec": ["/bin/*", "/usr/bin/*"]}
        c = Cluster(etcd, os.path.join(tmp, "agents"), ttl=ttl, renew_deadline=ttl * 0.6, retry_period=ttl * 0.15,
                    extra={"templates": {"clock": clock},
                           "execute": {"max_concurrent": 64, "memory_mb": 16384, "cpu": 64.0}})
        try:
            names = [f"g{i}" for i in range(agents)]
            for a in names:
                c.start(a)
            wait_for(lambda: c.converged({a: 1 for a in names}), 60, what="initial plan")
            store = c.job_store()
            start = datetime.now(timezone.utc) + timedelta(seconds=8)
            due: dict[str, float] = {}
            batch = []
            for i, off in enumerate(w.offsets):
                jid = f"t{i:05d}"
                at = parse_rfc3339(format_rfc3339(start + timedelta(seconds=off)))
                due[jid] = at.timestamp()
                batch.append((store.sign({"v": 1, "id": jid, "template": "clock", "params": {},
                                          "schedule": {"at": format_rfc3339(at)}}), ()))
            for k in range(0, len(batch), 64):
                for res in store.store.create_many(batch[k:k + 64]):
                    if isinstance(res, Exception):
                        raise res
            victim = names[0]
            t_kill = start.timestamp() + kill_at
            while time.time() < t_kill:
                time.sleep(min(0.05, max(0.0, t_kill - time.time())))
            lost = {s for s, a in c.owners().items() if a == victim}
            t_kill = time.time()
            os.kill(c.agents[victim].pid, signal.SIGKILL)
            live = set(names) - {victim}
            wait_for(lambda: all(c.owners().get(s) in live for s in lost), ttl + 30, interval=0.01, what="takeover")
            t_over = time.time()
            c.agents[victim].kill()   # reaps it
            end = start.timestamp() + w.span + 30
            while time.time() < end and len(read_clocks(out, due)[0]) < w.n:
                time.sleep(0.5)
            time.sleep(1.0)
            lateness, counts = read_clocks(out, due)
            recs = c.run_records()
            acquired = [parse_rfc3339(r["ts"]).timestamp() for a in live for r in c.audit(a)
                        if r.get("type") == "shard" and r.get("event") == "acquired" and r.get("shard") in lost]
        finally:
            c.close()
    taken = {j for j in due if shard_of(j, c.shards) in lost}
    print(f"killed {victim} (held {len(lost)} of {c.shards} shards; {len(taken)} of the {w.n} jobs) at +{t_kill - start.timestamp():.2f} s; "
          f"every shard owned again {t_over - t_kill:.2f} s after the kill"
          + (f" (last 'acquired' audit record {max(acquired) - t_kill:.2f} s after)" if acquired else ""))
    windows = (("due before the kill", None, t_kill), ("kill -> takeover complete", t_kill, t_over),
               ("takeover -> +10 s", t_over, t_over + 10), ("after takeover +10 s", t_over + 10, None))
    print("| firings due | which | n | ran | p50 ms | p99 ms | max ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, lo, hi in windows:
        sel = [j for j, t in due.items() if (lo is None or t >= lo) and (hi is None or t < hi)]
        for which, js in (("all", sel), ("taken-over shards", [j for j in sel if j in taken]),
                          ("other shards", [j for j in sel if j not in taken])):
            st = stats([lateness[j] for j in js if j in lateness], 0.0)
            f = lambda x: "-" if x is None else f"{x * 1000:.1f}"  # noqa: E731
            print(f"| {label} | {which} | {len(js)} | {st['n']} | {f(st['p50'])} | {f(st['p99'])} | {f(st['max'])} |")
    once = once_check(w.n, counts)
    per_job = collections.Counter(j for j, _ in recs)
    states = collections.Counter(r.get("state") for r in recs.values())
    reasons = collections.Counter(r.get("reason") for r in recs.values() if r.get("state") != "succeeded")
    print(f"runs (job clocks): exactly once {once['once']}, never {once['never']}, more than once {once['more']} of {w.n}; "
          f"run records {len(recs)} {dict(states)}"
          + (f", not succeeded by reason {json.dumps(dict(reasons))}" if reasons else "")
          + f"; jobs without a record {w.n - len(per_job)}, with more than one {sum(1 for v in per_job.values() if v > 1)}")
    print(f"after: {load()}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="movement,fence,failover,lateness",
                    help="which measurements, comma-separated: movement, fence, failover, lateness")
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--ttl", type=int, default=3)
    ap.add_argument("--fence-trials", type=int, default=5)
    ap.add_argument("--lateness-jobs", type=int, default=300)
    ap.add_argument("--lateness-rate", type=float, default=10.0)
    ap.add_argument("--kill-at", type=float, default=8.0, help="seconds after the first due time")
    a = ap.parse_args()
    only = set(a.only.split(","))
    if "movement" in only:
        movement()
    if "fence" in only:
        fence_lead(a.fence_trials, a.ttl)
    if "failover" in only:
        failover(a.trials, a.ttl)
    if "lateness" in only:
        takeover_lateness(a.ttl, a.lateness_jobs, a.lateness_rate, a.kill_at)


if __name__ == "__main__":
    main()
