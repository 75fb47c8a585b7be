#!/usr/bin/env python3
"""Staged rollouts on a real etcd with real agent processes (issue 38).

1. Overhead per agent start: N line-1 agents run a fan-out job without a rollout, then the
   same job with one (``max_concurrent`` = N: nothing waits, every start writes a claim and a
   start key), alternating. Per agent start: the agents' etcd requests
   (``millwright_etcd_requests_total``, by op) and the start's lateness after its due time
   (side effect's clock), with minus without.
2. Abort reaction: N agents whose runs all fail, ``max_concurrent: 1``, abort at the first
   failure. From the failing run's end (its side effect) to the rollout's abort mark and to
   the last agent's refusal (``rollout_aborted`` in its audit log), on the host's clock.

Usage: bench_rollout.py [--agents 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent.demo.services import EtcdServer, free_port  # noqa: E402
from agent.jobs import rollout as ro  # noqa: E402
from agent.jobs.schedule import parse_rfc3339  # noqa: E402
from tests.support import history  # noqa: E402
from tests.support.rollouts import Fleet  # noqa: E402
from tests.support.waiting import wait_for  # noqa: E402


def etcd_requests(ports: list[int]) -> collections.Counter:
    """Sum over the agents of millwright_etcd_requests_total by op."""
    out: collections.Counter = collections.Counter()
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("millwright_etcd_requests_total{"):
                    labels, value = line.rsplit(" ", 1)
                    op = labels.split('op="', 1)[1].split('"', 1)[0]
                    out[op] += float(value)
    return out


def lateness_ms(fleet: Fleet, job_id: str) -> list[float]:
    doc = fleet.store.get(job_id).doc
    due = parse_rfc3339(doc["issued_at"]).timestamp()
    return [(se.start - due) * 1000 for se in history.parse_effects(fleet.out)
            if se.job == job_id and not ro.rolled_back(se.fire_id)]


def overhead(tmp: str, n: int, rounds: int) -> None:
    with EtcdServer(os.path.join(tmp, "etcd-a")) as etcd:
        agents = [f"l1-{i:02d}" for i in range(n)]
        ports = {a: free_port() for a in agents}
        fleet = Fleet(etcd, os.path.join(tmp, "a"))
        try:
            for a in agents:
                fleet.start(a, metrics={"listen": f"127.0.0.1:{ports[a]}"})
            wait_for(lambda: fleet.c.members() == set(agents), 60, what="members")
            fleet.push("warm-up", None, sleep="0")   # the placement pool is made and loaded once
            wait_for(lambda: len(fleet.finals("warm-up")) == n, 60, interval=0.1, what="warm-up done")
            time.sleep(3)
            ops: dict = {"plain": collections.Counter(), "staged": collections.Counter()}
            late: dict = {"plain": [], "staged": []}
            for r in range(rounds):
                for kind in ("plain", "staged"):
                    before = etcd_requests(list(ports.values()))
                    job_id = f"{kind}-{r}"
                    fleet.push(job_id, {"max_concurrent": n} if kind == "staged" else None, sleep="0")
                    wait_for(lambda: len(fleet.finals(job_id)) == n, 60, interval=0.1, what=f"{job_id} done")
                    time.sleep(2)   # the outcomes' watch events and any late writes land
                    after = etcd_requests(list(ports.values()))
                    ops[kind].update(after - before)
                    late[kind] += lateness_ms(fleet, job_id)
            starts = n * rounds
            print(f"overhead per agent start ({n} agents, {rounds} rounds; etcd requests by op, per start):")
            for op in sorted(set(ops["plain"]) | set(ops["staged"])):
                p, s = ops["plain"][op] / starts, ops["staged"][op] / starts
                print(f"  {op:<12} without {p:6.2f}  with {s:6.2f}  (+{s - p:.2f})")
            for kind in ("plain", "staged"):
                xs = late[kind]
                print(f"  start after due ({kind}): p50 {statistics.median(xs):.1f} ms, max {max(xs):.1f} ms")
            print(f"  rollout's share of a start: +{statistics.median(late['staged']) - statistics.median(late['plain']):.1f}"
                  " ms (p50)")
        finally:
            fleet.close()


def abort_reaction(tmp: str, n: int, rounds: int) -> None:
    with EtcdServer(os.path.join(tmp, "etcd-b")) as etcd:
        agents = [f"l1-{i:02d}" for i in range(n)]
        fleet = Fleet(etcd, os.path.join(tmp, "b"), failing=set(agents))
        try:
            for a in agents:
                fleet.start(a)
            wait_for(lambda: fleet.c.members() == set(agents), 60, what="members")
            time.sleep(3)
            to_mark, to_last = [], []
            for r in range(rounds):
                job_id = f"abort-{r}"
                fleet.push(job_id, {"max_concurrent": 1, "abort": {"failed_pct": 1, "min_finished": 1}}, sleep="0.5")
                wait_for(lambda: len(fleet.finals(job_id)) == n, 60, interval=0.1, what=f"{job_id} done")
                time.sleep(1)
                failed = [se for se in history.parse_effects(fleet.out) if se.job == job_id and se.end is not None
                          and not ro.rolled_back(se.fire_id)]
                t_fail = min(se.end for se in failed)
                audit = [rec for a in agents for rec in fleet.c.audit(a) if rec.get("job") == job_id]
                mark = [parse_rfc3339(x["ts"]).timestamp() for x in audit if x.get("event") == "rollout_abort"]
                refused = [parse_rfc3339(x["ts"]).timestamp() for x in audit if x.get("event") == "rollout_aborted"]
                to_mark.append((min(mark) - t_fail) * 1000)
                to_last.append((max(refused) - t_fail) * 1000)
                print(f"  round {r}: {len(failed)} run(s), {len(refused)} refusals; mark +{to_mark[-1]:.0f} ms, "
                      f"last refusal +{to_last[-1]:.0f} ms after the failing run ended")
            print(f"abort reaction ({n} agents): threshold-crossing failure -> abort mark p50 "
                  f"{statistics.median(to_mark):.0f} ms, -> last agent refusing p50 {statistics.median(to_last):.0f} ms, "
                  f"max {max(to_last):.0f} ms")
        finally:
            fleet.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        overhead(tmp, args.agents, args.rounds)
        abort_reaction(tmp, args.agents, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
