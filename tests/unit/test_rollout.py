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
    """items: (agent whose prefix holds the key, name under the job, value[, version, lease, rev])."""
    jr = ro.JobRollout()
    for agent, rel, doc, *more in items:
        jr.put(agent, rel, kv(rel, doc, *more))
    return jr, jr.firing(BASE)


def start(agent: str, at: float, rev: int = 10) -> tuple:
    return (agent, f"{BASE}/start", {"agent": agent, "fire_id": f"{BASE}@{agent}", "at": at}, 1, 0, rev)


def outcome(agent: str, state: str, version: int = 1) -> tuple:
    return (agent, f"{BASE}/outcome", {"agent": agent, "fire_id": f"{BASE}@{agent}", "state": state}, version)


def claim(agent: str, rev: int, lease: int = 7) -> tuple:
    return (agent, f"{BASE}/claim", {"agent": agent, "fire_id": f"{BASE}@{agent}"}, 1, lease, rev)


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
    _, fr = rollout_of(start("a", T0), start("b", T0), start("c", T0),
                       outcome("a", "succeeded"), outcome("b", "succeeded", version=2), outcome("c", "aborted"),
                       outcome("d", "succeeded"))
    t = ro.tally(s, fr)
    # b's success was rewritten after its creation: a failure; c never ran; d never started
    assert t == ro.Tally(started=3, finished=3, failed=1, succeeded=1)


def test_a_key_belongs_to_the_agent_whose_prefix_holds_it_whatever_it_names():
    _, fr = rollout_of(("forger", f"{BASE}/start", {"agent": "a", "fire_id": f"{BASE}@a", "at": T0}),
                       ("forger", f"{BASE}/claim", {"agent": "a", "fire_id": f"{BASE}@a"}, 1, 7, 10),
                       ("forger", f"{BASE}/outcome", {"agent": "a", "fire_id": f"{BASE}@a", "state": "succeeded"}))
    assert set(fr.starts) == set(fr.claims) == set(fr.outcomes) == {"forger"}
    assert not fr.starts["forger"].believed and not fr.outcomes["forger"].believed   # naming another firing
    assert ro.tally(spec(max_concurrent=1), fr) == ro.Tally(started=1, finished=1, failed=1, succeeded=0)


@pytest.mark.parametrize("finished, failed, expect", [(3, 3, False), (4, 1, False), (4, 2, True), (10, 3, True),
                                                       (10, 2, False)])
def test_the_abort_threshold_needs_the_minimum_finished_and_the_failed_share(finished, failed, expect):
    s = spec(abort={"failed_pct": 30, "min_finished": 4})
    assert ro.crossed(s, ro.Tally(finished, finished, failed, finished - failed)) is expect


def test_starts_are_spaced_by_the_rate_and_the_rate_grows_with_successes():
    s = spec(per_minute=6, growth={"factor": 2, "after_succeeded": 2})
    _, fr = rollout_of()
    assert ro.next_start_at(s, fr, 0) == T0
    _, fr = rollout_of(start("a", T0 + 1))
    assert ro.next_start_at(s, fr, 0) == T0 + 11
    assert ro.next_start_at(s, fr, 1) == T0 + 11
    assert ro.next_start_at(s, fr, 2) == T0 + 6       # 12/min
    assert ro.next_start_at(s, fr, 4) == T0 + 3.5     # 24/min
    assert ro.rate(s, 10_000_000) == ro.MAX_PER_MINUTE


def test_a_start_key_with_an_early_time_moves_no_start_forward():
    s = spec(per_minute=6)
    _, fr = rollout_of(start("a", T0, 10), start("forged", T0 - 3600, 11), start("forged2", 0.0, 12))
    # three starts: the next comes no earlier than 3 spacings after the due time
    assert ro.next_start_at(s, fr, 0) == T0 + 30
    _, fr = rollout_of(start("a", T0 + 500))   # a time ahead only holds agents back
    assert ro.next_start_at(s, fr, 0) == T0 + 510


# --- deciding --------------------------------------------------------------------------------

def test_an_agent_claims_first_then_goes_when_fewer_than_max_concurrent_claims_are_ahead():
    s = spec(max_concurrent=2)
    jr, fr = rollout_of(claim("a", 10), claim("b", 11), claim("c", 12))
    assert ro.decide(s, jr, fr, "d", 0, T0) == ro.Decision("claim")
    assert ro.decide(s, jr, fr, "a", 10, T0) == ro.Decision("go", start=True)
    assert ro.decide(s, jr, fr, "b", 11, T0) == ro.Decision("go", start=True)
    d = ro.decide(s, jr, fr, "c", 12, T0)
    assert d.kind == "wait" and "max_concurrent" in d.detail
    jr.delete("a", f"{BASE}/claim")   # a's run ended: its claim went with its final record
    assert ro.decide(s, jr, fr, "c", 12, T0) == ro.Decision("go", start=True)
    jr, fr = rollout_of(claim("a", 10), start("a", T0))
    assert ro.decide(s, jr, fr, "a", 10, T0) == ro.Decision("go")   # started: nothing more to write
    assert ro.decide(spec(abort={"failed_pct": 10}), jr, fr, "b", 0, T0) == ro.Decision("go")


def test_every_claim_counts_as_taken_whoever_wrote_it_and_a_new_one_never_overtakes():
    s = spec(max_concurrent=1)
    jr, fr = rollout_of(claim("nobody", 5, lease=0), ("junk", f"{BASE}/claim", b"junk", 1, 0, 6))
    d = ro.decide(s, jr, fr, "b", 9, T0)
    assert d.kind == "wait" and "2 claim(s)" in d.detail
    # claims made after b's (a forger re-creating its own, anyone) are behind it
    jr, fr = rollout_of(claim("b", 9), claim("forger", 20, lease=0), claim("forger2", 21))
    assert ro.decide(s, jr, fr, "b", 9, T0).kind == "go"
    assert ro.decide(s, jr, fr, "forger2", 21, T0).kind == "wait"


def test_with_a_rate_the_first_claim_not_started_goes_first_and_waits_its_spacing():
    s = spec(per_minute=6)
    jr, fr = rollout_of(claim("a", 10), start("a", T0, 13), claim("b", 11), claim("c", 12))
    d = ro.decide(s, jr, fr, "b", 11, T0 + 2)
    assert d.kind == "wait" and d.until == T0 + 10
    assert ro.decide(s, jr, fr, "b", 11, T0 + 10) == ro.Decision("go", start=True)
    d = ro.decide(s, jr, fr, "c", 12, T0 + 100)   # b, ahead, has not started
    assert d.kind == "wait" and "ahead" in d.detail


def test_the_threshold_aborts_and_any_agents_mark_refuses_every_start():
    s = spec(max_concurrent=5, abort={"failed_pct": 30, "min_finished": 2})
    jr, fr = rollout_of(start("a", T0), start("b", T0), outcome("a", "failed"), outcome("b", "succeeded"))
    assert ro.decide(s, jr, fr, "c", 9, T0).kind == "abort"
    mark = {"by": "x", "at": "2026-12-02T12:00:00Z", "fire": BASE}
    jr, fr = rollout_of(("x", "aborted", mark), ("y", "aborted", {**mark, "by": "y"}), claim("c", 9))
    d = ro.decide(s, jr, fr, "c", 9, T0)
    assert d.kind == "aborted" and "by x" in d.detail
    jr, fr = rollout_of(("x", "aborted", {**mark, "by": "someone else"}), ("y", "aborted", mark), claim("c", 9))
    assert ro.decide(s, jr, fr, "c", 9, T0).detail.startswith("the rollout was aborted by x")   # its prefix's
    jr.delete("x", "aborted")   # x can delete only its own: y's still aborts
    assert ro.decide(s, jr, fr, "c", 9, T0).kind == "aborted"
    jr.delete("y", "aborted")
    assert ro.decide(s, jr, fr, "c", 9, T0).kind == "go"


def test_deletes_are_applied():
    jr, fr = rollout_of(start("a", T0), claim("a", 10), outcome("a", "failed"), ("a", "aborted", {}))
    for rel in (f"{BASE}/start", f"{BASE}/claim", f"{BASE}/outcome", "aborted"):
        jr.delete("a", rel)
    assert (fr.starts, fr.claims, fr.outcomes, jr.marks) == ({}, {}, {}, {})


def test_a_rollback_has_a_fire_id_of_its_own():
    fid = ro.rollback_fire_id(BASE, "gw-1")
    assert ro.rolled_back(fid) == BASE and ro.rolled_back(f"{BASE}@gw-1") is None
    assert fid < f"{BASE}@gw-1" and ro.base_of(fid) != BASE


# --- against a forger, in every interleaving ---------------------------------------------------

class _Store:
    """A revisioned key space as etcd keeps it (create revision kept across puts, a delete
    removes), enough to replay every interleaving; the agent of a key is its prefix's."""

    def __init__(self):
        self.rev = 0
        self.kvs: dict[tuple[str, str], KV] = {}
        self.snapshots: list[dict] = [{}]

    def put(self, agent: str, rel: str, doc: dict, lease: int = 0) -> int:
        self.rev += 1
        old = self.kvs.get((agent, rel))
        self.kvs[(agent, rel)] = KV(f"{agent}/{rel}", json.dumps(doc).encode(),
                                    old.create_revision if old else self.rev, self.rev,
                                    old.version + 1 if old else 1, lease)
        self.snapshots.append(dict(self.kvs))
        return self.kvs[(agent, rel)].create_revision

    def delete(self, agent: str, rel: str) -> None:
        if self.kvs.pop((agent, rel), None) is not None:
            self.rev += 1
            self.snapshots.append(dict(self.kvs))

    def view(self, rev: int) -> tuple[ro.JobRollout, ro.FiringRollout]:
        jr = ro.JobRollout()
        for (agent, rel), kv in self.snapshots[rev].items():
            jr.put(agent, rel, kv)
        return jr, jr.firing(BASE)


@pytest.mark.parametrize("seed", range(60))
@pytest.mark.parametrize("limit", [1, 2])
def test_a_forger_writing_only_its_own_keys_never_lets_more_than_max_concurrent_honest_runs_overlap(seed, limit):
    """Five honest agents and a forger that may write only its own keys (what etcd RBAC
    leaves it), interleaved at random: each honest agent judges on a view at any revision
    at or after its claim (a lagging watch). The honest runs never overlap beyond the limit,
    and every honest agent runs once."""
    import random

    rnd = random.Random(seed)
    s = spec(max_concurrent=limit, per_minute=6000)
    st = _Store()
    honest = [f"h{i}" for i in range(5)]
    claim_rev: dict[str, int] = {}
    running: set[str] = set()
    done: set[str] = set()
    claim_rel, start_rel, outcome_rel = f"{BASE}/claim", f"{BASE}/start", f"{BASE}/outcome"
    for step in range(2000):
        if rnd.random() < 0.3:   # the forger: its own keys only, naming whoever it likes
            victim = rnd.choice(honest)
            forged = {"agent": victim, "fire_id": f"{BASE}@{victim}", "at": 0}
            op = rnd.choice(("claim", "unclaim", "start", "unstart"))
            if op == "claim":
                st.put("forger", claim_rel, forged, lease=rnd.choice([0, 7]))
            elif op == "unclaim":
                st.delete("forger", claim_rel)
            elif op == "start":
                st.put("forger", start_rel, forged)
            else:
                st.delete("forger", start_rel)
            if rnd.random() < 0.8:
                st.delete("forger", claim_rel)   # (mostly gone again: else it holds everyone back)
            continue
        a = rnd.choice(honest)
        if a in done:
            continue
        if a in running:
            if rnd.random() < 0.3:   # the run ends: outcome and claim's release, one transaction
                st.put(a, outcome_rel, {"agent": a, "fire_id": f"{BASE}@{a}", "state": "succeeded"})
                st.delete(a, claim_rel)
                running.discard(a)
                done.add(a)
            continue
        if a not in claim_rev:
            claim_rev[a] = st.put(a, claim_rel, {"agent": a, "fire_id": f"{BASE}@{a}"}, lease=1)
            continue
        jr, fr = st.view(rnd.randint(claim_rev[a], st.rev))
        d = ro.decide(s, jr, fr, a, claim_rev[a], T0 + 10_000 + step)
        if d.kind == "go":
            if d.start:
                st.put(a, start_rel, {"agent": a, "fire_id": f"{BASE}@{a}", "at": T0 + 10_000 + step})
            running.add(a)
            assert len(running) <= limit, (seed, step, running)
    st.delete("forger", claim_rel)
    for _ in range(200):   # the forger stops: everyone left gets to run
        for a in honest:
            if a in running:
                st.put(a, outcome_rel, {"agent": a, "fire_id": f"{BASE}@{a}", "state": "succeeded"})
                st.delete(a, claim_rel)
                running.discard(a)
                done.add(a)
            elif a not in done and a in claim_rev:
                jr, fr = st.view(st.rev)
                if ro.decide(s, jr, fr, a, claim_rev[a], T0 + 1e6).kind == "go":
                    running.add(a)
                    assert len(running) <= limit
            elif a not in done:
                claim_rev[a] = st.put(a, claim_rel, {"agent": a, "fire_id": f"{BASE}@{a}"}, lease=1)
    assert done == set(honest)
