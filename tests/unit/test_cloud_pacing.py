"""Issue 50, section 3: the pacer (agent/cloud/pacing.py) and the outbox's coalescing of
superseded statuses while it is behind (agent/cloud/outbox.py), with a fake clock."""

from __future__ import annotations

import json
import random
import sqlite3

import pytest

from agent.cloud.link import Link
from agent.cloud.outbox import Outbox, OutboxPublisher, coalesce_key, supersedes, window_for
from agent.cloud.outboxwriter import OutboxWriter
from agent.cloud.pacing import PacedLink, Pacer, cap_for, paced
from agent.cloud.topics import Topics
from agent.runtime.metrics import sample
from tests.support.link import FakeLink


class Clock:
    """A monotonic clock that moves only when told (or when a pacer sleeps on it)."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def pacer(rate: float = 100.0, clock: Clock | None = None) -> tuple[Pacer, Clock]:
    c = clock or Clock()
    return Pacer(rate, clock=c, sleep=c.sleep), c


def most_in_any_second(times: list[float], window: float = 1.0) -> int:
    """The most of ``times`` in any window [t, t + window), wherever it starts (a window
    holding the most starts at one of the times)."""
    times = sorted(times)
    best, j = 0, 0
    for i, t in enumerate(times):
        while times[j] <= t - window:
            j += 1
        best = max(best, i - j + 1)
    return best


def test_the_cap_is_95_percent_of_the_rate_floored():
    assert cap_for(100) == 95
    assert cap_for(10) == 9
    assert cap_for(1) == 1 and cap_for(0.5) == 1
    p, _ = pacer(100)
    assert (p.cap, p.reserve, p.get_cap, p.burst) == (95, 2, 19, 10)


def test_no_second_ever_holds_more_than_the_cap():
    """Flat out, in bursts, and in a random mix of kinds: never more than the cap in any
    second, wherever the second starts (a token bucket allows rate plus burst)."""
    p, clock = pacer(100)
    times: list[float] = []
    kinds: list[str] = []
    rnd = random.Random(50)
    for _ in range(3000):   # about 30 s of fake time, taking as fast as the pacer allows
        kind = rnd.choices(("status", "get", "presence"), weights=(80, 18, 2))[0]
        kinds.append(kind)
        if rnd.random() < 0.05:
            clock.t += rnd.random() * 0.7   # an idle spell: the next burst comes on a full budget
        p.take(kind)
        times.append(clock())
    assert most_in_any_second(times) <= p.cap == 95
    assert most_in_any_second(times) >= p.cap - p.reserve   # and the budget is used
    # spread over the second: a tenth of the cap in any tenth (presence aside)
    spread = [t for t, k in zip(times, kinds) if k != "presence"]
    assert most_in_any_second(spread, 0.1) <= p.burst
    # the exact boundary: a slot taken at t still counts at t + 0.999..., not at t + 1
    q, c2 = pacer(10)
    for _ in range(q.cap):
        assert q.try_take("presence")
    assert not q.try_take("presence")
    c2.t += 0.999999
    assert not q.try_take("presence")
    c2.t += 0.000001
    assert q.try_take("presence")


def test_presence_comes_first():
    """The others leave the reserve free: presence is published at once over a full log."""
    p, clock = pacer(100)
    first = clock()
    for _ in range(p.cap - p.reserve):
        p.take("status")
    assert p.room("status") == 0 and p.room("get") == 0 and p.free_in("status") > 0
    before = clock()
    p.take("presence")
    p.take("presence")
    assert clock() == before   # never waited
    # a third presence in the same second waits for the oldest slot rather than pass the cap
    p.take("presence")
    assert clock() == pytest.approx(first + 1.0)


def test_jobs_get_replies_take_at_most_a_fifth():
    p, clock = pacer(100)
    times = []
    for _ in range(200):
        p.take("get")
        times.append(clock())
    assert most_in_any_second(times) <= p.get_cap == 19
    # a flood of gets leaves the statuses their room
    q, c2 = pacer(100)
    for _ in range(19):
        q.take("get")
    c2.t += 0.1
    assert q.taken["get"] == 19 and q.room("status") == 10   # the statuses' spread, not the gets', limits them
    assert q.room("get") == 0 and 0 < q.free_in("get") <= 1.0
    for _ in range(q.cap - q.reserve - 19):
        q.take("status")
    assert q.taken["status"] == 74


def test_no_rate_means_no_pacer_and_no_wrapper():
    link = FakeLink()
    same, p = paced(link, None, Topics("c", "a").kind)
    assert same is link and p is None


def test_paced_link_classes_publishes_by_topic_and_is_a_link():
    topics = Topics("c", "a")
    inner = FakeLink()
    clock = Clock()
    p = Pacer(100, clock=clock, sleep=clock.sleep)
    link = PacedLink(inner, p, topics.kind)
    assert isinstance(link, Link)
    link.publish(topics.presence(), b"{}", 1, True)
    link.publish(topics.get_reply("x"), b"{}", 1)
    link.publish(topics.status("j"), b"{}", 1)
    link.publish(topics.checkpoint(), b"{}", 1)
    assert p.taken == {"presence": 1, "get": 1, "status": 2}
    assert [t for _, t, _ in inner.sent] == [topics.presence(), topics.get_reply("x"), topics.status("j"),
                                             topics.checkpoint()]
    inner.connected = False
    assert not link.connected
    link.connected = True
    assert inner.connected and link.client_id == inner.client_id


def status(job: str, fire: str, state: str, **extra) -> dict:
    return {"v": 1, "job_id": job, "fire_id": fire, "state": state, **extra}


def paced_publisher(tmp_path):
    """An outbox published over a fake link paced at 100/s on a fake clock."""
    topics = Topics("c", "a")
    ob = Outbox(str(tmp_path / "o.sqlite"), 10000)
    inner = FakeLink()
    clock = Clock()
    p = Pacer(100, clock=clock, sleep=clock.sleep)
    pub = OutboxPublisher(ob, PacedLink(inner, p, topics.kind), window=window_for(100), pacer=p)
    return topics, ob, inner, clock, p, pub


def test_publisher_takes_no_more_rows_than_the_pacer_has_room_for(tmp_path):
    topics, ob, inner, clock, p, pub = paced_publisher(tmp_path)
    for i in range(300):
        ob.enqueue(topics.status(f"j{i}"), status(f"j{i}", "f", "succeeded"))
    sent_at: list[float] = []
    for _ in range(2000):
        n = len(inner.sent)
        pub.step()
        sent_at += [clock()] * (len(inner.sent) - n)
        for mid, _, _ in inner.sent[n:]:
            pub.on_publish(mid)   # the broker acknowledges at once
        clock.t += 0.01
    assert len(inner.sent) == 300 and ob.depth == 0
    assert most_in_any_second(sent_at) <= 95
    assert clock() == pytest.approx(1000.0 + 20.0)   # the fake clock only moved by the loop: never slept
    assert window_for(100) == 100 and window_for(1000) == 256


# --- coalescing -------------------------------------------------------------------------------------

def states_of(ob: Outbox) -> list[tuple[str, str]]:
    return [(d.get("job_id"), d.get("state")) for d in (json.loads(p) for _, _, p, _ in ob.batch(0, 100000))]


def test_coalesce_key_only_for_intermediate_statuses_without_a_marker():
    assert supersedes(status("j", "f1", "succeeded"), "answers/0/j/run.f1") == "j/f1"
    assert supersedes(status("j", "f1", "running"), None) == "j/f1"
    assert supersedes(status("j", "f1", "rejected"), None) is None
    assert supersedes({"v": 1, "job_id": "j", "state": "failed"}, None) is None
    assert coalesce_key(status("j", "f1", "running"), None) == "j/f1"
    for st in ("scheduled", "waiting", "retrying", "in_progress"):
        assert coalesce_key(status("j", "f1", st), None) == "j/f1"
    for st in ("succeeded", "failed", "timed_out", "killed", "cancelled", "misfired", "aborted", "accepted",
               "rejected", "waiting_approval"):
        assert coalesce_key(status("j", "f1", st), None) is None
    assert coalesce_key(status("j", "f1", "running"), "answers/0/j/run.f1") is None   # an answer
    assert coalesce_key({"v": 1, "job_id": "j", "state": "scheduled"}, None) is None   # no firing
    assert coalesce_key({"v": 1, "agent": "a", "checkpoint": 3}, None) is None


def test_coalescing_only_while_behind_and_never_finals_answers_or_sent_rows(tmp_path):
    seen: list[int] = []
    ob = Outbox(str(tmp_path / "o.sqlite"), 10000, coalesce_above=6, on_coalesce=seen.append)
    before = sample("millwright_mqtt_outbox_coalesced_total") or 0.0
    # not behind: nothing coalesced
    ob.enqueue("t/a", status("a", "f1", "scheduled"))
    ob.enqueue("t/a", status("a", "f1", "running"))
    assert ob.depth == 2 and not seen
    # rows already handed to the broker are never touched
    ob.mark_sent([s for s, *_ in ob.batch(0, 10)])
    ob.enqueue("t/b", status("b", "f1", "running"), marker="answers/0/b/run.f1")   # an answer
    ob.enqueue("t/b", status("b", "f1", "succeeded"))
    ob.enqueue("t/x", {"v": 1, "agent": "a", "checkpoint": 1})
    ob.enqueue("t/c", status("c", "f1", "scheduled"))
    ob.enqueue("t/c", status("c", "f2", "scheduled"))   # another firing of the job
    assert ob.depth == 7 and not seen
    # behind (depth > 6): each new intermediate status deletes its firing's older unsent ones
    ob.enqueue("t/c", status("c", "f1", "running"))
    ob.enqueue("t/a", status("a", "f1", "retrying"))     # a's older rows were sent: kept
    ob.enqueue("t/b", status("b", "f1", "running"))      # b's answer and final: kept
    ob.enqueue("t/c", status("c", "f1", "succeeded"))    # a final supersedes its firing's running
    got = states_of(ob)
    # c/f1's scheduled and running are gone; c/f2's scheduled (another firing of the job) stays
    assert got == [("a", "scheduled"), ("a", "running"), ("b", "running"), ("b", "succeeded"), (None, None),
                   ("c", "scheduled"), ("a", "retrying"), ("b", "running"), ("c", "succeeded")]
    assert sum(seen) == 2 and ob.depth == len(got) == 9
    # the batch form does the same, in its one transaction; a final with its answer marker too
    ob.enqueue_many([("t/c", status("c", "f2", "waiting"), None), ("t/c", status("c", "f2", "running"), None),
                     ("t/c", status("c", "f2", "failed"), "answers/0/c/run.f2")])
    got = states_of(ob)
    assert [s for j, s in got if j == "c"] == ["succeeded", "failed"]
    assert sum(seen) == 5 and ob.depth == len(got) == 9
    assert sample("millwright_mqtt_outbox_coalesced_total") == before + 5
    # every final and every answer is still there
    assert ("b", "succeeded") in got and ("c", "succeeded") in got and ("c", "failed") in got
    markers = {m for m, _ in ob.markers_of([s for s, *_ in ob.batch(0, 100)])}
    assert markers == {"answers/0/b/run.f1", "answers/0/c/run.f2"}
    # reopened: the depth counts what is left
    ob.close()
    assert Outbox(str(tmp_path / "o.sqlite"), 10000).depth == len(got)


def test_an_outbox_file_from_before_coalescing_is_migrated(tmp_path):
    path = str(tmp_path / "old.sqlite")
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE outbox (seq INTEGER PRIMARY KEY, topic TEXT NOT NULL, payload BLOB NOT NULL, "
               "keep INTEGER NOT NULL, sent INTEGER NOT NULL DEFAULT 0, ts REAL NOT NULL, "
               "held INTEGER NOT NULL DEFAULT 0, marker TEXT)")
    db.execute("CREATE TABLE meta (k TEXT PRIMARY KEY, v INTEGER NOT NULL)")
    db.execute("INSERT INTO outbox (seq, topic, payload, keep, ts) VALUES (1, 't/a', ?, 0, 0)",
               (json.dumps({**status("a", "f1", "running"), "seq": 1}).encode(),))
    db.execute("INSERT INTO meta VALUES ('seq', 1)")
    db.commit()
    db.close()
    ob = Outbox(path, 1000, coalesce_above=0)
    cols = [r[1] for r in ob._db.execute("PRAGMA table_info(outbox)")]
    assert "coalesce" in cols
    assert ob.depth == 1
    # the old row has no key: it is sent as it was; new rows coalesce among themselves
    ob.enqueue("t/a", status("a", "f1", "retrying"))
    ob.enqueue("t/a", status("a", "f1", "running"))
    ob.enqueue("t/a", status("a", "f1", "succeeded"))
    assert [json.loads(p)["seq"] for _, _, p, _ in ob.batch(0, 10)] == [1, 4]
    assert states_of(ob) == [("a", "running"), ("a", "succeeded")]
    ob.close()
    Outbox(path, 1000).close()   # opened again: the migration is idempotent


def test_the_writer_reports_coalescing_as_one_gap_record(tmp_path):
    records: list[tuple[str, dict]] = []
    ob = Outbox(str(tmp_path / "o.sqlite"), 1000, coalesce_above=1)
    writer = OutboxWriter(ob, schedule=lambda d, fn: None, record=lambda t, **f: records.append((t, f)))
    ob.on_coalesce = writer.coalesced
    writer.write([("t/a", status("a", "f1", st), None) for st in ("scheduled", "waiting", "running")])
    writer.write([("t/a", status("a", "f1", "retrying"), None), ("t/a", status("a", "f1", "running"), None)])
    writer.flush_gap()
    writer.flush_gap()
    # behind past one row: the third of the first batch deletes the two before it, the
    # second batch's running deletes them again; one record for the four
    assert records == [("gap", {"source": "mqtt_outbox", "count": 4, "reason": "coalesced"})]
    assert states_of(ob) == [("a", "running")]


def test_what_paho_resends_at_a_reconnect_is_charged_and_fits_in_a_second(tmp_path):
    topics, ob, inner, clock, p, pub = paced_publisher(tmp_path)
    assert pub.window == p.cap - p.reserve == 93
    for i in range(50):
        ob.enqueue(topics.status(f"j{i}"), status(f"j{i}", "f", "succeeded"))
    for _ in range(10):
        pub.step()
        clock.t += 0.1
    assert len(inner.sent) == 50   # none acknowledged: all 50 in flight
    clock.t += 5.0
    assert p.room() == 10
    inner.connected = False
    pub.step()
    inner.connected = True   # paho sent the 50 again at the connect
    pub.step()
    assert p.taken["status"] == 100 and p.room() == 0   # the 50 charged: in this tenth of a second, and
    clock.t += 0.1
    assert p.room() == 10
    clock.t += 0.5
    assert p.room() == 10 and p.room("presence") == p.cap - 50   # ... in this second
    clock.t += 0.4
    assert p.room("presence") == p.cap


def test_the_component_paces_only_a_profile_with_a_publish_rate(tmp_path):
    from agent.cloud.component import CloudComponent
    from agent.config import parse_config
    from agent.coordination.etcd import EtcdClient
    from agent.coordination.keys import Keys
    from agent.jobs.signing import KeyRing

    class Ownership:
        owned: frozenset = frozenset()

        def fence_snapshot(self, shard):
            return None

    class Loop:
        def post(self, fn, *args):
            pass

        def record(self, type_, **fields):   # the audit sink too
            pass

        def call_later(self, delay, fn, *args):
            pass

    def build(profile: str, d):
        cfg = parse_config(f"cluster: t\nagent_id: gw-1\nstate_dir: {d}\netcd: {{insecure: true}}\n"
                           f"mqtt: {{insecure: true, profile: {profile}}}\n")
        return CloudComponent(cfg, Loop(), EtcdClient(cfg.etcd), Keys(cfg.cluster), ownership=Ownership(),
                              members=list, audit=Loop(), keyring=KeyRing({}, source="none"), job_listeners=[])

    aws = build("aws-iot-core", tmp_path / "aws")
    plain = build("mosquitto", tmp_path / "plain")
    try:
        assert isinstance(aws.link, PacedLink) and aws.pacer is aws.link.pacer and aws.pacer.cap == 95
        assert aws.publisher.pacer is aws.pacer and aws.publisher.window == 93
        assert aws.outbox.coalesce_above == 200 and aws.outbox.on_coalesce == aws.writer.coalesced
        assert plain.pacer is None and not isinstance(plain.link, PacedLink)
        assert plain.publisher.pacer is None and plain.publisher.window == 256
        assert plain.outbox.coalesce_above is None
    finally:
        aws.outbox.close()
        plain.outbox.close()
