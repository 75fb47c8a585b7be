"""Helpers for multi-agent tests: start agents, read ownership, check etcd history."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import time
from typing import Callable, Optional

from agent.coordination.etcd import EtcdClient
from agent.config import EtcdConfig
from agent.coordination.keys import Keys
from agent.demo.services import AgentProcess
from tests.support import history


def wait_for(pred: Callable[[], object], timeout: float, interval: float = 0.02, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class Cluster:
    def __init__(self, etcd, base_dir: str, cluster: str = "t", shards: int = 64, ttl: int = 4,
                 renew_deadline: float = 2.5, retry_period: float = 0.5, extra: Optional[dict] = None,
                 env: Optional[dict] = None, etcd_access: Optional[dict] = None):
        """``etcd_access``: etcd settings for a secured server (tls, username, password,
        insecure), used by the agents and by this helper's own client."""
        self.etcd = etcd
        self.base = base_dir
        self.cluster = cluster
        self.keys = Keys(cluster)
        self.ttl = ttl
        self.cfg = {"cluster": cluster, "shards": shards,
                    "etcd": {"endpoints": [etcd.endpoint], "lease_ttl_s": ttl, "renew_deadline_s": renew_deadline,
                             "retry_period_s": retry_period, "request_timeout_s": 1.0},
                    # BPF costs ~2 s of CPU per agent start; tests that need it enable it
                    "bpf": {"enabled": False},
                    # the self-fence kill must fit before the lease can expire (config check)
                    "execute": {"kill_grace_s": round(max(0.1, min(1.0, ttl - renew_deadline - 0.5)), 3)},
                    # history checks replay etcd from revision 1: no compaction unless a test asks
                    "retention": {"compact_interval_s": 0}}
        for k, v in (extra or {}).items():
            self.cfg[k] = {**self.cfg.get(k, {}), **v} if isinstance(v, dict) else v
        # every agent verifies stored jobs against this ring; tests write through self.signing(store)
        from tests.support import cloudkit as testkit

        os.makedirs(base_dir, exist_ok=True)
        self.keys_file = os.path.join(base_dir, "keys.yaml")
        self.ring = testkit.write_keys(self.keys_file)
        self.cfg.setdefault("signing", {"keys_file": self.keys_file})
        self.env = env or {}
        self.agents: dict[str, AgentProcess] = {}
        access = dict(etcd_access or {})
        self.cfg["etcd"].update(access)
        if "tls" in access:
            from agent.config import TLSConfig

            access["tls"] = TLSConfig(**access["tls"])
        self.client = EtcdClient(EtcdConfig(endpoints=[etcd.endpoint], request_timeout_s=2.0, **access))
        self.shards = shards

    def signing(self, store):
        """``store`` wrapped so that create() binds and signs for this cluster."""
        from tests.support.cloudkit import SigningStore

        return SigningStore(store, self.ring, self.cluster)

    def start(self, agent_id: str, capacity: float = 1.0, endpoint_host: Optional[str] = None,
              extra: Optional[dict] = None) -> AgentProcess:
        cfg = json.loads(json.dumps(self.cfg))
        cfg["capacity"] = capacity
        if endpoint_host:
            cfg["etcd"]["endpoints"] = [self.etcd.endpoint_on(endpoint_host)]
        for k, v in (extra or {}).items():
            cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
        a = AgentProcess(agent_id, self.base, cfg, env=self.env).start()
        self.agents[agent_id] = a
        return a

    def owners(self) -> dict[int, str]:
        kvs, _ = self.client.get_prefix(self.keys.shards_prefix())
        return {self.keys.shard_number(kv.key): kv.value.decode() for kv in kvs}

    def counts(self) -> collections.Counter:
        return collections.Counter(self.owners().values())

    def all_owned_by(self, agents: set[str]) -> bool:
        o = self.owners()
        return len(o) == self.shards and set(o.values()) <= agents

    def converged(self, capacities: dict[str, float]) -> bool:
        """Ownership equals the bounded-load rendezvous plan for these members."""
        from agent.coordination import hrw

        return self.owners() == hrw.assignment(self.shards, capacities)

    def members(self) -> set[str]:
        kvs, _ = self.client.get_prefix(self.keys.members_prefix())
        return {kv.key.rsplit("/", 1)[1] for kv in kvs}

    def close(self) -> None:
        for a in self.agents.values():
            a.kill()
        for a in self.agents.values():
            a.remove_cgroups()  # the host's cgroup trees as we found them
        self.client.close()


def recording_cluster(etcd_server, tmp_path) -> tuple["Cluster", str]:
    """A cluster whose agents run the side-effect recording templates (tests/support/jobs.py)
    with room for many runs at once, and the effects file their runs append to."""
    from tests.support.jobs import templates

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    os.chmod(out_dir, 0o777)
    out = str(out_dir / "effects.txt")
    c = Cluster(etcd_server, str(tmp_path / "agents"), ttl=4, renew_deadline=2.5, retry_period=0.5,
                extra={"templates": templates(out), "execute": {"max_concurrent": 64, "memory_mb": 16384, "cpu": 64.0,
                                                                "kill_grace_s": 1.0}})
    return c, out


class _KV:
    __slots__ = ("key", "value", "mod_revision", "create_revision", "version")

    def __init__(self, e):
        self.key, self.value = e.key.encode(), e.value
        self.mod_revision, self.create_revision, self.version = e.rev, e.create_rev, e.version


class _Ev:
    """An event shaped like etcd's (type 0 put / 1 delete, kv.*) for the older callers."""

    __slots__ = ("type", "kv")

    def __init__(self, e):
        self.type = 1 if e.kind == "delete" else 0
        self.kv = _KV(e)


def etcd_history(client: EtcdClient, prefix: str) -> list:
    """Every event under prefix since revision 1, complete or an AssertionError
    (tests/support/history.py read_history: an error, a compaction or an incomplete
    stream fails the test instead of returning what arrived)."""
    return [_Ev(e) for e in history.read_history(client, prefix)]


def check_history(client: EtcdClient, keys: Keys) -> dict:
    """Replay the whole history with the strict checker (tests/support/history.py): a
    shard key only changes owner through a delete; every fenced write (the daemon's test
    probes and every run record) was made by the holder of the shard at that revision;
    one running record per attempt. The test's etcd holds only this cluster, so a missing
    revision is a gap and fails."""
    rep = history.check(history.read_history(client, keys.prefix, contiguous=True), keys.prefix)
    return {"problems": rep.problems, **rep.stats}


class NftBlock:
    """Drop TCP traffic to and from one loopback address:port, in a table of our own.

    Dropped in the input hook: the sender's transmit succeeds and the segment is lost
    on the way in, as on a real broken link, so the kernel retransmits (tcp_retransmit_skb,
    RetransSegs). Dropping in the output hook fails the transmit locally instead and the
    kernel counts no retransmit at all."""

    def __init__(self, addr: str, port: int):
        self.table = f"mw_test_{os.getpid()}_{port}"
        self.addr, self.port = addr, port
        self.active = False

    def __enter__(self):
        rules = f"""
table inet {self.table} {{
  chain inp {{ type filter hook input priority -10; policy accept;
    ip daddr {self.addr} tcp dport {self.port} drop
    ip saddr {self.addr} tcp sport {self.port} drop
  }}
}}"""
        subprocess.run(["nft", "-f", "-"], input=rules.encode(), check=True)
        self.active = True
        return self

    def remove(self):
        if self.active:
            subprocess.run(["nft", "delete", "table", "inet", self.table], check=False)
            self.active = False

    def __exit__(self, *exc):
        self.remove()
