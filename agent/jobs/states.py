"""The contract's vocabularies of a run: the states a run record and a status carry, and
the reasons a run ends with. Members are ``str``: they compare equal to the JSON strings
and serialise as them, so the documents on the wire do not change."""

from __future__ import annotations

import enum


class Word(str, enum.Enum):
    """A member prints as its value (``f"{state}"`` is ``running``), on every Python."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class RecordState(Word):
    """``state`` of a run record (runs/<shard>/<job>/<fire_id>) and of a run's status."""

    RUNNING = "running"        # claimed under the shard's fence; the process may be alive
    RETRYING = "retrying"      # an attempt ended; the next one is timed (retry_at)
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    KILLED = "killed"
    CANCELLED = "cancelled"
    MISFIRED = "misfired"
    ABORTED = "aborted"        # a staged rollout was aborted before this agent's firing ran


class JobState(Word):
    """States a status document may carry besides a run's (docs/contract.md: MQTT topics)."""

    ACCEPTED = "accepted"
    REJECTED = "rejected"
    SCHEDULED = "scheduled"
    WAITING = "waiting"
    WAITING_APPROVAL = "waiting_approval"   # stored; runs once its template's approvals are there
    IN_PROGRESS = "in_progress"   # a running attempt's newest progress line (rate-limited)


# after these nothing more happens to a firing
TERMINAL = frozenset({RecordState.SUCCEEDED, RecordState.FAILED, RecordState.TIMED_OUT, RecordState.KILLED,
                      RecordState.CANCELLED, RecordState.MISFIRED, RecordState.ABORTED})
# a record in one of these is a firing still in progress (a live run, or a retry to come)
IN_PROGRESS = frozenset({RecordState.RUNNING, RecordState.RETRYING})


class EndReason(Word):
    """Why a run ended: the executor's reasons, and those the scheduler adds."""

    # the executor's (agent/execute/runs.py REASONS)
    SUCCEEDED = "succeeded"
    FAILED = "failed"            # non-zero exit
    TIMED_OUT = "timed_out"
    KILLED = "killed"
    OOM = "oom"
    PIDS_LIMIT = "pids_limit"
    SPAWN_ERROR = "spawn_error"
    # asked for by the agent (RunHandle.terminate)
    CANCELLED = "cancelled"
    REPLACED = "replaced"        # overlap: replace
    EXEC_POLICY = "exec_policy"
    NETWORK_STALL = "network_stall"
    AGENT_STOPPED = "agent_stopped"
    ABORTED = "aborted"          # its staged rollout was aborted (abort_action: stop)
    # the run's lease or shard went: the next owner resolves its record
    FENCED = "fenced"
    SHARD_LOST = "shard_lost"
    RELEASED = "released"
    DELETED = "deleted"
    KEY_RETIRED = "key_retired"
    FINISHED = "finished"        # retention replaced the job by its tombstone
    # decided by an owner about a run it did not see end
    OWNER_LOST = "owner_lost"
    # the plant's rules (windows, gates, progress: docs/jobs.md)
    WINDOW_CLOSED = "window_closed"      # its window ended (end: stop | cancel)
    GATE_CLOSED = "gate_closed"          # its template's gate closed (while_running: stop)
    STEP_TIMED_OUT = "step_timed_out"    # no progress line for step_timeout_s
    GATE_TIMEOUT = "gate_timeout"        # it waited gate_timeout_s for its gates: never ran
