"""Staged-rollout fleets for tests and benchmarks: line-1 agents (processes) whose `fw`
template records its side effect (tests/jobs/effect.sh) and fails on chosen agents, and the
fan-out jobs they run."""

from __future__ import annotations

import os
import pathlib
from typing import Optional

from agent.jobs import rollout as ro
from agent.jobs.schedule import format_rfc3339
from tests.support.cluster import Cluster
from tests.support.jobs import JOBS, effects_file, now

EFFECT = os.path.join(JOBS, "effect.sh")


def fw_templates(out: str, agent: str, fails: bool, slow: bool = False) -> dict:
    """`fw` records its side effect as ``agent`` and fails (exit 3) where ``fails`` (runs 60 s
    where ``slow``); its rollback `fw-undo` records one and succeeds."""
    base = {"params": {"sleep": r"^[0-9.]+$"}, "user": "root", "allow_root": True,
            "allow_exec": ["/bin/*", "/usr/bin/*", EFFECT]}
    sleep = "60" if slow else "{sleep}"
    return {"fw": {**base, "argv": [EFFECT, out, agent, sleep, "2" if fails else "0"], "rollback": "fw-undo"},
            "fw-undo": {**base, "argv": [EFFECT, out, agent, "0", "0"]}}


class Fleet:
    """Line-1 agents (processes) of one cluster whose `fw` template fails on ``failing``."""

    def __init__(self, etcd, tmp_path, failing=(), mqtt_url: str = "mqtt://127.0.0.1:9", extra=None, slow=(),
                 etcd_access: Optional[dict] = None):
        tmp_path = pathlib.Path(tmp_path)
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.out = effects_file(tmp_path)
        self.failing, self.slow = set(failing), set(slow)
        self.c = Cluster(etcd, str(tmp_path / "agents"), shards=4, ttl=4, renew_deadline=2.5, retry_period=0.5,
                         extra={"mqtt": {"url": mqtt_url, "reconnect_min_s": 0.2, "reconnect_max_s": 1.0},
                                "execute": {"max_concurrent": 4, "memory_mb": 4096, "cpu": 8.0, "kill_grace_s": 1.0},
                                **(extra or {})}, etcd_access=etcd_access)
        self.store = self.c.job_store()

    def start(self, agent: str, **extra: dict) -> None:
        self.c.start(agent, extra={**extra, "labels": {"line": "1"},
                                   "templates": fw_templates(self.out, agent, agent in self.failing,
                                                             agent in self.slow)})

    def push(self, job_id: str, rollout: Optional[dict], sleep: str = "2", **extra) -> dict:
        doc = {"v": 1, "id": job_id, "template": "fw", "params": {"sleep": sleep}, "schedule": {},
               "issued_at": format_rfc3339(now()), "target": {"labels": {"line": "1"}, "fanout": True},
               **({"rollout": rollout} if rollout is not None else {}), **extra}
        self.store.create(doc)
        return doc

    def records(self, job_id: str) -> dict[str, dict]:
        return self.c.job_runs(job_id)

    def finals(self, job_id: str) -> dict[str, dict]:
        """agent -> its main firing's record, once final."""
        return {r["agent"]: r for fid, r in self.records(job_id).items()
                if ro.rolled_back(fid) is None and r["state"] not in ("running", "retrying")}

    def close(self) -> None:
        self.c.close()


def running_at_once(effects: list, died: dict) -> int:
    """The most side effects of the job's main firing that ran at the same time, on their
    own clock (a run killed before its end line ends when its process was seen gone,
    ``died[agent]``; else it lasts until the end of the log)."""
    edges = []
    for se in effects:
        end = se.end if se.end is not None else died.get(se.agent, float("inf"))
        edges += [(se.start, 1), (end, -1)]
    most = cur = 0
    for _, d in sorted(edges, key=lambda x: (x[0], x[1])):
        cur += d
        most = max(most, cur)
    return most


