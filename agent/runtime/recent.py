"""A bounded memory of recently seen keys (with a value each).

The agent runs for months; every "have I seen this already?" memory it keeps (answers the
broker delivered, job ids the jobs/ watch reported, stored documents already refused)
must stop growing. A RecentMemory keeps at most ``limit`` keys and forgets the one
remembered longest ago: forgetting only costs a repeated report or a re-check in etcd,
never a wrong answer, which is why these memories may be lossy. Not thread-safe: callers
that share one across threads hold their own lock (they already do, for related state).
"""

from __future__ import annotations

import collections
from typing import Generic, Hashable, Optional, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class RecentMemory(Generic[K, V]):
    """At most ``limit`` keys; remembering a key again makes it the newest."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        self.limit = limit
        self.forgotten = 0  # keys evicted by the bound, over the memory's life
        self._d: "collections.OrderedDict[K, V]" = collections.OrderedDict()

    def remember(self, key: K, value: V) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.limit:
            self._d.popitem(last=False)
            self.forgotten += 1

    def get(self, key: K, default: Optional[V] = None) -> Optional[V]:
        return self._d.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def __getitem__(self, key: K) -> V:
        return self._d[key]

    def __len__(self) -> int:
        return len(self._d)
