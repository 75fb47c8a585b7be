"""A firing with ``depends_on`` starts only once every dependency's newest run succeeded;
until then it waits (state `waiting`, reason `dependencies`) and looks again."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable, Optional

from agent.coordination.keys import Keys, shard_of
from agent.jobs import schedule as sch
from agent.jobs.firing import Firing, FiringState
from agent.jobs.states import JobState, RecordState
from agent.runtime.timefmt import utcnow

if TYPE_CHECKING:
    from agent.coordination.worker import EtcdWorkers
    from agent.jobs.catalog import JobEntry
    from agent.jobs.statuses import Statuses
    from agent.runtime.loop import EventLoop

RECHECK_S = 1.0


def read_states(client: Any, keys: Keys, shards: int, deps: list[str]) -> dict[str, Optional[str]]:
    """{dependency: state of its newest run record, None without one} (blocking: a worker
    thread). One key per dependency, never a prefix read: the latest/ copy of its newest
    record; for records written before latest/ existed, the last key of its runs prefix."""
    states: dict[str, Optional[str]] = {}
    for dep in deps:
        s = shard_of(dep, shards)
        kv = client.get(keys.latest(s, dep)) or client.get_last(keys.runs_prefix(s, dep))
        latest = json.loads(kv.value) if kv is not None else None
        states[dep] = latest.get("state") if latest else None
    return states


class DependencyCheck:
    def __init__(self, client: Any, keys: Keys, shards: int, loop: EventLoop, workers: EtcdWorkers,
                 statuses: Statuses, is_current: Callable[[JobEntry], bool]):
        self.client = client
        self.keys = keys
        self.shards = shards
        self.loop = loop
        self.workers = workers
        self.statuses = statuses
        self.is_current = is_current

    def check(self, f: Firing, ready: Callable[[Firing], None], expired: Callable[[Firing], None]) -> None:
        """``ready(f)`` once every dependency succeeded, ``expired(f)`` if the job expires
        first; until then the firing waits and this looks again every RECHECK_S."""
        deps = list(f.entry.job.depends_on)

        def done(states: Any, error: Optional[BaseException]) -> None:
            if f.state == FiringState.DONE or not self.is_current(f.entry):
                return
            if error is None and all(v == RecordState.SUCCEEDED for v in states.values()):
                ready(f)
                return
            if sch.is_expired(f.entry.job, utcnow()):
                expired(f)
                return
            if f.wait_reason != "dependencies":
                f.move(FiringState.WAITING, wait_reason="dependencies")
                pending = sorted(k for k, v in (states or {}).items() if v != RecordState.SUCCEEDED)
                self.statuses.send(f.entry, f, JobState.WAITING, reason="dependencies", waiting_for=pending)
            f.timer = self.loop.call_later(RECHECK_S, self.check, f, ready, expired)

        self.workers.submit(lambda: read_states(self.client, self.keys, self.shards, deps), done)
