"""The agent's etcd session: one lease and the adapter thread that keeps it alive.

Follows client-go leaderelection's bounds (lease TTL > renew deadline > retry period):
the session is *valid* only until `renew_deadline` after the send time of the last
successful keepalive. The server restarted the TTL no earlier than that send time, so
the agent stops acting at least TTL - renew_deadline before anyone else can take over.
The thread only posts events; the loop owns every decision.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from agent.coordination.etcd import EtcdClient, EtcdError, EtcdUnavailable
from agent.runtime.metrics import counter, gauge, histogram

log = logging.getLogger(__name__)

RENEWALS = counter("millwright_lease_renewals_total", "Lease keepalives by result", ("result",))
TTL_REMAINING = gauge("millwright_lease_ttl_remaining_seconds", "Server-side lease TTL at the last renewal")
VALID_FOR = gauge("millwright_session_valid_remaining_seconds", "Time left before the agent self-fences")
KEEPALIVE_LATENCY = histogram("millwright_lease_keepalive_latency_seconds", "Keepalive round trip",
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))


class Session:
    """Lease lifecycle in an adapter thread. Callbacks are posted to the loop:

    on_granted(lease_id, ttl, valid_until), on_renewed(lease_id, ttl, valid_until, latency),
    on_failed(error: str), on_lost(lease_id)  (the server says the lease is gone).
    """

    def __init__(self, client: EtcdClient, ttl: int, renew_deadline_s: float, retry_period_s: float,
                 post: Callable, on_granted: Callable, on_renewed: Callable, on_failed: Callable,
                 on_lost: Callable, clock: Callable[[], float] = time.monotonic):
        self.client = client
        self.ttl = ttl
        self.renew_deadline_s = renew_deadline_s
        self.retry_period_s = retry_period_s
        self.interval_s = retry_period_s  # the lease policy may shorten it
        self.post = post
        self.on_granted, self.on_renewed, self.on_failed, self.on_lost = on_granted, on_renewed, on_failed, on_lost
        self.clock = clock
        self.lease_id: Optional[int] = None
        self.valid_until = 0.0  # monotonic; readable from any thread
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._abandon: Optional[int] = None
        self.abandoned: set[int] = set()  # our old leases whose revoke has not succeeded yet
        self._revoke_not_before = 0.0     # monotonic: abandoned leases are revoked from then
        # called on THIS thread with each new valid_until (e.g. the run guard's deadman: it
        # must hear of renewals even when the loop is stalled or the agent frozen)
        self.validity_listeners: list[Callable[[float], None]] = []
        self._thread: Optional[threading.Thread] = None

    def is_valid(self) -> bool:
        return self.lease_id is not None and self.clock() < self.valid_until

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="session", daemon=True)
        self._thread.start()

    def set_interval(self, seconds: float) -> None:
        """How long the thread waits between keepalives from the next one on (the lease
        policy's adaptive renewal)."""
        self.interval_s = seconds

    def renew_now(self) -> None:
        """Send the next keepalive now instead of after the interval."""
        self._wake.set()

    def abandon(self, revoke_after_s: float = 0.0) -> None:
        """Give up the current lease (after a self-fence) and open a new one. The old lease
        is revoked (freeing its keys before the TTL) no sooner than ``revoke_after_s`` from
        now: the runs claimed under it must be dead before anyone can take its shards."""
        self._abandon = self.lease_id
        self._revoke_not_before = max(self._revoke_not_before, self.clock() + revoke_after_s)
        self.valid_until = 0.0
        self._wake.set()

    def stop(self, revoke: bool) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(5)
        if revoke and self.lease_id is not None:
            try:
                self.client.lease_revoke(self.lease_id)
                log.info("lease revoked", extra={"fields": {"lease": f"{self.lease_id:x}"}})
            except (EtcdUnavailable, EtcdError) as exc:
                log.warning("lease revoke failed; it expires by itself",
                            extra={"fields": {"lease": f"{self.lease_id:x}", "error": str(exc)}})
        self.lease_id = None
        self.valid_until = 0.0

    def _tell_validity(self) -> None:
        for fn in self.validity_listeners:
            try:
                fn(self.valid_until)
            except Exception:
                log.exception("validity listener failed")

    def _sleep(self, seconds: float) -> None:
        self._wake.wait(max(0.0, seconds))
        self._wake.clear()

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            if self._abandon is not None:
                old, self._abandon = self._abandon, None
                if old == self.lease_id:
                    self.lease_id = None
                    self.abandoned.add(old)
            # Revoke leases we gave up: frees their member and shard keys at once instead of
            # after the TTL (which etcd restarts from scratch when it restarts itself).
            for old in list(self.abandoned if self.clock() >= self._revoke_not_before else ()):
                try:
                    self.client.lease_revoke(old, timeout=min(1.0, self.client.timeout))
                    self.abandoned.discard(old)
                except (EtcdUnavailable, EtcdError):
                    break
            t0 = self.clock()
            try:
                if self.lease_id is None:
                    lease_id, ttl = self.client.lease_grant(self.ttl)
                    self.lease_id = lease_id
                    self.valid_until = t0 + self.renew_deadline_s
                    self._tell_validity()
                    failures = 0
                    RENEWALS.labels("granted").inc()
                    self.post(self.on_granted, lease_id, ttl, self.valid_until)
                else:
                    lease_id = self.lease_id
                    timeout = max(0.2, min(self.client.timeout, self.valid_until - t0))
                    ttl = self.client.lease_keepalive(lease_id, timeout=timeout)
                    latency = self.clock() - t0
                    KEEPALIVE_LATENCY.observe(latency)
                    if ttl <= 0:
                        RENEWALS.labels("lost").inc()
                        self.lease_id = None
                        self.valid_until = 0.0
                        self.post(self.on_lost, lease_id)
                        continue
                    if self._abandon is None and lease_id == self.lease_id:
                        self.valid_until = t0 + self.renew_deadline_s
                        self._tell_validity()
                    failures = 0
                    RENEWALS.labels("ok").inc()
                    TTL_REMAINING.set(ttl)
                    self.post(self.on_renewed, lease_id, ttl, self.valid_until, latency)
            except (EtcdUnavailable, EtcdError) as exc:
                failures += 1
                RENEWALS.labels("failed").inc()
                self.post(self.on_failed, str(exc))
                self._sleep(min(self.interval_s, 0.25 * 2 ** min(failures, 3)))
                continue
            VALID_FOR.set(max(0.0, self.valid_until - self.clock()))
            self._sleep(self.interval_s - (self.clock() - t0))
