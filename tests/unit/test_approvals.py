"""Four-eyes approval as pure logic: who signed a document (agent/jobs/approvals.py), the
job store's merge of more approvals, the template rule in the config, and the start policy
that holds a firing until the rule is met (agent/jobs/approvalgate.py)."""

from __future__ import annotations

import copy
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest

from agent.config import ConfigError, parse_config
from agent.coordination.jobstore import with_approvals
from agent.jobs import approvals
from agent.jobs.approvalgate import ApprovalGate
from agent.jobs.document import Job, parse_job
from agent.jobs.envelope import JobRejected
from agent.jobs.signing import KeyFileError, KeyRing, approve, canonical_json, generate_ed25519, sign
from agent.jobs.startpolicy import StartGate, wait
from tests.support.fakes import ManualLoop

UTC = timezone.utc
NOW = datetime.now(UTC).replace(microsecond=0)
KEYS = {kid: generate_ed25519() for kid in ("op-1", "op-2", "qa-1", "qa-old", "norole")}
ROLE = {"op-1": "operator", "op-2": "operator", "qa-1": "quality", "qa-old": "quality"}


def ring() -> KeyRing:
    m = {}
    for kid, (seed, _) in KEYS.items():
        m[kid] = {"alg": "ed25519", "private_key": seed, **({"role": ROLE[kid]} if kid in ROLE else {})}
    m["qa-old"]["retired_after"] = (NOW - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return KeyRing.from_mapping(m)


RING = ring()
CFG = parse_config("cluster: c\nagent_id: gw-1\netcd: {insecure: true}\n"
                   "templates:\n"
                   "  flash: {argv: [/bin/true], user: root, allow_root: true,"
                   " approvals: {required: 2, roles: [operator, quality]}}\n"
                   "  plain: {argv: [/bin/true], user: root, allow_root: true}\n")


def doc(**kw) -> dict:
    d = {"v": 1, "id": "flash-1", "cluster": "c", "kind": "job", "template": "flash",
         "issued_at": NOW.strftime("%Y-%m-%dT%H:%M:%SZ")}
    d.update(kw)
    return sign(d, RING, "op-1")


def parse(d: dict) -> Job:
    return parse_job(d, templates=CFG.templates, keyring=RING, now=NOW, max_skew_s=300, max_bytes=65536, cluster="c")


def test_an_approval_signs_what_sig_signs_and_leaves_sig_valid():
    d = approve(doc(), RING, "qa-1")
    assert canonical_json(d) == canonical_json(doc())
    assert parse(d).signers == (("op-1", "operator"), ("qa-1", "quality"))


@pytest.mark.parametrize("change, reason, field", [
    (lambda d: d["approvals"][0].update(kid="nobody"), "unknown_kid", "approvals[0]"),
    (lambda d: d["approvals"][0].update(value=d["sig"]["value"]), "bad_signature", "approvals[0]"),
    (lambda d: d["approvals"][0].update(alg="rot13"), "unsupported_alg", "approvals[0]"),
    (lambda d: d.update(approvals=[d["approvals"][0], d["approvals"][0]]), "bad_field", "approvals[1].kid"),
    (lambda d: d["approvals"][0].update(kid="op-1"), "bad_field", "approvals[0].kid"),
    (lambda d: d["approvals"][0].update(extra=1), "bad_field", "approvals[0].extra"),
    (lambda d: d.update(approvals=[]), "bad_field", "approvals"),
    (lambda d: d.update(approvals={"kid": "x"}), "bad_field", "approvals"),
])
def test_a_bad_approval_refuses_the_push_with_its_reason(change, reason, field):
    d = approve(doc(), RING, "qa-1")
    change(d)
    with pytest.raises(JobRejected) as err:
        parse(d)
    assert (err.value.reason, err.value.field) == (reason, field), err.value.detail
    assert err.value.bound   # the document itself is authentic: its job's topic hears why


def test_an_approval_by_a_retired_key_or_made_for_another_cluster_is_refused():
    with pytest.raises(JobRejected) as err:
        parse(approve(doc(), RING, "qa-old"))
    assert err.value.reason == "key_retired" and "approvals[0]" in err.value.detail
    elsewhere = approve(doc(cluster="plant-b"), RING, "qa-1")
    d = dict(doc(), approvals=elsewhere["approvals"])
    with pytest.raises(JobRejected) as err:
        parse(d)
    assert err.value.reason == "bad_signature" and "another document or cluster" in err.value.detail


def test_distinct_roles_count_and_a_second_key_of_one_role_counts_once():
    rule = CFG.templates["flash"].approvals
    st = approvals.standing(parse(approve(doc(), RING, "op-2")).signers, rule)
    assert not st.ok and st.missing == ("quality",) and "1 of 2" in st.describe()
    st = approvals.standing(parse(approve(doc(), RING, "norole")).signers, rule)
    assert not st.ok
    st = approvals.standing(parse(approve(approve(doc(), RING, "op-2"), RING, "qa-1")).signers, rule)
    assert st.ok and st.counted == (("op-1", "operator"), ("qa-1", "quality"))


def test_the_answer_to_a_push_says_waiting_approval_while_short():
    fields = approvals.answer_fields(doc(), RING, CFG.templates)
    assert fields["state"] == "waiting_approval" and fields["approvals"]["missing_roles"] == ["quality"]
    assert "state" not in approvals.answer_fields(approve(doc(), RING, "qa-1"), RING, CFG.templates)
    assert approvals.answer_fields(doc(template="plain"), RING, CFG.templates) == {}


def test_the_job_store_merges_more_approvals_of_the_same_document_and_nothing_else():
    stored = dict(approve(doc(), RING, "op-2"), _accepted={"at": "x", "by": "gw"})
    pushed = approve(doc(), RING, "qa-1")
    merged = with_approvals(stored, pushed)
    assert merged is not None and [a["kid"] for a in merged["approvals"]] == ["op-2", "qa-1"]
    assert merged["_accepted"] == stored["_accepted"]
    assert with_approvals(stored, doc()) is stored                       # nothing new: a redelivery
    assert with_approvals(stored, approve(doc(), RING, "op-2")) is stored
    assert with_approvals(stored, approve(doc(params={"x": "1"}), RING, "qa-1")) is None   # other content
    other_sig = copy.deepcopy(pushed)
    other_sig["sig"] = sign(doc(), RING, "op-2")["sig"]
    assert with_approvals(stored, other_sig) is None                     # another sig: another document


def test_a_key_role_is_checked_in_the_keys_file():
    seed, _ = KEYS["op-1"]
    with pytest.raises(KeyFileError) as err:
        KeyRing.from_mapping({"k": {"alg": "ed25519", "private_key": seed, "role": "bad role!"}})
    assert "k.role" in str(err.value)


@pytest.mark.parametrize("tpl, needle", [
    ("approvals: {required: 3, roles: [a, b]}", "approvals.required"),
    ("approvals: {required: 1, roles: [a, a]}", "approvals.roles"),
    ("approvals: {required: 0, roles: [a]}", "approvals.required"),
    ("rollback: nope", "rollback"),
    ("rollback: t", "rollback"),
    ("rollback: other", "a rollback runs with the job's own params"),
])
def test_a_template_rule_or_rollback_that_cannot_work_is_a_config_error(tpl, needle):
    text = ("etcd: {insecure: true}\ntemplates:\n  t: {argv: [/bin/true, '{x}'], params: {x: '^a$'}, " + tpl + "}\n"
            "  other: {argv: [/bin/true]}\n")
    with pytest.raises(ConfigError) as err:
        parse_config(text)
    assert needle in str(err.value)


# --- the start policy -----------------------------------------------------------------------

def firing(job: Job) -> SimpleNamespace:
    e = SimpleNamespace(job=job)
    return SimpleNamespace(entry=e, key=f"{job.id}/f#1", fire_id="f", rollback=False)


class Audit:
    def __init__(self):
        self.records = []

    def record(self, type_, **fields):
        self.records.append((type_, fields))


def test_a_firing_waits_for_approval_until_the_rule_is_met_or_the_time_for_it_passed():
    loop, audit = ManualLoop(), Audit()
    gate = ApprovalGate(CFG, loop, audit)
    f = firing(parse(doc()))
    v = gate.judge(f)
    assert (v.kind, v.reason, v.state) == ("wait", "approvals", "waiting_approval")
    woken = []
    cancel = gate.subscribe(f, lambda: woken.append(1))
    f.entry.job = parse(approve(doc(), RING, "qa-1"))
    gate.job_changed(f.entry)
    assert woken == [1] and gate.judge(f).kind == "go"
    cancel()
    assert gate.waiting == {}
    assert [r[1]["event"] for r in audit.records] == ["approval_waiting", "approval_approved"]
    # the approvals can no longer come: the firing ends
    old = parse_job(doc(issued_at=(NOW - timedelta(days=2)).strftime("%Y-%m-%dT%H:%M:%SZ")), templates=CFG.templates,
                    keyring=RING, now=None, max_skew_s=None, max_bytes=65536, cluster="c")
    v = gate.judge(firing(old))
    assert (v.kind, v.state, v.reason) == ("end", "misfired", "approval_expired")
    assert gate.judge(firing(parse(doc(template="plain")))).kind == "go"


def test_the_start_gate_sends_the_state_a_policy_waits_in_and_gathers_final_ops():
    sent = []
    statuses = SimpleNamespace(send=lambda e, f, state, **kw: sent.append((state, kw.get("reason"))))
    hooks = SimpleNamespace(name="approval", judge=lambda f: wait("approvals", "d", state="waiting_approval"),
                            subscribe=lambda f, w: (lambda: None),
        final_ops=lambda f, s: [("op", s)], done=lambda f: sent.append("done"))
    gate = StartGate([hooks], statuses, ManualLoop())
    unmarked = []
    f = SimpleNamespace(key="k", entry=None, state=None, wait_reason=None, notes={},
                        move=lambda to, wait_reason=None: None, unmark_ready=lambda: unmarked.append(1))
    gate.request(f, lambda g: None, lambda *a: None)
    assert sent == [("waiting_approval", "approvals")]
    assert unmarked == [1]      # a firing back at its start policies is not ready: its wait is no lag
    assert gate.final_ops(f, "failed") == [("op", "failed")]
    gate.done(f)
    assert sent[-1] == "done"
