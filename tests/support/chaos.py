"""A seeded, randomized fault test on this machine (Jepsen-style).

A real 3-member etcd on loopback, 4 `millwright run` agents, a mosquitto; a workload of
one-shot, retrying and cron jobs pushed over MQTT whose script (tests/jobs/effect.sh)
records each run's side effect; a nemesis that picks, one at a time, from kill -9 and
restart of an agent, SIGTERM and restart, SIGSTOP/SIGCONT, nftables cuts agent↔etcd and
agent↔broker (tables named per process and run, always removed), etcd leader kill and
restart, and a pause of an etcd member. Afterwards the whole etcd history (one watch from
revision 1, compaction off) and the side-effect log go through tests/support/history.py.

Everything random comes from one seed, printed first; the same seed gives the same
workload and the same fault schedule (the timing of a loaded machine does not repeat):

    make chaos SEED=1234 MINUTES=2          # python3 -m tests.support.chaos --seed 1234 --minutes 2

Stated bounds (README, testing): a firing is resolved within LATENESS_BOUND_S of its due
time, or of the end of the fault it fell into; owner_lost and misfired within the
budget :func:`budget_for` derives from the faults injected.
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
JOB_SLEEP_MAX_S = 0.6
KILL_GRACE_S = 1.0
# A firing is resolved (its first attempt started, or it ended without a run) within this
# long after its due time, or after the end of the fault it fell into: the lease TTL for
# the old owner's keys to expire, the TTL again for a self-fenced agent's new session and
# a rebalance, and 2 s for claims and process start on a loaded 2-core machine.
LATENESS_BOUND_S = 2 * TTL_S + 2.0
# A fault's consequences last until its end plus this (lease expiry, rejoin, rebalance).
RECOVERY_S = TTL_S + 3.0
FAULTS = ("agent_kill9", "agent_restart", "agent_pause", "cut_etcd", "cut_broker", "etcd_leader_kill",
          "etcd_member_pause")
AGENT_FAULTS = {"agent_kill9", "agent_restart", "agent_pause", "cut_etcd"}


def now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass
class Fault:
    kind: str
    target: str
    start: float
    end: float = 0.0


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


def budget_for(faults: list[Fault], n_cron: int, agents: int) -> history.Budget:
    """The most owner_lost and misfired firings the faults may cost.

    owner_lost: a run in flight when its agent dies, stops or is cut off ends `failed/
    owner_lost` (max_attempts 1): 3 per agent fault; an etcd fault can fence every agent
    at once: 3 per agent. misfired: a cron firing due while its shard had no working owner
    is skipped by misfire run_once (only the latest one runs): per fault and cron job, the
    firings in the fault plus the recovery time. One-shot firings never count here: the
    checker fails any misfired one-shot."""
    lost = 0
    missed = 0
    for f in faults:
        lost += 3 if f.kind in AGENT_FAULTS else (3 * agents if f.kind.startswith("etcd_") else 0)
        if f.kind != "cut_broker":
            missed += n_cron * math.ceil((f.end - f.start + RECOVERY_S + 1) / CRON_PERIOD_S)
    return history.Budget(owner_lost=lost, misfired=missed)


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
        self.keep = False

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
        issued = now().replace(microsecond=0)
        n_at = max(10, int(horizon / 1.5))
        n_retry = max(3, int(horizon / 8))
        for i in range(n_at + n_retry):
            retrying = i >= n_at
            jid = f"{'r' if retrying else 'o'}{i:03d}-{self.seed % 1000}"
            due = t0 + timedelta(seconds=rng.uniform(0, horizon))
            due = due.replace(microsecond=(due.microsecond // 1000) * 1000)
            doc = {"v": 1, "id": jid, "template": "fx",
                   "params": {"sleep": f"{rng.uniform(0.1, JOB_SLEEP_MAX_S):.2f}", "fail_until": "2" if retrying else "0"},
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
            doc = {"v": 1, "id": jid, "template": "fx", "params": {"sleep": "0.3", "fail_until": "0"},
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
    def _inject(self, kind: str, duration: float) -> Fault:
        rng = self.rng
        agent = rng.choice(sorted(self.agents))
        if kind.startswith("etcd_"):
            f = Fault(kind, "", time.time())
            if kind == "etcd_leader_kill":
                m = self.etcd.leader()
                f.target = m.member_name
                m.kill()
                self.say(f"FAULT etcd leader {m.member_name} killed for {duration:.1f}s")
                time.sleep(duration)
                m.start()
            else:
                m = rng.choice(self.etcd.members)
                f.target = m.member_name
                m.pause()
                self.say(f"FAULT etcd member {m.member_name} paused for {duration:.1f}s")
                time.sleep(duration)
                m.resume()
            self.etcd.wait_healthy(60)
        else:
            a = self.agents[agent]
            f = Fault(kind, agent, time.time())
            self.say(f"FAULT {kind} {agent} for {duration:.1f}s")
            if kind == "agent_kill9":
                a.kill()
                time.sleep(duration)
                a.start()
            elif kind == "agent_restart":
                a.terminate(timeout=30)
                time.sleep(duration)
                a.start()
            elif kind == "agent_pause":
                a.signal(signal.SIGSTOP)
                time.sleep(duration)
                a.signal(signal.SIGCONT)
            else:
                ports = [m.port for m in self.etcd.members] if kind == "cut_etcd" else [self.broker_ports[agent]]
                addr = self.hosts[agent] if kind == "cut_etcd" else "127.0.0.1"
                cut = NftCut(addr, ports)
                self.cuts.append(cut)
                cut.apply()
                time.sleep(duration)
                cut.heal()
        f.end = time.time()
        self.say(f"HEAL  {kind} {f.target} after {f.end - f.start:.1f}s")
        return f

    def nemesis(self, until: float) -> None:
        while True:
            gap = self.rng.uniform(1.0, 4.0)
            duration = self.rng.uniform(1.5, 6.0)
            kind = self.rng.choice(FAULTS)
            if time.time() + gap + duration > until:
                return
            time.sleep(gap)
            self.faults.append(self._inject(kind, duration))

    # --- judging ------------------------------------------------------------------------
    def effective_due(self, d: float) -> float:
        return max([d] + [f.end for f in self.faults if f.start - 1.0 <= d <= f.end])

    def affected(self, d: float) -> bool:
        return any(f.start - 1.0 <= d <= f.end + RECOVERY_S for f in self.faults)

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
            pusher = threading.Thread(target=self._pusher_thread, args=(plan, stop), daemon=True)
            pusher.start()
            self.say(f"workload: {len(self.firings)} firings of {len(plan)} jobs over {horizon:.0f}s")
            self.nemesis(t0.timestamp() + horizon - 2)
            pusher.join(max(0.0, t0.timestamp() + horizon - time.time() + 5))
            # the faults are healed; every firing must resolve within the bound
            end = max(t0.timestamp() + horizon, max((f.end for f in self.faults), default=0)) + LATENESS_BOUND_S + 5
            last_due = max(f.due for f in self.firings)
            while time.time() < end and not (time.time() > last_due + 2 and self._all_resolved()):
                time.sleep(0.5)
            time.sleep(1.0)
            # stop the agents before reading: no write or side effect can land after the read
            for a in self.agents.values():
                a.kill()
            events = history.read_history(self.client, self.keys.prefix, contiguous=True)
            effects = history.parse_effects(self.out)
            budget = budget_for(self.faults, self.n_cron, self.n_agents)
            rep = history.check(events, self.keys.prefix, firings=self.firings, effects=effects, budget=budget,
                                lateness_bound_s=LATENESS_BOUND_S, effective_due=self.effective_due,
                                affected=self.affected, max_run_s=JOB_SLEEP_MAX_S + KILL_GRACE_S + 1.0)
            kvs, _ = self.client.get_prefix(self.keys.jobs_prefix())
            stored = {kv.key.rsplit("/", 1)[1] for kv in kvs}
            for jid in sorted(set(self.pushed) - stored):
                rep.fail(f"job {jid}: pushed over MQTT, never stored in etcd")
            res = Result(self.seed, self.minutes, rep, self.faults, len(self.pushed), len(stored & set(self.pushed)),
                         time.monotonic() - t_wall)
            res.figures = {"seed": self.seed, "faults": len(self.faults),
                           "fault_kinds": sorted({f.kind for f in self.faults}),
                           "firings": rep.stats.get("firings"), "side_effects": rep.stats.get("side_effects"),
                           "events": rep.stats.get("events"), "states": rep.stats.get("states"),
                           "failed_reasons": rep.stats.get("failed_reasons"),
                           "lateness_p99_s": _r(rep.stats.get("lateness_p99_s")),
                           "lateness_max_s": _r(rep.stats.get("lateness_max_s")),
                           "owner_lost": f"{rep.stats.get('owner_lost')}/{budget.owner_lost}",
                           "misfired": f"{rep.stats.get('misfired')}/{budget.misfired}",
                           "pushed": res.pushed, "stored": res.stored, "wall_s": round(res.wall_s, 1)}
            self.log("chaos figures: " + json.dumps(res.figures))
            if rep.problems:
                self.keep = True
                self.log(f"chaos: failed; kept {self.dir} (agents' logs and audit, effects.log)")
            return res
        finally:
            stop.set()
            self.close()

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


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: a new one, printed)")
    ap.add_argument("--minutes", type=float, default=2.0)
    a = ap.parse_args(argv)
    seed = a.seed if a.seed is not None else secrets.randbelow(10 ** 6)
    # SIGTERM (a CI timeout) unwinds through the cleanup: nftables tables, processes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        run_and_check(seed, a.minutes)
    except AssertionError as exc:
        print(f"FAIL: {exc}", file=sys.stderr)
        return 1
    print(f"PASS: seed {seed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
