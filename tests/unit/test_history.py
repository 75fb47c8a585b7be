"""The history checker (tests/support/history.py) fails on bad histories: each test
builds a small history that breaks one rule and expects the problem to name the firing."""

from __future__ import annotations

import json

import pytest

from tests.support.history import Budget, Event, Firing, SideEffect, assert_clean, check, parse_effects

P = "/millwright/t/"
F1 = "20261203T120000.000Z"
DUE = 1796299200.0  # 2026-12-03T12:00:00Z


class H:
    """A history builder: revisions count up like etcd's."""

    def __init__(self):
        self.events: list[Event] = []
        self.rev = 1
        self.create: dict[str, int] = {}
        self.version: dict[str, int] = {}

    def put(self, key: str, value) -> int:
        self.rev += 1
        key = P + key
        if key not in self.create:
            self.create[key] = self.rev
            self.version[key] = 0
        self.version[key] += 1
        v = value if isinstance(value, bytes) else (value.encode() if isinstance(value, str) else json.dumps(value).encode())
        self.events.append(Event(self.rev, key, "put", v, self.create[key], self.version[key]))
        return self.rev

    def delete(self, key: str) -> None:
        self.rev += 1
        key = P + key
        self.create.pop(key, None)
        self.version.pop(key, None)
        self.events.append(Event(self.rev, key, "delete"))

    def shard(self, n: int, agent: str):
        return self.put(f"shards/{n:04d}", agent)

    def run(self, agent: str, state: str, attempt: int = 1, job: str = "j", fid: str = F1, shard: int = 1, **kw):
        """A run-record write, fenced (``fence``) by the shard key's current create revision
        unless the test names another."""
        rec = {"v": 1, "job_id": job, "fire_id": fid, "state": state, "attempt": attempt, "agent": agent,
               "shard": shard, "started_at": None, "ended_at": None, "reason": None, "new_field": {"x": 1},
               "fence": self.create.get(P + f"shards/{shard:04d}", 0)}
        rec.update(kw)
        return self.put(f"runs/{shard:04d}/{job}/{fid}", rec)


def good() -> H:
    h = H()
    h.shard(1, "a0")
    h.run("a0", "running", started_at="2026-12-03T12:00:00.000Z")
    h.run("a0", "succeeded", started_at="2026-12-03T12:00:00.010Z", ended_at="2026-12-03T12:00:00.300Z")
    return h


def fx(agent="a0", attempt=1, start=DUE + 0.02, end=DUE + 0.25, fid=F1) -> SideEffect:
    return SideEffect("j", fid, attempt, agent, start, end)


def run_check(h: H, effects=None, firings=None, **kw):
    return check(h.events, P, effects=effects, firings=firings if firings is not None else [Firing("j", F1, DUE)], **kw)


def problems(rep) -> str:
    return "\n".join(rep.problems)


def test_a_good_history_passes_and_counts():
    rep = run_check(good(), [fx()], budget=Budget(0, 0), lateness_bound_s=1.0)
    assert rep.problems == []
    assert rep.stats["firings"] == 1 and rep.stats["side_effects"] == 1 and rep.stats["states"] == {"succeeded": 1}
    assert rep.stats["lateness_p99_s"] == pytest.approx(0.02, abs=1e-3)   # the side effect's clock
    assert_clean(rep)


def test_two_agents_creating_the_same_attempt_fail():
    h = good()
    h.delete("shards/0001")
    h.shard(1, "a1")
    h.run("a1", "running", started_at="2026-12-03T12:00:01.000Z")
    rep = run_check(h, [fx()])
    assert f"(j, {F1}) attempt 1: running record created 2 times" in problems(rep)


def test_an_unfenced_write_fails():
    h = H()
    h.shard(1, "a0")
    h.run("a1", "running")   # a1 does not hold shard 1
    rep = run_check(h, complete=False)
    assert f"(j, {F1}) attempt 1 written as 'running' by a1 while shard 0001 was held by a0" in problems(rep)


def test_a_write_after_the_shard_key_expired_fails():
    h = H()
    h.shard(1, "a0")
    h.delete("shards/0001")
    h.run("a0", "succeeded", ended_at="2026-12-03T12:00:00.300Z")
    rep = run_check(h)
    assert "held by nobody" in problems(rep) and f"(j, {F1})" in problems(rep)


def test_owner_change_without_delete_fails():
    h = H()
    h.shard(1, "a0")
    h.shard(1, "a1")
    rep = check(h.events, P)
    assert "changed owner a0 -> a1 without a delete" in problems(rep)


def test_a_side_effect_without_its_running_record_fails():
    h = H()
    h.shard(1, "a0")
    h.run("a0", "succeeded", started_at="2026-12-03T12:00:00.010Z", ended_at="2026-12-03T12:00:00.300Z")
    rep = run_check(h, [fx()])
    assert f"(j, {F1}) attempt 1: side effect by a0" in problems(rep)
    assert "without a fenced running record" in problems(rep)


def test_a_side_effect_by_another_agent_than_the_claimer_fails():
    rep = run_check(good(), [fx(agent="a2")])
    assert "side effect by a2 but the running record was created by a0" in problems(rep)


def test_an_attempt_that_ran_twice_fails():
    rep = run_check(good(), [fx(), fx(start=DUE + 0.5, end=DUE + 0.6)])
    assert f"(j, {F1}) attempt 1 ran 2 times" in problems(rep)


def test_overlapping_attempts_fail_and_a_missing_end_line_counts_max_run():
    two = [Firing("j", F1, DUE, max_attempts=2)]
    h = H()
    h.shard(1, "a0")
    h.run("a0", "running")
    h.run("a0", "retrying")             # attempt 1's end was never recorded (its agent died)
    h.run("a0", "running", attempt=2)
    effects = [fx(end=None), fx(attempt=2, start=DUE + 0.5, end=DUE + 0.7)]
    rep = run_check(h, effects, firings=two, max_run_s=1.0)
    assert f"(j, {F1}): attempt 2 started" in problems(rep) and "overlapping runs" in problems(rep)
    assert not run_check(h, [fx(), fx(attempt=2, start=DUE + 0.5, end=DUE + 0.7)], firings=two, max_run_s=1.0,
                         complete=False).problems
    # killed without an end line, but its agent recorded the end after reaping it: no overlap
    h = H()
    h.shard(1, "a0")
    h.run("a0", "running", started_at="2026-12-03T12:00:00.000Z")
    h.run("a0", "retrying", ended_at="2026-12-03T12:00:00.300Z")
    h.run("a0", "running", attempt=2)
    assert not run_check(h, [fx(end=None), fx(attempt=2, start=DUE + 0.5, end=DUE + 0.7)], firings=two,
                         max_run_s=1.0, complete=False).problems


def test_running_before_the_due_time_fails():
    rep = run_check(good(), [fx(start=DUE - 1.0)])
    assert "before its due time" in problems(rep)


def test_an_unresolved_firing_fails():
    h = H()
    h.shard(1, "a0")
    h.run("a0", "running")
    rep = run_check(h)
    assert f"(j, {F1}): left 'running'" in problems(rep)
    rep = run_check(H())
    assert f"(j, {F1}): due at" in problems(rep) and "never resolved" in problems(rep)


def test_a_cron_firing_may_be_skipped_only_during_a_fault():
    f = Firing("j", F1, DUE, kind="cron", may_skip=True)
    rep = check(H().events, P, firings=[f])
    assert "never resolved (no run record) outside any fault" in problems(rep)
    rep = check(H().events, P, firings=[f], effective_due=lambda d: d + 3, budget=Budget(0, 1))
    assert rep.problems == [] and rep.stats["skipped_by_policy"] == 1
    rep = check(H().events, P, firings=[f], effective_due=lambda d: d + 3, budget=Budget(0, 0))
    assert "misfired 1 (1 skipped by policy) over its budget 0" in problems(rep)


def test_failed_without_reason_and_bad_misfire_reasons_fail():
    h = H()
    h.shard(1, "a0")
    h.run("a0", "failed", ended_at="2026-12-03T12:00:00.300Z")
    assert f"(j, {F1}): failed without a reason" in problems(run_check(h))
    h = H()
    h.shard(1, "a0")
    h.run("a0", "misfired", reason="because", ended_at="2026-12-03T12:00:00.300Z")
    p = problems(run_check(h))
    assert "misfired with reason 'because'" in p and "a one-shot firing misfired" in p


def test_lateness_over_the_bound_fails():
    h = H()
    h.shard(1, "a0")
    h.run("a0", "running")
    h.run("a0", "succeeded", started_at="2026-12-03T12:00:09.000Z", ended_at="2026-12-03T12:00:09.300Z")
    rep = run_check(h, lateness_bound_s=5.0)
    assert f"(j, {F1}): resolved 9.00 s after its due time" in problems(rep)
    # a fault that healed at due+6 s excuses 6 of those seconds
    assert not run_check(h, lateness_bound_s=5.0, effective_due=lambda d: d + 6).problems


def test_owner_lost_over_budget_fails():
    h = H()
    h.shard(1, "a0")
    h.run("a0", "running")
    h.delete("shards/0001")
    h.shard(1, "a1")
    h.run("a1", "failed", reason="owner_lost", ended_at="2026-12-03T12:00:05.000Z")
    during_fault = lambda d: True  # noqa: E731
    assert not run_check(h, budget=Budget(1, 0), affected=during_fault).problems
    assert "owner_lost 1 over its budget 0" in problems(run_check(h, budget=Budget(0, 0), affected=during_fault))


def test_owner_lost_without_a_fault_in_flight_fails():
    """A run may be lost only to a fault that caught it running: a scheduler that loses
    runs while nothing was wrong fails, whatever the budget."""
    h = H()
    h.shard(1, "a0")
    h.run("a0", "running")
    h.delete("shards/0001")
    h.shard(1, "a1")
    h.run("a1", "failed", reason="owner_lost", ended_at="2026-12-03T12:00:05.000Z")
    fault_at = lambda t0, t1: (lambda d: t0 <= d <= t1)  # noqa: E731
    big = Budget(100, 0)
    msg = problems(run_check(h, budget=big, affected=fault_at(DUE + 10, DUE + 20)))
    assert "(j, 20261203T120000.000Z): failed/owner_lost with no fault in flight" in msg
    # a fault 3 s after the due time catches a run that may last 4 s; not one that lasts 1 s
    assert not run_check(h, budget=big, affected=fault_at(DUE + 3, DUE + 5), max_run_s=4.0).problems
    assert "no fault in flight" in problems(run_check(h, budget=big, affected=fault_at(DUE + 3, DUE + 5),
                                                      max_run_s=1.0))


def test_a_record_for_an_unscheduled_firing_fails():
    h = good()
    h.run("a0", "succeeded", fid="20261203T120001.000Z", ended_at="2026-12-03T12:00:01.300Z")
    assert "(j, 20261203T120001.000Z): a record for a firing the workload never scheduled" in problems(run_check(h))


def test_probe_writes_with_a_stale_token_fail():
    h = H()
    rev = h.shard(1, "a0")
    h.put("test/probe/0001", {"agent": "a0", "token": rev})
    assert not check(h.events, P).problems
    h.put("test/probe/0001", {"agent": "a0", "token": rev - 1})
    assert "with token" in problems(check(h.events, P))


# --- the holes a reviewer found (issue 35): each history below passed the earlier checker


def test_hole_a_an_attempt_after_a_final_state_fails():
    """Attempt 2 running after attempt 1 succeeded, though max_attempts allows 2."""
    h = good()
    h.run("a0", "running", attempt=2, started_at="2026-12-03T12:00:01.000Z")
    h.run("a0", "succeeded", attempt=2, started_at="2026-12-03T12:00:01.000Z", ended_at="2026-12-03T12:00:01.300Z",
          exit_code=0)
    effects = [fx(), fx(attempt=2, start=DUE + 1.0, end=DUE + 1.3)]
    rep = run_check(h, effects, firings=[Firing("j", F1, DUE, max_attempts=3)])
    assert f"(j, {F1}): 'running' attempt 2 written after the final state 'succeeded'" in problems(rep)


def test_hole_a_attempts_out_of_order_or_out_of_range_fail():
    h = H()
    h.shard(1, "a0")
    h.run("a0", "running")
    h.run("a0", "retrying", ended_at="2026-12-03T12:00:00.300Z", exit_code=3)
    h.run("a0", "running", attempt=3)      # attempt 2 skipped
    h.run("a0", "succeeded", attempt=3, ended_at="2026-12-03T12:00:01.300Z", exit_code=0)
    effects = [fx(), fx(attempt=3, start=DUE + 1.0, end=DUE + 1.3)]
    rep = run_check(h, effects, firings=[Firing("j", F1, DUE, max_attempts=3)])
    assert f"(j, {F1}): 'running' attempt 3 after 'retrying' attempt 1" in problems(rep)
    h = H()
    h.shard(1, "a0")
    h.run("a0", "running", attempt=0)
    h.run("a0", "succeeded", attempt=0, ended_at="2026-12-03T12:00:00.300Z", exit_code=0)
    rep = run_check(h, [fx(attempt=0)])
    assert f"(j, {F1}): 'running' attempt 0 outside 1..1" in problems(rep)


def test_hole_b_a_final_record_overwritten_fails_even_during_a_fault():
    h = good()
    h.run("a0", "failed", reason="owner_lost", ended_at="2026-12-03T12:00:05.000Z")
    rep = run_check(h, [fx()], budget=Budget(1, 0), affected=lambda d: True)
    assert f"(j, {F1}): 'failed' attempt 1 written after the final state 'succeeded'" in problems(rep)


def test_hole_c_a_success_without_its_side_effect_fails():
    rep = run_check(good(), [])
    assert f"(j, {F1}) attempt 1: 'succeeded' but no side effect" in problems(rep)
    # an attempt that exited by itself (an exit code) ran its script: its effect must exist
    h = H()
    h.shard(1, "a0")
    h.run("a0", "running")
    h.run("a0", "failed", reason="exit_code", exit_code=3, ended_at="2026-12-03T12:00:00.300Z")
    assert f"(j, {F1}) attempt 1: 'failed' with exit code 3 but no side effect" in problems(run_check(h, []))


def test_hole_d_a_write_under_an_old_fence_by_the_same_agent_fails():
    h = H()
    old = h.shard(1, "a0")
    h.delete("shards/0001")
    new = h.shard(1, "a0")       # a0 lost the shard and claimed it again: a new fence
    h.run("a0", "running", fence=old, started_at="2026-12-03T12:00:00.000Z")
    h.run("a0", "succeeded", started_at="2026-12-03T12:00:00.010Z", ended_at="2026-12-03T12:00:00.300Z")
    rep = run_check(h, [fx()])
    assert (f"(j, {F1}) attempt 1 written as 'running' by a0 under fence {old}, but shard 0001 was held by a0 "
            f"under fence {new}") in problems(rep)
    h = H()
    h.shard(1, "a0")
    h.run("a0", "running", fence=None)
    assert f"(j, {F1}) attempt 1 'running' record without a fence token" in problems(run_check(h, complete=False))


def test_hole_e_lateness_is_measured_on_the_side_effects_clock():
    """The record says it started at once; the job itself ran 30 s late."""
    rep = run_check(good(), [fx(start=DUE + 30, end=DUE + 30.3)], lateness_bound_s=5.0)
    assert f"(j, {F1}): started 30.00 s after its due time" in problems(rep)
    assert rep.stats["lateness_p99_s"] == pytest.approx(30.0, abs=1e-3)


def test_a_missing_or_malformed_effect_file_fails(tmp_path):
    with pytest.raises(AssertionError, match="no side-effect log"):
        parse_effects(str(tmp_path / "nowhere.log"))
    p = tmp_path / "effects.log"
    p.write_text(f"start j {F1} 1 a0 10 {DUE + 0.02}\nstart j {F1} 1 a0\n")
    with pytest.raises(AssertionError, match="line 2"):
        parse_effects(str(p))
    p.write_text(f"end j {F1} 1 a0 10 {DUE + 0.2}\n")
    with pytest.raises(AssertionError, match="line 1: an end without its start"):
        parse_effects(str(p))


# --- quiet windows: a firing due with no fault nor recovery going on must simply run


def test_a_quiet_firing_must_run_once_on_time_and_succeed():
    every = lambda f: True  # noqa: E731
    rep = run_check(good(), [fx()], quiet=every, quiet_lateness_s=1.0)
    assert rep.problems == [] and rep.stats["quiet_firings"] == 1
    assert rep.stats["quiet_lateness_p99_s"] == pytest.approx(0.02, abs=1e-3)
    # late on the effect's clock
    rep = run_check(good(), [fx(start=DUE + 2.5, end=DUE + 2.7)], quiet=every, quiet_lateness_s=1.0,
                    lateness_bound_s=10.0)
    assert f"(j, {F1}): due in a quiet window, started 2.50 s after its due time" in problems(rep)
    # lost: owner_lost is excused by the fault windows, never in a quiet one
    h = H()
    h.shard(1, "a0")
    h.run("a0", "running")
    h.delete("shards/0001")
    h.shard(1, "a1")
    h.run("a1", "failed", reason="owner_lost", ended_at="2026-12-03T12:00:05.000Z")
    rep = run_check(h, [fx()], quiet=every, quiet_lateness_s=1.0, budget=Budget(1, 0), affected=lambda d: True)
    assert f"(j, {F1}): due in a quiet window, ended failed/owner_lost at attempt 1" in problems(rep)


def test_a_quiet_cron_firing_may_not_be_skipped_or_misfired():
    f = Firing("j", F1, DUE, kind="cron", may_skip=True)
    rep = check(H().events, P, firings=[f], effects=[], affected=lambda d: True, budget=Budget(0, 1),
                quiet=lambda f: True)
    assert f"(j, {F1}): due in a quiet window at {DUE:.3f}, never ran" in problems(rep)
    h = H()
    h.shard(1, "a0")
    h.run("a0", "misfired", reason="misfire_run_once", ended_at="2026-12-03T12:00:05.000Z")
    rep = check(h.events, P, firings=[f], effects=[], budget=Budget(0, 1), quiet=lambda f: True)
    assert f"(j, {F1}): due in a quiet window, ended misfired/misfire_run_once" in problems(rep)


def test_a_quiet_retrying_firing_has_one_effect_per_attempt():
    h = H()
    h.shard(1, "a0")
    h.run("a0", "running")
    h.run("a0", "retrying", exit_code=3, ended_at="2026-12-03T12:00:00.300Z")
    h.run("a0", "running", attempt=2)
    h.run("a0", "succeeded", attempt=2, exit_code=0, ended_at="2026-12-03T12:00:01.300Z")
    two = [Firing("j", F1, DUE, max_attempts=2)]
    ok = [fx(), fx(attempt=2, start=DUE + 1.0, end=DUE + 1.3)]
    assert not run_check(h, ok, firings=two, quiet=lambda f: True, quiet_lateness_s=1.0).problems
    rep = run_check(h, ok[1:], firings=two, quiet=lambda f: True, quiet_lateness_s=1.0)
    assert f"(j, {F1}): due in a quiet window, attempt 1 has 0 side effects, not exactly one" in problems(rep)


def test_a_firing_that_never_ran_is_dated_by_the_tests_clock_when_given():
    """A misfired record's ended_at is its agent's clock, which a clock fault moved: with
    rev_time (when the test saw that revision) the resolution is dated on the test's clock."""
    h = H()
    h.shard(1, "a0")
    rev = h.run("a0", "misfired", reason="misfire_run_once", ended_at="2026-12-03T12:00:30.000Z")
    f = [Firing("j", F1, DUE, kind="cron", may_skip=True)]
    assert "resolved 30.00 s after its due time" in problems(run_check(h, [], firings=f, lateness_bound_s=5.0))
    seen = {rev: DUE + 1.0}
    assert not run_check(h, [], firings=f, lateness_bound_s=5.0, rev_time=seen.get).problems


def test_a_run_at_or_after_its_jobs_not_after_fails():
    """A firing that waited past its job's not_after must never start (its effect's clock),
    unless the test set its agent's clock behind by that much."""
    f = [Firing("j", F1, DUE, not_after=DUE + 2.0)]
    assert not run_check(good(), [fx(start=DUE + 1.9, end=DUE + 2.1)], firings=f).problems
    rep = run_check(good(), [fx(start=DUE + 6.0, end=DUE + 6.2)], firings=f)
    assert f"(j, {F1}) attempt 1: ran at {DUE + 6.0:.3f}, after its job's not_after {DUE + 2.0:.3f}" in problems(rep)
    assert not run_check(good(), [fx(start=DUE + 3.0, end=DUE + 3.2)], firings=f, late_ok_s=lambda se: 2.05).problems


def exhausted(attempts: int) -> H:
    h = H()
    h.shard(1, "a0")
    for a in range(1, attempts + 1):
        h.run("a0", "running", attempt=a)
        h.run("a0", "failed" if a == attempts else "retrying", attempt=a, exit_code=3, reason="failed: exit 3",
              ended_at="2026-12-03T12:00:01.000Z")
    return h


def test_a_quiet_job_that_fails_every_attempt_ends_failed_after_exactly_max_attempts():
    every = lambda f: True  # noqa: E731
    two = [Firing("j", F1, DUE, max_attempts=2, expect="failed")]
    ran = [fx(), fx(attempt=2, start=DUE + 1.3, end=DUE + 1.5)]
    assert not run_check(exhausted(2), ran, firings=two, quiet=every, quiet_lateness_s=1.0).problems
    # one attempt short: failed at attempt 1 of 2
    rep = run_check(exhausted(1), ran[:1], firings=two, quiet=every, quiet_lateness_s=1.0)
    assert f"(j, {F1}): due in a quiet window, ended failed/failed: exit 3 at attempt 1, not failed after attempt 2" \
        in problems(rep)
    # one attempt too many: out of range, and not how it should end
    rep = run_check(exhausted(3), ran + [fx(attempt=3, start=DUE + 2.6, end=DUE + 2.8)], firings=two, quiet=every,
                    quiet_lateness_s=1.0)
    assert f"(j, {F1}): 'running' attempt 3 outside 1..2 (max_attempts 2)" in problems(rep)
    # and a job expected to succeed that failed is a failure too
    rep = run_check(exhausted(2), ran, firings=[Firing("j", F1, DUE, max_attempts=2)], quiet=every,
                    quiet_lateness_s=1.0)
    assert "ended failed/failed: exit 3 at attempt 2, not succeeded" in problems(rep)


def test_a_quiet_job_expected_to_expire_must_misfire_without_running_and_costs_no_budget():
    every = lambda f: True  # noqa: E731
    h = H()
    h.shard(1, "a0")
    h.run("a0", "misfired", reason="expired", ended_at="2026-12-03T12:00:02.000Z")
    f = [Firing("j", F1, DUE, expect="misfired", not_after=DUE + 2.0)]
    rep = run_check(h, [], firings=f, quiet=every, quiet_lateness_s=1.0, budget=Budget(0, 0))
    assert rep.problems == [] and rep.stats["misfired"] == 0
    # it ran after all (its dependency came after its not_after): three oracles say so
    rep = run_check(good(), [fx(start=DUE + 6.0, end=DUE + 6.2)], firings=f, quiet=every, quiet_lateness_s=1.0)
    assert "due in a quiet window, ended succeeded at attempt 1, not misfired" in problems(rep)
    assert "due in a quiet window, expected never to run, ran 1 time(s)" in problems(rep)
    assert "after its job's not_after" in problems(rep)
    # never resolved at all
    rep = run_check(H(), [], firings=f, quiet=every, quiet_lateness_s=1.0)
    assert f"(j, {F1}): due in a quiet window at {DUE:.3f}, never resolved (no run record)" in problems(rep)


def test_a_quiet_cron_firing_skipped_by_overlap_passes_only_behind_a_run_that_spans_its_due_time():
    """A fault's late run of an earlier firing can reach past the fault's window: the next
    firing of a job that forbids overlap is then skipped, even in a quiet window. The side
    effects must show that run; a skip with nothing running fails."""
    f0, f1 = F1, "20261203T120002.000Z"
    cron = [Firing("j", f0, DUE, kind="cron", may_skip=True), Firing("j", f1, DUE + 2, kind="cron", may_skip=True)]
    h = good()
    h.run("a0", "misfired", fid=f1, reason="overlap", ended_at="2026-12-03T12:00:02.000Z")
    quiet_second = lambda f: f.fire_id == f1  # noqa: E731
    late_run = [fx(start=DUE + 1.9, end=DUE + 2.2)]
    rep = run_check(h, late_run, firings=cron, quiet=quiet_second, quiet_lateness_s=1.0, affected=lambda d: d == DUE)
    assert rep.problems == [] and rep.stats["quiet_overlapped"] == [f"(j, {f1}) behind {f0}"]
    on_time = [fx(start=DUE + 0.01, end=DUE + 0.3)]
    rep = run_check(h, on_time, firings=cron, quiet=quiet_second, quiet_lateness_s=1.0, affected=lambda d: d == DUE)
    assert f"(j, {f1}): due in a quiet window, ended misfired/overlap at attempt 1, not succeeded" in problems(rep)
