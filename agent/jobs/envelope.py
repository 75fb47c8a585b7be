"""The envelope of a cloud document (job, cancel or jobs/get query): the checks made
before anything an unauthenticated sender controls is read, and the rejection they raise.

 1. size (too_large)             2. JSON (bad_json): strict, bounded nesting
 3. signature (unsigned, unknown_kid, bad_signature, unsupported_alg, key_retired)
 4. binding: ``cluster`` equals the agent's (wrong_cluster), ``kind`` is ``job``,
    ``cancel`` or ``query`` as expected (wrong_kind)

:func:`authenticate` runs exactly these steps (the ingest screen, on arrival);
agent/jobs/document.py runs them first and then reads the fields. Every refusal is a
:class:`JobRejected` with a stable reason code from :data:`REASONS`; nothing here raises
anything else for any input.

Pure logic: the caller passes the key ring and the clock.
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime
from typing import Any, Optional, Union

from agent.jobs.schedule import UTC
from agent.jobs.signing import KEY_RETIRED, KeyRing, SignatureError
from agent.runtime.text import short

VERSION = 1

# Reason codes (stable: they are published in `rejected` statuses).
TOO_LARGE = "too_large"
BAD_JSON = "bad_json"
BAD_FIELD = "bad_field"
UNKNOWN_TEMPLATE = "unknown_template"
BAD_PARAM = "bad_param"
UNSIGNED = "unsigned"
UNKNOWN_KID = "unknown_kid"
BAD_SIGNATURE = "bad_signature"
UNSUPPORTED_ALG = "unsupported_alg"
EXPIRED = "expired"
SKEW = "skew"
UNSUPPORTED_VERSION = "unsupported_version"
WRONG_CLUSTER = "wrong_cluster"
WRONG_KIND = "wrong_kind"
TOO_OLD = "too_old"
REASONS = (
    TOO_LARGE, BAD_JSON, BAD_FIELD, UNKNOWN_TEMPLATE, BAD_PARAM, UNSIGNED, UNKNOWN_KID,
    BAD_SIGNATURE, UNSUPPORTED_ALG, EXPIRED, SKEW, UNSUPPORTED_VERSION,
    WRONG_CLUSTER, WRONG_KIND, TOO_OLD, KEY_RETIRED,
)

KIND_JOB = "job"
KIND_CANCEL = "cancel"
KIND_QUERY = "query"  # a jobs/get request (agent/cloud/queries.py)

MAX_DEPTH = 16


class JobRejected(Exception):
    """A document was refused. ``reason``: a stable code from REASONS; ``detail``: one
    human line naming the field; ``field``: the field path ('' when not about one)."""

    def __init__(self, reason: str, detail: str, field: str = ""):
        self.reason = reason
        self.detail = detail
        self.field = field
        # True once the signature verified and the document is bound to this cluster: only
        # then may a rejection name the job or say more than the reason (set by the parsers)
        self.bound = False
        super().__init__(f"{reason}: {detail}")


def bad(path: str, msg: str, reason: str = BAD_FIELD) -> JobRejected:
    """A rejection about the field at ``path`` (bad_field unless told)."""
    return JobRejected(reason, f"{path}: {msg}", path)


def clip(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def field_name(k: Any) -> str:
    """A user-supplied key, safe to put into a field path (bounded, printable)."""
    if isinstance(k, str) and re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", k):
        return k
    return short(k, 40)


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def as_utc(now: datetime) -> datetime:
    """``now`` in UTC; a naive datetime is a programming error (TypeError)."""
    if not isinstance(now, datetime) or now.tzinfo is None or now.utcoffset() is None:
        raise TypeError("now must be a timezone-aware datetime")
    return now.astimezone(UTC)


# --------------------------------------------------------------------------- decoding


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _no_duplicates(pairs: list) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {short(k)}")
        out[k] = v
    return out


def decode(payload: Union[bytes, bytearray, str, dict], max_bytes: Optional[int]) -> dict:
    """bytes/str/dict -> a fresh JSON object (dict), enforcing size, strict JSON (no
    NaN/Infinity, no duplicate keys, valid UTF-8 without unpaired surrogates) and a
    nesting limit. Raises JobRejected(too_large | bad_json)."""
    if isinstance(payload, dict):
        try:
            raw = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
        except (TypeError, ValueError, RecursionError) as exc:
            raise JobRejected(BAD_JSON, f"document is not representable as JSON: {clip(str(exc))}") from None
    elif isinstance(payload, str):
        try:
            raw = payload.encode("utf-8")
        except UnicodeError:
            raise JobRejected(BAD_JSON, "document is not valid UTF-8 (unpaired surrogate)") from None
    elif isinstance(payload, (bytes, bytearray, memoryview)):
        raw = bytes(payload)
    else:
        raise JobRejected(BAD_JSON, f"document must be JSON bytes or text, got {type(payload).__name__}")
    if max_bytes is not None and len(raw) > max_bytes:
        raise JobRejected(TOO_LARGE, f"document is {len(raw)} bytes; the limit is {max_bytes}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JobRejected(BAD_JSON, f"document is not valid UTF-8 (byte {exc.start})") from None
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise JobRejected(BAD_JSON, f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except (ValueError, RecursionError) as exc:
        raise JobRejected(BAD_JSON, f"invalid JSON: {clip(str(exc) or type(exc).__name__)}") from None
    if not isinstance(doc, dict):
        raise JobRejected(BAD_JSON, f"document must be a JSON object, got {type_name(doc)}")
    _check_tree(doc, None, 0)
    return doc


def _check_tree(value: Any, path: Any, depth: int) -> None:
    """Depth limit, finite numbers and encodable text everywhere. ``path`` is built lazily
    (a tuple of parts) because it is only needed for the error message."""
    if isinstance(value, str):
        _check_text(value, path)
    elif isinstance(value, dict):
        if depth >= MAX_DEPTH:
            raise JobRejected(BAD_JSON, f"{_path(path) or 'document'}: nested deeper than {MAX_DEPTH} levels")
        for k, v in value.items():
            _check_text(k, path)
            _check_tree(v, (path, k), depth + 1)
    elif isinstance(value, list):
        if depth >= MAX_DEPTH:
            raise JobRejected(BAD_JSON, f"{_path(path) or 'document'}: nested deeper than {MAX_DEPTH} levels")
        for i, v in enumerate(value):
            _check_tree(v, (path, i), depth + 1)
    elif isinstance(value, float) and not math.isfinite(value):
        raise bad(_path(path), "numbers must be finite")


def _path(parts: Any) -> str:
    out: list[str] = []
    while parts:
        parts, last = parts
        out.append(f"[{last}]" if isinstance(last, int) else field_name(last))
    text = ""
    for piece in reversed(out):
        text += piece if piece.startswith("[") or not text else "." + piece
    return text


def _check_text(s: str, path: Any) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeError:
        raise JobRejected(BAD_JSON, f"{_path(path) or 'document'}: invalid unicode (unpaired surrogate)") from None


# --------------------------------------------------------------------------- signature and binding


def verify_signature(doc: dict, keyring: Optional[KeyRing], key_now: Optional[datetime], what: str) -> Any:
    """Step 3: the key that signed ``doc``. With ``key_now``, a key retired before it fails
    with key_retired. ``what`` names the document in the detail (document, cancel)."""
    if keyring is None or len(keyring) == 0:
        if "sig" not in doc:
            raise JobRejected(UNSIGNED, f"sig: the {what} is not signed", "sig")
        raise JobRejected(UNKNOWN_KID, "sig.kid: no signing keys are configured on this agent", "sig.kid")
    try:
        return keyring.verify(doc, now=as_utc(key_now) if key_now is not None else None)
    except SignatureError as exc:
        raise JobRejected(exc.reason, f"sig: {exc.detail}", "sig") from None


def check_binding(doc: dict, cluster: str, kind: str) -> None:
    """Step 4: the signed ``cluster`` and ``kind`` must be this agent's and this topic's."""
    got = doc.get("cluster")
    if got != cluster:
        if "cluster" not in doc:
            raise JobRejected(WRONG_CLUSTER, "cluster: is required (documents are bound to one cluster)", "cluster")
        raise JobRejected(WRONG_CLUSTER, "cluster: the document is bound to another cluster", "cluster")
    got = doc.get("kind")
    if got != kind:
        if "kind" not in doc:
            raise JobRejected(WRONG_KIND, f"kind: is required (\"{kind}\" here)", "kind")
        raise JobRejected(WRONG_KIND, f"kind: a {short(got, 20)} document is not a {kind}", "kind")


def authenticate(payload: Union[bytes, str, dict], *, keyring: Optional[KeyRing], max_bytes: int, cluster: str,
                 kind: str, now: Optional[datetime] = None) -> dict:
    """Steps 1-4 (size, JSON, signature, binding): the cheap screen that lets an agent drop
    unauthenticated input at once, before it is routed, held or looked at further.
    Returns the decoded document; raises JobRejected (``bound`` False)."""
    try:
        doc = decode(payload, max_bytes)
        verify_signature(doc, keyring, now, "document" if kind == KIND_JOB else kind)
        check_binding(doc, cluster, kind)
        return doc
    except JobRejected:
        raise
    except RecursionError:
        raise JobRejected(BAD_JSON, "document is nested too deeply") from None
    except Exception as exc:  # defensive: never a traceback for user input
        raise JobRejected(BAD_FIELD, f"invalid document ({type(exc).__name__})") from None
