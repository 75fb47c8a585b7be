"""What the jobs package needs from the rest of the agent, each as a narrow Protocol.

The daemon's Ownership, Session and Placement, its audit log and status hooks, and the
Executor implement these structurally; agent/daemon/wiring.py passes them in. A unit test
gives small fakes of exactly these and needs no etcd."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

if TYPE_CHECKING:
    from agent.coordination.fencing import Fence
    from agent.execute.launch import Staged
    from agent.execute.limits import Limits
    from agent.execute.runs import RunHandle, RunResult, RunSpec


class Fencing(Protocol):
    """Which units (cluster or pool shards) this agent may act for (coordination.ownership.Ownership)."""

    def fence_for(self, unit: int) -> Optional[Fence]:
        """The unit's fence if this agent may write for it now (held and session valid)."""

    def owns(self, unit: int) -> Optional[Fence]:
        """The unit's fence while held and not being released (session not checked)."""

    def held(self, unit: int) -> Optional[Fence]:
        """The unit's fence while held, also while it is being released."""

    def release_idle(self) -> None:
        """Units waiting to move may go now (their runs and record writes ended)."""

    def waiting_on_runs(self) -> bool:
        """Whether a unit waits for its runs and record writes before it moves."""


class Lease(Protocol):
    """The session lease runs are claimed under (agent/coordination/session.py)."""

    lease_id: Optional[int]
    valid_until: float   # monotonic time its local validity ends

    def is_valid(self) -> bool: ...


class Units(Protocol):
    """Placement: which unit a job belongs to (agent/coordination/pools.py)."""

    def pool_of_unit(self, unit: int) -> str: ...

    def unit_of(self, pool: str, storage: int) -> Optional[int]: ...


class StatusSink(Protocol):
    """Where job status documents go (the cloud's outbox)."""

    def publish_status(self, doc: dict) -> None: ...


class AuditSink(Protocol):
    """The tamper-evident audit log."""

    def record(self, type_: str, **fields: Any) -> None: ...


OnExit = Callable[["RunHandle", "RunResult"], None]     # the run ended: the reaper's thread
OnRelease = Callable[["RunHandle", bool], None]         # (handle, released): the release thread
OnProgress = Callable[["RunHandle", list], None]        # (handle, new valid progress lines): the reaper's thread


class RunStarter(Protocol):
    """The executor: makes a claimed run's directories and quota container, prepares its
    process to be released at its due time, or starts it now."""

    default_limits: Limits

    def stage(self, spec: RunSpec) -> Staged: ...

    def unstage(self, staged: Staged) -> None: ...

    def prepare(self, spec: RunSpec, on_exit: OnExit, *, release_at: float, on_release: OnRelease,
                guard: Callable[[], bool], guard_until: float, staged: Optional[Staged] = None,
                on_progress: Optional[OnProgress] = None) -> RunHandle: ...

    def start(self, spec: RunSpec, on_exit: OnExit, *, guard: Callable[[], bool], staged: Optional[Staged] = None,
              on_progress: Optional[OnProgress] = None) -> RunHandle: ...
