"""What a new owner of a job finds and owes: the live run records earlier owners left
(a timed retry to re-arm, or a run whose owner is gone), and the firings that fell due
while no agent owned the shard (misfire policy). Pure: it reads the records and the
job's schedule, adds the firings to the entry, and says what the scheduler must do.

Records are not signed and etcd is writable by more than agents, so a record is believed
only where the signed job allows what it says: its firing is on the job's schedule and not
further ahead than an owner whose clock runs fast could have claimed it (and, ahead at all,
only with a fence), its attempt within 1..max_attempts (a `retrying` one before the last),
its fence older than the write. Any other is foreign: reported, never run from; a past firing
it names counts as handled (forged state may stop work, never start it), a future one's
claim replaces it when it falls due."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Optional

from agent.jobs import schedule as sch
from agent.jobs.firing import ClaimState, Firing
from agent.jobs.rollout import rolled_back
from agent.jobs.states import TERMINAL, RecordState
from agent.runtime.timefmt import format_rfc3339, parse_rfc3339

if TYPE_CHECKING:
    from agent.jobs.catalog import JobEntry, Records


# a firing is claimed at most the claim lead ahead of its due time (execute.claim_lead_s,
# under a second) by its owner's clock, and owners' clocks differ by up to CLOCK_SKEW_MAX_S:
# a fenced record up to both ahead may be an owner's honest early run (believed: running its
# firing again could run it twice; forged, it can only stop that firing, and it is reported);
# a record further ahead was not made by a claim
FUTURE_SLACK_S = 5.0
CLOCK_SKEW_MAX_S = 60.0
FOREIGN_AHEAD_MAX = 64   # foreign records of future firings remembered per job (their claims replace them)


@dataclass
class Recovered:
    retrying: list[tuple[Firing, datetime]] = field(default_factory=list)   # (firing, retry_at) to re-arm
    orphans: list[Firing] = field(default_factory=list)     # `running` by an owner that is gone
    foreign: list[tuple[str, str, dict, int]] = field(default_factory=list)   # (fire_id, why, record, revision)
    early: list[tuple[str, float, dict, int]] = field(default_factory=list)   # (fire_id, seconds ahead, record,
    #                                          revision): believed, though its firing is ahead of this agent's clock
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
    # firings whose record decides them: never caught up or armed again. By fire id, not by
    # due time: a fire id keeps milliseconds, a one-shot's due time may have more
    handled: set[str] = set()
    for fire_id, (rec, rev) in sorted(records.items()):
        if job.fanout and not fire_id.endswith(mine):
            continue  # another agent's own firings of a fan-out job
        undone = rolled_back(fire_id) if job.fanout else None
        try:
            due = _exact(job, e.accepted_at, sch.parse_fire_id(undone if undone is not None else
                                                               fire_id[:-len(mine)] if job.fanout else fire_id))
        except Exception:
            continue
        if undone is not None:   # a rollback's run (agent/jobs/rollouts.py): resolved, never run again
            if foreign(job, e.accepted_at, fire_id, due, rec, rev, now) is None and rec.get("state") not in TERMINAL:
                f = Firing(e, due, fire_id, rec["attempt"], claim=ClaimState(rec, rev), rollback=True)
                e.firings[fire_id] = f
                out.orphans.append(f)
            continue
        why = foreign(job, e.accepted_at, fire_id, due, rec, rev, now)
        if why is not None:
            out.foreign.append((fire_id, why, rec if isinstance(rec, dict) else {}, rev))
            if due <= now:
                _done_up_to(e, due)   # handled, whatever really happened to it
                handled.add(fire_id)
            elif len(e.foreign_ahead) < FOREIGN_AHEAD_MAX:
                e.foreign_ahead[fire_id] = rev   # its claim may replace exactly this record
            continue
        ahead = (due - now).total_seconds()
        if ahead > FUTURE_SLACK_S:
            out.early.append((fire_id, ahead, rec, rev))
        _done_up_to(e, due)
        handled.add(fire_id)
        e.latest_fire = max(e.latest_fire, fire_id)
        state = rec.get("state")
        if state in TERMINAL:
            continue
        f = Firing(e, due, fire_id, rec["attempt"], claim=ClaimState(rec, rev))
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
            if due not in recovery.run and e.fire_id(due, agent_id) not in handled:
                f = Firing(e, due, e.fire_id(due, agent_id))
                e.firings[f.fire_id] = f
                _done_up_to(e, due)
                out.misfired.append(f)
    # a fire id names its due time to the millisecond: a due time with microseconds (a `{}`
    # job's issued_at) is later than the one its record's fire id parses to, and its firing,
    # which has that record (in handled), must not run again
    out.catch_up = [d for d in recovery.run if e.fire_id(d, agent_id) not in handled]
    nxt = recovery.next_due
    while nxt is not None and e.fire_id(nxt, agent_id) in handled:
        nxt = sch.next_firing(job, nxt, e.accepted_at)
    out.next_due = nxt
    out.announce = not records and job.schedule.kind != "now" and recovery.next_due is not None
    return out


def foreign(job: sch.JobDocument, accepted_at: datetime, fire_id: str, due: datetime, rec: Any, rev: int,
            now: datetime) -> Optional[str]:
    """Why a run record at runs/<shard>/<job>/<fire_id> (mod revision ``rev``) is not
    believed, or None when the signed job allows what it says."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    if rec.get("job_id") != job.id or rec.get("fire_id") != fire_id:
        return f"it names job {rec.get('job_id')!r} firing {rec.get('fire_id')!r}, not its key's"
    state = rec.get("state")
    if state not in _STATES:
        return f"state {state!r} is not a run-record state"
    attempt, most = rec.get("attempt"), job.retry.max_attempts
    if type(attempt) is not int or not 1 <= attempt <= most:
        return f"attempt {attempt!r} is outside 1..{most} (retry.max_attempts)"
    if state == RecordState.RETRYING and attempt >= most:
        return f"`retrying` after attempt {attempt} of {most}"
    ahead = (due - now).total_seconds()
    if ahead > FUTURE_SLACK_S + CLOCK_SKEW_MAX_S:
        return f"its firing is due at {format_rfc3339(due)}: no claim is made that far ahead"
    fence = rec.get("fence")
    if ahead > 0 and fence is None:
        return f"its firing is due at {format_rfc3339(due)} and it names no fence: every claim ahead does"
    if not sch.is_firing(job, due, accepted_at):
        return f"{fire_id} is not a firing of the job's schedule"
    if fence is not None and (type(fence) is not int or not 0 < fence <= rev):
        return f"fence {fence!r} cannot have fenced a write made at revision {rev}"
    return None


_STATES = frozenset(s.value for s in RecordState)


def _exact(job: sch.JobDocument, accepted_at: datetime, due: datetime) -> datetime:
    """A fire id names its firing to the millisecond; a one-shot's due time may be finer:
    its schedule's own time when the fire id is that one's (else the firing it names would
    look missed, and run again, after the last record)."""
    if job.schedule.one_shot:
        first = sch.first_due(job, accepted_at)
        if first is not None and sch.fire_id(job.id, first) == sch.fire_id(job.id, due):
            return first
    return due


def _done_up_to(e: JobEntry, due: datetime) -> None:
    if e.last_due_done is None or due > e.last_due_done:
        e.last_due_done = due


def _parse_or(text: Optional[str], default: datetime) -> datetime:
    try:
        return parse_rfc3339(text) if text else default
    except Exception:
        return default
