"""Sensor slots of finished runs: an exec event that reaches the loop after its run ended
names that run's job, never the next run's (agent/supervision/sensing.py)."""

from __future__ import annotations

from types import SimpleNamespace

from agent.audit.events import MemoryAudit
from agent.config import parse_config
from agent.signals.model import ExecEvent
from agent.supervision import sensing as sensing_mod
from agent.supervision.sensing import RunSensing
from tests.support.fakes import ManualClock


class _Audit(MemoryAudit):
    """MemoryAudit with the ``record`` every part writes through (jobs.seams.AuditSink)."""

    def record(self, type_: str, **fields) -> None:
        self.append(type_, **fields)


def _sensing():
    cfg = parse_config("bpf: {enabled: false}\netcd: {insecure: true}\n", "test")
    clock = ManualClock()
    audit = _Audit()
    s = RunSensing(cfg, SimpleNamespace(post=lambda fn, *a: None, clock=clock), audit)
    return s, audit, clock


def _start(s: RunSensing, job: str, pid: int):
    spec = SimpleNamespace(run_key=f"{job}/f1/1", job_id=job, fire_id=f"{job}-f1", run_id=f"{job}-f1.1",
                           attempt=1, argv=["/bin/true"])
    handle = SimpleNamespace(spec=spec, pid=pid)
    s.poststart(handle)
    return SimpleNamespace(handle=handle)


def _exec(slot: int, pid: int) -> ExecEvent:
    return ExecEvent(pid=pid, ppid=1, uid=0, gid=0, filename="/bin/date", argv=["/bin/date"], slot=slot, ts=1.0)


def test_a_late_exec_event_names_the_finished_run_not_the_next_one():
    s, audit, clock = _sensing()
    a = _start(s, "job-a", 101)
    slot_a = s.slot_of(a.handle.spec.run_key)
    s.run_ended(a)
    b = _start(s, "job-b", 102)
    slot_b = s.slot_of(b.handle.spec.run_key)
    assert slot_b != slot_a                      # a's slot waits out its quarantine
    s._on_exec(_exec(slot_a, 103))               # a's exec, delivered after a ended
    s._on_exec(_exec(slot_b, 104))
    late, live = audit.of_type("exec")
    assert (late["job"], late["run_id"], late["fire_id"], late["after_run_ended"]) == ("job-a", "job-a-f1.1", "job-a-f1", True)
    assert (live["job"], "after_run_ended" in live) == ("job-b", False)


def test_quarantined_slots_come_back_after_the_quarantine_and_early_under_pressure(monkeypatch):
    s, audit, clock = _sensing()
    s.free = [2, 1]                              # two slots in all
    a = _start(s, "job-a", 101)
    slot_a = s.slot_of(a.handle.spec.run_key)
    s.run_ended(a)
    b = _start(s, "job-b", 102)
    c = _start(s, "job-c", 103)                 # no free slot left: a's is reused early
    assert s.slot_of(c.handle.spec.run_key) == slot_a and s.slot_of(b.handle.spec.run_key) != slot_a
    assert s.ended == {}
    s.run_ended(b)
    s.run_ended(c)
    assert len(s.ended) == 2 and s.free == []
    clock.t += sensing_mod.SLOT_QUARANTINE_S + 0.1
    d = _start(s, "job-d", 104)
    assert s.slot_of(d.handle.spec.run_key) is not None
    assert len(s.ended) == 0 and len(s.free) == 1   # both expired: one taken, one free
    s._on_exec(_exec(slot_a, 105))              # long after: slot a is d's or free, never c's record
    (rec,) = audit.of_type("exec")
    assert rec["job"] in (None, "job-d") and "after_run_ended" not in rec
