"""Signatures: canonical form, key files, hmac-sha256 and ed25519, every failure reason."""

from __future__ import annotations

import base64
import json
import os

import pytest

from agent.jobs import signing
from agent.jobs.signing import KeyFileError, KeyRing, SignatureError, canonical_json, sign
from tests.support.kernel import require_kernel

SECRET = base64.b64encode(bytes(range(32))).decode()
OTHER_SECRET = base64.b64encode(bytes(range(1, 33))).decode()

DOC = {
    "v": 1,
    "id": "coolant-flush-line3-20261202",
    "template": "coolant-flush",
    "params": {"line": "3"},
    "schedule": {"at": "2026-12-02T12:00:00Z"},
    "retry": {"max_attempts": 3, "backoff_s": 2, "jitter": 0.2},
}

@pytest.fixture
def _ed25519():
    require_kernel(signing.HAVE_ED25519, "python3-cryptography not importable (scripts/setup-host.sh installs it)")


needs_ed = pytest.mark.usefixtures("_ed25519")


def ring(**extra) -> KeyRing:
    data = {"cloud-1": {"alg": "hmac-sha256", "secret": SECRET}}
    data.update(extra)
    return KeyRing.from_mapping(data)


def write_keys(path, text: str, mode: int = 0o600) -> str:
    p = str(path)
    with open(p, "w") as fh:
        fh.write(text)
    os.chmod(p, mode)
    return p


# ---------------------------------------------------------------- canonical form


def test_canonical_json_sorted_compact_utf8_without_sig():
    doc = {"b": 1, "a": {"z": "ü", "y": [1, 2.5]}, "sig": {"alg": "x"}}
    assert canonical_json(doc) == '{"a":{"y":[1,2.5],"z":"ü"},"b":1}'.encode("utf-8")
    assert b"sig" in canonical_json(doc, with_sig=True)


def test_canonical_json_is_stable_under_key_order_and_roundtrip():
    a = canonical_json(DOC)
    shuffled = json.loads(json.dumps(dict(reversed(list(DOC.items())))))
    assert canonical_json(shuffled) == a
    assert canonical_json(json.loads(a)) == a
    # a fixed vector: catches accidental changes of the canonical form (it is a contract)
    assert a == (
        b'{"id":"coolant-flush-line3-20261202","params":{"line":"3"},"retry":{"backoff_s":2,"jitter":0.2,'
        b'"max_attempts":3},"schedule":{"at":"2026-12-02T12:00:00Z"},"template":"coolant-flush","v":1}'
    )


def test_canonical_json_refuses_nan():
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


# ---------------------------------------------------------------- hmac


def test_hmac_sign_verify_roundtrip_and_copy():
    kr = ring()
    signed = sign(DOC, kr, "cloud-1")
    assert "sig" not in DOC  # a copy
    assert signed["sig"]["alg"] == "hmac-sha256" and signed["sig"]["kid"] == "cloud-1"
    kr.verify(signed)
    # re-signing replaces an existing sig and is deterministic for hmac
    assert sign(signed, kr, "cloud-1") == signed


def test_hmac_known_vector():
    import hashlib
    import hmac

    signed = sign(DOC, ring(), "cloud-1")
    expected = hmac.new(bytes(range(32)), canonical_json(DOC), hashlib.sha256).digest()
    assert base64.b64decode(signed["sig"]["value"]) == expected


def reason(fn, *a) -> str:
    with pytest.raises(SignatureError) as ei:
        fn(*a)
    return ei.value.reason


def test_unsigned():
    assert reason(ring().verify, dict(DOC)) == "unsigned"
    assert reason(ring().verify, {**DOC, "sig": None}) == "unsigned"


def test_unknown_kid():
    signed = sign(DOC, ring(), "cloud-1")
    signed["sig"]["kid"] = "cloud-9"
    assert reason(ring().verify, signed) == "unknown_kid"


def test_wrong_key_is_bad_signature():
    signed = sign(DOC, KeyRing.from_mapping({"cloud-1": {"alg": "hmac-sha256", "secret": OTHER_SECRET}}), "cloud-1")
    assert reason(ring().verify, signed) == "bad_signature"


@pytest.mark.parametrize("mutate", [
    lambda d: d["params"].__setitem__("line", "4"),
    lambda d: d.__setitem__("v", 2),
    lambda d: d["retry"].__setitem__("backoff_s", 2.0),  # 2 vs 2.0 differ in canonical form
    lambda d: d.__setitem__("extra", None),
    lambda d: d.pop("schedule"),
])
def test_tampered_field_is_bad_signature(mutate):
    signed = sign(DOC, ring(), "cloud-1")
    mutate(signed)
    assert reason(ring().verify, signed) == "bad_signature"


@pytest.mark.parametrize("sig,code", [
    ("abc", "bad_signature"),
    ({"alg": "hmac-sha256", "kid": "cloud-1"}, "bad_signature"),
    ({"alg": "hmac-sha256", "kid": "cloud-1", "value": "!!notbase64"}, "bad_signature"),
    ({"alg": "hmac-sha256", "kid": "cloud-1", "value": "AAAA", "x": 1}, "bad_signature"),
    ({"alg": "rsa-sha256", "kid": "cloud-1", "value": "AAAA"}, "unsupported_alg"),
    ({"alg": "ed25519", "kid": "cloud-1", "value": "AAAA"}, "bad_signature"),  # alg != key's alg
    ({"alg": "hmac-sha256", "kid": 7, "value": "AAAA"}, "bad_signature"),
])
def test_malformed_sig(sig, code):
    assert reason(ring().verify, {**DOC, "sig": sig}) == code


def test_sign_unknown_kid():
    assert reason(sign, DOC, ring(), "nope") == "unknown_kid"


# ---------------------------------------------------------------- ed25519


@needs_ed
def test_ed25519_roundtrip_and_wrong_key():
    priv, pub = signing.generate_ed25519()
    priv2, pub2 = signing.generate_ed25519()
    signer = KeyRing.from_mapping({"cloud-2": {"alg": "ed25519", "private_key": priv}}, require_private=True)
    verifier = KeyRing.from_mapping({"cloud-2": {"alg": "ed25519", "public_key": pub}})
    other = KeyRing.from_mapping({"cloud-2": {"alg": "ed25519", "public_key": pub2}})
    signed = sign(DOC, signer, "cloud-2")
    assert signed["sig"]["alg"] == "ed25519"
    verifier.verify(signed)
    assert reason(other.verify, signed) == "bad_signature"
    signed["params"]["line"] = "4"
    assert reason(verifier.verify, signed) == "bad_signature"


@needs_ed
def test_ed25519_verify_only_key_cannot_sign():
    _, pub = signing.generate_ed25519()
    kr = KeyRing.from_mapping({"cloud-2": {"alg": "ed25519", "public_key": pub}})
    assert reason(sign, DOC, kr, "cloud-2") == "no_private_key"
    with pytest.raises(KeyFileError, match="private key"):
        KeyRing.from_mapping({"cloud-2": {"alg": "ed25519", "public_key": pub}}, require_private=True)


@needs_ed
def test_ed25519_mismatched_pair_rejected():
    priv, _ = signing.generate_ed25519()
    _, pub2 = signing.generate_ed25519()
    with pytest.raises(KeyFileError, match="does not belong"):
        KeyRing.from_mapping({"k": {"alg": "ed25519", "private_key": priv, "public_key": pub2}})


def test_ed25519_without_cryptography_is_unsupported(monkeypatch):
    pub = base64.b64encode(b"\x01" * 32).decode()
    kr = KeyRing.from_mapping({"cloud-2": {"alg": "ed25519", "public_key": pub}})
    monkeypatch.setattr(signing, "HAVE_ED25519", False)
    doc = {**DOC, "sig": {"alg": "ed25519", "kid": "cloud-2", "value": base64.b64encode(b"x" * 64).decode()}}
    assert reason(kr.verify, doc) == "unsupported_alg"


# ---------------------------------------------------------------- keys file


def test_load_keys_file(tmp_path):
    p = write_keys(tmp_path / "keys.yaml", f"cloud-1: {{alg: hmac-sha256, secret: \"{SECRET}\"}}\n")
    kr = KeyRing.load(p)
    assert kr.kids == ["cloud-1"] and "cloud-1" in kr
    assert SECRET not in repr(kr) and "cloud-1" in repr(kr)
    kr.verify(sign(DOC, kr, "cloud-1"))


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o601])
def test_keys_file_open_to_others_refused(tmp_path, mode):
    p = write_keys(tmp_path / "keys.yaml", f"cloud-1: {{alg: hmac-sha256, secret: \"{SECRET}\"}}\n", mode)
    with pytest.raises(KeyFileError, match="chmod 600"):
        KeyRing.load(p)


def test_keys_file_missing_and_symlink(tmp_path):
    with pytest.raises(KeyFileError, match="cannot open"):
        KeyRing.load(str(tmp_path / "nope.yaml"))
    real = write_keys(tmp_path / "real.yaml", f"cloud-1: {{alg: hmac-sha256, secret: \"{SECRET}\"}}\n")
    link = tmp_path / "link.yaml"
    os.symlink(real, link)
    with pytest.raises(KeyFileError):
        KeyRing.load(str(link))


@pytest.mark.parametrize("text,match", [
    ("[1, 2]", "top level"),
    ("cloud-1: {alg: hmac-sha256, secret: 'c2hvcnQ='}", "at least 32"),
    ("cloud-1: {alg: hmac-sha256, secret: 'not base64!'}", "base64"),
    ("cloud-1: {alg: hmac-sha256}", "secret"),
    ("cloud-1: {alg: rsa, secret: 'x'}", "alg"),
    ("cloud-1: {alg: hmac-sha256, secret: '%s', extra: 1}" % SECRET, "unknown key"),
    ("'bad/kid': {alg: hmac-sha256, secret: '%s'}" % SECRET, "key id"),
    ("cloud-2: {alg: ed25519, public_key: 'AAAA'}", "32 bytes"),
    ("cloud-2: {alg: ed25519}", "public_key"),
    ("cloud-1: [", "invalid YAML"),
])
def test_bad_keys_file(tmp_path, text, match):
    p = write_keys(tmp_path / "keys.yaml", text)
    with pytest.raises(KeyFileError, match=match):
        KeyRing.load(p)


def test_keys_file_collects_all_problems(tmp_path):
    p = write_keys(tmp_path / "keys.yaml", "a: {alg: rsa}\nb: {alg: hmac-sha256, secret: 'c2hvcnQ='}\n")
    with pytest.raises(KeyFileError) as ei:
        KeyRing.load(p)
    assert len(ei.value.problems) == 2 and all(p in line for line in ei.value.problems)


def test_generate_hmac_secret_is_long_enough():
    assert len(base64.b64decode(signing.generate_hmac_secret())) >= 32


def test_keys_file_not_owned_by_root_refused_when_root(tmp_path):
    require_kernel(os.geteuid() == 0, "the ownership check applies to root")
    p = write_keys(tmp_path / "keys.yaml", f"cloud-1: {{alg: hmac-sha256, secret: \"{SECRET}\"}}\n")
    os.chown(p, 65534, 65534)
    with pytest.raises(KeyFileError, match="owned by"):
        KeyRing.load(p)
