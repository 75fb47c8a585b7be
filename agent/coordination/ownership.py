"""Which units (cluster shards and pool shards) this agent may act for now: the one
answer jobs, retention, compaction and the cloud channel ask, instead of asking the daemon.

The loop thread owns the live state (the shard manager's and the placement's tables);
``owned`` is a snapshot any thread may read, replaced on the loop thread each time a unit
is acquired or lost (``changed``).
"""

from __future__ import annotations

from typing import Optional

from agent.coordination.fencing import Fence
from agent.coordination.pools import Placement
from agent.coordination.session import Session
from agent.coordination.shards import ShardManager


class Ownership:
    """Implements jobs.seams.Fencing for every part that writes under a shard's fence."""

    def __init__(self, session: Session, shards: ShardManager, placement: Placement):
        self._session = session
        self._shards = shards
        self._placement = placement
        self._owned: frozenset[int] = frozenset()

    # --- loop thread ----------------------------------------------------------------------
    def fence_for(self, unit: int) -> Optional[Fence]:
        """The unit's fence if this agent may write for it now (held, not being released,
        session valid)."""
        if not self._session.is_valid():
            return None
        return self._placement.owns(unit)

    def owns(self, unit: int) -> Optional[Fence]:
        """The unit's fence while held and not being released (session not checked)."""
        return self._placement.owns(unit)

    def held(self, unit: int) -> Optional[Fence]:
        """The unit's fence while held, also while it is being released."""
        return self._placement.held(unit)

    def units(self) -> list[int]:
        """Every unit held (cluster and pool shards): what a drain or a shutdown waits on."""
        return self._placement.units()

    def release_idle(self) -> None:
        """Runs ended: units waiting to move may go now."""
        self._shards.release_idle()

    def waiting_on_runs(self) -> bool:
        return self._shards.waiting_on_runs()

    def changed(self) -> None:
        """A unit was acquired or lost (the daemon calls it first, on the loop thread)."""
        self._owned = frozenset(self._shards.mine)

    # --- any thread -----------------------------------------------------------------------
    @property
    def owned(self) -> frozenset[int]:
        """The cluster shards held, as of the last change: a snapshot for other threads."""
        return self._owned

    def fence_snapshot(self, shard: int) -> Optional[Fence]:
        """The cluster shard's fence if held as of the last change (ingest threads)."""
        if shard not in self._owned:
            return None
        return self._shards.mine.get(shard)
