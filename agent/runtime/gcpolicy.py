"""Keeps Python's cyclic garbage collector off the due times.

A full (generation 2) collection walks every tracked object and holds the GIL while it
does: with 10,000 jobs loaded that is 100-150 ms on a 2-core gateway, and whatever
falls due meanwhile starts that much late (measured with bench/bench_trigger.py). Job
entries are long-lived by nature, so:

- after state was installed in bulk (a shard loaded, jobs stored), the loop calls
  :meth:`GcPolicy.settle`; shortly after, everything alive is frozen (``gc.freeze``):
  moved to the permanent generation that collections skip. Later collections only walk
  what was allocated since, and stay short.
- what was frozen is never collected, so cyclic garbage among it would stay. Every
  ``full_every_s`` the policy unfreezes and runs one full collection, at a moment when
  nothing falls due for ``gap_s`` (asked of ``quiet_for``), then freezes again. A node
  that is never quiet gets it anyway after ``max_wait_s``.

Objects freed by reference counting (nearly all of them) are freed at once either way;
only reference cycles wait for the periodic full collection.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any, Callable, Optional

from agent.runtime.metrics import counter, histogram

log = logging.getLogger(__name__)

FREEZES = counter("millwright_gc_freezes_total", "Long-lived objects moved out of the collector's reach")
FULL = histogram("millwright_gc_full_collection_seconds", "Periodic full collections (in quiet gaps)",
                 buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5))


class GcPolicy:
    def __init__(self, loop: Any, quiet_for: Callable[[], Optional[float]], *, settle_s: float = 1.0,
                 full_every_s: float = 600.0, gap_s: float = 0.5, max_wait_s: float = 1800.0):
        """``quiet_for()``: seconds until the next thing falls due (None: nothing is due)."""
        self.loop = loop
        self.quiet_for = quiet_for
        self.settle_s = settle_s
        self.full_every_s = full_every_s
        self.gap_s = gap_s
        self.max_wait_s = max_wait_s
        self._freeze_timer: Any = None
        self._full_timer: Any = None
        self._full_due = 0.0

    def start(self) -> "GcPolicy":
        self._full_due = time.monotonic() + self.full_every_s
        self._full_timer = self.loop.call_later(self.full_every_s, self._full)
        return self

    def stop(self) -> None:
        for t in (self._freeze_timer, self._full_timer):
            if t is not None:
                t.cancel()
        self._freeze_timer = self._full_timer = None

    def settle(self) -> None:
        """Loop thread: long-lived state was just installed; freeze it soon (coalesced)."""
        if self._freeze_timer is None:
            self._freeze_timer = self.loop.call_later(self.settle_s, self._freeze)

    def _freeze(self) -> None:
        self._freeze_timer = None
        gc.freeze()
        FREEZES.inc()

    def _full(self) -> None:
        quiet = self.quiet_for()
        overdue = time.monotonic() - self._full_due > self.max_wait_s
        if quiet is not None and quiet < self.gap_s and not overdue:
            self._full_timer = self.loop.call_later(0.25, self._full)
            return
        t0 = time.perf_counter()
        gc.unfreeze()
        found = gc.collect()
        gc.freeze()
        took = time.perf_counter() - t0
        FULL.observe(took)
        log.debug("full garbage collection", extra={"fields": {"unreachable": found, "seconds": round(took, 4),
                                                               "overdue": overdue}})
        self._full_due = time.monotonic() + self.full_every_s
        self._full_timer = self.loop.call_later(self.full_every_s, self._full)
