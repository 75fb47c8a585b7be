#!/usr/bin/env python3
"""Scale figures (issue 14) on a real etcd with real agent processes.

takeover   time from a shard's acquisition to its jobs being armed, against the shard's
           run-record count (one agent, `shards: 1`, so the whole record set is one shard)
cluster    N jobs across S shards with A agents (real `millwright run` processes, BPF off):
           initial load, then kill -9 of one agent: failover time (kill until every shard
           is owned by a survivor and loaded, TTL included), agent RSS against jobs owned
memory     what an agent's memory holds per owned job (tracemalloc over the real install path)
month      etcd DB size after a simulated month of a realistic mix with retention on
           (see month() for exactly what is written and how time is compressed)

Jobs and records are written straight into etcd in the formats the product writes
(JobStore.create's value; the scheduler's run record and its latest/ copy), in batched
transactions, because pushing 100,000 jobs through MQTT would measure the broker.
Every sub-run is bounded (minutes). The load average is printed next to each figure.

Usage: bench_scale.py takeover [--records 0,1000,5000,20000]
       bench_scale.py cluster [--jobs 100000] [--shards 64] [--agents 3] [--ttl 4]
       bench_scale.py month [--days 30] [--cron 500] [--oneshots-per-day 5000]
       bench_scale.py memory [--jobs 100000]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent.coordination.etcd import Put  # noqa: E402
from agent.coordination.keys import shard_of  # noqa: E402
from agent.demo.services import EtcdServer  # noqa: E402
from agent.jobs.schedule import fire_id, format_rfc3339  # noqa: E402
from agent.daemon.admin import query  # noqa: E402
from tests.support.cluster import Cluster  # noqa: E402
from tests.support.waiting import wait_for  # noqa: E402

TEMPLATES = {"noop": {"argv": ["/bin/true"], "user": "root", "allow_root": True}}
# accepted a minute ago: a daily job then has no missed firing to record at install
ACCEPTED_AT = format_rfc3339(datetime.now(timezone.utc) - timedelta(minutes=1))


def load() -> str:
    return "load %.1f/%.1f/%.1f" % os.getloadavg()


def job_value(job_id: str, schedule: dict, **kw) -> str:
    """The value JobStore.create stores."""
    doc = {"v": 1, "id": job_id, "template": "noop", "params": {}, "schedule": schedule, **kw,
           "_accepted": {"at": ACCEPTED_AT, "by": "bench"}}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def record_value(job_id: str, shard: int, due: datetime, state: str = "succeeded") -> str:
    """A final run record as Scheduler._record writes it."""
    return json.dumps({"v": 1, "job_id": job_id, "fire_id": fire_id(job_id, due), "due": format_rfc3339(due),
                       "state": state, "attempt": 1, "agent": "gw-line3-cell07", "shard": shard,
                       "started_at": format_rfc3339(due), "ended_at": format_rfc3339(due + timedelta(seconds=2)),
                       "exit_code": 0, "reason": "succeeded", "health": "healthy",
                       "usage": {"cpu_s": 0.21, "max_rss_bytes": 14123008, "oom_kills": 0, "throttled_s": 0.0},
                       "retry_at": None})


class Writer:
    """Batched puts (100 per transaction)."""

    def __init__(self, client):
        self.client, self.ops, self.n = client, [], 0

    def put(self, key: str, value: str) -> None:
        self.ops.append(Put(key, value))
        if len(self.ops) >= 100:
            self.flush()

    def flush(self) -> None:
        if self.ops:
            self.client.txn([], self.ops)
            self.n += len(self.ops)
            self.ops = []


def daily_jobs(c: Cluster, n: int, prefix: str = "j") -> None:
    w = Writer(c.client)
    for i in range(n):
        jid = f"{prefix}{i:06d}"
        # daily at 03:00 Berlin: realistic, and never due during a bench
        w.put(c.keys.job(shard_of(jid, c.shards), jid), job_value(jid, {"cron": "0 3 * * *", "tz": "Europe/Berlin"},
                                                                  misfire="skip"))
    w.flush()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def agent_status(a) -> dict:
    try:
        return query(a.config["admin"]["socket"], timeout=5)
    except Exception:
        return {}


def patient(c: Cluster) -> Cluster:
    """The bench's own client waits longer than the agents' (the host is shared and loaded)."""
    from agent.config import EtcdConfig
    from agent.coordination.etcd import EtcdClient

    c.client.close()
    c.client = EtcdClient(EtcdConfig(endpoints=[c.etcd.endpoint], request_timeout_s=20.0))
    return c


def settled(c: Cluster, agents: list[str], jobs: int) -> bool:
    from agent.coordination.etcd import EtcdUnavailable

    try:
        if not c.all_owned_by(set(agents)):
            return False
    except EtcdUnavailable:
        return False
    total = 0
    for a in agents:
        st = agent_status(c.agents[a])
        j = st.get("jobs") or {}
        if not st or j.get("loading_shards"):
            return False
        total += j.get("owned_jobs", 0)
    return total == jobs


# --- takeover time against record count ------------------------------------------------------

def takeover(records: list[int]) -> None:
    print(f"takeover: one shard holding 20 jobs and N run records; acquisition -> jobs armed ({load()})")
    for n in records:
        with tempfile.TemporaryDirectory() as tmp, EtcdServer(os.path.join(tmp, "etcd")) as etcd:
            os.makedirs(etcd.dir, exist_ok=True)
            c = Cluster(etcd, os.path.join(tmp, "agents"), shards=1, extra={"templates": TEMPLATES})
            try:
                jobs = [f"old{i}" for i in range(20)]
                w = Writer(c.client)
                base = datetime(2026, 1, 1, tzinfo=timezone.utc)
                for j in jobs:
                    w.put(c.keys.job(0, j), job_value(j, {"cron": "0 3 1 1 *"}, misfire="skip"))
                    for i in range(n // len(jobs)):
                        w.put(c.keys.run(0, j, fire_id(j, base + timedelta(seconds=i))),
                              record_value(j, 0, base + timedelta(seconds=i)))
                w.flush()
                size = sum(len(kv.value) for kv in c.client.get_prefix(c.keys.runs_prefix())[0])
                a = c.start("t0")
                t_acq = t_done = None
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    st = agent_status(a)
                    if st and st["shards"]["count"] == 1:
                        t_acq = t_acq or time.monotonic()
                        if not st["jobs"]["loading_shards"] and st["jobs"]["owned_jobs"] == len(jobs):
                            t_done = time.monotonic()
                            break
                    time.sleep(0.005)
                took = (t_done - t_acq) if t_acq and t_done else float("nan")
                print(f"  {n:6d} records ({size / 1e6:5.1f} MB): takeover {took * 1000:7.0f} ms   ({load()})", flush=True)
            finally:
                c.close()


# --- cluster: initial load, failover, RSS ------------------------------------------------------

def cluster(jobs: int, shards: int, agents: int, ttl: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, EtcdServer(os.path.join(tmp, "etcd")) as etcd:
        os.makedirs(etcd.dir, exist_ok=True)
        c = Cluster(etcd, os.path.join(tmp, "agents"), shards=shards, ttl=ttl, renew_deadline=ttl * 0.6,
                    retry_period=ttl * 0.15, extra={"templates": TEMPLATES})
        patient(c)
        try:
            t = time.monotonic()
            daily_jobs(c, jobs)
            print(f"cluster: {jobs} jobs, {shards} shards, {agents} agents (real processes, BPF off, TTL {ttl} s); "
                  f"jobs written in {time.monotonic() - t:.1f} s ({load()})", flush=True)
            names = [f"s{i:02d}" for i in range(agents)]
            t = time.monotonic()
            for n in names:
                c.start(n)
            wait_for(lambda: settled(c, names, jobs), 600, interval=0.2, what="initial load")
            print(f"  start -> every shard owned and loaded: {time.monotonic() - t:.1f} s ({load()})", flush=True)
            rows = []
            for n in names:
                st = agent_status(c.agents[n])
                rows.append((st["jobs"]["owned_jobs"], rss_mb(c.agents[n].pid), st["shards"]["count"]))
            rows.sort()
            print("  agent RSS vs jobs owned: " + ", ".join(f"{j} jobs/{s} shards: {r:.0f} MB" for j, r, s in rows))
            if agents == 1:
                return
            victim = names[0]
            lost = {s for s, a in c.owners().items() if a == victim}
            lost_jobs = agent_status(c.agents[victim])["jobs"]["owned_jobs"]
            t0 = time.monotonic()
            c.agents[victim].kill()
            live = names[1:]
            def owned() -> bool:
                try:
                    return all(c.owners().get(s) in live for s in lost)
                except Exception:
                    return False
            wait_for(owned, ttl + 60, interval=0.01, what="owned")
            t_owned = time.monotonic() - t0
            wait_for(lambda: settled(c, live, jobs), 600, interval=0.05, what="loaded")
            t_loaded = time.monotonic() - t0
            print(f"  kill -9 of an agent with {len(lost)} shards / {lost_jobs} jobs: owned again after "
                  f"{t_owned:.2f} s, loaded after {t_loaded:.2f} s (TTL {ttl} s; load after TTL "
                  f"{t_loaded - t_owned:.2f} s) ({load()})", flush=True)
            rows = [(agent_status(c.agents[n])["jobs"]["owned_jobs"], rss_mb(c.agents[n].pid)) for n in live]
            print("  survivors RSS vs jobs owned: " + ", ".join(f"{j} jobs: {r:.0f} MB" for j, r in sorted(rows)))
        finally:
            c.close()


# --- a simulated month ------------------------------------------------------------------------

def month(days: int, cron: int, oneshots: int, per_day: int = 150, shards: int = 64) -> None:
    """etcd DB size after `days` of: `cron` jobs firing every minute and `oneshots` one-shot
    jobs a day, with retention's defaults (keep_runs 100, finished_job_s 7 d, tombstone_s 7 d).

    Time is compressed: day by day, the records and jobs that day would leave are written
    (a cron job's 1,440 daily firings are written as its newest `per_day` records, of
    which retention keeps 100 and deletes the rest, so the store churns as it does; the
    other firings' writes and deletes leave nothing after compaction either);
    retention's own pass (Retention.run_shard, with a clock set to the simulated day) then
    trims and tombstones, and the day ends with a compaction (what the shard-0 owner does
    every 5 minutes). The DB size is read with etcd's Status before and after a
    defragmentation."""
    from agent.config import parse_config
    from agent.coordination.fencing import fence_for
    import etcd3.etcdrpc as etcdrpc

    from agent.jobs.retention import Retention

    with tempfile.TemporaryDirectory() as tmp, EtcdServer(os.path.join(tmp, "etcd")) as etcd:
        os.makedirs(etcd.dir, exist_ok=True)
        c = Cluster(etcd, os.path.join(tmp, "agents"), shards=shards)
        cfg = parse_config("etcd: {insecure: true}\nretention: {max_deletes_per_s: 1000000}\n")
        # the fence: this bench holds every shard key, as an owner would
        lease, _ = c.client.lease_grant(600)
        fences = {}
        for s in range(shards):
            r = c.client.txn([], [Put(c.keys.shard(s), "bench", lease=lease)])
            fences[s] = fence_for(c.keys, s, r.revision)

        class _Loop:  # just what Retention's own worker reads (run_shard is called here directly)
            post = staticmethod(lambda *a: None)

        sim_now = [datetime(2026, 11, 1, tzinfo=timezone.utc).timestamp()]
        ret = Retention(cfg, _Loop(), c.client, c.keys, ownership=None, audit=None, catalog=None,
                        clock=lambda: sim_now[0])
        cron_ids = [f"cron{i:04d}" for i in range(cron)]
        w = Writer(c.client)
        for j in cron_ids:
            w.put(c.keys.job(shard_of(j, shards), j), job_value(j, {"cron": "* * * * *"}))
        w.flush()
        start = datetime.fromtimestamp(sim_now[0], timezone.utc)
        t_all = time.monotonic()
        for day in range(days):
            d0 = start + timedelta(days=day)
            for j in cron_ids:
                s = shard_of(j, shards)
                for m in range(per_day):  # the day's last minutes: the newest 100 stay
                    due = d0 + timedelta(minutes=1440 - per_day + m)
                    v = record_value(j, s, due)
                    w.put(c.keys.run(s, j, fire_id(j, due)), v)
                w.put(c.keys.latest(s, j), v)
            for i in range(oneshots):
                j = f"d{day:02d}-{i:05d}"
                s = shard_of(j, shards)
                due = d0 + timedelta(seconds=i * 86400 / oneshots)
                w.put(c.keys.job(s, j), job_value(j, {"at": format_rfc3339(due)}))
                v = record_value(j, s, due)
                w.put(c.keys.run(s, j, fire_id(j, due)), v)
                w.put(c.keys.latest(s, j), v)
            w.flush()
            sim_now[0] = (d0 + timedelta(days=1)).timestamp()
            totals = {}
            for s in range(shards):
                for k, v in ret.run_shard(fences[s]).items():
                    if k != "read_revision":
                        totals[k] = totals.get(k, 0) + v
            c.client.lease_keepalive(lease)
            rev = c.client.status()["revision"]
            c.client.compact(rev)
            st = c.client.status()
            keys = c.client.count_prefix(c.keys.prefix)
            print(f"  day {day + 1:2d}: {keys:7d} keys, DB {st['db_size'] / 1e6:6.1f} MB, revision {rev}, "
                  f"retention {totals} ({time.monotonic() - t_all:.0f} s, {load()})", flush=True)
        time.sleep(2)  # compaction finishes in the background
        before = c.client.status()["db_size"]
        t = time.monotonic()
        c.client.client()[0].maintenancestub.Defragment(etcdrpc.DefragmentRequest(), 300)
        took = time.monotonic() - t
        after = c.client.status()["db_size"]
        live = sum(len(kv.key) + len(kv.value) for kv in c.client.get_prefix(c.keys.prefix)[0])
        print(f"month: {cron} cron jobs at 1/min + {oneshots} one-shots/day, {days} days, retention defaults: "
              f"DB {before / 1e6:.1f} MB before defrag, {after / 1e6:.1f} MB after (defrag took {took:.1f} s); live keys+values "
              f"{live / 1e6:.1f} MB ({load()})")
        c.close()


# --- what an agent's memory holds per owned job -------------------------------------------------

def memory(jobs: int) -> None:
    """Install `jobs` stored jobs through the real job catalog and scheduler (in this
    process, no etcd: the stored values are what JobStore.create writes, signed for the
    cluster) and show with tracemalloc which allocations dominate, and the RSS growth."""
    import gc
    import tracemalloc
    from types import SimpleNamespace

    from agent.config import parse_config
    from agent.coordination.jobstore import StoredJob
    from agent.coordination.keys import Keys
    from agent.jobs.catalog import JobCatalog
    from agent.jobs.scheduler import Scheduler
    from agent.jobs.signing import KeyRing, generate_hmac_secret, sign
    from agent.runtime.loop import EventLoop

    cfg = parse_config("cluster: bench\nshards: 64\netcd: {insecure: true}\n"
                       "templates: {noop: {argv: [/bin/true], user: root, allow_root: true}}\n")
    ring = KeyRing.from_mapping({"bench": {"alg": "hmac-sha256", "secret": generate_hmac_secret()}})
    loop, keys = EventLoop(), Keys(cfg.cluster)
    # the agent's seams, inert: no shard is held, nothing is published
    agent = SimpleNamespace(fence_for=lambda unit: None, owns=lambda unit: None, held=lambda unit: None,
                            release_idle=lambda: None, publish_status=lambda doc: None,
                            record=lambda *a, **k: None, pool_of_unit=lambda unit: "", unit_of=lambda p, s: s)
    executor = SimpleNamespace(default_limits=None, stage=lambda spec: None, unstage=lambda staged: None)
    lease = SimpleNamespace(lease_id=None, valid_until=0.0, is_valid=lambda: False)
    catalog = JobCatalog(cfg, None, keys, agent, agent, loop, None, ring, audit=agent, statuses=agent)
    catalog.listener = Scheduler(cfg, catalog, fencing=agent, lease=lease, loop=loop, client=None, keys=keys,
                                 workers=None, executor=executor, admission=None, sink=agent, audit=agent)
    catalog.loaded.update({s: 0 for s in range(cfg.shards)})   # every shard listed (as after its load)
    issued = format_rfc3339(datetime.now(timezone.utc).replace(microsecond=0))
    values = []
    for i in range(jobs):
        doc = json.loads(job_value(f"j{i:06d}", {"cron": "0 3 * * *", "tz": "Europe/Berlin"}, misfire="skip"))
        accepted = doc.pop("_accepted")
        doc.update({"cluster": cfg.cluster, "kind": "job", "issued_at": issued})
        values.append(dict(sign(doc, ring, "bench"), _accepted=accepted))
    gc.collect()
    rss0 = rss_mb(os.getpid())
    tracemalloc.start(4)
    snap0 = tracemalloc.take_snapshot()
    t = time.monotonic()
    for i, v in enumerate(values):
        catalog.job_stored(StoredJob(shard_of(f"j{i:06d}", 64), v, i + 1, i + 1))
    took = time.monotonic() - t
    assert len(catalog.entries) == jobs, f"{jobs - len(catalog.entries)} jobs refused (see the log)"
    snap1 = tracemalloc.take_snapshot()
    tracemalloc.stop()
    del values
    gc.collect()
    rss1 = rss_mb(os.getpid())
    stats = snap1.compare_to(snap0, "filename")
    total = sum(s.size_diff for s in stats)
    print(f"memory: {jobs} jobs installed in {took:.1f} s; RSS +{rss1 - rss0:.0f} MB (this process, tracemalloc "
          f"overhead included); traced Python allocations {total / 1e6:.0f} MB = {total / jobs:.0f} B/job ({load()})")
    for st in stats[:8]:
        print(f"  {st.size_diff / 1e6:7.1f} MB  {st.size_diff / jobs:6.0f} B/job  {st.traceback[0].filename}")
    lines = snap1.compare_to(snap0, "lineno")[:8]
    for st in lines:
        fr = st.traceback[0]
        print(f"  {st.size_diff / 1e6:7.1f} MB  {os.path.relpath(fr.filename)}:{fr.lineno}")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("takeover")
    t.add_argument("--records", default="0,1000,5000,20000")
    cl = sub.add_parser("cluster")
    cl.add_argument("--jobs", type=int, default=100000)
    cl.add_argument("--shards", type=int, default=64)
    cl.add_argument("--agents", type=int, default=3)
    cl.add_argument("--ttl", type=int, default=4)
    mo = sub.add_parser("month")
    mo.add_argument("--days", type=int, default=30)
    mo.add_argument("--cron", type=int, default=500)
    mo.add_argument("--oneshots-per-day", type=int, default=5000)
    mo.add_argument("--cron-records-per-day", type=int, default=150)
    me = sub.add_parser("memory")
    me.add_argument("--jobs", type=int, default=100000)
    a = ap.parse_args()
    if a.cmd == "takeover":
        takeover([int(x) for x in a.records.split(",")])
    elif a.cmd == "memory":
        memory(a.jobs)
    elif a.cmd == "cluster":
        cluster(a.jobs, a.shards, a.agents, a.ttl)
    else:
        month(a.days, a.cron, a.oneshots_per_day, a.cron_records_per_day)


if __name__ == "__main__":
    main()
