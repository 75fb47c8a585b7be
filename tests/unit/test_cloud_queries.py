"""jobs/get requests (agent/cloud/queries.py) without a broker or etcd: what a signed query
must be, what an unsigned one gets (nothing, a report), the bounds on the link's thread
and in the workers, the shape of a job's view, where answers go."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone

import pytest

from agent.cloud import queries as q
from agent.cloud.asking import Asker, query_doc
from agent.cloud.ratelimit import TokenBucket
from agent.cloud.topics import Topics
from agent.config import MqttConfig
from agent.jobs.envelope import JobRejected
from agent.jobs.signing import KeyRing, generate_hmac_secret, sign
from tests.support.link import FakeLink, message

T = Topics("c", "me")
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
RING = KeyRing.from_mapping({"k1": {"alg": "hmac-sha256", "secret": generate_hmac_secret()}})
OTHER = KeyRing.from_mapping({"k1": {"alg": "hmac-sha256", "secret": generate_hmac_secret()}})


def signed(doc: dict, ring: KeyRing = RING) -> bytes:
    return json.dumps(sign(doc, ring, "k1"), separators=(",", ":")).encode()


def parse(payload: bytes, now: datetime = NOW) -> q.Query:
    return q.parse_query(payload, keyring=RING, cluster="c", shards=8, now=now, max_age_s=300, max_skew_s=60)


def test_a_signed_query_by_id_or_filter():
    got = parse(signed(query_doc("c", "corr-1", job_id="flush-3", now=NOW)))
    assert (got.correlation, got.job_id, got.filter, got.include, got.cursor) == ("corr-1", "flush-3", None,
                                                                                 frozenset(), None)
    got = parse(signed(query_doc("c", "corr-2", flt={"state": "failed", "limit": 5}, include=["params", "stderr"],
                                 cursor="a1/0003/flush-9", now=NOW)))
    assert got.filter == {"state": "failed", "limit": 5} and got.include == {"params", "stderr"}
    assert got.cursor == q.Cursor("a1", 3, "flush-9") and got.cursor.text() == "a1/0003/flush-9"
    assert parse(signed(query_doc("c", "c3", now=NOW))).filter == {"limit": q.FILTER_LIMIT}


@pytest.mark.parametrize("payload,reason", [
    (json.dumps(query_doc("c", "x", job_id="j", now=NOW)).encode(), "unsigned"),
    (signed(query_doc("c", "x", job_id="j", now=NOW), OTHER), "bad_signature"),
    (signed(query_doc("plant-b", "x", job_id="j", now=NOW)), "wrong_cluster"),
    (signed(dict(query_doc("c", "x", job_id="j", now=NOW), kind="cancel")), "wrong_kind"),
    (b"nope", "bad_json"),
    (b'{"pad":"' + b"y" * 9000 + b'"}', "too_large"),
])
def test_a_query_that_fails_the_envelope_is_not_authentic(payload, reason):
    with pytest.raises(JobRejected) as exc:
        parse(payload)
    assert exc.value.reason == reason and exc.value.bound is False


@pytest.mark.parametrize("change,reason,field", [
    ({"issued_at": "2026-12-01T11:50:00Z"}, "too_old", "issued_at"),
    ({"issued_at": "2026-12-01T12:05:00Z"}, "skew", "issued_at"),
    ({"issued_at": None}, "bad_field", "issued_at"),
    ({"reply_to": "millwright/c/jobs/push"}, "bad_field", "reply_to"),
    ({"correlation": "a/b"}, "bad_field", "correlation"),
    ({"filter": {"state": "failed"}}, "bad_field", "id"),
    ({"include": ["secrets"]}, "bad_field", "include"),
    ({"id": "../etc"}, "bad_field", "id"),
    ({"v": 2}, "unsupported_version", "v"),
])
def test_an_authentic_query_with_a_bad_field_names_it(change, reason, field):
    doc = {k: v for k, v in dict(query_doc("c", "x", job_id="j", now=NOW), **change).items() if v is not None}
    with pytest.raises(JobRejected) as exc:
        parse(signed(doc))
    assert exc.value.reason == reason and exc.value.field == field and exc.value.bound is True


def test_a_cursor_carries_the_shards_its_chain_of_pages_vouches_for():
    """A chain of pages vouches only for the shards its agent held at every page: the
    cursor carries them (a hex bit mask), and a cursor of an agent before it (no mask)
    still parses."""
    c = q.Cursor("a1", 3, "flush-9", frozenset({0, 3, 7}))
    assert c.text() == "a1/0003/flush-9/89" and q.Cursor.parse(c.text(), 8) == c
    assert q.Cursor.parse("a1/0003/flush-9", 8).held is None
    assert q.Cursor.parse("a1/0003/flush-9/0", 8).held == frozenset()
    got = parse(signed(query_doc("c", "x", flt={"shards": [2, 5]}, cursor=c.text(), now=NOW)))
    assert got.filter["shards"] == [2, 5] and got.cursor.held == {0, 3, 7}


@pytest.mark.parametrize("flt,cursor,field", [
    ({"owner": "me"}, None, "filter"), ({"updated_since": "yesterday"}, None, "filter.updated_since"),
    ({"limit": 0}, None, "filter.limit"), ({"limit": 1001}, None, "filter.limit"),
    ({}, "a1/0099/j", "cursor"), ({}, "a1/3/../x", "cursor"), ({}, 7, "cursor"),
    ({}, "a1/0003/j/100", "cursor"), ({}, "a1/0003/j/xz", "cursor"), ({}, "a1/0003/j/", "cursor"),
    ({"shards": []}, None, "filter.shards"), ({"shards": [8]}, None, "filter.shards"),
    ({"shards": [1, 1]}, None, "filter.shards"), ({"shards": [True]}, None, "filter.shards"),
    ({"shards": "1"}, None, "filter.shards"),
])
def test_filters_and_cursors_are_checked(flt, cursor, field):
    with pytest.raises(JobRejected) as exc:
        parse(signed(query_doc("c", "x", flt=flt, cursor=cursor, now=NOW)))
    assert exc.value.field == field, exc.value.detail


def _view(**extra) -> dict:
    v = {"id": "j", "shard": 1, "state": "failed", "doc": {"id": "j", "template": "t", "params": {"pw": "s3cret"}},
         "runs": [{"fire_id": "f", "state": "failed", "stderr_tail": "password=s3cret"}]}
    v.update(extra)
    return v


def test_params_and_stderr_only_when_the_query_includes_them():
    plain = q.shaped(_view(), frozenset())
    assert "s3cret" not in json.dumps(plain) and plain["doc"]["template"] == "t" and plain["runs"][0]["state"] == "failed"
    assert q.shaped(_view(), frozenset({"params"}))["doc"]["params"] == {"pw": "s3cret"}
    assert q.shaped(_view(), frozenset({"stderr"}))["runs"][0]["stderr_tail"] == "password=s3cret"


def test_a_view_too_large_for_a_page_leaves_out_what_does_not_fit():
    big = _view(doc={"id": "j", "params": {"p": "x" * 5000}},
                runs=[{"fire_id": str(i), "stderr_tail": "e" * 4000} for i in range(5)])
    assert q.fitted(big, 100000) is big
    fit = q.fitted(big, 6000)
    assert len(json.dumps(fit)) <= 6000 and fit["omitted"] == ["stderr"] and len(fit["runs"]) == 5
    fit = q.fitted(big, 1000)   # then its largest parts are cut (tests/unit/test_bounded_views.py)
    assert len(json.dumps(fit)) <= 1000 and fit["omitted"] == ["stderr"] and fit["cut"] == ["doc.params.p"]


class Queries:
    """A JobQueries on a fake link, without etcd (answers that need no read)."""

    def __init__(self, owned=frozenset(range(8)), rate=None, page_rate=None, queue_max=q.QUEUE_MAX):
        self.link = FakeLink()
        self.reports: list = []
        self.owned = {"now": frozenset(owned)}
        self.jq = q.JobQueries(None, None, 8, "me", T, self.link, lambda: self.owned["now"], hold_s=60.0,
                               keyring=RING, cluster="c", max_age_s=300, max_skew_s=60, page_bytes=32768,
                               report_unauthenticated=lambda *a: self.reports.append(a[:3]), rate=rate,
                               page_rate=page_rate, queue_max=queue_max)

    def request(self, payload: bytes) -> None:
        self.jq.request(message(T.jobs_get, payload))

    def replies(self) -> list:
        return [(topic, doc) for _, topic, doc in self.link.sent if T.kind(topic) == "get_reply"]


def now_doc(**kw) -> dict:
    return query_doc("c", kw.pop("corr", "corr"), **kw)


def test_an_unsigned_query_gets_no_answer_but_a_report():
    w = Queries()
    for payload in (json.dumps(now_doc(job_id="j")).encode(), signed(now_doc(job_id="j"), OTHER),
                    signed(query_doc("plant-b", "corr", job_id="j"))):
        w.request(payload)
    assert w.replies() == [] and w.jq.held == 0
    assert [r[:1] + r[2:] for r in w.reports] == [("get", "unsigned"), ("get", "bad_signature"), ("get", "wrong_cluster")]


def test_an_authentic_bad_query_is_answered_with_the_error_under_the_agents_own_prefix():
    w = Queries()
    w.request(signed(dict(now_doc(job_id="j", corr="c-9"), reply_to="millwright/c/jobs/push")))
    (topic, doc), = w.replies()
    assert topic == "millwright/c/agents/me/get/c-9" and doc["error"] == "bad_field" and "reply_to" in doc["detail"]
    assert all(t != "millwright/c/jobs/push" for _, t, _ in w.link.sent)


def test_replays_and_cursors_of_others_are_not_answered():
    w = Queries(owned=frozenset())
    a = signed(now_doc(job_id="j1", corr="a"))
    w.request(a)
    w.request(a)                                  # the same signed request again: a replay
    assert w.jq.held == 1                         # not its shard: held once for a takeover
    w.request(signed(now_doc(flt={}, cursor="other/0001/j", corr="b")))  # another agent's next page
    assert w.jq.held == 1 and w.replies() == [] and w.reports == []


def test_what_an_agent_reads_etcd_for_is_rate_limited():
    w = Queries(rate=TokenBucket(0.0, 0.0), page_rate=TokenBucket(0.0, 0.0))  # no tokens: nothing is read
    for i in range(5):
        w.request(signed(now_doc(job_id=f"j{i}", corr=f"id{i}")))
        w.request(signed(now_doc(flt={}, corr=f"f{i}")))
    assert w.replies() == [] and w.jq.held == 0


def test_the_link_thread_only_checks_the_size_and_queues_within_a_bound():
    w = Queries(queue_max=3)
    for i in range(10):
        w.jq.on_message(message(T.jobs_get, signed(now_doc(job_id=f"j{i}")), mid=i))
    assert w.jq.queued == 3 and len(w.link.acked) == 10 and w.replies() == []
    w.jq.on_message(message(T.jobs_get, b"x" * (q.MAX_REQUEST_BYTES + 1)))
    assert w.reports == [("get", b"x" * (q.MAX_REQUEST_BYTES + 1), "too_large")] and w.jq.queued == 3


def test_held_get_requests_are_bounded_and_answered_when_the_shard_comes():
    w = Queries(owned=frozenset())
    jq = w.jq
    now = time.monotonic()
    query = q.Query("c", "j", None, frozenset(), None, "d")
    for i in range(q.MAX_HELD + 10):
        jq._hold(q.Request(query, now, now + 60, i % 8))
    assert jq.held == q.MAX_HELD  # the bound: the oldest are dropped
    jq._hold(q.Request(query, now - 100, now - 1, 3))  # past its time: not held
    assert jq.held == q.MAX_HELD
    w.owned["now"] = frozenset({3})
    jq.recheck_once(time.monotonic())
    ready = list(jq._q)
    assert ready and all(r.shard == 3 for r in ready)
    assert jq.held == q.MAX_HELD - len(ready) and 3 not in jq._held


def test_a_query_ages_out_with_its_issued_at():
    doc = query_doc("c", "x", job_id="j", now=NOW - timedelta(seconds=301))
    with pytest.raises(JobRejected) as exc:
        parse(signed(doc))
    assert exc.value.reason == "too_old"


class ScriptedAsker(Asker):
    """The requester's page-following logic against scripted agents: ``ask`` hands the
    request to ``answer(kw)``, which returns [(agent, page)] answered to it."""

    def __init__(self, answer) -> None:
        super().__init__(MqttConfig(url="mqtt://127.0.0.1:1"), "c", RING, "k1")
        self.answer, self.asked = answer, []

    def ask(self, **kw) -> str:
        corr = f"q{len(self.asked)}"
        self.asked.append(kw)
        self.answers[corr] = [(agent, dict(page, correlation=corr, agent=agent), 100)
                              for agent, page in self.answer(kw)]
        return corr


def _page(shards, jobs, nxt=None) -> dict:
    return {"shards": shards, "shard_count": 2, "jobs": [{"id": j, "shard": s} for s, j in jobs], "next": nxt}


def test_the_requester_counts_a_chain_only_for_the_shards_it_vouched_for_and_asks_again_for_the_rest():
    """a1 reads shard 0 and part of shard 1, loses shard 1 before its last page: its jobs
    of shard 1 are not counted, and shard 1 is asked for again (a2 answers it). A second
    copy of an answer (QoS 1) is taken once."""
    def answer(kw):
        if kw.get("cursor") == "a1/0001/j1":
            return [("a1", _page([0], []))]              # shard 1 gone
        if kw["flt"].get("shards") == [1]:
            return [("a2", _page([1], [(1, "j1"), (1, "j2")]))]
        return [("a1", _page([0, 1], [(0, "j0"), (1, "j1")], "a1/0001/j1"))] * 2   # delivered twice

    ask = ScriptedAsker(answer)
    got = ask.list({}, timeout=5)
    assert got["complete"] and got["rounds"] == 2 and ask.asked[-1]["flt"] == {"shards": [1]}
    assert sorted((a, j["id"]) for a, d, _ in got["pages"] for j in d["jobs"]) == [
        ("a1", "j0"), ("a2", "j1"), ("a2", "j2")]
    assert len(ask.asked) == 3   # the second copy asked for no second next page


def test_a_chain_whose_agent_stops_answering_is_given_up_and_its_shards_asked_for_again(monkeypatch):
    """a1 dies after its first page: its next page is asked for PAGE_TRIES times, then its
    chain vouches for nothing, and the shards are asked for again (a2, their new owner,
    answers them)."""
    from agent.cloud import asking

    monkeypatch.setattr(asking, "PAGE_RETRY_S", 0.05)
    monkeypatch.setattr(asking, "ROUND_RETRY_S", 0.05)

    def answer(kw):
        if kw.get("cursor"):
            return []                                                   # a1 is gone
        if kw["flt"].get("shards") == [0, 1]:
            return [("a2", _page([0, 1], [(0, "j0"), (1, "j1")]))]
        return [("a1", _page([0, 1], [(0, "j0")], "a1/0000/j0"))]

    ask = ScriptedAsker(answer)
    got = ask.list({}, timeout=5)
    assert got["complete"] and got["rounds"] == 2
    assert sum(1 for kw in ask.asked if kw.get("cursor")) == asking.PAGE_TRIES
    assert sorted((a, j["id"]) for a, d, _ in got["pages"] for j in d["jobs"]) == [("a2", "j0"), ("a2", "j1")]
