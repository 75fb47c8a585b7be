"""The cloud component's seams: it is built from the values it uses (no daemon), reads
ownership and members through them, and registers nothing itself (the wiring does)."""

from __future__ import annotations

import pytest

from agent.cloud.component import CloudComponent
from agent.config import parse_config
from agent.coordination.etcd import EtcdClient
from agent.coordination.keys import Keys
from agent.coordination.shards import Member
from agent.errors import UserError
from agent.jobs.signing import KeyRing


class FakeLoop:
    """Keeps what is posted; ``run()`` runs it, as the loop thread would."""

    def __init__(self):
        self.posted: list = []

    def post(self, fn, *args):
        self.posted.append((fn, args))

    def call_later(self, delay, fn, *args):
        self.posted.append((fn, args))

    def run(self):
        posted, self.posted = self.posted, []
        for fn, args in posted:
            fn(*args)


class FakeOwnership:
    def __init__(self, owned):
        self.owned = frozenset(owned)

    def fence_snapshot(self, shard):
        return f"fence-{shard}" if shard in self.owned else None


class Audit:
    def __init__(self):
        self.records: list = []

    def record(self, type_, **fields):
        self.records.append((type_, fields))


class Listener:
    def __init__(self):
        self.stored: list = []
        self.cancelled: list = []

    def job_stored(self, stored):
        self.stored.append(stored)

    def job_cancelled(self, job_id):
        self.cancelled.append(job_id)


def build(state_dir, members=(), listeners=None, extra=""):
    cfg = parse_config(f"cluster: t\nagent_id: gw-1\nstate_dir: {state_dir}\n"
                       "etcd: {insecure: true}\nmqtt: {insecure: true}\n" + extra)
    loop, audit = FakeLoop(), Audit()
    listeners = [] if listeners is None else listeners
    part = CloudComponent(cfg, loop, EtcdClient(cfg.etcd), Keys(cfg.cluster), ownership=FakeOwnership({3}),
                          members=lambda: list(members), audit=audit, keyring=KeyRing({}, source="none"),
                          job_listeners=listeners)
    return part, loop, audit


def test_ownership_answers_for_ingest_and_dispatch(tmp_path):
    part, _, _ = build(tmp_path)
    try:
        assert part._fence_for(3) == "fence-3" and part._fence_for(4) is None
        assert part.dispatcher.owned() == frozenset({3}) and part.answers.owned() == frozenset({3})
    finally:
        part.outbox.close()


def test_members_come_through_the_callable(tmp_path):
    members = [Member("gw-1", 1.0, True, 1, {"line": "2"}, frozenset({"b", "a"})),
               Member("gw-2", 1.0, False, 2)]
    part, _, _ = build(tmp_path, members)
    try:
        assert part._members() == {"gw-1": {"labels": {"line": "2"}, "templates": ["a", "b"], "available": True},
                                   "gw-2": {"labels": {}, "templates": [], "available": False}}
    finally:
        part.outbox.close()


def test_job_listeners_registered_later_are_told_on_the_loop(tmp_path):
    listeners: list = []
    part, loop, audit = build(tmp_path, listeners=listeners)
    try:
        late = Listener()
        listeners.append(late)   # the scheduler registers after the cloud component is built
        part._notify("stored", "job-a")
        part._notify("cancelled", "job-b")
        assert late.stored == [] and late.cancelled == []   # posted, not called on the ingest thread
        loop.run()
        assert late.stored == ["job-a"] and late.cancelled == ["job-b"]
        part._record_later("mqtt", event="outbox_write_failed")
        assert audit.records == []
        loop.run()
        assert audit.records == [("mqtt", {"event": "outbox_write_failed"})]
    finally:
        part.outbox.close()


def test_status_and_gate_topics_are_public(tmp_path):
    part, _, _ = build(tmp_path, extra="templates:\n  g:\n    argv: [/bin/true]\n"
                                       "    gates: {line: {mqtt: plant/line2/state, equals: stopped}}\n")
    try:
        assert part.gate_topics.topics == {"plant/line2/state"}   # what the wiring hands the gates
        assert part.link.subscriptions["plant/line2/state"] == 1
        assert part.status()["keys"] == [] and part.status()["connected"] is False
    finally:
        part.outbox.close()


def test_an_outbox_it_cannot_open_is_a_user_error(tmp_path):
    (tmp_path / "mqtt-outbox.sqlite").mkdir()
    with pytest.raises(UserError, match="cannot open the status outbox"):
        build(tmp_path)


def test_the_agent_subscribes_to_no_status_and_drops_a_stray_one(tmp_path):
    """One connection per agent, which reads no agent's statuses: none is subscribed (the
    wildcard an older agent's session holds is unsubscribed), and a status that still
    arrives (an older agent's per-member subscription) is acknowledged unread, counted and
    its subscription dropped, once per agent."""
    from agent.cloud.link import Message
    from tests.support.link import FakeLink

    part, _, _ = build(tmp_path)
    try:
        assert not [t for t in part.link.subscriptions if "/status/" in t]
        part.link = FakeLink()
        for mid in (1, 2):
            part._message(Message("millwright/t/agents/gw-2/status/j1", b'{"state":"succeeded"}', 1, mid,
                                  dup=False, generation=1, received=0.0))
        assert [m.mid for m in part.link.acked] == [1, 2] and part.status()["statuses_received"] == 2
        assert part.link.unsubscribed == ["millwright/t/agents/gw-2/status/+"]
    finally:
        part.outbox.close()


def test_every_answer_carries_its_name(tmp_path):
    """The cloud dedupes answers on (job_id, answer): the status sink adds ``answer`` to an
    answer (a run's final status here), and to nothing else."""
    part, loop, _ = build(tmp_path)
    try:
        part.status_sink({"job_id": "j1", "fire_id": "f1", "state": "succeeded", "_answer": "/k"})
        part.status_sink({"job_id": "j1", "fire_id": "f1", "state": "running"})
        (_, final, marker), (_, running, _) = part._statuses
        assert final["answer"] == "run.f1" and "_answer" not in final and marker == "/k"
        assert "answer" not in running
    finally:
        part.outbox.close()
