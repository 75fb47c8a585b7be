"""Local etcd and mosquitto as child processes, for the demo and the test fixtures.

Each runs on free loopback ports with a temporary directory; it can be stopped,
restarted on the same ports and data, and paused with SIGSTOP for fault tests. Only the
processes started here are ever signalled.

Both can run the way a plant should: ``tls=TlsFiles`` (agent/demo/pki.py), and for
mosquitto a password file and an ACL, for etcd authentication with a user per agent
confined to its cluster's prefix (``enable_auth``, ``add_agent``, ``add_ops``,
``revoke_agent``: packaging/debian/examples/etcd-rbac.sh).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import IO, Any, Optional

from agent.demo.childproc import spawn_dying_with_parent
from agent.demo.pki import TlsFiles, make_pki  # noqa: F401 - the services' TLS, for their users

# the source tree's root (agents started from a checkout import `agent` from there)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LISTEN_PORTS_FROM = 20000   # services' ports are picked from here up to the kernel's ephemeral range


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port below the kernel's ephemeral range. A service that is stopped and
    started again on its port (a broker outage, an etcd restart) must find it free: a port
    from the ephemeral range can meanwhile be taken as the local port of any outgoing
    connection on the host, and the restart then fails with "Address already in use"."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(LISTEN_PORTS_FROM, low) if low > LISTEN_PORTS_FROM + 1 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_port(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


class _Child:
    name = "service"

    def __init__(self, workdir: Optional[str] = None):
        self.own_dir = workdir is None
        self.dir = workdir or tempfile.mkdtemp(prefix=f"mw-{self.name}-")
        os.makedirs(self.dir, exist_ok=True)
        self.proc: Optional[subprocess.Popen] = None
        self.logf: Optional[IO[bytes]] = None     # the log the process writes, from spawn() on
        self.paused = False

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def _ready(self, timeout: float) -> bool:
        raise NotImplementedError

    def spawn(self) -> None:
        """The process, its output appended to its log; not waited for."""
        exe = self._argv()[0]
        if shutil.which(exe) is None:
            raise RuntimeError(f"{exe} not found: run `make setup` (scripts/setup-host.sh) as root")
        self.logf = open(os.path.join(self.dir, f"{self.name}.log"), "ab")
        self.proc = spawn_dying_with_parent(self._argv(), stdout=self.logf, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)

    def start(self, timeout: float = 15.0) -> "_Child":
        self.spawn()
        if not self._ready(timeout):
            tail = self.log_tail()
            self.stop()
            raise RuntimeError(f"{self.name} did not become ready in {timeout}s; log tail:\n{tail}")
        return self

    def log_tail(self, n: int = 20) -> str:
        try:
            with open(os.path.join(self.dir, f"{self.name}.log"), "rb") as fh:
                return b"\n".join(fh.read().splitlines()[-n:]).decode(errors="replace")
        except OSError:
            return ""

    def pause(self) -> None:
        assert self.proc
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.proc
        os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if self.proc and self.proc.poll() is None:
            if self.paused:
                self.resume()
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self.logf:
            self.logf.close()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def restart(self, timeout: float = 15.0) -> None:
        self.stop()
        self.start(timeout)

    def close(self) -> None:
        self.stop()
        if self.own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()


class EtcdServer(_Child):
    """A single-member etcd on loopback."""

    name = "etcd"

    def __init__(self, workdir: Optional[str] = None, port: Optional[int] = None,
                 extra_hosts: tuple[str, ...] = ("127.0.0.2",), tls: Optional[TlsFiles] = None):
        super().__init__(workdir)
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.peer_port = free_port()
        # The same server is also reachable on other loopback addresses, so that a test can
        # cut one agent off (nftables on its address) while the others stay connected.
        self.extra_hosts = extra_hosts
        self.tls = tls
        self.root_password: Optional[str] = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def endpoint_on(self, host: str) -> str:
        return f"{self.scheme}://{host}:{self.port}"

    def _argv(self) -> list[str]:
        url = self.endpoint
        listen = ",".join([url] + [self.endpoint_on(h) for h in self.extra_hosts])
        peer = f"http://{self.host}:{self.peer_port}"
        tls = ["--cert-file", self.tls.cert, "--key-file", self.tls.key] if self.tls else []
        # a single member has no peer to lose its leadership to: a short election timeout
        # only shortens its (re)start to its first leader (0.6 s to 0.2 s on average)
        fast_election = ["--heartbeat-interval", "25", "--election-timeout", "250"]
        return ["etcd", "--name", "mw", "--data-dir", os.path.join(self.dir, "data"), *fast_election,
                "--listen-client-urls", listen, "--advertise-client-urls", url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"mw={peer}", "--initial-cluster-state", "new",
                "--log-level", "warn", "--logger", "zap",
                "--quota-backend-bytes", str(2 * 1024 ** 3), "--auto-compaction-retention", "0"] + tls

    def etcdctl_env(self, user: Optional[str] = None) -> dict:
        env = {**os.environ, "ETCDCTL_API": "3", "ETCDCTL_ENDPOINTS": self.endpoint}
        env.pop("ETCDCTL_USER", None)
        if self.tls:
            env["ETCDCTL_CACERT"] = self.tls.ca
        if user:
            env["ETCDCTL_USER"] = user
        return env

    def rbac(self, *args: str, stdin: str = "") -> str:
        """Run packaging/debian/examples/etcd-rbac.sh as the operator would (as root once
        auth is on); its output."""
        script = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "packaging", "debian", "examples", "etcd-rbac.sh")
        env = self.etcdctl_env(f"root:{self.root_password}" if self.root_password else None)
        r = subprocess.run(["sh", script, *args], env=env, input=stdin, capture_output=True, text=True,
                           timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"etcd-rbac.sh {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
        return r.stdout

    def enable_auth(self, root_password: str) -> None:
        """The root user, then auth on."""
        self.rbac("init", stdin=root_password + "\n")
        self.root_password = root_password

    def add_agent(self, cluster: str, agent_id: str, password: str) -> str:
        """Agent ``agent_id``'s own user, confined to ``cluster``'s prefix; its name."""
        return self.rbac("agent", cluster, agent_id, stdin=password + "\n").strip().splitlines()[-1]

    def add_ops(self, user: str, password: str, *clusters: str) -> None:
        """A cloud/operator user with read-write access to these clusters' prefixes."""
        self.rbac("ops", user, *clusters, stdin=password + "\n")

    def revoke_agent(self, cluster: str, agent_id: str) -> str:
        """Delete the agent's user and revoke its session lease."""
        return self.rbac("revoke", cluster, agent_id)

    def _ready(self, timeout: float) -> bool:
        import ssl
        import urllib.request
        ctx = ssl.create_default_context(cafile=self.tls.ca) if self.tls else None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc and self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.endpoint + "/health", timeout=0.5, context=ctx) as r:
                    if b'"true"' in r.read():
                        return True
            except OSError:
                pass
            time.sleep(0.05)
        return False


class EtcdMember(_Child):
    """One member of a multi-member etcd cluster on loopback (see :class:`EtcdCluster`)."""

    name = "etcd"

    def __init__(self, cluster: "EtcdCluster", index: int):
        super().__init__(os.path.join(cluster.dir, f"m{index}"))
        self.own_dir = False
        self.cluster = cluster
        self.index = index
        self.member_name = f"mw{index}"
        self.host = "127.0.0.1"
        self.port = free_port()
        self.peer_port = free_port()
        self.started_once = False

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def _argv(self) -> list[str]:
        extra = ",".join(f"http://{h}:{self.port}" for h in self.cluster.extra_hosts)
        listen = self.endpoint + ("," + extra if extra else "")
        # a restarted member rejoins with its data dir; "new" is only for the first start
        state = "existing" if self.started_once else "new"
        return ["etcd", "--name", self.member_name, "--data-dir", os.path.join(self.dir, "data"),
                "--listen-client-urls", listen, "--advertise-client-urls", self.endpoint,
                "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
                "--initial-cluster", self.cluster.initial_cluster,
                "--initial-cluster-token", self.cluster.token,
                "--initial-cluster-state", state,
                "--heartbeat-interval", "100", "--election-timeout", "1000",
                "--log-level", "warn", "--logger", "zap",
                "--quota-backend-bytes", str(2 * 1024 ** 3), "--auto-compaction-retention", "0"]

    def start(self, timeout: float = 20.0) -> "EtcdMember":
        super().start(timeout)
        self.started_once = True
        return self

    def _ready(self, timeout: float) -> bool:
        # a member alone cannot become healthy (no quorum): ready means it serves its
        # client port; EtcdCluster.wait_healthy waits for a leader
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc and self.proc.poll() is not None:
                return False
            if wait_port(self.host, self.port, 0.2):
                return True
        return False

    def status(self, timeout: float = 1.0) -> Optional[dict]:
        """The member's /v3/maintenance/status, or None when it does not answer."""
        import json
        import urllib.request
        req = urllib.request.Request(self.endpoint + "/v3/maintenance/status", data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None


class EtcdCluster:
    """A real multi-member etcd cluster on loopback (three processes by default), for tests
    that kill, pause and restart members, the leader included. Only its own processes are
    ever signalled."""

    def __init__(self, size: int = 3, workdir: Optional[str] = None,
                 extra_hosts: tuple[str, ...] = ("127.0.0.2",)):
        self.own_dir = workdir is None
        self.dir = workdir or tempfile.mkdtemp(prefix="mw-etcd-cluster-")
        self.extra_hosts = extra_hosts
        self.token = f"mw-{os.getpid()}-{int(time.time() * 1000)}"
        self.members = [EtcdMember(self, i) for i in range(size)]
        self.initial_cluster = ",".join(f"{m.member_name}={m.peer_url}" for m in self.members)

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def endpoints_on(self, host: str) -> list[str]:
        return [f"http://{host}:{m.port}" for m in self.members]

    def start(self, timeout: float = 30.0, tries: int = 3) -> "EtcdCluster":
        """Start every member and wait until they agree on a leader. A port free_port()
        found free can be taken by another process before etcd binds it (on another
        loopback address too): such a member exits at once, and the cluster is made again
        on new ports, at most ``tries`` times."""
        for attempt in range(tries):
            for m in self.members:  # members wait for each other: start all, then wait
                m.spawn()
                m.started_once = True
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and not self._port_lost():
                if self._healthy():
                    return self
                time.sleep(0.1)
            if not self._port_lost() or attempt + 1 == tries:
                break
            self._new_ports()
        tails = "\n".join(f"--- member {m.index}:\n{m.log_tail(10)}" for m in self.members)
        raise RuntimeError(f"etcd cluster not healthy in {timeout}s\n{tails}")

    def _port_lost(self) -> bool:
        return any(m.proc is not None and m.proc.poll() is not None and "address already in use" in m.log_tail(10)
                   for m in self.members)

    def _new_ports(self) -> None:
        """A new cluster on new ports: every member stopped, its data emptied (the data
        directory may be a mount point: only what is in it goes)."""
        for m in self.members:
            m.stop()
            data = os.path.join(m.dir, "data")
            for name in os.listdir(data) if os.path.isdir(data) else ():
                path = os.path.join(data, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
            m.port, m.peer_port, m.started_once = free_port(), free_port(), False
            open(os.path.join(m.dir, f"{m.name}.log"), "wb").close()   # the bind error is history now
        self.token = f"mw-{os.getpid()}-{int(time.time() * 1000)}"
        self.initial_cluster = ",".join(f"{m.member_name}={m.peer_url}" for m in self.members)

    def _healthy(self) -> bool:
        up = [m for m in self.members if m.proc is not None and not m.paused]
        sts = [m.status(0.5) for m in up]
        leaders = {st.get("leader") for st in sts if st}
        return bool(sts) and all(sts) and len(leaders) == 1 and "0" not in leaders

    def leader(self, timeout: float = 10.0) -> EtcdMember:
        """The current leader (asked of every running member until one names it)."""
        deadline = time.monotonic() + timeout
        while True:
            by_id = {}
            leader_id = None
            for m in self.members:
                if m.proc is None or m.paused:
                    continue
                st = m.status(0.5)
                if st:
                    by_id[st["header"]["member_id"]] = m
                    if st.get("leader") and st["leader"] != "0":
                        leader_id = st["leader"]
            if leader_id in by_id:
                return by_id[leader_id]
            if time.monotonic() > deadline:
                raise RuntimeError("etcd cluster has no leader")
            time.sleep(0.05)

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Wait until every running member answers and they agree on one leader."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._healthy():
                return
            time.sleep(0.1)
        tails = "\n".join(f"--- member {m.index}:\n{m.log_tail(10)}" for m in self.members)
        raise RuntimeError(f"etcd cluster not healthy in {timeout}s\n{tails}")

    def close(self) -> None:
        for m in self.members:
            m.stop()
        if self.own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()


class MosquittoServer(_Child):
    """A mosquitto broker on loopback with persistence (sessions survive restarts);
    optionally TLS (``tls``), passwords (``users``: name -> password, no anonymous) and an
    ACL file (``acl``: its text)."""

    name = "mosquitto"

    def __init__(self, workdir: Optional[str] = None, port: Optional[int] = None, extra_conf: str = "",
                 tls: Optional[TlsFiles] = None, users: Optional[dict] = None, acl: Optional[str] = None):
        super().__init__(workdir)
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.extra_conf = extra_conf
        self.tls = tls
        self.users = dict(users or {})
        self.acl = acl

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"

    def _security_conf(self) -> str:
        lines = []
        if self.tls:
            lines += [f"cafile {self.tls.ca}", f"certfile {self.tls.cert}", f"keyfile {self.tls.key}"]
        if self.users:
            pw = os.path.join(self.dir, "passwords")
            open(pw, "w").close()
            os.chmod(pw, 0o600)
            for user, password in self.users.items():
                subprocess.run(["mosquitto_passwd", "-b", pw, user, password], check=True, capture_output=True,
                               timeout=30)
            lines += ["allow_anonymous false", f"password_file {pw}"]
        else:
            lines.append("allow_anonymous true")
        if self.acl is not None:
            acl = os.path.join(self.dir, "acl")
            with open(acl, "w") as fh:
                fh.write(self.acl)
            lines.append(f"acl_file {acl}")
        return "".join(line + "\n" for line in lines)

    def _argv(self) -> list[str]:
        conf = os.path.join(self.dir, "mosquitto.conf")
        with open(conf, "w") as fh:
            fh.write(
                f"listener {self.port} {self.host}\n"
                # started as root, mosquitto would drop to user `mosquitto`, which cannot write
                # a 0700 temp dir: persistence (and so persistent sessions) would silently fail
                + ("user root\n" if os.geteuid() == 0 else "")
                + self._security_conf()
                + "persistence true\n"
                f"persistence_location {self.dir}/\n"
                "autosave_interval 1\n"
                "max_queued_messages 100000\n"
                "max_inflight_messages 100\n"
                "log_dest stdout\n"
                "log_type error\nlog_type warning\n"
                + self.extra_conf
            )
        return ["mosquitto", "-c", conf]

    def _ready(self, timeout: float) -> bool:
        return wait_port(self.host, self.port, timeout)


class AgentProcess:
    """A `millwright run` child process with its own config and state dirs."""

    def __init__(self, agent_id: str, base_dir: str, config: dict, python: Optional[str] = None,
                 env: Optional[dict] = None):
        import sys

        import yaml

        self.agent_id = agent_id
        self.dir = os.path.join(base_dir, agent_id)
        os.makedirs(self.dir, exist_ok=True)
        # the demo's and the tests' brokers are plain and anonymous on loopback: allowed only
        # with mqtt.insecure (a config that secures its broker connection keeps it false)
        cfg: dict[str, Any] = {"agent_id": agent_id, "state_dir": os.path.join(self.dir, "state"),
               "admin": {"socket": os.path.join(self.dir, "admin.sock")},
               "metrics": {"listen": ""}, "mqtt": {"insecure": True},
               "execute": {"runtime_dir": os.path.join(self.dir, "run")},   # not the host's /run
               "audit": {"dir": os.path.join(self.dir, "audit"), "key_file": os.path.join(self.dir, "audit.key")}}
        for k, v in config.items():
            if isinstance(v, dict) and isinstance(cfg.get(k), dict):
                cfg[k] = {**cfg[k], **v}
            else:
                cfg[k] = v
        self.config = cfg
        self.config_path = os.path.join(self.dir, "agent.yaml")
        # owner-only, as agent.yaml must be when it holds a password (agent/config.py)
        with open(os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
            os.fchmod(fh.fileno(), 0o600)
            yaml.safe_dump(cfg, fh)
        self.python = python or sys.executable
        self.env = env or {}
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = os.path.join(self.dir, "agent.log")

    def start(self) -> "AgentProcess":
        env = {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "PYTHONUNBUFFERED": "1", **self.env}
        self.logf = open(self.log_path, "ab")
        self.proc = spawn_dying_with_parent([self.python, "-m", "agent", "run", "-c", self.config_path],
                                            stdout=self.logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env)
        return self

    @property
    def pid(self) -> int:
        assert self.proc
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:   # it ended and was reaped (by a poll on another thread) meanwhile
                pass

    def kill(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            kids = self._descendants()
            self.signal(signal.SIGCONT)
            p.kill()
            p.wait()
            self._reap_adopted(kids)

    def _descendants(self) -> list[int]:
        import psutil

        try:
            return [c.pid for c in psutil.Process(self.pid).children(recursive=True)]
        except psutil.Error:
            return []

    @staticmethod
    def _reap_adopted(pids: list[int], wait_s: float = 5.0) -> None:
        """A kill -9 orphans the agent's guard and runs (the guard then ends them). If this
        process is a child subreaper (an Executor in the same process, e.g. in tests) they
        become our children: reap exactly those, or they stay zombies for the rest of our
        life. Orphans adopted by init raise ChildProcessError and are skipped at once."""
        deadline = time.monotonic() + wait_s
        for pid in pids:
            while True:
                try:
                    done, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    break
                if done == pid or time.monotonic() > deadline:
                    break
                time.sleep(0.02)

    def remove_cgroups(self, wait_s: float = 2.0) -> int:
        """After the agent is gone: remove the cgroup root it made for its runs (one per
        agent id and state dir, in every hierarchy) and its top-level run cgroups (cgroup
        v1 cpu), so test and demo clusters leave the host's cgroup trees as they found
        them. A kill -9 skips the agent's own cleanup; its runs die with their guard
        shortly after, so empty directories are retried for up to ``wait_s``. Returns how
        many directories were removed."""
        import glob

        from agent.execute.backends import run_root_name

        root = run_root_name(self.agent_id, self.config["state_dir"])
        tops = (glob.glob(f"/sys/fs/cgroup/{root}") + glob.glob(f"/sys/fs/cgroup/*/{root}")
                + glob.glob(f"/sys/fs/cgroup/*/{root}@*"))   # cgroup v1 cpu: top-level run cgroups
        removed, deadline = 0, time.monotonic() + wait_s
        while tops:
            left = []
            for top in tops:
                for d in sorted((w[0] for w in os.walk(top)), key=len, reverse=True):  # children first
                    try:
                        os.rmdir(d)
                        removed += 1
                    except FileNotFoundError:
                        pass
                    except OSError:
                        left.append(top)
                        break
            if not left or time.monotonic() > deadline:
                break
            tops = sorted(set(left))
            time.sleep(0.1)
        return removed

    def terminate(self, timeout: float = 30.0) -> Optional[int]:
        p = self.proc
        if p is None or p.poll() is not None:
            return p.returncode if p else None
        self.signal(signal.SIGCONT)
        p.terminate()
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            return p.wait()

    def log_text(self) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                return fh.read().decode(errors="replace")
        except OSError:
            return ""
