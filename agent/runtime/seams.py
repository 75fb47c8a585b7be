"""The seams the daemon calls parts through: a part implements these and the wiring
registers it; no part needs the daemon itself."""

from __future__ import annotations

from typing import Protocol

from agent.coordination.fencing import Fence


class Component(Protocol):
    """A part the daemon runs: started in order after construction, stopped in reverse."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


class ShardListener(Protocol):
    """Told when this agent starts or stops acting for a shard (loop thread)."""

    def shard_acquired(self, fence: Fence) -> None: ...

    def shard_lost(self, shard: int, reason: str) -> None: ...


class SessionListener(Protocol):
    """Told of every keepalive outcome of the session lease (loop thread): the lease policy."""

    def session_granted(self) -> None: ...

    def session_renewed(self, latency: float) -> None: ...

    def session_failed(self, error: str) -> None: ...
