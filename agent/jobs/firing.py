"""A firing: one due time of one job, from due to its final run record.

The scheduler owns every Firing and changes its state only through ``Firing.move``, so
the life of a firing reads from one table (``TRANSITIONS``); a firing that is DONE says why
(``FiringEnd``). The run-record and status states the cloud sees are the contract's
(agent/jobs/states.py); the firing states are the scheduler's own bookkeeping and never
leave the agent.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Optional, Protocol, Union

from agent.jobs.states import TERMINAL, Word

if TYPE_CHECKING:
    from agent.execute.launch import Staged
    from agent.execute.runs import RunHandle
    from agent.jobs.catalog import JobEntry
    from agent.jobs.launching import Planned
    from agent.jobs.progress import Reported

log = logging.getLogger(__name__)

__all__ = ["TERMINAL", "FiringState", "FiringEnd", "ClaimState", "Firing", "RunListener", "TRANSITIONS",
           "ACTIVE", "NOT_STARTED"]


class FiringState(enum.Enum):
    PENDING = "pending"                        # created, not yet asked for admission
    HELD = "held"                              # fell due while new runs are paused (early fence)
    WAITING = "waiting"                        # for its dependencies, node quota or a start policy
    CLAIMING = "claiming"                      # its run record is being written (fenced)
    RUNNING = "running"                        # process prepared or running
    RETRYING = "retrying"                      # attempt failed; the next one is timed
    RETRYING_ADMISSION = "retrying_admission"  # the next attempt waits for node quota
    FINISHING = "finishing"                    # will not run; its record waits out a lapsed session
    DONE = "done"                              # final record written, or given up to the next owner


S = FiringState
TRANSITIONS: dict[FiringState, frozenset[FiringState]] = {
    S.PENDING: frozenset({S.HELD, S.WAITING, S.CLAIMING, S.RETRYING, S.FINISHING, S.DONE}),
    S.HELD: frozenset({S.WAITING, S.CLAIMING, S.FINISHING, S.DONE}),
    S.WAITING: frozenset({S.WAITING, S.HELD, S.CLAIMING, S.RETRYING_ADMISSION, S.FINISHING, S.DONE}),
    S.CLAIMING: frozenset({S.CLAIMING, S.RUNNING, S.FINISHING, S.DONE}),
    S.RUNNING: frozenset({S.RETRYING, S.DONE}),
    S.RETRYING: frozenset({S.WAITING, S.CLAIMING, S.RETRYING_ADMISSION, S.FINISHING, S.DONE}),
    S.RETRYING_ADMISSION: frozenset({S.WAITING, S.CLAIMING, S.FINISHING, S.DONE}),
    S.FINISHING: frozenset({S.FINISHING, S.DONE}),
    S.DONE: frozenset(),
}
ACTIVE = frozenset({S.CLAIMING, S.RUNNING, S.FINISHING})  # a shard with such a firing is busy (a record to write)
NOT_STARTED = frozenset({S.PENDING, S.HELD, S.WAITING, S.RETRYING, S.RETRYING_ADMISSION})  # a cancel ends these



class FiringEnd(Word):
    """Why a firing is DONE (the ``abandoned`` ones leave no record of this agent's)."""

    RECORDED = "recorded"                  # its final record was written (or is being)
    HANDED_OVER = "handed_over"            # its run ended with the shard: the next owner resolves it
    DROPPED = "dropped"                    # its job's entry went (shard lost, job deleted) before it ran
    NOT_OWNER = "not_owner"                # no fence, and the shard is not held
    ALREADY_CLAIMED = "already_claimed"    # a record it may not replace holds its key
    SHARD_LOST = "shard_lost"              # the shard went while it was claiming
    FENCED = "fenced"                      # the fence went between its claim and its spawn
    RETRY_CLAIM_FAILED = "retry_claim_failed"  # its record is not the one its retry expected


@dataclass
class ClaimState:
    """What this agent knows of the firing's run record: the claim and every later write
    compare against ``rev``."""

    record: Optional[dict] = None   # the record as last written or read back
    rev: int = 0                    # its mod revision (0: no record of ours)
    writing: int = 0                # writes in flight: a retry's claim waits for the revision they set
    soft: bool = False              # the write in flight is a progress update: a write that comes waits for it
    after: list = field(default_factory=list)   # writes waiting for that progress update
    unsure: tuple = ()              # records of earlier claims whose outcome was unknown (a few)
    taken_over: bool = False        # its claim replaced a foreign record (once at most)


_SEQ = itertools.count(1)


@dataclass
class Firing:
    entry: "JobEntry"
    due: datetime
    fire_id: str
    attempt: int = 1
    claim: ClaimState = field(default_factory=ClaimState)
    handle: Optional[RunHandle] = None
    timer: Any = None
    wait_reason: Optional[str] = None
    started_mono: float = 0.0
    ready_mono: float = 0.0  # when its start became the agent's own work: the later of its due time and its admission request
    health: str = "healthy"
    end_reason: Optional[str] = None   # why its last run ended: set before the RunListeners hear of the end
    lead: float = 0.0        # how far ahead of `due` its claim was planned (0: at or after due)
    limits: Any = None       # the limits admission let in, which the run then gets
    run: Union[Planned, str, None] = None   # this attempt's run (spec, argv, user), or why it cannot start
    staged: Optional[Staged] = None   # its directories and quota container, made with the claim (Executor.stage)
    rollback: bool = False   # runs the template's rollback after an aborted rollout (never retried)
    notes: dict = field(default_factory=dict)   # start policies' own notes (since when it waits on a gate)
    progress: Optional[Reported] = None   # its running attempt's progress reports (agent/jobs/progress.py)
    seq: int = field(default_factory=lambda: next(_SEQ))
    state: FiringState = field(default=FiringState.PENDING, init=False)
    ended: Optional[FiringEnd] = field(default=None, init=False)

    @property
    def key(self) -> str:
        """Admission key: unique per Firing object, so a firing re-installed after a shard
        came back never collides with the old one still being stopped."""
        return f"{self.entry.job.id}/{self.fire_id}#{self.seq}"

    def move(self, to: FiringState, wait_reason: Optional[str] = None) -> None:
        """The one way a firing changes state. A move the table does not list is logged
        (a scheduler bug to fix), never refused: refusing would strand the firing."""
        if to not in TRANSITIONS[self.state]:
            log.error("firing moved outside its state table", extra={"fields": {
                "job": self.entry.job.id, "fire_id": self.fire_id, "from": self.state.value, "to": to.value}})
        self.state = to
        if wait_reason is not None:
            self.wait_reason = wait_reason

    def mark_ready(self) -> None:
        """When it first asks for admission (or, without, its first claim): from here on
        only the agent's own queues (admission, claims, spawns) delay its start."""
        if not self.ready_mono:
            now = time.monotonic()
            self.ready_mono = now + max(0.0, self.due.timestamp() - time.time())

    def unmark_ready(self) -> None:
        """Back at its start policies: their wait (a window closed before its claim) is not
        the agent's own delay; its next admission request marks it again."""
        self.ready_mono = 0.0

    def finish(self, why: FiringEnd) -> None:
        """DONE, saying why."""
        self.move(FiringState.DONE)
        self.ended = why


class RunListener(Protocol):
    """Told of each run the scheduler starts and ends (exec policy, sensor attribution).
    Called on the loop thread; run_started comes before the process can exec."""

    def run_started(self, firing: Firing) -> None: ...

    def run_ended(self, firing: Firing) -> None: ...
