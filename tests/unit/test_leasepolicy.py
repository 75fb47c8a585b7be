"""Lease policy (agent/supervision/leasepolicy.py): adaptive renewal, early fence, hand-off, memory reader."""

from __future__ import annotations

import pytest

from agent.runtime import metrics
from agent.config import EtcdConfig
from agent.supervision.leasepolicy import (DECISIONS, HAND_OFF, PAUSE_RUNS, RENEW_FAST, RENEW_NORMAL, RESUME_RUNS, TAKE_BACK,
                               AdaptiveRenewal, EarlyFence, HandOff, LeaseDecision, LeasePolicy, MemoryPressure,
                               memory_under_pressure, read_memory_pressure)
from agent.signals import EndpointSignals


def ep(retrans=0, stalled=None, available=True, host="127.0.0.1", port=2379, rate=0.0):
    return EndpointSignals(host=host, port=port, available=available, retransmits=retrans if available else 0,
                           retrans_per_s=rate, stalled_sockets=stalled)


def count(decision):
    return metrics.sample("millwright_lease_decisions_total", {"decision": decision}) or 0.0


# ---------------------------------------------------------------- adaptive renewal

def test_renewal_intervals_and_bounds():
    a = AdaptiveRenewal(1.0)
    assert (a.normal_s, a.fast_s, a.interval_s, a.latency_threshold_s) == (1.0, 0.25, 1.0, 0.25)
    assert AdaptiveRenewal(0.2).fast_s == 0.1          # floor
    assert AdaptiveRenewal(0.05).fast_s == 0.05        # never above normal
    with pytest.raises(ValueError):
        AdaptiveRenewal(0)
    with pytest.raises(ValueError):
        AdaptiveRenewal(1.0, healthy_renewals=0)


def test_retransmits_on_etcd_shrink_interval_then_healthy_renewals_restore_it():
    a = AdaptiveRenewal(1.0, healthy_renewals=3)
    assert a.on_endpoint(ep(10), 0.0) is None           # first sample: a baseline, not a rise
    assert a.on_endpoint(ep(10), 0.25) is None
    n0 = count(RENEW_FAST)
    d = a.on_endpoint(ep(12), 0.5)
    assert d.decision == RENEW_FAST and d.reason == "etcd_retransmits" and d.interval_s == 0.25
    assert d.evidence["new"] == 2 and a.interval_s == 0.25 and count(RENEW_FAST) == n0 + 1
    assert a.on_endpoint(ep(13), 0.6) is None             # already fast: no new decision ...
    assert a.on_keepalive(True, 0.01, 0.7) is None
    assert a.on_keepalive(True, 0.01, 0.95) is None
    assert a.on_endpoint(ep(14), 1.0) is None             # ... but the healthy count restarts
    assert a.on_keepalive(True, 0.01, 1.2) is None
    assert a.on_keepalive(True, 0.01, 1.45) is None
    d = a.on_keepalive(True, 0.01, 1.7)
    assert d.decision == RENEW_NORMAL and d.interval_s == 1.0 and a.interval_s == 1.0
    assert d.to_record() == {"event": "decision", "decision": RENEW_NORMAL, "reason": "healthy",
                             "evidence": {"healthy_renewals": 3}, "interval_s": 1.0}


def test_slow_or_failed_keepalive_goes_fast():
    a = AdaptiveRenewal(1.0)
    assert a.on_keepalive(True, 0.1, 1.0) is None
    d = a.on_keepalive(True, 0.3, 2.0)
    assert d.decision == RENEW_FAST and d.reason == "keepalive_slow" and d.evidence["threshold_s"] == 0.25
    b = AdaptiveRenewal(1.0)
    assert b.on_keepalive(False, None, 1.0).reason == "keepalive_failed"


def test_degraded_mode_stalled_sockets_go_fast():
    a = AdaptiveRenewal(1.0)
    assert a.on_endpoint(ep(available=False, stalled=0), 0.0) is None
    d = a.on_endpoint(ep(available=False, stalled=1), 1.0)
    assert d.reason == "etcd_stalled_sockets"


# ---------------------------------------------------------------- early fence

def fence(**kw):
    return EarlyFence(6.0, 1.0, **kw)


def test_fence_defaults_and_validation():
    f = fence()
    assert f.progress_timeout_s == 0.3 and f.stalled_renewal_age_s == 2.0
    with pytest.raises(ValueError):
        EarlyFence(6.0, 1.0, progress_timeout_s=6.0)
    with pytest.raises(ValueError):
        EarlyFence(6.0, 1.0, stalled_renewal_age_s=7.0)


def test_retransmits_without_renewal_progress_pause_runs():
    f = fence()
    f.on_endpoint(ep(5), 0.0)
    assert f.on_keepalive(True, 0.002, 1.0) is None
    assert f.on_endpoint(ep(5), 1.1) is None
    assert f.on_endpoint(ep(6), 1.3) is None     # first retransmit seen after the renewal
    assert f.next_deadline() == pytest.approx(1.6)
    assert f.tick(1.5) is None                   # 0.2 s without progress
    n0 = count(PAUSE_RUNS)
    d = f.tick(1.75)
    assert d.decision == PAUSE_RUNS and d.reason == "etcd_retransmits" and f.paused
    assert d.evidence["retransmits_since_renewal"] == 1 and d.evidence["no_progress_s"] == pytest.approx(0.45)
    assert d.evidence["last_renewal_age_s"] == pytest.approx(0.75)
    assert f.next_deadline() is None
    assert count(PAUSE_RUNS) == n0 + 1
    assert f.tick(2.0) is None and f.on_endpoint(ep(9), 2.1) is None   # paused once
    assert f.on_keepalive(False, None, 2.5, error="timeout") is None   # a failure does not resume
    d = f.on_keepalive(True, 1.9, 3.0)
    assert d.decision == RESUME_RUNS and d.reason == "renewed" and not f.paused
    assert d.evidence["paused_s"] == pytest.approx(1.25)


def test_renewal_in_time_means_no_fence():
    """A retransmit that the path recovers from: the immediate keepalive succeeds."""
    f = fence()
    f.on_endpoint(ep(5), 0.0)
    f.on_keepalive(True, 0.002, 1.0)
    f.on_endpoint(ep(6), 1.3)
    assert f.on_keepalive(True, 0.05, 1.5) is None
    for t in (1.8, 2.0, 2.5, 3.0):
        assert f.tick(t) is None
    assert not f.paused


def test_retransmits_before_the_last_renewal_do_not_count():
    f = fence()
    f.on_endpoint(ep(5), 0.0)
    f.on_endpoint(ep(8), 0.5)
    f.on_keepalive(True, 0.3, 0.9)
    assert f.tick(1.5) is None and f.tick(2.5) is None


def test_no_lease_no_fence():
    f = fence()
    f.on_endpoint(ep(5), 0.0)
    f.on_endpoint(ep(8), 0.5)
    assert f.tick(5.0) is None


def test_stalled_sockets_rule_degraded_mode():
    f = fence()
    f.on_keepalive(True, 0.01, 10.0)
    assert f.next_deadline() is None
    assert f.on_endpoint(ep(available=False, stalled=1), 10.5) is None   # renewal only 0.5 s old
    assert f.next_deadline() == 12.0
    assert f.tick(11.9) is None
    d = f.tick(12.0)
    assert d.decision == PAUSE_RUNS and d.reason == "etcd_stalled_sockets" and d.evidence["stalled_sockets"] == 1
    assert f.stall_began == 12.0


def test_never_resume_without_a_renewal_after_the_stall_began():
    f = fence()
    f.on_keepalive(True, 0.01, 10.0)
    f.on_endpoint(ep(available=False, stalled=1), 10.5)
    assert f.tick(12.0).decision == PAUSE_RUNS
    # a keepalive result stamped before the stall began (out-of-order) never resumes
    assert f.on_keepalive(True, 0.01, 11.0) is None and f.paused
    # the stall clears in the kernel: still paused until a renewal
    assert f.on_endpoint(ep(available=False, stalled=0), 12.5) is None and f.paused
    assert f.tick(20.0) is None and f.paused
    assert f.on_keepalive(True, 0.01, 20.5).decision == RESUME_RUNS


def test_keepalive_failures_pause_when_old_and_grant_resumes():
    f = fence()
    f.on_keepalive(True, 0.01, 0.0)
    assert f.on_keepalive(False, None, 1.0, error="unavailable") is None
    d = f.tick(2.0)
    assert d.reason == "keepalive_failed" and d.evidence["error"] == "unavailable"
    assert f.on_granted(8.0).decision == RESUME_RUNS


def test_keepalive_failure_rule_can_be_disabled():
    f = fence(on_failure=False)
    f.on_keepalive(True, 0.01, 0.0)
    f.on_keepalive(False, None, 1.0)
    assert f.tick(5.0) is None


# ---------------------------------------------------------------- memory

def test_read_memory_pressure_psi_and_meminfo(tmp_path):
    (tmp_path / "pressure").mkdir()
    (tmp_path / "pressure" / "memory").write_text("some avg10=12.50 avg60=3.00 avg300=1.00 total=5\n"
                                                  "full avg10=2.25 avg60=0.00 avg300=0.00 total=1\n")
    (tmp_path / "meminfo").write_text("MemTotal:        1000 kB\nMemFree:  10 kB\nMemAvailable:     250 kB\n")
    m = read_memory_pressure(str(tmp_path))
    assert m == MemoryPressure("psi", 12.5, 2.25, 0.25, 250 * 1024)


def test_read_memory_pressure_fallbacks(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 1000 kB\nMemAvailable: 20 kB\n")
    m = read_memory_pressure(str(tmp_path))
    assert m.source == "meminfo" and m.available_ratio == 0.02 and m.some_avg10 is None
    assert memory_under_pressure(m)
    (tmp_path / "pressure").mkdir()
    (tmp_path / "pressure" / "memory").write_text("garbage\n")
    assert read_memory_pressure(str(tmp_path)).source == "meminfo"
    assert read_memory_pressure(str(tmp_path / "nope")) == MemoryPressure("none")
    assert not memory_under_pressure(MemoryPressure("none"))


def test_read_memory_pressure_real_proc():
    m = read_memory_pressure()
    assert m.source in ("psi", "meminfo", "none")
    if m.source != "none":
        assert 0 < m.available_ratio <= 1


def test_memory_thresholds():
    assert memory_under_pressure(MemoryPressure("psi", 40.0, 0.0, 0.01)) is True
    assert memory_under_pressure(MemoryPressure("psi", 1.0, 10.0, 0.9)) is True
    assert memory_under_pressure(MemoryPressure("psi", 39.9, 9.9, 0.01)) is False  # PSI wins over the ratio
    assert memory_under_pressure(MemoryPressure("meminfo", available_ratio=0.5)) is False


# ---------------------------------------------------------------- hand-off

def test_job_evidence_never_reaches_the_lease_policy():
    """Issue 54: a job's exec violations, network stalls and quota kills quarantine the job
    (agent/jobs/quarantine.py); the lease policy has no way to hear of them."""
    for name in ("on_run_ended", "on_exec_violation", "on_other_endpoint", "on_node"):
        assert not hasattr(LeasePolicy, name), name
        assert not hasattr(HandOff, name), name
    with pytest.raises(TypeError):
        HandOff(stalled_runs=3)   # type: ignore[call-arg]
    with pytest.raises(TypeError):
        HandOff(violations=3)   # type: ignore[call-arg]


def test_sustained_memory_pressure():
    h = HandOff(memory_sustained_s=30)
    hot, cool = MemoryPressure("psi", 80.0, 20.0, 0.02), MemoryPressure("psi", 0.0, 0.0, 0.5)
    assert h.on_memory(hot, 0) is None
    assert h.on_memory(hot, 20) is None
    assert h.on_memory(cool, 25) is None        # a good sample restarts the clock
    assert h.on_memory(hot, 30) is None
    assert h.on_memory(hot, 59) is None
    assert h.next_deadline() == 60
    d = h.on_memory(hot, 60)
    assert d.reason == "memory_pressure" and d.evidence["source"] == "psi" and d.evidence["some_avg10"] == 80.0
    # still under pressure: no take-back however long
    for t in range(61, 400, 5):
        assert h.on_memory(hot, t) is None
    assert h.next_deadline() is None
    assert h.on_memory(cool, 400) is None
    assert h.next_deadline() == 460
    assert h.tick(459) is None
    assert h.tick(460).decision == TAKE_BACK


HOT, COOL = MemoryPressure("psi", 80.0, 20.0, 0.02), MemoryPressure("psi", 0.0, 0.0, 0.5)


def test_cooldown_restarts_on_bad_evidence_and_backs_off():
    h = HandOff(memory_sustained_s=0, cooldown_s=60, backoff_factor=2, max_cooldown_s=200)
    n0 = count(HAND_OFF)
    d = h.on_memory(HOT, 0)
    assert d.decision == HAND_OFF and d.reason == "memory_pressure" and not h.available
    assert d.evidence["cooldown_s"] == 60 and d.evidence["handoffs_recent"] == 1 and count(HAND_OFF) == n0 + 1
    assert d.to_record()["decision"] == HAND_OFF and d.to_record()["event"] == "decision"
    assert h.on_memory(COOL, 1) is None
    assert h.tick(59) is None
    assert h.on_memory(HOT, 50) is None     # pressure again: restarts the cool-down
    assert h.on_memory(COOL, 51) is None
    assert h.tick(110) is None
    n0 = count(TAKE_BACK)
    d = h.tick(111)
    assert d.decision == TAKE_BACK and h.available and d.evidence["unavailable_s"] == 111
    assert count(TAKE_BACK) == n0 + 1
    d = h.on_memory(HOT, 120)
    assert d.decision == HAND_OFF and d.evidence["cooldown_s"] == 120 and d.evidence["handoffs_recent"] == 2
    h.on_memory(COOL, 120)
    assert h.tick(239) is None and h.tick(240).decision == TAKE_BACK
    assert h.on_memory(HOT, 250).evidence["cooldown_s"] == 200   # capped
    h.on_memory(COOL, 250)
    assert h.tick(450).decision == TAKE_BACK


def test_backoff_memory_forgets_old_handoffs():
    h = HandOff(memory_sustained_s=0, cooldown_s=60, backoff_memory_s=1000)
    h.on_memory(HOT, 0)
    h.on_memory(COOL, 0)
    assert h.tick(60).decision == TAKE_BACK
    d = h.on_memory(HOT, 2000)
    assert d.evidence["cooldown_s"] == 60 and d.evidence["handoffs_recent"] == 1


def test_handoff_validation():
    with pytest.raises(ValueError):
        HandOff(cooldown_s=0)
    with pytest.raises(ValueError):
        HandOff(backoff_factor=0.5)


# ---------------------------------------------------------------- facade

def test_lease_policy_facade_routes_events():
    p = LeasePolicy.from_config(EtcdConfig(), handoff={"memory_sustained_s": 0, "cooldown_s": 5})
    assert p.status()["keepalive_interval_s"] == 1.0
    assert p.on_granted(0.0) == []
    assert p.on_etcd_endpoint(ep(3), 0.1) == []
    assert p.on_keepalive(True, 0.001, 1.0) == []
    ds = p.on_etcd_endpoint(ep(4), 1.2)
    assert [d.decision for d in ds] == [RENEW_FAST]
    assert p.next_deadline() == pytest.approx(1.5)
    ds = p.tick(1.6)
    assert [d.decision for d in ds] == [PAUSE_RUNS] and p.paused
    assert p.next_deadline() is None
    ds = p.on_keepalive(True, 0.5, 1.9)
    assert [d.decision for d in ds] == [RESUME_RUNS] and not p.paused
    assert [d.decision for d in p.on_memory(HOT, 2.0)] == [HAND_OFF] and not p.available
    assert p.on_memory(MemoryPressure("psi", 0.0, 0.0, 0.5), 2.0) == []
    assert p.next_deadline() == 7.0
    assert [d.decision for d in p.tick(8.0)] == [TAKE_BACK] and p.available
    assert set(p.status()) == {"keepalive_interval_s", "renew_fast", "runs_paused", "handoff", "cpu_pressure"}


def test_lease_policy_checks_timings():
    with pytest.raises(ValueError):
        LeasePolicy(10, 11, 1)
    with pytest.raises(ValueError):
        LeasePolicy(10, 6, 6)


def test_decision_labels_are_bounded():
    assert set(DECISIONS) == {RENEW_FAST, RENEW_NORMAL, PAUSE_RUNS, RESUME_RUNS, HAND_OFF, TAKE_BACK}
    for d in DECISIONS:
        assert metrics.sample("millwright_lease_decisions_total", {"decision": d}) is not None
    rec = LeaseDecision(PAUSE_RUNS, "etcd_retransmits", 1.0, {"a": 1}).to_record()
    assert rec == {"event": "decision", "decision": PAUSE_RUNS, "reason": "etcd_retransmits", "evidence": {"a": 1}}


# ---------------------------------------------------------------- host CPU pressure

def test_cpu_pressure_holds_keepalives_fast_until_relieved_then_healthy_renewals_restore_them():
    """CPU pressure (PSI some avg10) at the high line: one renew_fast decision, kept through
    any number of healthy keepalives and repeated high readings; once relieved (below the
    lower line), healthy keepalives bring the normal interval back as for any other cause."""
    p = LeasePolicy(6, 4, 1.0, renewal={"healthy_renewals": 2})
    assert p.on_cpu_pressure(None, 0.0) == [] and p.on_cpu_pressure(12.0, 0.0) == []
    (d,) = p.on_cpu_pressure(55.0, 1.0)
    assert (d.decision, d.reason, d.interval_s) == (RENEW_FAST, "cpu_pressure", 0.25)
    assert d.evidence == {"some_avg10": 55.0, "high_pct": 40.0}
    for i in range(6):
        assert p.on_keepalive(True, 0.01, 1.5 + i / 4) == []   # held: healthy renewals do not end it
    assert p.on_cpu_pressure(30.0, 5.0) == [] and p.renewal.fast   # in the gap: still high, no new decision
    assert p.status()["cpu_pressure"] == {"some_avg10": 30.0, "high": True}
    assert p.on_cpu_pressure(10.0, 10.0) == [] and p.renewal.fast   # relieved: the hold ends ...
    assert p.on_keepalive(True, 0.01, 10.25) == []
    (d,) = p.on_keepalive(True, 0.01, 10.5)                          # ... and healthy renewals end fast
    assert (d.decision, d.reason, p.renewal.interval_s) == (RENEW_NORMAL, "healthy", 1.0)
