"""Job documents for unit tests of the document checks: one fixed clock, cluster and
signing key, and parse_job called with the agent's default limits."""

from __future__ import annotations

import base64
from datetime import datetime, timezone
from typing import Any, Callable

from agent.jobs.document import Job, parse_job
from agent.jobs.signing import KeyRing, sign

UTC = timezone.utc
NOW = datetime(2026, 12, 2, 11, 0, 30, tzinfo=UTC)   # the parser's clock
ISSUED_AT = "2026-12-02T11:00:00Z"                   # 30 s before NOW
SECRET = base64.b64encode(bytes(range(32))).decode()
KID = "cloud-1"
KEYS = KeyRing.from_mapping({KID: {"alg": "hmac-sha256", "secret": SECRET}})
CLUSTER = "plant-a"


def signed(doc: dict) -> dict:
    """``doc`` signed with KEYS, bound to CLUSTER as a job issued at ISSUED_AT unless the
    document sets its own binding or issued_at."""
    return sign({"cluster": CLUSTER, "kind": "job", "issued_at": ISSUED_AT, **doc}, KEYS, KID)


def parser(templates: dict, max_bytes: int = 65536) -> Callable[..., Job]:
    """parse_job with these templates, KEYS, NOW, CLUSTER and the agent's default limits;
    the keyword arguments of a call override any of them."""

    def parse(payload: Any, **kw: Any) -> Job:
        args: dict[str, Any] = dict(templates=templates, keyring=KEYS, now=NOW, max_skew_s=300, max_bytes=max_bytes,
                                    cluster=CLUSTER, max_age_s=86400)
        args.update(kw)
        return parse_job(payload, **args)

    return parse
