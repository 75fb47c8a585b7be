"""Connects the kernel sensor to job runs: slots, exec attribution, gaps.

Each live run gets a slot (1..1023) in the executor's poststart hook, while the job's
process still waits before exec, so no exec of the job is missed. Exec events come back
with their slot and become audit `exec` records naming the job, the firing and the
attempt; execs outside any job are node activity. Lost perf events become audit `gap`
records. The agent's own etcd endpoints are watched so the lease policy sees
retransmits on the coordination path.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

log = logging.getLogger("millwright.sensing")

MAX_SLOT = 1023


class RunSensing:
    def __init__(self, agent: Any):
        from agent.signals import Sensor

        self.agent = agent
        self.cfg = agent.cfg
        self.sensor = Sensor.from_config(agent.cfg.bpf, agent.loop.post, on_exec=self._on_exec,
                                         on_gap=self._on_gap, on_signals=self._on_signals)
        self.free = list(range(MAX_SLOT, 0, -1))
        self.by_run_key: dict[str, int] = {}
        self.runs: dict[int, dict] = {}  # slot -> {job, run_id, attempt, run_key, firing}
        self.exec_listeners: list[Any] = []     # health: exec_event(run_info, ev)
        self.signal_listeners: list[Any] = []   # health: signals(changed_slots, changed_eps)
        agent.sensing = self
        agent.status_providers["sensor"] = self.status

    # --- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        mode = self.sensor.start()
        if mode == "bpf":
            for url in self.cfg.etcd.endpoints:
                try:
                    self.sensor.watch_url(url)
                except Exception as exc:
                    log.warning("cannot watch etcd endpoint", extra={"fields": {"url": url, "error": str(exc)}})
        self.agent.record("sensor", event="started", mode=mode)
        ex = getattr(self.agent, "executor", None)
        if ex is not None:
            ex.poststart.append(self._poststart)
        sched = getattr(self.agent, "scheduler", None)
        if sched is not None:
            sched.run_listeners.append(self)

    def stop(self) -> None:
        self.sensor.stop()

    # --- runs ---------------------------------------------------------------------------
    def _poststart(self, handle: Any) -> None:
        """Executor hook, loop thread, before the job execs: give the run a slot."""
        spec = handle.spec
        if not self.free:
            log.warning("no free sensor slot; run not attributed", extra={"fields": {"run": spec.run_key}})
            return
        slot = self.free.pop()
        self.by_run_key[spec.run_key] = slot
        self.runs[slot] = {"job": spec.job_id, "run_id": spec.run_id, "attempt": spec.attempt,
                           "run_key": spec.run_key, "argv0": spec.argv[0] if spec.argv else None,
                           "seen_job_exec": False}
        self.sensor.track(handle.pid, slot)

    def slot_of(self, run_key: str) -> Optional[int]:
        return self.by_run_key.get(run_key)

    def run_started(self, firing: Any) -> None:
        slot = self.by_run_key.get(firing.handle.spec.run_key) if firing.handle is not None else None
        if slot is not None:
            self.runs[slot]["firing"] = firing

    def run_ended(self, firing: Any) -> None:
        if firing.handle is None:
            return
        slot = self.by_run_key.pop(firing.handle.spec.run_key, None)
        if slot is None:
            return
        self.runs.pop(slot, None)
        self.sensor.untrack(slot)
        self.free.append(slot)

    # --- events -------------------------------------------------------------------------
    def _on_exec(self, ev: Any) -> None:
        audit = self.agent.audit
        if ev.slot is None:
            if self.cfg.audit.node_exec and audit is not None:
                audit.exec(pid=ev.pid, ppid=ev.ppid, uid=ev.uid, filename=ev.filename, argv=ev.argv,
                           verdict="node", gid=ev.gid, source=ev.source)
            return
        info = self.runs.get(ev.slot)
        verdict = "allowed"
        for l in self.exec_listeners:
            v = l.exec_event(info, ev)
            if v:
                verdict = v
        if audit is not None:
            audit.exec(pid=ev.pid, ppid=ev.ppid, uid=ev.uid, filename=ev.filename, argv=ev.argv,
                       job=info["job"] if info else None, run_id=info["run_id"] if info else None,
                       verdict=verdict, gid=ev.gid, attempt=info["attempt"] if info else None,
                       slot=ev.slot, source=ev.source, exec_ts=round(ev.ts, 6))

    def _on_gap(self, gap: Any) -> None:
        if self.agent.audit is not None:
            rec = gap.to_record()
            rec.pop("ts", None)
            count = rec.pop("lost", 0)
            self.agent.audit.gap(source="bpf", count=count, reason="perf_lost" if not gap.inferred else "exec_count",
                                 **rec)

    def _on_signals(self, slots: set, endpoints: set) -> None:
        for l in self.signal_listeners:
            l.signals(slots, endpoints)

    def status(self) -> dict:
        return {"mode": self.sensor.mode, "tracked_runs": len(self.runs), "lost_events": self.sensor.lost_events}
