"""How far ahead of a due time a firing is claimed.

Claiming ahead takes the etcd write and the spawn off the due time (see agent/jobs/scheduler.py),
but it has a price: a firing claimed ahead whose agent dies before the due time leaves a
`running` record that its new owner must treat as "may have run" (retry policy, or
`owner_lost`). So the lead is as short as the agent can afford: three times the recent worst
time from the claim timer's planned moment to the prepared process, at least ``floor_s``
and at most ``execute.claim_lead_s``. The worst case decays with a half-life, so one slow
moment (an etcd fsync stall, a burst of cron firings) widens the lead for a while, not
for ever. Until the first measurement the lead is the ceiling.
"""

from __future__ import annotations

import time
from typing import Callable

from agent.runtime.metrics import gauge

MARGIN = 3.0   # lead = MARGIN x the recent worst claim latency
LEAD = gauge("millwright_claim_lead_seconds", "How far ahead of due times firings are claimed now")


class ClaimLead:
    def __init__(self, ceiling_s: float, *, floor_s: float = 0.05, half_life_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.ceiling_s = ceiling_s
        self.floor_s = min(floor_s, ceiling_s)
        self.half_life_s = half_life_s
        self.clock = clock
        self._worst = ceiling_s / 2
        self._at = clock()
        LEAD.set(self.lead())

    def _decayed(self) -> float:
        now = self.clock()
        return self._worst * 0.5 ** (max(0.0, now - self._at) / self.half_life_s)

    def lead(self) -> float:
        """Seconds ahead to claim now (0 when claiming ahead is off)."""
        if self.ceiling_s <= 0:
            return 0.0
        return min(self.ceiling_s, max(self.floor_s, MARGIN * self._decayed()))

    def observe(self, took_s: float) -> None:
        """A claim timer's planned moment to its prepared process took ``took_s``."""
        self._worst = max(took_s, self._decayed())
        self._at = self.clock()
        LEAD.set(self.lead())
