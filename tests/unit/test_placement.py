"""Targeting, pure parts: label and target validation (hostile input included), the
canonical target and its pool id, selector matching, eligibility, the config's labels,
the job document's ``target`` and the pool's eligible-member set."""

from __future__ import annotations

import pytest

from agent.config import ConfigError, Template, parse_config
from agent.coordination import placement
from agent.coordination.placement import TargetError
from agent.jobs.envelope import JobRejected
from tests.support.documents import parser, signed
from tests.support.fakes import ManualLoop

TPL = {"noargs": Template(argv=["/bin/true"])}
parse = parser(TPL)


def doc(**kw) -> dict:
    return signed({"v": 1, "id": "j", "template": "noargs", "schedule": {}, **kw})


# --- labels and targets ------------------------------------------------------------------


def test_labels_are_checked_key_by_key():
    assert placement.check_labels({"line": "2", "cell": "press", "k8s.io/zone": "a-1"}, "labels") == {
        "line": "2", "cell": "press", "k8s.io/zone": "a-1"}
    for bad, where in [({"line": 2}, "labels.line"), ({"": "x"}, "labels"), ({"a b": "x"}, "labels"),
                       ({"line": ""}, "labels.line"), ({"line": "a/b"}, "labels.line"),
                       ({"x" * 64: "v"}, "labels"), ({"line": "v" * 64}, "labels.line"),
                       ({"li\x00ne": "1"}, "labels"), ({"line": "é"}, "labels.line"),
                       ({f"k{i}": "v" for i in range(33)}, "labels")]:
        with pytest.raises(TargetError) as ei:
            placement.check_labels(bad, "labels")
        assert ei.value.field == where, bad
    with pytest.raises(TargetError):
        placement.check_labels(["line", "2"], "labels")


@pytest.mark.parametrize("target,field", [
    ("line=2", "target"),
    ({}, "target"),
    ({"agent": "gw-1", "labels": {"line": "2"}}, "target"),
    ({"agent": "../etc"}, "target.agent"),
    ({"agent": "gw\x00"}, "target.agent"),
    ({"agent": "g" * 129}, "target.agent"),
    ({"agent": 7}, "target.agent"),
    ({"agent": "gw-1", "fanout": True}, "target.fanout"),
    ({"labels": {}}, "target.labels"),
    ({"labels": {"line": 2}}, "target.labels.line"),
    ({"labels": {f"k{i}": "v" for i in range(17)}}, "target.labels"),
    ({"labels": {"line": "2"}, "fanout": "yes"}, "target.fanout"),
    ({"labels": {"line": "2"}, "where": "x"}, "target.'where'"),
])
def test_hostile_targets_get_a_specific_error(target, field):
    with pytest.raises(TargetError) as ei:
        placement.check_target(target)
    assert ei.value.field == field


def test_canonical_target_and_pool_id():
    a = placement.check_target({"labels": {"line": "2", "cell": "press"}, "fanout": False})
    b = placement.check_target({"labels": {"cell": "press", "line": "2"}})
    assert a == b == {"labels": {"cell": "press", "line": "2"}}
    pid = placement.pool_id(placement.pool_spec(a, "t"))
    assert placement.POOL_ID_RE.match(pid)
    assert pid == placement.pool_id(placement.pool_spec(b, "t"))
    assert pid != placement.pool_id(placement.pool_spec(a, "other"))  # the template is part of the pool
    fan = placement.check_target({"labels": {"line": "2"}, "fanout": True})
    assert placement.pool_id(placement.pool_spec(fan, "t")) != placement.pool_id(
        placement.pool_spec({"labels": {"line": "2"}}, "t"))
    assert placement.pool_id(None) == placement.DEFAULT_POOL
    assert placement.pool_of_doc({"template": "t"}) == placement.DEFAULT_POOL
    assert placement.pool_of_doc({"template": "t", "target": {"labels": {"cell": "press", "line": "2"}}}) == pid
    assert placement.pool_of_doc({"template": "t", "target": {"agent": "../x"}}) == ""  # in no pool


def test_selector_matching_and_eligibility():
    assert placement.matches({"line": "2", "cell": "press"}, {"line": "2"})
    assert not placement.matches({"line": "1"}, {"line": "2"})
    assert not placement.matches({}, {"line": "2"})
    sel = {"template": "t", "labels": {"line": "2"}}
    assert placement.eligible("a", {"line": "2"}, {"t"}, sel)
    assert not placement.eligible("a", {"line": "2"}, {"u"}, sel)  # lacks the template
    assert not placement.eligible("a", {"line": "1"}, {"t"}, sel)
    pin = {"template": "t", "agent": "gw-3"}
    assert placement.eligible("gw-3", {}, ["t"], pin)
    assert not placement.eligible("gw-4", {}, ["t"], pin)
    assert not placement.eligible("gw-3", {}, [], pin)
    assert placement.unknown_keys({"labels": {"camera": "c", "line": "2"}}, {"line"}) == ["camera"]


# --- config ---------------------------------------------------------------------------------


def test_config_labels_every_problem_on_its_own_line():
    cfg = parse_config('labels: {line: "2", cell: press}\netcd: {insecure: true}\n', "agent.yaml")
    assert cfg.labels == {"line": "2", "cell": "press"}
    with pytest.raises(ConfigError) as ei:
        parse_config('labels: {line: 2, "bad key": x, cell: "a b"}\netcd: {insecure: true}\n', "agent.yaml")
    problems = ei.value.problems
    assert len(problems) == 3
    assert any("labels.line" in p and "expected a string" in p for p in problems)
    assert any("label key 'bad key'" in p for p in problems)
    assert any("labels.cell" in p for p in problems)
    with pytest.raises(ConfigError):
        parse_config("labels: [line]\n", "agent.yaml")


# --- job document -----------------------------------------------------------------------------


def test_document_target_is_parsed_and_canonical():
    job = parse(doc(target={"labels": {"line": "2"}}), templates=TPL)
    assert job.target == {"labels": {"line": "2"}} and not job.fanout
    assert job.pool == placement.pool_id({"template": "noargs", "labels": {"line": "2"}})
    assert parse(doc(target={"labels": {"line": "1"}, "fanout": True}), templates=TPL).fanout
    assert parse(doc(), templates=TPL).pool == placement.DEFAULT_POOL


@pytest.mark.parametrize("target,field", [
    ({"agent": "../../x"}, "target.agent"),
    ({"labels": {"line": "2"}, "fanout": 1}, "target.fanout"),
    ([], "target"),
    ({"labels": {"line\n": "2"}}, "target.labels"),
])
def test_document_target_errors_name_the_field(target, field):
    with pytest.raises(JobRejected) as ei:
        parse(doc(target=target), templates=TPL)
    assert ei.value.reason == "bad_field" and ei.value.field == field


def test_targeted_job_with_a_template_this_agent_lacks_is_accepted():
    """The ingesting agent may not be among the targets: the targets check the template."""
    job = parse(signed({"v": 1, "id": "j", "template": "camera-warmup", "schedule": {},
                        "target": {"labels": {"camera": "cam1"}}}), templates=TPL)
    assert job.template == "camera-warmup"
    with pytest.raises(JobRejected) as ei:  # untargeted: the ingesting agent needs the template
        parse(signed({"v": 1, "id": "j", "template": "camera-warmup", "schedule": {}}), templates=TPL)
    assert ei.value.reason == "unknown_template"


# --- a pool's eligible members ------------------------------------------------------------------


def test_pool_manager_assigns_only_among_eligible_members():
    from agent.coordination.keys import Keys, PoolKeys
    from agent.coordination.pools import PoolShardManager
    from agent.coordination.shards import Member, ShardManager

    parent = ShardManager("a", 8, Keys("t"), None, None, ManualLoop(), on_acquired=lambda f: None,
                          on_lost=lambda s, r: None)
    parent.members = {
        "a": Member("a", 1.0, True, 1, {"line": "1"}, frozenset({"t"})),
        "b": Member("b", 1.0, True, 2, {"line": "2"}, frozenset({"t"})),
        "c": Member("c", 1.0, True, 3, {"line": "2"}, frozenset()),          # lacks the template
        "d": Member("d", 1.0, False, 4, {"line": "2"}, frozenset({"t"})),    # unavailable
    }
    spec = {"template": "t", "labels": {"line": "2"}}
    m = PoolShardManager(parent, placement.pool_id(spec), spec, PoolKeys("t", placement.pool_id(spec)),
                         on_acquired=lambda f: None, on_lost=lambda s, r: None)
    assert m.available_members() == {"b": 1.0}
    assert set(m.desired().values()) == {"b"}
    assert not m.may_claim()  # "a" (line 1) never claims a line-2 shard, even unowned
    assert m.keys.shard(3) == "/millwright/t/pools/" + m.pool + "/shards/0003"
    fan_spec = {"template": "t", "labels": {"line": "2"}, "fanout": True}
    parent.me = "b"
    fan = PoolShardManager(parent, placement.pool_id(fan_spec), fan_spec,
                           PoolKeys("t", placement.pool_id(fan_spec), "b"),
                           on_acquired=lambda f: None, on_lost=lambda s, r: None)
    assert fan.available_members() == {"b": 1.0} and fan.may_claim()
    assert "/agents/b/shards/" in fan.keys.shard(0)
    m.removed = True
    assert m.available_members() == {}


def test_job_view_waits_with_no_eligible_agent():
    from agent.jobs.view import view

    d = {"id": "j", "template": "t", "schedule": {}, "target": {"labels": {"line": "2"}},
         "_accepted": {"at": "2026-12-02T11:00:00Z", "by": "x"}}
    members = {"a": {"labels": {"line": "1"}, "templates": ["t"]}, "b": {"labels": {"line": "2"}, "templates": []}}
    v = view(d, 3, [], members=members)
    assert v["state"] == "waiting" and v["reason"] == "no_eligible_agent"
    assert v["placement"]["eligible"] == [] and "detail" not in v["placement"]
    members["b"]["templates"] = ["t"]
    v = view(d, 3, [], members=members)
    assert v["state"] != "waiting" and v["placement"]["eligible"] == ["b"]
    v = view({**d, "target": {"labels": {"camera": "cam1"}}}, 3, [], members=members)
    assert v["state"] == "waiting" and "camera" in v["placement"]["detail"]
    assert "placement" not in view({k: x for k, x in d.items() if k != "target"}, 3, [], members=members)


def test_push_command_line_target():
    from agent.cli import UserError
    from agent.cloud.cli import with_target

    d = {"id": "j", "template": "t"}
    assert with_target(d, None, None, False) is d
    assert with_target(d, "gw-3", None, False)["target"] == {"agent": "gw-3"}
    assert with_target(d, None, ["line=2", "cell=press"], True)["target"] == {
        "labels": {"line": "2", "cell": "press"}, "fanout": True}
    for args in [("gw-3", ["line=2"], False), (None, ["line"], False), (None, ["line=a b"], False),
                 ("gw-3", None, True), (None, None, True), ("../x", None, False)]:
        with pytest.raises(UserError):
            with_target(d, *args)
    with pytest.raises(UserError):
        with_target({**d, "target": {"agent": "x"}}, "gw-3", None, False)
