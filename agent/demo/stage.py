"""The demo's machine: a local etcd and mosquitto, the cloud console, three agents (each
`millwright run` with its own state, audit log, metrics port and admin socket), the job
user and scripts, and the nftables table that blackholes the network-stall job's server.

:class:`Stage` starts all of it and takes all of it down again; it owns every process and
file the demo creates (under one temporary directory), so cleanup is one call.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
from typing import Any, Iterable, Optional

from agent.demo.console import CloudConsole, write_signer_keys
from agent.demo.output import Live
from agent.demo.services import REPO_ROOT, AgentProcess, EtcdServer, MosquittoServer, free_port
from agent.errors import UserError

DEMO_CONFIG_DIRS = (os.path.join(REPO_ROOT, "configs", "demo"), "/usr/share/millwright/demo")
AGENTS = 3
JOB_USER = "millwright-jobs"
KID = "cloud-1"


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
    """The per-agent cgroup root the daemon uses (agent/daemon/wiring.py)."""
    from agent.execute.backends import run_root_name

    return run_root_name(agent_id, state_dir)


class Stage:
    """Everything the demo runs on. Attributes are set by :meth:`start`; :meth:`cleanup`
    is safe after a start that failed half-way."""

    def __init__(self, live: Live, keep: bool, notes: list[str]):
        import logging

        # product modules used in-process (cleanup's cgroup reclaim) log through
        # agent.*; the demo prints its own lines instead
        logging.getLogger("agent").addHandler(logging.NullHandler())
        self.live = live
        self.keep = keep
        self.notes = notes  # what the summary reports about the machine (no nft, ...)
        self.base: Optional[str] = None
        self.out_dir = ""
        self.etcd: Any = None
        self.mqtt: Any = None
        self.console: Optional[CloudConsole] = None
        self.client: Any = None
        self.keys: Any = None
        self.ring: Any = None
        self.cluster = "demo"
        self.shard_count = 64
        self.templates: dict = {}
        self.agents: dict[str, AgentProcess] = {}
        self.metrics_ports: dict[str, int] = {}
        self.lines: dict[str, str] = {}  # agent -> the production line it serves (its label)
        self.nft_table: Optional[str] = None
        self.stall_listener: Optional[socket.socket] = None

    def start(self) -> None:
        """etcd, mosquitto, the cloud console and the agents (not yet converged)."""
        import yaml

        from agent.config import EtcdConfig
        from agent.coordination.etcd import EtcdClient
        from agent.coordination.keys import Keys

        live = self.live
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
        os.chmod(out_dir, 0o755)
        # every run has a uid of its own (job isolation): they all append to one side-effect
        # log that none of them can remove or replace
        effects_log = os.path.join(out_dir, "effects.log")
        open(effects_log, "a").close()
        os.chmod(effects_log, 0o666)
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
        # (in a directory of its own: job isolation hides a millwright* directory that holds
        # the agents' keys whole, and the job scripts live in the demo's base directory)
        os.makedirs(os.path.join(self.base, "signing"), mode=0o700, exist_ok=True)
        keys_file = os.path.join(self.base, "signing", "keys.yaml")
        self.ring = write_signer_keys(os.path.join(self.base, "cloud-signer.yaml"), keys_file, KID)
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
            cfg["etcd"] = {**cfg.get("etcd", {}), "endpoints": [self.etcd.endpoint]}   # insecure: true (agent.yaml)
            cfg["mqtt"] = {**cfg.get("mqtt", {}), "url": self.mqtt.url}
            cfg["signing"] = {"keys_file": keys_file}
            cfg["metrics"] = {"listen": f"127.0.0.1:{port}"}
            a = AgentProcess(aid, os.path.join(self.base, "agents"), cfg).start()
            self.agents[aid] = a
            self.metrics_ports[aid] = port
            live.line(aid, f"started `millwright run` (pid {a.pid}), labels line={self.lines[aid]}, "
                           f"metrics http://127.0.0.1:{port}/metrics")

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

    # ----------------------------------------------------------------- reading etcd
    def owners(self) -> dict[int, str]:
        """shard -> holder (shards/)."""
        kvs, _ = self.client.get_prefix(self.keys.shards_prefix())
        return {self.keys.shard_number(kv.key): kv.value.decode() for kv in kvs}

    def pool_owners(self) -> dict[str, dict[int, str]]:
        """pool -> shard -> holder, for every targeted pool (pools/<pool>/shards/)."""
        kvs, _ = self.client.get_prefix(self.keys.pools_prefix())
        out: dict[str, dict[int, str]] = {}
        for kv in kvs:
            pool, _, tail = kv.key[len(self.keys.pools_prefix()):].partition("/")
            if tail.startswith("shards/"):
                out.setdefault(pool, {})[int(tail[len("shards/"):])] = kv.value.decode()
        return out

    def records(self) -> dict[tuple[str, str], dict]:
        """(job id, fire id) -> run record, every run record in etcd."""
        kvs, _ = self.client.get_prefix(self.keys.runs_prefix())
        out = {}
        for kv in kvs:
            try:
                r = json.loads(kv.value)
            except ValueError:
                continue
            out[(r.get("job_id"), r.get("fire_id"))] = r
        return out

    # ----------------------------------------------------------------- cleanup
    def cleanup(self, stray_pids: Iterable[int] = ()) -> None:
        """Stop and remove everything; ``stray_pids``: job processes a SIGKILLed agent may
        have left (killed only if their command line is under this demo's directory)."""
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
            from agent.execute.backends.cgroup import CgroupBackend

            reclaimed = 0
            for aid, a in self.agents.items():
                backend = (a.config.get("execute") or {}).get("quota_backend", "auto")
                b = probe(backend, root_name=cgroup_root_name(aid, a.config["state_dir"]))
                reclaimed += b.reclaim() if isinstance(b, CgroupBackend) else 0   # only cgroups hold runs
                b.close()
            if reclaimed:
                self.live.raw(f"removed {reclaimed} run cgroup(s) the SIGKILLed agent left behind")
        except Exception as exc:
            errors.append(f"run cgroups: {exc}")
        for pid in list(stray_pids):
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
