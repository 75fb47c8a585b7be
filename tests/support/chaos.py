"""A seeded, randomized fault test on this machine (Jepsen-style).

A real 3-member etcd on loopback, 4 `millwright run` agents, a mosquitto; a workload of
one-shot, retrying and cron jobs pushed over MQTT whose script (tests/jobs/effect.sh)
records each run's side effect on its own clock; a nemesis that runs fault groups from a
seeded plan, each followed by a quiet window (at least TTL + 3 s with no fault). Faults:
kill -9 and restart of an agent, SIGTERM and restart, SIGSTOP/SIGCONT, nftables cuts
agent<->etcd and agent<->broker (tables `mw_chaos_*`, always removed), etcd leader kill and
restart, and a pause of an etcd member. Afterwards the whole etcd history (one watch from
revision 1, compaction off) and the side-effect log go through tests/support/history.py.

Everything random comes from one seed, printed first; the same seed gives the same
workload and the same fault plan (the timing of a loaded machine does not repeat):

    make chaos SEED=1234 MINUTES=2          # python3 -m tests.support.chaos --seed 1234 --minutes 2

Stated bounds (README, testing):
- a fault's affected window runs from its start to its heal + TTL; a firing is
  *affected* when it could be in flight (due, or stored, to its last possible end) during
  one, else it is *quiet*;
- a quiet firing runs: it succeeds, one side effect per attempt, the first started within
  QUIET_LATENESS_S of its due time on the side effect's own clock; never skipped, never
  owner_lost, never misfired;
- an affected firing is resolved within LATENESS_BOUND_S of its due time, or of the heal
  of the fault it fell into; owner_lost and misfired stay within budgets counted from the
  firings due inside the affected windows of the faults that can cost them
  (:func:`budgets`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from agent.config import EtcdConfig, MqttConfig  # noqa: E402
from agent.coordination.etcd import EtcdClient  # noqa: E402
from agent.coordination.keys import Keys  # noqa: E402
from agent.demo.services import AgentProcess, EtcdCluster, MosquittoServer, free_port  # noqa: E402
from agent.jobs.schedule import fire_id, format_rfc3339  # noqa: E402
from tests.support import history  # noqa: E402

EFFECT = os.path.join(ROOT, "tests", "jobs", "effect.sh")
CLUSTER = "chaos"
SHARDS = 16
TTL_S = 4
RENEW_DEADLINE_S = 2.5
CRON_PERIOD_S = 2
CRON_SLEEP_S = 0.3
JOB_SLEEP_MAX_S = 0.6
KILL_GRACE_S = 1.0
RETRY_BACKOFFS_S = (1.0, 2.0)   # the retrying jobs' waits before attempts 2 and 3 (backoff 1 s, max 2 s)
# A fault's consequences (lease expiry, a fenced agent's new session, rebalance) are over
# one TTL after its heal; the next fault group starts at least 3 s after that.
AFTER_HEAL_S = float(TTL_S)
QUIET_MIN_S = TTL_S + 3.0
QUIET_EXTRA_S = 8.0             # quiet windows last QUIET_MIN_S .. QUIET_MIN_S + QUIET_EXTRA_S
# A firing due in a quiet window starts within this long of its due time: claim and process
# start on a loaded 2-core machine, or a graceful hand-over of its shard (half the TTL).
QUIET_LATENESS_S = 3.0
# One attempt's claim, start, reap and record write on a loaded machine, besides its sleep.
RUN_OVERHEAD_S = 1.0
# An affected firing is resolved within this long after its due time, or after the heal of
# the fault it fell into: the lease TTL for the old owner's keys to expire, the TTL again
# for a self-fenced agent's new session and a rebalance, and 2 s for claims and process
# start on a loaded 2-core machine.
LATENESS_BOUND_S = 2 * TTL_S + 2.0
FAULTS = ("agent_kill9", "agent_restart", "agent_pause", "cut_etcd", "cut_broker", "etcd_leader_kill",
          "etcd_member_pause")
AGENT_FAULTS = {"agent_kill9", "agent_restart", "agent_pause", "cut_etcd", "cut_broker"}
# faults that cannot fence an agent, so cost no run and skip no cron firing
HARMLESS_TO_RUNS = {"cut_broker"}


def now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass
class Fault:
    kind: str
    target: str
    start: float
    end: float = 0.0
    group: int = 0
    shards: Optional[frozenset] = None   # the shards it can cost (its agent's, at start and after): None, all
    loses_runs: bool = True

    def window(self) -> tuple[float, float]:
        """When it may change what the agents do: from its start to its heal + TTL."""
        return self.start, self.end + AFTER_HEAL_S


@dataclass(frozen=True)
class PlannedFault:
    kind: str
    offset: float     # seconds after its group's start
    duration: float
    pick: int         # which agent or member it targets (an index, taken modulo the count)


@dataclass(frozen=True)
class PlannedGroup:
    at: float         # earliest start, seconds after the workload's t0
    faults: tuple[PlannedFault, ...]


@dataclass
class Result:
    seed: int
    minutes: float
    report: history.Report
    faults: list[Fault]
    pushed: int
    stored: int
    wall_s: float
    figures: dict = field(default_factory=dict)


def plan_faults(rng: random.Random, horizon: float, kinds: tuple[str, ...] = FAULTS) -> list[PlannedGroup]:
    """The seeded fault plan: one fault per group, each group after a quiet window of
    QUIET_MIN_S .. QUIET_MIN_S + QUIET_EXTRA_S (counted by the nemesis from the previous
    group's heal, so a slow heal delays the plan instead of shortening the window)."""
    out = []
    t = rng.uniform(QUIET_MIN_S, QUIET_MIN_S + QUIET_EXTRA_S)
    while True:
        kind = rng.choice(kinds)
        duration = rng.uniform(1.5, 6.0)
        pick = rng.randrange(1 << 16)
        if t + duration > horizon - 2:
            return out
        out.append(PlannedGroup(t, (PlannedFault(kind, 0.0, duration, pick),)))
        t += duration + rng.uniform(QUIET_MIN_S, QUIET_MIN_S + QUIET_EXTRA_S)


def flight_s(f: history.Firing, sleep_s: float) -> float:
    """How long after its due time a firing can still be in flight when nothing goes wrong:
    the quiet lateness bound, then each attempt (its sleep and overhead) and the backoffs."""
    attempts = f.max_attempts
    backoff = sum(RETRY_BACKOFFS_S[:attempts - 1])
    return QUIET_LATENESS_S + attempts * (sleep_s + RUN_OVERHEAD_S) + backoff


def _overlaps(a0: float, a1: float, b0: float, b1: float) -> bool:
    return a0 <= b1 and b0 <= a1


def affected_at(faults: list[Fault], t: float) -> bool:
    return any(w[0] <= t <= w[1] for w in (f.window() for f in faults))


def effective_due(faults: list[Fault], d: float) -> float:
    """A firing due during a fault is due again at its heal (and so on through overlaps)."""
    e = d
    moved = True
    while moved:
        moved = False
        for f in faults:
            if f.start - 1.0 <= e < f.end:
                e, moved = f.end, True
    return e


def is_quiet(faults: list[Fault], f: history.Firing, sleep_s: float) -> bool:
    """No fault's window meets the firing between its due (or store) time and the end of
    its last attempt."""
    t0 = max(f.due, f.stored_at)
    t1 = t0 + flight_s(f, sleep_s)
    return not any(_overlaps(t0, t1, *g.window()) for g in faults)


def budgets(faults: list[Fault], firings: list[history.Firing], sleep_of: dict[str, float],
            shard_of_job: Callable[[str], int]) -> tuple[history.Budget, dict]:
    """owner_lost and misfired budgets counted from the firings each fault can cost: those
    that could be in flight during its window (owner_lost: every kind; misfired: the cron
    firings due inside it), on the shards it touches (an agent fault: its agent's, at its
    start and TTL after its heal; an etcd fault: all), for the faults that can fence an
    agent. Each firing counts once."""
    lost, missed = set(), set()
    for g in faults:
        if not g.loses_runs:
            continue
        w0, w1 = g.window()
        for f in firings:
            if g.shards is not None and shard_of_job(f.job) not in g.shards:
                continue
            t0 = max(f.due, f.stored_at)
            if _overlaps(t0, t0 + flight_s(f, sleep_of.get(f.job, 0.0)), w0, w1):
                lost.add((f.job, f.fire_id))
            if f.may_skip and w0 <= f.due <= w1:
                missed.add((f.job, f.fire_id))
    return history.Budget(owner_lost=len(lost), misfired=len(missed)), {"owner_lost_firings": len(lost),
                                                                         "misfired_firings": len(missed)}


def affected_share(faults: list[Fault], t0: float, t1: float) -> float:
    """The share of [t0, t1] inside some fault's window."""
    spans = sorted((max(t0, a), min(t1, b)) for a, b in (f.window() for f in faults) if b > t0 and a < t1)
    covered, end = 0.0, t0
    for a, b in spans:
        a = max(a, end)
        if b > a:
            covered += b - a
            end = b
    return covered / (t1 - t0) if t1 > t0 else 0.0


class NftCut:
    """Drop TCP to and from addr:ports in the input hook (a lost link, with retransmits),
    in a table named for this process and a random suffix; removed by heal()."""

    def __init__(self, addr: str, ports: list[int]):
        self.table = f"mw_chaos_{os.getpid()}_{secrets.token_hex(3)}"
        self.addr, self.ports = addr, ports
        self.active = False

    def apply(self) -> "NftCut":
        ports = ", ".join(str(p) for p in self.ports)
        rules = f"""
table inet {self.table} {{
  chain inp {{ type filter hook input priority -10; policy accept;
    ip daddr {self.addr} tcp dport {{ {ports} }} drop
    ip saddr {self.addr} tcp sport {{ {ports} }} drop
  }}
}}"""
        subprocess.run(["nft", "-f", "-"], input=rules.encode(), check=True)
        self.active = True
        return self

    def heal(self) -> None:
        if self.active:
            subprocess.run(["nft", "delete", "table", "inet", self.table], check=False)
            self.active = False


class ChaosRun:
    def __init__(self, seed: int, minutes: float = 2.0, workdir: Optional[str] = None, agents: int = 4,
                 log: Callable[[str], None] = print):
        self.seed = seed
        self.minutes = minutes
        self.rng = random.Random(seed)
        self.own_dir = workdir is None
        self.dir = workdir or tempfile.mkdtemp(prefix="mw-chaos-")
        self.n_agents = agents
        self.log = log
        self.t_start = time.monotonic()
        self.agents: dict[str, AgentProcess] = {}
        self.hosts: dict[str, str] = {}
        self.broker_ports: dict[str, int] = {}
        self.cuts: list[NftCut] = []
        self.faults: list[Fault] = []
        self.keys = Keys(CLUSTER)
        self.out = os.path.join(self.dir, "effects.log")
        self.etcd: Optional[EtcdCluster] = None
        self.mq: Optional[MosquittoServer] = None
        self.client: Optional[EtcdClient] = None
        self.pusher = None
        self.pushed: dict[str, dict] = {}
        self.firings: list[history.Firing] = []
        self.sleep_of: dict[str, float] = {}
        self.stored_at: dict[str, float] = {}
        self.t_quiet_from = 0.0
        self.kinds = FAULTS
        self.keep = False

    def say(self, msg: str) -> None:
        self.log(f"{time.monotonic() - self.t_start:7.2f}s {msg}")

    # --- setup -------------------------------------------------------------------------
    def setup(self) -> None:
        from agent.cloud.mqtt import MqttLink
        from agent.cloud.testkit import write_keys

        # ids unique on the host: an agent's run cgroups are named after its id, and an agent
        # starting removes "stale" ones, so a0 of another test run must never be ours
        ids = [f"a{i}-{os.getpid() % 100000}" for i in range(self.n_agents)]
        self.hosts = {a: f"127.0.0.{10 + i}" for i, a in enumerate(ids)}
        self.etcd = EtcdCluster(3, os.path.join(self.dir, "etcd"), extra_hosts=tuple(self.hosts.values())).start()
        self.broker_ports = {a: free_port() for a in ids}
        listeners = "".join(f"listener {p} 127.0.0.1\n" for p in self.broker_ports.values())
        self.mq = MosquittoServer(os.path.join(self.dir, "mosquitto"), extra_conf=listeners)
        os.makedirs(self.mq.dir, exist_ok=True)
        self.mq.start()
        self.ring = write_keys(os.path.join(self.dir, "keys.yaml"))
        os.makedirs(os.path.join(self.dir, "agents"), exist_ok=True)
        for a in ids:
            self.agents[a] = AgentProcess(a, os.path.join(self.dir, "agents"), self._config(a)).start()
        self.client = EtcdClient(EtcdConfig(endpoints=self.etcd.endpoints, request_timeout_s=2.0))
        deadline = time.monotonic() + 90
        while len(self._owners()) < SHARDS or len(set(self._owners().values())) < self.n_agents:
            if time.monotonic() > deadline:
                raise AssertionError(f"seed {self.seed}: agents never owned all shards: {self._owners()}")
            time.sleep(0.2)
        self.pusher = MqttLink(MqttConfig(url=self.mq.url), f"chaos-pusher-{os.getpid()}", clean_session=False,
                               reconnect_min_s=0.2, reconnect_max_s=1.0)
        self.pusher.start()
        if not self.pusher.wait_connected(10):
            raise AssertionError("the pusher could not connect to the broker")
        self.say(f"up: etcd {self.etcd.endpoints}, broker {self.mq.url}, agents {ids}")

    def _config(self, agent: str) -> dict:
        return {"cluster": CLUSTER, "shards": SHARDS, "drain_timeout_s": 2.0,
                "etcd": {"endpoints": self.etcd.endpoints_on(self.hosts[agent]), "lease_ttl_s": TTL_S,
                         "renew_deadline_s": RENEW_DEADLINE_S, "retry_period_s": 0.5, "request_timeout_s": 1.0},
                "mqtt": {"url": f"mqtt://127.0.0.1:{self.broker_ports[agent]}", "reconnect_min_s": 0.2,
                         "reconnect_max_s": 1.0, "ingest_grace_s": 1.5},
                "signing": {"keys_file": os.path.join(self.dir, "keys.yaml")},
                "bpf": {"enabled": False},
                "execute": {"max_concurrent": 16, "memory_mb": 16384, "cpu": 64.0, "kill_grace_s": KILL_GRACE_S},
                "templates": {"fx": {"argv": [EFFECT, self.out, agent, "{sleep}", "{fail_until}"],
                                     "params": {"sleep": r"^[0-9.]+$", "fail_until": r"^[0-9]$"}, "user": "root", "allow_root": True,
                                     "allow_exec": ["/bin/*", "/usr/bin/*", EFFECT]}}}

    def _owners(self) -> dict[str, str]:
        try:
            kvs, _ = self.client.get_prefix(self.keys.shards_prefix())
        except Exception:  # noqa: BLE001 - polled again
            return {}
        return {kv.key: kv.value.decode() for kv in kvs}

    # --- workload ------------------------------------------------------------------------
    def plan_workload(self, t0: datetime, horizon: float) -> list[tuple[float, dict]]:
        """(push at, document) for every job; one-shots are pushed 3-20 s before their due
        time, so pushes go on while faults do."""
        rng = self.rng
        plan = []
        issued = (t0 - timedelta(seconds=4)).replace(microsecond=0)   # t0 is 4 s after now
        n_at = max(10, int(horizon / 1.5))
        n_retry = max(3, int(horizon / 8))
        for i in range(n_at + n_retry):
            retrying = i >= n_at
            jid = f"{'r' if retrying else 'o'}{i:03d}-{self.seed % 1000}"
            due = t0 + timedelta(seconds=rng.uniform(0, horizon))
            due = due.replace(microsecond=(due.microsecond // 1000) * 1000)
            sleep = round(rng.uniform(0.1, JOB_SLEEP_MAX_S), 2)
            self.sleep_of[jid] = sleep
            doc = {"v": 1, "id": jid, "template": "fx",
                   "params": {"sleep": f"{sleep:.2f}", "fail_until": "2" if retrying else "0"},
                   "schedule": {"at": format_rfc3339(due)}, "misfire": "run_once"}
            if retrying:
                doc["retry"] = {"max_attempts": 3, "backoff_s": 1.0, "max_backoff_s": 2.0, "jitter": 0}
            push_at = max(time.time(), due.timestamp() - rng.uniform(3, 20))
            plan.append((push_at, doc))
            self.firings.append(history.Firing(jid, fire_id(jid, due), due.timestamp(), "at",
                                               3 if retrying else 1))
        not_after = (t0 + timedelta(seconds=horizon)).replace(microsecond=0)
        self.n_cron = 4
        for i in range(self.n_cron):
            jid = f"c{i}-{self.seed % 1000}"
            self.sleep_of[jid] = CRON_SLEEP_S
            doc = {"v": 1, "id": jid, "template": "fx", "params": {"sleep": f"{CRON_SLEEP_S}", "fail_until": "0"},
                   "schedule": {"cron": f"*/{CRON_PERIOD_S} * * * * *"}, "misfire": "run_once", "overlap": "forbid",
                   "issued_at": format_rfc3339(issued), "not_after": format_rfc3339(not_after)}
            plan.append((time.time(), doc))
            d = math.floor(issued.timestamp() / CRON_PERIOD_S) * CRON_PERIOD_S + CRON_PERIOD_S
            while d < not_after.timestamp():
                due = datetime.fromtimestamp(d, timezone.utc)
                self.firings.append(history.Firing(jid, fire_id(jid, due), float(d), "cron", 1, may_skip=True))
                d += CRON_PERIOD_S
        plan.sort(key=lambda x: x[0])
        return plan

    def _push(self, doc: dict) -> None:
        from agent.jobs.signing import sign
        from agent.cloud.topics import Topics

        doc = dict(doc, cluster=CLUSTER, kind="job")  # bound to this cluster (signed with it)
        doc.setdefault("issued_at", format_rfc3339(now().replace(microsecond=0)))
        body = json.dumps(sign(doc, self.ring, "cloud-1"), separators=(",", ":")).encode()
        self.pusher.publish(Topics(CLUSTER).push, body, qos=1)
        self.pushed[doc["id"]] = doc

    def _pusher_thread(self, plan, stop: threading.Event) -> None:
        for at, doc in plan:
            if stop.wait(max(0.0, at - time.time())):
                return
            self._push(doc)

    # --- nemesis -------------------------------------------------------------------------
    def _shards_of(self, agent: str) -> set[int]:
        return {int(k.rsplit("/", 1)[1]) for k, v in self._owners().items() if v == agent}

    def _apply(self, pf: PlannedFault, group: int) -> tuple[Fault, Callable[[], None]]:
        """Start one fault; returns it and the function that heals it."""
        kind = pf.kind
        ids = sorted(self.agents)
        agent = ids[pf.pick % len(ids)]
        f = Fault(kind, agent if kind in AGENT_FAULTS else "", time.time(), group=group,
                  loses_runs=kind not in HARMLESS_TO_RUNS)
        if kind in AGENT_FAULTS:
            f.shards = frozenset(self._shards_of(agent))
        a = self.agents[agent]
        if kind == "etcd_leader_kill":
            m = self.etcd.leader()
            f.target = m.member_name
            m.kill()

            def heal():
                m.start()
                self.etcd.wait_healthy(60)
        elif kind == "etcd_member_pause":
            m = self.etcd.members[pf.pick % len(self.etcd.members)]
            f.target = m.member_name
            m.pause()

            def heal():
                m.resume()
                self.etcd.wait_healthy(60)
        elif kind == "agent_kill9":
            a.kill()
            heal = a.start
        elif kind == "agent_restart":
            a.terminate(timeout=30)
            heal = a.start
        elif kind == "agent_pause":
            a.signal(signal.SIGSTOP)

            def heal():
                a.signal(signal.SIGCONT)
        elif kind in ("cut_etcd", "cut_broker"):
            ports = [m.port for m in self.etcd.members] if kind == "cut_etcd" else [self.broker_ports[agent]]
            addr = self.hosts[agent] if kind == "cut_etcd" else "127.0.0.1"
            cut = NftCut(addr, ports)
            self.cuts.append(cut)
            cut.apply()
            heal = cut.heal
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        self.say(f"FAULT {kind} {f.target} for {pf.duration:.1f}s")
        return f, heal

    def _run_group(self, group: int, pg: PlannedGroup) -> list[Fault]:
        """Apply and heal the group's faults on their offsets (they may overlap)."""
        t_group = time.time()
        steps = sorted([(pf.offset, 0, i) for i, pf in enumerate(pg.faults)]
                       + [(pf.offset + pf.duration, 1, i) for i, pf in enumerate(pg.faults)])
        live: dict[int, tuple[Fault, Callable[[], None]]] = {}
        done: list[Fault] = []
        for at, what, i in steps:
            time.sleep(max(0.0, t_group + at - time.time()))
            if what == 0:
                live[i] = self._apply(pg.faults[i], group)
            else:
                f, heal = live.pop(i)
                heal()
                f.end = time.time()
                self.say(f"HEAL  {f.kind} {f.target} after {f.end - f.start:.1f}s")
                done.append(f)
        return done

    def nemesis(self, t0: float, until: float, plan: list[PlannedGroup]) -> None:
        """Run the plan; each group starts no earlier than planned and no earlier than
        QUIET_MIN_S after the previous group's heal."""
        last_heal = 0.0
        for n, pg in enumerate(plan):
            start = max(t0 + pg.at, last_heal + QUIET_MIN_S)
            length = max(pf.offset + pf.duration for pf in pg.faults)
            if start + length > until:
                return
            time.sleep(max(0.0, start - time.time()))
            faults = self._run_group(n, pg)
            last_heal = max(f.end for f in faults)
            # the shards an agent fault can cost include those its agent holds after the heal
            time.sleep(max(0.0, last_heal + AFTER_HEAL_S - time.time()))
            for f in faults:
                if f.shards is not None:
                    f.shards = f.shards | self._shards_of(f.target)
            self.faults.extend(faults)

    def _watch_stores(self, stop: threading.Event) -> None:
        """When each job first appears in etcd (this process's clock, every 0.25 s): a
        firing stored after its due time is due when stored."""
        prefix = self.keys.jobs_prefix()
        while not stop.wait(0.25):
            try:
                kvs, _ = self.client.get_prefix(prefix, keys_only=True, timeout=1.0)
            except Exception:  # noqa: BLE001 - polled again (etcd faults)
                continue
            t = time.time()
            for kv in kvs:
                self.stored_at.setdefault(kv.key.rsplit("/", 1)[1], t)

    # --- judging ------------------------------------------------------------------------
    def affected(self, d: float) -> bool:
        return affected_at(self.faults, d)

    def effective_due(self, d: float) -> float:
        return effective_due(self.faults, d)

    def quiet(self, f: history.Firing) -> bool:
        return f.due >= self.t_quiet_from and is_quiet(self.faults, f, self.sleep_of[f.job])

    def _all_resolved(self) -> bool:
        try:
            kvs, _ = self.client.get_prefix(self.keys.runs_prefix())
        except Exception:  # noqa: BLE001
            return False
        recs = {}
        for kv in kvs:
            r = json.loads(kv.value)
            recs[(r["job_id"], r["fire_id"])] = r["state"]
        for f in self.firings:
            st = recs.get((f.job, f.fire_id))
            if st is None and not (f.may_skip and self.affected(f.due)):
                return False
            if st is not None and st not in history.TERMINAL:
                return False
        return True

    def run(self) -> Result:
        self.log(f"chaos: seed={self.seed} minutes={self.minutes} dir={self.dir}")
        self.log(f"chaos: reproduce with `make chaos SEED={self.seed} MINUTES={self.minutes:g}`")
        t_wall = time.monotonic()
        stop = threading.Event()
        try:
            self.setup()
            horizon = max(20.0, self.minutes * 60 - 40)
            t0 = now() + timedelta(seconds=4)
            plan = self.plan_workload(t0, horizon)
            fault_plan = plan_faults(self.rng, horizon, self.kinds)
            self.t_quiet_from = t0.timestamp()
            threading.Thread(target=self._pusher_thread, args=(plan, stop), daemon=True).start()
            threading.Thread(target=self._watch_stores, args=(stop,), daemon=True).start()
            self.say(f"workload: {len(self.firings)} firings of {len(plan)} jobs over {horizon:.0f}s; "
                     f"{len(fault_plan)} fault groups planned")
            self.nemesis(t0.timestamp(), t0.timestamp() + horizon - 2, fault_plan)
            # the faults are healed; every firing must resolve within the bound
            end = max(t0.timestamp() + horizon, max((f.end for f in self.faults), default=0)) + LATENESS_BOUND_S + 5
            last_due = max(f.due for f in self.firings)
            while time.time() < end and not (time.time() > last_due + 2 and self._all_resolved()):
                time.sleep(0.5)
            time.sleep(1.0)
            # stop the agents before reading: no write or side effect can land after the read
            for a in self.agents.values():
                a.kill()
            stop.set()
            return self.judge(t0.timestamp(), horizon, t_wall)
        finally:
            stop.set()
            self.close()

    def judge(self, t0: float, horizon: float, t_wall: float) -> Result:
        events = history.read_history(self.client, self.keys.prefix, contiguous=True)
        effects = history.parse_effects(self.out)
        for f in self.firings:
            f.stored_at = self.stored_at.get(f.job, 0.0)
        from agent.coordination.keys import shard_of

        budget, _ = budgets(self.faults, self.firings, self.sleep_of, lambda j: shard_of(j, SHARDS))
        rep = history.check(events, self.keys.prefix, firings=self.firings, effects=effects, budget=budget,
                            lateness_bound_s=LATENESS_BOUND_S, effective_due=self.effective_due,
                            affected=self.affected, max_run_s=JOB_SLEEP_MAX_S + KILL_GRACE_S + 1.0,
                            quiet=self.quiet, quiet_lateness_s=QUIET_LATENESS_S)
        kvs, _ = self.client.get_prefix(self.keys.jobs_prefix())
        stored = {kv.key.rsplit("/", 1)[1] for kv in kvs}
        for jid in sorted(set(self.pushed) - stored):
            rep.fail(f"job {jid}: pushed over MQTT, never stored in etcd")
        res = Result(self.seed, self.minutes, rep, self.faults, len(self.pushed), len(stored & set(self.pushed)),
                     time.monotonic() - t_wall)
        st = rep.stats
        kinds: dict[str, int] = {}
        for f in self.faults:
            kinds[f.kind] = kinds.get(f.kind, 0) + 1
        by_kind: dict[str, int] = {}
        for f in self.firings:
            k = "retrying" if f.max_attempts > 1 else f.kind
            by_kind[k] = by_kind.get(k, 0) + 1
        outcomes = dict(st.get("states") or {})
        for reason, n in (st.get("failed_reasons") or {}).items():
            outcomes[f"failed/{reason}"] = n
        outcomes.pop("failed", None)
        if st.get("skipped_by_policy"):
            outcomes["skipped_by_policy"] = st["skipped_by_policy"]
        res.figures = {"seed": self.seed, "faults": len(self.faults), "fault_kinds": kinds,
                       "affected_share": round(affected_share(self.faults, t0, t0 + horizon), 3),
                       "firings": st.get("firings"), "firings_by_kind": by_kind,
                       "quiet_firings": st.get("quiet_firings"), "side_effects": st.get("side_effects"),
                       "events": st.get("events"), "outcomes": outcomes,
                       "owner_lost": f"{st.get('owner_lost')}/{budget.owner_lost}",
                       "misfired": f"{st.get('misfired')}/{budget.misfired}",
                       "lateness_p50_s": _r(st.get("lateness_p50_s")), "lateness_p99_s": _r(st.get("lateness_p99_s")),
                       "lateness_max_s": _r(st.get("lateness_max_s")),
                       "quiet_lateness_p50_s": _r(st.get("quiet_lateness_p50_s")),
                       "quiet_lateness_p99_s": _r(st.get("quiet_lateness_p99_s")),
                       "quiet_lateness_max_s": _r(st.get("quiet_lateness_max_s")),
                       "pushed": res.pushed, "stored": res.stored, "wall_s": round(res.wall_s, 1)}
        self.log(f"chaos seed {self.seed}: faults {len(self.faults)} by kind {kinds}; "
                 f"{res.figures['affected_share']:.0%} of the horizon affected")
        self.log(f"chaos seed {self.seed}: firings {st.get('firings')} {by_kind}; quiet-window firings checked "
                 f"{st.get('quiet_firings')} (bound {QUIET_LATENESS_S:.1f} s); side effects {st.get('side_effects')}")
        self.log(f"chaos seed {self.seed}: lateness from effect clocks p50 {_r(st.get('lateness_p50_s'))} s "
                 f"p99 {_r(st.get('lateness_p99_s'))} s max {_r(st.get('lateness_max_s'))} s (bound "
                 f"{LATENESS_BOUND_S:.0f} s after a heal); quiet p50 {_r(st.get('quiet_lateness_p50_s'))} s "
                 f"p99 {_r(st.get('quiet_lateness_p99_s'))} s max {_r(st.get('quiet_lateness_max_s'))} s")
        self.log(f"chaos seed {self.seed}: outcomes {outcomes}; owner_lost {st.get('owner_lost')} of budget "
                 f"{budget.owner_lost}, misfired {st.get('misfired')} of budget {budget.misfired}")
        self.log("chaos figures: " + json.dumps(res.figures))
        if rep.problems:
            self.keep = True
            self.log(f"chaos: failed; kept {self.dir} (agents' logs and audit, effects.log)")
        return res

    def close(self) -> None:
        for c in self.cuts:
            c.heal()
        if self.pusher is not None:
            self.pusher.stop()
        for a in self.agents.values():
            a.kill()
        for a in self.agents.values():
            a.remove_cgroups()
        if self.client is not None:
            self.client.close()
        if self.mq is not None:
            self.mq.close()
        if self.etcd is not None:
            self.etcd.close()
        if self.own_dir and not self.keep and os.environ.get("MILLWRIGHT_CHAOS_KEEP") != "1":
            shutil.rmtree(self.dir, ignore_errors=True)


def _r(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 3)


def run_and_check(seed: int, minutes: float, workdir: Optional[str] = None, log=print) -> Result:
    res = ChaosRun(seed, minutes, workdir, log=log).run()
    if res.report.problems:
        raise AssertionError(f"chaos seed {seed} failed (reproduce: make chaos SEED={seed} MINUTES={minutes:g}); "
                             f"faults: {[(f.kind, f.target, round(f.end - f.start, 1)) for f in res.faults]}\n"
                             + "\n".join(res.report.problems[:20]))
    return res


def seed_from_commit() -> tuple[int, str]:
    """The seed CI runs: from the commit under test (each commit tries another schedule,
    and a run is repeated from its commit), else a random one. Returns (seed, where from)."""
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        if len(head) >= 8:
            return int(head[:8], 16) % 10 ** 6, f"commit {head[:12]}"
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return secrets.randbelow(10 ** 6), "random (no git commit)"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: a new one, printed)")
    ap.add_argument("--from-commit", action="store_true", help="the seed from the commit under test (as CI)")
    ap.add_argument("--seeds", type=int, default=1, help="run this many consecutive seeds from the first")
    ap.add_argument("--minutes", type=float, default=2.0)
    a = ap.parse_args(argv)
    if a.seed is not None:
        seed, origin = a.seed, "given"
    elif a.from_commit:
        seed, origin = seed_from_commit()
    else:
        seed, origin = secrets.randbelow(10 ** 6), "random"
    print(f"chaos: first seed {seed} ({origin}); {a.seeds} seed(s) of {a.minutes:g} minutes", flush=True)
    # SIGTERM (a CI timeout) unwinds through the cleanup: nftables tables, processes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    figures = []
    for s in range(seed, seed + a.seeds):
        try:
            figures.append(run_and_check(s, a.minutes).figures)
        except AssertionError as exc:
            print(f"FAIL: {exc}", file=sys.stderr)
            return 1
        print(f"PASS: seed {s}", flush=True)
    if len(figures) > 1:
        print("chaos: all seeds passed:\n" + "\n".join(json.dumps(f) for f in figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
