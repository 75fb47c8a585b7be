"""Writes to the status outbox that outlive a failing state disk.

The loop's statuses, the answers' republications and the audit checkpoints all go into the
outbox through :class:`OutboxWriter`. When SQLite refuses a write (disk full, I/O error,
read-only file system, database locked), the documents are held in memory, in order, and
written again by a retry on the event loop (``min_backoff_s`` doubling to ``max_backoff_s``);
while anything is held, later documents queue behind it, so the outbox gets them in the
order they were produced. Writing never raises into its callers.

Bounded: at most ``outbox.max_rows`` documents are held, with the outbox's own
``outbox_full_policy``; what the bound drops is counted and reported like the outbox's own
drops (millwright_mqtt_outbox_dropped_total, an audit ``gap`` with reason
``outbox_full:<policy>``, aggregated by :meth:`flush_gap`). The outbox's coalescing of
superseded statuses (its ``on_coalesce``: :meth:`coalesced`) is reported the same way, as a
``gap`` record with reason ``coalesced``. An outage is one warning and
one audit record (``mqtt``/``outbox_write_failed``) when it starts, one line and one
record (``mqtt``/``outbox_write_recovered``) when what was held is written; each failed
attempt counts in millwright_mqtt_outbox_write_errors_total{error}, the documents held in
millwright_mqtt_outbox_held. A clean stop tries once more (:meth:`close`) and logs what
is still held, which is then lost.

Held documents are kept as JSON text (a dict per status costs several times its text) and
their answer markers are counted, so the answers' sweep sees them as this agent's, still
on their way (:meth:`has_marker`).
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import threading
import time
from typing import Callable, Optional

from agent.runtime.metrics import gauge

from .outbox import DROPPED, WRITE_ERRORS, WRITE_FAILURES, Outbox, error_kind, keep_state

log = logging.getLogger(__name__)

HELD = gauge("millwright_mqtt_outbox_held", "Status documents held in memory because the outbox cannot be written")

Item = tuple[str, dict, Optional[str]]   # (topic, document, answer marker)
CHUNK = 1000   # held documents written per retry turn, so one turn never holds the loop long


class OutboxWriter:
    """Any thread writes; the retry runs where ``schedule`` puts it (the event loop)."""

    def __init__(self, outbox: Outbox, *, schedule: Callable[[float, Callable[[], None]], None],
                 record: Callable[..., None], min_backoff_s: float = 0.5, max_backoff_s: float = 30.0):
        self.outbox = outbox
        self.schedule = schedule        # (delay_s, fn): run fn later; callable from any thread
        self.record = record            # audit record; callable from any thread
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self._lock = threading.Lock()
        # invariant: while anything is held, nothing is written past it
        self._held: dict[int, tuple[str, bytes, Optional[str]]] = {}   # insertion order = write order
        self._light: collections.deque[int] = collections.deque()      # held keys the policy drops first
        self._markers: collections.Counter[str] = collections.Counter()
        self._keys = itertools.count()
        self._outage: Optional[dict] = None   # while failing: error, since, attempts, written, dropped
        self._backoff = min_backoff_s
        self._closed = False
        self._gap = 0
        self._coalesced = 0
        self._gap_lock = threading.Lock()

    # --- writers (any thread) ------------------------------------------------------
    def write(self, items: list[Item]) -> None:
        """Into the outbox, in order, in one transaction; held in memory while it fails."""
        if not items:
            return
        with self._lock:
            if self._closed:
                log.info("status outbox closed: documents after the stop not written",
                         extra={"fields": {"count": len(items)}})
                return
            if self._outage is None:
                try:
                    self.outbox.enqueue_many(items)
                    return
                except WRITE_FAILURES as exc:
                    self._outage_starts(exc)
            for item in items:
                self._hold(item)
            HELD.set(len(self._held))

    def has_marker(self, marker: str) -> bool:
        """Whether this answer is still on its way from here (held, or in the outbox)."""
        with self._lock:
            if self._markers[marker]:
                return True
        return self.outbox.has_marker(marker)

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def failing(self) -> bool:
        return self._outage is not None

    # --- the retry (event loop) -----------------------------------------------------
    def retry(self) -> None:
        """Write what is held, oldest first, a chunk per turn; again later if it fails."""
        with self._lock:
            if self._closed or self._outage is None:
                return
            if self._write_held(CHUNK):
                if self._held:
                    self.schedule(0.0, self.retry)   # the next chunk, after what waits on the loop
                else:
                    self._outage_ends()
                return
            self._backoff = min(self.max_backoff_s, self._backoff * 2)
            self.schedule(self._backoff, self.retry)

    def close(self) -> int:
        """A clean stop: what is held is tried once more; returns how many are lost."""
        with self._lock:
            if self._closed:
                return len(self._held)
            self._closed = True
            if self._outage is not None and self._write_held(len(self._held)):
                self._outage_ends()
            left = len(self._held)
            outage = self._outage
        if left and outage is not None:
            log.warning("status outbox still cannot be written at stop: held statuses are lost",
                        extra={"fields": {"count": left, "error": outage["error"], "path": self.outbox.path}})
        return left

    # --- what is lost (the outbox's drops and the bound's) --------------------------------
    def dropped(self, n: int, policy: str) -> None:
        """The outbox's ``on_drop``, and the bound's drops: reported by :meth:`flush_gap`."""
        with self._gap_lock:
            self._gap += n

    def coalesced(self, n: int) -> None:
        """The outbox's ``on_coalesce``: reported by :meth:`flush_gap`."""
        with self._gap_lock:
            self._coalesced += n

    def flush_gap(self) -> None:
        """The publisher's tick (at most once a second): the drops since the last one, as one
        warning and one ``gap`` record; the coalesced statuses as one ``gap`` record."""
        with self._gap_lock:
            n, self._gap = self._gap, 0
            c, self._coalesced = self._coalesced, 0
        if c:
            log.info("status outbox behind: superseded intermediate statuses coalesced",
                     extra={"fields": {"coalesced": c, "depth": self.outbox.depth}})
            self.record("gap", source="mqtt_outbox", count=c, reason="coalesced")
        if n:
            policy = self.outbox.policy
            log.warning("status outbox full: documents dropped", extra={"fields": {"dropped": n, "policy": policy}})
            self.record("gap", source="mqtt_outbox", count=n, reason=f"outbox_full:{policy}")

    # --- under _lock ------------------------------------------------------------------------
    def _hold(self, item: Item) -> None:
        topic, doc, marker = item
        if len(self._held) >= self.outbox.max_rows:
            if self.outbox.policy == "reject_new":
                self._lose(1)
                return
            self._forget(self._victim())
            self._lose(1)
        key = next(self._keys)
        self._held[key] = (topic, json.dumps(doc, separators=(",", ":"), ensure_ascii=False,
                                             default=str).encode(), marker)
        if not keep_state(doc):
            self._light.append(key)
        if marker is not None:
            self._markers[marker] += 1

    def _victim(self) -> int:
        """The held document the policy drops: drop_oldest_terminal the oldest intermediate
        status while there is one, otherwise (and drop_oldest) the oldest document."""
        if self.outbox.policy == "drop_oldest_terminal":
            while self._light:
                key = self._light.popleft()
                if key in self._held:
                    return key
        return next(iter(self._held))

    def _forget(self, key: int) -> None:
        marker = self._held.pop(key)[2]
        if marker is not None:
            self._markers[marker] -= 1
            if not self._markers[marker]:
                del self._markers[marker]
        # keys leave in order or from the front of _light, so stale keys are at its front
        while self._light and self._light[0] not in self._held:
            self._light.popleft()

    def _lose(self, n: int) -> None:
        DROPPED.labels(self.outbox.policy).inc(n)
        if self._outage is not None:
            self._outage["dropped"] += n
        self.dropped(n, self.outbox.policy)

    def _write_held(self, limit: int) -> bool:
        """The oldest ``limit`` held documents in one transaction; False if it failed."""
        assert self._outage is not None
        keys = list(itertools.islice(self._held, limit))
        items = [(topic, json.loads(body), marker) for topic, body, marker in (self._held[k] for k in keys)]
        self._outage["attempts"] += 1
        try:
            self.outbox.enqueue_many(items)
        except WRITE_FAILURES as exc:
            WRITE_ERRORS.labels(error_kind(exc)).inc()
            log.debug("status outbox still cannot be written", extra={"fields": {"error": str(exc)[:200],
                                                                                  "held": len(self._held)}})
            return False
        for k in keys:
            self._forget(k)
        self._outage["written"] += len(keys)
        HELD.set(len(self._held))
        return True

    def _outage_starts(self, exc: BaseException) -> None:
        kind = error_kind(exc)
        WRITE_ERRORS.labels(kind).inc()
        self._outage = {"error": kind, "since": time.monotonic(), "attempts": 1, "written": 0, "dropped": 0}
        self._backoff = self.min_backoff_s
        detail = str(exc)[:200]
        log.warning("status outbox cannot be written: statuses are held in memory and written when it can be",
                    extra={"fields": {"error": kind, "detail": detail, "path": self.outbox.path,
                                      "hold_max": self.outbox.max_rows, "policy": self.outbox.policy}})
        self.record("mqtt", event="outbox_write_failed", error=kind, detail=detail, path=self.outbox.path)
        self.schedule(self._backoff, self.retry)

    def _outage_ends(self) -> None:
        o, self._outage = self._outage, None
        assert o is not None
        HELD.set(0)
        fields = {"error": o["error"], "written": o["written"], "dropped": o["dropped"], "attempts": o["attempts"],
                  "outage_s": round(time.monotonic() - o["since"], 1)}
        log.info("status outbox writable again: held statuses written", extra={"fields": fields})
        self.record("mqtt", event="outbox_write_recovered", **fields)
