"""What a new owner of a job finds and owes: the live run records earlier owners left
(a timed retry to re-arm, or a run whose owner is gone), and the firings that fell due
while no agent owned the shard (misfire policy). Pure: it reads the records and the
job's schedule, adds the firings to the entry, and says what the scheduler must do."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Optional

from agent.jobs import schedule as sch
from agent.jobs.firing import ClaimState, Firing
from agent.jobs.states import TERMINAL, RecordState
from agent.runtime.timefmt import parse_rfc3339

if TYPE_CHECKING:
    from agent.jobs.catalog import JobEntry, Records


@dataclass
class Recovered:
    retrying: list[tuple[Firing, datetime]] = field(default_factory=list)   # (firing, retry_at) to re-arm
    orphans: list[Firing] = field(default_factory=list)     # `running` by an owner that is gone
    error: Optional[str] = None       # the schedule cannot be computed: nothing below applies
    skipped: int = 0                  # firings the misfire policy skipped
    skipped_capped: bool = False
    misfired: list[Firing] = field(default_factory=list)    # the latest skipped one, recorded misfired
    catch_up: list[datetime] = field(default_factory=list)  # missed firings to run, oldest first
    next_due: Optional[datetime] = None
    announce: bool = False            # a new job with a future firing: its `scheduled` status


def recover(e: JobEntry, records: Records, agent_id: str, now: datetime) -> Recovered:
    job, out = e.job, Recovered()
    mine = "@" + agent_id
    for fire_id, (rec, rev) in sorted(records.items()):
        if job.fanout and not fire_id.endswith(mine):
            continue  # another agent's own firings of a fan-out job
        try:
            due = sch.parse_fire_id(fire_id[:-len(mine)] if job.fanout else fire_id)
        except Exception:
            continue
        _done_up_to(e, due)
        e.latest_fire = max(e.latest_fire, fire_id)
        state = rec.get("state")
        if state in TERMINAL:
            continue
        f = Firing(e, due, fire_id, int(rec.get("attempt", 1)), claim=ClaimState(rec, rev))
        e.firings[fire_id] = f
        if state == RecordState.RETRYING:
            out.retrying.append((f, _parse_or(rec.get("retry_at"), now)))
        else:  # running (or any unknown live state)
            out.orphans.append(f)
    try:
        recovery = sch.recover_job(job, e.accepted_at, e.last_due_done, now)
    except Exception as exc:
        out.error = str(exc)
        return out
    out.skipped, out.skipped_capped = recovery.skipped, recovery.skipped_capped
    if recovery.skipped:
        # one record for the latest skipped firing, so the next owner does not decide again
        try:
            latest = sch.missed_firings(job.schedule, e.last_due_done, sch.window_end(job, now), "run_once", 1,
                                        first_due=sch.first_due(job, e.accepted_at))
        except ValueError:
            latest = []
        for due in latest:
            if due not in recovery.run:
                f = Firing(e, due, e.fire_id(due, agent_id))
                e.firings[f.fire_id] = f
                _done_up_to(e, due)
                out.misfired.append(f)
    out.catch_up = list(recovery.run)
    out.next_due = recovery.next_due
    out.announce = not records and job.schedule.kind != "now" and recovery.next_due is not None
    return out


def _done_up_to(e: JobEntry, due: datetime) -> None:
    if e.last_due_done is None or due > e.last_due_done:
        e.last_due_done = due


def _parse_or(text: Optional[str], default: datetime) -> datetime:
    try:
        return parse_rfc3339(text) if text else default
    except Exception:
        return default
