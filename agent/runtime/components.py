"""The parts the daemon runs, in start order. Each factory takes the Agent and returns
an object with optional start()/stop(); parts register their hooks on the agent."""

from __future__ import annotations

from typing import Any, Callable

from agent.config import Config


def _admin(agent) -> Any:
    from agent.runtime.admin import AdminServer

    return AdminServer(agent, agent.cfg.admin.socket)


class _AuditComponent:
    """Opens the audit log first and closes it last, so every part's records land in it."""

    def __init__(self, agent):
        from agent.audit import AuditLog
        from agent.audit.events import describe_config

        self.agent = agent
        self.checkpoint_sinks: list[Callable[[dict], None]] = []
        agent.checkpoint_sinks = self.checkpoint_sinks
        agent.audit = AuditLog.from_config(agent.cfg.audit, agent_id=agent.cfg.agent_id,
                                           on_checkpoint=self._checkpoint)
        agent.audit.config(**describe_config(agent.cfg))

    def _checkpoint(self, doc: dict) -> None:  # writer thread: hand over, never block
        for sink in self.checkpoint_sinks:
            try:
                sink(doc)
            except Exception:
                pass

    def stop(self) -> None:
        self.agent.audit.close()


class _JobsComponent:
    """Executor (quotas), admission control and the scheduler that owns due firings."""

    def __init__(self, agent):
        import os
        import re

        from agent.execute.admission import Admission, Budget
        from agent.execute.executor import Executor
        from agent.jobs.scheduler import Scheduler

        # one cgroup root per agent id, so that several agents on one host (tests, demo)
        # never reclaim each other's runs
        root = "millwright-" + re.sub(r"[^A-Za-z0-9._-]", "_", agent.cfg.agent_id)[:50]
        self.executor = Executor.from_config(agent.cfg.execute, os.path.join(agent.cfg.state_dir, "runs"),
                                             root_name=root, reclaim=True)
        self.admission = Admission(Budget.from_config(agent.cfg.execute))
        self.scheduler = Scheduler(agent, self.executor, self.admission)
        agent.scheduler = self.scheduler
        agent.executor = self.executor
        agent.status_providers["quota"] = lambda: {"backend": self.executor.backend.name,
                                                   "why": self.executor.backend.why}

    def start(self) -> None:
        self.scheduler.workers.start()

    def start_watches(self):
        return self.scheduler.start_watches()

    def stop(self) -> None:
        self.scheduler.stop()
        self.executor.close()
        self.scheduler.workers.stop()


def _sensing(agent) -> Any:
    from agent.supervision.sensing import RunSensing

    return RunSensing(agent)


def _supervision(agent) -> Any:
    from agent.supervision.component import Supervision

    return Supervision(agent)


def default_components(cfg: Config) -> list[Callable[[Any], Any]]:
    from agent.cloud import cloud_component  # cloud channel (agent/cloud, docs/cloud.md)

    return [_AuditComponent, cloud_component, _admin, _JobsComponent, _sensing, _supervision]
