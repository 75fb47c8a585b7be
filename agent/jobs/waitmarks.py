"""Waiting marks: while a firing waits on a start policy (its window, a gate), its agent
keeps ``waiting/<NNNN>/<job_id>/<agent_id>`` in etcd (reason, detail, since), so `millwright
jobs show` and `jobs/get`, which read etcd alone, say what the job waits for. A mark is
bound to the agent's session lease (it goes when the agent does) and written without a
fence: it is shown, never believed; nothing decides from it.

Writes of one key are made one at a time, in order (loop thread; etcd calls on workers)."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Optional

from agent.runtime.timefmt import format_rfc3339, utcnow

if TYPE_CHECKING:
    from agent.coordination.keys import Keys
    from agent.coordination.worker import EtcdWorkers
    from agent.jobs.firing import Firing
    from agent.jobs.seams import Lease

log = logging.getLogger(__name__)


class EtcdWaitMarks:
    """Implements startpolicy.WaitMarks."""

    def __init__(self, client: Any, keys: Keys, lease: Lease, workers: EtcdWorkers, agent_id: str, shards: int):
        self.client = client
        self.keys = keys
        self.lease = lease
        self.workers = workers
        self.agent_id = agent_id
        self.shards = shards
        self.owner: dict[str, str] = {}            # key -> the firing (Firing.key) its mark is of
        self.want: dict[str, Optional[str]] = {}   # key -> the value to write (None: delete), not yet written
        self.busy: set[str] = set()

    def _key(self, f: Firing) -> str:
        return self.keys.waiting(f.entry.shard % self.shards, f.entry.job.id, self.agent_id)

    def waiting(self, f: Firing, reason: str, detail: str) -> None:
        key = self._key(f)
        self.owner[key] = f.key
        self.want[key] = json.dumps({"v": 1, "job_id": f.entry.job.id, "fire_id": f.fire_id, "attempt": f.attempt,
                                     "agent": self.agent_id, "reason": reason, "detail": detail,
                                     "since": format_rfc3339(utcnow())}, sort_keys=True)
        self._sync(key)

    def done(self, f: Firing) -> None:
        key = self._key(f)
        if self.owner.get(key) != f.key:
            return   # not its mark (another firing of the job waits now, or none was made)
        del self.owner[key]
        self.want[key] = None
        self._sync(key)

    def _sync(self, key: str) -> None:
        if key in self.busy or key not in self.want:
            return
        value = self.want.pop(key)
        lease = self.lease.lease_id
        if value is not None and not lease:
            return   # no session: nothing to bind it to (the next wait writes it)
        self.busy.add(key)

        def op() -> Any:
            return self.client.put(key, value, lease=lease) if value is not None else self.client.delete(key)

        def done(result: Any, error: Optional[BaseException]) -> None:
            self.busy.discard(key)
            if error is not None:
                log.debug("waiting mark not written", extra={"fields": {"key": key, "error": str(error)}})
            self._sync(key)

        self.workers.submit(op, done)
