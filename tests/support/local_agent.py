"""The daemon's own Daemon on a thread of the test process, so a test can wrap one of its
parts' methods at the point a fault is injected while etcd (and the agent's runs) stay real."""

from __future__ import annotations

import threading
from typing import Any, Callable

from agent.config import load_config
from agent.demo.services import AgentProcess
from agent.execute.backends import run_root_name
from agent.daemon.core import Daemon
from agent.daemon.wiring import SupervisedJobs, build
from tests.support.cluster import Cluster
from tests.support.jobs import effects_file, templates


class LocalAgent:
    """The Daemon, with the parts `millwright run` gives it, on a thread here. Its config is
    the one a Cluster's agent process gets (AgentProcess writes it; that process is never
    started). ``ownership`` is what every part asks which shards it may act for: a test
    that makes a shard look lost patches its ``fence_for``."""

    def __init__(self, cluster: Cluster, agent_id: str, extra: dict):
        self.files = AgentProcess(agent_id, cluster.base, cluster.agent_config(extra))   # config file and cgroup cleanup only
        self.cfg = load_config(self.files.config_path)
        self.agent = Daemon(self.cfg, build)
        self.ownership = self.agent.ownership
        jobs = next(c.jobs for c in self.agent.components if isinstance(c, SupervisedJobs))
        self.executor, self.scheduler = jobs.executor, jobs.scheduler
        self.cgroup_root = run_root_name(agent_id, self.cfg.state_dir)
        self.thread = threading.Thread(target=self.agent.run, name=f"agent-{agent_id}", daemon=True)

    def start(self) -> "LocalAgent":
        self.thread.start()
        return self

    def on_loop(self, fn: Callable[[], Any]) -> Any:
        """fn() on the agent's loop thread (where the scheduler's state lives); its result."""
        out: list = []
        done = threading.Event()

        def run():
            try:
                out.append((fn(), None))
            except BaseException as exc:  # noqa: B036 - handed to the test thread
                out.append((None, exc))
            finally:
                done.set()

        self.agent.loop.post(run)
        assert done.wait(10), "the agent's loop did not answer"
        result, exc = out[0]
        if exc is not None:
            raise exc
        return result

    def reaper_idle(self) -> None:
        """Wait until the executor's reaper thread has done everything posted to it so far
        (an unstage() is such a post)."""
        done = threading.Event()
        self.executor.reaper.post(done.set)
        assert done.wait(10), "the executor's reaper did not answer"

    def stop(self) -> None:
        if self.thread.is_alive():
            self.agent.request_stop()
            self.thread.join(30)
        self.files.remove_cgroups()


# the agent fences itself RENEW_S after etcd stopped answering; the run guard's kill
# (kill_grace_s) must fit in TTL_S - RENEW_S - 0.5 (config check)
TTL_S, RENEW_S, KILL_GRACE_S = 3, 1.5, 0.5


def recording_agent(etcd_server: Any, tmp_path: Any, agent_id: str, quota_backend: str) -> tuple[Cluster, LocalAgent, str]:
    """A 4-shard cluster for one local agent (not started) that runs the side-effect
    recording templates (tests/support/jobs.py) on ``quota_backend``: (cluster, agent,
    effects file)."""
    out = effects_file(tmp_path)
    c = Cluster(etcd_server, str(tmp_path / "agents"), shards=4, ttl=TTL_S, renew_deadline=RENEW_S,
                retry_period=0.3)
    la = LocalAgent(c, agent_id, {"templates": templates(out), "mqtt": {"url": "mqtt://127.0.0.1:9"},
                                  "execute": {"quota_backend": quota_backend, "kill_grace_s": KILL_GRACE_S}})
    assert la.executor.backend.name == quota_backend
    return c, la, out


def abandoned(caplog: Any, job_id: str) -> list[str]:
    """Why the scheduler gave up the job's firings (its debug log), in order."""
    return [r.fields["why"] for r in caplog.records
            if r.getMessage() == "firing abandoned" and getattr(r, "fields", {}).get("job") == job_id]
