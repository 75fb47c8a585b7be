"""Signatures of job and cancel documents: canonical form, key ring, sign and verify.

The cloud signs the *canonical JSON* of a document without its ``sig`` member: keys
sorted (by code point), no whitespace, UTF-8 without ``\\u`` escapes for non-ASCII, no
NaN/Infinity. The signature travels in the document as
``"sig": {"alg": ..., "kid": ..., "value": "<base64>"}``.

Keys live in a root-only YAML file mapping a key id to a key::

    cloud-1: {alg: hmac-sha256, secret: "<base64 of >= 32 random bytes>"}
    cloud-2: {alg: ed25519, public_key: "<base64 of the 32-byte raw public key>"}
    ops-1:   {alg: ed25519, private_key: "<base64 of the 32-byte raw seed>"}   # signers only
    old-1:   {alg: ed25519, public_key: "...", retired_after: "2027-03-01T00:00:00Z"}
    qa-1:    {alg: ed25519, public_key: "...", role: quality}   # role: four-eyes approval

ed25519 is the default (gateways then hold only public keys; ``millwright keygen`` makes a
pair); hmac-sha256 is for labs, where every gateway holds the signing secret. ed25519 uses
python3-cryptography (a Debian package the .deb depends on); without it an ed25519 key
still loads, and using it fails with the reason ``unsupported_alg``.

Rotation: a key with ``retired_after`` verifies documents only until that instant; after
it, verify(now=...) fails with ``key_retired`` (stored jobs signed by it then stop).
Pure logic: no network; the caller passes the clock.
"""

from __future__ import annotations

import base64
import binascii
import copy
import hashlib
import hmac
import json
import logging
import os
import re
import stat
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Optional

import yaml

from agent.runtime.text import short as _short

if TYPE_CHECKING:
    from agent.jobs.seams import AuditSink

log = logging.getLogger(__name__)

try:  # python3-cryptography (Debian); optional
    from cryptography.exceptions import InvalidSignature as _InvalidSignature
    from cryptography.hazmat.primitives import serialization as _serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey as _Ed25519PrivateKey,
    )
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PublicKey as _Ed25519PublicKey,
    )

    HAVE_ED25519 = True
except Exception:  # pragma: no cover - depends on the host
    HAVE_ED25519 = False

HMAC_SHA256 = "hmac-sha256"
ED25519 = "ed25519"
ALGS = (HMAC_SHA256, ED25519)
MIN_HMAC_SECRET_BYTES = 32
KID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
ROLE_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")

# Reason codes of SignatureError (also used verbatim as JobRejected reasons).
UNSIGNED = "unsigned"
UNKNOWN_KID = "unknown_kid"
BAD_SIGNATURE = "bad_signature"
UNSUPPORTED_ALG = "unsupported_alg"
KEY_RETIRED = "key_retired"
NO_PRIVATE_KEY = "no_private_key"  # only from sign()


class SignatureError(Exception):
    """A document's signature cannot be accepted (or made). ``reason`` is a stable code."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        self.detail = detail or reason
        super().__init__(f"{reason}: {self.detail}")


class KeyFileError(Exception):
    """The keys file is unusable: unreadable, too open, or invalid. One line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


# --------------------------------------------------------------------------- canonical form


UNSIGNED_MEMBERS = ("sig", "approvals")   # what the signatures travel in: never part of the signed bytes


def load_keyring(path: str, audit: AuditSink) -> KeyRing:
    """The daemon's key ring, loaded once at start: an unusable keys file is logged (one
    line per problem) and recorded, and gives an empty ring, so every push and every stored
    job is rejected until the file is fixed (the agent still runs: it keeps its shards)."""
    try:
        return KeyRing.load(path)
    except KeyFileError as exc:
        for line in exc.problems:
            log.error("signing keys unusable: no push or stored job will be accepted",
                      extra={"fields": {"problem": line}})
        audit.record("config", event="signing_keys_unusable", problems=exc.problems)
        return KeyRing({}, source=path)


def canonical_json(doc: dict, *, with_sig: bool = False) -> bytes:
    """The bytes that are signed: ``doc`` without ``sig`` and ``approvals`` (unless
    ``with_sig``), keys sorted, no whitespace, UTF-8. Raises ValueError/TypeError for
    values JSON cannot carry (NaN, Infinity, non-string keys, unpaired surrogates)."""
    if not isinstance(doc, dict):
        raise TypeError("a document must be a JSON object")
    body = doc if with_sig else {k: v for k, v in doc.items() if k not in UNSIGNED_MEMBERS}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8")  # UnicodeEncodeError (a ValueError) for lone surrogates


def _b64decode(text: Any) -> bytes:
    """Strict standard base64 (padding required, no stray characters)."""
    if not isinstance(text, str) or not text.isascii():
        raise ValueError("not base64")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not base64") from None


def _b64encode(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


# --------------------------------------------------------------------------- keys


@dataclass(frozen=True)
class Key:
    kid: str
    alg: str
    secret: Optional[bytes] = field(default=None, repr=False)  # hmac-sha256
    public_key: Optional[bytes] = field(default=None, repr=False)  # ed25519 raw 32 bytes
    private_key: Optional[bytes] = field(default=None, repr=False)  # ed25519 raw 32-byte seed
    retired_after: Optional[datetime] = None  # documents signed by it stop verifying after this
    role: Optional[str] = None                # whose approval its signature is (four-eyes templates)

    @property
    def can_sign(self) -> bool:
        return self.secret is not None if self.alg == HMAC_SHA256 else self.private_key is not None


class KeyRing:
    """Keys by id. Build with :meth:`load` (the YAML keys file) or :meth:`from_mapping`."""

    def __init__(self, keys: dict[str, Key], source: str = "<memory>"):
        self._keys = dict(keys)
        self.source = source

    def __repr__(self) -> str:  # never print secrets
        return f"KeyRing({self.source!r}, kids={sorted(self._keys)!r})"

    def __contains__(self, kid: object) -> bool:
        return kid in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def kids(self) -> list[str]:
        return sorted(self._keys)

    def get(self, kid: str) -> Optional[Key]:
        return self._keys.get(kid)

    def replace(self, other: "KeyRing") -> None:
        """Take ``other``'s keys in place (a reload): every holder of this ring (ingest, the
        catalog, the scheduler) verifies with the new keys from the next document on."""
        self._keys = dict(other._keys)
        self.source = other.source

    def digest(self) -> str:
        """SHA-256 of the ring's public content (kids, algorithms, public keys, retirements,
        roles), never of a secret itself: what a reload compares and records."""
        import hashlib

        h = hashlib.sha256()
        for kid in sorted(self._keys):
            k = self._keys[kid]
            secret = hashlib.sha256(k.secret).hexdigest() if k.secret else ""
            h.update(repr((kid, k.alg, k.public_key, secret, k.retired_after, k.role)).encode())
        return h.hexdigest()

    # ---- loading

    @classmethod
    def load(cls, path: str, require_private: bool = False) -> "KeyRing":
        """Read a keys file. It must not be accessible by group or others (mode & 0o077
        == 0), and when running as root it must be owned by root: anyone who can write
        it can make the agent run their jobs. Raises KeyFileError."""
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            hint = " (symlinks are not followed)" if getattr(exc, "errno", None) == 40 else ""
            raise KeyFileError([f"{path}: cannot open keys file: {exc.strerror or exc}{hint}"]) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise KeyFileError([f"{path}: keys file is not a regular file"])
            mode = stat.S_IMODE(st.st_mode)
            if mode & 0o077:
                raise KeyFileError([
                    f"{path}: keys file mode is {mode:04o}; it must not be accessible by group or "
                    f"others (run: chmod 600 {path})"
                ])
            if os.geteuid() == 0 and st.st_uid != 0:
                raise KeyFileError([f"{path}: keys file is owned by uid {st.st_uid}; as root it must be owned by root"])
            with os.fdopen(fd, "rb", closefd=True) as fh:
                fd = -1
                raw = fh.read(1024 * 1024 + 1)
        finally:
            if fd >= 0:
                os.close(fd)
        if len(raw) > 1024 * 1024:
            raise KeyFileError([f"{path}: keys file is larger than 1 MiB"])
        try:
            data = yaml.safe_load(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise KeyFileError([f"{path}: keys file is not UTF-8"]) from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise KeyFileError([f"{path}:{where}: invalid YAML: {getattr(exc, 'problem', None) or exc}"]) from None
        return cls.from_mapping(data, source=path, require_private=require_private)

    @classmethod
    def from_mapping(cls, data: Any, source: str = "<memory>", require_private: bool = False) -> "KeyRing":
        """Build a ring from the parsed keys-file mapping; collects every problem."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise KeyFileError([f"{source}: the top level must be a mapping of key id to key"])
        problems: list[str] = []
        keys: dict[str, Key] = {}
        for kid, entry in data.items():
            where = f"{source}: {kid}"
            if not isinstance(kid, str) or not KID_RE.fullmatch(kid):
                problems.append(f"{source}: key id {kid!r} must match [A-Za-z0-9._-]{{1,128}}")
                continue
            if not isinstance(entry, dict):
                problems.append(f"{where}: expected a mapping with alg and the key material")
                continue
            alg = entry.get("alg")
            if alg == HMAC_SHA256:
                allowed = {"alg", "secret", "retired_after", "role"}
            elif alg == ED25519:
                allowed = {"alg", "public_key", "private_key", "retired_after", "role"}
            else:
                problems.append(f"{where}.alg: must be {HMAC_SHA256} or {ED25519}, got {alg!r}")
                continue
            extra = [str(k) for k in entry if k not in allowed]
            if extra:
                problems.append(f"{where}: unknown key(s) {', '.join(sorted(extra))} for alg {alg}")
                continue
            role = entry.get("role")
            if role is not None and not (isinstance(role, str) and ROLE_RE.fullmatch(role)):
                problems.append(f"{where}.role: must match [A-Za-z0-9._-]{{1,64}}, got {role!r}")
                continue
            retired = None
            if "retired_after" in entry:
                retired = _retired_after(entry["retired_after"])
                if retired is None:
                    problems.append(f"{where}.retired_after: must be an RFC 3339 time with a zone, "
                                    f"e.g. 2027-03-01T00:00:00Z")
                    continue
            if alg == HMAC_SHA256:
                try:
                    secret = _b64decode(entry.get("secret"))
                except ValueError:
                    problems.append(f"{where}.secret: required, base64 of at least {MIN_HMAC_SECRET_BYTES} bytes")
                    continue
                if len(secret) < MIN_HMAC_SECRET_BYTES:
                    problems.append(
                        f"{where}.secret: decodes to {len(secret)} bytes; at least {MIN_HMAC_SECRET_BYTES} are required"
                    )
                    continue
                keys[kid] = Key(kid, alg, secret=secret, retired_after=retired, role=role)
                continue
            pub = priv = None
            if "public_key" in entry:
                try:
                    pub = _b64decode(entry["public_key"])
                except ValueError:
                    problems.append(f"{where}.public_key: not base64")
                    continue
                if len(pub) != 32:
                    problems.append(f"{where}.public_key: must decode to 32 bytes (raw ed25519 key), got {len(pub)}")
                    continue
            if "private_key" in entry:
                try:
                    priv = _b64decode(entry["private_key"])
                except ValueError:
                    problems.append(f"{where}.private_key: not base64")
                    continue
                if len(priv) == 64:  # NaCl style seed || public key
                    priv, tail = priv[:32], priv[32:]
                    pub = pub or tail
                if len(priv) != 32:
                    problems.append(f"{where}.private_key: must decode to the 32-byte raw ed25519 seed, got {len(priv)}")
                    continue
                if HAVE_ED25519:
                    derived = _ed_public_from_private(priv)
                    if pub is not None and pub != derived:
                        problems.append(f"{where}: public_key does not belong to private_key")
                        continue
                    pub = derived
            if pub is None and priv is None:
                problems.append(f"{where}: needs public_key (to verify) or private_key (to sign)")
                continue
            keys[kid] = Key(kid, alg, public_key=pub, private_key=priv, retired_after=retired, role=role)
        if require_private:
            for kid, key in keys.items():
                if not key.can_sign:
                    problems.append(f"{source}: {kid}: has no private key material (needed for signing)")
        if problems:
            raise KeyFileError(problems)
        return cls(keys, source)

    # ---- verify

    def verify(self, doc: dict, now: Optional[datetime] = None) -> Key:
        """Check ``doc["sig"]`` over canonical_json(doc) and return the key that signed it.
        Raises SignatureError with reason unsigned, bad_signature, unsupported_alg,
        unknown_kid, or key_retired (only when ``now`` is given and past the key's
        ``retired_after``)."""
        if not isinstance(doc, dict) or "sig" not in doc or doc.get("sig") is None:
            raise SignatureError(UNSIGNED, "the document has no sig")
        sig = doc["sig"]
        if not isinstance(sig, dict):
            raise SignatureError(BAD_SIGNATURE, "sig must be an object with alg, kid and value")
        extra = [k for k in sig if k not in ("alg", "kid", "value")]
        if extra:
            raise SignatureError(BAD_SIGNATURE, f"sig has unknown key(s): {', '.join(sorted(map(repr, extra)))}")
        for name in ("alg", "kid", "value"):
            if not isinstance(sig.get(name), str) or not sig.get(name):
                raise SignatureError(BAD_SIGNATURE, f"sig.{name} must be a non-empty string")
        alg, kid = sig["alg"], sig["kid"]
        if alg not in ALGS:
            raise SignatureError(UNSUPPORTED_ALG, f"sig.alg {_short(alg)} is not supported (use {' or '.join(ALGS)})")
        key = self._keys.get(kid)
        if key is None:
            raise SignatureError(UNKNOWN_KID, f"sig.kid {_short(kid)} is not in the keys file")
        if key.alg != alg:
            raise SignatureError(BAD_SIGNATURE, f"sig.alg {alg} does not match key {kid} ({key.alg})")
        try:
            value = _b64decode(sig["value"])
        except ValueError:
            raise SignatureError(BAD_SIGNATURE, "sig.value is not base64") from None
        try:
            message = canonical_json(doc)
        except (TypeError, ValueError):
            raise SignatureError(BAD_SIGNATURE, "the document has no canonical JSON form") from None
        if alg == HMAC_SHA256:
            expected = hmac.new(key.secret or b"", message, hashlib.sha256).digest()
            if not hmac.compare_digest(expected, value):
                raise SignatureError(BAD_SIGNATURE, f"signature does not verify with key {kid}")
            return _check_retired(key, now)
        if not HAVE_ED25519:
            raise SignatureError(UNSUPPORTED_ALG, "ed25519 needs python3-cryptography, which is not installed")
        if key.public_key is None:
            raise SignatureError(UNKNOWN_KID, f"key {kid} has no public key")
        try:
            _Ed25519PublicKey.from_public_bytes(key.public_key).verify(value, message)
        except (_InvalidSignature, ValueError):
            raise SignatureError(BAD_SIGNATURE, f"signature does not verify with key {kid}") from None
        return _check_retired(key, now)


def _check_retired(key: Key, now: Optional[datetime]) -> Key:
    if now is not None and key.retired_after is not None and now >= key.retired_after:
        raise SignatureError(KEY_RETIRED, f"key {key.kid} was retired at "
                                          f"{key.retired_after.strftime('%Y-%m-%dT%H:%M:%SZ')}")
    return key


def _retired_after(value: Any) -> Optional[datetime]:
    """An RFC 3339 time with a zone (YAML may already have made it a datetime)."""
    if isinstance(value, datetime):
        return value.astimezone(timezone.utc) if value.tzinfo is not None else None
    if not isinstance(value, str):
        return None
    text = value.strip().replace("z", "Z")
    if not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", text):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(timezone.utc)
    except ValueError:
        return None


def sign(doc: dict, keyring: KeyRing, kid: str) -> dict:
    """A deep copy of ``doc`` with ``sig`` set (any existing sig is replaced; approvals
    are kept: they sign the same bytes)."""
    out = copy.deepcopy(doc)
    out.pop("sig", None)
    out["sig"] = _signature(out, keyring, kid)
    return out


def approve(doc: dict, keyring: KeyRing, kid: str) -> dict:
    """A deep copy of a signed ``doc`` with ``kid``'s approval added to ``approvals`` (a
    signature over the same bytes as ``sig``: the document without sig and approvals)."""
    if "sig" not in doc:
        raise SignatureError(UNSIGNED, "an approval is added to a signed document (it has no sig)")
    out = copy.deepcopy(doc)
    raw = out.get("approvals")
    present: list = raw if isinstance(raw, list) else []
    if kid == (out.get("sig") or {}).get("kid") or any(isinstance(a, dict) and a.get("kid") == kid for a in present):
        raise SignatureError(BAD_SIGNATURE, f"key {kid} has already signed this document")
    out["approvals"] = [*present, _signature(out, keyring, kid)]
    return out


def _signature(doc: dict, keyring: KeyRing, kid: str) -> dict:
    key = keyring.get(kid)
    if key is None:
        raise SignatureError(UNKNOWN_KID, f"key id {kid!r} is not in {keyring.source}")
    message = canonical_json(doc)
    if key.alg == HMAC_SHA256:
        value = hmac.new(key.secret or b"", message, hashlib.sha256).digest()
    else:
        if not HAVE_ED25519:
            raise SignatureError(UNSUPPORTED_ALG, "ed25519 needs python3-cryptography, which is not installed")
        if key.private_key is None:
            raise SignatureError(NO_PRIVATE_KEY, f"key {kid} has no private_key in {keyring.source}")
        value = _Ed25519PrivateKey.from_private_bytes(key.private_key).sign(message)
    return {"alg": key.alg, "kid": kid, "value": _b64encode(value)}


def _ed_public_from_private(seed: bytes) -> bytes:
    pk = _Ed25519PrivateKey.from_private_bytes(seed).public_key()
    return pk.public_bytes(_serialization.Encoding.Raw, _serialization.PublicFormat.Raw)


def generate_ed25519() -> tuple[str, str]:
    """(private seed b64, public key b64) for tests and operators."""
    if not HAVE_ED25519:
        raise SignatureError(UNSUPPORTED_ALG, "ed25519 needs python3-cryptography, which is not installed")
    seed = _Ed25519PrivateKey.generate().private_bytes(
        _serialization.Encoding.Raw, _serialization.PrivateFormat.Raw, _serialization.NoEncryption()
    )
    return _b64encode(seed), _b64encode(_ed_public_from_private(seed))


def keygen_files(kid: str, private_path: str) -> str:
    """Write a new ed25519 pair as a signer's keys file (mode 0600, never overwritten) and
    return the YAML entry for the agents' keys file (public key only)."""
    if not KID_RE.fullmatch(kid or ""):
        raise SignatureError(UNKNOWN_KID, f"key id {kid!r} must match [A-Za-z0-9._-]{{1,128}}")
    seed, public = generate_ed25519()
    body = yaml.safe_dump({kid: {"alg": ED25519, "private_key": seed, "public_key": public}}, sort_keys=True)
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(body)
    os.chmod(private_path, 0o600)
    return yaml.safe_dump({kid: {"alg": ED25519, "public_key": public}}, sort_keys=True)


def generate_hmac_secret(nbytes: int = 32) -> str:
    return _b64encode(os.urandom(max(nbytes, MIN_HMAC_SECRET_BYTES)))
