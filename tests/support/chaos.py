"""A seeded, randomized fault test on this machine (Jepsen-style).

A real 3-member etcd on loopback, 4 `millwright run` agents, a mosquitto; a workload of
one-shot, retrying and cron jobs pushed over MQTT whose script (tests/jobs/effect.sh)
records each run's side effect on its own clock (some jobs fail every attempt, some wait
for a dependency past their not_after and must never run); a nemesis that runs fault groups from a
seeded plan (one fault, or two that overlap), each followed by a quiet window (at least
TTL + 3 s with no fault). Every agent reaches each etcd member through a proxy of its own
(tests/support/etcd_proxy.py); each member's data and each agent's state live on a small
file system of their own (tests/support/faults.py). The faults:

- agents: kill -9 (aimed at an agent with a job running) and restart, SIGTERM and restart,
  SIGSTOP/SIGCONT; its wall clock set 2 s ahead or behind, or 30 s ahead (stepped back at
  the heal); its state disk slow (fsyncs throttled) or full;
- links (nftables, tables `mw_chaos_*`, always removed): agent<->etcd cut both ways,
  requests only, replies only; agent<->broker cut, replies only; the agent's etcd replies
  dropped (connections reset at the heal) or held and delivered late by its proxy; its etcd
  requests held by its proxy past its lease and delivered at the heal, their cancels lost
  (late writes, that only the fence tells from live ones);
- etcd: the leader killed and restarted, a member paused, the leader isolated on its peer
  port, quorum lost (2 of 3 members paused), a member's disk slow or full;
- the broker killed (-9) and restarted.

Afterwards the whole etcd history (one watch from revision 1, compaction off) and the
side-effect log go through tests/support/history.py.

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
import bisect
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
import traceback
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
from tests.support import faults as fx  # noqa: E402
from tests.support import history  # noqa: E402
from tests.support.etcd_proxy import ReplyProxy  # noqa: E402

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
EXHAUSTED_ATTEMPTS = 2          # the jobs that fail every attempt have this many
WAIT_DEPENDENCY_S = 6.0         # a waiting job's dependency is due this long after it,
EXPIRES_AFTER_S = 2.0           # and the waiting job expires (not_after) this long after its due time
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
FAULTS = ("agent_kill9", "agent_restart", "agent_pause", "cut_etcd", "cut_broker",
          "cut_etcd_requests", "cut_etcd_replies", "cut_broker_replies", "etcd_replies_drop", "etcd_replies_delay",
          "etcd_requests_delay",
          "clock_skew", "clock_jump", "agent_disk_slow", "agent_disk_full",
          "etcd_leader_kill", "etcd_member_pause", "etcd_leader_isolate", "etcd_quorum_loss",
          "etcd_disk_slow", "etcd_disk_full", "broker_kill")
# faults aimed at one agent: they can cost the firings of its shards only
AGENT_FAULTS = {"agent_kill9", "agent_restart", "agent_pause", "cut_etcd", "cut_broker", "cut_etcd_requests",
                "cut_etcd_replies", "cut_broker_replies", "etcd_replies_drop", "etcd_replies_delay",
                "etcd_requests_delay", "clock_skew",
                "clock_jump", "agent_disk_slow", "agent_disk_full"}
ETCD_FAULTS = {"etcd_leader_kill", "etcd_member_pause", "etcd_leader_isolate", "etcd_quorum_loss", "etcd_disk_slow",
               "etcd_disk_full"}
# faults that cannot fence an agent, so cost no run and skip no cron firing
HARMLESS_TO_RUNS = {"cut_broker", "cut_broker_replies", "broker_kill"}
CLOCK_FAULTS = {"clock_skew": 2, "clock_jump": 30}   # seconds (a skew is +2 or -2; a jump is forward)
DISK_FAULTS = {"agent_disk_slow", "agent_disk_full", "etcd_disk_slow", "etcd_disk_full"}
PROXY_MODES = {"etcd_replies_drop": "drop", "etcd_replies_delay": "hold", "etcd_requests_delay": "hold_requests"}
# faults that last past the lease (TTL_S more than drawn): the agent's shards move while its
# requests are held, so what is delivered at the heal is late
PAST_THE_LEASE = {"etcd_requests_delay"}
# the outcomes a fault may cost besides owner_lost and misfired: a graceful stop kills its
# runs (killed/agent_stopped); a full state disk fails their start (failed/spawn_error...)
KILLS_RUNS = {"agent_restart"}
FAILS_RUNS = {"agent_disk_full"}
PROBE_S = 1.0
# faults aimed at an agent with a job running (a kill -9 then leaves a `running` record that
# its shard's next owner must resolve), waiting at most AIM_WAIT_S for one
AIMED = {"agent_kill9"}
# agent faults that act on the agent's process (its pid): not applied while it is down
PROCESS_FAULTS = {"agent_kill9", "agent_restart", "agent_pause", "agent_disk_slow"}
AIM_WAIT_S = 3.0
OVERLAP_P = 0.35                # a fault group holds two overlapping faults this often
DISK_SLOW_IOPS = 5              # a slow disk: every fsync waits about 1/5 s
ETCD_DISK_MB, AGENT_DISK_MB = 256, 64


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
    reach_s: float = 0.0    # a clock ahead by this much runs firings due this much later
    offset_s: int = 0       # a clock fault's offset
    note: str = ""          # what the heal found (a process the fault ended)

    def window(self) -> tuple[float, float]:
        """When it may change what the agents do: from its start to its heal + TTL (a
        clock ahead reaches that much further)."""
        return self.start, self.end + self.reach_s + AFTER_HEAL_S


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


def _category(kind: str) -> str:
    return "etcd" if kind in ETCD_FAULTS else "broker" if kind == "broker_kill" else "agent"


def plan_faults(rng: random.Random, horizon: float, kinds: tuple[str, ...] = FAULTS) -> list[PlannedGroup]:
    """The seeded fault plan: groups of one fault, or two that overlap (OVERLAP_P: the
    second starts while the first is on, at another agent, or on another component), each
    group after a quiet window of QUIET_MIN_S .. QUIET_MIN_S + QUIET_EXTRA_S (counted by
    the nemesis from the previous group's heal, so a slow heal delays the plan instead of
    shortening the window)."""
    out = []
    t = rng.uniform(QUIET_MIN_S, QUIET_MIN_S + QUIET_EXTRA_S)
    while True:
        kind = rng.choice(kinds)
        duration = rng.uniform(1.5, 6.0) + (TTL_S if kind in PAST_THE_LEASE else 0)
        pick = rng.randrange(1 << 16)
        faults = [PlannedFault(kind, 0.0, duration, pick)]
        if rng.random() < OVERLAP_P:
            k2 = rng.choice(kinds)
            offset = rng.uniform(0.5, duration)
            d2 = rng.uniform(1.5, 6.0) + (TTL_S if k2 in PAST_THE_LEASE else 0)
            pick2 = pick + 1 + rng.randrange(3)   # another agent (of four) or member (of three)
            if k2 != kind and (_category(k2) != _category(kind) or _category(k2) == "agent"):
                faults.append(PlannedFault(k2, offset, d2, pick2))
        # a clock fault reaches past its heal (the agent's times stay off until it catches up):
        # the next quiet window starts after that reach, so the plan makes room for it
        length = max(f.offset + f.duration + CLOCK_FAULTS.get(f.kind, 0.0) for f in faults)
        if t + length > horizon - 2:
            return out
        out.append(PlannedGroup(t, tuple(faults)))
        t += length + rng.uniform(QUIET_MIN_S, QUIET_MIN_S + QUIET_EXTRA_S)


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


def exposed(faults: list[Fault], firings: list[history.Firing], sleep_of: dict[str, float],
            shard_of_job: Callable[[str], int]) -> dict[str, set]:
    """Per outcome, the firings a fault could cost it: those that could be in flight in its
    window (misfired: the cron firings due inside it), on the shards it touches (an agent
    fault: its agent's, at its start and TTL after its heal; an etcd fault: all).
    owner_lost and misfired: the faults that can fence an agent; killed: a graceful stop;
    failed (another reason than owner_lost): a full state disk."""
    out: dict[str, set] = {"owner_lost": set(), "misfired": set(), "killed": set(), "failed": set()}
    for g in faults:
        w0, w1 = g.window()
        for f in firings:
            if g.shards is not None and shard_of_job(f.job) not in g.shards:
                continue
            t0 = max(f.due, f.stored_at)
            key = (f.job, f.fire_id)
            if not _overlaps(t0, t0 + flight_s(f, sleep_of.get(f.job, 0.0)), w0, w1):
                continue
            if g.loses_runs:
                out["owner_lost"].add(key)
                if f.may_skip and w0 <= f.due <= w1:
                    out["misfired"].add(key)
            if g.kind in KILLS_RUNS:
                out["killed"].add(key)
            if g.kind in FAILS_RUNS:
                out["failed"].add(key)
    return out


def held_during(events: list[history.Event], shards_prefix: str, agent: str, rev0: int, rev1: int) -> set[int]:
    """The shards ``agent`` owned at revision ``rev0`` or was given in (rev0, rev1], by the
    history of the shard keys (an owner key's value is its agent's id): a shard can pass
    to a faulty agent and leave it again between two polls of the owners."""
    owner: dict[str, str] = {}
    held: set[str] = set()
    for e in events:
        if e.rev > rev1:
            break
        if not e.key.startswith(shards_prefix):
            continue
        value = e.value.decode() if e.kind == "put" else ""
        if e.rev <= rev0:
            owner[e.key] = value
        elif value == agent:
            held.add(e.key)
    held |= {k for k, v in owner.items() if v == agent}
    return {int(k.rsplit("/", 1)[1]) for k in held}


def budgets(faults: list[Fault], firings: list[history.Firing], sleep_of: dict[str, float],
            shard_of_job: Callable[[str], int]) -> tuple[history.Budget, dict[str, set]]:
    """owner_lost and misfired budgets: how many firings the faults could cost each (see
    :func:`exposed`; each firing counts once)."""
    ex = exposed(faults, firings, sleep_of, shard_of_job)
    return history.Budget(owner_lost=len(ex["owner_lost"]), misfired=len(ex["misfired"])), ex


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


class ChaosRun:
    def __init__(self, seed: int, minutes: float = 2.0, workdir: Optional[str] = None, agents: int = 4,
                 log: Callable[[str], None] = print, kinds: tuple[str, ...] = FAULTS):
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
        self.rules: list[fx.NftRules] = []
        self.proxies: dict[str, list[ReplyProxy]] = {}
        self.clocks: dict[str, fx.Clock] = {}
        self.disks: dict[str, fx.LoopDisk] = {}
        self.throttles: list[fx.BlkioThrottle] = []
        self.netcls: Optional[fx.NetCls] = None
        self.push_time: dict[str, float] = {}
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
        self.rev_clock: list[tuple[int, float]] = []   # (revision read, when): this process's clock
        self.t_quiet_from = 0.0
        self.kinds = tuple(kinds)
        self.keep = False
        self._effects_read = 0
        self._in_flight: dict[tuple[str, str, str], tuple[str, float]] = {}

    def say(self, msg: str) -> None:
        self.log(f"{time.monotonic() - self.t_start:7.2f}s {msg}")

    # --- setup -------------------------------------------------------------------------
    def setup(self) -> None:
        from agent.cloud.mqtt import MqttLink
        from tests.support.cloudkit import write_keys

        # ids unique on the host: an agent's run cgroups are named after its id, and an agent
        # starting removes "stale" ones, so a0 of another test run must never be ours
        ids = [f"a{i}-{os.getpid() % 100000}" for i in range(self.n_agents)]
        self.hosts = {a: f"127.0.0.{10 + i}" for i, a in enumerate(ids)}
        self.etcd = EtcdCluster(3, os.path.join(self.dir, "etcd"), extra_hosts=tuple(self.hosts.values()))
        disks = os.path.join(self.dir, "disks")
        os.makedirs(disks, exist_ok=True)
        if DISK_FAULTS & set(self.kinds):
            # each member's data and each agent's state on a file system of its own
            for m in self.etcd.members:
                self.disks[m.member_name] = fx.LoopDisk(os.path.join(disks, f"{m.member_name}.img"),
                                                        os.path.join(m.dir, "data"), ETCD_DISK_MB).create()
            for a in ids:
                self.disks[a] = fx.LoopDisk(os.path.join(disks, f"{a}.img"),
                                            os.path.join(self.dir, "agents", a, "state"), AGENT_DISK_MB).create()
        if "etcd_leader_isolate" in self.kinds:
            self.netcls = fx.NetCls(self.dir).mount()
        self.etcd.start()
        # each agent reaches each member through a proxy of its own, on its own address
        for a in ids:
            self.proxies[a] = [ReplyProxy(self.hosts[a], free_port(self.hosts[a]), ("127.0.0.1", m.port)).start()
                               for m in self.etcd.members]
        self.broker_ports = {a: free_port() for a in ids}
        listeners = "".join(f"listener {p} 127.0.0.1\n" for p in self.broker_ports.values())
        self.mq = MosquittoServer(os.path.join(self.dir, "mosquitto"), extra_conf=listeners)
        os.makedirs(self.mq.dir, exist_ok=True)
        self.mq.start()
        # a directory of its own: the templates name self.dir (effects.log), which hiding
        # cannot cover whole, and a root agent with root templates refuses such a layout
        os.makedirs(os.path.join(self.dir, "signing"), exist_ok=True)
        self.ring = write_keys(os.path.join(self.dir, "signing", "keys.yaml"))
        os.makedirs(os.path.join(self.dir, "agents"), exist_ok=True)
        shim = ""
        for a in ids:
            env: dict = {}
            if CLOCK_FAULTS.keys() & set(self.kinds):
                shim = shim or fx.Clock.build(self.dir)
                self.clocks[a] = fx.Clock(os.path.join(self.dir, f"clock-{a}"), shim)
                env = self.clocks[a].env()
            # each agent writes test/probe/<shard> under its fence every PROBE_S: more fenced
            # writes for the checker to hold against the shard keys (a late one is stale)
            env["MILLWRIGHT_TEST_FENCED_WRITES_S"] = str(PROBE_S)
            self.agents[a] = AgentProcess(a, os.path.join(self.dir, "agents"), self._config(a), env=env).start()
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
                "etcd": {"endpoints": [f"http://{self.hosts[agent]}:{p.port}" for p in self.proxies[agent]],
                         "lease_ttl_s": TTL_S,
                         "renew_deadline_s": RENEW_DEADLINE_S, "retry_period_s": 0.5, "request_timeout_s": 1.0,
                         "insecure": True},
                "mqtt": {"url": f"mqtt://127.0.0.1:{self.broker_ports[agent]}", "reconnect_min_s": 0.2,
                         "reconnect_max_s": 1.0, "ingest_grace_s": 1.5},
                "signing": {"keys_file": os.path.join(self.dir, "signing", "keys.yaml")},
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
        time, so pushes go on while faults do. Besides jobs that succeed (some after failed
        attempts): jobs that fail every attempt (they end `failed` after exactly
        max_attempts), and jobs that wait for a dependency due after their not_after (they
        end `misfired`/expired and never run)."""
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
        for i in range(max(2, int(horizon / 15))):
            # fails every attempt: `failed` after attempt EXHAUSTED_ATTEMPTS, never one more
            jid = f"x{i:03d}-{self.seed % 1000}"
            due = self._due_in(t0, horizon)
            sleep = round(rng.uniform(0.1, JOB_SLEEP_MAX_S), 2)
            self.sleep_of[jid] = sleep
            doc = {"v": 1, "id": jid, "template": "fx", "params": {"sleep": f"{sleep:.2f}", "fail_until": "9"},
                   "schedule": {"at": format_rfc3339(due)}, "misfire": "run_once",
                   "retry": {"max_attempts": EXHAUSTED_ATTEMPTS, "backoff_s": 1.0, "max_backoff_s": 2.0, "jitter": 0}}
            plan.append((max(time.time(), due.timestamp() - rng.uniform(3, 20)), doc))
            self.firings.append(history.Firing(jid, fire_id(jid, due), due.timestamp(), "at", EXHAUSTED_ATTEMPTS,
                                               expect="failed"))
        for i in range(max(2, int(horizon / 20))):
            # waits for a dependency due WAIT_DEPENDENCY_S after it, past its not_after
            # (EXPIRES_AFTER_S after its due time): expires waiting, never runs
            wid, did = f"w{i:03d}-{self.seed % 1000}", f"d{i:03d}-{self.seed % 1000}"
            due = self._due_in(t0, max(1.0, horizon - WAIT_DEPENDENCY_S - 1))
            dep_due = due + timedelta(seconds=WAIT_DEPENDENCY_S)
            not_after = due + timedelta(seconds=EXPIRES_AFTER_S)
            push_at = max(time.time(), due.timestamp() - rng.uniform(3, 20))
            for jid, at in ((did, dep_due), (wid, due)):
                self.sleep_of[jid] = 0.1
                doc = {"v": 1, "id": jid, "template": "fx", "params": {"sleep": "0.10", "fail_until": "0"},
                       "schedule": {"at": format_rfc3339(at)}, "misfire": "run_once"}
                if jid == wid:
                    doc.update(depends_on=[did], not_after=format_rfc3339(not_after))
                plan.append((push_at, doc))
            self.firings.append(history.Firing(did, fire_id(did, dep_due), dep_due.timestamp(), "at"))
            self.firings.append(history.Firing(wid, fire_id(wid, due), due.timestamp(), "at", expect="misfired",
                                               not_after=not_after.timestamp()))
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
                self.firings.append(history.Firing(jid, fire_id(jid, due), float(d), "cron", 1, may_skip=True,
                                                   not_after=not_after.timestamp()))
                d += CRON_PERIOD_S
        plan.sort(key=lambda x: x[0])
        return plan

    def _due_in(self, t0: datetime, horizon: float) -> datetime:
        due = t0 + timedelta(seconds=self.rng.uniform(0, horizon))
        return due.replace(microsecond=(due.microsecond // 1000) * 1000)

    def _push(self, doc: dict) -> None:
        from agent.jobs.signing import sign
        from agent.cloud.topics import Topics

        doc = dict(doc, cluster=CLUSTER, kind="job")  # bound to this cluster (signed with it)
        doc.setdefault("issued_at", format_rfc3339(now().replace(microsecond=0)))
        body = json.dumps(sign(doc, self.ring, "cloud-1"), separators=(",", ":")).encode()
        self.push_time[doc["id"]] = time.time()
        self.pusher.publish(Topics(CLUSTER).push, body, qos=1)   # queued by paho while disconnected
        self.pushed[doc["id"]] = doc

    def _pusher_thread(self, plan, stop: threading.Event) -> None:
        for at, doc in plan:
            if stop.wait(max(0.0, at - time.time())):
                return
            self._push(doc)

    # --- nemesis -------------------------------------------------------------------------
    def _shards_of(self, agent: str) -> set[int]:
        return {int(k.rsplit("/", 1)[1]) for k, v in self._owners().items() if v == agent}

    def _rules(self, text: str, hook: str = "input") -> fx.NftRules:
        r = fx.NftRules(text, hook)
        self.rules.append(r)
        return r.apply()

    def _restart_member_if_dead(self, m, f: Fault) -> None:
        if m.proc is None or m.proc.poll() is not None:
            f.note = f"{m.member_name} exited ({m.proc.returncode if m.proc else 'stopped'}); restarted"
            self.say(f"  {f.note}")
            m.start()

    def _apply(self, pf: PlannedFault, group: int) -> tuple[Fault, Callable[[], None]]:
        """Start one fault; returns it and the function that heals it."""
        kind = pf.kind
        ids = sorted(self.agents)
        agent = ids[pf.pick % len(ids)]
        if kind in AIMED:
            agent = self._aim(agent)
        members = self.etcd.members
        f = Fault(kind, agent if kind in AGENT_FAULTS else "", time.time(), group=group,
                  loses_runs=kind not in HARMLESS_TO_RUNS)
        if kind in AGENT_FAULTS:
            f.shards = frozenset(self._shards_of(agent))
        a = self.agents[agent]
        proxy_ports = [p.port for p in self.proxies[agent]]
        heal: Callable[[], None]

        def healthy() -> None:
            self.etcd.wait_healthy(60)
            self._wait_writable()

        if kind in PROCESS_FAULTS and not a.alive():
            # an aimed kill -9 may have moved onto this agent within the group: it is down
            # until that fault heals, so this one has no process to act on (counted as a
            # fault all the same: its window only widens what the oracles forgive)
            f.note = f"not applied: {agent} was down (another fault of the group)"
            self.say(f"  {f.note}")
            return f, lambda: None
        if kind == "etcd_leader_kill":
            m = self.etcd.leader()
            f.target = m.member_name
            m.kill()

            def heal():
                m.start()
                healthy()
        elif kind == "etcd_member_pause":
            m = members[pf.pick % len(members)]
            f.target = m.member_name
            m.pause()

            def heal():
                m.resume()
                healthy()
        elif kind == "etcd_quorum_loss":
            two = [members[(pf.pick + i) % len(members)] for i in (0, 1)]
            f.target = "+".join(m.member_name for m in two)
            for m in two:
                m.pause()

            def heal():
                for m in two:
                    m.resume()
                healthy()
        elif kind == "etcd_leader_isolate":
            # the leader's peer traffic, both ways: connections to its peer port, and its own
            # (net_cls-tagged) connections to the others' peer ports; clients still reach it
            m = self.etcd.leader()
            f.target = m.member_name
            pid, classid = m.proc.pid, 0x100001 + m.index
            self.netcls.tag(pid, classid)
            peers = fx.ports(x.peer_port for x in members)
            rules = self._rules(f"    meta cgroup {classid} tcp dport {peers} drop\n"
                                f"    tcp dport {m.peer_port} drop\n    tcp sport {m.peer_port} drop", hook="output")

            def heal():
                rules.heal()
                self.netcls.untag(pid)
                healthy()
        elif kind in ("etcd_disk_slow", "etcd_disk_full"):
            m = members[pf.pick % len(members)]
            f.target = m.member_name
            disk = self.disks[m.member_name]
            if kind == "etcd_disk_slow":
                th = fx.BlkioThrottle(m.member_name)
                self.throttles.append(th)
                th.apply(m.proc.pid, disk.majmin, DISK_SLOW_IOPS)

                def heal():
                    th.heal()
                    self._wait_writable()
            else:
                disk.fill()

                def heal():
                    disk.unfill()
                    self._restart_member_if_dead(m, f)
                    healthy()
        elif kind == "broker_kill":
            f.target = "mosquitto"
            self.mq.kill()
            heal = self.mq.start
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
        elif kind in ("cut_etcd", "cut_etcd_requests", "cut_etcd_replies"):
            way = {"cut_etcd": "both", "cut_etcd_requests": "requests", "cut_etcd_replies": "replies"}[kind]
            heal = self._rules(fx.cut_rules(self.hosts[agent], proxy_ports, way)).heal
        elif kind in ("cut_broker", "cut_broker_replies"):
            way = "both" if kind == "cut_broker" else "replies"
            heal = self._rules(fx.cut_rules("127.0.0.1", [self.broker_ports[agent]], way)).heal
        elif kind in PROXY_MODES:
            for p in self.proxies[agent]:
                p.set_mode(PROXY_MODES[kind])

            def heal():
                for p in self.proxies[agent]:
                    p.set_mode("pass")
        elif kind in CLOCK_FAULTS:
            clock = self.clocks[agent]
            f.offset_s = CLOCK_FAULTS[kind] * (1 if kind == "clock_jump" or pf.pick % 2 else -1)
            f.reach_s = max(0, f.offset_s)
            clock.set(f.offset_s)

            def heal():
                clock.set(0)
                time.sleep(0.3)   # the shim reads the offset again every 200 ms
        elif kind == "agent_disk_slow":
            th = fx.BlkioThrottle(agent)
            self.throttles.append(th)
            th.apply(a.pid, self.disks[agent].majmin, DISK_SLOW_IOPS)
            heal = th.heal
        elif kind == "agent_disk_full":
            disk = self.disks[agent]
            disk.fill()

            def heal():
                disk.unfill()
                if not a.alive():
                    f.note = f"{agent} exited ({a.proc.returncode if a.proc else '?'}); restarted"
                    self.say(f"  {f.note}")
                    a.start()
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        self.say(f"FAULT {kind} {f.target}" + (f" {f.offset_s:+d}s" if f.offset_s else "")
                 + f" for {pf.duration:.1f}s")
        return f, heal

    def _wait_writable(self, timeout: float = 60.0) -> None:
        """An etcd fault has healed when the cluster commits a write again: its members can
        answer and agree on a leader seconds before that (after a quorum loss on a loaded
        machine), and until then no agent can hold a lease, claim or record anything."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client.put(self.keys.prefix + "test/heal", str(time.time()), timeout=1.0)
                return
            except Exception:  # noqa: BLE001 - tried again until the deadline (etcd faults)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def _aim(self, planned: str) -> str:
        """The agent a kill -9 hits: one with a job running now (by the side-effect log: a
        start line without its end line), waiting up to AIM_WAIT_S for one, so the kill
        leaves a run its new owner must resolve as "may have run"; else the planned one."""
        deadline = time.monotonic() + AIM_WAIT_S
        while True:
            running = self._runs_in_flight()
            live = sorted({agent for agent, _ in running.values() if agent in self.agents and self.agents[agent].alive()})
            if live:
                agent = planned if planned in live else live[0]
                what = sorted(k for k, (a, _) in running.items() if a == agent)[0]
                self.say(f"  aimed at {agent}: {what[0]} {what[1]} attempt {what[2]} running")
                return agent
            if time.monotonic() > deadline:
                return planned
            time.sleep(0.05)

    def _runs_in_flight(self) -> dict[tuple[str, str, str], tuple[str, float]]:
        """(job, firing, attempt) -> (agent, start) of every run whose start line is in the
        side-effect log without its end line (read on from where the last call stopped)."""
        try:
            with open(self.out, "rb") as fh:
                fh.seek(self._effects_read)
                data = fh.read()
        except FileNotFoundError:
            return {}
        complete = data[:data.rfind(b"\n") + 1]
        self._effects_read += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            p = line.split()
            if len(p) != 7:
                continue
            key = (p[1], p[2], p[3])
            if p[0] == "start":
                self._in_flight[key] = (p[4], float(p[6]))
            else:
                self._in_flight.pop(key, None)
        # a run killed with its agent writes no end line: forgotten after the longest run
        now_s = time.time()
        for k in [k for k, (_, t) in self._in_flight.items() if now_s - t > JOB_SLEEP_MAX_S + KILL_GRACE_S + 1.0]:
            del self._in_flight[k]
        return dict(self._in_flight)

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
            last_heal = max(f.end + f.reach_s for f in faults)   # a clock ahead reaches further
            # the shards an agent fault can cost include those its agent holds after the heal
            time.sleep(max(0.0, last_heal + AFTER_HEAL_S - time.time()))
            for f in faults:
                if f.shards is not None:
                    f.shards = f.shards | self._shards_of(f.target)
            self.faults.extend(faults)

    def _watch_stores(self, stop: threading.Event) -> None:
        """When each job first appears in etcd (this process's clock, every 0.25 s): a
        firing stored after its due time is due when stored. Each read's revision and time
        also date the history's writes on this clock (:meth:`rev_time`), whatever clock
        the agent that wrote them had."""
        prefix = self.keys.jobs_prefix()
        while not stop.wait(0.25):
            try:
                kvs, rev = self.client.get_prefix(prefix, keys_only=True, timeout=1.0)
            except Exception:  # noqa: BLE001 - polled again (etcd faults)
                continue
            t = time.time()
            self.rev_clock.append((rev, t))
            for kv in kvs:
                self.stored_at.setdefault(kv.key.rsplit("/", 1)[1], t)

    # --- judging ------------------------------------------------------------------------
    def affected(self, d: float) -> bool:
        return affected_at(self.faults, d)

    def effective_due(self, d: float) -> float:
        return effective_due(self.faults, d)

    def rev_time(self, rev: int) -> Optional[float]:
        """When the write at ``rev`` had surely happened: the first read that saw it."""
        i = bisect.bisect_left(self.rev_clock, (rev, 0.0))
        return self.rev_clock[i][1] if i < len(self.rev_clock) else None

    def rev_read_before(self, t: float) -> int:
        """A revision every write before ``t`` (this process's clock) is after: the last
        read done by then (0 before the first)."""
        return max((rev for rev, when in self.rev_clock if when <= t), default=0)

    def rev_read_after(self, t: float) -> int:
        """A revision every write until ``t`` is at or before: the first read after it
        (every revision when none was)."""
        return min((rev for rev, when in self.rev_clock if when >= t), default=1 << 62)

    def early_ok_s(self, se: history.SideEffect) -> float:
        """How early a run may start by its agent's clock fault (the shim reads the offset
        every 200 ms; a run claimed ahead under it starts up to its claim lead later)."""
        ahead = [g.offset_s for g in self.faults if g.kind in CLOCK_FAULTS and g.target == se.agent
                 and g.offset_s > 0 and g.start - 1.0 <= se.start <= g.end + 2.0]
        return 0.05 + max(ahead, default=0)

    def late_ok_s(self, se: history.SideEffect) -> float:
        """How long after its job's not_after a run may start by its agent's clock fault (a
        clock set behind expires the job that much later on the effect's clock)."""
        behind = [-g.offset_s for g in self.faults if g.kind in CLOCK_FAULTS and g.target == se.agent
                  and g.offset_s < 0 and g.start - 1.0 <= se.start <= g.end + 2.0]
        return 0.05 + max(behind, default=0)

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

        for g in self.faults:
            if g.shards is not None:
                w0, w1 = g.window()
                g.shards = g.shards | held_during(events, self.keys.shards_prefix(), g.target,
                                                  self.rev_read_before(w0), self.rev_read_after(w1))
        budget, ex = budgets(self.faults, self.firings, self.sleep_of, lambda j: shard_of(j, SHARDS))
        rep = history.check(events, self.keys.prefix, firings=self.firings, effects=effects, budget=budget,
                            lateness_bound_s=LATENESS_BOUND_S, effective_due=self.effective_due,
                            affected=self.affected, max_run_s=JOB_SLEEP_MAX_S + KILL_GRACE_S + 1.0,
                            quiet=self.quiet, quiet_lateness_s=QUIET_LATENESS_S, early_ok_s=self.early_ok_s,
                            late_ok_s=self.late_ok_s, rev_time=self.rev_time)
        # the outcomes besides owner_lost and misfired: each only where a fault could cost it
        finals = history.final_records(events, self.keys.prefix)
        other = {"killed": 0, "failed": 0}
        for f in self.firings:
            r = finals.get((f.job, f.fire_id)) or {}
            what = "killed" if r.get("state") == "killed" else (
                "failed" if r.get("state") == "failed" and r.get("reason") != "owner_lost" else None)
            if what is None or (f.expect == "failed" and (r.get("reason") or "").split(":")[0] == "failed"):
                continue   # (a job that fails every attempt: its own failure, judged by the checker)
            other[what] += 1
            if (f.job, f.fire_id) not in ex[what]:
                rep.fail(f"{history.name(f.job, f.fire_id)}: ended {r.get('state')}/{r.get('reason')} with no fault "
                         f"that {'stops agents gracefully' if what == 'killed' else 'fills a state disk'} in flight")
        kvs, _ = self.client.get_prefix(self.keys.jobs_prefix())
        stored = {kv.key.rsplit("/", 1)[1] for kv in kvs}
        # a kill -9 of the broker loses what it accepted but had not delivered or saved (it
        # saves every second): a push acknowledged just before it is the broker's loss
        kills = [g for g in self.faults if g.kind == "broker_kill"]
        broker_lost = []
        for jid in sorted(set(self.pushed) - stored):
            t = self.push_time.get(jid, 0.0)
            if any(g.start - 2.0 <= t <= g.end for g in kills):
                broker_lost.append(jid)
            else:
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
        budgets_by_type = {"owner_lost": f"{st.get('owner_lost')}/{budget.owner_lost}",
                           "misfired": f"{st.get('misfired')}/{budget.misfired}",
                           "killed": f"{other['killed']}/{len(ex['killed'])}",
                           "failed_other": f"{other['failed']}/{len(ex['failed'])}"}
        notes = [f"{g.kind}: {g.note}" for g in self.faults if g.note]
        res.figures = {"seed": self.seed, "faults": len(self.faults), "fault_kinds": kinds,
                       "affected_share": round(affected_share(self.faults, t0, t0 + horizon), 3),
                       "firings": st.get("firings"), "firings_by_kind": by_kind,
                       "quiet_firings": st.get("quiet_firings"),
                       "quiet_overlapped": st.get("quiet_overlapped") or [], "side_effects": st.get("side_effects"),
                       "events": st.get("events"), "outcomes": outcomes,
                       "owner_lost": f"{st.get('owner_lost')}/{budget.owner_lost}",
                       "misfired": f"{st.get('misfired')}/{budget.misfired}", "budgets": budgets_by_type,
                       "overlapping_groups": len({g.group for g in self.faults}) and sum(
                           1 for n in {g.group for g in self.faults} if sum(1 for g in self.faults if g.group == n) > 1),
                       "heal_notes": notes, "pushes_lost_by_broker_kill": broker_lost,
                       "lateness_p50_s": _r(st.get("lateness_p50_s")), "lateness_p99_s": _r(st.get("lateness_p99_s")),
                       "lateness_max_s": _r(st.get("lateness_max_s")),
                       "quiet_lateness_p50_s": _r(st.get("quiet_lateness_p50_s")),
                       "quiet_lateness_p99_s": _r(st.get("quiet_lateness_p99_s")),
                       "quiet_lateness_max_s": _r(st.get("quiet_lateness_max_s")),
                       "pushed": res.pushed, "stored": res.stored, "wall_s": round(res.wall_s, 1)}
        self.log(f"chaos seed {self.seed}: faults {len(self.faults)} by kind {kinds}; "
                 f"{res.figures['affected_share']:.0%} of the horizon affected")
        self.log(f"chaos seed {self.seed}: firings {st.get('firings')} {by_kind}; quiet-window firings checked "
                 f"{st.get('quiet_firings')} (bound {QUIET_LATENESS_S:.1f} s; skipped behind a fault's late run of "
                 f"their job: {st.get('quiet_overlapped') or 'none'}); side effects {st.get('side_effects')}")
        self.log(f"chaos seed {self.seed}: lateness from effect clocks p50 {_r(st.get('lateness_p50_s'))} s "
                 f"p99 {_r(st.get('lateness_p99_s'))} s max {_r(st.get('lateness_max_s'))} s (bound "
                 f"{LATENESS_BOUND_S:.0f} s after a heal); quiet p50 {_r(st.get('quiet_lateness_p50_s'))} s "
                 f"p99 {_r(st.get('quiet_lateness_p99_s'))} s max {_r(st.get('quiet_lateness_max_s'))} s")
        self.log(f"chaos seed {self.seed}: outcomes {outcomes}; used/budget {budgets_by_type}")
        if notes or broker_lost:
            self.log(f"chaos seed {self.seed}: heals found {notes}; pushes lost by a broker kill -9 {broker_lost}")
        self.log("chaos figures: " + json.dumps(res.figures))
        if rep.problems:
            self.keep = True
            if os.environ.get("MILLWRIGHT_CHAOS_KEEP") != "0":
                self.log(f"chaos: failed; kept {self.dir} (agents' logs and audit, effects.log)")
        return res

    def close(self) -> None:
        for r in self.rules:
            r.heal()
        for p in [p for ps in self.proxies.values() for p in ps]:
            p.set_mode("pass")
        for th in self.throttles:
            th.heal()
        for c in self.clocks.values():
            c.set(0)
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
        for p in [p for ps in self.proxies.values() for p in ps]:
            p.close()
        if self.netcls is not None:
            self.netcls.close()
        for d in self.disks.values():
            d.unfill()
            d.close()
        # a failed run's directory is kept for a look (MILLWRIGHT_CHAOS_KEEP=1: every run's,
        # =0: none, as the mutation harness runs it)
        keep = {"1": True, "0": False}.get(os.environ.get("MILLWRIGHT_CHAOS_KEEP", ""), self.keep)
        if self.own_dir and not keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def _r(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 3)


def run_and_check(seed: int, minutes: float, workdir: Optional[str] = None, log=print,
                  kinds: tuple[str, ...] = FAULTS) -> Result:
    res = ChaosRun(seed, minutes, workdir, log=log, kinds=kinds).run()
    if res.report.problems:
        raise AssertionError(failure(res, kinds))
    return res


def failure(res: Result, kinds: tuple[str, ...] = FAULTS) -> str:
    only = "" if kinds == FAULTS else f" KINDS={','.join(kinds)}"
    return (f"chaos seed {res.seed} failed (reproduce: make chaos SEED={res.seed} MINUTES={res.minutes:g}{only}); "
            f"faults: {[(f.kind, f.target, round(f.end - f.start, 1)) for f in res.faults]}\n"
            + "\n".join(res.report.problems[:20]))


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


def _report(path: str, doc: dict) -> None:
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(doc) + "\n")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: a new one, printed)")
    ap.add_argument("--from-commit", action="store_true", help="the seed from the commit under test (as CI)")
    ap.add_argument("--seeds", type=int, default=1, help="run this many consecutive seeds from the first")
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--kinds", default="", help="only these fault kinds (comma-separated; default: all)")
    ap.add_argument("--report", default="", help="write each seed's outcome here, one JSON line per seed "
                    "(problems, figures; or the error that stopped the run before it could be judged)")
    ap.add_argument("--summarize", metavar="REPORT", default="",
                    help="print the table of the seeds a --report file holds, and exit")
    a = ap.parse_args(argv)
    if a.summarize:
        with open(a.summarize) as fh:
            docs = [json.loads(x) for x in fh if x.strip()]
        for d in docs:
            if "figures" not in d:
                print(f"seed {d.get('seed')}: not judged: {d.get('error')}")
            elif d.get("problems"):
                print(f"seed {d['seed']}: FAILED, {len(d['problems'])} problem(s), first: {d['problems'][0]}")
        print(seeds_table([d["figures"] for d in docs if "figures" in d]))
        return 0
    kinds = tuple(k for k in a.kinds.split(",") if k) or FAULTS
    unknown = set(kinds) - set(FAULTS)
    if unknown:
        ap.error(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(FAULTS)}")
    if a.seed is not None:
        seed, origin = a.seed, "given"
    elif a.from_commit:
        seed, origin = seed_from_commit()
    else:
        seed, origin = secrets.randbelow(10 ** 6), "random"
    print(f"chaos: first seed {seed} ({origin}); {a.seeds} seed(s) of {a.minutes:g} minutes; fault kinds "
          f"{'all' if kinds == FAULTS else ','.join(kinds)}", flush=True)
    # SIGTERM (a CI timeout) unwinds through the cleanup: nftables tables, processes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    figures = []
    for s in range(seed, seed + a.seeds):
        try:
            res = ChaosRun(s, a.minutes, kinds=kinds).run()
        except Exception as exc:  # noqa: BLE001 - the run could not be judged: said so, apart from a failure
            _report(a.report, {"seed": s, "error": f"{type(exc).__name__}: {exc}"})
            traceback.print_exc()   # where the harness broke: a harness bug, or a fault it could not inject
            print(f"ERROR: seed {s} could not be judged: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
        _report(a.report, {"seed": s, "problems": res.report.problems, "figures": res.figures})
        if res.report.problems:
            print(f"FAIL: {failure(res, kinds)}", file=sys.stderr)
            return 1
        figures.append(res.figures)
        print(f"PASS: seed {s}", flush=True)
    if len(figures) > 1:
        print("chaos: all seeds passed:\n" + "\n".join(json.dumps(f) for f in figures))
        print("\n" + seeds_table(figures))
    return 0


def seeds_table(figures: list[dict]) -> str:
    """One line per seed: what the fault test did and what the checker found, for notes
    and docs (from the figures each run prints, or its --report lines). Budgets are
    used/budget; the outcomes are the final records (misfired includes the jobs expected
    to expire, failed/failed the jobs expected to fail every attempt)."""
    head = ("seed", "faults (kinds)", "firings", "quiet", "lateness p50/p99/max s", "quiet p99 s", "owner_lost",
            "misfired", "killed", "failed other", "outcomes", "wall s")
    rows = [head]
    for f in figures:
        out = dict(f.get("outcomes") or {})
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(out.items(), key=lambda kv: -kv[1]))
        b = f.get("budgets") or {}
        rows.append((str(f["seed"]), f"{f['faults']} ({len(f.get('fault_kinds') or {})})", str(f["firings"]),
                     str(f["quiet_firings"]), f"{f['lateness_p50_s']}/{f['lateness_p99_s']}/{f['lateness_max_s']}",
                     str(f["quiet_lateness_p99_s"]), str(b.get("owner_lost")), str(b.get("misfired")),
                     str(b.get("killed")), str(b.get("failed_other")), outcomes, str(f["wall_s"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
