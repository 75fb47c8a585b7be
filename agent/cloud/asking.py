"""The cloud's side of ``jobs/get`` (agent/cloud/queries.py): signed queries, every agent's
answers, and a filter's pages followed to the end. Used by ``millwright get``, the tests and
the benchmarks.

An answer is believed only from under the prefix of the agent it names (the broker ACL lets
an agent publish nowhere else): a document whose ``agent`` differs from its topic's is
ignored.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Iterable, Optional

from agent.jobs.envelope import KIND_QUERY
from agent.jobs.signing import sign

from .link import Message
from .mqtt import MqttLink
from .topics import Topics

PAGE_RETRY_S = 3.0  # a page request not answered in this time is signed and sent again
PAGE_TRIES = 3       # then its chain is given up (its agent gone): its shards are asked for again
ROUND_RETRY_S = 1.0  # shards no finished chain vouched for are asked for again after this


def query_doc(cluster: str, correlation: str, *, job_id: Optional[str] = None, flt: Optional[dict] = None,
              include: Iterable[str] = (), cursor: Optional[str] = None, now: Optional[datetime] = None) -> dict:
    """An unsigned query bound to ``cluster``, issued now."""
    doc: dict = {"v": 1, "cluster": cluster, "kind": KIND_QUERY, "correlation": correlation,
                 "issued_at": (now or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
    if job_id is not None:
        doc["id"] = job_id
    else:
        doc["filter"] = dict(flt or {})
    if include:
        doc["include"] = sorted(set(include))
    if cursor is not None:
        doc["cursor"] = cursor
    return doc


class Asker:
    """Signs queries with ``kid`` of ``ring`` and collects the answers: (agent, document,
    payload size) per correlation id."""

    def __init__(self, mqtt_cfg: Any, cluster: str, ring: Any, kid: str, client_id: Optional[str] = None):
        self.topics = Topics(cluster)
        self.cluster = cluster
        self.ring, self.kid = ring, kid
        self.answers: dict[str, list[tuple[str, dict, int]]] = {}
        self.forged = 0  # answers whose agent is not their topic's
        self.cond = threading.Condition()
        self.link = MqttLink(mqtt_cfg, client_id or f"millwright-get-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                             clean_session=True, on_message=self._msg,
                             subscriptions=((self.topics.get_reply_filter(), 1),), topic_kind=self.topics.kind,
                             reconnect_min_s=0.2, reconnect_max_s=1.0)

    def start(self, timeout: float = 10.0) -> bool:
        self.link.start()
        if not self.link.wait_connected(timeout):
            return False
        time.sleep(0.1)  # the SUBACK, before any question can be answered
        return True

    def stop(self) -> None:
        self.link.stop()

    def _msg(self, msg: Message) -> None:
        self.link.ack(msg)
        try:
            doc = json.loads(msg.payload)
        except ValueError:
            return
        agent = self.topics.agent_of(msg.topic)
        if not isinstance(doc, dict) or agent is None:
            return
        with self.cond:
            if doc.get("agent") != agent:
                self.forged += 1
                return
            self.answers.setdefault(str(doc.get("correlation")), []).append((agent, doc, len(msg.payload)))
            self.cond.notify_all()

    # --- asking ---------------------------------------------------------------------------
    def signed(self, doc: dict) -> bytes:
        return json.dumps(sign(doc, self.ring, self.kid), separators=(",", ":")).encode()

    def send(self, payload: bytes, timeout: float = 10.0) -> bool:
        """Publish a request (any bytes: tests send unsigned ones) with QoS 1."""
        return self.link.publish_wait(self.topics.jobs_get, payload, 1, timeout=timeout)

    def ask(self, **kw: Any) -> str:
        """Sign and send a query (``job_id``, ``flt``, ``include``, ``cursor``); its correlation id."""
        corr = uuid.uuid4().hex
        if not self.send(self.signed(query_doc(self.cluster, corr, **kw))):
            raise OSError("the broker did not acknowledge the request")
        return corr

    def wait(self, corr: str, n: int = 1, timeout: float = 10.0) -> list[tuple[str, dict, int]]:
        """At least ``n`` answers to ``corr`` (fewer on timeout)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while len(self.answers.get(corr, [])) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            return list(self.answers.get(corr, []))

    def get(self, job_id: str, include: Iterable[str] = (), timeout: float = 10.0) -> Optional[dict]:
        """The owner's answer about one job (``found``, ``job``, or ``error``), or None."""
        got = self.wait(self.ask(job_id=job_id, include=include), 1, timeout)
        return got[0][1] if got else None

    def list(self, flt: Optional[dict] = None, include: Iterable[str] = (), timeout: float = 30.0) -> dict:
        """Every page of a filter from every agent, each next page asked for with its cursor.
        ``{"jobs", "pages": [(agent, answer, bytes)], "complete", "missing": [shards],
        "errors", "rounds"}``; complete when the agents whose last page came in cover every
        shard. A chain of pages counts only for the shards its last page vouches for (those
        its agent held all along, queries.py), each shard from one chain; shards no chain
        vouched for (moved while read, or an answer lost) are asked for again in another
        round."""
        include = tuple(include)
        flt = dict(flt or {})
        deadline = time.monotonic() + timeout
        # correlation id -> (cursor, asked at, its chain, tries): a chain is (first correlation,
        # agent); a request without a cursor starts one per agent that answers it
        asked: dict[str, tuple[Optional[str], float, Optional[tuple], int]] = {
            self.ask(flt=flt, include=include): (None, time.monotonic(), None, 1)}
        round_at = time.monotonic()
        rounds = 1
        taken: dict[str, int] = {}
        answered: set[tuple[str, str]] = set()
        pages: list = []
        jobs: dict[str, dict] = {}
        chain: dict[tuple, list] = {}  # chain -> its pages so far
        covered: set[int] = set()
        chains: set[tuple] = set()     # chains whose pages are still coming
        errors: list[dict] = []
        shard_count: Optional[int] = None
        while time.monotonic() < deadline:
            with self.cond:
                fresh = [(c, a) for c in asked for a in self.answers.get(c, [])[taken.get(c, 0):]]
                if not fresh:
                    self.cond.wait(min(0.2, max(0.0, deadline - time.monotonic())))
                    fresh = [(c, a) for c in asked for a in self.answers.get(c, [])[taken.get(c, 0):]]
            for corr, (agent, doc, size) in fresh:
                taken[corr] = taken.get(corr, 0) + 1
                if (corr, agent) in answered:
                    continue   # a second copy (QoS 1 delivers at least once)
                answered.add((corr, agent))
                if "error" in doc:
                    errors.append(doc)
                    continue
                shard_count = doc.get("shard_count", shard_count)
                key = asked[corr][2] or (corr, agent)
                chain.setdefault(key, []).append((agent, doc, size))
                if doc.get("next"):
                    chains.add(key)
                    asked[self.ask(flt=flt, include=include, cursor=doc["next"])] = (doc["next"], time.monotonic(), key, 1)
                    continue
                chains.discard(key)
                vouched = {s for s in doc.get("shards") or [] if isinstance(s, int)} - covered
                covered |= vouched
                for a, d, n in chain.pop(key, []):
                    kept = [j for j in d.get("jobs") or [] if j.get("shard") in vouched]
                    pages.append((a, dict(d, jobs=kept), n))
                    for j in kept:
                        jobs.setdefault(j.get("id"), j)
            now = time.monotonic()
            for corr, (cursor, at, root, tries) in list(asked.items()):  # a page request lost or rate-limited
                if cursor is not None and not taken.get(corr) and now - at > PAGE_RETRY_S:
                    del asked[corr]
                    if tries < PAGE_TRIES:
                        asked[self.ask(flt=flt, include=include, cursor=cursor)] = (cursor, now, root, tries + 1)
                    elif root is not None:   # its agent does not answer: the chain vouches for nothing
                        chains.discard(root)
                        chain.pop(root, None)
            if shard_count is None:
                continue
            missing = sorted(set(range(shard_count)) - covered)
            if not missing and not chains:
                return {"jobs": list(jobs.values()), "pages": pages, "complete": True, "missing": [],
                        "errors": errors, "rounds": rounds}
            if missing and not chains and now - round_at > ROUND_RETRY_S:
                asked[self.ask(flt=dict(flt, shards=missing), include=include)] = (None, now, None, 1)
                round_at, rounds = now, rounds + 1
        missing = sorted(set(range(shard_count or 0)) - covered) if shard_count else []
        return {"jobs": list(jobs.values()), "pages": pages, "complete": False, "missing": missing, "errors": errors,
                "rounds": rounds}
