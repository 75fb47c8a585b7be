"""Peers' statuses (agent/cloud/peers.py) and what Answers believes of them: bounded on the
link's thread (size before parsing, a rate per agent, a bounded queue that drops the new),
and a status counts as delivered only under its marker's writer's own prefix."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

from agent.cloud.answers import SEEN_MARGIN_S, Answers
from agent.cloud.facts import marker_writer, marker_writers
from agent.cloud.peers import MIN_COST, PeerStatuses
from agent.cloud.topics import Topics
from agent.runtime.timefmt import format_rfc3339
from tests.support.fakes import ManualClock
from tests.support.link import FakeLink, message

T = Topics("t", "me")


class World:
    def __init__(self, **kw):
        self.link = FakeLink()
        self.saw: list = []
        self.missed: list = []
        self.records: list = []
        self.clock = ManualClock()
        self.peers = PeerStatuses(T, self.link, saw=lambda a, d: self.saw.append((a, d)), missed=self.missed.append,
                                  record=lambda *a, **k: self.records.append((a, k)), clock=self.clock, **kw)

    def status(self, agent: str, doc: dict, pad: int = 0) -> None:
        body = dict(doc, pad="x" * pad) if pad else doc
        self.peers.on_message(message(T.status(doc.get("job_id"), agent), json.dumps(body).encode()))

    def drain(self) -> None:
        while self.peers._q:
            self.peers.handle(*self.peers._q.popleft())


def test_a_status_too_large_is_dropped_before_parsing_and_makes_its_agent_missed():
    w = World(max_bytes=1000)
    w.status("gw", {"job_id": "j", "state": "succeeded", "run_id": "f.1", "fire_id": "f"}, pad=2000)
    w.status("a2", {"job_id": "j", "state": "succeeded", "run_id": "f.1", "fire_id": "f"})
    w.drain()
    assert w.missed == ["gw"] and [a for a, _ in w.saw] == ["a2"] and len(w.link.acked) == 2


def test_a_flooding_agent_is_rate_limited_alone():
    w = World(rate=10 * MIN_COST, burst=5 * MIN_COST)  # bytes: a small status costs MIN_COST
    for i in range(50):
        w.status("gw", {"job_id": f"j{i}", "state": "accepted", "push_sha256": "ab"})
    w.status("a2", {"job_id": "k", "state": "accepted", "push_sha256": "ab"})
    w.drain()
    assert [a for a, _ in w.saw].count("gw") == 5 and ("a2", {"job_id": "k", "state": "accepted",
                                                              "push_sha256": "ab"}) in w.saw
    assert w.missed == ["gw"]  # told once per half second: the drops' times are covered by its margin
    w.clock.t += 1.0  # ten more small statuses' worth, of which the burst keeps five
    for i in range(20):
        w.status("gw", {"job_id": f"late{i}", "state": "accepted", "push_sha256": "ab"})
    w.status("gw", {"job_id": "big", "state": "accepted"}, pad=20000)
    w.drain()
    assert [a for a, _ in w.saw].count("gw") == 10 and w.missed == ["gw", "gw"]
    w.clock.t += 1.0  # ten small statuses' worth: not enough for a 20 KiB status, which costs its length
    w.status("gw", {"job_id": "big", "state": "accepted"}, pad=20000)
    w.drain()
    assert [a for a, _ in w.saw].count("gw") == 10


def test_a_full_queue_drops_the_new_status_and_never_blocks_the_link():
    w = World(queue_max=3)
    for i in range(10):
        w.status(f"a{i}", {"job_id": "j", "state": "accepted", "push_sha256": "ab"})
    assert w.peers.depth == 3 and w.missed == [f"a{i}" for i in range(3, 10)] and len(w.link.acked) == 10


def test_drops_are_reported_in_the_audit_log_per_agent_and_reason():
    w = World(max_bytes=100, rate=0.0, burst=1024.0)  # the large status costs its ~530 bytes, a small one MIN_COST
    w.status("gw", {"job_id": "j"}, pad=500)
    w.status("gw", {"job_id": "j"})
    w.status("gw", {"job_id": "j"})   # over its rate
    w.peers.report()
    assert sorted((k["reason"], k["count"]) for _, k in w.records) == [("rate_limited", 1), ("too_large", 1)]
    w.peers.report()
    assert len(w.records) == 2  # reported once


def test_junk_and_other_topics_never_reach_answers():
    w = World()
    w.peers.on_message(message("millwright/t/agents/a b/status/x", b"{}"))
    w.peers.on_message(message(T.status("j", "a2"), b"not json"))
    w.peers.on_message(message(T.status("j", "a2"), b"[1]"))
    w.drain()
    assert w.saw == [] and w.missed == []


def _answers(reading_since: float = 100.0) -> Answers:
    """Connected and subscribed to a1's and a2's statuses since ``reading_since`` seconds ago."""
    a = Answers(None, None, "me", enqueue=lambda *a: None, in_outbox=lambda k: False, owned=frozenset,
                fence_for=lambda s: None)
    a.watching_since = time.time() - reading_since
    a._reading.update({"a1": a.watching_since, "a2": a.watching_since})
    return a


def _doc(age_s: float, **kw) -> dict:
    ts = format_rfc3339(datetime.fromtimestamp(time.time() - age_s, timezone.utc))
    return dict({"job_id": "j", "state": "succeeded", "run_id": "f.1", "fire_id": "f", "agent": "a1", "ts": ts}, **kw)


def test_delivered_only_when_seen_under_the_markers_writer():
    a = _answers()
    marker = _doc(10)
    now = time.time()
    assert a._seen_or_known_missing(("a1",), "j", "run.f", marker, now) is False  # subscribed long before: missing
    a.saw("gw", _doc(0))                        # a gateway's fake `succeeded` about a1's run
    assert a._seen_or_known_missing(("a1",), "j", "run.f", marker, now) is False
    a.saw("a1", _doc(0))                        # a1's own, under its own prefix
    assert a._seen_or_known_missing(("a1",), "j", "run.f", marker, now) is True


def test_a_missed_status_of_the_writer_makes_its_older_answers_unknown():
    a = _answers()
    a.missed("a1")
    now = time.time()
    assert a._seen_or_known_missing(("a1",), "j", "run.f", _doc(10), now) is None     # may have been the dropped one
    assert a._seen_or_known_missing(("a2",), "j", "run.f", _doc(10, agent="a2"), now) is False  # others: as before
    later = now + 10 + SEEN_MARGIN_S
    assert a._seen_or_known_missing(("a1",), "j", "run.f", _doc(-2), later) is False  # written after the drop


def test_the_markers_writer_is_who_last_published_it():
    assert marker_writer({"agent": "a1"}) == "a1"
    assert marker_writer({"agent": "a1", "published_by": "a2"}) == "a2"
    assert marker_writer({"agent": "a b"}) is None and marker_writer({}) is None
    assert marker_writers({"agent": "a1", "published_by": "a2"}) == ("a1", "a2")
    assert marker_writers({"agent": "a1", "published_by": "a1"}) == ("a1",)


def test_a_republished_answer_is_delivered_when_either_writer_delivered_it():
    a = _answers()
    marker = _doc(10, published_by="a2")   # a1 decided it, a2 republished it (and died too)
    now = time.time()
    assert a._seen_or_known_missing(("a1", "a2"), "j", "run.f", marker, now) is False
    a.saw("a1", _doc(5))                   # a1 had delivered it after all
    assert a._seen_or_known_missing(("a1", "a2"), "j", "run.f", marker, now) is True
    b = _answers()
    b.missed("a2")                         # a status of the republisher went unread
    assert b._seen_or_known_missing(("a1", "a2"), "j", "run.f", marker, now) is None


def test_ten_thousand_large_statuses_cost_the_link_thread_no_parsing():
    w = World()
    body = json.dumps({"job_id": "j", "state": "accepted", "agent": "a1", "pad": "x" * 8000}).encode()
    for i in range(10000):
        w.peers.on_message(message(T.status("j", "gw"), body, mid=i))
    assert w.saw == [] and len(w.link.acked) == 10000   # nothing parsed on the link's thread, all acknowledged
    # queued: the gateway's burst of bytes, within the queue's bytes; the rest dropped
    assert w.peers.depth == min(int(w.peers.burst), w.peers.queue_bytes) // len(body)
    assert w.missed == ["gw"]


def test_only_the_statuses_of_a_writer_it_reads_tell_an_answer_missing():
    a = _answers()
    now = time.time()
    assert a._seen_or_known_missing(("a3",), "j", "run.f", _doc(10, agent="a3"), now) is None  # never subscribed
    a.reading("a3")
    assert a._seen_or_known_missing(("a3",), "j", "run.f", _doc(10, agent="a3"), now) is None  # before it
    later = now + 10 + SEEN_MARGIN_S
    assert a._seen_or_known_missing(("a3",), "j", "run.f", _doc(-2, agent="a3"), later) is False
    a.not_reading("a1")                                  # unsubscribed (a flood's cool-off)
    assert a._seen_or_known_missing(("a1",), "j", "run.f", _doc(10), now) is None
    assert a._seen_or_known_missing(("a1", "a2"), "j", "run.f", _doc(10, published_by="a2"), now) is None
    a.saw("a1", _doc(0))
    assert a._seen_or_known_missing(("a1",), "j", "run.f", _doc(10), now) is True  # what it saw stays seen
