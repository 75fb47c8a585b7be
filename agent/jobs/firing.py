"""A firing: one due time of one job, from due to its final run record.

The scheduler owns every Firing and changes its state only through ``Firing.move``, so
the life of a firing reads from one table (``TRANSITIONS``). The run-record and status
states that the cloud sees (``TERMINAL``, ``RETRYABLE``) are the contract's; the firing
states are the scheduler's own bookkeeping and never leave the agent.
"""

from __future__ import annotations

import enum
import itertools
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:
    from agent.jobs.scheduler import JobEntry

log = logging.getLogger(__name__)

# run-record / status states after which nothing more happens to a firing (README contract)
TERMINAL = frozenset({"succeeded", "failed", "timed_out", "killed", "cancelled", "misfired"})
# final states the job's retry policy may turn into another attempt
RETRYABLE = frozenset({"failed", "timed_out"})


class FiringState(enum.Enum):
    PENDING = "pending"                        # created, not yet asked for admission
    HELD = "held"                              # fell due while new runs are paused (early fence)
    WAITING = "waiting"                        # for its dependencies or for node quota
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
    S.WAITING: frozenset({S.WAITING, S.HELD, S.CLAIMING, S.FINISHING, S.DONE}),
    S.CLAIMING: frozenset({S.CLAIMING, S.RUNNING, S.FINISHING, S.DONE}),
    S.RUNNING: frozenset({S.RETRYING, S.DONE}),
    S.RETRYING: frozenset({S.CLAIMING, S.RETRYING_ADMISSION, S.FINISHING, S.DONE}),
    S.RETRYING_ADMISSION: frozenset({S.CLAIMING, S.FINISHING, S.DONE}),
    S.FINISHING: frozenset({S.FINISHING, S.DONE}),
    S.DONE: frozenset(),
}
ACTIVE = frozenset({S.CLAIMING, S.RUNNING, S.FINISHING})  # a shard with such a firing is busy (a record to write)
NOT_STARTED = frozenset({S.PENDING, S.HELD, S.WAITING, S.RETRYING, S.RETRYING_ADMISSION})  # a cancel ends these

_SEQ = itertools.count(1)


@dataclass
class Firing:
    entry: "JobEntry"
    due: datetime
    fire_id: str
    attempt: int = 1
    record: Optional[dict] = None
    record_rev: int = 0      # mod revision of the run record we last wrote
    handle: Any = None
    timer: Any = None
    wait_reason: Optional[str] = None
    started_mono: float = 0.0
    health: str = "healthy"
    lead: float = 0.0        # how far ahead of `due` its claim was planned (0: at or after due)
    writing: int = 0         # record writes in flight: a retry's claim compares the revision they set
    limits: Any = None       # the limits admission let in, which the run then gets
    run: Any = None          # (RunSpec, argv, template) of this attempt, or why it cannot start
    staged: Any = None       # its directories and quota container, made with the claim (Executor.stage)
    unsure: tuple = ()       # records of its earlier claims whose outcome was unknown (a few)
    seq: int = field(default_factory=lambda: next(_SEQ))
    state: FiringState = field(default=FiringState.PENDING, init=False)

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


class RunListener(Protocol):
    """Told of each run the scheduler starts and ends (exec policy, sensor attribution).
    Called on the loop thread; run_started comes before the process can exec."""

    def run_started(self, firing: Firing) -> None: ...

    def run_ended(self, firing: Firing) -> None: ...
