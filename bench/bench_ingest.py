#!/usr/bin/env python3
"""Ingest benchmark: pushes accepted and durable per second, and push -> accepted latency,
for one agent and for three, with paho-mqtt 1.6 (Debian) and 2.x (.cache/paho2, see
`make paho2`). Real etcd, real mosquitto, real `millwright run` agents.

    /usr/bin/python3 bench/bench_ingest.py            # BENCH_PUSHES=2000 BENCH_RATE=100
    /usr/bin/python3 bench/bench_ingest.py --junk     # BENCH_PUSHES=500 BENCH_JUNK=10000
    /usr/bin/python3 bench/bench_ingest.py --flood    # BENCH_PUSHES=500 BENCH_FLOOD=10000

--junk (issue 16): the same burst on two agents, once quiet and once while a second client
publishes BENCH_JUNK unauthenticated messages (unsigned, forged, another cluster's, bad
JSON, noise; aimed at the burst's job ids) as fast as the broker takes them. Figure: the
burst's accepted+durable/s in both runs and their ratio.

--flood (issue 34): the same, while a gateway publishes BENCH_FLOOD statuses under its own
prefix (all the broker ACL lets it write; it is also a member in etcd, taking no shards)
as fast as the broker takes them, QoS 1: fake `accepted` and `succeeded` answers about the
burst's jobs, 8 KiB each, every tenth 40 KiB (BENCH_FLOOD_KB=40 for all of them). No agent
reads another's statuses (issue 50): the figure says what the flood costs the agents'
ingest through the broker alone.

BENCH_PIN=1 (--flood): the agents, etcd and the bench's cloud clients (pusher, collector: the
same work in both runs) run on CPU 0, the broker and the flooding gateway on CPU 1, in quiet
and flood runs alike. In a plant the flooding gateway is another machine and the broker the
cloud's; on this 2-core machine they otherwise take the agents' cores, and the ratio then
measures the attacker's CPU as much as the agents' cost of the flood.

The broker is configured as the product ships it (a user per client, the cluster's ACL,
message_size_limit = mqtt.max_payload_bytes; plain TCP on loopback instead of TLS). The
flood figure also gives each process's CPU during the burst (/proc/<pid>/stat).

Latency first, on an idle system: BENCH_RATE pushes per second for 5 s (open loop), push
publish -> accepted status received by a subscriber (p50/p99). Then throughput: a burst of
BENCH_PUSHES pushes published as fast as the broker takes them; figure = pushes / (last
accepted - first publish), with the p99 latency inside the burst (mostly queueing).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from agent.cloud.mqtt import MqttLink  # noqa: E402
from tests.support.cloudkit import TEMPLATES, StatusCollector, job_doc, signed, write_keys  # noqa: E402
from agent.cloud.topics import Topics  # noqa: E402
from agent.config import MqttConfig  # noqa: E402
from agent.demo.services import EtcdServer, MosquittoServer  # noqa: E402
from tests.support.cluster import Cluster  # noqa: E402
from tests.support.waiting import wait_for  # noqa: E402

PUSHES = int(os.environ.get("BENCH_PUSHES", "2000"))
RATE = float(os.environ.get("BENCH_RATE", "100"))
PAHO2 = os.path.join(ROOT, ".cache", "paho2")


PIN = os.environ.get("BENCH_PIN", "0") == "1"
AGENT_CPUS = {0}    # BENCH_PIN: the agents, etcd and the bench's cloud clients (the same in both runs)
BROKER_CPUS = {1}   # BENCH_PIN: the broker and the flooding gateway


class spawned_on:
    """Children forked inside this block start on ``cpus`` (they inherit the affinity of
    the thread that forks them); the bench's own thread gets its affinity back after."""

    def __init__(self, cpus: Optional[set]):
        self.cpus = cpus
        self.saved: Optional[set] = None

    def __enter__(self):
        if self.cpus is not None:
            self.saved = os.sched_getaffinity(0)
            os.sched_setaffinity(0, self.cpus)
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            os.sched_setaffinity(0, self.saved)


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


FLOOD_KB = [int(x) for x in os.environ.get("BENCH_FLOOD_KB", "8,8,8,8,8,8,8,8,8,40").split(",")]


def flood_payloads(n: int, ids: list) -> list[bytes]:
    """A gateway's status flood: fake answers about ``ids``, their sizes in KiB taken in
    turn from BENCH_FLOOD_KB (default: 8, every tenth 40)."""
    import json

    return [json.dumps({"v": 1, "job_id": ids[i % len(ids)], "run_id": "20261201T120000.000Z", "agent": "a0",
                        "seq": i, "state": "accepted" if i % 2 else "succeeded", "push_sha256": "0" * 16,
                        "pad": "x" * (FLOOD_KB[i % len(FLOOD_KB)] * 1000)}).encode() for i in range(n)]


def agents_cpu_s(cl, names) -> float:
    """CPU seconds (user + system) the agents' processes used so far."""
    import psutil

    return sum(sum(psutil.Process(cl.agents[a].pid).cpu_times()[:2]) for a in names)


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, its threads included) process ``pid`` used so far:
    /proc/<pid>/stat utime + stime; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# The broker as the product ships it (packaging/debian/examples/mosquitto-millwright.conf):
# a user per client, the per-cluster ACL `millwright broker acl` writes, and the settings
# `millwright broker settings` writes (message_size_limit = mqtt.max_payload_bytes, client
# id = username). Plain TCP on loopback (the shipped listener is TLS).
BROKER_PAYLOAD_LIMIT = 65536
BROKER_CLOUD_USERS = ("bench-pusher", "bench-junk", "bench-collector")


def shipped_broker(workdir: str, names: list) -> tuple:
    """(MosquittoServer, {user: password}): the agents ``names`` and the gateway ``gw``
    are agents of the ACL (each writes only under its own prefix), the bench's clients
    cloud users."""
    from agent.cloud.broker import acl_text, settings_text

    agents = list(names) + ["gw"]
    users = {u: f"{u}-pw" for u in agents + list(BROKER_CLOUD_USERS)}
    acl = acl_text("t", {a: a for a in agents}, list(BROKER_CLOUD_USERS))
    return MosquittoServer(workdir, users=users, acl=acl, extra_conf=settings_text(BROKER_PAYLOAD_LIMIT)), users


def run(n_agents: int, paho2: bool, junk: int = 0, paced: bool = True, flood_statuses: int = 0,
        observe: Optional[Callable[[str, dict], None]] = None, agent_env: Optional[dict] = None) -> dict:
    """One run. ``observe(phase, info)`` is called at ready (info: the pids of the agents,
    etcd and mosquitto), paced_start, paced_end, burst_start and burst_end (blocking the
    run while it returns: bench/profile_ingest.py profiles the phases through it);
    ``agent_env``: more environment for the agents."""
    observe = observe or (lambda phase, info: None)
    broker_cpus = BROKER_CPUS if PIN else None
    if PIN:
        os.sched_setaffinity(0, AGENT_CPUS)   # the bench's threads and what it starts, the broker's side aside
    base = tempfile.mkdtemp(prefix="mw-bench-ingest-")
    etcd = EtcdServer(os.path.join(base, "etcd"))
    names = [f"a{i}" for i in range(n_agents)]
    mq, users = shipped_broker(os.path.join(base, "mq"), names)  # (it runs as root itself when started by root)

    def as_user(user: str) -> MqttConfig:
        return MqttConfig(url=mq.url, username=user, password=users[user], insecure=True)
    for s in (etcd, mq):
        os.makedirs(s.dir, exist_ok=True)
        with spawned_on(broker_cpus if s is mq else None):
            s.start()
    keys = os.path.join(base, "keys.yaml")
    ring = write_keys(keys)
    env = {"PYTHONPATH": PAHO2} if paho2 else {}
    env.update(agent_env or {})
    cl = Cluster(etcd, os.path.join(base, "agents"), shards=64, ttl=10, renew_deadline=6, retry_period=1,
                 extra={"mqtt": {"url": mq.url}, "signing": {"keys_file": keys}, "templates": TEMPLATES,
                        "bpf": {"enabled": False}}, env=env)
    topics = Topics("t")
    # the cloud's view: the agents' own statuses (a gateway's flood is not the cloud's to parse)
    col = StatusCollector(mq.url, "t", agents=tuple(names) if flood_statuses else None,
                          mqtt_cfg=as_user("bench-collector")).start()
    arrived: dict[str, float] = {}
    lock = threading.Lock()
    orig = col._msg

    def on_msg(msg):
        orig(msg)
        d = col.messages[-1][2]
        if d.get("state") == "accepted":
            with lock:
                arrived.setdefault(d["job_id"], time.monotonic())
    col.link._on_message = on_msg
    pusher = MqttLink(as_user("bench-pusher"), "bench-pusher", clean_session=True, max_inflight=200)
    try:
        if flood_statuses and os.environ.get("BENCH_FLOOD_MEMBER", "1") == "1":
            # the gateway is an agent of the cluster as far as etcd says (a member that takes
            # no shards; BENCH_FLOOD_MEMBER=0: not a member). No agent reads its statuses
            # either way
            import json

            cl.client.put(cl.keys.member("gw"), json.dumps({"capacity": 1.0, "available": False}))
        for n in names:
            cl.start(n, extra={"mqtt": {"username": n, "password": users[n], "insecure": True}})
        wait_for(lambda: cl.all_owned_by(set(names)) and len(set(cl.owners().values())) == n_agents, 60,
                 what="agents own the shards")
        time.sleep(1.0)
        pusher.start()
        pusher.wait_connected(10)
        if PIN:   # every thread of each process where it was put
            for who, pid, cpus in [(a, cl.agents[a].pid, AGENT_CPUS) for a in names] + [
                    ("etcd", etcd.proc.pid, AGENT_CPUS), ("mosquitto", mq.proc.pid, BROKER_CPUS)]:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    assert os.sched_getaffinity(int(tid)) == cpus, (who, tid, os.sched_getaffinity(int(tid)))
        observe("ready", {"agents": {a: cl.agents[a].pid for a in names}, "etcd": etcd.proc.pid,
                          "mosquitto": mq.proc.pid})
        sent: dict[str, float] = {}
        lat: list = []
        # paced
        n = int(RATE * 5) if paced else 0
        pids = [f"paced-{i}" for i in range(n)]
        ppay = [signed(job_doc(j, line=str(i % 100)), ring) for i, j in enumerate(pids)]
        observe("paced_start", {"pushes": n})
        start = time.monotonic()
        for i, (j, p) in enumerate(zip(pids, ppay)):
            due = start + i / RATE
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            sent[j] = time.monotonic()
            pusher.publish(topics.push, p, qos=1)
        wait_for(lambda: all(j in arrived for j in pids), 120, interval=0.05, what="paced accepted")
        lat = [arrived[j] - sent[j] for j in pids] or [float("nan")]
        observe("paced_end", {"pushes": n, "p50_ms": statistics.median(lat) * 1000 if pids else float("nan"),
                              "p99_ms": pct(lat, 99) * 1000})
        # burst
        ids = [f"burst-{i}" for i in range(PUSHES)]
        payloads = [signed(job_doc(j, line=str(i % 100)), ring) for i, j in enumerate(ids)]
        flood = None
        gw = None
        if flood_statuses:
            # the gateway is a process of its own (mosquitto_pub, one status per line): the
            # bench's own process only pushes and collects, as the cloud would
            lines = os.path.join(base, "flood.txt")
            with open(lines, "wb") as fh:
                fh.writelines(p + b"\n" for p in flood_payloads(flood_statuses, ids))
            with spawned_on(broker_cpus):
                gw = subprocess.Popen(["mosquitto_pub", "-h", mq.host, "-p", str(mq.port), "-i", "gw", "-u", "gw",
                                       "-P", users["gw"], "-q", "1",
                                       "-t", topics.status("flood", "gw"), "-l"], stdin=open(lines, "rb"),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if junk:
            import random

            from agent.jobs.signing import KeyRing, generate_hmac_secret
            from tests.support.cloudkit import junk_payload as _junk

            other = KeyRing.from_mapping({"cloud-1": {"alg": "hmac-sha256", "secret": generate_hmac_secret()}})
            rnd = random.Random(16)
            junk_payloads = [_junk(rnd, i, ids, ring, other) for i in range(junk)]
            junker = MqttLink(as_user("bench-junk"), "bench-junk", clean_session=True, max_inflight=200)
            junker.start()
            junker.wait_connected(10)

            def flood_all():
                for p in junk_payloads:
                    junker.publish(topics.push, p, qos=1)
            flood = threading.Thread(target=flood_all, daemon=True)
            flood.start()
        observe("burst_start", {"pushes": PUSHES})
        procs = {**{a: cl.agents[a].pid for a in names}, "mosquitto": mq.proc.pid, "etcd": etcd.proc.pid,
                 "bench": os.getpid(), **({"gateway": gw.pid} if gw is not None else {})}
        pcpu0 = {k: proc_cpu_s(pid) for k, pid in procs.items()}
        cpu0 = agents_cpu_s(cl, names)
        t0 = time.monotonic()
        for j, p in zip(ids, payloads):
            sent[j] = time.monotonic()
            pusher.publish(topics.push, p, qos=1)
        wait_for(lambda: all(j in arrived for j in ids), 300, interval=0.05, what="burst accepted")
        if flood is not None:
            flood.join(120)
            junker.stop()
        gw_cpu = 0.0
        if gw is not None:
            _, status, usage = os.wait4(gw.pid, 0)   # reaped here: its CPU is in the rusage
            gw.returncode = os.waitstatus_to_exitcode(status)
            gw_cpu = usage.ru_utime + usage.ru_stime
        time.sleep(1.0)  # what the agents still had queued
        cpu = (agents_cpu_s(cl, names) - cpu0) / n_agents
        received = {}
        for a in names:   # what the agents' links received of any agent's statuses (none expected)
            try:
                from agent.daemon.admin import query

                cloud = query(os.path.join(cl.agents[a].dir, "admin.sock")).get("cloud", {})
                received[a] = cloud.get("statuses_received")
            except Exception:
                received[a] = None
        pcpu = {k: proc_cpu_s(pid) - pcpu0[k] for k, pid in procs.items() if k != "gateway"}
        if gw is not None:
            pcpu["gateway"] = gw_cpu - pcpu0["gateway"]
        t_last = max(arrived[j] for j in ids)
        burst_rate = PUSHES / (t_last - t0)
        burst_lat = [arrived[j] - sent[j] for j in ids]
        observe("burst_end", {"pushes": PUSHES, "per_s": burst_rate, "p99_ms": pct(burst_lat, 99) * 1000})
        return {"agents": n_agents, "paho": "2.x" if paho2 else "1.6", "burst_per_s": burst_rate, "agent_cpu_s": cpu,
                "proc_cpu_s": pcpu, "statuses_received": received,
                "burst_p99_ms": pct(burst_lat, 99) * 1000, "paced_rate": RATE,
                "p50_ms": statistics.median(lat) * 1000, "p99_ms": pct(lat, 99) * 1000}
    finally:
        pusher.stop()
        col.stop()
        cl.close()
        mq.close()
        etcd.close()
        shutil.rmtree(base, ignore_errors=True)


def main_junk() -> int:
    junk = int(os.environ.get("BENCH_JUNK", "10000"))
    global PUSHES
    PUSHES = int(os.environ.get("BENCH_PUSHES", "500"))
    print(f"junk benchmark: burst of {PUSHES} valid pushes on 2 agents, quiet vs with {junk} unauthenticated "
          f"messages at full speed; cpus={os.cpu_count()} load={os.getloadavg()[0]:.1f}")
    rounds = int(os.environ.get("BENCH_ROUNDS", "3"))  # alternated, so a shared machine's load hits both alike
    quiet, noisy = [], []
    for i in range(rounds):
        q = run(2, False, paced=False)["burst_per_s"]
        n = run(2, False, junk=junk, paced=False)["burst_per_s"]
        quiet.append(q)
        noisy.append(n)
        print(f"round {i + 1}: quiet {q:.0f}/s, junk {n:.0f}/s (load {os.getloadavg()[0]:.1f})", flush=True)
    mq, mn = statistics.median(quiet), statistics.median(noisy)
    print(f"median quiet: {mq:.0f} accepted+durable/s; median with junk: {mn:.0f}/s; "
          f"ratio {mn / mq:.2f}  load={os.getloadavg()[0]:.1f}")
    return 0


def main_flood() -> int:
    n = int(os.environ.get("BENCH_FLOOD", "10000"))
    global PUSHES
    PUSHES = int(os.environ.get("BENCH_PUSHES", "500"))
    print(f"status flood benchmark: burst of {PUSHES} valid pushes on 2 agents, quiet vs while a gateway publishes "
          f"{n} statuses (8-40 KiB, fake answers) at full speed; cpus={os.cpu_count()} "
          f"load={os.getloadavg()[0]:.1f}")
    if PIN:
        print(f"pinned (BENCH_PIN=1): agents, etcd and the bench's cloud clients on CPUs {sorted(AGENT_CPUS)}; "
              f"the broker and the flooding gateway on CPUs {sorted(BROKER_CPUS)}")
    rounds = int(os.environ.get("BENCH_ROUNDS", "3"))  # alternated, so a shared machine's load hits both alike
    quiet, noisy, cq, cf = [], [], [], []
    pq: list = []
    pf: list = []
    for i in range(rounds):
        q = run(2, False, paced=False)
        f = run(2, False, paced=False, flood_statuses=n)
        pq.append(q["proc_cpu_s"])
        pf.append(f["proc_cpu_s"])
        quiet.append(q["burst_per_s"])
        noisy.append(f["burst_per_s"])
        cq.append(q["agent_cpu_s"])
        cf.append(f["agent_cpu_s"])
        print(f"  statuses received per agent (quiet / flood): "
              f"{q['statuses_received']} / {f['statuses_received']}")
        print(f"round {i + 1}: quiet {quiet[-1]:.0f}/s ({cq[-1]:.2f} s CPU per agent), flood {noisy[-1]:.0f}/s "
              f"({cf[-1]:.2f} s CPU per agent) (load {os.getloadavg()[0]:.1f})", flush=True)
    mq, mf = statistics.median(quiet), statistics.median(noisy)
    print(f"median quiet: {mq:.0f} accepted+durable/s; median under the flood: {mf:.0f}/s; "
          f"ratio {mf / mq:.2f}; CPU per agent {statistics.median(cq):.2f} s quiet, {statistics.median(cf):.2f} s "
          f"with the flood  load={os.getloadavg()[0]:.1f}")
    print("median CPU seconds per process during the burst (quiet / flood):")
    for k in pf[0]:
        print(f"  {k:>10}: {statistics.median(p.get(k, 0.0) for p in pq):6.2f} / "
              f"{statistics.median(p[k] for p in pf):6.2f}")
    return 0


def main() -> int:
    if "--junk" in sys.argv[1:]:
        return main_junk()
    if "--flood" in sys.argv[1:]:
        return main_flood()
    have2 = os.path.exists(os.path.join(PAHO2, "paho", "mqtt", "client.py"))
    if not have2:
        print("paho-mqtt 2.x not installed in .cache/paho2 (run `make paho2`): measuring 1.6 only")
    print(f"ingest benchmark: burst of {PUSHES} pushes; latency at {RATE:g} pushes/s for 5 s; "
          f"cpus={os.cpu_count()} load={os.getloadavg()[0]:.1f}")
    print(f"{'paho':>5} {'agents':>6} {'burst accepted+durable/s':>25} {'burst p99 ms':>13} "
          f"{'paced p50 ms':>13} {'paced p99 ms':>13}")
    for paho2 in ([False, True] if have2 else [False]):
        for n in (1, 3):
            r = run(n, paho2)
            print(f"{r['paho']:>5} {r['agents']:>6} {r['burst_per_s']:>25.0f} {r['burst_p99_ms']:>13.0f} "
                  f"{r['p50_ms']:>13.1f} {r['p99_ms']:>13.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
