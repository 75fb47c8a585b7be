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
import fnmatch
import json
import os
import pwd
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Optional

from agent.cli import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the dir holding agent/
DEMO_CONFIG_DIRS = (os.path.join(ROOT, "configs", "demo"), "/usr/share/millwright/demo")
DEFAULT_DURATION = 45.0
MIN_DURATION = 24.0
AGENTS = 3
JOB_USER = "millwright-jobs"
KID = "cloud-1"
TERMINAL = ("succeeded", "failed", "timed_out", "killed", "cancelled", "misfired")
CRON_EVERY_S = 5
LAUNCHERS = ("setpriv",)  # the executor's own user switch, exec'd before the job (agent/execute)


class DemoFailed(Exception):
    """An invariant broke: the demo ends with exit code 1 and this reason."""


class Interrupted(Exception):
    pass


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def rfc(dt: datetime) -> str:
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


def parse_rfc(text: Optional[str]) -> Optional[datetime]:
    if not text:
        return None
    from agent.jobs.schedule import parse_rfc3339

    try:
        return parse_rfc3339(text)
    except Exception:
        return None


# --------------------------------------------------------------------------- output


class Live:
    """One line per notable event: UTC wall time, seconds since the demo started, who, what."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.t0 = time.monotonic()
        self.lock = threading.Lock()

    def line(self, who: str, text: str) -> None:
        now = utcnow()
        with self.lock:
            print(f"{now:%H:%M:%S}.{now.microsecond // 1000:03d} {time.monotonic() - self.t0:5.1f}s  "
                  f"{who:<9} {text}", file=self.stream, flush=True)

    def phase(self, text: str) -> None:
        with self.lock:
            print(f"\n== {text}", file=self.stream, flush=True)

    def raw(self, text: str = "") -> None:
        with self.lock:
            print(text, file=self.stream, flush=True)


# --------------------------------------------------------------------------- cloud side


class CloudConsole:
    """What the cloud sees: a paho client that publishes signed pushes (QoS 1) and
    subscribes to every status and presence document of the cluster."""

    def __init__(self, host: str, port: int, cluster: str):
        import paho.mqtt.client as paho

        from agent.cloud.mqtt import PAHO_MAJOR
        from agent.cloud.topics import Topics

        self.topics = Topics(cluster)
        self.host, self.port = host, port
        kw = dict(client_id=f"millwright-demo-console-{os.getpid()}", clean_session=True, protocol=paho.MQTTv311)
        self.client = (paho.Client(paho.CallbackAPIVersion.VERSION1, **kw) if PAHO_MAJOR >= 2 else paho.Client(**kw))
        self.q: "queue.Queue[tuple[float, str, dict]]" = queue.Queue()
        self.subscribed = threading.Event()
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda *a: self.subscribed.set()
        self.client.on_message = self._on_message

    def _on_connect(self, client, userdata, flags, rc, properties=None) -> None:
        if rc == 0:
            client.subscribe([(self.topics.status_filter(), 1), (self.topics.base + "agents/+/presence", 1)])

    def _on_message(self, client, userdata, msg) -> None:
        try:
            doc = json.loads(msg.payload)
        except ValueError:
            return
        if isinstance(doc, dict):
            self.q.put((time.time(), msg.topic, doc))

    def start(self, timeout: float = 10.0) -> None:
        self.client.connect_async(self.host, self.port, keepalive=30)
        self.client.loop_start()
        if not self.subscribed.wait(timeout):
            raise DemoFailed(f"the demo's cloud console could not subscribe at mqtt://{self.host}:{self.port}")

    def publish(self, topic: str, payload: bytes, timeout: float = 10.0) -> bool:
        info = self.client.publish(topic, payload, qos=1)
        deadline = time.monotonic() + timeout
        while not info.is_published():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def stop(self) -> None:
        try:
            self.client.disconnect()
            self.client.loop_stop()
        except Exception:
            pass


# --------------------------------------------------------------------------- scenario


@dataclass
class DemoJob:
    doc: dict
    kind: str                         # what the job shows (printed)
    expect: str = "succeeded"         # succeeded | not_succeeded | any
    cron_expected: list = field(default_factory=list)  # due times of a cron job's firings
    accepted_by: Optional[str] = None
    shard: Optional[int] = None

    @property
    def id(self) -> str:
        return self.doc["id"]

    @property
    def category(self) -> str:
        if self.kind in ("network stall", "exec policy", "memory limit"):
            return "misbehaving"
        sch = self.doc.get("schedule") or {}
        return "cron" if "cron" in sch else "at" if "at" in sch else "delayed" if "delay_s" in sch else "immediate"


def plan_jobs(t0: datetime, duration: float, kill_at: float) -> list[DemoJob]:
    """The maintenance jobs of the scenario; times are relative to t0 (the push)."""
    issued = t0.replace(microsecond=(t0.microsecond // 1000) * 1000)
    far = issued + timedelta(minutes=30)
    stall_timeout = int(max(5, min(12, kill_at - 4)))
    jobs: list[DemoJob] = []

    def add(jid, template, params, schedule, kind, expect="succeeded", **kw):
        doc = {"v": 1, "id": jid, "template": template, "params": params, "schedule": schedule,
               "issued_at": rfc(issued), "not_after": rfc(far), "timeout_s": 60,
               "retry": {"max_attempts": 2, "backoff_s": 1, "max_backoff_s": 5, "jitter": 0}}
        doc.update(kw)
        jobs.append(DemoJob(doc, kind, expect))
        return jobs[-1]

    # immediate
    add("oil-check-line1", "oil-check", {"line": "1"}, {}, "immediate")
    add("oil-check-line2", "oil-check", {"line": "2"}, {}, "immediate")
    add("firmware-fetch-press4", "firmware-fetch", {"image": "press-ctl-4.2"}, {}, "network stall", "any",
        timeout_s=stall_timeout, retry={"max_attempts": 1})
    add("line-diagnostics-line2", "line-diagnostics", {"line": "2"}, {}, "exec policy", "any",
        retry={"max_attempts": 1})
    add("vision-warmup-cam1", "vision-warmup", {"mb": "256"}, {}, "memory limit", "not_succeeded",
        resources={"memory_mb": 48, "cpu": 0.5}, retry={"max_attempts": 1})
    # delayed (relative to issued_at)
    add("coolant-flush-line3", "coolant-flush", {"line": "3"}, {"delay_s": 6}, "delayed 6 s")
    late = int(duration * 0.6)
    add("coolant-flush-line4", "coolant-flush", {"line": "4"}, {"delay_s": late}, f"delayed {late} s")
    # at: spread over the scenario, most of them after the kill
    span = duration - 12.0
    for i in range(6):
        at = t0 + timedelta(seconds=5.0 + i * span / 5)
        add(f"filter-swap-press{i + 1}", "filter-swap", {"press": str(i + 1)}, {"at": rfc(at)},
            f"at +{(at - t0).total_seconds():.0f} s")
    # a long run that is in progress when the agent is killed (if its agent is the victim)
    at = t0 + timedelta(seconds=kill_at - 2)
    add("press-calibration-2", "press-calibration", {"press": "2", "seconds": "5"}, {"at": rfc(at)},
        f"at +{kill_at - 2:.0f} s, runs 5 s")
    # cron with seconds, bounded by not_after
    end = t0 + timedelta(seconds=duration - 4)
    grid_end = datetime.fromtimestamp((int(end.timestamp()) // CRON_EVERY_S) * CRON_EVERY_S, timezone.utc)
    not_after = grid_end + timedelta(seconds=2.5)
    for line in (1, 2, 3):
        j = add(f"vibration-sample-line{line}", "vibration-sample", {"line": str(line)},
                {"cron": f"*/{CRON_EVERY_S} * * * * *", "tz": "Europe/Berlin"}, f"cron */{CRON_EVERY_S} s",
                misfire="run_all", misfire_limit=3, overlap="forbid", not_after=rfc(not_after))
        g = (int(issued.timestamp() // CRON_EVERY_S) + 1) * CRON_EVERY_S
        while g < not_after.timestamp():
            j.cron_expected.append(datetime.fromtimestamp(g, timezone.utc))
            g += CRON_EVERY_S
    return jobs


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


def scrape(port: int, timeout: float = 3.0) -> dict[tuple[str, tuple], float]:
    """Samples of an agent's Prometheus endpoint: {(name, sorted label items): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def msum(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == w for k, w in labels.items()))


def by_label(samples: dict, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = collections.Counter()
    for (n, ls), v in samples.items():
        if n == name:
            out[dict(ls).get(label, "")] += v
    return dict(out)


def cgroup_root_name(agent_id: str) -> str:
    """The per-agent cgroup root the daemon uses (agent/runtime/components.py)."""
    return "millwright-" + re.sub(r"[^A-Za-z0-9._-]", "_", agent_id)[:50]


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(p / 100.0 * (len(s) - 1)))))]


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


# --------------------------------------------------------------------------- the demo


class Demo:
    def __init__(self, duration: float = DEFAULT_DURATION, keep: bool = False, stream=None):
        import logging

        # product modules used in-process (cleanup's cgroup reclaim) log through
        # millwright.*; the demo prints its own lines instead
        logging.getLogger("millwright").addHandler(logging.NullHandler())
        self.duration = float(duration)
        self.kill_at = max(10.0, round(self.duration * 0.4, 1))
        self.keep = keep
        self.live = Live(stream)
        self.started = time.monotonic()
        self.base: Optional[str] = None
        self.etcd = None
        self.mqtt = None
        self.console: Optional[CloudConsole] = None
        self.client = None
        self.keys = None
        self.agents: dict[str, Any] = {}
        self.metrics_ports: dict[str, int] = {}
        self.nft_table: Optional[str] = None
        self.stall_listener: Optional[socket.socket] = None
        self.jobs: list[DemoJob] = []
        self.templates: dict = {}
        self.victim: Optional[str] = None
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
            result = self.collect()
            self.stop_agents()
            result["audit"] = self.verify_audit()
            code = self.summary(result)
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
            import paho.mqtt.client  # noqa: F401
            import etcd3  # noqa: F401
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

        keys_file = os.path.join(self.base, "keys.yaml")
        self.ring = testkit.write_keys(keys_file, KID)
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
        for aid in ids:
            port = free_port()
            cfg = json.loads(json.dumps(base_cfg))
            cfg["etcd"] = {**cfg.get("etcd", {}), "endpoints": [self.etcd.endpoint]}
            cfg["mqtt"] = {**cfg.get("mqtt", {}), "url": self.mqtt.url}
            cfg["signing"] = {"keys_file": keys_file}
            cfg["metrics"] = {"listen": f"127.0.0.1:{port}"}
            a = AgentProcess(aid, os.path.join(self.base, "agents"), cfg).start()
            self.agents[aid] = a
            self.metrics_ports[aid] = port
            live.line(aid, f"started `millwright run` (pid {a.pid}), metrics http://127.0.0.1:{port}/metrics")
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

    def _job(self, jid: str) -> Optional[DemoJob]:
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
            elif "at" in sch and parse_rfc(sch["at"]) and parse_rfc(sch["at"]) > kill - timedelta(seconds=3):
                score[owner] += 1
            elif "delay_s" in sch and self.t0 + timedelta(seconds=sch["delay_s"]) > kill:
                score[owner] += 1
        return score

    def _kill(self) -> None:
        from agent.coordination.keys import shard_of

        owners = self._owners()
        owner_of = lambda j: owners.get(shard_of(j.id, self.shard_count))
        score = self._future_firings(owner_of)
        victim = max(sorted(self.agents), key=lambda a: score.get(a, 0))
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
        orphans = [(k[0], int(d["pid"])) for k, d in self._running.items() if d.get("agent") == victim
                   and d.get("pid") and k[0] in running and os.path.exists(f"/proc/{d['pid']}")]
        for jid, pid in orphans:
            self.live.line(victim, f"its run of {jid} (pid {pid}) keeps running without its agent")
            self.notes.append(f"{victim}'s run of {jid} (pid {pid}) outlived its agent: runs of a dead agent are "
                              "not stopped, so a retry by the new owner could overlap a run longer than the lease TTL")

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
                return
            if now > deadline:
                raise DemoFailed(f"failover did not complete: {len(mine) - len(taken)} of {victim}'s shards "
                                 "still unowned 40 s after the kill")
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

    # ----------------------------------------------------------------- results
    def _effects(self) -> collections.Counter:
        c: collections.Counter = collections.Counter()
        path = os.path.join(self.out_dir, "effects.log")
        if os.path.exists(path):
            with open(path) as fh:
                for line in fh:
                    p = line.split()
                    if len(p) >= 3:
                        c[(p[0], p[1], p[2])] += 1
        return c

    def _audit_records(self, aid: str, types: set) -> list[dict]:
        from agent.audit.show import Filter, records

        d = os.path.join(self.agents[aid].dir, "audit")
        try:
            return [rec for _, rec in records(d, Filter(types=types))]
        except Exception:
            return []

    def collect(self) -> dict:
        from agent.jobs.schedule import fire_id

        self.live.phase("6/6 check the results against etcd, the side effects, the audit logs and the metrics")
        self._pump()
        recs = self._records()
        fx = self._effects()
        problems: list[str] = []
        # 1. exactly once: one record per expected firing, side effects consistent with it
        firings = 0
        by_state: collections.Counter = collections.Counter()
        for j in self.jobs:
            mine = {f: r for (jid, f), r in recs.items() if jid == j.id}
            if j.cron_expected:
                want = [fire_id(j.id, d) for d in j.cron_expected]
                for f in want:
                    if f not in mine:
                        problems.append(f"lost: {j.id} firing {f} has no run record")
                extra = sorted(set(mine) - set(want))
                if extra:
                    problems.append(f"{j.id}: unexpected firings {extra[:3]}")
            elif len(mine) != 1:
                problems.append(f"{j.id}: {len(mine)} run records (expected exactly 1)")
            for f, r in mine.items():
                firings += 1
                state = r.get("state")
                by_state[state] += 1
                if state not in TERMINAL:
                    problems.append(f"{j.id} {f}: not finished (state {state})")
                attempt = int(r.get("attempt") or 1)
                runs = {int(a): n for (jid, ff, a), n in fx.items() if jid == j.id and ff == f and a.isdigit()}
                twice = [a for a, n in runs.items() if n > 1]
                if twice:
                    problems.append(f"ran twice: {j.id} {f} attempt {twice[0]} has {runs[twice[0]]} side effects")
                if any(a > attempt for a in runs):
                    problems.append(f"{j.id} {f}: side effect of attempt {max(runs)} but the record says {attempt}")
                if state == "succeeded" and runs.get(attempt, 0) != 1:
                    problems.append(f"{j.id} {f}: succeeded without its side effect")
                if state in ("misfired", "cancelled") and runs:
                    problems.append(f"{j.id} {f}: {state} but it ran")
        orphan_fx = [k for k in fx if (k[0], k[1]) not in recs]
        for k in orphan_fx[:3]:
            problems.append(f"ran without a run record: {k[0]} {k[1]} attempt {k[2]}")
        # 2. on time: start minus due, from the records
        delays, late, immediate = [], [], []
        now_jobs = {j.id for j in self.jobs if not j.doc["schedule"]}
        kill = self.kill_wall
        fo_end = kill + timedelta(seconds=self.failover.get("done_s", 0)) if kill else None
        for (jid, f), r in recs.items():
            due, started = parse_rfc(r.get("due")), parse_rfc(r.get("started_at"))
            if not due or not started or int(r.get("attempt") or 1) != 1:
                continue
            d = (started - due).total_seconds()
            if jid in now_jobs:
                immediate.append(d)
            elif kill and kill - timedelta(seconds=1) <= due <= fo_end + timedelta(seconds=3) and d > 0.05:
                late.append((jid, d))
            else:
                delays.append(d)
        metrics = {}
        for aid, port in self.metrics_ports.items():
            if aid == self.victim:
                continue
            try:
                metrics[aid] = scrape(port)
            except Exception as exc:
                self.notes.append(f"metrics of {aid} unreadable: {exc}")
        audit_recs = {aid: self._audit_records(aid, {"exec", "policy_violation", "health", "lease", "gap", "job"})
                      for aid in self.agents}
        # firings left `running` by the dead agent: the new owner resolves them by policy
        retried_after_loss = []
        for aid, rs in audit_recs.items():
            for e in rs:
                if e.get("type") == "job" and e.get("event") == "owner_lost":
                    r = recs.get((e.get("job"), e.get("fire_id")), {})
                    retried_after_loss.append((e.get("job"), e.get("fire_id") or "", r, aid))
        return {"records": recs, "effects": fx, "problems": problems, "firings": firings, "by_state": by_state,
                "retried": retried_after_loss, "delays": delays, "immediate": immediate, "late": late, "metrics": metrics,
                "audit_recs": audit_recs}

    def stop_agents(self) -> None:
        for aid, a in self.agents.items():
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

    def verify_audit(self) -> dict[str, tuple[bool, str]]:
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        procs = {}
        for aid, a in self.agents.items():
            procs[aid] = subprocess.Popen([sys.executable, "-m", "agent", "audit", "verify", "-c", a.config_path],
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
        out = {}
        for aid, p in procs.items():
            try:
                text, _ = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                text, _ = p.communicate()
            lines = [ln for ln in text.strip().splitlines() if ln.strip()]
            out[aid] = (p.returncode == 0, lines[-1] if lines else f"exit {p.returncode}", lines[:-1])
        return out

    # ----------------------------------------------------------------- summary
    def _final(self, recs: dict, jid: str) -> Optional[dict]:
        mine = [r for (j, _), r in recs.items() if j == jid]
        return mine[-1] if mine else None

    def _statuses(self, jid: str) -> list[dict]:
        return [d for d in self.statuses if d.get("job_id") == jid]

    def summary(self, res: dict) -> int:
        live = self.live
        recs, problems = res["records"], list(res["problems"])
        metrics = res["metrics"]
        live.phase("Summary")
        W = 13

        def row(label: str, text: str) -> None:
            live.raw(f"{label:<{W}}{text}")

        def cont(text: str) -> None:
            live.raw(" " * W + text)

        # jobs
        via = "MQTT" if not any(j.accepted_by == "(etcd)" for j in self.jobs) else "MQTT + JobStore fallback"
        kinds = collections.Counter(j.category for j in self.jobs)
        bad = [j.kind for j in self.jobs if j.category == "misbehaving"]
        row("jobs", f"{len(self.jobs)} signed jobs pushed over {via}: " + ", ".join(
            f"{n} {k}" for k, n in kinds.items() if k != "misbehaving") +
            (f", {len(bad)} misbehaving ({', '.join(bad)})" if bad else ""))
        # exactly once
        fx = res["effects"]
        states = ", ".join(f"{n} {s}" for s, n in sorted(res["by_state"].items()))
        verdict = "OK " if not problems else "BROKEN"
        row("exactly-once", f"{verdict} {res['firings']} firings -> {len(recs)} run records ({states}); "
                            f"{sum(fx.values())} side-effect lines, none twice for one (job, firing, attempt)"
            if not problems else f"{verdict} " + problems[0])
        for p in problems[1:6]:
            cont(p)
        for jid, f, r, aid in res["retried"]:
            cont(f"{jid}: was running on {self.victim} when it died (owner_lost); {aid} resolved it by "
                 f"the retry policy: attempt {r.get('attempt')} {r.get('state')} on {r.get('agent')}")
        # the cloud's view: a final status for every finished firing
        finals = {(d.get("job_id"), d.get("run_id")) for d in self.statuses if d.get("state") in TERMINAL}
        missing = collections.Counter(r.get("agent") for (jid, f), r in recs.items()
                                      if r.get("state") in TERMINAL and r.get("state") != "misfired"
                                      and (jid, f) not in finals)
        got = sum(1 for k, r in recs.items() if k in finals)
        row("statuses", f"the cloud received a final status for {got} of {len(recs)} run records over MQTT" +
            ("" if not missing else "; missing from " + ", ".join(f"{a} {n}" for a, n in sorted(missing.items()))))
        lost_live = {a: n for a, n in missing.items() if a != self.victim}
        if missing.get(self.victim):
            cont(f"{self.victim}'s undelivered statuses wait in its outbox on its disk until it runs again")
        if lost_live:
            self.findings.append("final statuses of surviving agents never reached the broker: " +
                                 ", ".join(f"{a} {n}" for a, n in sorted(lost_live.items())) +
                                 " (status outbox stalled?)")
        # on time
        if res["delays"]:
            d = res["delays"]
            row("on time", f"start minus due over {len(d)} scheduled firings: p50 {fmt_ms(pct(d, 50))}, "
                           f"p95 {fmt_ms(pct(d, 95))}, max {fmt_ms(max(d))}")
        if res["immediate"]:
            d = res["immediate"]
            cont(f"{len(d)} immediate jobs started {fmt_ms(min(d))} to {fmt_ms(max(d))} after issued_at "
                 "(push, signature check, durable etcd write, ack, claim, spawn)")
        for jid, dl in res["late"]:
            cont(f"{jid}: due during the failover, started {fmt_ms(dl)} late on the new owner")
        # failover
        fo = self.failover
        if fo.get("done_s") is not None:
            row("failover", f"OK  {fo['victim']} SIGKILLed at +{self.kill_at:g} s holding {len(fo['shards'])} shards; "
                            f"lease expired after {fo['expired_s']:.2f} s; all its shards owned by " +
                ", ".join(f"{a} ({n})" for a, n in sorted(fo["taken"].items())) +
                f" {fo['done_s']:.2f} s after the kill (lease_ttl_s 4)")
        else:
            problems.append("failover did not complete")
            row("failover", "BROKEN did not complete")
        # health decisions
        self._health_summary(res, row, cont, problems)
        # audit
        audit_ok = True
        first = True
        for aid, (ok, last, notes) in sorted(res["audit"].items()):
            audit_ok &= ok
            tag = " (SIGKILLed)" if aid == self.victim else ""
            row("audit verify" if first else "", f"{'OK ' if ok else 'FAILED '} {aid}{tag}: {last}")
            for n in notes[:2]:
                cont("  " + n)
            first = False
        if not audit_ok:
            problems.append("`millwright audit verify` failed for " +
                            ", ".join(a for a, (ok, _, _) in res["audit"].items() if not ok))
        for n in self.notes:
            row("note", n)
        for f in self.findings:
            row("not yet", f)
        live.raw("")
        if problems:
            live.raw(f"RESULT: FAILED - {problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
            return 1
        live.raw("RESULT: OK - no job lost, none run twice, failover in "
                 f"{fo['done_s']:.1f} s, audit logs verified")
        return 0

    def _health_summary(self, res: dict, row, cont, problems: list) -> None:
        recs, metrics = res["records"], res["metrics"]
        audit = res["audit_recs"]

        def rec_line(jid: str) -> tuple[Optional[dict], str]:
            r = self._final(recs, jid)
            if r is None:
                return None, "no run record"
            bits = [str(r.get("state"))]
            if r.get("reason") and r.get("reason") != r.get("state"):
                bits.append(f"reason {r['reason']}")
            if r.get("exit_code") is not None:
                bits.append(f"exit {r['exit_code']}")
            bits.append(f"health {r.get('health') or '-'}")
            bits.append(f"on {r.get('agent')}")
            return r, ", ".join(bits)

        total = lambda name, **lb: sum(msum(s, name, **lb) for s in metrics.values())
        # memory
        r, text = rec_line("vision-warmup-cam1")
        qk = total("millwright_quota_kills_total")
        ok = r is not None and r.get("state") != "succeeded"
        row("memory", f"{'OK ' if ok else 'BROKEN'} vision-warmup-cam1 (256 MiB model, 48 MiB limit): {text}; "
                      f"millwright_quota_kills_total {qk:g} (survivors)")
        if not ok:
            problems.append("the job over its memory limit was not stopped")
        # exec policy
        jid = "line-diagnostics-line2"
        r, text = rec_line(jid)
        allow = self.templates.get("line-diagnostics", {}).get("allow_exec", [])
        execs = [e for recs_ in audit.values() for e in recs_ if e.get("type") == "exec" and e.get("job") == jid]
        outside = [e for e in execs if not any(fnmatch.fnmatch(e.get("filename") or "", p) for p in allow)
                   and os.path.basename(e.get("filename") or "") not in LAUNCHERS]
        viol = [e for recs_ in audit.values() for e in recs_ if e.get("type") == "policy_violation" and e.get("job") == jid]
        enforced = bool(viol) or any(e.get("verdict") in ("denied", "killed", "violation") for e in outside) or (
            r is not None and r.get("state") == "killed")
        seen = ", ".join(sorted({f"{e.get('filename')} (verdict {e.get('verdict')})" for e in outside})) or "none"
        row("exec policy", f"{'OK ' if enforced else 'NOT SHOWN'} {jid} execs uname outside allow_exec: {text}")
        cont(f"audit exec records outside allow_exec: {seen}; policy_violation records: {len(viol)}")
        if not execs:
            cont("the audit log has no exec record of this run (BPF sensor degraded or not attributing execs?)")
        if not enforced:
            self.findings.append("exec policy (bpf.mode enforce): an exec outside allow_exec is recorded "
                                 "but the run is not stopped and no policy_violation is recorded")
        # network stall
        jid = "firmware-fetch-press4"
        r, text = rec_line(jid)
        health_seen = sorted({d.get("health") for d in self._statuses(jid) if d.get("health")} |
                             ({r.get("health")} if r and r.get("health") else set()))
        detected = any(h not in ("healthy", None) for h in health_seen) or (
            r is not None and "network_stall" in str(r.get("reason")))
        row("net stall", f"{'OK ' if detected else 'NOT SHOWN'} {jid} (update server blackholed): {text}")
        bpf = {}
        for s in metrics.values():
            for k, v in by_label(s, "millwright_bpf_events_total", "kind").items():
                bpf[k] = bpf.get(k, 0) + v
        lost = total("millwright_bpf_lost_events_total")
        mode = getattr(self, "sensor_mode", None)
        cont(f"health values published for it: {', '.join(h for h in health_seen if h) or 'none'}; BPF sensor mode "
             f"{mode or '?'}, events (survivors) " + (", ".join(f"{k} {v:g}" for k, v in sorted(bpf.items())) or "none")
             + f", lost {lost:g}")
        if not detected:
            self.findings.append("health decisions: the stalled run's health stays 'healthy' (no run health "
                                 "from kernel signals in statuses or run records)")
        # lease decisions
        fences = {}
        for s in metrics.values():
            for k, v in by_label(s, "millwright_self_fences_total", "reason").items():
                fences[k] = fences.get(k, 0) + v
        lease_events = collections.Counter(f"{e.get('event')}" for recs_ in audit.values() for e in recs_
                                           if e.get("type") == "lease")
        row("lease", "survivors' self-fences: " + (", ".join(f"{k} {v:g}" for k, v in fences.items()) or "0") +
            "; audit lease records: " + ", ".join(f"{k} {n}" for k, n in sorted(lease_events.items())) +
            " (this scenario stalls a job's network, not an agent's etcd path)")
        hm = {}
        for name, label in (("millwright_run_health_changes_total", "state"),
                            ("millwright_exec_policy_violations_total", "mode")):
            for s in metrics.values():
                for k, v in by_label(s, name, label).items():
                    hm[f"{name[11:]}{{{k}}}"] = hm.get(f"{name[11:]}{{{k}}}", 0) + v
        if hm:
            cont("health metrics (survivors): " + ", ".join(f"{k} {v:g}" for k, v in sorted(hm.items())))
        else:
            self.findings.append("health metrics (run health changes, exec-policy violations) are not exported")

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
                b = probe(backend, root_name=cgroup_root_name(aid))
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
