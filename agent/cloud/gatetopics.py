"""The production gates' MQTT topics (agent/jobs/gates.py): the last value the broker gave
for each, kept from the cloud component's link (implements jobs.gatesources.TopicValues).

The topics are the templates' (local config); the component subscribes to them with its
own subscriptions (QoS 1), so a retained value arrives with every (re)connect. While the
link is down every value is unknown: a gate never opens on a value that may be stale."""

from __future__ import annotations

import logging
import threading
from typing import Callable, Iterable, Optional

log = logging.getLogger(__name__)


class RetainedTopics:
    def __init__(self, topics: Iterable[str]):
        self.topics = frozenset(topics)
        self._values: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._listeners: list[Callable[[str], None]] = []

    def __contains__(self, topic: str) -> bool:
        return topic in self.topics

    def value(self, topic: str) -> Optional[bytes]:
        with self._lock:
            return self._values.get(topic)

    def listen(self, fn: Callable[[str], None]) -> None:
        self._listeners.append(fn)

    def saw(self, topic: str, payload: bytes) -> None:
        """A message on a gate topic (the link's thread); an empty payload clears it."""
        with self._lock:
            before = self._values.get(topic)
            if payload:
                self._values[topic] = payload
            else:
                self._values.pop(topic, None)
        if before != (payload or None):
            self._notify([topic])

    def link_down(self) -> None:
        """The broker is unreachable: every value is unknown until it sends them again."""
        with self._lock:
            gone, self._values = list(self._values), {}
        self._notify(gone)

    def _notify(self, topics: list[str]) -> None:
        for t in topics:
            for fn in self._listeners:
                try:
                    fn(t)
                except Exception:
                    log.exception("gate topic listener failed")
