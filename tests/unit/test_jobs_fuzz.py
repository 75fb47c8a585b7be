"""Property tests: parse_job / parse_cancel raise nothing but JobRejected, whatever they
are given, and never accept a document that breaks the rules."""

from __future__ import annotations

import base64
import json

from hypothesis import HealthCheck, given, settings, strategies as st

from agent.config import Template
from agent.jobs.document import ID_RE, parse_cancel
from agent.jobs.envelope import REASONS, JobRejected
from agent.jobs.signing import KeyRing, sign
from tests.support.documents import CLUSTER, KEYS, NOW, parser

TEMPLATES = {"t": Template(argv=["/bin/echo", "{line}"], params={"line": "^[0-9]{1,2}$"})}
FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=12))
json_ish = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                        max_leaves=6)
VALID = {
    "v": 1, "id": "job-1", "cluster": CLUSTER, "kind": "job", "template": "t", "params": {"line": "3"}, "schedule": {"cron": "0 */5 * * * *", "tz": "Europe/Berlin"},
    "misfire": "run_all", "misfire_limit": 3, "overlap": "forbid",
    "retry": {"max_attempts": 3, "backoff_s": 2, "max_backoff_s": 60, "jitter": 0.2}, "timeout_s": 300,
    "resources": {"cpu": 0.5, "memory_mb": 128, "pids": 64}, "depends_on": ["a"],
    "not_after": "2026-12-03T00:00:00Z", "issued_at": "2026-12-02T11:00:00Z",
}

# Values near the edges of each field, so that generated documents reach deep validation.
FIELD_VALUES = {
    "v": st.sampled_from([1, 1, 1, 2, 0, "1", 1.0, True, None]),
    "id": st.one_of(st.from_regex(r"[A-Za-z0-9._-]{1,12}", fullmatch=True),
                    st.sampled_from(["", ".", "..", "../x", "a/b", "a" * 129, "a\x00", "é"]), st.text(max_size=10)),
    "template": st.sampled_from(["t", "t", "nope", "", 5, None]),
    "params": st.one_of(st.just({"line": "3"}), st.dictionaries(st.sampled_from(["line", "x", ""]), json_ish, max_size=2)),
    "schedule": st.one_of(
        st.just({}),
        st.fixed_dictionaries({"at": st.sampled_from(["2026-12-02T12:00:00Z", "2026-12-02T12:00:00", "x", 5])}),
        st.fixed_dictionaries({"delay_s": st.one_of(st.floats(), st.integers(-5, 10**9))}),
        st.fixed_dictionaries({"cron": st.sampled_from(["* * * * *", "0 */5 * * * *", "61 * * * *", "0 0 30 2 *", "a b c d e", "", "* * * * * * *"]),
                               "tz": st.sampled_from(["UTC", "Europe/Berlin", "Mars/X", "../x", "", 3])}),
        json_ish,
    ),
    "misfire": st.sampled_from(["run_once", "skip", "run_all", "x", None, 1]),
    "misfire_limit": st.one_of(st.integers(-2, 2000), st.floats()),
    "overlap": st.sampled_from(["forbid", "allow", "replace", "x", []]),
    "retry": st.one_of(st.fixed_dictionaries({}, optional={
        "max_attempts": st.one_of(st.integers(-1, 200), st.floats()), "backoff_s": st.floats(),
        "max_backoff_s": st.floats(), "jitter": st.floats()}), json_ish),
    "timeout_s": st.one_of(st.floats(), st.integers(-10, 10**7), json_ish),
    "resources": st.one_of(st.fixed_dictionaries({}, optional={
        "cpu": st.floats(), "memory_mb": st.integers(-1, 2**21), "pids": st.integers(-1, 2**23)}), json_ish),
    "depends_on": st.one_of(st.lists(st.sampled_from(["a", "b", "..", "a/b", "", 1]), max_size=3), json_ish),
    "not_after": st.sampled_from(["2026-12-03T00:00:00Z", "2026-12-01T00:00:00Z", "bad", 0]),
    "issued_at": st.sampled_from(["2026-12-02T11:00:00Z", "2026-12-02T09:00:00Z", "2026-12-02T11:00:00+01:00", "x"]),
    "cluster": st.sampled_from([CLUSTER, CLUSTER, "plant-b", "", None, 1]),
    "kind": st.sampled_from(["job", "job", "cancel", "", None]),
    "bogus": json_ish,
}


@st.composite
def documents(draw):
    """A valid document with up to three fields replaced by edge values or removed."""
    doc = dict(VALID)
    for key in draw(st.sets(st.sampled_from(sorted(FIELD_VALUES)), max_size=3)):
        if draw(st.integers(0, 5)) == 0:
            doc.pop(key, None)
        else:
            doc[key] = draw(FIELD_VALUES[key])
    return doc


call = parser(TEMPLATES, max_bytes=8192)


def check_accepted(job, doc):
    """An accepted document really satisfies the rules."""
    assert doc.get("v") == 1 and not isinstance(doc.get("v"), bool)
    assert ID_RE.fullmatch(job.id) and not job.id.startswith(".")
    assert job.template in TEMPLATES and set(job.params) == {"line"}
    assert doc.get("cluster") == CLUSTER and doc.get("kind") == "job" and "issued_at" in doc
    KEYS.verify(doc)  # only what this ring signed is ever accepted
    assert set(doc) <= {"v", "id", "cluster", "kind", "template", "params", "schedule", "misfire", "misfire_limit", "overlap", "retry",
                        "timeout_s", "resources", "depends_on", "not_after", "issued_at", "sig"}
    assert 0 < job.timeout_s and 1 <= job.retry.max_attempts <= 100 and 0 <= job.retry.jitter <= 1
    assert job.not_after is None or job.not_after > NOW


@FUZZ
@given(doc=documents(), sign_it=st.booleans())
def test_structured_documents_only_raise_job_rejected(doc, sign_it):
    payload = doc
    if sign_it:
        try:
            payload = sign(doc, KEYS, "cloud-1")
        except (TypeError, ValueError):
            payload = doc  # not canonicalisable (NaN...): send it unsigned
    try:
        job = call(payload)
    except JobRejected as exc:
        assert exc.reason in REASONS and exc.detail and len(exc.detail) < 1000
        return
    assert sign_it
    check_accepted(job, payload)
    # and the stored copy verifies again at load, bound to this cluster only
    from agent.jobs.document import Job

    assert Job.from_stored(payload, keyring=KEYS, cluster=CLUSTER).content == job.content
    try:
        Job.from_stored(payload, keyring=KEYS, cluster="plant-b")
    except JobRejected as exc:
        assert exc.reason == "wrong_cluster"
    else:  # pragma: no cover
        raise AssertionError("a document bound to plant-a loaded in plant-b")


@FUZZ
@given(doc=json_ish)
def test_arbitrary_json_values_only_raise_job_rejected(doc):
    for payload in (doc, json.dumps(doc, allow_nan=True)):
        try:
            call(payload)
        except JobRejected as exc:
            assert exc.reason in REASONS
        else:  # pragma: no cover - an arbitrary value is never a signed document
            raise AssertionError("accepted an arbitrary value")


@FUZZ
@given(data=st.one_of(st.binary(max_size=300), st.text(max_size=300)))
def test_arbitrary_bytes_only_raise_job_rejected(data):
    for verify in (True, False):
        try:
            call(data, verify_signature=verify)
        except JobRejected as exc:
            assert exc.reason in REASONS
        try:
            parse_cancel(data, KEYS, 8192, cluster=CLUSTER, now=NOW, max_age_s=86400)
        except JobRejected as exc:
            assert exc.reason in REASONS


@FUZZ
@given(doc=st.fixed_dictionaries({}, optional={"v": FIELD_VALUES["v"], "id": FIELD_VALUES["id"], "x": json_ish,
                                               "cluster": FIELD_VALUES["cluster"],
                                               "kind": st.sampled_from(["cancel", "cancel", "job", None]),
                                               "issued_at": FIELD_VALUES["issued_at"]}),
       sign_it=st.booleans())
def test_cancel_only_raises_job_rejected(doc, sign_it):
    payload = doc
    if sign_it:
        try:
            payload = sign(doc, KEYS, "cloud-1")
        except (TypeError, ValueError):
            pass
    try:
        job_id = parse_cancel(payload, KEYS, 8192, cluster=CLUSTER, now=NOW, max_skew_s=300, max_age_s=86400)
    except JobRejected as exc:
        assert exc.reason in REASONS
        return
    assert sign_it and ID_RE.fullmatch(job_id)
    assert set(payload) == {"v", "id", "cluster", "kind", "issued_at", "sig"}
    assert payload["cluster"] == CLUSTER and payload["kind"] == "cancel"
    KEYS.verify(payload)


def test_a_valid_document_passes_the_fuzz_oracle():
    doc = sign({"v": 1, "id": "ok", "cluster": CLUSTER, "kind": "job", "template": "t", "params": {"line": "3"},
                "issued_at": "2026-12-02T11:00:00Z"}, KEYS, "cloud-1")
    check_accepted(call(doc), doc)


OTHER_KEYS = KeyRing.from_mapping({"cloud-1": {"alg": "hmac-sha256", "secret": base64.b64encode(b"o" * 32).decode()}})


@FUZZ
@given(doc=documents(), signer=st.sampled_from(["ours", "ours", "other", "none"]),
       tamper=st.sampled_from([None, None, "cluster", "kind", "id", "params"]))
def test_the_stored_job_gate_admits_only_documents_signed_by_the_ring_and_bound_here(doc, signer, tamper):
    """What the scheduler runs: Job.from_stored(...) succeeds only for a document this ring
    signed, bound to this cluster as a job, unchanged since signing (issue 16, acceptance 5)."""
    from agent.jobs.document import Job

    payload = dict(doc)
    if signer != "none":
        try:
            payload = sign(doc, KEYS if signer == "ours" else OTHER_KEYS, "cloud-1")
        except (TypeError, ValueError):
            payload = dict(doc)
    if tamper is not None and isinstance(payload, dict):
        payload = json.loads(json.dumps(payload, allow_nan=True))
        new = {"cluster": "plant-b", "kind": "cancel", "id": "other-job", "params": {"line": "9"}}[tamper]
        if payload.get(tamper) == new:
            tamper = None  # it already had that value: not a change
        else:
            payload[tamper] = new
    try:
        job = Job.from_stored(payload, keyring=KEYS, cluster=CLUSTER)
    except JobRejected as exc:
        assert exc.reason in REASONS
        return
    KEYS.verify(payload)
    assert signer == "ours" and tamper is None
    assert payload["cluster"] == CLUSTER and payload["kind"] == "job" and job.kid == "cloud-1"
