"""Issue 54, point 5: a job's view within a byte bound whatever etcd holds
(agent/jobs/bounded.py), as jobs/get (agent/cloud/queries.py) and `millwright jobs show`
(agent/jobs/cli.py) use it. Sizes are those of the publisher's encoding."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.cloud import queries as q
from agent.jobs import bounded
from agent.jobs import cli as jobs_cli
from tests.unit.test_cloud_queries import Queries

MB = 1_000_000


def _view(**extra) -> dict:
    v = {"id": "j", "shard": 3, "template": "flush", "state": "scheduled", "next_due": "2026-12-01T12:00:00Z",
         "accepted": {"at": "2026-12-01T11:00:00Z", "by": "gw-1"}, "cancelled": None,
         "updated_at": "2026-12-01T11:00:00Z", "runs": [{"fire_id": "f1", "state": "failed", "reason": "exit 3"}],
         "doc": {"id": "j", "template": "flush", "schedule": {"at": "2026-12-01T12:00:00Z"}}}
    v.update(extra)
    return v


def test_a_view_that_fits_is_unchanged():
    v = _view()
    assert bounded.fitted(v, 32768) is v and q.fitted(v, 32768) is v


def test_a_1_mb_forged_accepted_costs_that_field_alone():
    v = _view(accepted={"at": "2026-12-01T11:00:00Z", "by": "x" * MB})
    out = q.fitted(v, 32768 - 512)
    assert bounded.size(out) <= 32768 - 512
    assert out["accepted"]["at"] == "2026-12-01T11:00:00Z"           # the rest of the field stays
    assert out["accepted"]["by"].endswith(f"…[truncated: {MB} bytes]")  # cut, with its size
    assert len(out["accepted"]["by"].encode()) <= bounded.STRING_KEEP + 40
    assert out["cut"] == ["accepted.by"] and out["doc"] == v["doc"] and out["runs"] == v["runs"]


def test_an_oversized_object_of_small_parts_becomes_the_marker():
    v = _view(accepted={str(i): i for i in range(100000)})
    out = bounded.fitted(v, 4096)
    assert bounded.size(out) <= 4096
    assert out["accepted"] == {"truncated": True, "bytes": bounded.size(v["accepted"])}
    assert out["cut"] == ["accepted"] and out["doc"] == v["doc"]


def test_a_view_that_cannot_fit_is_a_stub_with_the_keys_id():
    v = _view(id="forged-" + "y" * MB)   # the stored document's id: not the key's
    out = bounded.fitted(v, 200, "j", 3)
    assert out == {"id": "j", "shard": 3, "truncated": True, "bytes": bounded.size(v)}
    assert bounded.was_cut(out) == "stub" and bounded.was_cut(_view()) is None


def test_a_string_cut_twice_keeps_its_original_size():
    v = _view(doc={"a": ["z" * 5000] * 10})
    out = bounded.fitted(v, 3000)
    assert bounded.size(out) <= 3000
    assert all(s.endswith("…[truncated: 5000 bytes]") for s in out["doc"]["a"] if isinstance(s, str))


def test_the_cut_list_is_bounded():
    v = _view(doc={f"k{i}": "w" * 3000 for i in range(40)})
    out = bounded.fitted(v, 8000)
    assert bounded.size(out) <= 8000
    assert len(out["cut"]) == bounded.MAX_PATHS + 1 and out["cut"][-1].startswith("…and ")


def test_the_encoding_survives_a_lone_surrogate():
    v = _view(accepted={"by": "\ud800" * 10})   # json.loads accepts "\\ud800" from etcd
    assert bounded.encode(v).count(b"?") == 10


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=2000),
    lambda kids: st.lists(kids, max_size=20) | st.dictionaries(st.text(max_size=300), kids, max_size=20),
    max_leaves=60)


@settings(max_examples=40, deadline=None)
@given(json_values, st.sampled_from([300, 1000, 4096, 32768]))
def test_any_view_fits_its_bound(value, limit):
    v = _view(accepted=value, runs=[value], waiting=[value, value])
    out = bounded.fitted(v, limit, "j", 3)
    assert bounded.size(out) <= limit
    json.loads(bounded.encode(out))


def test_stderr_tails_go_first_then_parts_are_cut():
    big = _view(doc={"id": "j", "params": {"p": "x" * 5000}},
                runs=[{"fire_id": str(i), "stderr_tail": "e" * 4000} for i in range(5)])
    fit = q.fitted(big, 6000)
    assert bounded.size(fit) <= 6000 and fit["omitted"] == ["stderr"] and "cut" not in fit
    fit = q.fitted(big, 1000)
    assert bounded.size(fit) <= 1000 and fit["omitted"] == ["stderr"] and fit["cut"] == ["doc.params.p"]


def test_an_oversized_job_is_reported_once_not_per_answer():
    w = Queries()
    records: list = []
    w.jq.record = lambda *a, **k: records.append((a, k))
    before = q.OVERSIZED.labels("cut")._value.get()
    v = _view(accepted={"at": "x", "by": "x" * MB})
    for _ in range(5):
        assert bounded.size(w.jq._fitted(v, 32000, "j", 3)) <= 32000
    w.jq._fitted(_view(), 32000, "k", 3)   # fits: nothing to report
    assert q.OVERSIZED.labels("cut")._value.get() == before + 1
    (args, fields), = records
    assert args == ("job",) and fields["event"] == "view_oversized" and fields["job"] == "j"
    assert fields["cut"] == ["accepted.by"] and fields["bytes"] > MB


@pytest.mark.parametrize("part", ["waiting", "rollout"])
def test_jobs_show_prints_cut_waiting_marks_and_rollouts(part, capsys):
    marks = [{"fire_id": "f", "agent": f"a{i}", "since": "t", "reason": "window", "detail": "d" * 3000}
             for i in range(200)]
    rollout = {"state": "running", "firing": "f", "counts": {"started": 1}, "aborted": {"detail": "z" * MB},
               "agents": {f"agent-{i}": {"state": "waiting"} for i in range(50000)}}
    v = _view(**({"waiting": marks} if part == "waiting" else {"rollout": rollout}))
    out = bounded.fitted(v, 32768)
    assert bounded.size(out) <= 32768
    lines = jobs_cli._maintenance_lines(out, type("Cfg", (), {"templates": {}})()) + jobs_cli._rollout_lines(
        out.get("rollout") or {})
    text = "\n".join(lines)
    assert len(text) <= 32768 and "truncated" in text


def test_a_forged_abort_mark_is_cut_in_the_reason_it_gives():
    from agent.jobs import rollout as ro

    text = ro._abort_detail({"by": "b" * MB, "at": "2026-12-01T12:00:00Z", "detail": "d" * MB})
    assert len(text) < 4 * ro.ABORT_TEXT_MAX and text.startswith("the rollout was aborted by bbb")
    assert ro._abort_detail({"by": "gw-1", "detail": "3 failed"}) == "the rollout was aborted by gw-1: 3 failed"
