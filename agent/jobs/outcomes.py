"""What a run's end means: the record state an end reason gives, which retry criterion
(``retry.on``) it falls under, and whether another attempt follows. Pure: no etcd, no
loop, the clock passed in; the scheduler asks, then writes what it is told.

A new retry criterion is a new name in ``RETRY_ON`` (what a document's retry.on may list)
and a line in ``criterion`` (which run ends it covers), both here."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Optional

from agent.jobs import schedule as sch
from agent.jobs.states import EndReason as R
from agent.jobs.states import RecordState as S
from agent.runtime.timefmt import format_rfc3339

if TYPE_CHECKING:
    from agent.execute.runs import RunResult
    from agent.jobs.schedule import JobDocument

# a run that ended for one of these is left to the shard's next owner: this agent may no
# longer write for the shard, and the new owner resolves its record (owner_lost)
HANDED_OVER = frozenset({R.FENCED, R.SHARD_LOST, R.RELEASED, R.DELETED})

# What a retry may be asked for (retry.on): a run that failed (non-zero exit, oom,
# pids_limit, network_stall, spawn_error), that timed out (timeout_s, step_timeout_s), or
# whose outcome is unknown because its agent died, fenced itself or was cut off
# (owner_lost: it may have run); and a run the plant's rules stopped part way: its window
# ended (window_closed: the retry waits for the next window) or its gate closed
# (gate_closed: the retry waits for the gate). The last three are opt-in.
RETRY_ON = ("failed", "timed_out", "owner_lost", "window_closed", "gate_closed")
DEFAULT_RETRY_ON = ("failed", "timed_out")

# record states the job's retry policy may turn into another attempt
RETRYABLE = frozenset({S.FAILED, S.TIMED_OUT})

_STATE_OF = {R.SUCCEEDED: S.SUCCEEDED, R.TIMED_OUT: S.TIMED_OUT, R.KILLED: S.KILLED, R.CANCELLED: S.CANCELLED,
             R.REPLACED: S.KILLED, R.EXEC_POLICY: S.KILLED, R.AGENT_STOPPED: S.KILLED,
             R.ABORTED: S.KILLED,
             R.STEP_TIMED_OUT: S.TIMED_OUT, R.WINDOW_CLOSED: S.KILLED, R.GATE_CLOSED: S.KILLED}
# stopped by the plant's rules: retried only where retry.on names the rule
_OWN_CRITERION = frozenset({R.WINDOW_CLOSED, R.GATE_CLOSED})


def record_state(reason: str) -> S:
    """The state a run that ended for ``reason`` is recorded in (anything else: failed)."""
    return _STATE_OF.get(reason, S.FAILED)  # type: ignore[call-overload]


def criterion(reason: str) -> Optional[str]:
    """The ``retry.on`` name covering a run that ended for ``reason``, or None when no
    criterion can retry it. A run this agent stopped on its way out was cut short: it is
    retried only where a lost owner's run would be (owner_lost)."""
    if reason == R.AGENT_STOPPED:
        return R.OWNER_LOST
    if reason in _OWN_CRITERION:
        return str(reason)
    state = record_state(reason)
    return state if state in RETRYABLE else None


@dataclass(frozen=True)
class RunOutcome:
    state: S                          # how the run ended (its audit record, its metric)
    retry_at: Optional[datetime]      # when the next attempt starts; None: `state` is final

    @property
    def record_state(self) -> S:
        """What the firing's record says now: retrying while another attempt follows."""
        return S.RETRYING if self.retry_at is not None else self.state


def after_run(job: JobDocument, reason: str, fire_id: str, attempt: int, now: datetime, cancelled: bool) -> RunOutcome:
    """A run ended for ``reason``: its record state, and the next attempt's time if the
    job's retry policy asks for one (never for a cancelled job)."""
    state = record_state(reason)
    name = criterion(reason)
    nxt = None
    if name is not None and job.retry.retries(name) and not cancelled:
        nxt = sch.next_retry_at(job, fire_id, attempt, now)
    return RunOutcome(state, nxt)


def after_owner_lost(job: JobDocument, fire_id: str, attempt: int, now: datetime) -> Optional[datetime]:
    """A run left `running` by an owner that is gone may have run: another attempt only if
    the job opted in (retry.on lists owner_lost) and attempts remain."""
    if not job.retry.retries(R.OWNER_LOST):
        return None
    return sch.next_retry_at(job, fire_id, attempt, now)


def end_fields(result: RunResult, reason: str, health: str, now: datetime) -> dict[str, Any]:
    """What a run's final (or `retrying`) record and status say of how it ended, from the
    executor's result."""
    detail = result.error
    # a run the executor never saw (RunResult.spawn_error) used nothing: its usage is empty
    fields: dict[str, Any] = {"exit_code": result.exit_code,
                              "reason": reason if detail is None else f"{reason}: {detail}",
                              "usage": result.usage.to_dict() if result.backend else {},
                              "ended_at": format_rfc3339(now), "health": health}
    if result.stderr_tail is not None:   # kept by the reaper as the output came
        fields["stderr_tail"] = result.stderr_tail
    # what the job reported (agent/execute/progress.py)
    for k, v in (("progress", result.progress), ("result", result.result), ("result_error", result.result_error)):
        if v is not None:
            fields[k] = v
    # the claim wrote the planned start; the record keeps the real one (None: never released)
    released = result.started_at
    fields["started_at"] = format_rfc3339(datetime.fromtimestamp(released, timezone.utc)) if released else None
    return fields
