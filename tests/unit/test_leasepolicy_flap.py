"""Deterministic simulation: a link that drops for 200 ms every few seconds.

Issue 7, acceptance 4: such a link causes at most one hand-off in 5 minutes. The whole
decision chain runs on a fake clock with synthetic signals: a TCP model (RTO 200 ms,
doubling while the link is down) for the job's connection and the agent's etcd
connection, a sensor model with the real sensor's stall heuristic (a streak ends when no
retransmit came within 2 x gap + 1 s) and its 5 s rate window, JobHealth per run, and
LeasePolicy fed exactly as docs/health.md tells the daemon to.

Since issue 54 a run's stall is the job's evidence: it strikes the job in a
JobQuarantine (agent/jobs/quarantine.py), which holds the job's later firings; the
lease policy never hears of it, so a flapping link hands off nothing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

import pytest

from agent.config import HealthThresholds
from agent.jobs.quarantine import JobQuarantine
from agent.supervision.health import JobHealth
from agent.supervision.leasepolicy import HAND_OFF, PAUSE_RUNS, RESUME_RUNS, TAKE_BACK, LeasePolicy
from agent.signals import EndpointSignals, SlotSignals

DT = 0.05          # simulation step
SAMPLE = 0.25      # sensor sampling interval
WINDOW = 5.0       # sensor rate window
RTO = 0.2
RTT = 0.002


class Link:
    def __init__(self, outages: list[tuple[float, float]]):
        self.outages = outages

    def down(self, t: float) -> bool:
        return any(a <= t <= b for a, b in self.outages)

    def next_up_delivery(self, sent: float) -> tuple[float, list[float]]:
        """A segment sent at `sent`: (delivery time, retransmit times) with RTO backoff."""
        if not self.down(sent):
            return sent + RTT, []
        rto, t, retrans = RTO, sent, []
        while True:
            t += rto
            retrans.append(t)
            if not self.down(t):
                return t + RTT, retrans
            rto *= 2


@dataclass
class Streaks:
    """Retransmit history of a set of sockets, read the way the sensor reads it."""

    times: list = field(default_factory=list)

    def add(self, ts: list[float]) -> None:
        self.times.extend(ts)
        self.times.sort()

    def seen(self, now: float) -> list[float]:
        return [t for t in self.times if t <= now]

    def stall_age(self, now: float) -> float:
        start = last = gap = None
        for t in self.seen(now):
            if last is not None and t <= last + 2 * (gap or 0) + 1.0:
                gap = t - last
            else:
                start, gap = t, None
            last = t
        if last is None or now > last + 2 * (gap or 0) + 1.0:
            return 0.0
        return now - start

    def rate(self, now: float, since: float) -> float:
        n = sum(1 for t in self.seen(now) if t > now - WINDOW)
        return n / min(WINDOW, max(1.0, now - since))


@dataclass
class Result:
    decisions: list = field(default_factory=list)       # (t, decision, reason)
    health: list = field(default_factory=list)          # (t, state, rule)
    runs_started: int = 0
    runs_stalled: int = 0
    hard_fences: int = 0
    hard_fence_at: list = field(default_factory=list)
    resumes_without_success: int = 0
    start_delays: list = field(default_factory=list)
    quarantined_at: list = field(default_factory=list)   # (t, hold_s)
    released_at: list = field(default_factory=list)      # (t, why)

    def count(self, decision: str, until: float = 1e9, since: float = 0.0) -> int:
        return sum(1 for t, d, _ in self.decisions if d == decision and since <= t <= until)


def outages_every(period_lo: float, period_hi: float, until: float, seed: int, start: float = 5.0,
                  dur: float = 0.2) -> list[tuple[float, float]]:
    rnd = random.Random(seed)
    out, t = [], start
    while t < until:
        out.append((t, t + dur))
        t += rnd.uniform(period_lo, period_hi)
    return out


def simulate(outages, *, end: float = 300.0, etcd_on_link: bool = True, thresholds: Optional[HealthThresholds] = None,
             job_every: float = 10.0, run_s: float = 6.0, retry_s: float = 2.0, handoff: Optional[dict] = None,
             retry_period_s: float = 1.0, renew_deadline_s: float = 6.0,
             quarantine: Optional[dict] = None) -> Result:
    link = Link(outages)
    etcd_link = link if etcd_on_link else Link([])
    th = thresholds or HealthThresholds()
    pol = LeasePolicy(10, renew_deadline_s, retry_period_s, handoff=handoff)
    quar = JobQuarantine(**(quarantine or {}))
    res = Result()
    etcd = Streaks()

    # keepalive state
    next_send = 0.0
    inflight: Optional[tuple[float, float]] = None    # (sent, delivered)
    last_renew_send = 0.0
    interval = pol.renewal.interval_s

    # scheduler state: one job firing every job_every s (overlap forbid: a firing due while
    # the previous run is still running is skipped); a stalled run is retried after retry_s
    pending: list[float] = []
    next_fire = 0.0
    run: Optional[dict] = None

    def handle(ds, t, from_success=False):
        nonlocal interval, next_send
        for d in ds:
            res.decisions.append((t, d.decision, d.reason))
            if d.interval_s is not None:
                interval = d.interval_s
                if d.decision == "renew_fast" and inflight is None:
                    next_send = t          # renew_now()
            if d.decision == RESUME_RUNS and not from_success:
                res.resumes_without_success += 1

    steps = int(round(end / DT))
    for i in range(steps + 1):
        t = round(i * DT, 6)
        # --- keepalives
        if inflight is None and t >= next_send:
            delivered, retrans = etcd_link.next_up_delivery(t)
            etcd.add(retrans)
            inflight = (t, delivered)
        if inflight is not None and t >= inflight[1]:
            sent, delivered = inflight
            inflight = None
            last_renew_send = sent
            handle(pol.on_keepalive(True, delivered - sent, t), t, from_success=True)
            next_send = sent + interval
        if t - last_renew_send >= renew_deadline_s:
            res.hard_fences += 1
            res.hard_fence_at.append(t)
            last_renew_send = t
        # --- the job connection of the current run: retransmits during outages
        if run is not None:
            for a, _b in link.outages:
                if run["t0"] <= a <= t and a not in run["hit"]:
                    run["hit"].add(a)
                    _, retrans = link.next_up_delivery(a)
                    run["conn"].add(retrans)
        # --- sensor sample
        if i % int(round(SAMPLE / DT)) == 0:
            last = etcd.seen(t)
            sig = EndpointSignals(host="10.0.0.5", port=2379, available=True, retransmits=len(last),
                                  retrans_per_s=etcd.rate(t, 0.0), last_retransmit_age_s=(t - last[-1]) if last else None,
                                  stalled_sockets=1 if etcd.stall_age(t) > 0 else 0)
            handle(pol.on_etcd_endpoint(sig, t), t)
            if run is not None:
                c: Streaks = run["conn"]
                age = c.stall_age(t)
                s = SlotSignals(slot=1, available=True, retransmits=len(c.seen(t)), retrans_per_s=c.rate(t, run["t0"]),
                                stalled_connections=1 if age > 0 else 0, oldest_stall_age_s=age)
                d = run["health"].observe(s, t)
                if d is not None:
                    res.health.append((t, d.state, d.rule))
                    if d.end_run:
                        end_run(run, t, res, quar, pending, retry_s, stalled=True)
                        run = None
            handle(pol.tick(t), t)
        # --- runs
        if run is not None and t >= run["t0"] + run_s:
            end_run(run, t, res, quar, pending, retry_s, stalled=False)
            run = None
        if t >= next_fire:
            if run is None and not pending:
                pending.append(next_fire)
            next_fire += job_every
        held, rel = quar.held("job", "v1", t)
        if rel is not None:
            res.released_at.append((t, rel["why"]))
        if run is None and pending and t >= pending[0] and held is None:
            if not pol.available:
                pending.pop(0)     # a peer runs it
            elif not pol.paused:
                d0 = pending.pop(0)
                res.start_delays.append(t - d0)
                run = {"t0": t, "conn": Streaks(), "hit": set(), "health": JobHealth(th, t, slot=1)}
                res.runs_started += 1
    return res


def end_run(run, t, res, quar, pending, retry_s, stalled):
    """The run's end is the job's evidence (the quarantine's), never the lease policy's."""
    run["health"].close()
    if stalled:
        res.runs_stalled += 1
        pending.insert(0, t + retry_s)
        started, _ = quar.strike("job", "v1", "network_stall", t)
        if started is not None:
            res.quarantined_at.append((t, started["hold_s"]))
    elif run["health"].state == "healthy":
        quar.clean("job", "v1")


# ---------------------------------------------------------------- the acceptance scenario

STRICT = HealthThresholds(retrans_per_s_degraded=0.2, retrans_per_s_stalled=0.4, stall_age_s=0.3, failed_connects=3)


def check_invariants(res: Result) -> None:
    assert res.hard_fences == 0
    assert res.resumes_without_success == 0
    assert res.count(PAUSE_RUNS) - res.count(RESUME_RUNS) in (0, 1)


@pytest.mark.parametrize("etcd_on_link", [True, False], ids=["link", "job-path-only"])
@pytest.mark.parametrize("run_s", [6.0, 30.0])
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_link_dropping_200ms_every_few_seconds_never_hands_off(seed, run_s, etcd_on_link):
    res = simulate(outages_every(2.0, 5.0, 300.0, seed), run_s=run_s, job_every=10.0 if run_s < 10 else 40.0,
                   etcd_on_link=etcd_on_link)
    assert res.count(HAND_OFF) == 0
    check_invariants(res)


@pytest.mark.parametrize("etcd_on_link", [True, False], ids=["link", "job-path-only"])
@pytest.mark.parametrize("period", [2.0, 2.2, 3.0, 4.0])
def test_fixed_period_flaps_with_long_runs(period, etcd_on_link):
    """Drops every 2 s keep the sensor's retransmit streak alive: long runs do stall
    (stall_age); the job is the one held, the agent never hands off."""
    res = simulate(outages_every(period, period, 300.0, 0), run_s=30.0, job_every=40.0, etcd_on_link=etcd_on_link)
    assert res.count(HAND_OFF) == 0
    check_invariants(res)


def test_every_run_stalled_quarantines_the_job_never_the_agent():
    """Thresholds so strict that every drop stalls the run: after 3 stalled runs the job is
    quarantined (300 s); the agent keeps its shards throughout."""
    outages = outages_every(2.0, 5.0, 300.0, 7)
    res = simulate(outages, end=700.0, thresholds=STRICT)
    assert res.runs_stalled >= 3
    assert res.count(HAND_OFF) == 0 and res.count(TAKE_BACK) == 0
    assert res.quarantined_at and res.quarantined_at[0][1] == 300.0
    first = res.quarantined_at[0][0]
    assert res.released_at and res.released_at[0] == (pytest.approx(first + 300.0, abs=DT), "expired")
    check_invariants(res)


def test_job_path_only_flaps_quarantine_backs_off_exponentially():
    """Only the job's path flaps: each repeat quarantine of the job (one stalled run after a
    release is enough) doubles its hold, up to the cap; no hand-off ever."""
    outages = outages_every(2.0, 5.0, 900.0, 7)
    res = simulate(outages, end=900.0, etcd_on_link=False, thresholds=STRICT,
                   quarantine={"hold_s": 60.0, "max_hold_s": 200.0})
    holds = [h for _, h in res.quarantined_at]
    assert holds[:4] == [60.0, 120.0, 200.0, 200.0]
    assert res.count(HAND_OFF) == 0 and res.count(PAUSE_RUNS) == 0
    check_invariants(res)


def test_stable_link_no_decisions_and_runs_on_time():
    res = simulate([], end=120.0)
    assert res.decisions == [] and res.health == [] and res.runs_started == 13
    assert max(res.start_delays) < DT + 1e-9


def test_etcd_blackhole_pauses_runs_and_resumes_after_renewal():
    """A 3 s blackhole of the etcd path only: runs pause well before the renew deadline
    and resume with the first renewal after it."""
    res = simulate([(20.3, 23.3)], end=40.0, thresholds=HealthThresholds(), etcd_on_link=True, job_every=1.0,
                   run_s=0.5)
    pauses = [t for t, d, _ in res.decisions if d == PAUSE_RUNS]
    resumes = [t for t, d, _ in res.decisions if d == RESUME_RUNS]
    # at worst: retry period (next keepalive) + RTO + sensor sample + progress timeout + tick step
    assert len(pauses) == 1 and 20.3 < pauses[0] <= 20.3 + 1.0 + RTO + SAMPLE + 0.3 + SAMPLE
    assert len(resumes) == 1 and resumes[0] > 23.3
    check_invariants(res)


def figures() -> None:
    """Policy-level figures for the report (python3 tests/unit/test_leasepolicy_flap.py)."""
    import statistics

    for retry in (1.0, 0.5):
        lat, hard = [], []
        for k in range(40):
            b = 20.0 + k * retry / 40
            r = simulate([(b, b + 10.0)], end=40.0, job_every=1.0, run_s=0.5, retry_period_s=retry)
            p = [t for t, d, _ in r.decisions if d == PAUSE_RUNS]
            lat.append(p[0] - b)
            hard.append(r.hard_fence_at[0] - b)
        print(f"etcd blackhole, retry_period_s={retry}: soft fence after {min(lat):.2f}/{statistics.mean(lat):.2f}/"
              f"{max(lat):.2f} s (min/mean/max); renew-deadline fence after {min(hard):.2f}/"
              f"{statistics.mean(hard):.2f}/{max(hard):.2f} s")
    for label, kw in (("default thresholds, link", {}), ("default, job path only", {"etcd_on_link": False}),
                      ("strict thresholds, link", {"thresholds": STRICT}),
                      ("strict, job path only", {"thresholds": STRICT, "etcd_on_link": False})):
        worst = held = 0
        for seed in range(1, 21):
            for run_s, every in ((6.0, 10.0), (30.0, 40.0)):
                r = simulate(outages_every(2.0, 5.0, 300.0, seed), run_s=run_s, job_every=every, **kw)
                worst = max(worst, r.count(HAND_OFF, until=300.0))
                held = max(held, len(r.quarantined_at))
        print(f"200 ms drops every 2-5 s, 20 seeds x 2 run lengths, {label}: most hand-offs in 5 min = {worst}, "
              f"most quarantines of the job = {held}")


if __name__ == "__main__":
    figures()
