"""Lease decisions from keepalive results and kernel signals: a small, pure policy.

Three policies, each deterministic, free of I/O and driven with a monotonic ``now``
passed in by the caller (the daemon's loop; tests use a fake clock):

* :class:`AdaptiveRenewal` - the keepalive interval: ``retry_period_s`` normally,
  ``retry_period_s / 4`` (floor ``min_interval_s``) while the etcd connection shows
  retransmits or keepalives are slow or failing; normal again after N healthy renewals.
* :class:`EarlyFence` - a *soft* fence ("stop starting runs now") when the kernel shows
  the etcd path stalled, long before ``renew_deadline_s``; lifted only by a successful
  renewal that completed after the stall began. The hard fence (renew deadline, lease
  lost) stays in the daemon and the session, as in client-go's leaderelection.
* :class:`HandOff` - voluntary hand-off of all shards (member record
  ``available=false``) when the node cannot do its work: sustained memory pressure on
  the host. Taking shards back needs a healthy cool-down that doubles with each repeated
  hand-off.

Every input here is evidence about the agent itself: its etcd path (keepalives, the
etcd endpoint's retransmits and stalled sockets), its host (memory pressure). What one
job does (exec-policy violations, its runs' network stalls, quota kills) never reaches
these policies: it quarantines that job on this agent (agent/jobs/quarantine.py), so a
job on every agent cannot make every agent hand its shards off (issue 54).

:class:`LeasePolicy` bundles the three behind one set of event methods. Every decision
is a :class:`LeaseDecision` with its evidence (for the audit record) and is counted in
``millwright_lease_decisions_total{decision}``. The integration guide is docs/health.md.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from agent.runtime.metrics import counter, gauge
from agent.supervision.cpupressure import CpuPressureRule

if TYPE_CHECKING:
    from agent.config import EtcdConfig
    from agent.signals.model import EndpointSignals

# decision labels (bounded: these and nothing else)
RENEW_FAST, RENEW_NORMAL = "renew_fast", "renew_normal"
PAUSE_RUNS, RESUME_RUNS = "pause_runs", "resume_runs"
HAND_OFF, TAKE_BACK = "hand_off", "take_back"
DECISIONS = (RENEW_FAST, RENEW_NORMAL, PAUSE_RUNS, RESUME_RUNS, HAND_OFF, TAKE_BACK)

LEASE_DECISIONS = counter("millwright_lease_decisions_total", "Lease policy decisions", ("decision",))
KEEPALIVE_INTERVAL = gauge("millwright_lease_keepalive_interval_seconds", "Keepalive interval chosen by the policy")
RUNS_PAUSED = gauge("millwright_runs_paused", "1 while the early fence stops new runs")
HANDED_OFF = gauge("millwright_shards_handed_off", "1 while the agent has handed its shards to peers")
for _d in DECISIONS:
    LEASE_DECISIONS.labels(_d)


@dataclass(frozen=True)
class LeaseDecision:
    """One decision. ``decision`` is the metric label (see :data:`DECISIONS`), ``reason``
    the rule that fired, ``evidence`` the values behind it (JSON-safe).

    What supervision does with it (agent/supervision/component.py, docs/health.md):
    renew_fast / renew_normal -> ``renewal.set_interval(interval_s)`` (renew_fast: also
    ``renewal.renew_now()``); pause_runs / resume_runs -> stop / restart starting new runs;
    hand_off / take_back -> ``availability.hand_off(reason)`` / ``take_back()`` (the shard
    manager publishes its member record and lets idle shards go)."""

    decision: str
    reason: str
    at: float
    evidence: dict = field(default_factory=dict)
    interval_s: Optional[float] = None

    def to_record(self) -> dict:
        """Fields for an audit ``lease`` record (``agent.record("lease", **d.to_record())``):
        ``event`` is always ``decision`` and ``decision`` names it, so a reader can count
        one decision kind without knowing every event name."""
        doc: dict[str, Any] = {"event": "decision", "decision": self.decision, "reason": self.reason,
                               "evidence": dict(self.evidence)}
        if self.interval_s is not None:
            doc["interval_s"] = self.interval_s
        return doc


def _decide(decision: str, reason: str, now: float, evidence: dict, interval_s: Optional[float] = None) -> LeaseDecision:
    LEASE_DECISIONS.labels(decision).inc()
    return LeaseDecision(decision, reason, now, evidence, interval_s)


def _r(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(float(x), 3)


# --------------------------------------------------------------------------- adaptive renewal

class AdaptiveRenewal:
    """Chooses the keepalive interval.

    Fast (``max(min_interval_s, retry_period_s / fast_divisor)``) as soon as: the etcd
    endpoint's retransmit counter rises, a stalled socket to it is seen, a keepalive takes
    ``latency_threshold_s`` or longer, or a keepalive fails. Normal again after
    ``healthy_renewals`` consecutive successful, fast keepalives with no new retransmits.
    More attempts before the renew deadline; the cost is a few more keepalives while the
    path is bad.
    """

    def __init__(self, retry_period_s: float, *, fast_divisor: float = 4.0, min_interval_s: float = 0.1,
                 latency_threshold_s: Optional[float] = None, healthy_renewals: int = 5):
        if retry_period_s <= 0 or fast_divisor < 1 or min_interval_s <= 0 or healthy_renewals < 1:
            raise ValueError("retry_period_s, min_interval_s > 0, fast_divisor >= 1, healthy_renewals >= 1")
        self.normal_s = float(retry_period_s)
        self.fast_s = min(self.normal_s, max(min_interval_s, retry_period_s / fast_divisor))
        self.latency_threshold_s = (latency_threshold_s if latency_threshold_s is not None
                                    else min(0.25, retry_period_s / 2))
        self.healthy_renewals = healthy_renewals
        self.interval_s = self.normal_s
        self.fast = False
        KEEPALIVE_INTERVAL.set(self.interval_s)
        self._healthy = 0
        self._retrans: Optional[int] = None   # last cumulative retransmit count seen
        self.held_by: Optional[str] = None    # a host condition that keeps the fast interval

    def _go_fast(self, reason: str, now: float, evidence: dict) -> Optional[LeaseDecision]:
        self._healthy = 0
        if self.fast:
            return None
        self.fast, self.interval_s = True, self.fast_s
        KEEPALIVE_INTERVAL.set(self.interval_s)
        return _decide(RENEW_FAST, reason, now, evidence, self.interval_s)

    def on_keepalive(self, ok: bool, latency_s: Optional[float], now: float) -> Optional[LeaseDecision]:
        if not ok:
            return self._go_fast("keepalive_failed", now, {"latency_s": _r(latency_s)})
        if latency_s is not None and latency_s >= self.latency_threshold_s:
            return self._go_fast("keepalive_slow", now, {"latency_s": _r(latency_s),
                                                         "threshold_s": self.latency_threshold_s})
        if not self.fast or self.held_by is not None:
            return None
        self._healthy += 1
        if self._healthy < self.healthy_renewals:
            return None
        self.fast, self.interval_s, self._healthy = False, self.normal_s, 0
        KEEPALIVE_INTERVAL.set(self.interval_s)
        return _decide(RENEW_NORMAL, "healthy", now, {"healthy_renewals": self.healthy_renewals}, self.interval_s)

    def hold_fast(self, reason: str, now: float, evidence: dict) -> Optional[LeaseDecision]:
        """Fast, and kept fast (healthy keepalives do not end it) until :meth:`release`."""
        self.held_by = reason
        return self._go_fast(reason, now, evidence)

    def release(self) -> None:
        """The hold ends; healthy keepalives bring the normal interval back as usual."""
        self.held_by = None

    def on_endpoint(self, sig: EndpointSignals, now: float) -> Optional[LeaseDecision]:
        retrans = int(sig.retransmits or 0) if sig.available else None
        prev, self._retrans = self._retrans, (retrans if retrans is not None else self._retrans)
        stalled = int(sig.stalled_sockets or 0)
        if retrans is not None and prev is not None and retrans > prev:
            return self._go_fast("etcd_retransmits", now, {"retransmits": retrans, "new": retrans - prev,
                                                           "retrans_per_s": _r(sig.retrans_per_s)})
        if stalled > 0:
            return self._go_fast("etcd_stalled_sockets", now, {"stalled_sockets": stalled})
        return None


# --------------------------------------------------------------------------- early fence

class EarlyFence:
    """Soft fence from kernel evidence that the etcd path is stalled.

    Rules (either pauses new runs):

    * ``etcd_retransmits``: the etcd endpoint's retransmit counter rose after the last
      successful renewal, and either ``progress_timeout_s`` passed since that first
      retransmit was seen with no successful renewal (the adaptive renewal asked for an
      immediate keepalive when it appeared; a healthy path answers it in milliseconds),
      or the renewal is already overdue: the last success is older than the keepalive
      interval in effect at that success plus ``overdue_margin_s`` (the keepalive that
      should have renewed is the one being retransmitted).
    * ``etcd_stalled_sockets``: a socket to etcd is stalled (SYN_SENT or unrecovered RTOs;
      the only rule in degraded mode) and the last successful renewal is older than
      ``stalled_renewal_age_s`` (default ``max(retry_period_s + progress_timeout_s,
      renew_deadline_s / 3)``).
    * ``keepalive_failed`` (optional, ``on_failure``): a keepalive failed and the last
      success is older than ``stalled_renewal_age_s``.

    Resume: only on a successful renewal that completed after the stall began.
    Time-based rules need :meth:`tick` (the daemon calls it from a timer).
    """

    def __init__(self, renew_deadline_s: float, retry_period_s: float, *, progress_timeout_s: float = 0.3,
                 stalled_renewal_age_s: Optional[float] = None, on_failure: bool = True,
                 overdue_margin_s: float = 0.2):
        if not 0 < progress_timeout_s < renew_deadline_s:
            raise ValueError("progress_timeout_s must be > 0 and < renew_deadline_s")
        self.renew_deadline_s = renew_deadline_s
        self.retry_period_s = retry_period_s
        self.progress_timeout_s = progress_timeout_s
        self.stalled_renewal_age_s = (stalled_renewal_age_s if stalled_renewal_age_s is not None
                                      else max(retry_period_s + progress_timeout_s, renew_deadline_s / 3))
        if not 0 < self.stalled_renewal_age_s < renew_deadline_s:
            raise ValueError("stalled_renewal_age_s must be > 0 and < renew_deadline_s")
        self.on_failure = on_failure
        self.overdue_margin_s = overdue_margin_s
        self.interval_s = retry_period_s          # the keepalive interval in effect (LeasePolicy keeps it)
        self._interval_at_success = retry_period_s
        self.paused = False
        self.paused_at: Optional[float] = None
        self.stall_began: Optional[float] = None
        self.last_success: Optional[float] = None
        self._retrans: Optional[int] = None          # last cumulative count seen
        self._retrans_at_success: Optional[int] = None
        self._first_retrans_at: Optional[float] = None   # first rise after the last success
        self._stalled_sockets = 0
        self._last_failure_at: Optional[float] = None
        self._last_error: Optional[str] = None

    def on_keepalive(self, ok: bool, latency_s: Optional[float], now: float,
                     error: Optional[str] = None) -> Optional[LeaseDecision]:
        if not ok:
            self._last_failure_at, self._last_error = now, error
            return self._evaluate(now)
        self.last_success = now
        self._interval_at_success = self.interval_s
        self._retrans_at_success = self._retrans
        self._first_retrans_at = None
        self._last_failure_at = None
        if self.paused and self.stall_began is not None and now > self.stall_began:
            ev = {"paused_s": _r(now - self.paused_at) if self.paused_at is not None else None,
                  "latency_s": _r(latency_s)}
            self.paused, self.paused_at, self.stall_began = False, None, None
            RUNS_PAUSED.set(0)
            return _decide(RESUME_RUNS, "renewed", now, ev)
        return None

    def on_granted(self, now: float) -> Optional[LeaseDecision]:
        """A new lease was granted (after a hard fence): it is a successful renewal."""
        return self.on_keepalive(True, None, now)

    def on_endpoint(self, sig: EndpointSignals, now: float) -> Optional[LeaseDecision]:
        if sig.available:
            retrans = int(sig.retransmits or 0)
            if (self._retrans is not None and retrans > self._retrans and self._first_retrans_at is None
                    and self.last_success is not None):
                if self._retrans_at_success is None or retrans > self._retrans_at_success:
                    self._first_retrans_at = now
            self._retrans = retrans
            if self._retrans_at_success is None and self.last_success is not None:
                self._retrans_at_success = retrans
        self._stalled_sockets = int(sig.stalled_sockets or 0)
        return self._evaluate(now)

    def tick(self, now: float) -> Optional[LeaseDecision]:
        return self._evaluate(now)

    def next_deadline(self) -> Optional[float]:
        """The earliest time a time-based rule could fire with no new event (for
        ``loop.call_at(t, tick)``); None when nothing is pending."""
        if self.paused:
            return None
        cands = []
        if self._first_retrans_at is not None:
            cands.append(self._first_retrans_at + self.progress_timeout_s)
            if self.last_success is not None:
                cands.append(self.last_success + self._interval_at_success + self.overdue_margin_s)
        if self.last_success is not None and (self._stalled_sockets > 0 or
                                              (self.on_failure and self._last_failure_at is not None)):
            cands.append(self.last_success + self.stalled_renewal_age_s)
        return min(cands) if cands else None

    def _evaluate(self, now: float) -> Optional[LeaseDecision]:
        if self.paused:
            return None
        age = None if self.last_success is None else now - self.last_success
        if self._first_retrans_at is not None:
            overdue = self._interval_at_success + self.overdue_margin_s
            waited = now - self._first_retrans_at
            if waited >= self.progress_timeout_s or (age is not None and age >= overdue):
                new = (self._retrans or 0) - (self._retrans_at_success or 0)
                return self._pause("etcd_retransmits", now, self._first_retrans_at,
                                   {"retransmits_since_renewal": new, "no_progress_s": _r(waited),
                                    "last_renewal_age_s": _r(age), "progress_timeout_s": self.progress_timeout_s,
                                    "overdue_after_s": _r(overdue)})
        if age is None:
            return None  # no lease yet: nothing to fence
        if self._stalled_sockets > 0 and age >= self.stalled_renewal_age_s:
            return self._pause("etcd_stalled_sockets", now, now,
                               {"stalled_sockets": self._stalled_sockets, "last_renewal_age_s": _r(age),
                                "threshold_s": self.stalled_renewal_age_s})
        if self.on_failure and self._last_failure_at is not None and age >= self.stalled_renewal_age_s:
            return self._pause("keepalive_failed", now, self._last_failure_at,
                               {"error": self._last_error, "last_renewal_age_s": _r(age),
                                "threshold_s": self.stalled_renewal_age_s})
        return None

    def _pause(self, reason: str, now: float, began: float, evidence: dict) -> LeaseDecision:
        self.paused, self.paused_at = True, now
        self.stall_began = min(began, now)
        RUNS_PAUSED.set(1)
        return _decide(PAUSE_RUNS, reason, now, evidence)


# --------------------------------------------------------------------------- memory pressure

@dataclass(frozen=True)
class MemoryPressure:
    """One reading. ``source``: ``psi`` (/proc/pressure/memory), ``meminfo`` (MemAvailable
    ratio only) or ``none`` (nothing readable)."""

    source: str
    some_avg10: Optional[float] = None    # % of time some task stalled on memory, last 10 s
    full_avg10: Optional[float] = None    # % of time all non-idle tasks stalled
    available_ratio: Optional[float] = None   # MemAvailable / MemTotal
    available_bytes: Optional[int] = None


def read_memory_pressure(proc: str = "/proc") -> MemoryPressure:
    """Read PSI (kernel >= 4.20 with CONFIG_PSI, not disabled by ``psi=0``) and MemAvailable.
    Never raises: missing files give None fields."""
    some = full = None
    try:
        with open(os.path.join(proc, "pressure", "memory"), encoding="ascii") as fh:
            for line in fh:
                parts = line.split()
                if not parts:
                    continue
                vals = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
                if "avg10" in vals:
                    if parts[0] == "some":
                        some = float(vals["avg10"])
                    elif parts[0] == "full":
                        full = float(vals["avg10"])
    except (OSError, ValueError):
        some = full = None
    ratio = avail = None
    try:
        info = {}
        with open(os.path.join(proc, "meminfo"), encoding="ascii") as fh:
            for line in fh:
                k, _, rest = line.partition(":")
                if k in ("MemTotal", "MemAvailable"):
                    info[k] = int(rest.split()[0]) * 1024
        if info.get("MemTotal") and "MemAvailable" in info:
            avail = info["MemAvailable"]
            ratio = avail / info["MemTotal"]
    except (OSError, ValueError, IndexError):
        pass
    source = "psi" if some is not None else ("meminfo" if ratio is not None else "none")
    return MemoryPressure(source, some, full, ratio, avail)


def memory_under_pressure(m: MemoryPressure, *, psi_some_pct: float = 40.0, psi_full_pct: float = 10.0,
                          min_available_ratio: float = 0.05) -> bool:
    """PSI when present (some avg10 >= psi_some_pct or full avg10 >= psi_full_pct), else
    MemAvailable / MemTotal below ``min_available_ratio``."""
    if m.source == "psi":
        return (m.some_avg10 or 0.0) >= psi_some_pct or (m.full_avg10 or 0.0) >= psi_full_pct
    if m.source == "meminfo" and m.available_ratio is not None:
        return m.available_ratio < min_available_ratio
    return False


# --------------------------------------------------------------------------- hand-off

class HandOff:
    """Voluntary hand-off of all shards, with hysteresis.

    Trigger (while available): ``memory_pressure``: memory under pressure
    (:func:`memory_under_pressure`) in every sample for ``memory_sustained_s``.

    Only evidence about this agent and its host may trigger it. A job's misbehaviour
    (exec-policy violations, its runs' network stalls, quota kills) is the job's and
    quarantines that job (agent/jobs/quarantine.py): fed here, one job on every agent
    would make every agent hand off and leave the cluster's shards unowned.

    Take-back: after ``cooldown_s * backoff_factor ** (n - 1)`` (capped at
    ``max_cooldown_s``; n = hand-offs within ``backoff_memory_s``) of *healthy* time:
    no memory-pressure sample. Each piece of bad evidence restarts the cool-down.
    """

    def __init__(self, *, memory_sustained_s: float = 30.0, cooldown_s: float = 60.0, backoff_factor: float = 2.0,
                 max_cooldown_s: float = 1800.0, backoff_memory_s: float = 3600.0,
                 memory_thresholds: Optional[dict] = None):
        if cooldown_s <= 0 or backoff_factor < 1 or memory_sustained_s < 0:
            raise ValueError("cooldown_s > 0, memory_sustained_s >= 0, backoff_factor >= 1")
        self.memory_sustained_s = memory_sustained_s
        self.cooldown_s = cooldown_s
        self.backoff_factor = backoff_factor
        self.max_cooldown_s = max_cooldown_s
        self.backoff_memory_s = backoff_memory_s
        self.memory_thresholds = memory_thresholds or {}
        self.available = True
        self.reason: Optional[str] = None
        self.handed_off_at: Optional[float] = None
        self.healthy_since: Optional[float] = None
        self.cooldown_now_s: float = cooldown_s
        self.last_bad: Optional[tuple[float, str]] = None
        self._pressure_since: Optional[float] = None
        self._last_memory: Optional[MemoryPressure] = None
        self._handoffs: collections.deque = collections.deque()   # times of hand-offs (within backoff_memory_s)

    # evidence ------------------------------------------------------------------------
    def _bad(self, now: float, what: str) -> None:
        self.last_bad = (now, what)
        if not self.available:
            self.healthy_since = now

    def on_memory(self, m: MemoryPressure, now: float) -> Optional[LeaseDecision]:
        self._last_memory = m
        if memory_under_pressure(m, **self.memory_thresholds):
            if self._pressure_since is None:
                self._pressure_since = now
            self._bad(now, "memory_pressure")
        else:
            if self._pressure_since is not None and not self.available:
                self.healthy_since = now   # the pressure lasted until this sample
            self._pressure_since = None
        return self._evaluate(now)

    def tick(self, now: float) -> Optional[LeaseDecision]:
        return self._evaluate(now)

    def next_deadline(self) -> Optional[float]:
        """The earliest time :meth:`tick` could decide with no new event, or None."""
        cands = []
        if self.available and self._pressure_since is not None:
            cands.append(self._pressure_since + self.memory_sustained_s)
        if not self.available and self.healthy_since is not None and self._pressure_since is None:
            cands.append(self.healthy_since + self.cooldown_now_s)
        return min(cands) if cands else None

    # decisions -----------------------------------------------------------------------
    def _evaluate(self, now: float) -> Optional[LeaseDecision]:
        while self._handoffs and self._handoffs[0] < now - self.backoff_memory_s:
            self._handoffs.popleft()
        if self.available:
            trig = self._trigger(now)
            if trig is None:
                return None
            reason, evidence = trig
            self._handoffs.append(now)
            n = len(self._handoffs)
            self.cooldown_now_s = min(self.max_cooldown_s, self.cooldown_s * self.backoff_factor ** (n - 1))
            self.available, self.reason, self.handed_off_at, self.healthy_since = False, reason, now, now
            HANDED_OFF.set(1)
            return _decide(HAND_OFF, reason, now, {**evidence, "handoffs_recent": n,
                                                    "cooldown_s": _r(self.cooldown_now_s)})
        if self._pressure_since is not None:
            self.healthy_since = now   # still under pressure right now
        if self.healthy_since is not None and now - self.healthy_since >= self.cooldown_now_s:
            ev = {"previous_reason": self.reason, "unavailable_s": _r(now - self.handed_off_at) if self.handed_off_at is not None else None,
                  "healthy_s": _r(now - self.healthy_since), "cooldown_s": _r(self.cooldown_now_s)}
            self.available, self.reason, self.healthy_since = True, None, None
            self._pressure_since = None
            HANDED_OFF.set(0)
            return _decide(TAKE_BACK, "healthy", now, ev)
        return None

    def _trigger(self, now: float) -> Optional[tuple[str, dict]]:
        if self._pressure_since is not None and now - self._pressure_since >= self.memory_sustained_s:
            m = self._last_memory
            return "memory_pressure", {"sustained_s": _r(now - self._pressure_since), "source": m.source if m else None,
                                       "some_avg10": m.some_avg10 if m else None,
                                       "full_avg10": m.full_avg10 if m else None,
                                       "available_ratio": _r(m.available_ratio) if m else None}
        return None

    def status(self) -> dict:
        return {"available": self.available, "reason": self.reason, "handed_off_at": self.handed_off_at,
                "cooldown_s": self.cooldown_now_s, "recent_handoffs": len(self._handoffs)}


# --------------------------------------------------------------------------- facade

class LeasePolicy:
    """The three policies behind one set of event methods; each returns a list of
    decisions (possibly empty) in the order they were taken."""

    def __init__(self, lease_ttl_s: float, renew_deadline_s: float, retry_period_s: float, *,
                 renewal: Optional[dict] = None, fence: Optional[dict] = None, handoff: Optional[dict] = None):
        if not (lease_ttl_s > renew_deadline_s > retry_period_s > 0):
            raise ValueError("need lease_ttl_s > renew_deadline_s > retry_period_s > 0")
        self.renewal = AdaptiveRenewal(retry_period_s, **(renewal or {}))
        self.fence = EarlyFence(renew_deadline_s, retry_period_s, **(fence or {}))
        self.handoff = HandOff(**(handoff or {}))
        self.cpu = CpuPressureRule()

    @classmethod
    def from_config(cls, etcd_cfg: EtcdConfig, **kw: Any) -> "LeasePolicy":
        return cls(etcd_cfg.lease_ttl_s, etcd_cfg.renew_deadline_s, etcd_cfg.retry_period_s, **kw)

    @staticmethod
    def _l(*ds: Optional[LeaseDecision]) -> list[LeaseDecision]:
        return [d for d in ds if d is not None]

    def on_keepalive(self, ok: bool, latency_s: Optional[float], now: float,
                     error: Optional[str] = None) -> list[LeaseDecision]:
        before = self.renewal.interval_s
        d = self.renewal.on_keepalive(ok, latency_s, now)
        # the session may already have scheduled its next keepalive with the old interval
        self.fence.interval_s = max(before, self.renewal.interval_s)
        return self._l(d, self.fence.on_keepalive(ok, latency_s, now, error=error))

    def on_granted(self, now: float) -> list[LeaseDecision]:
        return self._l(self.fence.on_granted(now))

    def on_etcd_endpoint(self, sig: EndpointSignals, now: float) -> list[LeaseDecision]:
        return self._l(self.renewal.on_endpoint(sig, now), self.fence.on_endpoint(sig, now))

    def on_memory(self, m: MemoryPressure, now: float) -> list[LeaseDecision]:
        return self._l(self.handoff.on_memory(m, now))

    def on_cpu_pressure(self, some_avg10: Optional[float], now: float) -> list[LeaseDecision]:
        """Host CPU pressure (supervision/cpupressure.py): keepalives fast while it is high
        (a starved keepalive thread leaves late), normal again after it is relieved."""
        high = self.cpu.observe(some_avg10)
        if high:
            return self._l(self.renewal.hold_fast("cpu_pressure", now, {"some_avg10": some_avg10,
                                                                        "high_pct": self.cpu.high_pct}))
        if high is False:
            self.renewal.release()
        return []

    def tick(self, now: float) -> list[LeaseDecision]:
        return self._l(self.fence.tick(now), self.handoff.tick(now))

    def next_deadline(self) -> Optional[float]:
        """When the daemon should call :meth:`tick` next at the latest (monotonic), or None.
        Re-read it after every event; a periodic tick (e.g. 0.25 s) is a fine substitute."""
        cands = [t for t in (self.fence.next_deadline(), self.handoff.next_deadline()) if t is not None]
        return min(cands) if cands else None

    @property
    def paused(self) -> bool:
        return self.fence.paused

    @property
    def available(self) -> bool:
        return self.handoff.available

    def status(self) -> dict:
        return {"keepalive_interval_s": self.renewal.interval_s, "renew_fast": self.renewal.fast,
                "runs_paused": self.fence.paused, "handoff": self.handoff.status(),
                "cpu_pressure": {"some_avg10": self.cpu.last, "high": self.cpu.high}}
