"""The cloud's side in tests and benchmarks: signing keys, bound job and cancel documents,
unauthenticated junk, a signing job store for tests that write jobs straight into etcd, a
status collector on a real broker."""

from __future__ import annotations

import collections
import json
import os
import random
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Optional

import yaml

from agent.cloud.mqtt import MqttLink
from agent.cloud.topics import Topics
from agent.config import MqttConfig
from agent.jobs.signing import KeyRing, generate_hmac_secret, sign
from agent.runtime.timefmt import format_rfc3339

KID = "cloud-1"
CLUSTER = "t"


def rfc(dt: datetime) -> str:
    """A document time as people write them: whole seconds."""
    return format_rfc3339(dt.replace(microsecond=0))


def write_keys(path: str, kid: str = KID, secret: Optional[str] = None) -> KeyRing:
    """A root-only (0600) hmac keys file; returns its ring."""
    secret = secret or generate_hmac_secret()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        yaml.safe_dump({kid: {"alg": "hmac-sha256", "secret": secret}}, fh)
    os.chmod(path, 0o600)
    return KeyRing.load(path)


TEMPLATES = {
    "flush": {"argv": ["/bin/true", "--line", "{line}"], "params": {"line": "^[0-9]{1,2}$"},
              "user": "root", "allow_root": True, "allow_exec": ["/bin/true", "/usr/bin/true"]},
}


def job_doc(job_id: str, line: str = "3", template: str = "flush", at_offset_s: float = 30 * 86400,
            now: Optional[datetime] = None, cluster: str = CLUSTER, **extra) -> dict:
    """A valid (unsigned) job bound to ``cluster`` that is due far in the future, so no run
    starts during tests."""
    now = now or datetime.now(timezone.utc)
    doc = {"v": 1, "id": job_id, "cluster": cluster, "kind": "job", "template": template, "params": {"line": line},
           "schedule": {"at": rfc(now + timedelta(seconds=at_offset_s))},
           "not_after": rfc(now + timedelta(seconds=at_offset_s + 86400)), "issued_at": rfc(now)}
    doc.update(extra)
    return doc


def cancel_doc(job_id: str, cluster: str = CLUSTER, now: Optional[datetime] = None) -> dict:
    return {"v": 1, "id": job_id, "cluster": cluster, "kind": "cancel",
            "issued_at": rfc(now or datetime.now(timezone.utc))}


def bound(doc: dict, cluster: str, kind: str = "job", now: Optional[datetime] = None) -> dict:
    """``doc`` with cluster, kind and (when missing) issued_at set, and a recurring job's
    lifetime (``not_after``: null, until cancelled) when it names none."""
    out = dict(doc)
    out.setdefault("cluster", cluster)
    out.setdefault("kind", kind)
    out.setdefault("issued_at", rfc(now or datetime.now(timezone.utc)))
    if kind == "job" and isinstance(out.get("schedule"), dict) and "cron" in out["schedule"]:
        out.setdefault("not_after", None)
    return out


def signed(doc: dict, ring: KeyRing, kid: str = KID) -> bytes:
    return json.dumps(sign(doc, ring, kid), separators=(",", ":")).encode()


class SigningStore:
    """A JobStore whose create() binds and signs the document first, as the cloud would:
    the one helper for every test that writes jobs straight into etcd (agents verify
    stored jobs at every load and never run an unsigned one)."""

    def __init__(self, store, ring: KeyRing, cluster: str, kid: str = KID):
        self.store, self.ring, self.cluster, self.kid = store, ring, cluster, kid

    def sign(self, doc: dict) -> dict:
        return sign(bound(doc, self.cluster), self.ring, self.kid)

    def create(self, doc: dict):
        return self.store.create(self.sign(doc))

    def __getattr__(self, name):
        return getattr(self.store, name)


class StatusCollector:
    """Subscribes to every agent's statuses and rejections (and anything else asked) on a
    real broker and keeps every message."""

    def __init__(self, url: str, cluster: str, extra_filters: tuple[str, ...] = (), mqtt_cfg=None,
                 agents: Optional[tuple[str, ...]] = None):
        """``agents``: only these agents' statuses and rejections (default: every agent's)."""
        self.topics = Topics(cluster)
        self.lock = threading.RLock()  # predicates passed to wait() may call docs()
        self.messages: list[tuple[float, str, dict]] = []
        self.cond = threading.Condition(self.lock)
        if agents is None:
            own: tuple = ((self.topics.status_filter(), 1), (self.topics.rejections_filter(), 1))
        else:
            own = tuple((f, 1) for a in agents for f in (self.topics.agent_prefix(a) + "status/+",
                                                         self.topics.rejections(a)))
        filters = own + tuple((f, 1) for f in extra_filters)
        self.link = MqttLink(mqtt_cfg or MqttConfig(url=url), f"collector-{os.getpid()}-{id(self) % 100000}",
                             clean_session=False, on_message=self._msg, subscriptions=filters,
                             topic_kind=self.topics.kind, reconnect_min_s=0.2, reconnect_max_s=1.0)

    def start(self, timeout: float = 10.0) -> "StatusCollector":
        self.link.start()
        if not self.link.wait_connected(timeout):
            raise RuntimeError("status collector could not connect")
        time.sleep(0.1)
        return self

    def _msg(self, msg) -> None:
        try:
            doc = json.loads(msg.payload)
        except ValueError:
            doc = {"_raw": msg.payload.decode(errors="replace")}
        with self.cond:
            self.messages.append((time.monotonic(), msg.topic, doc))
            self.cond.notify_all()
        self.link.ack(msg)

    def docs(self, state: Optional[str] = None) -> list[dict]:
        with self.lock:
            return [d for _, _, d in self.messages if state is None or d.get("state") == state]

    def wait(self, pred, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not pred(self.messages):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.5))
            return True

    def by_job(self, state: Optional[str] = None) -> dict:
        out = collections.defaultdict(list)
        for d in self.docs(state):
            out[d.get("job_id")].append(d)
        return out

    def stop(self) -> None:
        self.link.stop()


def junk_payload(rnd: random.Random, i: int, real_ids: list, ring, other_ring) -> bytes:
    """Unauthenticated input aimed at real job ids: unsigned, forged, signed by another
    fleet's key, a valid document of another cluster, bad JSON, noise."""
    jid = rnd.choice(real_ids)
    k = i % 6
    if k == 0:
        return json.dumps(job_doc(jid, line="1")).encode()
    if k == 1:
        d = json.loads(signed(job_doc(jid, line="1"), ring))
        d["params"]["line"] = "2"  # forged: the signature no longer fits
        return json.dumps(d).encode()
    if k == 2:
        return json.dumps(sign(job_doc(jid), other_ring, KID)).encode()
    if k == 3:
        return signed(job_doc(jid, cluster="plant-b"), ring)
    if k == 4:
        return b'{"v":1,"id":"' + jid.encode() + b'","template":'
    return bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 64)))
