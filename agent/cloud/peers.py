"""Peers' statuses: every agent reads its cluster members' statuses, bounded against a flooding peer.

Every agent subscribes to ``millwright/<c>/agents/<member>/status/+`` of each member
(agent/cloud/peersubs.py) to learn which answers reached the broker (agent/cloud/answers.py:
an answer a dead peer already delivered is not published again). A member (or whoever
forged a membership) could otherwise make every agent parse everything it publishes there
on the link's thread and stall its ingest. So on the link's thread a status costs only its
topic, its length and a token:

 1. the topic's agent segment: the only sender identity the broker vouches for (its ACL);
 2. the size, before any parsing (``max_bytes``);
 3. a token bucket per agent, in bytes: a status costs its length, at least
    ``MIN_COST`` (``rate`` bytes per second, ``burst``): parsing costs by the byte, so a
    flood of large statuses is cut far sooner than an agent's many small ones;
 4. a bounded queue (``queue_max`` statuses, ``queue_bytes`` bytes): when full, the new
    status is dropped (drop-new: the link's thread never waits);

and it is acknowledged (a peer's status is no durable state of this agent). A status
refused for its agent's rate (or too large while its bucket is empty) also tells
``flooding(agent)``, at most every ``FLOODING_EVERY_S`` per agent: peersubs.py then stops
the broker from sending that agent's statuses at all for a while. On a link of its own
(``mqtt.peers_username``: a clean session that carries only statuses) ``cut(agent)`` runs
first, on the link's thread: the agent is unsubscribed and the connection ended, so what
the broker had already queued of the flood is discarded with the session instead of
read. A status of an agent not in ``wanted()`` (peersubs.py's current set) is dropped
unread and told ``stray(agent)`` (as often): peersubs.py unsubscribes it again (a
subscription a previous run of this agent left in its persistent session, or what the
broker sent before an unsubscribe took effect), or subscribes again if the set changed
meanwhile. One worker thread parses what is queued and tells :meth:`Answers.saw` which
agent's topic carried it.

A status dropped at 2-4 is counted (``millwright_mqtt_peer_statuses_total{result}``),
audited (aggregated: one ``mqtt``/``peer_statuses_dropped`` record per agent and reason at
most every ``report_s``), and makes its agent *missed* (:meth:`Answers.missed`): an answer
of that writer this agent did not see may still have been delivered, so it is never
published again unmarked on the strength of a status this agent did not read. A drop
never loses an owed answer: at worst a republished copy is marked ``redelivery``.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from typing import Any, Callable, Optional

from agent.runtime.metrics import counter
from agent.runtime.recent import RecentMemory

from .link import Link, Message
from .ratelimit import TokenBucket
from .topics import ID_RE, Topics

log = logging.getLogger(__name__)

PEER_STATUSES = counter("millwright_mqtt_peer_statuses_total",
                        "Peers' statuses received, by result (read, too_large, rate_limited, queue_full, bad_json, "
                        "unsubscribed)",
                        ("result",))

# A status is about 240 bytes; the largest an agent writes (a 4 KiB stderr tail, every
# byte of it escaped) stays well below this.
MAX_BYTES = 32 * 1024
MIN_COST = 256           # bytes: what a status costs at least against its agent's rate (a status's size)
RATE_PER_S = 1 << 20     # bytes per agent and second: 4,000 small statuses/s, four times an agent's at
BURST = 1 << 20          # ~500 pushes/s, 4,000 at once (a group commit's burst), but only 128 of 8 KiB:
                         # a flood of large statuses is cut (and unsubscribed) before the broker queues much
MISSED_EVERY_S = 0.5     # answers.py's margin (1 s) covers the lag of a throttled `missed`
FLOODING_EVERY_S = 1.0
QUEUE_MAX = 20000
QUEUE_BYTES = 16 * 1024 * 1024
BUCKETS_MAX = 4096       # agents told apart (a flood under made-up agent ids evicts the oldest)
REPORT_S = 10.0
REPORT_AGENTS_MAX = 20   # audit records per report: the agents that lost the most


class PeerStatuses:
    """The status subscription's consumer: bounded on the link's thread, parsed on its own."""

    def __init__(self, topics: Topics, link: Link, saw: Callable[[str, dict], None],
                 missed: Callable[[str], None], record: Callable[..., None] = lambda *a, **k: None, *,
                 flooding: Callable[[str], None] = lambda agent: None,
                 stray: Callable[[str], None] = lambda agent: None,
                 wanted: Callable[[], Optional[frozenset]] = lambda: None,
                 cut: Optional[Callable[[str], None]] = None,
                 max_bytes: int = MAX_BYTES, rate: float = RATE_PER_S, burst: float = BURST,
                 queue_max: int = QUEUE_MAX, queue_bytes: int = QUEUE_BYTES, report_s: float = REPORT_S,
                 clock: Callable[[], float] = time.monotonic):
        self.topics = topics
        self.link = link
        self.saw = saw
        self.missed = missed
        self.record = record
        self.flooding = flooding
        self.stray = stray
        self.wanted = wanted
        self.cut = cut
        self.max_bytes = max_bytes
        self.rate, self.burst = rate, burst
        self.queue_max, self.queue_bytes = queue_max, queue_bytes
        self.report_s = report_s
        self.clock = clock
        self._buckets: RecentMemory[str, TokenBucket] = RecentMemory(BUCKETS_MAX)  # link thread only
        self._missed_at: RecentMemory[str, float] = RecentMemory(BUCKETS_MAX)     # link thread only
        self._flooding_at: RecentMemory[str, float] = RecentMemory(BUCKETS_MAX)   # link thread only
        self._count = {r: PEER_STATUSES.labels(r) for r in ("read", "too_large", "rate_limited", "queue_full",
                                                             "bad_json", "unsubscribed")}
        self._q: "collections.deque[tuple[str, bytes]]" = collections.deque()
        self._bytes = 0
        self._cv = threading.Condition()
        self._drops: "collections.Counter[tuple[str, str]]" = collections.Counter()  # under _cv
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self.read = 0
        self.received = 0   # link thread only (a figure for the status)

    # --- the link's thread -------------------------------------------------------------
    def on_message(self, msg: Message) -> None:
        self.link.ack(msg)
        self.received += 1
        agent = self.topics.agent_of(msg.topic)
        if agent is None or not ID_RE.fullmatch(agent):
            return
        wanted = self.wanted()
        if wanted is not None and agent not in wanted:
            # not (or no longer) subscribed to: what the broker had already sent, or a
            # subscription a previous run left in the session: told like a flood (unsubscribe)
            self._count["unsubscribed"].inc()
            self._flooding(agent, self.stray)
            return
        size = len(msg.payload)
        bucket = self._buckets.get(agent)
        if bucket is None:
            bucket = TokenBucket(self.rate, self.burst, self.clock)
            self._buckets.remember(agent, bucket)
        within = bucket.take(max(size, MIN_COST))   # what the link read counts, parsed or not
        if size > self.max_bytes or not within:
            self._dropped(agent, "too_large" if size > self.max_bytes else "rate_limited")
            if not within:
                self._flooding(agent, self._flood)
            return
        with self._cv:
            if len(self._q) >= self.queue_max or self._bytes + size > self.queue_bytes:
                full = True
            else:
                full = False
                if not self._q:
                    self._cv.notify()
                self._q.append((agent, msg.payload))
                self._bytes += size
        if full:
            self._dropped(agent, "queue_full")

    def _flood(self, agent: str) -> None:
        if self.cut is not None:
            self.cut(agent)
        self.flooding(agent)

    def _flooding(self, agent: str, tell: Callable[[str], None]) -> None:
        now = self.clock()
        last = self._flooding_at.get(agent)
        if last is None or now - last >= FLOODING_EVERY_S:
            self._flooding_at.remember(agent, now)
            tell(agent)

    def _dropped(self, agent: str, reason: str) -> None:
        self._count[reason].inc()
        now = self.clock()
        last = self._missed_at.get(agent)
        if last is None or now - last >= MISSED_EVERY_S:
            self._missed_at.remember(agent, now)
            self.missed(agent)
        with self._cv:
            if (agent, reason) in self._drops or len(self._drops) < BUCKETS_MAX:
                self._drops[(agent, reason)] += 1

    @property
    def depth(self) -> int:
        return len(self._q)

    # --- the worker ------------------------------------------------------------------------
    def start(self) -> "PeerStatuses":
        self._thread = threading.Thread(target=self._run, name="mqtt-peer-statuses", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        next_report = self.clock() + self.report_s
        while True:
            with self._cv:
                while not self._q and not self._stop and self.clock() < next_report:
                    self._cv.wait(max(0.01, next_report - self.clock()))
                if self._stop:
                    return
                batch: list[tuple[str, bytes]] = []
                while self._q and len(batch) < 256:
                    item = self._q.popleft()
                    self._bytes -= len(item[1])
                    batch.append(item)
            for agent, payload in batch:
                self.handle(agent, payload)
            if self.clock() >= next_report:
                self.report()
                next_report = self.clock() + self.report_s

    def handle(self, agent: str, payload: bytes) -> None:
        """One queued status: parsed, and its answer remembered under ``agent``."""
        try:
            doc: Any = json.loads(payload)
        except (ValueError, RecursionError):
            doc = None
        if not isinstance(doc, dict):
            self._count["bad_json"].inc()
            return
        self._count["read"].inc()
        self.read += 1
        try:
            self.saw(agent, doc)
        except Exception:  # a peer's payload never stops the worker
            log.exception("a peer's status could not be handled")

    def report(self) -> None:
        """The drops since the last report: one warning, and an audit record per agent and
        reason (the agents that lost the most, at most REPORT_AGENTS_MAX)."""
        with self._cv:
            drops, self._drops = self._drops, collections.Counter()
        if not drops:
            return
        log.warning("peers' statuses dropped unread (too large, over their rate, or the queue full)",
                    extra={"fields": {"dropped": sum(drops.values()), "agents": len({a for a, _ in drops})}})
        for (agent, reason), n in drops.most_common(REPORT_AGENTS_MAX):
            self.record("mqtt", event="peer_statuses_dropped", agent=agent, reason=reason, count=n)
