"""Cluster quotas on stored job documents: how many, and how many bytes (``quotas``).

The owner of each cluster shard keeps usage/<shard> = {jobs, bytes} for the documents of
its storage shard (agent/jobs/catalog.py: counted at load, then from the jobs watch, and
written fenced at most once a second). Ingest sums those keys, read again at most every
``refresh_s``, adds the documents it stored itself since, and refuses a push that would
pass a quota (``quota_exceeded``). So a quota can be passed by at most what the other
agents store between two refreshes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable, Optional

from agent.coordination.keys import Keys
from agent.runtime.metrics import counter

log = logging.getLogger(__name__)

READ_ERRORS = counter("millwright_quota_read_errors_total", "Reads of the cluster's usage that failed")

MB = 1024 * 1024


class ClusterQuota:
    """Thread-safe: ingest checks from its own threads."""

    def __init__(self, client: Any, keys: Keys, max_jobs: int, max_mb: int, refresh_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic):
        self.client = client
        self.keys = keys
        self.max_jobs = max_jobs
        self.max_bytes = max_mb * MB
        self.refresh_s = refresh_s
        self.clock = clock
        self._lock = threading.Lock()
        self._read_at: Optional[float] = None
        self._jobs = 0          # as published by the shard owners at the last read
        self._bytes = 0
        self._mine = [0, 0]     # stored by this agent since that read

    def check(self, nbytes: int) -> Optional[str]:
        """Why storing one more document of ``nbytes`` would pass a quota, or None."""
        with self._lock:
            self._refresh()
            jobs, used = self._jobs + self._mine[0], self._bytes + self._mine[1]
        if jobs + 1 > self.max_jobs:
            return f"the cluster stores {jobs} job documents; quotas.jobs is {self.max_jobs}"
        if used + nbytes > self.max_bytes:
            return (f"the cluster's job documents take {used / MB:.1f} MB; this one ({nbytes} bytes) would pass "
                    f"quotas.stored_mb ({self.max_bytes // MB})")
        return None

    def stored(self, nbytes: int) -> None:
        """This agent stored a new document of ``nbytes``."""
        with self._lock:
            self._mine[0] += 1
            self._mine[1] += nbytes

    def _refresh(self) -> None:
        now = self.clock()
        if self._read_at is not None and now - self._read_at < self.refresh_s:
            return
        try:
            kvs, _ = self.client.get_prefix(self.keys.usage_prefix())
        except Exception as exc:   # etcd unreachable: keep the last figures (ingest will fail anyway)
            READ_ERRORS.inc()
            log.debug("cluster usage not read", extra={"fields": {"error": str(exc)}})
            return
        jobs = used = 0
        for kv in kvs:
            try:
                u = json.loads(kv.value)
                jobs += max(0, int(u.get("jobs", 0)))
                used += max(0, int(u.get("bytes", 0)))
            except (ValueError, TypeError, AttributeError):
                continue
        self._jobs, self._bytes, self._mine, self._read_at = jobs, used, [0, 0], now
