"""`millwright demo` (`make demo`): the product at work on one machine, in about a minute.

It starts a local etcd and mosquitto as child processes (free loopback ports, temporary
directories), three agents (`millwright run`, each with its own state, audit log, metrics
port and admin socket), pushes a realistic set of signed maintenance jobs over MQTT as
the cloud would, SIGKILLs one agent, and prints a summary checked against etcd and the
jobs' own side effects:

- every firing ran exactly once (run records in etcd + a side-effect line each job script
  appends: one per execution),
- the dead agent's shards failed over (measured from etcd),
- what the product decided about health (statuses, run records, audit, metrics), and
  what it does not show yet,
- `millwright audit verify` for every agent.

Progress is printed live, one line per notable event. Everything is cleaned up at the end
(processes, the demo's nftables table, the temporary directory unless --keep). Exit code
0 when every invariant held, 1 with the reason when one broke, 2 when the machine cannot
run the demo (not root, etcd/mosquitto missing: run `make setup`).

The scenario, the job templates and the job scripts live in configs/demo/ (docs/demo.md).
"""

from __future__ import annotations

import collections
import json
import os
import pwd
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from datetime import datetime, timedelta
from typing import Any, Optional

from agent.cli import UserError
from agent.demo import report
from agent.demo.console import CloudConsole
from agent.demo.output import Live, fmt_ms
from agent.demo.plan import DemoFailed, DemoJob, plan_jobs
from agent.demo.report import parse_rfc
from agent.demo.services import REPO_ROOT
from agent.jobs.firing import TERMINAL
from agent.runtime.timefmt import utcnow

DEMO_CONFIG_DIRS = (os.path.join(REPO_ROOT, "configs", "demo"), "/usr/share/millwright/demo")
DEFAULT_DURATION = 45.0
MIN_DURATION = 24.0
AGENTS = 3
JOB_USER = "millwright-jobs"
KID = "cloud-1"


class Interrupted(Exception):
    pass


# --------------------------------------------------------------------------- helpers


def ensure_job_user(live: Live) -> str:
    """The unprivileged user the demo's templates run as: millwright-jobs (the package
    creates it too), created as a system user if missing; `nobody` as a last resort."""
    try:
        pwd.getpwnam(JOB_USER)
        return JOB_USER
    except KeyError:
        pass
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    try:
        r = subprocess.run([useradd, "--system", "--no-create-home", "--home-dir", "/nonexistent",
                            "--shell", "/usr/sbin/nologin", "--user-group", JOB_USER],
                           capture_output=True, text=True, timeout=20)
        if r.returncode == 0:
            live.line("demo", f"created system user {JOB_USER} for job runs (the .deb creates it too)")
            return JOB_USER
        why = (r.stderr or "").strip().splitlines()[-1:] or [f"exit {r.returncode}"]
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = [str(exc)]
    live.line("demo", f"cannot create {JOB_USER} ({why[0]}); jobs run as nobody")
    return "nobody"


def demo_config_dir() -> str:
    for d in DEMO_CONFIG_DIRS:
        if os.path.isfile(os.path.join(d, "agent.yaml")):
            return d
    raise UserError(f"demo configuration not found (looked in {', '.join(DEMO_CONFIG_DIRS)})")


def cgroup_root_name(agent_id: str, state_dir: str) -> str:
    """The per-agent cgroup root the daemon uses (agent/runtime/components.py)."""
    from agent.execute.backends import run_root_name

    return run_root_name(agent_id, state_dir)


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2:].split()[0] not in (b"Z", b"X")


# --------------------------------------------------------------------------- the demo


class Demo:
    def __init__(self, duration: float = DEFAULT_DURATION, keep: bool = False, stream=None):
        import logging

        # product modules used in-process (cleanup's cgroup reclaim) log through
        # agent.*; the demo prints its own lines instead
        logging.getLogger("agent").addHandler(logging.NullHandler())
        self.duration = float(duration)
        self.kill_at = max(10.0, round(self.duration * 0.4, 1))
        self.keep = keep
        self.live = Live(stream)
        self.started = time.monotonic()
        self.base: Optional[str] = None
        # set by setup(); every later phase runs only after it succeeded
        self.etcd: Any = None
        self.mqtt: Any = None
        self.console: Any = None  # CloudConsole
        self.client: Any = None
        self.keys: Any = None
        self.agents: dict[str, Any] = {}
        self.metrics_ports: dict[str, int] = {}
        self.nft_table: Optional[str] = None
        self.stall_listener: Optional[socket.socket] = None
        self.jobs: list[DemoJob] = []
        self.templates: dict = {}
        self.victim: Optional[str] = None
        self.lines: dict[str, str] = {}                  # agent -> its line label
        self.victim_pools: dict[str, list[int]] = {}     # pool -> the victim's shards of it
        self.kill_wall: Optional[datetime] = None
        self.kill_mono = 0.0
        self.failover: dict = {}
        self.owners: dict[int, str] = {}
        self.statuses: list[dict] = []
        self._seen_seq: set = set()
        self._running: dict[tuple, dict] = {}
        self.victim_pids: dict[int, str] = {}
        self.notes: list[str] = []
        self.findings: list[str] = []
        self.sensor_mode: Optional[str] = None  # of the first survivor, from its status

    # ----------------------------------------------------------------- entry point
    def run(self) -> int:
        self.preflight()
        old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}

        def interrupted(signum, frame):
            raise Interrupted(signal.Signals(signum).name)

        for s in old:
            signal.signal(s, interrupted)
        code = 1
        try:
            self.setup()
            self.push_jobs()
            self.scenario()
            self.settle()
            self._check_targets()
            result = report.collect(self)
            self.stop_agents()
            result["audit"] = report.verify_audit(self)
            code = report.summary(self, result)
        except DemoFailed as exc:
            self.live.raw(f"\nFAILED: {exc}")
            code = 1
        except (KeyboardInterrupt, Interrupted) as exc:
            self.live.raw(f"\ninterrupted ({exc or 'SIGINT'}): cleaning up")
            code = 130
        finally:
            self.cleanup()
            for s, h in old.items():
                signal.signal(s, h)
        self.live.raw(f"demo took {time.monotonic() - self.started:.0f} s; exit {code}")
        return code

    def preflight(self) -> None:
        if os.geteuid() != 0:
            raise UserError("the demo must run as root (job users, cgroups, BPF, nftables): sudo make demo")
        for exe in ("etcd", "mosquitto"):
            if shutil.which(exe) is None:
                raise UserError(f"{exe} not found: run `make setup` (scripts/setup-host.sh) first")
        try:
            import etcd3  # noqa: F401
            import paho.mqtt.client  # noqa: F401
        except ImportError as exc:
            raise UserError(f"{exc.name} is missing: run `make setup` (scripts/setup-host.sh) first") from None
        if self.duration < MIN_DURATION:
            raise UserError(f"--duration must be at least {MIN_DURATION:g} s (a failover takes ~5 s)")

    # ----------------------------------------------------------------- setup
    def setup(self) -> None:
        import yaml

        from agent.cloud import testkit
        from agent.config import EtcdConfig
        from agent.coordination.etcd import EtcdClient
        from agent.coordination.keys import Keys
        from agent.demo.services import AgentProcess, EtcdServer, MosquittoServer, free_port

        live = self.live
        live.raw(f"Millwright demo: 3 agents, one etcd, one MQTT broker on this machine; the job phase lasts "
                 f"{self.duration:g} s (times are UTC)")
        live.phase("1/6 start etcd, mosquitto and 3 agents")
        cfg_dir = demo_config_dir()
        self.base = tempfile.mkdtemp(prefix="millwright-demo-")
        os.chmod(self.base, 0o711)  # job users traverse it to their scripts and side-effect dir
        user = ensure_job_user(live)
        jobs_dir = os.path.join(self.base, "jobs")
        os.makedirs(jobs_dir)
        for name in sorted(os.listdir(os.path.join(cfg_dir, "jobs"))):
            dst = os.path.join(jobs_dir, name)
            shutil.copyfile(os.path.join(cfg_dir, "jobs", name), dst)
            os.chmod(dst, 0o755)
        out_dir = os.path.join(self.base, "out")
        os.makedirs(out_dir)
        pw = pwd.getpwnam(user)
        os.chown(out_dir, pw.pw_uid, pw.pw_gid)
        os.chmod(out_dir, 0o755)
        self.out_dir = out_dir

        self.stall_listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.stall_listener.bind(("127.0.0.1", 0))
        self.stall_listener.listen(16)
        stall_port = self.stall_listener.getsockname()[1]
        self._blackhole(stall_port)

        for sub in ("etcd", "mosquitto", "agents"):
            os.makedirs(os.path.join(self.base, sub))
        self.etcd = EtcdServer(os.path.join(self.base, "etcd"))
        self.etcd.start(timeout=30)
        live.line("etcd", f"started (pid {self.etcd.proc.pid}) at {self.etcd.endpoint}")
        self.mqtt = MosquittoServer(os.path.join(self.base, "mosquitto"))
        self.mqtt.start(timeout=15)
        live.line("mosquitto", f"started (pid {self.mqtt.proc.pid}) at {self.mqtt.url}")

        # ed25519, as in production: the cloud's key file holds the private key, the agents'
        # only the public one (what `millwright keygen` prints)
        keys_file = os.path.join(self.base, "keys.yaml")
        self.ring = testkit.write_ed25519_keys(os.path.join(self.base, "cloud-signer.yaml"), keys_file, KID)
        text = open(os.path.join(cfg_dir, "agent.yaml")).read()
        for k, v in {"@JOBS@": jobs_dir, "@OUT@": out_dir, "@USER@": user, "@STALL_PORT@": str(stall_port)}.items():
            text = text.replace(k, v)
        base_cfg = yaml.safe_load(text)
        self.templates = base_cfg.get("templates", {})
        self.cluster = base_cfg.get("cluster", "demo")
        self.shard_count = int(base_cfg.get("shards", 64))
        self.keys = Keys(self.cluster)
        self.client = EtcdClient(EtcdConfig(endpoints=[self.etcd.endpoint], request_timeout_s=2.0))

        self.console = CloudConsole(self.mqtt.host, self.mqtt.port, self.cluster)
        self.console.start()

        suffix = secrets.token_hex(2)
        ids = [f"gw{i}-{suffix}" for i in range(1, AGENTS + 1)]
        # targeting: gw1 serves line 1, gw2 and gw3 line 2 (the demo's line jobs name a line)
        self.lines = {aid: "1" if i == 0 else "2" for i, aid in enumerate(ids)}
        for aid in ids:
            port = free_port()
            cfg = json.loads(json.dumps(base_cfg))
            cfg["labels"] = {"line": self.lines[aid]}
            cfg["etcd"] = {**cfg.get("etcd", {}), "endpoints": [self.etcd.endpoint]}
            cfg["mqtt"] = {**cfg.get("mqtt", {}), "url": self.mqtt.url}
            cfg["signing"] = {"keys_file": keys_file}
            cfg["metrics"] = {"listen": f"127.0.0.1:{port}"}
            a = AgentProcess(aid, os.path.join(self.base, "agents"), cfg).start()
            self.agents[aid] = a
            self.metrics_ports[aid] = port
            live.line(aid, f"started `millwright run` (pid {a.pid}), labels line={self.lines[aid]}, "
                           f"metrics http://127.0.0.1:{port}/metrics")
        self._await_convergence(ids)

    def _blackhole(self, port: int) -> None:
        """nftables table of the demo's own: drop data segments to the stall port (the TCP
        handshake passes, so the job's request is retransmitted and never answered)."""
        if shutil.which("nft") is None:
            self.notes.append("nft not found: the network-stall job is never answered but sees no retransmits")
            return
        table = f"millwright_demo_{os.getpid()}"
        # input hook: the segment leaves the socket and is lost on the way, so the kernel
        # really retransmits it (a drop in the output hook fails the transmit instead, and
        # such a "retransmit" is neither counted nor traced)
        rules = (f"table inet {table} {{\n  chain blackhole {{ type filter hook input priority -10; policy accept;\n"
                 f"    ip daddr 127.0.0.1 tcp dport {port} meta length > 200 drop\n  }}\n}}\n")
        r = subprocess.run(["nft", "-f", "-"], input=rules.encode(), capture_output=True, timeout=20)
        if r.returncode != 0:
            self.notes.append(f"nftables unusable ({r.stderr.decode().strip()[:120]}): the network-stall job sees "
                              "no retransmits")
            return
        self.nft_table = table
        self.live.line("nftables", f"table inet {table}: data to 127.0.0.1:{port} (the 'update server') is dropped")

    def _await_convergence(self, ids: list[str]) -> None:
        from agent.coordination import hrw

        plan = hrw.assignment(self.shard_count, {a: 1.0 for a in ids})
        deadline = time.monotonic() + 60
        while True:
            self._pump()
            for aid, a in self.agents.items():
                if not a.alive():
                    raise DemoFailed(f"agent {aid} exited with {a.proc.returncode} at start; log tail:\n"
                                     + "\n".join(a.log_text().splitlines()[-15:]))
            owners = self._owners()
            if owners == plan:
                break
            if time.monotonic() > deadline:
                raise DemoFailed(f"the 3 agents did not share the {self.shard_count} shards within 60 s "
                                 f"(owned: {dict(collections.Counter(owners.values()))})")
            time.sleep(0.1)
        self.owners = owners
        counts = collections.Counter(owners.values())
        self.live.line("etcd", f"{self.shard_count} shards owned: " +
                       ", ".join(f"{a} {counts[a]}" for a in sorted(counts)) + " (bounded-load rendezvous plan)")

    def _owners(self) -> dict[int, str]:
        kvs, _ = self.client.get_prefix(self.keys.shards_prefix())
        return {self.keys.shard_number(kv.key): kv.value.decode() for kv in kvs}

    def _pool_owners(self) -> dict[str, dict[int, str]]:
        """pool -> shard -> holder, for every targeted pool (pools/<pool>/shards/)."""
        kvs, _ = self.client.get_prefix(self.keys.pools_prefix())
        out: dict[str, dict[int, str]] = {}
        for kv in kvs:
            pool, _, tail = kv.key[len(self.keys.pools_prefix()):].partition("/")
            if tail.startswith("shards/"):
                out.setdefault(pool, {})[int(tail[len("shards/"):])] = kv.value.decode()
        return out

    def _check_targets(self) -> None:
        """Every run of a line-targeted job ran on a gateway of that line (etcd records)."""
        from agent.coordination import placement

        kvs, _ = self.client.get_prefix(self.keys.runs_prefix())
        targets = {j.id: j.doc["target"] for j in self.jobs if j.doc.get("target")}
        n, per_line = 0, collections.Counter[str]()
        for kv in kvs:
            rec = json.loads(kv.value)
            target = targets.get(rec.get("job_id"))
            if target is None or not rec.get("started_at"):
                continue
            n += 1
            line = self.lines.get(rec.get("agent"))
            if not placement.matches({"line": line or ""}, target.get("labels", {})):
                raise DemoFailed(f"{rec['job_id']} targets {target} but ran on {rec.get('agent')} (line {line})")
            per_line[line or "?"] += 1
        self.live.line("etcd", f"targeting: {n} runs of line-targeted jobs, each on a gateway of its line (" +
                       ", ".join(f"line {k}: {v}" for k, v in sorted(per_line.items())) + ")")

    # ----------------------------------------------------------------- push
    def push_jobs(self) -> None:
        from agent.cloud import testkit
        from agent.coordination.keys import shard_of

        self.live.phase("2/6 the cloud pushes signed jobs over MQTT (QoS 1); agents store them in etcd, then ack")
        self.t0 = utcnow()
        self.t0_mono = time.monotonic()
        self.jobs = plan_jobs(self.t0, self.duration, self.kill_at)
        payloads = {}
        for j in self.jobs:
            j.doc.update(cluster=self.cluster, kind="job")  # bound to this cluster, signed with it
            payloads[j.id] = testkit.signed(j.doc, self.ring, KID)
            if not self.console.publish(self.console.topics.push, payloads[j.id]):
                raise DemoFailed(f"the broker did not acknowledge the push of {j.id}")
        deadline = time.monotonic() + 12
        pending = {j.id for j in self.jobs}
        while pending and time.monotonic() < deadline:
            self._pump()
            for j in self.jobs:
                if j.accepted_by:
                    pending.discard(j.id)
            time.sleep(0.05)
        if pending:
            # The MQTT ingest did not answer: say so, and store the signed documents the way
            # ingest does, so the rest of the demo still runs.
            from agent.coordination.jobstore import JobStore

            self.live.line("demo", f"no `accepted` over MQTT within 12 s for {len(pending)} job(s): FALLBACK, writing "
                                   "them straight into etcd with JobStore")
            self.findings.append(f"MQTT ingest did not accept {len(pending)} push(es) within 12 s (fallback: JobStore)")
            store = JobStore(self.client, self.keys, self.shard_count, "demo")
            for j in self.jobs:
                if j.id in pending:
                    store.create(json.loads(payloads[j.id]))
                    j.accepted_by = "(etcd)"
                    j.shard = shard_of(j.id, self.shard_count)
        self.live.line("cloud", f"{len(self.jobs)} jobs pushed and accepted in "
                                f"{time.monotonic() - self.t0_mono:.1f} s")

    # ----------------------------------------------------------------- live events
    def _pump(self) -> None:
        """Print what arrived from the broker since the last call."""
        while True:
            if self.console is None:
                return
            try:
                ts, topic, doc = self.console.q.get_nowait()
            except queue.Empty:
                return
            if topic.endswith("/presence"):
                who = topic.split("/")[-2]
                reason = doc.get("reason")
                extra = {"connection_lost": " (last will: the broker lost the connection)"}.get(reason, "")
                self.live.line(who, f"presence {doc.get('state')}{extra}")
                continue
            key = (doc.get("agent"), doc.get("seq"))
            if doc.get("seq") is not None:
                if key in self._seen_seq:
                    continue
                self._seen_seq.add(key)
            doc["_rx"] = ts
            self.statuses.append(doc)
            self._print_status(doc)

    def _job(self, jid: Optional[str]) -> Optional[DemoJob]:
        for j in self.jobs:
            if j.id == jid:
                return j
        return None

    def _print_status(self, d: dict) -> None:
        state, jid, who = d.get("state"), d.get("job_id"), d.get("agent") or "?"
        j = self._job(jid)
        cron = j is not None and "cron" in j.doc.get("schedule", {})
        fid = d.get("run_id")
        run = f" @{str(d.get('due'))[11:19]}" if cron and d.get("due") else ""
        if state == "accepted":
            if j is not None and not j.accepted_by:
                j.accepted_by, j.shard = who, d.get("shard")
                self.live.line(who, f"accepted {jid} ({j.kind}), shard {d.get('shard')}")
            return
        if state == "rejected":
            self.live.line(who, f"REJECTED {jid}: {d.get('reason')} {d.get('detail') or ''}")
            raise DemoFailed(f"the agents rejected {jid}: {d.get('reason')}: {d.get('detail')}")
        if state == "scheduled":
            return
        if state == "running":
            key = (jid, fid, d.get("attempt"))
            if key in self._running:  # same run again: a health change
                ev = d.get("health_rule") or d.get("rule") or d.get("reason")
                self.live.line(who, f"health of {jid}{run}: {d.get('health')}" + (f" ({ev})" if ev else ""))
                return
            self._running[key] = d
            if d.get("pid"):
                self.victim_pids[int(d["pid"])] = who
            if cron:
                return
            due = parse_rfc(d.get("due"))
            ts = parse_rfc(d.get("ts"))
            late = f", {fmt_ms(max(0.0, (ts - due).total_seconds()))} after due" if due and ts else ""
            self.live.line(who, f"running {jid}{run} (attempt {d.get('attempt')}, pid {d.get('pid')}{late})")
            return
        if state in TERMINAL or state == "retrying":
            r = self._running.get((jid, fid, d.get("attempt")))
            took = ""
            if r is not None:
                a, b = parse_rfc(r.get("ts")), parse_rfc(d.get("ts"))
                if a and b:
                    took = f" in {(b - a).total_seconds():.1f} s"
            bits = []
            if d.get("exit_code") is not None:
                bits.append(f"exit {d['exit_code']}")
            reason = d.get("reason")
            if reason and reason != state:
                bits.append(str(reason))
            health = d.get("health")
            if health and health != "healthy":
                bits.append(f"health {health}")
            if state == "retrying" and d.get("retry_at"):
                bits.append(f"next attempt at {str(d['retry_at'])[11:23]}")
            usage = d.get("usage") or {}
            if usage.get("max_rss_bytes"):
                bits.append(f"max rss {usage['max_rss_bytes'] / 1048576:.0f} MiB")
            self.live.line(who, f"{state} {jid}{run}{took}" + (f" ({', '.join(bits)})" if bits else ""))
            return
        if state == "waiting":
            self.live.line(who, f"waiting {jid} ({d.get('reason')})")

    def _tick(self, until_mono: float, step: float = 0.05) -> None:
        while time.monotonic() < until_mono:
            self._pump()
            time.sleep(min(step, max(0.0, until_mono - time.monotonic())))

    # ----------------------------------------------------------------- scenario
    def scenario(self) -> None:
        self.live.phase(f"3/6 jobs run; at +{self.kill_at:g} s one agent is killed with SIGKILL")
        self._tick(self.t0_mono + self.kill_at)
        self.live.phase("4/6 failover")
        self._kill()
        self._await_failover()
        self._show_status()
        self.live.phase("5/6 the remaining jobs run on the surviving agents")
        self._tick(self.t0_mono + self.duration)

    def _future_firings(self, owner_of) -> collections.Counter:
        """Firings still due after the kill, per owning agent."""
        score: collections.Counter = collections.Counter()
        kill = self.t0 + timedelta(seconds=self.kill_at)
        for j in self.jobs:
            owner = owner_of(j)
            sch = j.doc["schedule"]
            if j.cron_expected:
                score[owner] += sum(1 for g in j.cron_expected if g > kill)
            elif "at" in sch and (at := parse_rfc(sch["at"])) is not None and at > kill - timedelta(seconds=3):
                score[owner] += 1
            elif "delay_s" in sch and self.t0 + timedelta(seconds=sch["delay_s"]) > kill:
                score[owner] += 1
        return score

    def _kill(self) -> None:
        from agent.coordination import placement
        from agent.coordination.keys import shard_of

        owners = self._owners()
        pools = self._pool_owners()

        def owner_of(j):
            s = shard_of(j.id, self.shard_count)
            if j.doc.get("target"):
                return pools.get(placement.pool_of_doc(j.doc), {}).get(s)
            return owners.get(s)
        score = self._future_firings(owner_of)
        # the victim serves line 2: its line's jobs must move to the other line-2 gateway only
        victim = max(sorted(a for a in self.agents if self.lines[a] == "2"), key=lambda a: score.get(a, 0))
        self.victim_pools = {p: sorted(s for s, a in o.items() if a == victim) for p, o in pools.items()}
        self.victim = victim
        mine = sorted(s for s, a in owners.items() if a == victim)
        running = [k[0] for k, d in self._running.items() if d.get("agent") == victim
                   and not any(s.get("job_id") == k[0] and s.get("run_id") == k[1] and s.get("state") in TERMINAL
                               for s in self.statuses)]
        self.kill_wall = utcnow()
        self.kill_mono = time.monotonic()
        self.agents[victim].kill()
        self.failover = {"victim": victim, "shards": mine, "future": score.get(victim, 0),
                         "running": sorted(set(running))}
        self.live.line(victim, f"SIGKILL (pid {self.agents[victim].proc.pid}): it held {len(mine)} shards with "
                               f"{score.get(victim, 0)} firings still due" +
                       (f"; running now: {', '.join(sorted(set(running)))}" if running else ""))
        runs = [(k[0], int(d["pid"])) for k, d in self._running.items() if d.get("agent") == victim
                and d.get("pid") and k[0] in running]
        # the agent's run guard kills its runs when it dies (agent/execute/guard.py)
        deadline = time.monotonic() + 2.0
        while any(_alive(pid) for _, pid in runs) and time.monotonic() < deadline:
            time.sleep(0.005)
        gone_s = time.monotonic() - self.kill_mono
        for jid, pid in runs:
            if _alive(pid):
                self.live.line(victim, f"its run of {jid} (pid {pid}) keeps running without its agent")
                self.notes.append(f"{victim}'s run of {jid} (pid {pid}) outlived its agent by more than 2 s: a retry "
                                  "by the new owner could overlap it")
            else:
                self.live.line(victim, f"its run of {jid} (pid {pid}) died with it ({gone_s * 1000:.0f} ms)")

    def _await_failover(self) -> None:
        victim = self.failover["victim"]
        mine = set(self.failover["shards"])
        member_key = self.keys.member(victim)
        expired_at = None
        taken: dict[int, str] = {}
        deadline = self.kill_mono + 40
        while True:
            self._pump()
            now = time.monotonic()
            if expired_at is None and self.client.get(member_key) is None:
                expired_at = now
                self.live.line("etcd", f"lease of {victim} expired {now - self.kill_mono:.2f} s after the kill: its "
                                       f"member key and {len(mine)} shard keys are gone")
            owners = self._owners()
            new = {s: owners[s] for s in mine if s in owners and owners[s] != victim and s not in taken}
            if new:
                taken.update(new)
                per = collections.Counter(new.values())
                for a, n in sorted(per.items()):
                    self.live.line(a, f"claimed {n} of {victim}'s shards (+{now - self.kill_mono:.2f} s)")
            if len(taken) == len(mine):
                self.failover.update(done_s=now - self.kill_mono,
                                     expired_s=(expired_at or now) - self.kill_mono,
                                     taken=dict(collections.Counter(taken.values())))
                self.live.line("etcd", f"failover complete: all {len(mine)} shards of {victim} owned by " +
                               ", ".join(f"{a} ({n})" for a, n in sorted(self.failover['taken'].items())) +
                               f", {self.failover['done_s']:.2f} s after the kill")
                self._await_pool_failover(deadline)
                return
            if now > deadline:
                raise DemoFailed(f"failover did not complete: {len(mine) - len(taken)} of {victim}'s shards "
                                 "still unowned 40 s after the kill")
            time.sleep(0.05)

    def _await_pool_failover(self, deadline: float) -> None:
        """The victim's shards of line 2's pool move to the other line-2 gateway, never to
        line 1's (it is not eligible: the pool's shards are shared by eligible agents only)."""
        victim = self.failover["victim"]
        want = {p: set(s) for p, s in self.victim_pools.items() if s}
        if not want:
            return
        while True:
            pools = self._pool_owners()
            moved = {p: {s: pools.get(p, {}).get(s) for s in ss} for p, ss in want.items()}
            for p, got in moved.items():
                wrong = {a for a in got.values() if a and self.lines.get(a) != "2"}
                if wrong:
                    raise DemoFailed(f"pool {p}: shards of {victim} went to {', '.join(sorted(wrong))}, not line 2")
            if all(a and a != victim for got in moved.values() for a in got.values()):
                took = collections.Counter(str(a) for got in moved.values() for a in got.values())
                self.failover["pools_done_s"] = time.monotonic() - self.kill_mono
                self.live.line("etcd", f"line 2's jobs: {sum(len(s) for s in want.values())} pool shards of {victim} "
                               f"now held by " + ", ".join(f"{a} (line {self.lines[a]})" for a in sorted(took)) +
                               f", {self.failover['pools_done_s']:.2f} s after the kill; line 1's gateway is "
                               "never eligible")
                return
            if time.monotonic() > deadline:
                raise DemoFailed(f"line 2's pool shards of {victim} still unowned 40 s after the kill")
            self._pump()
            time.sleep(0.05)

    def _show_status(self) -> None:
        """`millwright status` of one survivor, read from its admin socket."""
        from agent.runtime.admin import query, render

        survivor = sorted(a for a in self.agents if a != self.victim)[0]
        try:
            doc = query(os.path.join(self.agents[survivor].dir, "admin.sock"), timeout=5)
        except Exception as exc:
            self.live.line(survivor, f"`millwright status` unavailable: {exc}")
            return
        self.sensor_mode = (doc.get("sensor") or {}).get("mode")
        self.live.line(survivor, "`millwright status` (admin socket):")
        for ln in render(doc).splitlines()[:8]:
            self.live.raw("                      " + ln[:110])

    # ----------------------------------------------------------------- settle
    def _expected(self) -> dict[str, Optional[list]]:
        return {j.id: ([f for f in j.cron_expected] if j.cron_expected else None) for j in self.jobs}

    def _records(self) -> dict[tuple[str, str], dict]:
        kvs, _ = self.client.get_prefix(self.keys.runs_prefix())
        out = {}
        for kv in kvs:
            try:
                r = json.loads(kv.value)
            except ValueError:
                continue
            out[(r.get("job_id"), r.get("fire_id"))] = r
        return out

    def _unsettled(self, recs: dict) -> list[str]:
        from agent.jobs.schedule import fire_id

        left = []
        for j in self.jobs:
            mine = {f: r for (jid, f), r in recs.items() if jid == j.id}
            if j.cron_expected:
                for due in j.cron_expected:
                    r = mine.get(fire_id(j.id, due))
                    if r is None or r.get("state") not in TERMINAL:
                        left.append(f"{j.id}@{due:%H:%M:%S}")
            elif not mine or any(r.get("state") not in TERMINAL for r in mine.values()):
                left.append(j.id)
        return left

    def settle(self) -> None:
        deadline = time.monotonic() + 25
        while True:
            self._pump()
            left = self._unsettled(self._records())
            if not left:
                return
            if time.monotonic() > deadline:
                self.live.line("demo", f"still not finished 25 s after the job phase: {', '.join(left[:6])}")
                return
            time.sleep(0.2)

    def stop_agents(self) -> None:
        for a in self.agents.values():
            if a.alive():
                a.signal(signal.SIGTERM)
        for aid, a in self.agents.items():
            if aid == self.victim or a.proc is None:
                continue
            code = a.terminate(timeout=15)
            if code == -signal.SIGKILL:
                self.live.line(aid, "did not stop within 15 s of SIGTERM: SIGKILLed")
                self.findings.append(f"{aid} did not stop within 15 s of SIGTERM (drain/shutdown hang)")
            else:
                self.live.line(aid, f"stopped (SIGTERM: drained, lease revoked), exit {code}")
        self._tick(time.monotonic() + 0.5)  # statuses the survivors flushed while stopping

    # ----------------------------------------------------------------- cleanup
    def cleanup(self) -> None:
        errors = []
        if self.console is not None:
            self.console.stop()
        for aid, a in self.agents.items():
            try:
                if a.alive():
                    a.kill()
            except Exception as exc:
                errors.append(f"agent {aid}: {exc}")
        # runs the SIGKILLed agent left behind (nobody supervises them any more)
        try:
            from agent.execute.backends import probe

            reclaimed = 0
            for aid, a in self.agents.items():
                backend = (a.config.get("execute") or {}).get("quota_backend", "auto")
                b = probe(backend, root_name=cgroup_root_name(aid, a.config["state_dir"]))
                reclaim = getattr(b, "reclaim", None)
                reclaimed += reclaim() if reclaim else 0
                b.close()
            if reclaimed:
                self.live.raw(f"removed {reclaimed} run cgroup(s) the SIGKILLed agent left behind")
        except Exception as exc:
            errors.append(f"run cgroups: {exc}")
        for pid in list(self.victim_pids):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    if self.base and self.base.encode() in fh.read():
                        os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if self.client is not None:
            try:
                self.client.close()
            except Exception:
                pass
        for srv in (self.mqtt, self.etcd):
            if srv is not None:
                try:
                    srv.stop()
                except Exception as exc:
                    errors.append(f"{srv.name}: {exc}")
        if self.nft_table:
            r = subprocess.run(["nft", "delete", "table", "inet", self.nft_table], capture_output=True)
            if r.returncode != 0:
                errors.append(f"nft delete table inet {self.nft_table}: {r.stderr.decode().strip()}")
            self.nft_table = None
        if self.stall_listener is not None:
            self.stall_listener.close()
        if self.base:
            if self.keep:
                self.live.raw(f"kept {self.base} (agents/<id>/agent.yaml, agent.log, audit/; out/effects.log)")
            else:
                shutil.rmtree(self.base, ignore_errors=True)
        for e in errors:
            self.live.raw(f"cleanup: {e}")
        if not errors:
            self.live.raw("cleaned up: agents, etcd, mosquitto, the nftables table" +
                          ("" if self.keep else ", the temporary directory"))


def cli_demo(args) -> int:
    duration = args.duration if args.duration is not None else DEFAULT_DURATION
    return Demo(duration=duration, keep=bool(args.keep)).run()
