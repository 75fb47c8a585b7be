"""Claiming a firing: its run record written `running` under the shard's fence, before any
process of it may run. The first attempt creates the record (create-revision==0: one
record per firing); a retry swaps it in place (its mod revision must be the one this
agent last wrote).

A claim whose outcome is unknown (etcd did not answer), or that found a record there, is
read back before anything is decided, and every decision reaches the scheduler as one
``Claim``: claimed (run it), again (claim once more), discard (its job went: end it),
foreign (a record this agent never claimed holds the key), or give up (the record is not
ours to write). Nothing here starts a process.

Claims leave in the run records' group commit (records.py): the claims of a few
milliseconds share one etcd transaction, each still with its own outcome; a batch whose
answer is lost makes each of its claims read back its own record.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from agent.coordination.etcd import Create, Mod
from agent.coordination.fencing import Fence, FencedWrite, StaleToken
from agent.jobs.firing import Firing, FiringEnd, FiringState
from agent.jobs.metrics import CLAIMS
from agent.jobs.states import RecordState
from agent.runtime.timefmt import format_optional as rfc
from agent.runtime.timefmt import utcnow

if TYPE_CHECKING:
    from agent.coordination.worker import EtcdWorkers
    from agent.execute.launch import Staged
    from agent.execute.runs import RunSpec
    from agent.jobs.catalog import JobEntry
    from agent.jobs.records import RunRecords
    from agent.jobs.seams import Fencing, RunStarter
    from agent.runtime.loop import EventLoop


READ_BACK_S = 0.2        # a read-back that failed, or found a write of ours still to land, is made again after this
UNSURE_CLAIMS_MAX = 8    # earlier claims of one firing with an unknown outcome that are remembered
# A claim made ahead of its due time waits for others to join its transaction for this
# share of the time left, at most CLAIM_WAIT_MAX_S: the claim lead (claimlead.py) measures
# the wait with the rest, and one transaction for several firings is what lets the agent
# keep up with many firings a second. A claim at or after its due time leaves at the end
# of the loop tick, unless the loop lags (then it waits a share of the lag).
CLAIM_WAIT_SHARE = 0.25
CLAIM_WAIT_MAX_S = 0.02


class ClaimKind(enum.Enum):
    CLAIMED = "claimed"    # the record is ours, `running`: the firing may run
    AGAIN = "again"        # claim once more (after ``delay``; ``retry``: as a retry's swap)
    DISCARD = "discard"    # its job was cancelled or dropped meanwhile: it ends without running
    FOREIGN = "foreign"    # a record this agent never claimed is there (``record``, at ``rev``)
    GIVE_UP = "give_up"    # the record is not this agent's to write (``why``)


@dataclass(frozen=True)
class Claim:
    kind: ClaimKind
    why: Optional[FiringEnd] = None
    staged: Optional[Staged] = None   # the run's directories and quota container, made once the claim landed
    delay: float = 0.0
    retry: bool = False
    record: Any = None
    rev: int = 0


Done = Callable[[Firing, Claim], None]


def decided_here(record: Optional[dict], agent_id: str, fence: Optional[Fence]) -> bool:
    """A record this agent wrote under the fence it holds now: the firing was decided here
    (its final record, say), so a claim must not take it over as a foreign one."""
    return (fence is not None and record is not None and record.get("agent") == agent_id
            and record.get("fence") == fence.token)


class ClaimWriter:
    """Writes claims and reads back those with an unknown outcome (loop thread; etcd on
    the workers)."""

    def __init__(self, client: Any, fencing: Fencing, records: RunRecords, loop: EventLoop, workers: EtcdWorkers,
                 agent_id: str, is_current: Callable[[JobEntry], bool], executor: RunStarter):
        self.client = client
        self.fencing = fencing
        self.records = records
        self.loop = loop
        self.workers = workers
        self.agent_id = agent_id
        self.is_current = is_current
        self.executor = executor      # stages a claimed run (its directories, quota container)

    def claim(self, f: Firing, fence: Fence, retry: bool, spec: Optional[RunSpec], done: Done, takeover: bool = False) -> None:
        """Write the claim of ``f`` (in state CLAIMING, its attempt set) under ``fence``;
        ``spec``: the run to stage once the claim landed (None: nothing to stage).
        ``takeover``: replace the record at ``f.claim.rev`` (a foreign one) instead of
        creating it. The claims made within a few milliseconds of each other leave in one
        transaction (the records' group commit), each with its own outcome."""
        key = self.records.key(f)
        rec = self.records.document(f, RecordState.RUNNING, fence, started_at=rfc(max(utcnow(), f.due)))
        compare = (Mod(key) == f.claim.rev,) if retry or takeover else (Create(key) == 0,)
        ops = tuple(self.records.ops(f, key, json.dumps(rec)))
        def stage(r: Any) -> Optional[Staged]:
            # ours now: its directories and quota container are made on the worker, so the
            # loop's spawn does no blocking file-system work
            return self.executor.stage(spec) if spec is not None else None

        def landed(result: Any, error: Optional[BaseException]) -> None:
            r: Any
            r, staged = result if error is None else (None, None)
            if f.state != FiringState.CLAIMING:
                if staged is not None:
                    self.executor.unstage(staged)
                return
            if isinstance(error, StaleToken):
                self._give_up(f, FiringEnd.SHARD_LOST, done)
            elif retry and (error is not None or not r.succeeded):
                # etcd did not answer, or our own `retrying` write landed after this claim
                # was built: read the record back before deciding
                self._read_back_retry(f, key, rec, done)
            elif error is not None:
                # unknown outcome (timeout): the record may exist
                self._read_back(f, key, rec, fence, done)
            elif not r.succeeded:
                # a record is there: an earlier claim of ours read back as absent that landed
                # after all (still queued in etcd), or one this agent never claimed
                self._read_back(f, key, rec, fence, done)
            else:
                f.claim.record, f.claim.rev, f.claim.unsure = rec, r.revision, ()
                CLAIMS.labels("claimed").inc()
                done(f, Claim(ClaimKind.CLAIMED, staged=staged))

        self.records.commits.submit(FencedWrite(fence, compare, ops), landed, within=self._wait(f), then=stage)

    def _wait(self, f: Firing) -> float:
        """How long the claim of ``f`` may wait for others to share its transaction: a share
        of the time left to its due time; past it, a share of the loop's lag (an agent that
        is behind makes bigger batches, and so catches up faster); at most CLAIM_WAIT_MAX_S."""
        ahead = (f.due - utcnow()).total_seconds()
        if ahead > 0:
            return min(CLAIM_WAIT_MAX_S, ahead * CLAIM_WAIT_SHARE)
        return min(CLAIM_WAIT_MAX_S, self.loop.lag() * CLAIM_WAIT_SHARE)

    def _give_up(self, f: Firing, why: FiringEnd, done: Done) -> None:
        CLAIMS.labels(why.value).inc()
        done(f, Claim(ClaimKind.GIVE_UP, why=why))

    def _read_back(self, f: Firing, key: str, rec: dict, fence: Fence, done: Done) -> None:
        """A first attempt's claim with an unknown outcome: is the record there, and ours?"""
        def landed(kv: Any, err: Optional[BaseException]) -> None:
            if f.state != FiringState.CLAIMING:
                return
            lost = self.fencing.owns(f.entry.shard) != fence
            if lost or not self.is_current(f.entry):
                # the shard was lost since this claim (and maybe held again under a new
                # fence, its jobs installed anew), or the job was dropped: a record the
                # claim landed was read by the shard's next load, which resolves it. A claim
                # made again here would be under a fence this firing never had.
                self._give_up(f, FiringEnd.SHARD_LOST if lost else FiringEnd.DROPPED, done)
            elif err is not None:
                # the claim may have landed and the shard is still held (a lapsed session
                # may renew, and the record is ours then): read again
                self.loop.call_later(READ_BACK_S, self._read_back, f, key, rec, fence, done)
            elif kv is None:
                if f.entry.cancelled:   # no claim landed: its record will say cancelled
                    done(f, Claim(ClaimKind.DISCARD))
                    return
                # not there (yet): claim again; if that create then finds a record, it may be
                # the one read back now, landed late (a request etcd still held)
                f.claim.unsure = (f.claim.unsure + (rec,))[-UNSURE_CLAIMS_MAX:]
                done(f, Claim(ClaimKind.AGAIN))
            else:
                cur = _json(kv.value)
                if isinstance(cur, dict) and any(
                        cur.get("agent") == self.agent_id and cur.get("started_at") == r["started_at"]
                        and cur.get("attempt") == r["attempt"] for r in (rec,) + f.claim.unsure):
                    f.claim.record, f.claim.rev, f.claim.unsure = cur, kv.mod_revision, ()
                    CLAIMS.labels("read_back").inc()
                    done(f, Claim(ClaimKind.CLAIMED))
                else:
                    CLAIMS.labels("foreign").inc()
                    done(f, Claim(ClaimKind.FOREIGN, record=cur, rev=kv.mod_revision))

        self.workers.submit(lambda: self.client.get(key), landed)

    def _read_back_retry(self, f: Firing, key: str, rec: dict, done: Done) -> None:
        """A retry's swap that did not succeed: where does the record stand?"""
        def landed(kv: Any, err: Optional[BaseException]) -> None:
            if f.state != FiringState.CLAIMING:
                return
            if not self.is_current(f.entry) or f.entry.cancelled:
                done(f, Claim(ClaimKind.DISCARD))
                return
            if err is not None:
                if self.fencing.owns(f.entry.shard) is not None:
                    self.loop.call_later(READ_BACK_S, self._read_back_retry, f, key, rec, done)
                else:
                    self._give_up(f, FiringEnd.SHARD_LOST, done)
                return
            cur = _json(kv.value) if kv is not None else {}
            if not isinstance(cur, dict) or type(cur.get("attempt") or 0) is not int:
                self._give_up(f, FiringEnd.RETRY_CLAIM_FAILED, done)
                return
            state, attempt = cur.get("state"), cur.get("attempt") or 0
            if state == RecordState.RUNNING and cur.get("agent") == self.agent_id \
                    and cur.get("attempt") == rec["attempt"] and cur.get("started_at") == rec["started_at"]:
                f.claim.record, f.claim.rev = cur, kv.mod_revision   # our claim did land
                CLAIMS.labels("read_back").inc()
                done(f, Claim(ClaimKind.CLAIMED))
            elif state == RecordState.RUNNING and attempt == rec["attempt"] - 1:
                # our `retrying` write for the previous attempt (or for an orphan of a dead
                # owner) has not landed yet: read again; the claim stays fenced either way
                self.loop.call_later(READ_BACK_S, self._read_back_retry, f, key, rec, done)
            elif state == RecordState.RETRYING and attempt == rec["attempt"] - 1:
                # still waiting for this attempt: claim again from the record read now
                f.claim.record, f.claim.rev = cur, kv.mod_revision
                f.attempt -= 1
                done(f, Claim(ClaimKind.AGAIN, delay=READ_BACK_S, retry=True))
            else:
                self._give_up(f, FiringEnd.RETRY_CLAIM_FAILED, done)

        self.workers.submit(lambda: self.client.get(key), landed)


def _json(value: bytes) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return None
