"""Supervision decides, each owner applies (agent/supervision/component.py): a lease
decision reaches the session through Renewal, the shard manager through Availability and
the scheduler through RunGate, and is audited; supervision writes no field of theirs."""

from __future__ import annotations

from types import SimpleNamespace

from agent.config import parse_config
from agent.supervision.component import Supervision
from agent.supervision.leasepolicy import LeaseDecision
from tests.support.fakes import ManualLoop


class Owners:
    """Renewal, Availability and RunGate at once: the calls, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def set_interval(self, seconds: float) -> None:
        self.calls.append(("set_interval", seconds))

    def renew_now(self) -> None:
        self.calls.append(("renew_now",))

    def hand_off(self, reason: str) -> None:
        self.calls.append(("hand_off", reason))

    def take_back(self) -> None:
        self.calls.append(("take_back",))

    def pause(self, reason: str) -> None:
        self.calls.append(("pause", reason))

    def resume(self) -> None:
        self.calls.append(("resume",))


def _supervision(stopping: list[bool]) -> tuple[Supervision, Owners, list, ManualLoop]:
    cfg = parse_config("bpf: {enabled: false}\netcd: {insecure: true}\n", "test")
    owners, records, loop = Owners(), [], ManualLoop()
    audit = SimpleNamespace(record=lambda type_, **f: records.append((type_, f)))
    sup = Supervision(cfg, loop, audit, renewal=owners, availability=owners, gate=owners, sensing=None,
                      offences=None, stopping=lambda: stopping[0])
    return sup, owners, records, loop


def test_each_decision_goes_to_its_owner_and_is_audited():
    sup, owners, records, _ = _supervision([False])
    sup.apply([LeaseDecision("renew_fast", "etcd_retransmits", 1.0, {}, 0.25),
               LeaseDecision("renew_normal", "healthy", 2.0, {}, 1.0),
               LeaseDecision("pause_runs", "keepalive_failed", 3.0),
               LeaseDecision("resume_runs", "renewed", 4.0),
               LeaseDecision("hand_off", "memory_pressure", 5.0),
               LeaseDecision("hand_off", "", 6.0),
               LeaseDecision("take_back", "healthy", 7.0)])
    assert owners.calls == [("set_interval", 0.25), ("renew_now",), ("set_interval", 1.0),
                            ("pause", "keepalive_failed"), ("resume",),
                            ("hand_off", "memory_pressure"), ("hand_off", "unhealthy"), ("take_back",)]
    assert [(t, f["decision"]) for t, f in records] == [
        ("lease", d) for d in ("renew_fast", "renew_normal", "pause_runs", "resume_runs", "hand_off", "hand_off",
                               "take_back")]
    assert [d["decision"] for d in sup.status()["recent_decisions"]][-2:] == ["hand_off", "take_back"]


def test_the_tick_stops_re_arming_once_the_agent_is_stopping():
    stopping = [False]
    sup, _, _, loop = _supervision(stopping)
    sup.start()
    assert loop.run_all() == 1 and len(loop.calls) == 1   # the tick re-armed itself
    stopping[0] = True
    assert loop.run_all() == 1 and loop.calls == []
