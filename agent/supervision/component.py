"""Applies the health and lease policies to the running agent.

The policies (agent/supervision/health.py, agent/supervision/leasepolicy.py) are pure; this module feeds them
the agent's events (keepalive results, kernel signals, exec events, run starts and
ends, a periodic tick) and carries out what they decide:
- a stalled run is ended with reason network_stall (its retry policy applies);
- an exec outside the template's allow-list kills the run (enforce) or is recorded
  (monitor), audited either way; a kill is reported to the job quarantine (JobOffences);
- adaptive renewal changes the keepalive interval (through Renewal, the session);
- the early fence pauses new runs (through RunGate, the scheduler);
- a voluntary hand-off publishes this agent as unavailable so peers take its shards
  (through Availability, the shard manager).
Supervision decides; each owner applies the decision to its own state.

The lease policy hears only evidence about the agent itself (keepalives, the etcd path,
host memory). A job's exec violations, network stalls and quota kills are the job's: they
go to the job quarantine (agent/jobs/quarantine.py), never to the lease policy, so one job
on every agent cannot take every agent's shards away (docs/health.md).
Every decision is audited with its evidence and counted in metrics by the policies.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Optional, Protocol
from urllib.parse import urlsplit

from agent.supervision.cpupressure import read_cpu_pressure
from agent.supervision.health import ExecPolicy, JobHealth
from agent.supervision.leasepolicy import LeaseDecision, LeasePolicy, read_memory_pressure
from agent.supervision.sensing import RunSensing

if TYPE_CHECKING:
    from agent.config import Config
    from agent.jobs.firing import Firing
    from agent.jobs.seams import AuditSink
    from agent.runtime.loop import EventLoop
    from agent.signals.model import ExecEvent

log = logging.getLogger(__name__)

TICK_S = 0.25
MEMORY_EVERY_S = 5.0


class RunGate(Protocol):
    """What the decisions do to runs (the scheduler, which owns firings): stop and resume
    starting runs (early fence), and a run's changed health (kept and published)."""

    def pause(self, reason: str) -> None: ...

    def resume(self) -> None: ...

    def health_changed(self, f: Firing, state: str, rule: Optional[str]) -> None: ...


class Renewal(Protocol):
    """How often the session lease is kept alive (coordination.session.Session): adaptive
    renewal sets the interval, and a fast renewal asks for a keepalive now."""

    def set_interval(self, seconds: float) -> None: ...

    def renew_now(self) -> None: ...


class Availability(Protocol):
    """Whether this agent offers to hold shards (coordination.shards.ShardManager): a
    hand-off publishes it unavailable, so peers take its shards; take_back offers again."""

    def hand_off(self, reason: str) -> None: ...

    def take_back(self) -> None: ...


class JobOffences(Protocol):
    """Where a run's own misbehaviour goes (the job quarantine, agent/jobs/quarantine.py)."""

    def offence(self, f: Firing, cause: str) -> None: ...


class Supervision:
    """The daemon's SessionListener, a RunListener of the scheduler, an ExecListener and
    SignalListener of RunSensing (wired by agent/daemon/wiring.py). Its decisions go
    to the audit log, the gate, the renewal and the availability it is given."""

    def __init__(self, cfg: Config, loop: EventLoop, audit: AuditSink, renewal: Renewal, availability: Availability,
                 gate: RunGate, sensing: Optional[RunSensing], offences: Optional[JobOffences],
                 stopping: Callable[[], bool]):
        self.cfg = cfg
        self.loop = loop
        self.audit = audit
        self.renewal = renewal
        self.availability = availability
        self.gate = gate
        self.offences = offences
        self.sensing = sensing
        self.stopping = stopping   # True once a graceful stop began: the tick stops re-arming
        self.clock = time.monotonic
        self.policy = LeasePolicy.from_config(cfg.etcd)
        self.exec_policies = {name: ExecPolicy(t.allow_exec, cfg.bpf.mode)
                              for name, t in cfg.templates.items()}
        self.etcd_eps: set[tuple[Optional[str], int]] = set()
        for url in cfg.etcd.endpoints:
            u = urlsplit(url)
            self.etcd_eps.add((u.hostname, u.port or 2379))
        self.runs: dict[str, dict] = {}  # run_key -> {"firing", "health", "exec", "slot"}
        self._last_memory = 0.0
        self.decisions: list[dict] = []  # recent decisions, for status

    def start(self) -> None:
        self.loop.call_later(TICK_S, self._tick)

    def stop(self) -> None:
        pass  # the tick stops re-arming once the agent is stopping

    # --- decisions -----------------------------------------------------------------------
    def apply(self, decisions: Optional[list[LeaseDecision]]) -> None:
        for d in decisions or []:
            self.audit.record("lease", **d.to_record())
            self.decisions = (self.decisions + [{"decision": d.decision, "reason": d.reason}])[-10:]
            log.info("lease decision", extra={"fields": {"decision": d.decision, "reason": d.reason}})
            if d.decision in ("renew_fast", "renew_normal"):
                if d.interval_s:
                    self.renewal.set_interval(d.interval_s)
                if d.decision == "renew_fast":
                    self.renewal.renew_now()
            elif d.decision == "pause_runs":
                self.gate.pause(d.reason)
            elif d.decision == "resume_runs":
                self.gate.resume()
            elif d.decision == "hand_off":
                self.availability.hand_off(d.reason or "unhealthy")
            elif d.decision == "take_back":
                self.availability.take_back()

    # --- session -------------------------------------------------------------------------
    def session_granted(self) -> None:
        self.apply(self.policy.on_granted(self.clock()))

    def session_renewed(self, latency: float) -> None:
        self.apply(self.policy.on_keepalive(True, latency, self.clock()))

    def session_failed(self, error: str) -> None:
        self.apply(self.policy.on_keepalive(False, None, self.clock(), error=error))

    def templates_changed(self, templates: dict) -> None:
        """A reload swapped the templates: later runs get the new exec allowlists; a live
        run keeps the policy it started with."""
        self.exec_policies = {name: ExecPolicy(t.allow_exec, self.cfg.bpf.mode) for name, t in templates.items()}

    # --- runs ------------------------------------------------------------------------------
    def run_started(self, f: Firing) -> None:
        if f.handle is None:
            return
        spec = f.handle.spec
        tpl = self.cfg.templates.get(f.entry.job.template)
        slot = self.sensing.slot_of(spec.run_key) if self.sensing is not None else None
        ep = self.exec_policies.get(f.entry.job.template)
        self.runs[spec.run_key] = {
            "firing": f, "slot": slot, "run_id": spec.run_id,
            "health": JobHealth(tpl.health, self.clock(), slot=slot) if tpl else None,
            "exec": ep.for_run(spec.argv[0], job_argv=spec.argv) if ep is not None else None,
        }

    def run_ended(self, f: Firing) -> None:
        if f.handle is None:
            return
        r = self.runs.pop(f.handle.spec.run_key, None)
        if r is None:
            return
        if r["health"] is not None:
            r["health"].close()
        # the run's health is the job's evidence, not the agent's: the job quarantine reads
        # it from the firing (f.health); the lease policy never hears of it

    def exec_event(self, info: Optional[dict], ev: ExecEvent) -> Optional[str]:
        """RunSensing asks for a verdict on an exec by a job process."""
        if not info:
            return None
        r = self.runs.get(info["run_key"])
        if r is None or r["exec"] is None:
            return None
        v = r["exec"].check_event(ev)
        if v is None:
            return None
        f = r["firing"]
        self.audit.record("policy_violation", job=f.entry.job.id, run_id=r["run_id"],
                          fire_id=f.fire_id, attempt=f.attempt,
                          **v.to_record())
        log.warning("exec policy violation", extra={"fields": {"job": f.entry.job.id, "path": v.path,
                                                                "action": v.action}})
        if v.action == "kill":
            if f.handle is not None:
                f.handle.terminate("exec_policy", grace_s=0)
            if self.offences is not None:   # the job's, not the agent's: never the lease policy's
                self.offences.offence(f, "exec_policy")
        return v.verdict

    def signals(self, slots: set, endpoints: set) -> None:
        sensing = self.sensing
        assert sensing is not None  # signals come from it
        now = self.clock()
        for (h, p) in endpoints:
            if (h, p) in self.etcd_eps:   # the agent's own path; other endpoints (MQTT) decide nothing
                self.apply(self.policy.on_etcd_endpoint(sensing.sensor.endpoint_signals(h, p), now))
        for r in self.runs.values():
            if r["slot"] in slots:
                self._observe(r, now)

    def _observe(self, r: dict, now: float) -> None:
        if r["health"] is None or r["slot"] is None:
            return
        if self.sensing is None:
            return
        d = r["health"].observe(self.sensing.sensor.slot_signals(r["slot"]), now)
        if d is None:
            return
        f = r["firing"]
        self.audit.record("job", event="health", job=f.entry.job.id, run_id=r["run_id"],
                          fire_id=f.fire_id, attempt=f.attempt,
                          **d.to_record())
        self.gate.health_changed(f, d.state, d.rule)
        if d.end_run and f.handle is not None:
            f.handle.terminate("network_stall")

    # --- periodic ----------------------------------------------------------------------------
    def _tick(self) -> None:
        now = self.clock()
        self.apply(self.policy.tick(now))
        sensing = self.sensing
        if sensing is not None:
            for r in list(self.runs.values()):
                self._observe(r, now)
            if now - self._last_memory >= MEMORY_EVERY_S:
                self._last_memory = now
                self.apply(self.policy.on_memory(read_memory_pressure(), now))
                self.apply(self.policy.on_cpu_pressure(read_cpu_pressure(), now))
        if not self.stopping():
            self.loop.call_later(TICK_S, self._tick)

    def status(self) -> dict:
        st = self.policy.status()
        st["recent_decisions"] = self.decisions
        st["runs"] = {k: r["firing"].health for k, r in self.runs.items()}
        return st
