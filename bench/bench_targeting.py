#!/usr/bin/env python3
"""Targeting failover on a real etcd with real agent processes (issue 15).

Four agents, labels line=1 (two) and line=2 (two); jobs targeted at line 2 create its
placement pool. Each trial kills -9 one line-2 agent and times until every one of its
shards of the line-2 pool is owned by the other line-2 agent; then restarts it and waits
until the pool is shared again. Prints p50/p99/max against the TTL (contract: TTL + 1 s),
and whether a line-1 agent ever held a line-2 pool shard.

Usage: bench_targeting.py [--trials 10] [--ttl 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent.coordination import placement  # noqa: E402
from agent.coordination.jobstore import JobStore  # noqa: E402
from agent.demo.services import EtcdServer  # noqa: E402
from agent.runtime.timefmt import format_rfc3339  # noqa: E402
from tests.support.cluster import Cluster  # noqa: E402
from tests.support.waiting import wait_for  # noqa: E402
from tests.support.jobs import job, now, templates  # noqa: E402

LABELS = {"l1a": "1", "l1b": "1", "l2a": "2", "l2b": "2"}


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--ttl", type=int, default=3)
    args = ap.parse_args()
    ttl = args.ttl
    with tempfile.TemporaryDirectory() as tmp, EtcdServer(os.path.join(tmp, "etcd")) as etcd:
        os.makedirs(etcd.dir, exist_ok=True)
        c = Cluster(etcd, os.path.join(tmp, "agents"), ttl=ttl, renew_deadline=ttl * 0.6, retry_period=ttl * 0.15,
                    extra={"templates": templates(os.path.join(tmp, "effects.txt"))})
        try:
            for a, line in LABELS.items():
                c.start(a, extra={"labels": {"line": line}})
            store = c.signing(JobStore(c.client, c.keys, c.shards, "bench"))
            t = format_rfc3339(now())
            for i in range(50):
                store.create(job(f"l2-{i}", {"cron": "0 0 1 1 *"}, issued_at=t, target={"labels": {"line": "2"}}))
            pool = placement.pool_id({"template": "rec", "labels": {"line": "2"}})
            prefix = c.keys.pool_shards_prefix(pool)

            def owners():
                kvs, _ = c.client.get_prefix(prefix)
                return {kv.key: kv.value.decode() for kv in kvs}

            seen: set[str] = set()

            def shared():
                o = owners()
                seen.update(o.values())
                return len(o) == c.shards and set(o.values()) == {"l2a", "l2b"}

            wait_for(shared, 60, what="line-2 pool shared")
            times = []
            for trial in range(args.trials):
                victim, other = ("l2a", "l2b") if trial % 2 == 0 else ("l2b", "l2a")
                mine = {k for k, a in owners().items() if a == victim}
                t0 = time.monotonic()
                c.agents[victim].kill()
                while True:
                    o = owners()
                    seen.update(o.values())
                    if all(o.get(k) == other for k in mine):
                        break
                    time.sleep(0.005)
                dt = time.monotonic() - t0
                times.append(dt)
                print(f"  trial {trial + 1:3d}: {len(mine)} pool shards of {victim} -> {other} in {dt:.3f} s")
                c.start(victim, extra={"labels": {"line": LABELS[victim]}})
                wait_for(shared, 60, what="line-2 pool shared again")
            print(f"line-2 pool failover over {len(times)} kill -9 trials (TTL {ttl} s): p50 {pct(times, 50):.3f} s, "
                  f"p99 {pct(times, 99):.3f} s, max {max(times):.3f} s; max - TTL = {max(times) - ttl:+.3f} s "
                  f"(contract: TTL + 1 s)")
            print(f"holders of line-2 pool shards ever seen: {sorted(seen)} "
                  f"({'no line-1 agent' if seen <= {'l2a', 'l2b'} else 'A LINE-1 AGENT HELD ONE'})")
        finally:
            c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
