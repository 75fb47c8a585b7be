"""Which peers' statuses this agent reads: one subscription per cluster member, none for
anyone else, and none for a while for a member that floods.

An agent reads its peers' statuses only to know which of a dead peer's answers reached the
broker (agent/cloud/answers.py). A status it does not read costs at worst a ``redelivery``
mark on a republished answer, never the answer; a status the broker sends it costs its
link's thread a read even when peers.py then drops it. So the broker is asked for what is
worth reading only:

- ``agents/<member>/status/+`` for each member in etcd (this agent included), at most
  ``max_peers``: a forged membership costs a subscription, nothing more;
- a member that left keeps its subscription for ``grace_s``, so its last answers are seen
  before the shard's new owner decides what to republish;
- a member whose statuses overflow its rate (peers.py's ``flooding``) is unsubscribed for a
  cool-off: ``cool_off_s``, doubled at each flood that follows a resubscription within
  ``cool_off_max_s``, at most ``cool_off_max_s``. Meanwhile Answers treats each of its
  answers as possibly delivered (:meth:`Answers.not_reading`): republished, they are marked
  ``redelivery``; after the cool-off it is subscribed again.

Owned by the event loop: membership and floods arrive as posted events, the cool-off and
grace ends as loop timers. The link keeps the set across reconnects (agent/cloud/mqtt.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

from agent.runtime.metrics import counter, gauge

from .link import Link
from .topics import ID_RE, Topics

log = logging.getLogger(__name__)

PEER_SUBSCRIPTIONS = gauge("millwright_mqtt_peer_subscriptions", "Peers whose statuses this agent subscribes to")
PEER_COOL_OFFS = counter("millwright_mqtt_peer_cool_offs_total",
                         "Times a peer's statuses were unsubscribed for flooding")

MAX_PEERS = 1024
GRACE_S = 120.0          # > answers' republish_after_s (30 s+): a takeover decides within it
COOL_OFF_S = 10.0
COOL_OFF_MAX_S = 300.0


class PeerSubscriptions:
    """The set of peers whose statuses the link subscribes to (loop thread only)."""

    def __init__(self, topics: Topics, link: Link, me: str, *, reading: Callable[[str], None],
                 not_reading: Callable[[str], None], call_later: Callable[..., Any],
                 record: Callable[..., None] = lambda *a, **k: None, max_peers: int = MAX_PEERS,
                 grace_s: float = GRACE_S, cool_off_s: float = COOL_OFF_S, cool_off_max_s: float = COOL_OFF_MAX_S,
                 clock: Callable[[], float] = time.monotonic):
        self.topics = topics
        self.link = link
        self.me = me
        self.reading = reading
        self.not_reading = not_reading
        self.call_later = call_later
        self.record = record
        self.max_peers = max_peers
        self.grace_s = grace_s
        self.cool_off_s, self.cool_off_max_s = cool_off_s, cool_off_max_s
        self.clock = clock
        self.members: frozenset[str] = frozenset({me})
        self.departed: dict[str, float] = {}      # a member that left -> until when it is still read
        self.cooling: dict[str, float] = {}       # a flooding peer -> until when it is not read
        self.strikes: dict[str, tuple[int, float]] = {}  # peer -> (floods in a row, last resubscribed at)
        self.subscribed: set[str] = set()
        self.snapshot: frozenset[str] = frozenset()   # ``subscribed`` for other threads (peers.py)

    def topic(self, agent: str) -> str:
        return self.topics.agent_prefix(agent) + "status/+"

    def wanted(self) -> set[str]:
        """Members and recently departed members not cooling off, at most ``max_peers``
        (this agent first, then by name)."""
        candidates = sorted((self.members | set(self.departed)) - set(self.cooling) - {self.me})
        return ({self.me} - set(self.cooling)) | set(candidates[:max(0, self.max_peers - 1)])

    def start(self) -> None:
        self._apply()

    def members_changed(self, members: Iterable[str]) -> None:
        """The members/ view changed: subscribe to newcomers, keep the departed for grace_s."""
        now = self.clock()
        new = frozenset(m for m in members if ID_RE.fullmatch(m)) | {self.me}
        for agent in self.members - new:
            self.departed[agent] = now + self.grace_s
            self.call_later(self.grace_s, self._grace_over, agent)
        for agent in new:
            self.departed.pop(agent, None)
        self.members = new
        self._apply()

    def flooding(self, agent: str) -> None:
        """peers.py: ``agent``'s statuses overflow its rate: not read for a cool-off."""
        if agent not in self.subscribed:
            self.stray(agent)
            return
        if agent in self.cooling:
            return
        now = self.clock()
        n, resubscribed = self.strikes.get(agent, (0, now))
        n = n + 1 if now - resubscribed < self.cool_off_max_s else 1
        wait = min(self.cool_off_max_s, self.cool_off_s * 2 ** (n - 1))
        self.strikes[agent] = (n, now + wait)
        self.cooling[agent] = now + wait
        PEER_COOL_OFFS.inc()
        log.warning("a peer floods its statuses: not reading them for a while",
                    extra={"fields": {"agent": agent, "cool_off_s": wait}})
        self.record("mqtt", event="peer_statuses_unsubscribed", agent=agent, cool_off_s=wait)
        self.call_later(wait, self._cooled, agent)
        self._apply()

    def stray(self, agent: str) -> None:
        """peers.py: a status of ``agent`` arrived although it was not in the set (peers.py
        read the set's snapshot): unsubscribe again, unless the set took it in meanwhile."""
        if not ID_RE.fullmatch(agent):
            return
        if agent not in self.subscribed:
            self.link.unsubscribe(self.topic(agent))

    def _cooled(self, agent: str) -> None:
        if self.cooling.get(agent, float("inf")) <= self.clock() + 1e-6:
            del self.cooling[agent]
            self._apply()

    def _grace_over(self, agent: str) -> None:
        until = self.departed.get(agent)
        if until is not None and until <= self.clock() + 1e-6:
            del self.departed[agent]
            self._apply()

    def _apply(self) -> None:
        wanted = self.wanted()
        self.snapshot = frozenset(wanted)   # before the SUBSCRIBEs: what they bring is wanted
        for agent in sorted(self.subscribed - wanted):
            self.link.unsubscribe(self.topic(agent))
            self.not_reading(agent)
        for agent in sorted(wanted - self.subscribed):
            self.reading(agent)   # before the SUBSCRIBE: nothing of it read earlier counts
            self.link.subscribe(self.topic(agent), 1)
        self.subscribed = wanted
        for agent in [a for a in self.strikes if a not in self.members and a not in self.departed]:
            del self.strikes[agent]
        PEER_SUBSCRIPTIONS.set(len(wanted))
