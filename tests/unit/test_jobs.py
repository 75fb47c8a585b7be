"""Job documents: every invalid field gets its specific reason and names the field;
hostile ids; signatures; binding (cluster, kind), age and skew; the check order; templates
and argv; regex limits; cancel; stored re-parse with verification."""

from __future__ import annotations

import base64
import copy
import json
from datetime import datetime, timedelta

import pytest

from agent.config import Resources, Template
from agent.jobs.document import Job, parse_cancel
from agent.jobs.envelope import JobRejected
from agent.jobs.render import effective_resources, render_argv
from agent.jobs.schedule import Schedule
from agent.jobs.signing import KeyRing, sign
from tests.support.documents import CLUSTER, ISSUED_AT, KEYS, NOW, SECRET, UTC, parser, signed

TEMPLATES = {
    "coolant-flush": Template(
        argv=["/usr/lib/millwright/jobs/coolant-flush", "--line", "{line}", "--tag=l{line}-{mode}"],
        params={"line": "^[0-9]{1,2}$", "mode": "fast|slow"},
        resources=Resources(cpu=1.0, memory_mb=256, pids=32),
    ),
    "noargs": Template(argv=["/bin/true"]),
}
BASE = {
    "v": 1,
    "id": "coolant-flush-line3-20261202",
    "cluster": CLUSTER,
    "kind": "job",
    "template": "coolant-flush",
    "params": {"line": "3", "mode": "fast"},
    "schedule": {"at": "2026-12-02T12:00:00Z"},
    "misfire": "run_once",
    "overlap": "forbid",
    "retry": {"max_attempts": 3, "backoff_s": 2, "max_backoff_s": 60, "jitter": 0.2},
    "timeout_s": 300,
    "resources": {"cpu": 0.5, "memory_mb": 128, "pids": 64},
    "depends_on": [],
    "not_after": "2026-12-03T00:00:00Z",
    "issued_at": ISSUED_AT,
}


parse = parser(TEMPLATES)


def rejected(payload, **kw) -> JobRejected:
    with pytest.raises(JobRejected) as ei:
        parse(payload, **kw)
    return ei.value


def variant(**changes) -> dict:
    doc = copy.deepcopy(BASE)
    for k, v in changes.items():
        if v is DROP:
            doc.pop(k, None)
        else:
            doc[k] = v
    return doc


DROP = object()


# ---------------------------------------------------------------- the happy path


def test_valid_document_parses_from_bytes_str_and_dict():
    doc = signed(BASE)
    for payload in (json.dumps(doc).encode(), json.dumps(doc), doc):
        job = parse(payload)
        assert job.id == BASE["id"] and job.template == "coolant-flush"
        assert job.params == {"line": "3", "mode": "fast"}
        assert job.schedule.kind == "at" and job.schedule.at == datetime(2026, 12, 2, 12, tzinfo=UTC)
        assert job.retry.max_attempts == 3 and job.retry.backoff_s == 2.0 and job.retry.jitter == 0.2
        assert job.timeout_s == 300.0 and job.resources == Resources(cpu=0.5, memory_mb=128, pids=64)
        assert job.not_after == datetime(2026, 12, 3, tzinfo=UTC)
        assert job.issued_at == datetime(2026, 12, 2, 11, tzinfo=UTC)
        assert job.doc == doc and job.doc is not doc
        assert job.canonical == json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        assert b'"sig"' in job.canonical and b'"sig"' not in job.content


def test_defaults_for_a_minimal_document():
    job = parse(signed({"v": 1, "id": "j1", "template": "noargs"}), now=NOW)
    assert job.schedule == Schedule.now() and job.misfire == "run_once" and job.misfire_limit == 1
    assert job.overlap == "forbid" and job.retry.max_attempts == 1 and job.timeout_s == 3600.0
    assert job.resources == Resources() and job.depends_on == [] and job.params == {}
    assert job.not_after is None and job.issued_at == datetime(2026, 12, 2, 11, tzinfo=UTC)


def test_canonical_identifies_content_regardless_of_wire_formatting():
    doc = signed(BASE)
    a = parse(json.dumps(doc, indent=2))
    b = parse(json.dumps(dict(reversed(list(doc.items())))))
    assert a.canonical == b.canonical and a == b
    other = parse(signed(variant(timeout_s=301)))
    assert other.canonical != a.canonical and not other.same_content(a)


def test_cron_and_misfire_run_all():
    job = parse(signed(variant(schedule={"cron": "0 */5 * * * *", "tz": "Europe/Berlin"},
                               misfire="run_all", misfire_limit=5)))
    assert job.schedule.kind == "cron" and job.schedule.tz == "Europe/Berlin"
    assert job.misfire == "run_all" and job.misfire_limit == 5
    job = parse(signed(variant(misfire="run_all")))
    assert job.misfire_limit == 10


# ---------------------------------------------------------------- every invalid field


BAD_FIELDS = [
    # (changes, reason, field named in detail)
    ({"v": DROP}, "bad_field", "v"),
    ({"v": "1"}, "bad_field", "v"),
    ({"v": True}, "bad_field", "v"),
    ({"v": 1.5}, "bad_field", "v"),
    ({"v": 2}, "unsupported_version", "v"),
    ({"v": 0}, "unsupported_version", "v"),
    ({"id": DROP}, "bad_field", "id"),
    ({"id": 5}, "bad_field", "id"),
    ({"template": DROP}, "bad_field", "template"),
    ({"template": ["x"]}, "bad_field", "template"),
    ({"template": "../etc"}, "bad_field", "template"),
    ({"template": "nope"}, "unknown_template", "template"),
    ({"params": "line=3"}, "bad_field", "params"),
    ({"params": {"line": 3, "mode": "fast"}}, "bad_field", "params.line"),
    ({"params": {"line": "3", "mode": "fast", "bad name": "x"}}, "bad_field", "params"),
    ({"params": {"line": "333", "mode": "fast"}}, "bad_param", "params.line"),
    ({"params": {"line": "3\n", "mode": "fast"}}, "bad_param", "params.line"),
    ({"params": {"line": "3", "mode": "fastest"}}, "bad_param", "params.mode"),
    ({"params": {"line": "3"}}, "bad_param", "params.mode"),
    ({"params": {"line": "3", "mode": "fast", "extra": "1"}}, "bad_param", "params.extra"),
    ({"schedule": "now"}, "bad_field", "schedule"),
    ({"schedule": {"at": "2026-12-02T12:00:00Z", "delay_s": 5}}, "bad_field", "schedule"),
    ({"schedule": {"when": 5}}, "bad_field", "schedule"),
    ({"schedule": {"at": "2026-12-02 12:00"}}, "bad_field", "schedule.at"),
    ({"schedule": {"at": "2026-12-02T12:00:00"}}, "bad_field", "schedule.at"),
    ({"schedule": {"at": "2026-13-02T12:00:00Z"}}, "bad_field", "schedule.at"),
    ({"schedule": {"at": 1764676800}}, "bad_field", "schedule.at"),
    ({"schedule": {"at": "2026-12-04T00:00:00Z"}}, "bad_field", "schedule.at"),  # after not_after
    ({"schedule": {"delay_s": -1}}, "bad_field", "schedule.delay_s"),
    ({"schedule": {"delay_s": "5"}}, "bad_field", "schedule.delay_s"),
    ({"schedule": {"delay_s": 1e12}}, "bad_field", "schedule.delay_s"),
    ({"schedule": {"delay_s": True}}, "bad_field", "schedule.delay_s"),
    ({"schedule": {"cron": "* * * *"}}, "bad_field", "schedule.cron"),
    ({"schedule": {"cron": "* * * * * * *"}}, "bad_field", "schedule.cron"),
    ({"schedule": {"cron": "61 * * * *"}}, "bad_field", "schedule.cron"),
    ({"schedule": {"cron": "0 0 30 2 *"}}, "bad_field", "schedule.cron"),
    ({"schedule": {"cron": "H * * * *"}}, "bad_field", "schedule.cron"),
    ({"schedule": {"cron": "@daily"}}, "bad_field", "schedule.cron"),
    ({"schedule": {"cron": "*/0 * * * *"}}, "bad_field", "schedule.cron"),
    ({"schedule": {"cron": "0 0 * * mon 0"}}, "bad_field", "schedule.cron"),  # croniter order (seconds last) is wrong here
    ({"schedule": {"cron": 5}}, "bad_field", "schedule.cron"),
    ({"schedule": {"cron": "0 * * * *", "tz": "Mars/Olympus"}}, "bad_field", "schedule.tz"),
    ({"schedule": {"cron": "0 * * * *", "tz": "../../etc/passwd"}}, "bad_field", "schedule.tz"),
    ({"schedule": {"cron": "0 * * * *", "tz": "localtime"}}, "bad_field", "schedule.tz"),
    ({"schedule": {"cron": "0 * * * *", "tz": 1}}, "bad_field", "schedule.tz"),
    ({"schedule": {"at": "2026-12-02T12:00:00Z", "tz": "UTC"}}, "bad_field", "schedule.tz"),
    ({"misfire": "later"}, "bad_field", "misfire"),
    ({"misfire": {"run_all": 3}}, "bad_field", "misfire"),
    ({"misfire_limit": 3}, "bad_field", "misfire_limit"),  # only with run_all
    ({"misfire": "run_all", "misfire_limit": 0}, "bad_field", "misfire_limit"),
    ({"misfire": "run_all", "misfire_limit": 1001}, "bad_field", "misfire_limit"),
    ({"misfire": "run_all", "misfire_limit": 2.5}, "bad_field", "misfire_limit"),
    ({"overlap": "queue"}, "bad_field", "overlap"),
    ({"overlap": None}, "bad_field", "overlap"),
    ({"retry": []}, "bad_field", "retry"),
    ({"retry": {"max_attempts": 0}}, "bad_field", "retry.max_attempts"),
    ({"retry": {"max_attempts": 101}}, "bad_field", "retry.max_attempts"),
    ({"retry": {"max_attempts": 2.0}}, "bad_field", "retry.max_attempts"),
    ({"retry": {"backoff_s": -1}}, "bad_field", "retry.backoff_s"),
    ({"retry": {"backoff_s": 1e9}}, "bad_field", "retry.backoff_s"),
    ({"retry": {"backoff_s": 10, "max_backoff_s": 5}}, "bad_field", "retry.max_backoff_s"),
    ({"retry": {"jitter": 1.5}}, "bad_field", "retry.jitter"),
    ({"retry": {"jitter": -0.1}}, "bad_field", "retry.jitter"),
    ({"retry": {"tries": 3}}, "bad_field", "retry.tries"),
    ({"retry": {"on": []}}, "bad_field", "retry.on"),
    ({"retry": {"on": "owner_lost"}}, "bad_field", "retry.on"),
    ({"retry": {"on": ["failed", "lost"]}}, "bad_field", "retry.on[1]"),
    ({"retry": {"on": ["killed"]}}, "bad_field", "retry.on[0]"),
    ({"retry": {"on": [None]}}, "bad_field", "retry.on[0]"),
    ({"retry": {"on": ["failed", "failed"]}}, "bad_field", "retry.on"),
    ({"timeout_s": 0}, "bad_field", "timeout_s"),
    ({"timeout_s": -5}, "bad_field", "timeout_s"),
    ({"timeout_s": "300"}, "bad_field", "timeout_s"),
    ({"timeout_s": 10**9}, "bad_field", "timeout_s"),
    ({"resources": 1}, "bad_field", "resources"),
    ({"resources": {"cpu": 0}}, "bad_field", "resources.cpu"),
    ({"resources": {"cpu": "1"}}, "bad_field", "resources.cpu"),
    ({"resources": {"memory_mb": 2}}, "bad_field", "resources.memory_mb"),
    ({"resources": {"memory_mb": 128.5}}, "bad_field", "resources.memory_mb"),
    ({"resources": {"pids": 0}}, "bad_field", "resources.pids"),
    ({"resources": {"gpu": 1}}, "bad_field", "resources.gpu"),
    ({"depends_on": "other"}, "bad_field", "depends_on"),
    ({"depends_on": ["ok", "../x"]}, "bad_field", "depends_on[1]"),
    ({"depends_on": ["a", "a"]}, "bad_field", "depends_on[1]"),
    ({"depends_on": ["coolant-flush-line3-20261202"]}, "bad_field", "depends_on[0]"),
    ({"depends_on": [str(i) for i in range(65)]}, "bad_field", "depends_on"),
    ({"not_after": "tomorrow"}, "bad_field", "not_after"),
    ({"not_after": "2026-12-02T10:00:00Z"}, "bad_field", "not_after"),  # before issued_at
    ({"issued_at": 5}, "bad_field", "issued_at"),
    ({"issued_at": "1969-12-31T23:59:59Z"}, "bad_field", "issued_at"),
    ({"command": "rm -rf /"}, "bad_field", "command"),
]


@pytest.mark.parametrize("changes,reason,field", BAD_FIELDS, ids=[f"{r}:{f}:{i}" for i, (_, r, f) in enumerate(BAD_FIELDS)])
def test_every_invalid_field_has_its_specific_error(changes, reason, field):
    err = rejected(signed(variant(**changes)))
    assert err.reason == reason, err.detail
    assert err.field == field, err.detail
    assert err.detail.startswith(field + ":") or field in err.detail


def test_sig_field_shape_errors():
    for sig, _ in [("abc", "sig"), ({"alg": "hmac-sha256", "kid": "cloud-1"}, "sig.value"),
                       ({"alg": "hmac-sha256", "kid": "cloud-1", "value": "AA==", "x": 1}, "sig.x"),
                       ({"alg": "", "kid": "cloud-1", "value": "AA=="}, "sig.alg")]:
        err = rejected({**BASE, "sig": sig})
        assert (err.reason, err.field, err.bound) == ("bad_signature", "sig", False)


# ---------------------------------------------------------------- size and JSON


def test_too_large_is_checked_first():
    doc = signed(variant(params={"line": "3", "mode": "fast" * 10000}))
    err = rejected(json.dumps(doc), max_bytes=1024)
    assert err.reason == "too_large" and "1024" in err.detail
    assert rejected(b"{" * 5000, max_bytes=1024).reason == "too_large"


@pytest.mark.parametrize("payload", [
    b"", b"not json", b"{", b"[]", b"\"s\"", b"1", b"null", b"\xff\xfe{}",
    b'{"v":1,"v":1}',  # duplicate keys: parser differentials could bypass the signature
    b'{"v":NaN}', b'{"v":Infinity}', b'{"id":"\\ud800"}', b"[" * 200 + b"]" * 200,
    b'{"a":' * 50 + b"1" + b"}" * 50,
    "{\"id\":\"\ud800\"}",
])
def test_bad_json(payload):
    err = rejected(payload)
    assert err.reason == "bad_json", err.detail


def test_non_json_python_objects_are_bad_json():
    assert rejected({"v": 1, "x": {1, 2}}).reason == "bad_json"
    assert rejected({"v": 1, "x": float("nan")}).reason == "bad_json"
    assert rejected(12345).reason == "bad_json"


def test_overflowing_number_is_bad_field():
    text = json.dumps(signed(variant(timeout_s=DROP)))
    err = rejected(text[:-1] + ',"timeout_s":1e400}')
    assert (err.reason, err.field) == ("bad_field", "timeout_s"), err.detail


# ---------------------------------------------------------------- hostile ids


HOSTILE_IDS = [
    "", ".", "..", "../x", "../../etc/passwd", "a/b", "/abs", ".hidden", "...", "a\x00b", "\x00",
    "a" * 129, "jöb", "job\u202e", "x y", "x\n", "x\t", "%2e%2e", "a\\b", "ｊｏｂ", "job;rm", "*", "",
]


@pytest.mark.parametrize("bad_id", HOSTILE_IDS, ids=[repr(i)[:20] for i in HOSTILE_IDS])
def test_hostile_ids_rejected(bad_id):
    err = rejected(signed(variant(id=bad_id)))
    assert (err.reason, err.field) == ("bad_field", "id"), err.detail
    assert len(err.detail) < 300


def test_longest_and_odd_but_valid_ids():
    for ok in ["a" * 128, "a.b", "a..b", "x.", "-", "_", "A-Z_0.9"]:
        assert parse(signed(variant(id=ok))).id == ok


def test_hostile_id_in_cancel():
    for bad_id in ["..", "../x", "a/b", "a" * 129, "\x00"]:
        with pytest.raises(JobRejected) as ei:
            parse_cancel(sign(cancel(bad_id), KEYS, "cloud-1"), KEYS, 4096, cluster=CLUSTER)
        assert ei.value.field == "id"


# ---------------------------------------------------------------- signature, expiry, skew


def test_unsigned_wrong_key_unknown_kid_tampered():
    assert rejected(BASE).reason == "unsigned"
    other = KeyRing.from_mapping({"cloud-1": {"alg": "hmac-sha256", "secret": base64.b64encode(b"k" * 32).decode()}})
    assert rejected(sign(BASE, other, "cloud-1")).reason == "bad_signature"
    doc = signed(BASE)
    doc["sig"]["kid"] = "cloud-7"
    assert rejected(doc).reason == "unknown_kid"
    doc = signed(BASE)
    doc["params"]["line"] = "4"
    assert rejected(doc).reason == "bad_signature"
    doc = signed(BASE)
    doc["sig"]["alg"] = "rsa"
    assert rejected(doc).reason == "unsupported_alg"


def test_no_keys_configured():
    assert rejected(signed(BASE), keyring=None).reason == "unknown_kid"
    assert rejected(BASE, keyring=None).reason == "unsigned"


def test_verify_signature_false_skips_signature_only():
    job = parse(BASE, keyring=None, verify_signature=False)
    assert job.id == BASE["id"] and job.canonical == job.content
    assert rejected(variant(template="nope"), verify_signature=False).reason == "unknown_template"


def test_expired():
    err = rejected(signed(BASE), now=datetime(2026, 12, 3, tzinfo=UTC))
    assert (err.reason, err.field) == ("expired", "not_after")


def test_a_recurring_job_states_its_lifetime_in_what_is_signed():
    cron = {"cron": "0 * * * *", "tz": "UTC"}
    doc = variant(schedule=cron)
    del doc["not_after"]
    err = rejected(signed(doc))
    assert (err.reason, err.field) == ("bad_field", "not_after") and "null to run until cancelled" in str(err)
    assert parse(signed(dict(doc, not_after=None))).not_after is None
    assert parse(signed(dict(doc, not_after="2026-12-03T00:00:00Z"))).not_after == datetime(2026, 12, 3, tzinfo=UTC)
    # a one-shot may leave it out; a stored document is held to the same rule at every load
    one_shot = variant()
    del one_shot["not_after"]
    assert parse(signed(one_shot)).not_after is None
    with pytest.raises(JobRejected):
        Job.from_stored(signed(doc), keyring=KEYS, cluster=CLUSTER)


def test_future_skew_and_max_age_and_tz_offsets():
    issued = datetime(2026, 12, 2, 11, tzinfo=UTC)
    doc = signed(variant(not_after="2026-12-10T00:00:00Z"))
    assert rejected(doc, now=issued - timedelta(seconds=301)).reason == "skew"
    assert parse(doc, now=issued - timedelta(seconds=299)).id
    # the past side is bounded by max_age_s, not the skew
    assert parse(doc, now=issued + timedelta(seconds=301)).id
    err = rejected(doc, now=issued + timedelta(seconds=86401))
    assert (err.reason, err.field, err.bound) == ("too_old", "issued_at", True)
    assert rejected(doc, now=issued + timedelta(seconds=61), max_age_s=60).reason == "too_old"
    assert parse(doc, now=issued + timedelta(seconds=59), max_age_s=60).id
    # the same instant written with an offset
    assert parse(signed(variant(issued_at="2026-12-02T12:00:00+01:00"))).issued_at == datetime(2026, 12, 2, 11, tzinfo=UTC)


def test_validation_order():
    # size -> JSON -> signature -> binding -> version -> fields -> template -> params ->
    # expiry -> age/skew: nothing unauthenticated is looked at beyond size, JSON, signature.
    assert rejected(b"x" * 100, max_bytes=10).reason == "too_large"
    assert rejected(b"{x", max_bytes=10).reason == "bad_json"
    for unsigned_doc in ({"v": 2, "bogus": 1}, {**BASE, "template": "nope", "timeout_s": -1},
                         {**BASE, "params": {"line": "x" * 5000}}, {**BASE, "cluster": "other"}):
        err = rejected(unsigned_doc)
        assert (err.reason, err.bound) == ("unsigned", False)
    assert rejected(signed({**BASE, "cluster": "other", "v": 2})).reason == "wrong_cluster"
    assert rejected(signed({**BASE, "kind": "cancel", "v": 2})).reason == "wrong_kind"
    assert rejected(signed({"v": 2, "bogus": 1})).reason == "unsupported_version"
    assert rejected(signed({**BASE, "template": "nope", "timeout_s": -1})).reason == "bad_field"
    assert rejected(signed({**BASE, "template": "nope", "params": {"x": "1"}})).reason == "unknown_template"
    assert rejected(signed({**BASE, "params": {}})).reason == "bad_param"
    late = NOW + timedelta(days=2)
    assert rejected(signed(BASE), now=late).reason == "expired"


def test_binding_to_cluster_and_kind():
    for doc, reason in [(sign({k: v for k, v in BASE.items() if k != "cluster"}, KEYS, "cloud-1"), "wrong_cluster"),
                        (signed({**BASE, "cluster": "plant-b"}), "wrong_cluster"),
                        (sign({k: v for k, v in BASE.items() if k != "kind"}, KEYS, "cloud-1"), "wrong_kind"),
                        (signed({**BASE, "kind": "cancel"}), "wrong_kind")]:
        err = rejected(doc)
        assert (err.reason, err.bound) == (reason, False), err.detail
    assert parse(signed(BASE), cluster=CLUSTER).id == BASE["id"]
    assert rejected(signed(BASE), cluster="plant-b").reason == "wrong_cluster"
    # the binding is signed: editing it breaks the signature
    doc = signed(BASE)
    doc["cluster"] = "plant-b"
    assert rejected(doc, cluster="plant-b").reason == "bad_signature"


def test_issued_at_is_required():
    doc = sign({k: v for k, v in BASE.items() if k != "issued_at"}, KEYS, "cloud-1")
    err = rejected(doc)
    assert (err.reason, err.field) == ("bad_field", "issued_at")


def test_retired_key_refuses_after_its_date_only():
    ring = KeyRing.from_mapping({"old": {"alg": "hmac-sha256", "secret": SECRET,
                                         "retired_after": "2026-12-02T11:00:10Z"}})
    doc = sign(BASE, ring, "old")
    assert parse(doc, keyring=ring, now=datetime(2026, 12, 2, 11, 0, 9, tzinfo=UTC)).kid == "old"
    err = rejected(doc, keyring=ring)  # NOW is 11:00:30
    assert (err.reason, err.bound) == ("key_retired", False)
    job = Job.from_stored(doc, keyring=ring, cluster=CLUSTER)  # no clock: the scheduler arms a timer
    assert job.key_retired_after == datetime(2026, 12, 2, 11, 0, 10, tzinfo=UTC)
    with pytest.raises(JobRejected) as ei:
        Job.from_stored(doc, keyring=ring, cluster=CLUSTER, now=NOW)
    assert ei.value.reason == "key_retired"


def test_param_length_is_limited_before_any_regex_runs():
    t = Template(argv=["/bin/echo", "{a}"], params={"a": "(?s).*"})
    err = rejected(signed({"v": 1, "id": "j", "template": "t", "params": {"a": "x" * 1025}}), templates={"t": t})
    assert (err.reason, err.field) == ("bad_field", "params.a")
    assert parse(signed({"v": 1, "id": "j", "template": "t", "params": {"a": "x" * 1024}}), templates={"t": t}).id


def test_param_regex_is_ascii_only():
    t = Template(argv=["/bin/echo", "{a}"], params={"a": r"^\d+$"})
    assert parse(signed({"v": 1, "id": "j", "template": "t", "params": {"a": "42"}}), templates={"t": t}).id
    err = rejected(signed({"v": 1, "id": "j", "template": "t", "params": {"a": "\u0664\u0662"}}), templates={"t": t})
    assert err.reason == "bad_param"


def test_naive_now_is_a_programming_error_not_a_user_error():
    with pytest.raises(JobRejected):
        parse(signed(BASE), now=datetime(2026, 12, 2, 11))


# ---------------------------------------------------------------- templates


def test_render_argv_substitutes_verbatim():
    job = parse(signed(BASE))
    argv = render_argv(job, TEMPLATES["coolant-flush"])
    assert argv == ["/usr/lib/millwright/jobs/coolant-flush", "--line", "3", "--tag=l3-fast"]


def test_render_argv_does_not_reexpand_braces():
    t = Template(argv=["/bin/echo", "{a}", "{b}"], params={"a": ".*", "b": ".*"})
    job = parse(signed({"v": 1, "id": "j", "template": "t", "params": {"a": "{b}", "b": "$(id) {0.__class__}"}}),
                templates={"t": t})
    assert render_argv(job, t) == ["/bin/echo", "{b}", "$(id) {0.__class__}"]


def test_render_argv_rechecks_a_changed_template():
    job = parse(signed(BASE))
    changed = Template(argv=["/bin/x", "{line}"], params={"line": "^[a-z]+$"})
    with pytest.raises(JobRejected) as ei:
        render_argv(job, changed)
    assert ei.value.reason == "bad_param"


def test_nul_in_param_rejected_even_if_regex_allows():
    t = Template(argv=["/bin/echo", "{a}"], params={"a": "(?s).*"})
    err = rejected(signed({"v": 1, "id": "j", "template": "t", "params": {"a": "x\x00y"}}), templates={"t": t})
    assert (err.reason, err.field) == ("bad_param", "params.a")


def test_effective_resources_capped_by_template():
    job = parse(signed(variant(resources={"cpu": 4.0, "memory_mb": 64})))
    r = effective_resources(job, TEMPLATES["coolant-flush"])
    assert r == Resources(cpu=1.0, memory_mb=64, pids=32)


# ---------------------------------------------------------------- stored documents, cancel


def test_from_stored_verifies_signature_and_binding_but_not_expiry_age_or_templates():
    doc = signed(BASE)
    job = Job.from_stored(doc, keyring=KEYS, cluster=CLUSTER)
    assert job == parse(doc) and job.canonical == parse(doc).canonical and job.kid == "cloud-1"
    old = signed(variant(not_after="2020-01-01T00:00:00Z", issued_at="2019-01-01T00:00:00Z", template="gone",
                         schedule={}))
    assert Job.from_stored(old, keyring=KEYS, cluster=CLUSTER).template == "gone"
    for bad, reason in [(variant(), "unsigned"), (sign(BASE, KeyRing.from_mapping(
            {"cloud-1": {"alg": "hmac-sha256", "secret": base64.b64encode(b"k" * 32).decode()}}), "cloud-1"),
            "bad_signature"), (signed({**BASE, "cluster": "plant-b"}), "wrong_cluster"),
            (signed({"v": 1, "id": "../x", "template": "t"}), "bad_field")]:
        with pytest.raises(JobRejected) as ei:
            Job.from_stored(bad, keyring=KEYS, cluster=CLUSTER)
        assert ei.value.reason == reason
    with pytest.raises(JobRejected) as ei:
        Job.from_stored(doc, keyring=None, cluster=CLUSTER)
    assert ei.value.reason == "unknown_kid"


def test_job_shard_matches_contract():
    import hashlib

    job = parse(signed(BASE))
    expect = int.from_bytes(hashlib.sha256(BASE["id"].encode()).digest()[:8], "big") % 64
    assert job.shard(64) == expect


def cancel(job_id, **kw) -> dict:
    return {"v": 1, "id": job_id, "cluster": CLUSTER, "kind": "cancel", "issued_at": BASE["issued_at"], **kw}


def test_parse_cancel():
    doc = sign(cancel("job-1"), KEYS, "cloud-1")
    assert parse_cancel(json.dumps(doc).encode(), KEYS, 4096, cluster=CLUSTER, now=NOW, max_age_s=86400) == "job-1"
    for payload, reason in [
        (b"nope", "bad_json"),
        (json.dumps(cancel("job-1")), "unsigned"),
        (json.dumps({**doc, "id": "job-2"}), "bad_signature"),
        (json.dumps({**doc, "extra": 1}), "bad_signature"),
        (json.dumps(sign(cancel("job-1", extra=1), KEYS, "cloud-1")), "bad_field"),
        (json.dumps(sign(cancel("job-1", v=3), KEYS, "cloud-1")), "unsupported_version"),
        (json.dumps(sign(cancel("job-1", cluster="plant-b"), KEYS, "cloud-1")), "wrong_cluster"),
        (json.dumps(sign(cancel("job-1", kind="job"), KEYS, "cloud-1")), "wrong_kind"),
        (json.dumps(sign({k: v for k, v in cancel("x").items() if k != "id"}, KEYS, "cloud-1")), "bad_field"),
        (json.dumps(doc) + " " * 5000, "too_large"),
    ]:
        with pytest.raises(JobRejected) as ei:
            parse_cancel(payload, KEYS, 4096, cluster=CLUSTER, now=NOW, max_age_s=86400)
        assert ei.value.reason == reason, (payload, ei.value.detail)


def test_a_cancel_replayed_after_a_day_is_too_old():
    doc = sign(cancel("job-1"), KEYS, "cloud-1")
    later = NOW + timedelta(days=1, seconds=1)
    with pytest.raises(JobRejected) as ei:
        parse_cancel(json.dumps(doc), KEYS, 4096, cluster=CLUSTER, now=later, max_age_s=86400)
    assert (ei.value.reason, ei.value.field) == ("too_old", "issued_at")


def test_the_brief_example_with_templates_from_the_config_file():
    from agent.config import parse_config

    cfg = parse_config(
        """
etcd: {insecure: true}
templates:
  coolant-flush:
    argv: ["/usr/lib/millwright/jobs/coolant-flush", "--line", "{line}"]
    params: {line: "^[0-9]{1,2}$"}
    user: millwright-jobs
    resources: {cpu: 1.0, memory_mb: 256, pids: 32}
    allow_exec: ["/usr/lib/millwright/jobs/*", "/usr/bin/python3*"]
""",
        "agent.yaml",
    )
    doc = {k: v for k, v in BASE.items()}
    doc["params"] = {"line": "3"}
    job = parse(signed(doc), templates=cfg.templates)
    assert render_argv(job, cfg.templates["coolant-flush"]) == ["/usr/lib/millwright/jobs/coolant-flush", "--line", "3"]
    assert effective_resources(job, cfg.templates["coolant-flush"]) == Resources(cpu=0.5, memory_mb=128, pids=32)


# ---------------------------------------------------------------- retry.on and the run's identity


def test_retry_on_defaults_to_outcomes_the_agent_saw():
    job = parse(signed(BASE))
    assert job.retry.on == ("failed", "timed_out")
    assert job.retry.retries("failed") and job.retry.retries("timed_out")
    assert not job.retry.retries("owner_lost")


def test_retry_on_owner_lost_is_an_opt_in_and_its_order_does_not_matter():
    a = parse(signed(variant(retry={"max_attempts": 3, "on": ["owner_lost", "failed"]})))
    b = parse(signed(variant(retry={"max_attempts": 3, "on": ["failed", "owner_lost"]})))
    assert a.retry.on == b.retry.on == ("failed", "owner_lost")
    assert a.retry.retries("owner_lost") and not a.retry.retries("timed_out")


def test_retry_on_error_names_the_allowed_values():
    err = rejected(signed(variant(retry={"on": ["lost"]})))
    assert "failed, timed_out, owner_lost" in err.detail and "'lost'" in err.detail


def test_render_argv_fills_the_run_identity_placeholders():
    t = Template(argv=["/bin/x", "--key={job_id}/{fire_id}", "{attempt}", "{run_id}", "{a}"], params={"a": ".*"})
    job = parse(signed({"v": 1, "id": "j", "template": "t", "params": {"a": "{fire_id}"}}), templates={"t": t})
    argv = render_argv(job, t, {"fire_id": "20261202T120000.000Z", "attempt": 2, "run_id": "20261202T120000.000Z.2"})
    # a param value is never expanded again, even when it spells a run placeholder
    assert argv == ["/bin/x", "--key=j/20261202T120000.000Z", "2", "20261202T120000.000Z.2", "{fire_id}"]


def test_run_placeholders_are_reserved_in_the_config():
    from agent.config import ConfigError, parse_config

    ok = parse_config('etcd: {insecure: true}\n'
                      'templates: {t: {argv: ["/bin/x", "{fire_id}", "{run_id}", "{attempt}", "{job_id}"]}}\n',
                      "agent.yaml")
    assert ok.templates["t"].argv[1] == "{fire_id}"
    with pytest.raises(ConfigError) as ei:
        parse_config('templates: {t: {argv: ["/bin/x", "{fire_id}"], params: {fire_id: ".*"}}}\n', "agent.yaml")
    assert any("templates.t.params.fire_id" in p and "reserved" in p for p in ei.value.problems)


@pytest.mark.parametrize("grace,ttl,deadline,ok", [(3, 10, 6, True), (5, 10, 6, False), (1.0, 4, 2.5, True),
                                                   (1.1, 4, 2.5, False), (0, 4, 3.5, True)])
def test_kill_grace_must_fit_before_the_lease_can_expire(grace, ttl, deadline, ok):
    from agent.config import ConfigError, parse_config

    text = (f"etcd: {{lease_ttl_s: {ttl}, renew_deadline_s: {deadline}, retry_period_s: 0.5, insecure: true}}\n"
            f"execute: {{kill_grace_s: {grace}}}\n")
    if ok:
        parse_config(text, "agent.yaml")
        return
    with pytest.raises(ConfigError) as ei:
        parse_config(text, "agent.yaml")
    (problem,) = ei.value.problems
    assert "execute.kill_grace_s" in problem and "lease_ttl_s - etcd.renew_deadline_s" in problem
