"""Job documents (cloud -> edge, contract v1): the job model and its validation.

``parse_job`` turns an untrusted push into a :class:`Job` or raises :class:`JobRejected`
with a stable ``reason`` code and a ``detail`` that names the offending field. It never
raises anything else for any input (a property test checks this). Validation order:
nothing an unauthenticated sender controls is looked at beyond its size, its JSON and its
signature (no operator regex ever runs on attacker strings):

 1-4. the envelope (agent/jobs/envelope.py): size (too_large), JSON (bad_json), signature
    (unsigned, unknown_kid, bad_signature, unsupported_alg, key_retired), binding to this
    cluster and kind (wrong_cluster, wrong_kind)
 -- from here on the document is authentic and meant for us: ``JobRejected.bound`` is True --
 5. v == 1 (unsupported_version)
 6. unknown keys, then every field's type and range (bad_field), ids (bad_field)
 7. template known (unknown_template)    8. params vs the template (bad_param)
 9. not_after in the past (expired)     10. issued_at older than max_age_s (too_old) or
    ahead of the clock by more than max_skew_s (skew)

Stored documents (``Job.from_stored``) go through 1-6 again at every load: the signed bytes
stay in etcd, so whoever can write etcd still cannot make an agent run anything. What a
job becomes at run time (argv, run id, resources) is agent/jobs/render.py.

Pure logic: the caller passes the clock (``now``), the templates and the key ring.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Optional, Union

from agent.config import Resources, Template
from agent.coordination import placement
from agent.coordination.keys import shard_of
from agent.jobs import approvals, envelope
from agent.jobs.envelope import (
    BAD_FIELD,
    BAD_JSON,
    BAD_PARAM,
    EXPIRED,
    KIND_CANCEL,
    KIND_JOB,
    SKEW,
    TOO_OLD,
    UNKNOWN_TEMPLATE,
    UNSUPPORTED_VERSION,
    VERSION,
    JobRejected,
    as_utc,
    bad,
    check_binding,
    clip,
    decode,
    field_name,
    type_name,
)
from agent.jobs.outcomes import DEFAULT_RETRY_ON, RETRY_ON
from agent.jobs.rollout import RolloutSpec, parse_rollout
from agent.jobs.schedule import (
    MISFIRE_POLICIES,
    OVERLAP_POLICIES,
    RetryPolicy,
    Schedule,
    ScheduleError,
    parse_rfc3339,
)
from agent.jobs.signing import KeyRing, canonical_json
from agent.jobs.window import Window, WindowError
from agent.runtime.text import short

ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")

TOP_LEVEL_KEYS = (
    "v", "id", "cluster", "kind", "template", "params", "schedule", "misfire", "misfire_limit", "overlap",
    "retry", "timeout_s", "resources", "depends_on", "not_after", "issued_at", "target", "sig",
    "rollout", "abort_action", "approvals",
    "window", "step_timeout_s",
)
CANCEL_KEYS = ("v", "id", "cluster", "kind", "issued_at", "sig")

# Ranges (documented in docs/jobs.md).
MAX_PARAMS = 64
MAX_PARAM_NAME = 64
MAX_PARAM_VALUE = 1024  # characters; checked before any regex runs
MAX_DEPENDS = 64
MAX_ATTEMPTS = 100
MAX_BACKOFF_S = 86400.0
MAX_TIMEOUT_S = 7 * 86400.0
DEFAULT_TIMEOUT_S = 3600.0
DEFAULT_MISFIRE_LIMIT = 10
MAX_MISFIRE_LIMIT = 1000
MAX_CPU = 1024.0
MAX_MEMORY_MB = 1 << 20
MAX_PIDS = 1 << 22


@dataclass(frozen=True)
class Job:
    id: str
    template: str
    params: dict
    schedule: Schedule
    misfire: str = "run_once"
    misfire_limit: int = 1
    overlap: str = "forbid"
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    timeout_s: float = DEFAULT_TIMEOUT_S
    resources: Resources = field(default_factory=Resources)
    depends_on: list = field(default_factory=list)
    not_after: Optional[datetime] = None
    issued_at: Optional[datetime] = None
    target: Optional[dict] = None  # canonical target (agent/coordination/placement.py); None: any agent
    rollout: Optional[RolloutSpec] = None   # a fan-out job's staged rollout (agent/jobs/rollout.py)
    signers: tuple = field(default=(), compare=False)  # (kid, role) of sig and each approval (approvals.py)
    window: Optional[Window] = None          # when its runs may start (agent/jobs/window.py); None: any time
    step_timeout_s: Optional[float] = None   # a run silent on its progress this long is killed (step_timed_out)
    doc: dict = field(default_factory=dict, repr=False, compare=False)
    canonical: bytes = field(default=b"", repr=False)  # canonical JSON of the full doc (with sig)
    content: bytes = field(default=b"", repr=False, compare=False)  # canonical JSON without sig (the signed bytes)
    kid: Optional[str] = field(default=None, compare=False)  # the key that signed it (None: not verified)
    key_retired_after: Optional[datetime] = field(default=None, compare=False)  # that key's retirement

    def shard(self, shards: int) -> int:
        return shard_of(self.id, shards)

    @property
    def pool(self) -> str:
        """The job's placement pool id (``default`` when untargeted)."""
        return placement.pool_id(placement.pool_spec(self.target, self.template))

    @property
    def fanout(self) -> bool:
        return bool(self.target and self.target.get("fanout"))

    def same_content(self, other: "Job") -> bool:
        """Same signed content (ignores which key signed it)."""
        return self.content == other.content

    @classmethod
    def from_stored(cls, doc: dict, *, keyring: Optional[KeyRing], cluster: str,
                    now: Optional[datetime] = None) -> "Job":
        """Re-parse a document read back from the job store. The signature and the binding
        are checked again (etcd is not trusted to hold only what ingest stored); with
        ``now``, a key retired before ``now`` fails with key_retired. No template, expiry,
        age or size checks: a stored job keeps running while its schedule says so."""
        return _parse(doc, templates=None, keyring=keyring, now=None, max_skew_s=None, max_bytes=None,
                      verify_signature=True, cluster=cluster, key_now=now)

    @classmethod
    def for_display(cls, doc: dict) -> "Job":
        """Parse a stored document only to describe it (``millwright jobs``, ``jobs/get``):
        no signature or binding check. Never used to decide that something runs: the
        scheduler loads with :meth:`from_stored`."""
        shown = dict(doc)
        shown.setdefault("cluster", "")
        shown.setdefault("kind", KIND_JOB)
        return _parse(shown, templates=None, keyring=None, now=None, max_skew_s=None, max_bytes=None,
                      verify_signature=False, cluster=shown["cluster"] if isinstance(shown["cluster"], str) else "")


def parse_job(payload: Union[bytes, str, dict], *, templates: dict, keyring: Optional[KeyRing],
              now: Optional[datetime], max_skew_s: Optional[float], max_bytes: int, cluster: str,
              max_age_s: Optional[float] = None,
              verify_signature: bool = True) -> Job:
    """Validate an untrusted job document. Raises only JobRejected (see the module doc)."""
    return _parse(payload, templates=templates, keyring=keyring, now=now, max_skew_s=max_skew_s,
                  max_bytes=max_bytes, verify_signature=verify_signature, cluster=cluster, max_age_s=max_age_s,
                  key_now=now)


# --------------------------------------------------------------------------- field checks


def _check_id(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise bad(path, f"must be a string, got {type_name(value)}")
    if not ID_RE.fullmatch(value):
        if not value:
            raise bad(path, "must not be empty")
        if len(value) > 128:
            raise bad(path, f"is {len(value)} characters long; at most 128 are allowed")
        raise bad(path, f"{short(value)} may contain only A-Z a-z 0-9 . _ - (1 to 128 characters)")
    if value.startswith("."):
        raise bad(path, f"{short(value)} must not start with '.' (ids become etcd key segments)")
    return value


def _number(doc: dict, key: str, path: str, lo: float, hi: float, default: Any, *, integer: bool = False,
            lo_open: bool = False) -> Any:
    if key not in doc:
        return default
    v = doc[key]
    kind = "an integer" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise bad(path, f"must be {kind}, got {type_name(v)} {short(v)}")
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v <= lo):
        rng = f"greater than {lo:g} and at most {hi:g}" if lo_open else f"between {lo:g} and {hi:g}"
        raise bad(path, f"must be {kind} {rng}, got {short(v)}")
    return v if integer else float(v)


def _object(doc: dict, key: str, path: str, allowed: tuple) -> dict:
    v = doc.get(key, {})
    if not isinstance(v, dict):
        raise bad(path, f"must be an object, got {type_name(v)}")
    extra = [k for k in v if k not in allowed]
    if extra:
        raise bad(f"{path}.{field_name(extra[0])}", f"unknown key (allowed: {', '.join(allowed)})")
    return v


def _timestamp(doc: dict, key: str, nullable: bool = False) -> Optional[datetime]:
    if key not in doc or (nullable and doc[key] is None):
        return None
    try:
        return parse_rfc3339(doc[key])
    except ValueError as exc:
        raise bad(key, f"{exc}, got {short(doc[key])}") from None


def _parse(payload: Any, *, templates: Optional[dict], keyring: Optional[KeyRing], now: Optional[datetime],
           max_skew_s: Optional[float], max_bytes: Optional[int], verify_signature: bool, cluster: str,
           max_age_s: Optional[float] = None, key_now: Optional[datetime] = None) -> Job:
    stage = {"bound": False}
    try:
        return _parse_inner(payload, templates, keyring, now, max_skew_s, max_bytes, verify_signature, cluster,
                            max_age_s, key_now, stage)
    except JobRejected as exc:
        exc.bound = stage["bound"]
        raise
    except RecursionError:
        raise JobRejected(BAD_JSON, "document is nested too deeply") from None
    except Exception as exc:  # defensive: never a traceback for user input
        raise JobRejected(BAD_FIELD, f"invalid document ({type(exc).__name__}: {clip(str(exc))})") from None


def check_version(doc: dict) -> None:
    """`v` must be the integer 1 (job documents and cancels alike)."""
    if "v" not in doc:
        raise bad("v", "is required (the contract version, 1)")
    v = doc["v"]
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad("v", f"must be the integer 1, got {type_name(v)} {short(v)}")
    if v != VERSION:
        raise JobRejected(UNSUPPORTED_VERSION, f"v: version {short(v)} is not supported (this agent speaks v1)", "v")


def _parse_inner(payload: Any, templates: Optional[dict], keyring: Optional[KeyRing], now: Optional[datetime],
                 max_skew_s: Optional[float], max_bytes: Optional[int], verify_signature: bool, cluster: str,
                 max_age_s: Optional[float], key_now: Optional[datetime], stage: dict) -> Job:
    doc = decode(payload, max_bytes)

    # ---- signature, then binding: nothing else is read from an unauthenticated document
    key = envelope.verify_signature(doc, keyring, key_now, "document") if verify_signature else None
    check_binding(doc, cluster, KIND_JOB)
    stage["bound"] = True

    # ---- version
    check_version(doc)

    # ---- shape
    unknown = [k for k in doc if k not in TOP_LEVEL_KEYS]
    if unknown:
        raise bad(field_name(unknown[0]), f"unknown key (allowed: {', '.join(TOP_LEVEL_KEYS)})")
    for req in ("id", "template"):
        if req not in doc:
            raise bad(req, "is required")
    job_id = _check_id(doc["id"], "id")
    tname = doc["template"]
    if not isinstance(tname, str):
        raise bad("template", f"must be a string, got {type_name(tname)}")
    if not ID_RE.fullmatch(tname):
        raise bad("template", f"{short(tname)} is not a template name ([A-Za-z0-9._-]{{1,128}})")

    params = doc.get("params", {})
    if not isinstance(params, dict):
        raise bad("params", f"must be an object of strings, got {type_name(params)}")
    if len(params) > MAX_PARAMS:
        raise bad("params", f"has {len(params)} entries; at most {MAX_PARAMS} are allowed")
    for k, pv in params.items():
        if not isinstance(k, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", k):
            raise bad("params", f"parameter name {short(k)} must match [A-Za-z_][A-Za-z0-9_]{{0,63}}")
        if not isinstance(pv, str):
            raise bad(f"params.{k}", f"must be a string, got {type_name(pv)}")
        if len(pv) > MAX_PARAM_VALUE:
            raise bad(f"params.{k}", f"is {len(pv)} characters long; at most {MAX_PARAM_VALUE} are allowed")

    try:
        schedule = Schedule.parse(doc.get("schedule", {}))
    except ScheduleError as exc:
        raise bad(exc.field, exc.message) from None

    misfire = doc.get("misfire", "run_once")
    if not isinstance(misfire, str) or misfire not in MISFIRE_POLICIES:
        raise bad("misfire", f"must be one of {', '.join(MISFIRE_POLICIES)}, got {short(misfire)}")
    if "misfire_limit" in doc and misfire != "run_all":
        raise bad("misfire_limit", "is only allowed with \"misfire\": \"run_all\"")
    misfire_limit = _number(doc, "misfire_limit", "misfire_limit", 1, MAX_MISFIRE_LIMIT,
                            DEFAULT_MISFIRE_LIMIT if misfire == "run_all" else 1, integer=True)

    overlap = doc.get("overlap", "forbid")
    if not isinstance(overlap, str) or overlap not in OVERLAP_POLICIES:
        raise bad("overlap", f"must be one of {', '.join(OVERLAP_POLICIES)}, got {short(overlap)}")

    r = _object(doc, "retry", "retry", ("max_attempts", "backoff_s", "max_backoff_s", "jitter", "on"))
    retry = RetryPolicy(
        max_attempts=_number(r, "max_attempts", "retry.max_attempts", 1, MAX_ATTEMPTS, 1, integer=True),
        backoff_s=_number(r, "backoff_s", "retry.backoff_s", 0, MAX_BACKOFF_S, 1.0),
        max_backoff_s=_number(r, "max_backoff_s", "retry.max_backoff_s", 0, MAX_BACKOFF_S, 60.0),
        jitter=_number(r, "jitter", "retry.jitter", 0, 1, 0.0),
        on=_retry_on(r),
    )
    if "max_backoff_s" in r and retry.max_backoff_s < retry.backoff_s:
        raise bad("retry.max_backoff_s", f"must be at least retry.backoff_s ({retry.backoff_s:g})")
    if "max_backoff_s" not in r and retry.max_backoff_s < retry.backoff_s:
        retry = RetryPolicy(retry.max_attempts, retry.backoff_s, retry.backoff_s, retry.jitter, retry.on)

    timeout_s = _number(doc, "timeout_s", "timeout_s", 0, MAX_TIMEOUT_S, DEFAULT_TIMEOUT_S, lo_open=True)

    res = _object(doc, "resources", "resources", ("cpu", "memory_mb", "pids"))
    resources = Resources(
        cpu=_number(res, "cpu", "resources.cpu", 0, MAX_CPU, None, lo_open=True),
        memory_mb=_number(res, "memory_mb", "resources.memory_mb", 4, MAX_MEMORY_MB, None, integer=True),
        pids=_number(res, "pids", "resources.pids", 1, MAX_PIDS, None, integer=True),
    )

    deps = doc.get("depends_on", [])
    if not isinstance(deps, list):
        raise bad("depends_on", f"must be a list of job ids, got {type_name(deps)}")
    if len(deps) > MAX_DEPENDS:
        raise bad("depends_on", f"has {len(deps)} entries; at most {MAX_DEPENDS} are allowed")
    seen: set = set()
    for i, dep in enumerate(deps):
        _check_id(dep, f"depends_on[{i}]")
        if dep == job_id:
            raise bad(f"depends_on[{i}]", "a job cannot depend on itself")
        if dep in seen:
            raise bad(f"depends_on[{i}]", f"{short(dep)} is listed twice")
        seen.add(dep)

    not_after = _timestamp(doc, "not_after", nullable=True)
    if schedule.kind == "cron" and "not_after" not in doc and verify_signature:   # (display reads any)
        # a recurring job signed once would otherwise run for ever, and a copy of it could be
        # put back into the store years later: its lifetime is part of what is signed
        raise bad("not_after", "is required for a recurring job: an RFC 3339 time after which it never runs, "
                               "or null to run until cancelled")
    if "issued_at" not in doc:
        raise bad("issued_at", "is required (the signer's clock; pushes older than max_age_s are refused)")
    issued_at = _timestamp(doc, "issued_at")
    if not_after is not None and issued_at is not None and not_after <= issued_at:
        raise bad("not_after", "must be later than issued_at")
    if not_after is not None and schedule.kind == "at" and schedule.at is not None and schedule.at >= not_after:
        raise bad("schedule.at", "is not before not_after: the job could never run")

    target = None
    if "target" in doc:
        try:
            target = placement.check_target(doc["target"])
        except placement.TargetError as exc:
            raise bad(exc.field, exc.message) from None

    # ---- staged rollout and four-eyes approval (agent/jobs/rollout.py, approvals.py)
    rollout = parse_rollout(doc, target)
    signers = approvals.signers(doc, keyring, key_now, key, verify=keyring is not None)
    window, step_timeout_s = _maintenance(doc)

    sig = doc.get("sig")
    if "sig" in doc:
        if not isinstance(sig, dict):
            raise bad("sig", f"must be an object with alg, kid and value, got {type_name(sig)}")
        extra = [k for k in sig if k not in ("alg", "kid", "value")]
        if extra:
            raise bad(f"sig.{field_name(extra[0])}", "unknown key (allowed: alg, kid, value)")
        for name in ("alg", "kid", "value"):
            if not isinstance(sig.get(name), str) or not sig.get(name):
                raise bad(f"sig.{name}", "must be a non-empty string")

    # ---- template and params (skipped for stored documents: templates is None; a targeted
    # job's template is checked by the agents it targets, which may not include this one)
    if templates is not None and not (target is not None and tname not in templates):
        template = templates.get(tname)
        if template is None:
            known = ", ".join(sorted(templates)) or "none configured"
            raise JobRejected(UNKNOWN_TEMPLATE, f"template: {short(tname)} is not a template of this agent (known: {short(known, 200)})", "template")
        check_params(params, template, tname)

    # ---- time
    if now is not None:
        now_utc = as_utc(now)
        if not_after is not None and not_after <= now_utc:
            raise JobRejected(EXPIRED, f"not_after: the job expired at {doc['not_after']}", "not_after")
        _check_age(doc, issued_at, now_utc, max_skew_s, max_age_s)

    stored = doc  # decode() always returns a fresh object that nothing else references
    return Job(
        id=job_id, template=tname, params=dict(params), schedule=schedule, misfire=misfire,
        misfire_limit=misfire_limit, overlap=overlap, retry=retry, timeout_s=timeout_s, resources=resources,
        depends_on=list(deps), not_after=not_after, issued_at=issued_at, target=target, rollout=rollout,
        signers=signers, window=window, step_timeout_s=step_timeout_s, doc=stored,
        canonical=canonical_json(stored, with_sig=True), content=canonical_json(stored),
        kid=key.kid if key is not None else None,
        key_retired_after=key.retired_after if key is not None else None,
    )


def _check_age(doc: dict, issued_at: Optional[datetime], now_utc: datetime, max_skew_s: Optional[float],
               max_age_s: Optional[float]) -> None:
    """issued_at may be at most max_skew_s ahead of the clock (skew) and at most max_age_s
    behind it (too_old): a captured document cannot be replayed for ever."""
    if issued_at is None:
        return
    ahead = (issued_at - now_utc).total_seconds()
    if max_skew_s is not None and ahead > max_skew_s:
        raise JobRejected(SKEW, f"issued_at: {doc['issued_at']} is {ahead:.0f} s ahead of this agent's clock "
                                f"(allowed: {max_skew_s:g} s)", "issued_at")
    if max_age_s is not None and -ahead > max_age_s:
        raise JobRejected(TOO_OLD, f"issued_at: {doc['issued_at']} is {-ahead:.0f} s old "
                                   f"(allowed: {max_age_s:g} s)", "issued_at")


# --------------------------------------------------------------------------- templates


def check_params(params: dict, template: Template, tname: str = "template") -> None:
    """params must be exactly the template's params, each value matching its regex in
    full (and free of NUL, which no argv can carry). Raises JobRejected(bad_param).

    Runs at ingest and again for every run (render_argv, on the agent's loop: the
    template may have changed since ingest). The regexes match in linear time
    (agent/jobs/paramregex.py) and the verdict is remembered per template name, params
    and template params, so a job's later firings cost a lookup (the key holds the job's
    own strings, whose hashes Python keeps)."""
    try:
        verdict = _remembered_verdict(tname, tuple(params.items()), tuple(template.params.items()))
    except TypeError:   # an unhashable value: checked (and refused) without remembering
        verdict = _param_verdict(params, template.params, tname)
    if verdict is not None:
        raise JobRejected(*verdict)


@functools.lru_cache(maxsize=256)   # entries are at most one document each (64 KiB)
def _remembered_verdict(tname: str, params: tuple, template_params: tuple) -> Optional[tuple[str, str, str]]:
    return _param_verdict(dict(params), dict(template_params), tname)


def _param_verdict(params: dict, template_params: dict, tname: str) -> Optional[tuple[str, str, str]]:
    """None, or the (reason, detail, field) of check_params' rejection."""
    try:
        _check_params(params, template_params, tname)
    except JobRejected as exc:
        return exc.reason, exc.detail, exc.field
    return None


def _check_params(params: dict, template_params: dict, tname: str) -> None:
    for name in template_params:
        if name not in params:
            raise bad(f"params.{name}", f"is required by template {tname}", BAD_PARAM)
    for name, value in params.items():
        rx = template_params.get(name)
        if rx is None:
            allowed = ", ".join(sorted(template_params)) or "none"
            raise bad(f"params.{name}", f"is not a parameter of template {tname} (its params: {allowed})", BAD_PARAM)
        if not isinstance(value, str):
            raise bad(f"params.{name}", f"must be a string, got {type_name(value)}", BAD_PARAM)
        if "\x00" in value:
            raise bad(f"params.{name}", "must not contain NUL", BAD_PARAM)
        if len(value) > MAX_PARAM_VALUE:  # bounds the regex's work before it runs
            raise bad(f"params.{name}", f"is {len(value)} characters long; at most {MAX_PARAM_VALUE} are allowed",
                      BAD_PARAM)
        try:
            ok = param_regex(rx).fullmatch(value) is not None
        except re.error:
            ok = False
        if not ok:
            raise bad(f"params.{name}", f"{short(value)} does not match {rx}", BAD_PARAM)


def _maintenance(doc: dict) -> tuple[Optional[Window], Optional[float]]:
    """``window`` (when runs may start) and ``step_timeout_s`` (progress, docs/jobs.md)."""
    window = None
    if "window" in doc:
        try:
            window = Window.parse(doc["window"])
        except WindowError as exc:
            raise bad(exc.field, exc.message) from None
    step = _number(doc, "step_timeout_s", "step_timeout_s", 0, MAX_TIMEOUT_S, None, lo_open=True)
    return window, step


def _retry_on(r: dict) -> tuple:
    """retry.on: a non-empty list of distinct outcomes from RETRY_ON (default: failed,
    timed_out; owner_lost only when the job can stand a second run of a firing)."""
    if "on" not in r:
        return DEFAULT_RETRY_ON
    on = r["on"]
    allowed = ", ".join(RETRY_ON)
    if not isinstance(on, list) or not on:
        raise bad("retry.on", f"must be a non-empty list of {allowed}, got {short(on)}")
    for i, v in enumerate(on):
        if not isinstance(v, str) or v not in RETRY_ON:
            raise bad(f"retry.on[{i}]", f"must be one of {allowed}, got {short(v)}")
    if len(set(on)) != len(on):
        raise bad("retry.on", f"lists an outcome twice: {short(on)}")
    return tuple(v for v in RETRY_ON if v in on)


@functools.lru_cache(maxsize=512)
def param_regex(rx: str) -> "re.Pattern":
    """A template's param regex, compiled with re.ASCII: \\d, \\w and \\s match ASCII only
    (a Unicode digit in a param never reaches an argv that expects 0-9)."""
    return re.compile(rx, re.ASCII)


# --------------------------------------------------------------------------- cancel


def parse_cancel(payload: Union[bytes, str, dict], keyring: Optional[KeyRing], max_bytes: int, *,
                 cluster: str, now: Optional[datetime] = None, max_skew_s: Optional[float] = None,
                 max_age_s: Optional[float] = None, verify_signature: bool = True) -> str:
    """``{"v":1,"id","cluster","kind":"cancel","issued_at","sig"}`` -> the job id. Same
    errors and order as parse_job (a cancel older than max_age_s is too_old)."""
    stage = {"bound": False}
    try:
        doc = decode(payload, max_bytes)
        if verify_signature:
            envelope.verify_signature(doc, keyring, now, "cancel")
        check_binding(doc, cluster, KIND_CANCEL)
        stage["bound"] = True
        check_version(doc)
        unknown = [k for k in doc if k not in CANCEL_KEYS]
        if unknown:
            raise bad(field_name(unknown[0]), f"unknown key (a cancel has only: {', '.join(CANCEL_KEYS)})")
        if "id" not in doc:
            raise bad("id", "is required")
        job_id = _check_id(doc["id"], "id")
        if "issued_at" not in doc:
            raise bad("issued_at", "is required (cancels older than max_age_s are refused)")
        issued_at = _timestamp(doc, "issued_at")
        if now is not None:
            _check_age(doc, issued_at, as_utc(now), max_skew_s, max_age_s)
        return job_id
    except JobRejected as exc:
        exc.bound = stage["bound"]
        raise
    except RecursionError:
        raise JobRejected(BAD_JSON, "document is nested too deeply") from None
    except Exception as exc:  # defensive
        raise JobRejected(BAD_FIELD, f"invalid cancel ({type(exc).__name__}: {clip(str(exc))})") from None

