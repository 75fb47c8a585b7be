"""What a demo run produced: the scenario fills a :class:`DemoResult`, the report
(agent/demo/report.py) checks it against the invariants and prints the summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Optional

from agent.demo.plan import DemoJob


@dataclass
class Failover:
    """The kill of one agent and how its shards moved (times in seconds after the kill)."""

    victim: str
    kill_wall: datetime
    kill_mono: float                    # time.monotonic() at the kill
    shards: list[int]                   # the victim's shards at the kill
    future: int                         # firings still due on them
    running: list[str]                  # jobs it had a run of in progress
    pools: dict[str, list[int]] = field(default_factory=dict)  # pool -> the victim's shards of it
    expired_s: Optional[float] = None   # its lease gone
    done_s: Optional[float] = None      # all its shards owned by survivors
    taken: dict[str, int] = field(default_factory=dict)        # survivor -> shards it took
    pools_done_s: Optional[float] = None


@dataclass
class DemoResult:
    jobs: list[DemoJob]
    records: dict[tuple[str, str], dict]   # (job id, fire id) -> run record, read after the job phase
    statuses: list[dict]                   # what the cloud received; grows until the agents stopped
    effects_log: str                       # the side-effect lines the job scripts append
    agent_dirs: dict[str, str]             # agent -> its directory (audit/ inside)
    config_paths: dict[str, str]           # agent -> its agent.yaml
    metrics_ports: dict[str, int]
    templates: dict
    kill_at: float                         # seconds into the job phase
    failover: Failover
    sensor_mode: Optional[str]             # of the first survivor, from `millwright status`
    notes: list[str]                       # printed as "note" lines
    findings: list[str]                    # printed as "not yet" lines: what the product does not show
    gate_opened: Optional[datetime] = None  # when line 1 reported stopped (spindle-check's gate opened)

    @property
    def victim(self) -> str:
        return self.failover.victim
