"""Four-eyes approval, as pure logic: who signed a document, and whether that is enough for
its template.

A document carries its ``sig`` and, optionally, ``approvals: [{kid, alg, value}, ...]``:
more signatures, each over the same bytes as ``sig`` (the canonical document without
``sig`` and ``approvals``), so an approval is valid for exactly this content and cluster,
and adding one changes nothing that was signed. A template with ``approvals: {required:
K, roles: [...]}`` runs a job only when K of its signatures are by keys of K distinct
listed roles (the keys file's ``role``): two keys of one role count once.

Every approval of a document is verified like its ``sig`` (known key, valid signature,
key not retired): at ingest a bad one refuses the push with its reason, at load it
refuses the stored job (etcd is not trusted to hold only what ingest stored).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Optional

from agent.jobs.envelope import JobRejected, bad, field_name, type_name
from agent.jobs.signing import KeyRing, SignatureError

if TYPE_CHECKING:
    from agent.config import ApprovalRule, Template

MAX_APPROVALS = 16
APPROVAL_KEYS = ("alg", "kid", "value")

Signer = tuple[str, Optional[str]]   # (key id, its role; None: no role, or not known here)


def _shape(doc: dict, sig_kid: Optional[str]) -> list[dict]:
    """The document's approvals, checked for shape (bad_field naming approvals[i])."""
    raw = doc.get("approvals")
    if "approvals" not in doc:
        return []
    if not isinstance(raw, list) or not raw:
        raise bad("approvals", f"must be a non-empty list of {{kid, alg, value}}, got {type_name(raw)}")
    if len(raw) > MAX_APPROVALS:
        raise bad("approvals", f"has {len(raw)} entries; at most {MAX_APPROVALS} are allowed")
    seen = {sig_kid}
    for i, a in enumerate(raw):
        where = f"approvals[{i}]"
        if not isinstance(a, dict):
            raise bad(where, f"must be an object with alg, kid and value, got {type_name(a)}")
        extra = [k for k in a if k not in APPROVAL_KEYS]
        if extra:
            raise bad(f"{where}.{field_name(extra[0])}", "unknown key (allowed: alg, kid, value)")
        for name in APPROVAL_KEYS:
            if not isinstance(a.get(name), str) or not a.get(name):
                raise bad(f"{where}.{name}", "must be a non-empty string")
        if a["kid"] in seen:
            raise bad(f"{where}.kid", f"key {field_name(a['kid'])} has already signed this document "
                                      "(each signature must be by another key)")
        seen.add(a["kid"])
    return raw


def signers(doc: dict, keyring: Optional[KeyRing], key_now: Optional[datetime], sig_key: Any,
            verify: bool = True) -> tuple[Signer, ...]:
    """The keys that signed ``doc``: its ``sig`` (``sig_key``, the verified key; None when
    the caller verified it elsewhere or not at all) and each approval, verified against
    ``keyring`` (with ``key_now``: a retired key is refused). ``verify`` False (display):
    the key ids as written, roles from the ring when there is one. Raises JobRejected with
    the approval's field path and the signature's reason (unknown_kid, bad_signature,
    unsupported_alg, key_retired)."""
    raw = doc.get("sig")
    sig: dict = raw if isinstance(raw, dict) else {}
    sig_kid = sig_key.kid if sig_key is not None else sig.get("kid")
    approvals = _shape(doc, sig_kid if isinstance(sig_kid, str) else None)
    out: list[Signer] = []
    if isinstance(sig_kid, str):
        key = sig_key or (keyring.get(sig_kid) if keyring is not None else None)
        out.append((sig_kid, key.role if key is not None else None))
    for i, a in enumerate(approvals):
        if not verify or keyring is None:
            key = keyring.get(a["kid"]) if keyring is not None else None
            out.append((a["kid"], key.role if key is not None else None))
            continue
        try:
            key = keyring.verify({**doc, "sig": a}, now=key_now)
        except SignatureError as exc:
            where = f"approvals[{i}]"
            raise JobRejected(exc.reason, f"{where}: {exc.detail.replace('sig.', where + '.')}"
                                          + (" (an approval is a signature over this very document: one "
                                             "made for another document or cluster does not verify)"
                                             if exc.reason == "bad_signature" else ""), where) from None
        out.append((key.kid, key.role))
    return tuple(out)


@dataclass(frozen=True)
class Standing:
    """Where a job stands against its template's approval rule."""

    required: int
    counted: tuple[Signer, ...]    # one signature per listed role (the first of each)
    missing: tuple[str, ...]       # listed roles without a signature

    @property
    def ok(self) -> bool:
        return len(self.counted) >= self.required

    def describe(self) -> str:
        have = ", ".join(f"{role} ({kid})" for kid, role in self.counted) or "none"
        return (f"{len(self.counted)} of {self.required} approvals (have: {have}; missing role(s): "
                f"{', '.join(self.missing) or '-'})")

    def to_dict(self) -> dict:
        return {"required": self.required, "have": len(self.counted),
                "signed_by": [{"kid": k, "role": r} for k, r in self.counted], "missing_roles": list(self.missing)}


def standing(job_signers: tuple[Signer, ...], rule: ApprovalRule) -> Standing:
    """How many of the rule's roles ``job_signers`` cover (``rule``: the template's
    ``approvals``, with ``required`` and ``roles``)."""
    roles = list(rule.roles)
    counted: list[Signer] = []
    covered: set = set()
    for kid, role in job_signers:
        if role in roles and role not in covered:
            covered.add(role)
            counted.append((kid, role))
    return Standing(rule.required, tuple(counted), tuple(r for r in roles if r not in covered))


def rule_of(templates: Optional[dict[str, Template]], template: str) -> Optional[ApprovalRule]:
    """The template's approval rule, or None (no such template here, or none asked)."""
    t = (templates or {}).get(template)
    return t.approvals if t is not None else None


def answer_fields(doc: dict, keyring: Optional[KeyRing], templates: Optional[dict]) -> dict:
    """What a push's answer says of approvals, when this agent has the job's template and
    it asks for them: ``{"state": "waiting_approval", "approvals": {...}}`` while short,
    else ``{"approvals": {...}}``; ``{}`` without a rule. The document's approvals are the
    ones stored (verified at their push): the agents that run the job decide for
    themselves at every load."""
    rule = rule_of(templates, str(doc.get("template", "")))
    if rule is None:
        return {}
    try:
        st = standing(signers(doc, keyring, None, None, verify=False), rule)
    except JobRejected:
        return {}
    out: dict = {"approvals": st.to_dict()}
    if not st.ok:
        out["state"] = "waiting_approval"
        out["detail"] = st.describe()
    return out
