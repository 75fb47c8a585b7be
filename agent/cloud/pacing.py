"""Pacing one connection's PUBLISH requests to its broker's rate (``publish_rate``).

A broker such as AWS IoT Core refuses (or throttles and then disconnects) a connection that
sends more than ``publish_rate`` PUBLISH requests in any second. A token bucket does not
keep that: it allows its rate plus its burst within a second. :class:`Pacer` keeps a
sliding log of the times of the last PUBLISHes and grants a slot only while fewer than
``cap = floor(0.95 × publish_rate)`` were taken in the last second, so no window of one
second, wherever it starts, ever holds more than ``cap`` (the 5 % leave room for the
jitter between our send and the broker's count). A backlog is also spread over the second,
at most ``ceil(cap / 10)`` slots in any tenth of a second, instead of the whole cap at its
start: a send the client library's thread delays then shifts a few messages, not a burst,
into the next second.

Every PUBLISH of the connection takes a slot: :class:`PacedLink` wraps the link and takes
it in ``publish``/``publish_wait``, classed by topic:
- presence comes first: it never shares the others' slots (they leave ``reserve`` of the cap
  free for it), and it only waits in the pathological case of more than ``reserve``
  presences in one second over a full log;
- jobs/get replies take at most ``get_share`` (20 %) of the cap in any second, so a flood of
  queries never holds the statuses back;
- everything else (statuses, rejections, republished answers, audit checkpoints) takes the rest.
The outbox publisher asks :meth:`Pacer.room` before it takes rows, so its publishes never
wait; a caller that finds no room waits in ``publish`` for the oldest slot to leave the
window (at most a second). With no ``publish_rate`` there is no pacer and no wrapper
(:func:`paced`): nothing is counted and nothing waits.

What the client library sends again by itself (the QoS 1 messages in flight at a
reconnect) cannot wait: the outbox publisher charges its in-flight rows to the pacer when
it sees the link back (:meth:`Pacer.charge`), and its window on a paced link is at most
what the others may take in a second, so that burst alone never passes the cap.
"""

from __future__ import annotations

import bisect
import collections
import math
import threading
import time
from typing import Callable, Optional

from agent.runtime.metrics import counter

from .link import Link, Message, MessageProps

PACED = counter("millwright_mqtt_paced_total", "PUBLISH requests that waited for the broker's rate, by kind",
                ("kind",))

CAP_FRACTION = 0.95      # of publish_rate: the cap in any one second
GET_SHARE = 0.2          # of the cap: jobs/get replies in any one second
PRESENCE_RESERVE = 2     # slots of the cap the others leave free for presence
WINDOW_S = 1.0
BURST_WINDOW_S = 0.1     # ... and at most a tenth of the cap in any tenth of a second
KINDS = ("presence", "get", "status")


def cap_for(rate: float) -> int:
    """PUBLISH requests allowed in any second at ``rate`` per second (at least 1)."""
    return max(1, math.floor(CAP_FRACTION * rate + 1e-9))


class Pacer:
    """A sliding one-second log of PUBLISH times; thread-safe. ``clock`` and ``sleep`` are
    the monotonic clock and the wait (a test gives fake ones)."""

    def __init__(self, rate: float, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, get_share: float = GET_SHARE,
                 reserve: int = PRESENCE_RESERVE):
        if not rate > 0:
            raise ValueError(f"publish rate {rate!r}: expected a number greater than 0")
        self.rate = float(rate)
        self.cap = cap_for(rate)
        self.reserve = min(reserve, self.cap // 10)            # nothing reserved below a cap of 10
        self.get_cap = max(1, math.floor(get_share * self.cap + 1e-9))
        self.burst = max(1, math.ceil(self.cap * BURST_WINDOW_S))
        self.clock = clock
        self.sleep = sleep
        self._lock = threading.Lock()
        self._all: collections.deque[float] = collections.deque()    # every slot in the window
        self._gets: collections.deque[float] = collections.deque()   # the get replies' among them
        self.taken = dict.fromkeys(KINDS, 0)

    def _prune(self, now: float) -> None:
        """Forget slots a second old: a slot at t counts for every window holding t, i.e.
        while now - t < 1 (so the boundary is on the safe side)."""
        edge = now - WINDOW_S
        for log in (self._all, self._gets):
            while log and log[0] <= edge:
                log.popleft()

    def _recent(self, now: float) -> int:
        """Slots taken in the last BURST_WINDOW_S."""
        return len(self._all) - bisect.bisect_right(self._all, now - BURST_WINDOW_S)

    def _room(self, kind: str, now: float) -> int:
        if kind == "presence":
            return self.cap - len(self._all)
        room = min(self.cap - self.reserve - len(self._all), self.burst - self._recent(now))
        if kind == "get":
            room = min(room, self.get_cap - len(self._gets))
        return max(0, room)

    def room(self, kind: str = "status") -> int:
        """Slots ``kind`` may take now (the outbox publisher asks before it takes rows)."""
        with self._lock:
            now = self.clock()
            self._prune(now)
            return self._room(kind, now)

    def free_in(self, kind: str = "status") -> float:
        """Seconds until ``kind`` has room again (0 when it has some now)."""
        with self._lock:
            now = self.clock()
            self._prune(now)
            return self._free_in(kind, now)

    def _free_in(self, kind: str, now: float) -> float:
        if self._room(kind, now) > 0:
            return 0.0
        # the room comes back when enough of the oldest slots leave the window
        # (each rule only relaxes as time passes: the room is back when the last one is kept)
        need = len(self._all) - (self.cap - (0 if kind == "presence" else self.reserve)) + 1
        t = self._all[need - 1] + WINDOW_S if need > 0 else now
        if kind != "presence" and self._recent(now) >= self.burst:
            t = max(t, self._all[len(self._all) - self.burst] + BURST_WINDOW_S)
        if kind == "get" and len(self._gets) >= self.get_cap:
            t = max(t, self._gets[len(self._gets) - self.get_cap] + WINDOW_S)
        return max(0.0, t - now)

    def try_take(self, kind: str = "status") -> bool:
        """Take one slot now if ``kind`` has room."""
        with self._lock:
            now = self.clock()
            self._prune(now)
            if self._room(kind, now) <= 0:
                return False
            self._all.append(now)
            if kind == "get":
                self._gets.append(now)
            self.taken[kind] += 1
            return True

    def charge(self, n: int, kind: str = "status") -> None:
        """Count ``n`` PUBLISHes sent without asking (what the client library sends again at
        a reconnect): the log may go over the cap, and nothing else is granted until it is
        back under."""
        if n <= 0:
            return
        with self._lock:
            now = self.clock()
            self._prune(now)
            self._all.extend([now] * n)
            if kind == "get":
                self._gets.extend([now] * n)
            self.taken[kind] += n

    def take(self, kind: str = "status") -> None:
        """Take one slot, waiting for it if there is no room now."""
        waited = False
        while True:
            with self._lock:
                now = self.clock()
                self._prune(now)
                if self._room(kind, now) > 0:
                    self._all.append(now)
                    if kind == "get":
                        self._gets.append(now)
                    self.taken[kind] += 1
                    return
                delay = self._free_in(kind, now)
            if not waited:
                PACED.labels(kind).inc()
                waited = True
            self.sleep(max(delay, 0.0005))


class PacedLink:
    """A :class:`~agent.cloud.link.Link` whose PUBLISHes each take a slot of ``pacer``
    first; ``kind_of(topic)`` names the topic's kind (agent/cloud/topics.py ``Topics.kind``:
    ``presence`` and ``get_reply`` are paced as such, the rest as statuses)."""

    def __init__(self, link: Link, pacer: Pacer, kind_of: Callable[[str], str]):
        self.inner = link
        self.pacer = pacer
        self.kind_of = kind_of
        self.host = link.host
        self.port = link.port
        self.client_id = link.client_id
        self.deferred_ack = link.deferred_ack
        self.protocol = link.protocol

    def _kind(self, topic: str) -> str:
        kind = self.kind_of(topic)
        return kind if kind == "presence" else "get" if kind == "get_reply" else "status"

    # the paced requests
    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                props: Optional[MessageProps] = None) -> tuple[int, int]:
        self.pacer.take(self._kind(topic))
        return self.inner.publish(topic, payload, qos, retain, props=props)

    def publish_wait(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                     timeout: float = 2.0, props: Optional[MessageProps] = None) -> bool:
        self.pacer.take(self._kind(topic))
        return self.inner.publish_wait(topic, payload, qos, retain, timeout=timeout, props=props)

    # the rest is the link's (what never changes is copied; the state is read through)
    @property
    def connected(self) -> bool:
        return self.inner.connected

    @connected.setter
    def connected(self, value: bool) -> None:
        self.inner.connected = value

    @property
    def session_present(self) -> Optional[bool]:
        return self.inner.session_present

    @session_present.setter
    def session_present(self, value: Optional[bool]) -> None:
        self.inner.session_present = value

    @property
    def session_lost(self) -> bool:
        return self.inner.session_lost

    @session_lost.setter
    def session_lost(self, value: bool) -> None:
        self.inner.session_lost = value

    def start(self) -> "PacedLink":
        self.inner.start()
        return self

    def wait_connected(self, timeout: float) -> bool:
        return self.inner.wait_connected(timeout)

    def stop(self, timeout: float = 2.0) -> None:
        self.inner.stop(timeout)

    def ack(self, msg: Message) -> bool:
        return self.inner.ack(msg)

    def subscribe(self, topic: str, qos: int = 1) -> None:
        self.inner.subscribe(topic, qos)

    def unsubscribe(self, topic: str) -> None:
        self.inner.unsubscribe(topic)


def paced(link: Link, rate: Optional[float], kind_of: Callable[[str], str]) -> tuple[Link, Optional[Pacer]]:
    """``link`` paced to ``rate`` PUBLISH requests per second, and its pacer; with no rate
    (the mosquitto profile) the link itself and None: no wrapper, no cost."""
    if rate is None:
        return link, None
    pacer = Pacer(rate)
    return PacedLink(link, pacer, kind_of), pacer
