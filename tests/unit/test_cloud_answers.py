"""Unit tests of issue 17's pure parts: answer-marker decisions, outbox markers and the
hold knob, the jobs/get topics, the job read model, the stderr tail (jobs/get requests:
tests/unit/test_cloud_queries.py)."""

from __future__ import annotations

import sqlite3
from datetime import datetime, timedelta, timezone

import pytest

from agent.cloud.answers import KEEP_S, decide
from agent.cloud.outbox import Outbox, OutboxPublisher
from agent.cloud.topics import Topics
from agent.execute.runs import STDERR_TAIL_BYTES
from agent.jobs import view
from tests.support.link import FakeLink
from tests.support.processes import stderr_tail

T = Topics("c")


@pytest.mark.parametrize("alive,in_outbox,age,want", [
    (False, False, 1.0, "republish"),         # writer died before delivering: the owner publishes
    (True, False, 1.0, "skip"),               # writer alive, still on its way
    (True, False, 31.0, "republish"),         # writer alive but stuck for too long
    (False, True, 1.0, "skip"),               # already in this agent's outbox
    (True, True, 100.0, "skip"),
    (False, False, KEEP_S + 1, "expire"),     # the bound: nothing is kept for ever
    (True, True, KEEP_S + 1, "expire"),
])
def test_answer_marker_decision(alive, in_outbox, age, want):
    assert decide({"job_id": "j"}, alive, in_outbox, age, republish_after_s=30.0) == want


def test_a_republished_copy_is_a_redelivery_unless_never_handed():
    """No ``handed`` stamp means the first answer was never sent: the republished copy is
    the first (unmarked); a stamped marker's copy may repeat one (``redelivery``)."""
    from agent.cloud.answers import redelivery

    assert redelivery({"job_id": "j", "agent": "a1"}) is False
    assert redelivery({"job_id": "j", "agent": "a1", "handed": True}) is True
    assert redelivery({"job_id": "j", "agent": "a1", "published_by": "a2", "handed": True}) is True


class _RefusingClient:
    """etcd refusing the first ``refusals`` stamps, then taking them."""

    def __init__(self, refusals: int):
        self.refusals = refusals
        self.txns: list = []

    def txn(self, compare, success, failure, timeout=None):
        from agent.coordination.etcd import EtcdUnavailable

        if self.refusals:
            self.refusals -= 1
            raise EtcdUnavailable("down")
        self.txns.append(success)


def _answers(client):
    from agent.cloud.answers import Answers

    return Answers(client, None, "a1", enqueue=lambda *a: None, in_outbox=lambda k: False, owned=frozenset,
                   fence_for=lambda s: None)


def test_an_answer_whose_stamp_etcd_refuses_is_held_and_retried(monkeypatch):
    """No stamp must mean never sent: handing() returns True only once every marker is
    stamped; while etcd refuses, it retries 0.25 s doubling (each refusal counted
    ``hand_held``) and gives the publisher False after HOLD_CALL_S."""
    from agent.cloud import answers
    from agent.runtime.metrics import sample

    waits: list[float] = []
    items = [("/m/answers/0001/j/accepted", b'{"state":"accepted","seq":3}')]
    held = sample("millwright_answers_total", {"event": "hand_held"}) or 0.0
    client = _RefusingClient(3)
    a = _answers(client)
    monkeypatch.setattr(a._stop, "wait", lambda s: waits.append(s) or False)
    assert a.handing(items) is True
    assert waits == [0.25, 0.5, 1.0] and len(client.txns) == 1
    assert (sample("millwright_answers_total", {"event": "hand_held"}) or 0.0) - held == 3
    assert a._hold_s == 0.0   # the next refusal starts again at 0.25 s
    # etcd down for longer: False (the publisher holds the rows), the wait capped at 5 s
    client = _RefusingClient(10 ** 6)
    a = _answers(client)
    clock = [0.0]
    monkeypatch.setattr(answers.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(a._stop, "wait", lambda s: clock.__setitem__(0, clock[0] + s) or False)
    assert a.handing(items) is False and a._hold_s == answers.HOLD_MAX_S
    a._stop.set()
    assert a.handing(items) is False and not client.txns   # stopping: never sent unstamped


def test_the_publisher_sends_nothing_of_a_held_answer(tmp_path):
    """The outbox publisher holds the rows while handing() says False, and sends them, in
    order, once it says True."""
    ob = Outbox(str(tmp_path / "ob.sqlite"), 100)
    ob.enqueue("t", {"state": "accepted"}, marker="/m/answers/0001/j/accepted")
    ob.enqueue("t", {"state": "scheduled"})
    link = FakeLink()
    stamped = [False]
    pub = OutboxPublisher(ob, link, on_handing=lambda items: stamped[0])
    pub.step()
    assert link.sent == [] and ob.depth == 2
    stamped[0] = True
    pub.step()
    assert [doc["state"] for _, _, doc in link.sent] == ["accepted", "scheduled"]
    ob.close()


def test_answer_names_match_marker_names():
    from agent.cloud.answers import answer_name

    assert answer_name({"state": "accepted", "push_sha256": "ab"}) == "accepted"
    assert answer_name({"state": "rejected", "push_sha256": "ab"}) == "rejected.ab"
    assert answer_name({"state": "rejected", "push_sha256": "ab", "kind": "cancel"}) is None
    assert answer_name({"state": "failed", "run_id": "20261201T130000.000Z.2",
                        "fire_id": "20261201T130000.000Z"}) == "run.20261201T130000.000Z"
    assert answer_name({"state": "running", "run_id": "x.1", "fire_id": "x"}) is None
    assert answer_name({"state": "cancelled", "run_id": None, "fire_id": None}) is None


def test_outbox_markers_are_returned_on_delivery(tmp_path):
    ob = Outbox(str(tmp_path / "ob.sqlite"), 100)
    ob.enqueue("t", {"state": "accepted"}, marker="/m/answers/0001/j/accepted")
    ob.enqueue("t", {"state": "scheduled"})
    seq = ob.reserve("t")
    ob.fill(seq, "t", {"state": "failed"}, marker="/m/answers/0001/j/run.x")
    assert ob.has_marker("/m/answers/0001/j/accepted") and ob.has_marker("/m/answers/0001/j/run.x")
    assert not ob.has_marker("/m/answers/0001/other/accepted")
    delivered = []
    link = FakeLink()
    pub = OutboxPublisher(ob, link, on_delivered=delivered.extend)
    pub.step()
    for mid, _, _ in link.sent:
        pub.on_publish(mid)
    pub.step()
    assert sorted(delivered) == ["/m/answers/0001/j/accepted", "/m/answers/0001/j/run.x"]
    assert not ob.has_marker("/m/answers/0001/j/accepted") and ob.depth == 0
    assert all("marker" not in d for _, _, d in link.sent)  # the key never leaves the agent


def test_outbox_opens_a_database_from_before_markers(tmp_path):
    path = str(tmp_path / "old.sqlite")
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE outbox (seq INTEGER PRIMARY KEY, topic TEXT NOT NULL, payload BLOB NOT NULL, "
               "keep INTEGER NOT NULL, sent INTEGER NOT NULL DEFAULT 0, ts REAL NOT NULL, held INTEGER NOT NULL DEFAULT 0)")
    db.execute("INSERT INTO outbox (seq, topic, payload, keep, ts) VALUES (1, 't', '{\"seq\":1}', 1, 0)")
    db.commit()
    db.close()
    ob = Outbox(path, 10)
    assert ob.depth == 1 and ob.enqueue("t", {"x": 1}, marker="k") == 2 and ob.has_marker("k")
    assert ob.delete([1, 2]) == ["k"]


def test_hold_knob_publishes_nothing(tmp_path):
    ob = Outbox(str(tmp_path / "ob.sqlite"), 10)
    ob.enqueue("t", {"state": "succeeded"})
    link = FakeLink()
    pub = OutboxPublisher(ob, link, hold=True)
    pub.step()
    assert link.sent == [] and ob.depth == 1


def test_topics_for_jobs_get():
    assert T.jobs_get == "millwright/c/jobs/get"
    assert T.get_reply("z", "a1") == "millwright/c/agents/a1/get/z"  # under the answering agent's prefix
    assert T.get_reply_filter("z") == "millwright/c/agents/+/get/z"
    assert T.kind(T.jobs_get) == "get" and T.kind(T.get_reply("z", "a1")) == "get_reply"
    assert T.agent_of(T.get_reply("z", "a1")) == "a1"
    assert T.kind(T.push) == "push"


def _doc(schedule, **extra):
    now = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
    d = {"v": 1, "id": "j", "template": "flush", "params": {"line": "3"}, "schedule": schedule,
         "sig": {"alg": "hmac-sha256", "kid": "k", "value": "x"},
         "cluster": "c", "kind": "job", "issued_at": "2026-12-01T11:59:00Z",
         "_accepted": {"at": "2026-12-01T12:00:00Z", "by": "a1"}}
    d.update(extra)
    return d, now


def test_job_view_states_and_next_due():
    doc, now = _doc({"at": "2026-12-01T13:00:00Z"})
    v = view.view(doc, 3, [], now=now)
    assert v["state"] == "scheduled" and v["next_due"] == "2026-12-01T13:00:00.000000Z"
    assert "sig" not in v["doc"] and "_accepted" not in v["doc"] and v["accepted"]["by"] == "a1"
    run = {"fire_id": "20261201T130000.000Z", "state": "running", "started_at": "2026-12-01T13:00:00Z"}
    later = now + timedelta(hours=2)
    assert view.view(doc, 3, [run], now=later)["state"] == "running"
    done = dict(run, state="failed", ended_at="2026-12-01T13:00:05Z")
    v = view.view(doc, 3, [done], now=later)
    assert v["state"] == "failed" and v["next_due"] is None and v["updated_at"] == "2026-12-01T13:00:05.000000Z"
    cdoc, _ = _doc({"cron": "0 * * * *", "tz": "UTC"})
    v = view.view(cdoc, 3, [dict(done, fire_id="20261201T130000.000Z", state="succeeded")], now=later)
    assert v["state"] == "scheduled" and v["next_due"] == "2026-12-01T14:00:00.000000Z"  # the missed 14:00 runs now
    gone, _ = _doc({}, _cancelled={"at": "2026-12-01T12:30:00Z", "by": "a2"})
    v = view.view(gone, 3, [], now=later)
    assert v["state"] == "cancelled" and v["next_due"] is None and v["updated_at"] == "2026-12-01T12:30:00.000000Z"
    assert view.view(doc, 3, [done] * 9, last_runs=5, now=later)["runs"] == [done] * 5


def test_stderr_tail_is_bounded(tmp_path):
    p = tmp_path / "stderr.log"
    assert stderr_tail(str(tmp_path / "none")) is None and stderr_tail(None) is None
    p.write_bytes(b"")
    assert stderr_tail(str(p)) is None
    p.write_bytes(b"short failure\n")
    assert stderr_tail(str(p)) == "short failure\n"
    p.write_bytes(b"".join(b"line %05d of a long stderr\n" % i for i in range(2000)) + b"\xff\xfe last")
    tail = stderr_tail(str(p))
    assert len(tail.encode()) <= STDERR_TAIL_BYTES + 8 and tail.startswith("line ") and tail.endswith(" last")
    assert "\ufffd" in tail  # invalid UTF-8 is replaced, never raised


def test_the_stderr_tail_kept_in_memory_is_the_one_read_from_the_file(tmp_path):
    """The reaper keeps the end of a run's stderr as it copies it (no file read on the
    loop at the run's end); it must be exactly what reading the file back gives, also when
    the output was cut at output_max_bytes and when it came in odd-sized chunks."""
    import os

    from agent.execute.output import OutputStream
    from agent.execute.runs import tail_text

    lines = b"".join(b"line %05d of a long stderr\n" % i for i in range(600)) + b"\xff\xfe last"
    cases = [(b"", 1 << 20), (b"short failure\n", 1 << 20), (b"no newline at all" * 400, 1 << 20),
             (lines, 1 << 20), (lines, 10_000), (lines, 3_000), (lines, 0)]
    for i, (data, limit) in enumerate(cases):
        path = str(tmp_path / f"stderr-{i}.log")
        r, w = os.pipe()
        s = OutputStream(r, path, limit, tail=STDERR_TAIL_BYTES)
        s.open()
        for at in range(0, len(data), 777):
            s.feed(data[at:at + 777])
        s.close()
        os.close(w)
        assert os.path.getsize(path) == min(len(data), limit) == s.written
        assert tail_text(bytes(s.tail), s.written) == stderr_tail(path), (i, limit)
        assert s.open() is False and os.path.getsize(path) == s.written   # closed: never truncated again
    assert tail_text(bytes(s.tail), s.written) is None   # limit 0: nothing kept, nothing to show


def test_a_runs_output_file_that_cannot_be_created_drops_the_output_and_says_so(tmp_path, caplog):
    import os

    from agent.execute.output import OutputStream

    r, w = os.pipe()
    s = OutputStream(r, str(tmp_path / "no-such-dir" / "stdout.log"), 1000)
    assert s.open() is False
    s.feed(b"lost output\n")
    s.close()
    os.close(w)
    assert (s.written, s.dropped) == (0, 12)
    assert "cannot create a run's output file" in caplog.text
