"""Every MQTT topic name of the contract, in one place (``<c>`` is the cluster).

Agents publish only under their own prefix ``millwright/<c>/agents/<agent_id>/`` (their
statuses, rejections, presence, audit checkpoints and jobs/get answers), so a broker ACL
(agent/cloud/broker.py, packaging/debian/examples/mosquitto-acl.conf) lets an agent write
its own and nobody else's. The cloud reads ``millwright/<c>/agents/+/status/+``.

Nothing outside this module builds a topic string: other code asks a :class:`Topics`.
"""

from __future__ import annotations

import re
from typing import Optional

ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
# Statuses about a push whose id cannot be read (bad JSON, missing id) go here. Job ids never
# start with '.', so this topic can never be a job's own.
INVALID_ID = ".invalid"


def _job_segment(job_id: Optional[str]) -> str:
    if not isinstance(job_id, str) or not ID_RE.fullmatch(job_id) or job_id.startswith("."):
        return INVALID_ID
    return job_id


class Topics:
    """Topic names for one cluster; ``agent_id`` is the publishing agent (None for the
    cloud side: the CLI, the demo's console, test collectors)."""

    def __init__(self, cluster: str, agent_id: Optional[str] = None):
        self.cluster = cluster
        self.agent_id = agent_id
        self.base = f"millwright/{cluster}/"
        self.push = self.base + "jobs/push"
        self.cancel = self.base + "jobs/cancel"
        self.agents_prefix = self.base + "agents/"
        # jobs/get: signed requests; each agent answers under its own prefix (get_reply)
        self.jobs_get = self.base + "jobs/get"

    # --- what an agent publishes (its own prefix) ---------------------------------------
    def agent_prefix(self, agent_id: Optional[str] = None) -> str:
        agent = agent_id or self.agent_id
        if not agent:
            raise ValueError("an agent topic needs an agent id")
        return f"{self.agents_prefix}{agent}/"

    def status(self, job_id: Optional[str], agent_id: Optional[str] = None) -> str:
        """The status topic of ``job_id`` as published by ``agent_id`` (default: this agent)."""
        return self.agent_prefix(agent_id) + "status/" + _job_segment(job_id)

    def rejections(self, agent_id: Optional[str] = None) -> str:
        """Where an agent reports documents that failed authentication or binding: reason
        only, never on a job's own status topic (their job id is not to be believed)."""
        return self.agent_prefix(agent_id) + "rejected"

    def presence(self, agent_id: Optional[str] = None) -> str:
        return self.agent_prefix(agent_id) + "presence"

    def checkpoint(self, agent_id: Optional[str] = None) -> str:
        return self.agent_prefix(agent_id) + "audit/checkpoint"

    def get_reply(self, correlation: str, agent_id: Optional[str] = None) -> str:
        """Where ``agent_id`` answers the jobs/get request ``correlation``: never a topic
        the requester names."""
        return self.agent_prefix(agent_id) + "get/" + correlation

    # --- what the cloud subscribes to -----------------------------------------------------
    def status_filter(self) -> str:
        """Every agent's statuses of every job."""
        return self.agents_prefix + "+/status/+"

    def job_status_filter(self, job_id: Optional[str]) -> str:
        """Statuses of one job, from whichever agent answers."""
        return self.agents_prefix + "+/status/" + _job_segment(job_id)

    def rejections_filter(self) -> str:
        return self.agents_prefix + "+/rejected"

    def presence_filter(self) -> str:
        return self.agents_prefix + "+/presence"

    def get_reply_filter(self, correlation: Optional[str] = None) -> str:
        """Every agent's answers to one jobs/get request (or to all of them)."""
        return self.agents_prefix + "+/get/" + (correlation or "+")

    def agent_of(self, topic: str) -> Optional[str]:
        """The agent id of a topic under agents/<id>/, else None."""
        if not topic.startswith(self.agents_prefix):
            return None
        agent, sep, _ = topic[len(self.agents_prefix):].partition("/")
        return agent if sep and agent else None

    def kind(self, topic: str) -> str:
        """Bounded label for metrics: push, cancel, get, get_reply, status, rejected, presence,
        checkpoint, other."""
        if topic == self.push:
            return "push"
        if topic == self.cancel:
            return "cancel"
        if topic == self.jobs_get:
            return "get"
        if topic.startswith(self.agents_prefix):
            rest = topic[len(self.agents_prefix):].split("/", 1)[-1]
            if rest.startswith("status/"):
                return "status"
            if rest.startswith("get/"):
                return "get_reply"
            if rest == "rejected":
                return "rejected"
            if rest == "presence":
                return "presence"
            if rest == "audit/checkpoint":
                return "checkpoint"
        return "other"
