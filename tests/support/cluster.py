"""A cluster of real `millwright run` agent processes on one etcd, for multi-agent tests
and benchmarks: start agents, store signed jobs, read shard ownership, check the history."""

from __future__ import annotations

import collections
import json
import os
from typing import Any, Optional

from tests.support.cloudkit import SigningStore, write_keys
from agent.config import EtcdConfig, TLSConfig
from agent.coordination import hrw
from agent.coordination.etcd import EtcdClient
from agent.coordination.jobstore import JobStore
from agent.coordination.keys import Keys
from agent.demo.services import AgentProcess
from tests.support import history
from tests.support.jobs import effects_file, templates
from tests.support.records import agent_audit, agent_statuses, job_runs, run_records


def merge_sections(cfg: dict, extra: Optional[dict]) -> dict:
    """``cfg`` with ``extra``'s sections merged in (a dict section key by key, else replaced)."""
    for k, v in (extra or {}).items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    return cfg


class Cluster:
    """Agents of one cluster (``start``), their shared config, and a client of their etcd."""

    def __init__(self, etcd, base_dir: str, cluster: str = "t", shards: int = 64, ttl: int = 4,
                 renew_deadline: float = 2.5, retry_period: float = 0.5, extra: Optional[dict] = None,
                 env: Optional[dict] = None, etcd_access: Optional[dict] = None):
        """``etcd_access``: etcd settings for a secured server (tls, username, password),
        used by the agents (each may add its own user in ``start``'s extra) and by this
        helper's own client. Without it the agents reach the loopback etcd in plaintext
        and unauthenticated, which their config must allow explicitly (etcd.insecure)."""
        self.etcd = etcd
        self.base = base_dir
        self.cluster = cluster
        self.keys = Keys(cluster)
        self.ttl = ttl
        self.cfg = {"cluster": cluster, "shards": shards,
                    "etcd": {"endpoints": [etcd.endpoint], "lease_ttl_s": ttl, "renew_deadline_s": renew_deadline,
                             "retry_period_s": retry_period, "request_timeout_s": 1.0},
                    # the tests' loopback brokers are plain and anonymous (a secured one sets
                    # its own mqtt keys: tests/integration/test_secure_transport.py)
                    "mqtt": {"insecure": True},
                    # BPF costs ~2 s of CPU per agent start; tests that need it enable it
                    "bpf": {"enabled": False},
                    # the self-fence kill must fit before the lease can expire (config check)
                    "execute": {"kill_grace_s": round(max(0.1, min(1.0, ttl - renew_deadline - 0.5)), 3)},
                    # history checks replay etcd from revision 1: no compaction unless a test asks
                    "retention": {"compact_interval_s": 0}}
        merge_sections(self.cfg, extra)
        # every agent verifies stored jobs against this ring; tests write through self.signing(store)
        # (in a directory of its own, never one a template names: hiding.py)
        os.makedirs(os.path.join(base_dir, "signing"), exist_ok=True)
        self.keys_file = os.path.join(base_dir, "signing", "keys.yaml")
        self.ring = write_keys(self.keys_file)
        self.cfg.setdefault("signing", {"keys_file": self.keys_file})
        self.env = env or {}
        self.agents: dict[str, AgentProcess] = {}
        access = dict(etcd_access or {})
        if etcd_access is None:
            self.cfg["etcd"]["insecure"] = True
        self.cfg["etcd"].update(access)
        if "tls" in access:
            access["tls"] = TLSConfig(**access["tls"])
        self.client = EtcdClient(EtcdConfig(endpoints=[etcd.endpoint], request_timeout_s=2.0, **access))
        self.shards = shards

    def signing(self, store: Any) -> SigningStore:
        """``store`` wrapped so that create() binds and signs for this cluster."""
        return SigningStore(store, self.ring, self.cluster)

    def job_store(self, writer: str = "test") -> SigningStore:
        """The job store of this cluster's etcd, signing what it creates (as the cloud would)."""
        return self.signing(JobStore(self.client, self.keys, self.shards, writer))

    def agent_config(self, extra: Optional[dict] = None) -> dict:
        """A copy of the agents' shared config with ``extra``'s sections merged in."""
        return merge_sections(json.loads(json.dumps(self.cfg)), extra)

    def start(self, agent_id: str, capacity: float = 1.0, endpoint_host: Optional[str] = None,
              extra: Optional[dict] = None) -> AgentProcess:
        """Start agent ``agent_id`` (a `millwright run` process) with this cluster's config."""
        cfg = self.agent_config()
        cfg["capacity"] = capacity
        if endpoint_host:
            cfg["etcd"]["endpoints"] = [self.etcd.endpoint_on(endpoint_host)]
        merge_sections(cfg, extra)
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
        return self.owners() == hrw.assignment(self.shards, capacities)

    def run_records(self) -> dict[tuple[str, str], dict]:
        """Every run record in etcd: (job_id, fire_id) -> record."""
        return run_records(self.client, self.keys)

    def job_runs(self, job_id: str) -> dict[str, dict]:
        """The run records of one job: fire_id -> record, oldest firing first."""
        return job_runs(self.client, self.keys, self.shards, job_id)

    def audit(self, *agent_ids: str) -> list[dict]:
        """The audit records of these agents (default: every agent started), agent by agent."""
        return [r for a in agent_ids or list(self.agents) for r in agent_audit(self.agents[a])]

    def statuses(self, *agent_ids: str) -> list[dict]:
        """The status documents in these agents' outboxes (default: every agent started)."""
        return [d for a in agent_ids or list(self.agents) for d in agent_statuses(self.agents[a])]

    def members(self) -> set[str]:
        kvs, _ = self.client.get_prefix(self.keys.members_prefix())
        return {kv.key.rsplit("/", 1)[1] for kv in kvs}

    def close(self) -> None:
        for a in self.agents.values():
            a.kill()
        for a in self.agents.values():
            a.remove_cgroups()  # the host's cgroup trees as we found them
        self.client.close()


# room for many recording runs at once (tests/support/jobs.py), and a quick kill of a run
RECORDING_EXECUTE = {"max_concurrent": 64, "memory_mb": 16384, "cpu": 64.0, "kill_grace_s": 1.0}


def recording_cluster(etcd_server: Any, tmp_path: Any, extra: Optional[dict] = None,
                      **kw: Any) -> tuple[Cluster, str]:
    """A cluster whose agents run the side-effect recording templates (tests/support/jobs.py)
    with room for many runs at once, and the effects file their runs append to. ``extra``
    config sections are merged over those; ``kw`` goes to Cluster."""
    out = effects_file(tmp_path)
    cfg = merge_sections({"templates": templates(out), "execute": dict(RECORDING_EXECUTE)}, extra)
    c = Cluster(etcd_server, str(tmp_path / "agents"), ttl=4, renew_deadline=2.5, retry_period=0.5, extra=cfg, **kw)
    return c, out


def check_history(client: EtcdClient, keys: Keys) -> dict:
    """Replay the whole history with the strict checker (tests/support/history.py): a
    shard key only changes owner through a delete; every fenced write (the daemon's test
    probes and every run record) was made by the holder of the shard at that revision;
    one running record per attempt. The test's etcd holds only this cluster, so a missing
    revision is a gap and fails."""
    rep = history.check(history.read_history(client, keys.prefix, contiguous=True), keys.prefix)
    return {"problems": rep.problems, **rep.stats}
