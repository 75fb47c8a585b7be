"""``jobs/get``: the cloud asks what a job is doing (request/response, as AWS IoT Jobs ``get``).

Request on ``millwright/<c>/jobs/get`` (QoS 0 or 1), JSON:
``{"v":1, "correlation":"<≤128 chars>", "reply_to":"millwright/<c>/jobs/get/reply/<anything>",
   "id":"<job id>"}`` or, instead of ``id``, ``"filter": {"state", "template", "updated_since",
"limit"}``. The reply topic travels in the payload (MQTT 5's response topic and correlation
data, done by hand so it works over MQTT 3.1.1 with paho 1.6). It must be under
``jobs/get/reply/``: an agent never publishes a requester-chosen topic elsewhere (say,
``jobs/push``). Without ``reply_to`` the answer goes to ``jobs/get/reply/<correlation>``.

Who answers: for an id, the agent that owns the job's shard, read from etcd (agent/jobs/view.py).
Every agent holds an id request whose shard it does not own for up to ``hold_s`` (the lease
TTL plus a margin): when the shard becomes its own meanwhile (a takeover), it answers then.
So a request for a job whose owner just died is answered by the new owner after the
takeover. (When ownership does not change, the held copies simply expire.) For a filter,
each agent answers for the shards it owns, and says which (``shards``, ``shard_count``):
the requester knows it has everything when the union covers all shards.

Answer: ``{"v":1, "correlation", "agent", "ts", "found", "job": {id, shard, template, state,
next_due, accepted, cancelled, updated_at, runs[<=5], doc}}`` or, for a filter,
``{"v":1, "correlation", "agent", "ts", "shards", "shard_count", "jobs": [...], "truncated"}``.
Bad requests are answered ``{"error": "<reason>", "detail"}`` when there is a reply topic.
"""

from __future__ import annotations

import collections
import json
import logging
import queue
import threading
import time
from datetime import datetime, timezone
from typing import Callable, Optional

from agent.coordination.etcd import EtcdError, EtcdUnavailable
from agent.coordination.keys import Keys, shard_of
from agent.jobs import view
from agent.runtime.metrics import counter, histogram

from .link import Link, Message
from .topics import ID_RE, Topics

log = logging.getLogger("millwright.cloud.queries")

QUERIES = counter("millwright_jobs_get_total", "jobs/get requests by result", ("result",))
QUERY_SECONDS = histogram("millwright_jobs_get_seconds", "jobs/get arrival to answer",
                          buckets=(.002, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 10))

MAX_PENDING = 20000
FILTER_LIMIT = 1000


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class BadRequest(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class Request:
    __slots__ = ("correlation", "reply_to", "job_id", "filter", "received", "deadline", "shard")

    def __init__(self, correlation, reply_to, job_id, flt, received, deadline, shard):
        self.correlation, self.reply_to, self.job_id, self.filter = correlation, reply_to, job_id, flt
        self.received, self.deadline, self.shard = received, deadline, shard


def parse_request(payload: bytes, topics: Topics, max_bytes: int = 8192) -> tuple[str, str, Optional[str], Optional[dict]]:
    """(correlation, reply_to, job_id, filter). Raises BadRequest; the reply_to of a request
    whose reply topic is unusable is ''."""
    if len(payload) > max_bytes:
        raise BadRequest("too_large", f"request is {len(payload)} bytes; the limit is {max_bytes}")
    try:
        doc = json.loads(payload)
    except (ValueError, RecursionError):
        raise BadRequest("bad_json", "request is not valid JSON") from None
    if not isinstance(doc, dict):
        raise BadRequest("bad_json", "request must be a JSON object")
    corr = doc.get("correlation")
    if not isinstance(corr, str) or not 0 < len(corr) <= 128 or any(c in corr for c in "+#/\0"):
        raise BadRequest("bad_field", "correlation: a string of 1-128 characters without + # / is required")
    reply = doc.get("reply_to", topics.get_reply(corr))
    if not isinstance(reply, str) or not reply.startswith(topics.get_reply_prefix) or \
            len(reply) > 512 or any(c in reply for c in "+#\0"):
        raise BadRequest("bad_field", f"reply_to: must be a topic under {topics.get_reply_prefix}")
    job_id = doc.get("id")
    flt = doc.get("filter")
    if job_id is not None:
        if not isinstance(job_id, str) or not ID_RE.fullmatch(job_id) or job_id.startswith("."):
            raise BadRequest("bad_field", "id: not a job id")
        return corr, reply, job_id, None
    if flt is None:
        flt = {}
    if not isinstance(flt, dict) or set(flt) - {"state", "template", "updated_since", "limit"}:
        raise BadRequest("bad_field", "filter: an object with state, template, updated_since, limit")
    for k in ("state", "template", "updated_since"):
        if k in flt and not isinstance(flt[k], str):
            raise BadRequest("bad_field", f"filter.{k}: must be a string")
    if "updated_since" in flt and view.parse_time(flt["updated_since"]) is None:
        raise BadRequest("bad_field", "filter.updated_since: an RFC 3339 time with an offset")
    lim = flt.get("limit", FILTER_LIMIT)
    if not isinstance(lim, int) or isinstance(lim, bool) or not 0 < lim <= FILTER_LIMIT:
        raise BadRequest("bad_field", f"filter.limit: 1..{FILTER_LIMIT}")
    return corr, reply, None, dict(flt, limit=lim)


class JobQueries:
    """Answers jobs/get from etcd. on_message runs on the link's thread and only queues;
    ``threads`` workers do the etcd reads and publish the answers."""

    def __init__(self, client, keys: Keys, shards: int, agent_id: str, topics: Topics, link: Link,
                 owned: Callable[[], frozenset], hold_s: float, threads: int = 2):
        self.client = client
        self.keys = keys
        self.shards = shards
        self.agent_id = agent_id
        self.topics = topics
        self.link = link
        self.owned = owned
        self.hold_s = hold_s
        self.nthreads = threads
        self._q: "queue.Queue" = queue.Queue()
        # held id requests by shard, and all of them in arrival order (deadlines increase)
        self._held: dict[int, "collections.deque[Request]"] = {}
        self._held_order: "collections.deque[Request]" = collections.deque()
        self._held_lock = threading.Lock()
        self._stop = threading.Event()
        self._held_ev = threading.Event()  # set when a request is held (and on stop)
        self._threads: list[threading.Thread] = []

    def start(self) -> "JobQueries":
        for i in range(self.nthreads):
            t = threading.Thread(target=self._work, name=f"mqtt-jobs-get-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        t = threading.Thread(target=self._recheck, name="mqtt-jobs-get-held", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._held_ev.set()
        for _ in range(self.nthreads):
            self._q.put(None)
        for t in self._threads:
            t.join(timeout)

    @property
    def held(self) -> int:
        return len(self._held_order)

    # --- link thread ----------------------------------------------------------------
    def on_message(self, msg: Message) -> None:
        self.link.ack(msg)  # a query is not durable state: nothing to wait for
        self._q.put(msg)

    # --- workers ----------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            try:
                if isinstance(item, Request):
                    self._answer(item)
                else:
                    self._request(item)
            except Exception:
                log.exception("jobs/get failed")

    def _request(self, msg) -> None:
        try:
            corr, reply, job_id, flt = parse_request(msg.payload, self.topics)
        except BadRequest as exc:
            QUERIES.labels("bad_request").inc()
            bad_corr: Optional[str] = None
            bad_reply: Optional[str] = None
            try:
                doc = json.loads(msg.payload)
                if isinstance(doc, dict):
                    bad_corr, bad_reply = doc.get("correlation"), doc.get("reply_to")
            except (ValueError, RecursionError):
                pass
            if isinstance(bad_corr, str) and isinstance(bad_reply, str) \
                    and bad_reply.startswith(self.topics.get_reply_prefix) \
                    and not any(c in bad_reply for c in "+#\0") and shard_of(bad_corr, self.shards) in self.owned():
                # one agent answers a bad request: the owner of the correlation id's shard
                self._publish(bad_reply, {"v": 1, "correlation": bad_corr, "agent": self.agent_id, "ts": _now(),
                                      "error": exc.reason, "detail": exc.detail})
            return
        shard = shard_of(job_id, self.shards) if job_id else None
        self._answer(Request(corr, reply, job_id, flt, msg.received, msg.received + self.hold_s, shard))

    def _answer(self, req: Request) -> None:
        owned = self.owned()
        if req.job_id is None:
            if not owned:
                QUERIES.labels("no_shards").inc()
                return
            f = req.filter or {}
            jobs = view.list_jobs(self.client, self.keys, self.shards, in_shards=owned, state=f.get("state"),
                                  template=f.get("template"), updated_since=f.get("updated_since"),
                                  limit=f.get("limit", FILTER_LIMIT) + 1)
            lim = f.get("limit", FILTER_LIMIT)
            self._reply(req, {"shards": sorted(owned), "shard_count": self.shards, "jobs": jobs[:lim],
                              "truncated": len(jobs) > lim}, "list")
            return
        if req.shard not in owned:
            self._hold(req)
            return
        try:
            job = view.get_job(self.client, self.keys, self.shards, req.job_id)
        except (EtcdUnavailable, EtcdError):
            self._hold(req)  # try again shortly, within the request's time
            return
        self._reply(req, {"found": job is not None, "job": job}, "found" if job else "not_found")

    def _reply(self, req: Request, body: dict, result: str) -> None:
        doc = {"v": 1, "correlation": req.correlation, "agent": self.agent_id, "ts": _now(), **body}
        self._publish(req.reply_to, doc)
        QUERIES.labels(result).inc()
        QUERY_SECONDS.observe(time.monotonic() - req.received)

    def _publish(self, topic: str, doc: dict) -> None:
        self.link.publish(topic, json.dumps(doc, separators=(",", ":"), ensure_ascii=False, default=str).encode(), 1)

    # --- held requests ----------------------------------------------------------------------
    def _hold(self, req: Request) -> None:
        now = time.monotonic()
        if now >= req.deadline:
            QUERIES.labels("not_owner").inc()
            return
        with self._held_lock:
            self._held.setdefault(req.shard, collections.deque()).append(req)
            self._held_order.append(req)
            self._held_ev.set()
            while len(self._held_order) > MAX_PENDING:
                self._drop_oldest_locked()
                QUERIES.labels("dropped").inc()

    def _drop_oldest_locked(self) -> None:
        r = self._held_order.popleft()
        q = self._held.get(r.shard)
        if q is not None:
            try:
                q.remove(r)  # almost always its head
            except ValueError:
                pass
            if not q:
                del self._held[r.shard]

    def _recheck(self) -> None:
        """Every 0.1 s while requests are held: those whose shard became ours are answered,
        expired ones dropped. With none held it sleeps until one is (no idle wake-ups)."""
        while not self._stop.is_set():
            with self._held_lock:
                idle = not self._held_order
                if idle:
                    self._held_ev.clear()
            if idle:
                self._held_ev.wait()
                continue
            if self._stop.wait(0.1):
                return
            self.recheck_once(time.monotonic())

    def recheck_once(self, now: float) -> None:
        """Held requests whose shard is ours now go to the workers; expired ones are dropped."""
        owned = self.owned()
        ready: list = []
        with self._held_lock:
            for shard in [s for s in self._held if s in owned]:
                ready.extend(self._held.pop(shard))
            if ready:
                taken = set(map(id, ready))
                self._held_order = collections.deque(r for r in self._held_order if id(r) not in taken)
            while self._held_order and self._held_order[0].deadline <= now:
                self._drop_oldest_locked()
                QUERIES.labels("not_owner").inc()
        for r in ready:
            self._q.put(r)
