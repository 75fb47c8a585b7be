"""ClaimLead: claim as late as the measured claim latency allows, within its bounds."""

from __future__ import annotations

import pytest

from agent.jobs.claimlead import LEAD, MARGIN, ClaimLead
from tests.support.fakes import ManualClock


def test_starts_at_the_ceiling_then_follows_a_margin_over_the_worst_recent_latency():
    clock = ManualClock()
    c = ClaimLead(0.25, floor_s=0.02, half_life_s=30, clock=clock)
    assert c.lead() == 0.25                      # nothing measured yet: be generous
    clock.t += 600                               # long after: the initial guess has decayed
    c.observe(0.004)
    assert c.lead() == pytest.approx(0.02)       # the floor
    c.observe(0.04)
    assert c.lead() == pytest.approx(MARGIN * 0.04) and LEAD._value.get() == pytest.approx(MARGIN * 0.04)
    c.observe(0.01)                              # a fast one does not shrink it at once
    assert c.lead() == pytest.approx(MARGIN * 0.04)
    clock.t += 30                                # one half-life later
    assert c.lead() == pytest.approx(MARGIN * 0.02)
    c.observe(0.5)                               # a stall: capped at the ceiling
    assert c.lead() == 0.25


def test_zero_ceiling_means_claim_at_the_due_time():
    c = ClaimLead(0.0)
    c.observe(0.3)
    assert c.lead() == 0.0
