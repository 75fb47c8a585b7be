"""Connects the kernel sensor to job runs: slots, exec attribution, gaps.

Each live run gets a slot (1..1023) in the executor's poststart hook, while the job's
process still waits before exec, so no exec of the job is missed. Exec events come back
with their slot and become audit `exec` records naming the job, the firing and the
attempt; execs outside any job are node activity. Lost perf events become audit `gap`
records. The agent's own etcd endpoints are watched so the lease policy sees
retransmits on the coordination path.
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:
    from agent.config import Config
    from agent.execute.runs import RunHandle
    from agent.jobs.firing import Firing
    from agent.runtime.loop import EventLoop
    from agent.signals.model import ExecEvent, Gap

log = logging.getLogger(__name__)

MAX_SLOT = 1023
# A finished run's slot is not given to another run for this long: its exec events may
# still be on their way (perf buffer, poll thread, loop queue) and must name its job, not
# the next run's. Under slot pressure the oldest such slot is reused early.
SLOT_QUARANTINE_S = 10.0


class SensingAudit(Protocol):
    """The audit log as sensing writes it (agent.audit.AuditLog): records of its own, and
    the typed ``exec`` and ``gap`` helpers (agent/audit/events.py), which check the verdict
    and leave out fields that are None."""

    def record(self, type_: str, **fields: Any) -> None: ...

    def exec(self, *, pid: int, filename: str, **fields: Any) -> bool: ...

    def gap(self, *, source: str, count: int, reason: str, **fields: Any) -> bool: ...


class ExecListener(Protocol):
    """Asked for a verdict on each exec by a job process (the exec policy). Returns the
    audit verdict (``denied``, ``would_deny``) or None to leave it ``allowed``."""

    def exec_event(self, info: Optional[dict], ev: ExecEvent) -> Optional[str]: ...


class SignalListener(Protocol):
    """Told which run slots and remote endpoints have new kernel signals (health)."""

    def signals(self, slots: set, endpoints: set) -> None: ...


class RunSensing:
    """A RunListener of the scheduler and the executor's poststart hook (both wired by
    agent/daemon/wiring.py); tells its ExecListeners and SignalListeners."""

    def __init__(self, cfg: Config, loop: EventLoop, audit: SensingAudit):
        from agent.signals import Sensor

        self.cfg = cfg
        self.loop = loop
        self.audit = audit
        self.sensor = Sensor.from_config(cfg.bpf, loop.post, on_exec=self._on_exec,
                                         on_gap=self._on_gap, on_signals=self._on_signals)
        self.free = list(range(MAX_SLOT, 0, -1))
        # slots of finished runs, oldest first: slot -> (reusable at, the run's info)
        self.ended: "collections.OrderedDict[int, tuple[float, dict]]" = collections.OrderedDict()
        self.by_run_key: dict[str, int] = {}
        self.runs: dict[int, dict] = {}  # slot -> {job, run_id, fire_id, attempt, run_key, firing}
        self.exec_listeners: list[ExecListener] = []
        self.signal_listeners: list[SignalListener] = []

    # --- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        mode = self.sensor.start()
        if mode == "bpf":
            for url in self.cfg.etcd.endpoints:
                try:
                    self.sensor.watch_url(url)
                except Exception as exc:
                    log.warning("cannot watch etcd endpoint", extra={"fields": {"url": url, "error": str(exc)}})
        self.audit.record("sensor", event="started", mode=mode)

    def stop(self) -> None:
        self.sensor.stop()

    # --- runs ---------------------------------------------------------------------------
    def poststart(self, handle: RunHandle) -> None:
        """Executor hook, loop thread, before the job execs: give the run a slot."""
        spec = handle.spec
        assert handle.pid is not None   # the executor sets it before its poststart hooks run
        slot = self._take_slot()
        if slot is None:
            log.warning("no free sensor slot; run not attributed", extra={"fields": {"run": spec.run_key}})
            return
        self.by_run_key[spec.run_key] = slot
        self.runs[slot] = {"job": spec.job_id, "run_id": spec.run_id, "fire_id": spec.fire_id, "attempt": spec.attempt,
                           "run_key": spec.run_key, "argv0": spec.argv[0] if spec.argv else None,
                           "seen_job_exec": False}
        self.sensor.track(handle.pid, slot)

    def slot_of(self, run_key: str) -> Optional[int]:
        return self.by_run_key.get(run_key)

    def run_started(self, firing: Firing) -> None:
        slot = self.by_run_key.get(firing.handle.spec.run_key) if firing.handle is not None else None
        if slot is not None:
            self.runs[slot]["firing"] = firing

    def run_ended(self, firing: Firing) -> None:
        if firing.handle is None:
            return
        slot = self.by_run_key.pop(firing.handle.spec.run_key, None)
        if slot is None:
            return
        info = self.runs.pop(slot, None)
        self.sensor.untrack(slot)
        if info is None:
            self.free.append(slot)
        else:
            info.pop("firing", None)
            self.ended[slot] = (self.loop.clock() + SLOT_QUARANTINE_S, info)

    def _take_slot(self) -> Optional[int]:
        """A free slot; the oldest finished run's before its quarantine ends if none is."""
        now = self.loop.clock()
        while self.ended:
            slot, (until, _) = next(iter(self.ended.items()))
            if until > now:
                break
            del self.ended[slot]
            self.free.append(slot)
        if self.free:
            return self.free.pop()
        if self.ended:
            return self.ended.popitem(last=False)[0]
        return None

    # --- events -------------------------------------------------------------------------
    def _on_exec(self, ev: ExecEvent) -> None:
        audit = self.audit
        if ev.slot is None:
            if self.cfg.audit.node_exec:
                audit.exec(pid=ev.pid, ppid=ev.ppid, uid=ev.uid, filename=ev.filename, argv=ev.argv,
                           verdict="node", gid=ev.gid, source=ev.source)
            return
        info = self.runs.get(ev.slot)
        late = None
        if info is None and ev.slot in self.ended:
            # the run ended before its exec event reached the loop: still its job's exec;
            # the exec policy had nothing left to act on (supervision forgot the run)
            info, late = self.ended[ev.slot][1], True
        verdict = "allowed"
        for l in self.exec_listeners:
            v = l.exec_event(info, ev)
            if v:
                verdict = v
        audit.exec(pid=ev.pid, ppid=ev.ppid, uid=ev.uid, filename=ev.filename, argv=ev.argv,
                   job=info["job"] if info else None, run_id=info["run_id"] if info else None,
                   fire_id=info["fire_id"] if info else None, verdict=verdict, gid=ev.gid, attempt=info["attempt"] if info else None,
                   slot=ev.slot, source=ev.source, exec_ts=round(ev.ts, 6), after_run_ended=late)

    def _on_gap(self, gap: Gap) -> None:
        rec = gap.to_record()
        rec.pop("ts", None)
        count = rec.pop("lost", 0)
        self.audit.gap(source="bpf", count=count, reason="perf_lost" if not gap.inferred else "exec_count", **rec)

    def _on_signals(self, slots: set, endpoints: set) -> None:
        for l in self.signal_listeners:
            l.signals(slots, endpoints)

    def status(self) -> dict:
        """What the sensor does now (``bpf``, degraded, stopped), for the status document."""
        return {"mode": self.sensor.mode, "tracked_runs": len(self.runs), "lost_events": self.sensor.lost_events}
