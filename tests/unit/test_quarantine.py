"""The job quarantine (issue 54, point 1): a job's own misbehaviour holds that job on this
agent, never the agent. Pure bookkeeping on a fake clock, and the start policy through the
real StartGate."""

from __future__ import annotations

from datetime import datetime, timezone
from types import SimpleNamespace

import pytest

from agent.config import QuarantineConfig
from agent.jobs.firing import Firing, FiringState
from agent.jobs.quarantine import REASON, JobQuarantine, QuarantinePolicy, strike_cause, version_of
from agent.jobs.startpolicy import StartGate
from agent.runtime import metrics
from tests.support.fakes import ManualClock, ManualLoop


def m(name: str, **labels: str) -> float:
    return metrics.sample(name, labels) or 0.0


# ---------------------------------------------------------------- the bookkeeping

def test_strikes_within_the_window_quarantine_the_job():
    q = JobQuarantine(strikes=3, window_s=60, hold_s=100, max_hold_s=1000)
    n0 = m("millwright_job_quarantines_total", cause="exec_policy")
    assert q.strike("j", "v", "exec_policy", 0)[0] is None
    assert q.strike("j", "v", "exec_policy", 30)[0] is None
    assert q.strike("j", "v", "exec_policy", 61)[0] is None     # the first one aged out
    started, released = q.strike("j", "v", "exec_policy", 62)
    assert released == []
    assert started["cause"] == "exec_policy" and started["strikes"] == 3 and started["hold_s"] == 100
    assert started["repeats"] == 1 and started["version"] == "v"
    assert m("millwright_job_quarantines_total", cause="exec_policy") == n0 + 1
    assert m("millwright_jobs_quarantined") == 1     # this agent's count (one quarantine per agent)
    assert q.held("j", "v", 161)[0] is not None
    assert q.held("other", "v", 100) == (None, None)            # only that job
    e, rel = q.held("j", "v", 162)
    assert e is None and rel["why"] == "expired" and rel["held_s"] == 100
    assert m("millwright_jobs_quarantined") == 0


def test_a_repeat_needs_one_strike_and_doubles_the_hold_up_to_the_cap():
    q = JobQuarantine(strikes=3, window_s=60, hold_s=100, max_hold_s=250)
    for t in (0, 1, 2):
        started, _ = q.strike("j", "v", "quota", t)
    assert started["hold_s"] == 100
    assert q.strike("j", "v", "quota", 50) == (None, [])        # held: a run that began earlier
    assert q.expire("j", 101) is None
    assert q.expire("j", 102)["why"] == "expired"
    assert q.strike("j", "v", "quota", 120)[0]["hold_s"] == 200  # on probation: one strike
    assert q.expire("j", 320) is not None
    assert q.strike("j", "v", "network_stall", 330)[0]["hold_s"] == 250   # capped
    assert q.expire("j", 580) is not None
    q.clean("j", "v")                                            # a clean run: back-off forgotten
    assert q.strike("j", "v", "quota", 600)[0] is None           # 3 strikes again
    q.strike("j", "v", "quota", 601)
    assert q.strike("j", "v", "quota", 602)[0]["hold_s"] == 100


def test_a_clean_run_does_not_end_a_hold_in_force():
    q = JobQuarantine(strikes=1, hold_s=100)
    q.strike("j", "v", "exec_policy", 0)
    q.clean("j", "v")
    assert q.held("j", "v", 50)[0] is not None


def test_a_new_signed_version_ends_the_quarantine_and_starts_clean():
    q = JobQuarantine(strikes=2, hold_s=100)
    q.strike("j", "v1", "exec_policy", 0)
    q.strike("j", "v1", "exec_policy", 1)
    n0 = m("millwright_job_quarantine_releases_total", why="new_version")
    assert q.held("j", "v1", 2)[0] is not None
    e, rel = q.held("j", "v2", 3)
    assert e is None and rel["why"] == "new_version"
    assert m("millwright_job_quarantine_releases_total", why="new_version") == n0 + 1
    assert q.strike("j", "v2", "exec_policy", 4)[0] is None     # no probation carried over
    # a strike of the new version while the old one is held releases the old hold too
    q.strike("k", "v1", "quota", 0)
    q.strike("k", "v1", "quota", 0)
    started, released = q.strike("k", "v2", "quota", 1)
    assert started is None and [r["why"] for r in released] == ["new_version"]


def test_the_version_is_the_signed_content():
    a = SimpleNamespace(id="j", content=b'{"id":"j","argv":1}')
    b = SimpleNamespace(id="j", content=b'{"id":"j","argv":2}')
    assert version_of(a) == version_of(SimpleNamespace(id="j", content=a.content))
    assert version_of(a) != version_of(b)


def test_entries_are_bounded_and_an_eviction_only_releases():
    q = JobQuarantine(strikes=2, hold_s=100, max_jobs=4)

    def hold(job: str, t: float):
        q.strike(job, "v", "quota", t)
        return q.strike(job, "v", "quota", t)

    hold("held-a", 0)                           # until 100
    hold("held-b", 1)                           # until 101
    q.strike("s-1", "v", "quota", 2)            # strike-only entries
    q.strike("s-2", "v", "quota", 3)
    assert len(q.entries) == 4
    q.strike("s-3", "v", "quota", 4)            # the least recently struck strike-only entry goes
    assert len(q.entries) == 4 and "s-1" not in q.entries and "held-a" in q.entries
    n0 = m("millwright_job_quarantine_releases_total", why="evicted")
    hold("held-c", 5)                           # evicts s-2
    hold("held-d", 6)                           # evicts s-3
    assert set(q.entries) == {"held-a", "held-b", "held-c", "held-d"}
    q.strike("held-e", "v", "quota", 7)         # all held: the hold that ends soonest is released
    assert len(q.entries) == 4 and "held-a" not in q.entries
    assert m("millwright_job_quarantine_releases_total", why="evicted") == n0 + 1
    started, released = q.strike("held-e", "v", "quota", 8)
    assert started is not None and released == []
    for j in ("held-b", "held-c", "held-d", "held-e"):
        assert q.held(j, "v", 9)[0] is not None
    # driven far past the bound: never more than max_jobs entries
    for i in range(100):
        q.strike(f"x-{i}", "v", "quota", 10 + i)
        assert len(q.entries) <= 4


def test_validation_and_config_defaults():
    with pytest.raises(ValueError):
        JobQuarantine(strikes=0)
    with pytest.raises(ValueError):
        JobQuarantine(hold_s=100, max_hold_s=50)
    with pytest.raises(ValueError):
        JobQuarantine().strike("j", "v", "bogus", 0)
    q = JobQuarantine.from_config(QuarantineConfig())
    assert (q.threshold, q.window_s, q.hold_s, q.max_hold_s, q.max_jobs) == (3, 300.0, 300.0, 3600.0, 4096)


def test_metric_labels_are_bounded():
    for cause in ("exec_policy", "network_stall", "quota"):
        assert metrics.sample("millwright_job_quarantines_total", {"cause": cause}) is not None
        assert metrics.sample("millwright_job_strikes_total", {"cause": cause}) is not None
    for why in ("expired", "new_version", "evicted"):
        assert metrics.sample("millwright_job_quarantine_releases_total", {"why": why}) is not None


# ---------------------------------------------------------------- which run end is a strike

def _firing(job_id="j", content=b"v1", fire_id="f1", reason=None, health="healthy") -> Firing:
    entry = SimpleNamespace(job=SimpleNamespace(id=job_id, content=content), shard=0, cancelled=False)
    f = Firing(entry, datetime(2026, 1, 1, tzinfo=timezone.utc), fire_id)
    f.end_reason, f.health = reason, health
    return f


@pytest.mark.parametrize("reason,health,flag,cause", [
    ("exec_policy", "healthy", None, "exec_policy"),
    ("succeeded", "healthy", "exec_policy", "exec_policy"),   # exited before the kill landed
    ("oom", "healthy", None, "quota"),
    ("pids_limit", "healthy", None, "quota"),
    ("network_stall", "stalled", None, "network_stall"),
    ("failed", "stalled", None, "network_stall"),
    ("failed", "healthy", None, None),
    ("timed_out", "degraded", None, None),
    ("cancelled", "healthy", None, None),
    ("succeeded", "healthy", None, None),
])
def test_strike_cause(reason, health, flag, cause):
    assert strike_cause(_firing(reason=reason, health=health), flag) == cause


# ---------------------------------------------------------------- the start policy, through the StartGate

class Loop(ManualLoop):
    def post(self, fn, *args):
        self.call_later(0.0, fn, *args)


class Statuses:
    def __init__(self):
        self.sent = []

    def send(self, entry, f, state, **fields):
        self.sent.append((entry.job.id, str(state), fields))


class Audit:
    def __init__(self):
        self.records = []

    def record(self, type_, **fields):
        self.records.append((type_, fields))


class Marks:
    def __init__(self):
        self.now = {}

    def waiting(self, f, reason, detail):
        self.now[f.key] = reason

    def done(self, f):
        self.now.pop(f.key, None)


def _setup(**cfg):
    clock, loop, audit, statuses = ManualClock(0.0), Loop(), Audit(), Statuses()
    pol = QuarantinePolicy(QuarantineConfig(**cfg), loop, audit, clock=clock)
    gate = StartGate([pol], statuses, loop)
    gate.marks = Marks()
    return clock, loop, audit, statuses, pol, gate


def _run(pol, f, reason, health="healthy", flag=None):
    pol.run_started(f)
    if flag:
        pol.offence(f, flag)
    f.end_reason, f.health = reason, health
    pol.run_ended(f)


def test_a_quarantined_job_waits_and_goes_when_the_hold_ends():
    clock, loop, audit, statuses, pol, gate = _setup(strikes=3, hold_s=10.0)
    for i in range(3):
        clock.t = float(i)
        _run(pol, _firing(fire_id=f"f{i}"), "succeeded", flag="exec_policy")   # one strike per run
    rec = [r for r in audit.records if r[0] == "quarantine"]
    assert [r[1]["event"] for r in rec] == ["quarantined"] and rec[0][1]["cause"] == "exec_policy"
    assert rec[0][1]["strikes"] == 3 and rec[0][1]["hold_s"] == 10.0
    went, refused = [], []
    f = _firing(fire_id="f3")
    clock.t = 3.0
    gate.request(f, went.append, lambda *a: refused.append(a))
    assert went == [] and refused == [] and f.state == FiringState.WAITING and f.wait_reason == REASON
    assert statuses.sent[-1][:2] == ("j", "waiting") and statuses.sent[-1][2]["reason"] == REASON
    assert "quarantined on this agent" in statuses.sent[-1][2]["detail"]
    assert gate.marks.now == {f.key: REASON}
    assert m("millwright_firings_waiting", policy="quarantine") >= 1
    assert pol.status()["quarantined"] == 1 and "j" in pol.status()["jobs"]
    # another job is never held by it
    g = _firing(job_id="other", fire_id="g1")
    gate.request(g, went.append, lambda *a: refused.append(a))
    assert went == [g]
    # the hold's timer: the release is audited and the waiting firing asked again (posted)
    timer = [c for c in loop.calls if not c[3] and c[0] == 10.0]
    assert len(timer) == 1
    clock.t = 2.0 + 10.0
    loop.run_next()
    assert audit.records[-1][0] == "quarantine" and audit.records[-1][1]["event"] == "released"
    assert audit.records[-1][1]["why"] == "expired"
    assert went == [g]          # the release itself starts nothing
    loop.run_all()              # the posted wake: the gate asks every policy again
    assert went == [g, f] and gate.marks.now == {}


def test_a_new_signed_version_goes_at_once():
    clock, loop, audit, statuses, pol, gate = _setup(strikes=1, hold_s=100.0)
    _run(pol, _firing(fire_id="f0"), "oom")
    went = []
    gate.request(_firing(fire_id="f1"), went.append, lambda *a: None)
    assert went == []
    newer = _firing(content=b"v2", fire_id="f2")
    gate.request(newer, went.append, lambda *a: None)
    assert went == [newer]
    assert audit.records[-1][1]["event"] == "released" and audit.records[-1][1]["why"] == "new_version"


def test_a_clean_run_resets_strikes_and_a_stalled_one_counts():
    clock, loop, audit, statuses, pol, gate = _setup(strikes=2, hold_s=100.0)
    _run(pol, _firing(fire_id="a"), "network_stall", health="stalled")
    _run(pol, _firing(fire_id="b"), "succeeded")
    _run(pol, _firing(fire_id="c"), "network_stall", health="stalled")
    assert not [r for r in audit.records if r[1].get("event") == "quarantined"]
    _run(pol, _firing(fire_id="d"), "failed", health="stalled")
    assert [r[1]["cause"] for r in audit.records if r[1].get("event") == "quarantined"] == ["network_stall"]
    assert pol.live == {}      # one entry per live run, gone at its end


def test_an_offence_outside_a_live_run_is_ignored():
    clock, loop, audit, statuses, pol, gate = _setup(strikes=1)
    f = _firing()
    pol.offence(f, "exec_policy")
    assert pol.live == {}
    f.end_reason = "succeeded"
    pol.run_ended(f)
    assert audit.records == []


def test_config_check_refuses_bad_quarantine_settings():
    from agent.config import Config
    from agent.configcheck import validate

    for section, key in ((QuarantineConfig(strikes=0), "quarantine.strikes"),
                         (QuarantineConfig(max_jobs=0), "quarantine.max_jobs"),
                         (QuarantineConfig(hold_s=0), "quarantine.hold_s"),
                         (QuarantineConfig(hold_s=600, max_hold_s=300), "quarantine.max_hold_s")):
        problems: list = []
        validate(Config(quarantine=section), problems)
        assert any(key in p for p in problems), (key, problems)
    problems = []
    validate(Config(), problems)
    assert not any("quarantine" in p for p in problems)
