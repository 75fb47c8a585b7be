"""Load-aware placement (agent/coordination/loadshed.py): an agent whose loop stays late
publishes less weight, one step at a time and never below the floor, only while a peer has
headroom; it takes the weight back after a long quiet; a burst, or a lag between the bounds,
moves nothing; and the plan moves about the shed shards only."""

from __future__ import annotations

import json

from agent.coordination import hrw
from agent.coordination.loadshed import LoadShedding


def run(policy: LoadShedding, lag: float, seconds: int, start: float, headroom: bool = True) -> tuple[float, list]:
    """One sample a second; (the time after, the changes as (t, weight, overloaded))."""
    changes = []
    t = start
    for _ in range(seconds):
        if policy.observe(lag, t, headroom):
            changes.append((t, policy.weight, policy.overloaded))
        t += 1.0
    return t, changes


def test_a_loop_that_stays_late_sheds_weight_step_by_step_down_to_the_floor():
    p = LoadShedding()
    t, changes = run(p, 2.0, 120, 0.0)
    assert changes[0] == (p.sustain_s, 0.5, True)            # overloaded for sustain_s: one step
    steps = [(at, w) for at, w, _ in changes]
    assert steps == [(10.0, 0.5), (40.0, 0.25)]              # the next after hold_s; then the floor
    assert p.record() == {"lag_s": 2.0, "overloaded": True, "weight": 0.25}


def test_a_burst_or_a_lag_between_the_bounds_moves_nothing():
    p = LoadShedding()
    t, changes = run(p, 2.0, int(p.sustain_s) - 1, 0.0)
    t, more = run(p, 0.2, 300, t)                             # above low_s, below high_s
    assert changes == more == [] and p.weight == 1.0


def test_no_peer_with_headroom_keeps_the_shards_but_says_overloaded():
    p = LoadShedding()
    _, changes = run(p, 2.0, 60, 0.0, headroom=False)
    assert changes == [(10.0, 1.0, True)] and p.weight == 1.0


def test_the_weight_comes_back_after_a_long_quiet_one_step_at_a_time():
    p = LoadShedding()
    t, _ = run(p, 2.0, 60, 0.0)
    assert p.weight == 0.25
    t, changes = run(p, 0.01, 200, t)
    assert changes[0][2] is False and changes[0][1] == 0.25   # first: no longer overloaded
    weights = [w for _, w, _ in changes[1:]]
    assert weights == [0.5, 1.0]
    ups = [at for at, _, _ in changes[1:]]
    assert ups[0] - t + 200 >= p.recover_s and ups[1] - ups[0] >= p.hold_s


def test_a_lighter_member_holds_fewer_shards_and_mostly_only_those_move():
    names = ["gw-a", "gw-b", "gw-c"]
    before = hrw.assignment(64, dict.fromkeys(names, 1.0))
    after = hrw.assignment(64, {"gw-a": 0.5, "gw-b": 1.0, "gw-c": 1.0})
    held = [sum(1 for s in range(64) if plan[s] == "gw-a") for plan in (before, after)]
    moved = sum(1 for s in range(64) if before[s] != after[s])
    assert held[1] < held[0]
    assert moved <= 2 * (held[0] - held[1]), json.dumps({"held": held, "moved": moved})
