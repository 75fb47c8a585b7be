"""``jobs/get``: the cloud asks what jobs are doing (request/response, as AWS IoT Jobs ``get``),
in signed requests, with bounded work, answered under the answering agent's own prefix.

Request on ``millwright/<c>/jobs/get`` (QoS 0 or 1), a document signed like a cancel::

    {"v":1, "cluster":"<c>", "kind":"query", "issued_at":"<RFC 3339>", "correlation":"<1-128 chars>",
     "id":"<job id>"  |  "filter":{"state","template","updated_since","limit","shards"},
     "include":["params","stderr"]?, "cursor":"<a previous answer's next>"?, "sig":{...}}

Checked in this order: size (on the link's thread, before parsing), a bounded queue (the
link's thread never waits: when full the new request is dropped), then in a worker the
envelope of agent/jobs/envelope.py (JSON, signature, binding to this cluster and kind
``query``), then the fields: ``issued_at`` at most ``mqtt.get_max_age_s`` old and
``mqtt.max_skew_s`` ahead, a signed request already answered (a replay) is ignored, and
the requests this agent reads etcd for are rate-limited (GET_RATE_PER_S by id,
PAGE_RATE_PER_S pages of a filter). A request that fails the
envelope gets no answer: it is counted, audited and reported (reason only, on the
agent's ``rejected`` topic, rate-limited) by the owner of its digest's shard, like an
unauthenticated push. An authenticated request with a bad field is answered
``{"error", "detail"}`` by one agent (the owner of the correlation id's shard).

Answers go to ``millwright/<c>/agents/<agent_id>/get/<correlation>``: under the answering
agent's own prefix, never to a topic the requester names (the broker ACL lets an agent
write nothing else). A requester subscribes to ``agents/+/get/<correlation>``.

By id: the agent that owns the job's shard answers ``{"v":1, "correlation", "agent", "ts",
"found", "job": {id, shard, template, state, next_due, accepted, cancelled, updated_at,
runs[<=5], doc}}``. Every agent holds an id request whose shard it does not own for up to
``hold_s`` (the lease TTL plus a margin): if the shard becomes its own meanwhile (a
takeover), it answers then.

By filter: each agent that owns shards (of the filter's ``shards``, when given) answers one
page for them: ``{"v":1, "correlation", "agent", "ts", "shards", "shard_count", "jobs":
[...], "next": "<cursor>" | null}``, at most ``mqtt.get_page_bytes`` of JSON and
GET_SCAN_MAX jobs read. The requester asks for the next page with the same signed filter
and ``"cursor": <next>``; only the agent the cursor names answers it. A page's ``shards``
are those its chain of pages vouches for: owned by the agent at every page so far (the
cursor carries them), so a shard that moves while the pages are read is vouched for by
neither agent, and its jobs are asked for again (agent/cloud/asking.py), never counted
complete from a chain that skipped part of it. The requester has everything when every
agent's last page (``next`` null) is in and their ``shards`` cover ``0..shard_count-1``.

A job's view carries its params and its runs' stderr tails only when ``include`` asks.
Every answer, by id too, is at most ``mqtt.get_page_bytes`` of its final encoding whatever
etcd holds: a view too large is cut (agent/jobs/bounded.py), and reported once per job.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Optional

from agent.coordination.etcd import EtcdError, EtcdUnavailable
from agent.coordination.keys import Keys, shard_of
from agent.jobs import bounded, view
from agent.jobs.envelope import (
    KIND_QUERY,
    SKEW,
    TOO_OLD,
    UNSUPPORTED_VERSION,
    VERSION,
    JobRejected,
    authenticate,
    bad,
    field_name,
)
from agent.runtime.metrics import counter, histogram
from agent.runtime.recent import RecentMemory

from .ingest import push_digest
from .link import Link, Message
from .ratelimit import TokenBucket
from .topics import ID_RE, Topics

log = logging.getLogger(__name__)

QUERIES = counter("millwright_jobs_get_total", "jobs/get requests by result", ("result",))
OVERSIZED = counter("millwright_jobs_get_oversized_total",
                    "stored jobs whose view had to be cut to fit a jobs/get answer (once per job and agent)",
                    ("result",))
QUERY_SECONDS = histogram("millwright_jobs_get_seconds", "jobs/get arrival to answer",
                          buckets=(.002, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 10))

MAX_REQUEST_BYTES = 8192
QUEUE_MAX = 1000          # requests waiting for a worker
MAX_HELD = 1000           # id requests held for a shard that may become this agent's
# authenticated requests this agent reads etcd for, per second: a job by id (a few reads),
# a page of a filter (up to GET_SCAN_MAX jobs); a request for a shard of another agent only
# costs its place among the held ones
GET_RATE_PER_S = 200.0
GET_BURST = 1000.0
PAGE_RATE_PER_S = 20.0
PAGE_BURST = 100.0
GET_SCAN_MAX = 2000       # jobs read for one page of a filter
FILTER_LIMIT = 1000       # jobs in one page at most
REPLAYS_MAX = 20000
OVERSIZED_MAX = 10000     # jobs remembered as reported oversized (a report per job, not per answer)
QUERY_KEYS = ("v", "cluster", "kind", "issued_at", "correlation", "id", "filter", "include", "cursor", "sig")
FILTER_KEYS = ("state", "template", "updated_since", "limit", "shards")
INCLUDE = ("params", "stderr")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _size(doc: Any) -> int:
    return bounded.size(doc)


@dataclass(frozen=True)
class Cursor:
    """Where one agent's next page of a filter starts: after ``job_id`` of ``shard``; and
    the shards its pages vouch for so far (``held``, a hex bit mask in the text; None in a
    cursor of an agent before it: then the shards owned now)."""

    agent: str
    shard: int
    job_id: str
    held: Optional[frozenset] = None

    def text(self) -> str:
        base = f"{self.agent}/{self.shard:04d}/{self.job_id}"
        return base if self.held is None else f"{base}/{sum(1 << s for s in self.held):x}"

    @staticmethod
    def parse(text: Any, shards: int) -> "Cursor":
        parts = text.split("/") if isinstance(text, str) else []
        if len(parts) not in (3, 4) or not ID_RE.fullmatch(parts[0]) or not parts[1].isdigit() or \
                not int(parts[1]) < shards or not ID_RE.fullmatch(parts[2]):
            raise bad("cursor", "not a cursor of this cluster (pass an answer's `next` unchanged)")
        held = None
        if len(parts) == 4:
            mask = parts[3]
            if not 0 < len(mask) <= (shards + 3) // 4 or any(c not in "0123456789abcdef" for c in mask) \
                    or int(mask, 16) >> shards:
                raise bad("cursor", "not a cursor of this cluster (pass an answer's `next` unchanged)")
            held = frozenset(s for s in range(shards) if int(mask, 16) >> s & 1)
        return Cursor(parts[0], int(parts[1]), parts[2], held)


@dataclass(frozen=True)
class Query:
    """A signed, bound, fresh jobs/get request."""

    correlation: str
    job_id: Optional[str]
    filter: Optional[dict]
    include: frozenset
    cursor: Optional[Cursor]
    digest: str


def parse_query(payload: bytes, *, keyring: Any, cluster: str, shards: int, now: datetime, max_age_s: float,
                max_skew_s: float, max_bytes: int = MAX_REQUEST_BYTES) -> Query:
    """A jobs/get request, or JobRejected: ``bound`` False when it failed the envelope
    (size, JSON, signature, cluster, kind), True for a bad field of an authentic request."""
    doc = authenticate(payload, keyring=keyring, max_bytes=max_bytes, cluster=cluster, kind=KIND_QUERY, now=now)
    try:
        return _fields(doc, shards, now, max_age_s, max_skew_s, push_digest(bytes(payload)))
    except JobRejected as exc:
        exc.bound = True
        raise


def _fields(doc: dict, shards: int, now: datetime, max_age_s: float, max_skew_s: float, digest: str) -> Query:
    if doc.get("v") != VERSION:
        raise JobRejected(UNSUPPORTED_VERSION, f"v: this agent speaks version {VERSION}", "v")
    unknown = [k for k in doc if k not in QUERY_KEYS]
    if unknown:
        hint = " (answers go to agents/<id>/get/<correlation>)" if unknown[0] == "reply_to" else ""
        raise bad(field_name(unknown[0]), f"unknown key{hint}; a query has only: {', '.join(QUERY_KEYS)}")
    issued = view.parse_time(doc.get("issued_at")) if isinstance(doc.get("issued_at"), str) else None
    if issued is None:
        raise bad("issued_at", "an RFC 3339 time with an offset is required (queries expire)")
    ahead = (issued - now).total_seconds()
    if ahead > max_skew_s:
        raise JobRejected(SKEW, f"issued_at: {ahead:.0f} s ahead of this agent's clock (allowed: {max_skew_s:g} s)",
                          "issued_at")
    if -ahead > max_age_s:
        raise JobRejected(TOO_OLD, f"issued_at: {-ahead:.0f} s old (allowed: {max_age_s:g} s)", "issued_at")
    corr = doc.get("correlation")
    if not isinstance(corr, str) or not 0 < len(corr) <= 128 or any(c in corr for c in "+#/\0"):
        raise bad("correlation", "a string of 1-128 characters without + # / is required")
    include = doc.get("include", [])
    if not isinstance(include, list) or any(i not in INCLUDE for i in include):
        raise bad("include", f"a list of {', '.join(INCLUDE)}")
    job_id, flt, cursor = doc.get("id"), doc.get("filter"), doc.get("cursor")
    if job_id is not None:
        if flt is not None or cursor is not None:
            raise bad("id", "a query asks by id or by filter (with its cursor), not both")
        if not isinstance(job_id, str) or not ID_RE.fullmatch(job_id) or job_id.startswith("."):
            raise bad("id", "not a job id")
        return Query(corr, job_id, None, frozenset(include), None, digest)
    flt = {} if flt is None else flt
    if not isinstance(flt, dict) or set(flt) - set(FILTER_KEYS):
        raise bad("filter", f"an object with {', '.join(FILTER_KEYS)}")
    for k in ("state", "template", "updated_since"):
        if k in flt and not isinstance(flt[k], str):
            raise bad(f"filter.{k}", "must be a string")
    if "updated_since" in flt and view.parse_time(flt["updated_since"]) is None:
        raise bad("filter.updated_since", "an RFC 3339 time with an offset")
    lim = flt.get("limit", FILTER_LIMIT)
    if not isinstance(lim, int) or isinstance(lim, bool) or not 0 < lim <= FILTER_LIMIT:
        raise bad("filter.limit", f"1..{FILTER_LIMIT} (jobs per page)")
    if "shards" in flt:
        want = flt["shards"]
        if not isinstance(want, list) or not 0 < len(want) <= shards or len(set(want)) != len(want) or \
                any(not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < shards for x in want):
            raise bad("filter.shards", f"a list of distinct shard numbers 0..{shards - 1}")
    return Query(corr, None, dict(flt, limit=lim), frozenset(include),
                 Cursor.parse(cursor, shards) if cursor is not None else None, digest)


def shaped(job: dict, include: frozenset) -> dict:
    """A job's view as a query may see it: no params, no stderr tails unless included."""
    out = dict(job)
    if "params" not in include and isinstance(out.get("doc"), dict):
        out["doc"] = {k: v for k, v in out["doc"].items() if k != "params"}
    if "stderr" not in include and out.get("runs"):
        out["runs"] = [{k: v for k, v in r.items() if k != "stderr_tail"} if isinstance(r, dict) else r
                       for r in out["runs"]]
    return out


def fitted(job: dict, max_bytes: int, job_id: Optional[str] = None, shard: Optional[int] = None) -> dict:
    """``job`` within ``max_bytes`` of JSON, whatever etcd holds: its runs' stderr tails are
    left out first (named in ``omitted``), then its largest parts are cut (named in
    ``cut``, agent/jobs/bounded.py), and a view that cannot fit even so is a stub with its
    id (``job_id``: the etcd key's) and the marker."""
    if _size(job) <= max_bytes:
        return job
    out = dict(job, runs=[{k: v for k, v in r.items() if k != "stderr_tail"} if isinstance(r, dict) else r
                          for r in job.get("runs") or []] if isinstance(job.get("runs"), list) else job.get("runs"),
               omitted=["stderr"])
    return bounded.fitted(out, max_bytes, job_id if job_id is not None else job.get("id"),
                          shard if shard is not None else job.get("shard"))


class Request:
    __slots__ = ("query", "received", "deadline", "shard")

    def __init__(self, query: Query, received: float, deadline: float, shard: Optional[int]):
        self.query, self.received, self.deadline, self.shard = query, received, deadline, shard


class JobQueries:
    """Answers jobs/get from etcd. on_message runs on the link's thread and only queues;
    ``threads`` workers check the requests, read etcd and publish the answers."""

    def __init__(self, client, keys: Keys, shards: int, agent_id: str, topics: Topics, link: Link,
                 owned: Callable[[], frozenset], hold_s: float, *, keyring: Any, cluster: str,
                 max_age_s: float, max_skew_s: float, page_bytes: int,
                 report_unauthenticated: Callable[[str, bytes, str, Callable[[int], bool]], Any],
                 threads: int = 2, rate: Optional[TokenBucket] = None, page_rate: Optional[TokenBucket] = None,
                 queue_max: int = QUEUE_MAX, record: Optional[Callable[..., Any]] = None):
        self.client = client
        self.keys = keys
        self.shards = shards
        self.agent_id = agent_id
        self.topics = topics
        self.link = link
        self.owned = owned
        self.hold_s = hold_s
        self.keyring = keyring
        self.cluster = cluster
        self.max_age_s = max_age_s
        self.max_skew_s = max_skew_s
        self.page_bytes = page_bytes
        self.report_unauthenticated = report_unauthenticated
        self.nthreads = threads
        self.rate = rate or TokenBucket(GET_RATE_PER_S, GET_BURST)
        self.page_rate = page_rate or TokenBucket(PAGE_RATE_PER_S, PAGE_BURST)
        self.queue_max = queue_max
        self._q: "collections.deque" = collections.deque()
        self._cv = threading.Condition()
        self._replays: RecentMemory[str, bool] = RecentMemory(REPLAYS_MAX)
        self._replays_lock = threading.Lock()
        self.record = record or (lambda *a, **k: None)
        # jobs already reported oversized (job id -> True), so a job is reported once, not per answer
        self._oversized: RecentMemory[str, bool] = RecentMemory(OVERSIZED_MAX)
        self._oversized_lock = threading.Lock()
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
        with self._cv:
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout)

    @property
    def held(self) -> int:
        return len(self._held_order)

    @property
    def queued(self) -> int:
        return len(self._q)

    # --- link thread ----------------------------------------------------------------
    def on_message(self, msg: Message) -> None:
        """Size, then the bounded queue; nothing else on the link's thread."""
        self.link.ack(msg)  # a query is not durable state: nothing to wait for
        if len(msg.payload) > MAX_REQUEST_BYTES:
            self.report_unauthenticated("get", msg.payload, "too_large", self._responsible)
            QUERIES.labels("unauthenticated").inc()
            return
        with self._cv:
            if len(self._q) >= self.queue_max:
                full = True
            else:
                full = False
                self._q.append(msg)
                self._cv.notify()
        if full:
            QUERIES.labels("queue_full").inc()

    def _responsible(self, shard: int) -> bool:
        return shard in self.owned()

    # --- workers ----------------------------------------------------------------------
    def _next(self) -> Optional[Any]:
        with self._cv:
            while not self._q and not self._stop.is_set():
                self._cv.wait(1.0)
            return None if self._stop.is_set() else self._q.popleft()

    def _work(self) -> None:
        while True:
            item = self._next()
            if item is None:
                return
            try:
                if isinstance(item, Request):
                    self._answer(item)
                else:
                    self.request(item)
            except Exception:
                log.exception("jobs/get failed")

    def request(self, msg: Message) -> None:
        """One request from the link (a worker thread): checked, then answered or held."""
        try:
            q = parse_query(msg.payload, keyring=self.keyring, cluster=self.cluster, shards=self.shards,
                            now=datetime.now(timezone.utc), max_age_s=self.max_age_s, max_skew_s=self.max_skew_s)
        except JobRejected as exc:
            if not exc.bound:
                QUERIES.labels("unauthenticated").inc()
                self.report_unauthenticated("get", msg.payload, exc.reason, self._responsible)
                return
            QUERIES.labels("bad_request").inc()
            self._bad_request(msg.payload, exc)
            return
        with self._replays_lock:
            replay = q.digest in self._replays
            self._replays.remember(q.digest, True)
        if replay:  # the same signed request again (a replay, or QoS 1 delivering it twice)
            QUERIES.labels("replay").inc()
            return
        if q.cursor is not None and q.cursor.agent != self.agent_id:
            QUERIES.labels("other_agents_cursor").inc()
            return
        shard = shard_of(q.job_id, self.shards) if q.job_id else None
        owned = self.owned()
        reads = shard in owned if q.job_id else bool(owned)  # else: held, or not this agent's to answer
        if reads and not (self.rate if q.job_id else self.page_rate).take():
            QUERIES.labels("rate_limited").inc()
            return
        self._answer(Request(q, msg.received, msg.received + self.hold_s, shard))

    def _bad_request(self, payload: bytes, exc: JobRejected) -> None:
        """An authentic request with a bad field: answered by the owner of its correlation
        id's shard, when the correlation id itself is usable."""
        try:
            corr = json.loads(payload).get("correlation")
        except (ValueError, RecursionError, AttributeError):
            return
        if not isinstance(corr, str) or not 0 < len(corr) <= 128 or any(c in corr for c in "+#/\0"):
            return
        if shard_of(corr, self.shards) in self.owned():
            self._publish(corr, {**self._envelope(corr), "error": exc.reason, "detail": exc.detail})

    def _answer(self, req: Request) -> None:
        q = req.query
        owned = self.owned()
        if q.job_id is None:
            if q.cursor is None and not owned & set((q.filter or {}).get("shards", owned)):
                QUERIES.labels("no_shards").inc()
                return
            self._page(req, owned)   # a chain of pages always ends (with no shard if none is left)
            return
        if req.shard not in owned:
            self._hold(req)
            return
        try:
            job = view.get_job(self.client, self.keys, self.shards, q.job_id)
        except (EtcdUnavailable, EtcdError):
            self._hold(req)  # try again shortly, within the request's time
            return
        env = self._envelope(q.correlation)
        if job is not None:
            # the answer's bytes are the envelope's and the job's: "null" stands in its place
            budget = self.page_bytes - _size(dict(env, found=True, job=None)) + len("null")
            job = self._fitted(shaped(job, q.include), budget, q.job_id, req.shard)  # type: ignore[arg-type]
        self._reply(req, {**env, "found": job is not None, "job": job}, "found" if job else "not_found")

    def _page(self, req: Request, owned: frozenset) -> None:
        q = req.query
        f = q.filter or {}
        vouched = owned if q.cursor is None or q.cursor.held is None else owned & q.cursor.held
        if "shards" in f:
            vouched = vouched & frozenset(f["shards"])
        head = {**self._envelope(q.correlation), "shards": sorted(vouched), "shard_count": self.shards, "jobs": [],
                "next": None}
        # the page's own bytes with the longest cursor it can carry (a job id has 128 characters
        # at most); list_page counts "[]" and a comma per job again: a few bytes to spare
        longest = Cursor(self.agent_id, self.shards - 1, "x" * 128, held=vouched).text()
        budget = self.page_bytes - _size(dict(head, next=longest))
        after = (q.cursor.shard, q.cursor.job_id) if q.cursor else None
        jobs, nxt = view.list_page(self.client, self.keys, self.shards, vouched, state=f.get("state"),
                                   template=f.get("template"), updated_since=f.get("updated_since"), after=after,
                                   limit=f.get("limit", FILTER_LIMIT), max_bytes=budget, scan_max=GET_SCAN_MAX,
                                   shape=lambda v, shard, job_id: self._fitted(shaped(v, q.include), budget - 2,
                                                                               job_id, shard))
        head.update(jobs=jobs, next=Cursor(self.agent_id, *nxt, held=vouched).text() if nxt else None)
        self._reply(req, head, "page")

    def _envelope(self, correlation: str) -> dict:
        return {"v": 1, "correlation": correlation, "agent": self.agent_id, "ts": _now()}

    def _fitted(self, job: dict, budget: int, job_id: str, shard: int) -> dict:
        """:func:`fitted`, reporting a job cut to fit (a metric, a log line and an audit
        record) once per job: the answers themselves may repeat without end."""
        out = fitted(job, budget, job_id, shard)
        how = bounded.was_cut(out)
        if how is not None:
            with self._oversized_lock:
                seen = job_id in self._oversized
                self._oversized.remember(job_id, True)
            if not seen:
                OVERSIZED.labels(how).inc()
                detail = {"job": job_id, "shard": shard, "result": how, "bytes": _size(job), "limit": budget,
                          "cut": out.get("cut", [])}
                log.warning("a stored job's view exceeds the jobs/get bound: cut (etcd holds more than an agent "
                            "writes?)", extra={"fields": detail})
                self.record("job", event="view_oversized", **detail)
        return out

    def _reply(self, req: Request, doc: dict, result: str) -> None:
        self._publish(req.query.correlation, doc)
        QUERIES.labels(result).inc()
        QUERY_SECONDS.observe(time.monotonic() - req.received)

    def _publish(self, correlation: str, doc: dict) -> None:
        payload = bounded.encode(doc)
        self.link.publish(self.topics.get_reply(correlation, self.agent_id), payload, 1)

    # --- held requests ----------------------------------------------------------------------
    def _hold(self, req: Request) -> None:
        now = time.monotonic()
        if now >= req.deadline:
            QUERIES.labels("not_owner").inc()
            return
        with self._held_lock:
            self._held.setdefault(req.shard, collections.deque()).append(req)  # type: ignore[arg-type]
            self._held_order.append(req)
            self._held_ev.set()
            while len(self._held_order) > MAX_HELD:
                self._drop_oldest_locked()
                QUERIES.labels("dropped").inc()

    def _drop_oldest_locked(self) -> None:
        r = self._held_order.popleft()
        q = self._held.get(r.shard)  # type: ignore[arg-type]
        if q is not None:
            try:
                q.remove(r)  # almost always its head
            except ValueError:
                pass
            if not q:
                del self._held[r.shard]  # type: ignore[arg-type]

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
        if ready:
            with self._cv:
                self._q.extend(ready)  # already admitted: past the queue's bound on purpose
                self._cv.notify_all()
