#!/usr/bin/env python3
"""Coordination benchmarks on a real etcd with real agent processes (issue 2).

1. Failover time over N kill -9 trials: from the kill until every shard of the victim
   is owned by a survivor; p50, p99 and max against the lease TTL.
2. Self-fence lead time: an agent cut off from etcd by nftables; how long before the
   server-side expiry of its lease (its shard keys vanishing) it stopped acting.
3. Shards moved when a member joins or leaves, against the ideal (shards / members),
   over many random member sets (the same function every agent runs) and in one real run.

Usage: bench_failover.py [--trials 50] [--ttl 3] [--fence-trials 5]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent.coordination import hrw  # noqa: E402
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
    from agent.runtime.admin import query

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--ttl", type=int, default=3)
    ap.add_argument("--fence-trials", type=int, default=5)
    a = ap.parse_args()
    movement()
    fence_lead(a.fence_trials, a.ttl)
    failover(a.trials, a.ttl)


if __name__ == "__main__":
    main()
