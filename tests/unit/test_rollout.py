"""Staged rollouts as pure logic (agent/jobs/rollout.py): the document's ``rollout``, what a
firing's keys say, and what an agent may do with its own firing. Forged keys only hold
agents back (docs/security.md)."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from agent.coordination.etcd import KV
from agent.jobs import rollout as ro
from agent.jobs.envelope import JobRejected
from agent.jobs.schedule import fire_id

FANOUT = {"labels": {"line": "1"}, "fanout": True}
DUE = datetime(2026, 12, 2, 12, 0, tzinfo=timezone.utc)
BASE = fire_id("j", DUE)
T0 = DUE.timestamp()


def spec(**rollout) -> ro.RolloutSpec:
    out = ro.parse_rollout({"rollout": rollout}, FANOUT)
    assert out is not None
    return out


def kv(rel: str, doc, version: int = 1, lease: int = 0, rev: int = 10) -> KV:
    return KV("x/" + rel, json.dumps(doc).encode() if not isinstance(doc, bytes) else doc, rev, rev + version - 1,
              version, lease)


def rollout_of(*items) -> tuple[ro.JobRollout, ro.FiringRollout]:
    jr = ro.JobRollout()
    for rel, doc, *more in items:
        jr.put(rel, kv(rel, doc, *more))
    return jr, jr.firing(BASE)


def start(k: int, agent: str, at: float) -> tuple:
    return (f"{BASE}/starts/{k:06d}", {"agent": agent, "fire_id": f"{BASE}@{agent}", "at": at})


def outcome(agent: str, state: str, version: int = 1) -> tuple:
    return (f"{BASE}/outcomes/{agent}", {"agent": agent, "fire_id": f"{BASE}@{agent}", "state": state}, version)


def slot(i: int, agent: str, lease: int = 0) -> tuple:
    return (f"{BASE}/slots/{i}", {"agent": agent, "fire_id": f"{BASE}@{agent}"}, 1, lease)


# --- the document -----------------------------------------------------------------------------

@pytest.mark.parametrize("doc, target, field", [
    ({"rollout": {"max_concurrent": 2}}, {"labels": {"line": "1"}}, "rollout"),
    ({"rollout": {"max_concurrent": 2}}, None, "rollout"),
    ({"rollout": {}}, FANOUT, "rollout"),
    ({"rollout": {"max_concurrent": 0}}, FANOUT, "rollout.max_concurrent"),
    ({"rollout": {"max_concurrent": 2.0}}, FANOUT, "rollout.max_concurrent"),
    ({"rollout": {"per_minute": 0}}, FANOUT, "rollout.per_minute"),
    ({"rollout": {"growth": {"factor": 2, "after_succeeded": 1}, "max_concurrent": 1}}, FANOUT, "rollout.growth"),
    ({"rollout": {"per_minute": 6, "growth": {"factor": 6, "after_succeeded": 1}}}, FANOUT, "rollout.growth.factor"),
    ({"rollout": {"per_minute": 6, "growth": {"factor": 2}}}, FANOUT, "rollout.growth.after_succeeded"),
    ({"rollout": {"abort": {"min_finished": 3}}}, FANOUT, "rollout.abort.failed_pct"),
    ({"rollout": {"abort": {"failed_pct": 101}}}, FANOUT, "rollout.abort.failed_pct"),
    ({"rollout": {"abort": {"failed_pct": 30, "on": ["failed", "failed"]}}}, FANOUT, "rollout.abort.on"),
    ({"rollout": {"abort": {"failed_pct": 30, "on": ["oom"]}}}, FANOUT, "rollout.abort.on[0]"),
    ({"rollout": {"max_concurrent": 1, "window": 3}}, FANOUT, "rollout.window"),
    ({"rollout": {"max_concurrent": 1}, "abort_action": "kill"}, FANOUT, "abort_action"),
    ({"abort_action": "stop"}, FANOUT, "abort_action"),
])
def test_a_bad_rollout_is_refused_naming_its_field(doc, target, field):
    with pytest.raises(JobRejected) as err:
        ro.parse_rollout(doc, target)
    assert err.value.reason == "bad_field" and err.value.field == field, err.value.detail


def test_a_rollout_reads_with_its_defaults():
    s = ro.parse_rollout({"rollout": {"max_concurrent": 2, "per_minute": 6, "growth": {"factor": 2, "after_succeeded": 3},
                                      "abort": {"failed_pct": 30, "min_finished": 4, "on": ["timed_out", "failed"]}},
                          "abort_action": "stop"}, FANOUT)
    assert s == ro.RolloutSpec(2, 6.0, 2.0, 3, 30.0, 4, ("failed", "timed_out"), "stop")
    assert spec(abort={"failed_pct": 10}) == ro.RolloutSpec(failed_pct=10.0)
    assert ro.parse_rollout({}, FANOUT) is None


# --- what the keys say ------------------------------------------------------------------------

def test_the_tally_believes_an_outcome_created_once_and_counts_any_other_as_a_failure():
    s = spec(abort={"failed_pct": 50, "min_finished": 2})
    _, fr = rollout_of(start(0, "a", T0), start(1, "b", T0), start(2, "c", T0),
                       outcome("a", "succeeded"), outcome("b", "succeeded", version=2), outcome("c", "aborted"),
                       outcome("d", "succeeded"))
    t = ro.tally(s, fr)
    # b's success was rewritten after its creation: a failure; c never ran; d never started
    assert t == ro.Tally(started=3, finished=3, failed=1, succeeded=1)


def test_a_start_key_naming_another_firing_is_a_start_of_no_agent():
    _, fr = rollout_of((f"{BASE}/starts/000000", {"agent": "a", "fire_id": "other@a", "at": T0}))
    assert fr.starts[0].agent is None


@pytest.mark.parametrize("finished, failed, expect", [(3, 3, False), (4, 1, False), (4, 2, True), (10, 3, True),
                                                       (10, 2, False)])
def test_the_abort_threshold_needs_the_minimum_finished_and_the_failed_share(finished, failed, expect):
    s = spec(abort={"failed_pct": 30, "min_finished": 4})
    assert ro.crossed(s, ro.Tally(finished, finished, failed, finished - failed)) is expect


def test_starts_are_spaced_by_the_rate_and_the_rate_grows_with_successes():
    s = spec(per_minute=6, growth={"factor": 2, "after_succeeded": 2})
    _, fr = rollout_of()
    assert ro.next_start_at(s, fr, 0) == T0
    _, fr = rollout_of(start(0, "a", T0 + 1))
    assert ro.next_start_at(s, fr, 0) == T0 + 11
    assert ro.next_start_at(s, fr, 1) == T0 + 11
    assert ro.next_start_at(s, fr, 2) == T0 + 6       # 12/min
    assert ro.next_start_at(s, fr, 4) == T0 + 3.5     # 24/min
    assert ro.rate(s, 10_000_000) == ro.MAX_PER_MINUTE


def test_a_start_key_with_an_early_time_moves_no_start_forward():
    s = spec(per_minute=6)
    _, fr = rollout_of(start(0, "a", T0), start(1, "forged", T0 - 3600), start(2, "forged2", 0.0))
    # three starts: the next comes no earlier than 3 spacings after the due time
    assert ro.next_start_at(s, fr, 0) == T0 + 30
    _, fr = rollout_of(start(0, "a", T0 + 500))   # a time ahead only holds agents back
    assert ro.next_start_at(s, fr, 0) == T0 + 510


# --- deciding --------------------------------------------------------------------------------

def test_an_agent_takes_a_free_slot_and_with_a_rate_the_next_start():
    jr, fr = rollout_of(start(0, "a", T0), slot(0, "a", lease=7))
    assert ro.decide(spec(max_concurrent=2), jr, fr, "b", 9, T0 + 1) == ro.Decision("try", slot=1)
    assert ro.decide(spec(max_concurrent=2, per_minute=60), jr, fr, "b", 9, T0 + 1) == \
        ro.Decision("try", slot=1, start=1)
    assert ro.decide(spec(abort={"failed_pct": 10}), jr, fr, "b", 9, T0) == ro.Decision("try")
    assert ro.decide(spec(per_minute=60), jr, fr, "a", 7, T0) == ro.Decision("go")
    assert 0 <= ro.stagger("b", BASE) <= ro.STAGGER_S


def test_every_slot_key_counts_as_taken_whoever_wrote_it():
    s = spec(max_concurrent=2)
    jr, fr = rollout_of(slot(0, "nobody"), (f"{BASE}/slots/1", b"junk"))
    d = ro.decide(s, jr, fr, "b", 9, T0)
    assert d.kind == "wait" and "max_concurrent" in d.detail


def test_an_agent_that_holds_its_slot_and_started_goes_and_one_that_started_takes_only_a_slot():
    s = spec(max_concurrent=1)
    jr, fr = rollout_of(start(0, "a", T0), slot(0, "a", lease=7))
    assert ro.decide(s, jr, fr, "a", 7, T0).kind == "go"
    # the slot of the same agent under an earlier session is not this session's
    assert ro.decide(s, jr, fr, "a", 8, T0).kind == "wait"
    jr, fr = rollout_of(start(0, "a", T0))
    assert ro.decide(s, jr, fr, "a", 8, T0) == ro.Decision("try", slot=0, start=None)


def test_a_rate_wait_says_when_to_look_again():
    s = spec(per_minute=6)
    jr, fr = rollout_of(start(0, "a", T0))
    d = ro.decide(s, jr, fr, "b", 9, T0 + 2)
    assert d.kind == "wait" and d.until == T0 + 10
    assert ro.decide(s, jr, fr, "b", 9, T0 + 10) == ro.Decision("try", start=1)


def test_the_threshold_aborts_and_a_mark_refuses_every_start():
    s = spec(max_concurrent=5, abort={"failed_pct": 30, "min_finished": 2})
    jr, fr = rollout_of(start(0, "a", T0), start(1, "b", T0), outcome("a", "failed"), outcome("b", "succeeded"))
    assert ro.decide(s, jr, fr, "c", 9, T0).kind == "abort"
    jr, fr = rollout_of(("aborted", {"by": "x", "at": "2026-12-02T12:00:00Z", "fire": BASE}))
    d = ro.decide(s, jr, fr, "c", 9, T0)
    assert d.kind == "aborted" and "by x" in d.detail
    jr.delete("aborted", 99)
    assert ro.decide(s, jr, fr, "c", 9, T0).kind == "try"


def test_deletes_are_applied():
    jr, fr = rollout_of(start(0, "a", T0), slot(0, "a"), outcome("a", "failed"), (f"{BASE}/ended", {}))
    assert fr.ended_rev == 10
    for rel in (f"{BASE}/starts/000000", f"{BASE}/slots/0", f"{BASE}/outcomes/a", f"{BASE}/ended"):
        jr.delete(rel, 20)
    assert (fr.starts, fr.slots, fr.outcomes, fr.ended_rev) == ({}, {}, {}, 20)


def test_a_rollback_has_a_fire_id_of_its_own():
    fid = ro.rollback_fire_id(BASE, "gw-1")
    assert ro.rolled_back(fid) == BASE and ro.rolled_back(f"{BASE}@gw-1") is None
    assert fid < f"{BASE}@gw-1" and ro.base_of(fid) != BASE
