"""The MQTT topic names of the v1 contract, in one place (``<c>`` is the cluster)."""

from __future__ import annotations

import re

ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
# Statuses about a push whose id cannot be read (bad JSON, missing id) go here. Job ids never
# start with '.', so this topic can never be a job's own.
INVALID_ID = ".invalid"


class Topics:
    def __init__(self, cluster: str):
        self.base = f"millwright/{cluster}/"
        self.push = self.base + "jobs/push"
        self.cancel = self.base + "jobs/cancel"
        self.status_prefix = self.base + "status/"
        # jobs/get: requests; answers go to the reply topic the request names, under this prefix
        self.jobs_get = self.base + "jobs/get"
        self.get_reply_prefix = self.base + "jobs/get/reply/"

    def get_reply(self, correlation: str) -> str:
        """The default reply topic of a jobs/get request."""
        return self.get_reply_prefix + correlation

    def status(self, job_id: str | None) -> str:
        if not isinstance(job_id, str) or not ID_RE.fullmatch(job_id) or job_id.startswith("."):
            job_id = INVALID_ID
        return self.status_prefix + job_id

    def status_filter(self) -> str:
        return self.status_prefix + "+"

    def presence(self, agent_id: str) -> str:
        return f"{self.base}agents/{agent_id}/presence"

    def checkpoint(self, agent_id: str) -> str:
        return f"{self.base}agents/{agent_id}/audit/checkpoint"

    def kind(self, topic: str) -> str:
        """Bounded label for metrics: push, cancel, get, get_reply, status, presence, checkpoint, other."""
        if topic == self.push:
            return "push"
        if topic == self.cancel:
            return "cancel"
        if topic == self.jobs_get:
            return "get"
        if topic.startswith(self.get_reply_prefix):
            return "get_reply"
        if topic.startswith(self.status_prefix):
            return "status"
        if topic.endswith("/presence"):
            return "presence"
        if topic.endswith("/audit/checkpoint"):
            return "checkpoint"
        return "other"
