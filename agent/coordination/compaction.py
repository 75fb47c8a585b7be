"""etcd history compaction by one agent: the holder of shard 0.

etcd keeps every revision until it is compacted; run records rewritten a few times per
firing make that history grow by ~1 GB a month for 500 cron jobs at 1/min (see
docs/operations.md), and etcd refuses all writes once its space quota is reached.
Holding shard 0 is already a leased, fenced election, so no second election is needed:
its owner compacts every ``retention.compact_interval_s`` to the revision it saw one
interval earlier, which keeps at least one interval of history for watches to resume
from. Two agents compacting at a hand-over is harmless (etcd refuses an older revision;
the client treats that as done). Compaction frees pages inside the DB file; giving the
space back to the file system needs a defragmentation, an operator step
(docs/operations.md).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from agent.coordination.worker import EtcdWorkers
from agent.runtime.metrics import counter, gauge

if TYPE_CHECKING:
    from agent.config import Config
    from agent.coordination.etcd import EtcdClient
    from agent.coordination.ownership import Ownership
    from agent.runtime.loop import EventLoop, Timer

log = logging.getLogger(__name__)

COMPACTIONS = counter("millwright_etcd_compactions_total", "History compactions run by this agent", ("result",))
COMPACTED_REV = gauge("millwright_etcd_compacted_revision", "Revision this agent last compacted to")
DB_SIZE = gauge("millwright_etcd_db_size_bytes", "etcd DB size reported by the member this agent talks to")

ELECTION_SHARD = 0


class Compactor:
    """Daemon component (loop thread); the etcd calls run on its own thread. It compacts
    only while ``ownership`` gives it shard 0's fence."""

    def __init__(self, cfg: Config, loop: EventLoop, client: EtcdClient, ownership: Ownership):
        self.loop = loop
        self.client = client
        self.ownership = ownership
        self.interval = cfg.retention.compact_interval_s
        self.workers = EtcdWorkers(loop.post, threads=1, name="compaction")
        self._timer: Optional[Timer] = None
        self._seen: Optional[int] = None   # revision read at the previous tick
        self._busy = False
        self._started = False
        self.last: Optional[dict] = None

    def status(self) -> Optional[dict]:
        """The last compaction that did something (None before the first)."""
        return self.last

    def start(self) -> None:
        self._started = True
        self.workers.start()
        if self.interval > 0:
            self._timer = self.loop.call_later(self.interval, self._tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._started:
            self.workers.stop()

    def _tick(self) -> None:
        self._timer = self.loop.call_later(self.interval, self._tick)
        if self._busy:
            return
        if self.ownership.fence_for(ELECTION_SHARD) is None:
            self._seen = None  # start over when we hold it again
            return
        target = self._seen
        self._busy = True
        self.workers.submit(lambda: self._compact(target), self._done)

    def _compact(self, target: Optional[int]) -> dict:
        st = self.client.status()
        if target:
            self.client.compact(target)
        return {"compacted_to": target, "revision": st["revision"], "db_size": st["db_size"]}

    def _done(self, result: Optional[dict], error: Optional[BaseException]) -> None:
        self._busy = False
        if error is not None:
            COMPACTIONS.labels("error").inc()
            log.warning("etcd compaction failed", extra={"fields": {"error": str(error)}})
            return
        assert result is not None
        DB_SIZE.set(result["db_size"])
        self._seen = result["revision"]
        if result["compacted_to"]:
            COMPACTIONS.labels("ok").inc()
            COMPACTED_REV.set(result["compacted_to"])
            self.last = result
            log.info("etcd history compacted", extra={"fields": result})
