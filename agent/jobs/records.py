"""Run records: their documents, and the fenced writes that create and update them.

A record runs/<shard>/<job>/<fire_id> is written only in a transaction fenced by the
shard's token, and compared with the revision this agent last wrote (or created with
create-revision==0), so no write of an agent that lost the shard, and no stale write of
its own, lands. Its copy latest/<shard>/<job> is written in the same transaction while
the firing is the job's newest. The writes (claims.py's included) leave in group commits
(agent/coordination/groupcommit.py): the writes of a few milliseconds in one etcd
transaction, each its own nested transaction with its own outcome. Each shard's writes in
flight are counted: a shard is not handed over while one may still land.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Callable, Optional

from agent.coordination.etcd import Create, EtcdError, EtcdUnavailable, Mod, Put
from agent.coordination.fencing import Fence, FencedWrite, StaleToken
from agent.coordination.groupcommit import GroupCommit
from agent.coordination.keys import Keys
from agent.jobs.states import RecordState
from agent.runtime.timefmt import format_optional as rfc
from agent.runtime.timefmt import utcnow

if TYPE_CHECKING:
    from agent.coordination.worker import EtcdWorkers
    from agent.jobs.firing import Firing
    from agent.jobs.seams import Fencing
    from agent.runtime.loop import EventLoop

log = logging.getLogger(__name__)

# How often a write without a fence looks again while the session is past its renew
# deadline but the shard is still held (RunRecords.waits).
FENCE_WAIT_S = 0.1
WRITE_RETRY_S = 0.3   # a write etcd did not answer is made again after this (while the shard is held)
# A record that ends a firing, or says it waits for a retry, waits this long for other
# writes to share its transaction (no process waits for it; the shard's hand-over does).
RECORD_WAIT_S = 0.05

_RESET_WHEN_RUNNING = ("ended_at", "exit_code", "reason", "retry_at")


class RunRecords:
    """Writes run records for the shards this agent holds (loop thread; the etcd calls
    run on the given workers)."""

    def __init__(self, client: Any, keys: Keys, fencing: Fencing, loop: EventLoop, workers: EtcdWorkers,
                 agent_id: str, shards: int, on_settled: Callable[[int], None]):
        self.client = client
        self.keys = keys
        self.fencing = fencing
        self.loop = loop
        self.workers = workers
        self.agent_id = agent_id
        self.shards = shards
        self.on_settled = on_settled     # a shard's last write in flight finished
        self.in_flight: dict[int, int] = {}
        # ops that go with a firing's final record (a staged rollout's outcome: StartGate.final_ops)
        self.final_ops: Callable[[Firing, str], list] = lambda f, state: []
        self.commits = GroupCommit(client, loop, workers)   # claims' and records' fenced writes, batched

    # --- documents -------------------------------------------------------------------
    def key(self, f: Firing) -> str:
        e = f.entry
        return self.keys.run(e.shard % self.shards, e.job.id, f.fire_id)

    def document(self, f: Firing, state: str, fence: Fence, **fields: Any) -> dict:
        """The firing's record in ``state``, written under ``fence``: what this agent last
        knew of it, with the fields given."""
        e = f.entry
        base = dict(f.claim.record or {})
        base.update({"v": 1, "job_id": e.job.id, "fire_id": f.fire_id, "due": rfc(f.due), "state": state,
                     "attempt": f.attempt, "agent": self.agent_id, "shard": e.shard % self.shards,
                     "fence": fence.token})
        if e.job.target:  # the fence of this record is the pool's shard key (docs/contract.md)
            base["pool"] = e.job.pool
            if e.job.fanout:
                base["fanout"] = True
        base.setdefault("started_at", None)
        for k in ("ended_at", "exit_code", "reason", "health", "usage", "retry_at"):
            base.setdefault(k, None)
        if state == RecordState.RUNNING:
            for k in _RESET_WHEN_RUNNING:
                base[k] = None
            base["usage"] = None
        base.update(fields)
        return base

    def ops(self, f: Firing, key: str, value: str) -> list:
        """The record's put, and its copy in latest/<shard>/<job> when this firing is the
        job's newest (in the same fenced transaction, so the two never disagree)."""
        e = f.entry
        ops = [Put(key, value)]
        if f.fire_id >= e.latest_fire and not f.rollback:
            e.latest_fire = f.fire_id
            ops.append(Put(self.keys.latest(e.shard % self.shards, e.job.id), value))
        return ops

    # --- in flight -------------------------------------------------------------------
    def busy(self, shard: int) -> bool:
        return bool(self.in_flight.get(shard))

    def waits(self, shard: int) -> bool:
        """A write for the shard has no fence only because the session is past its renew
        deadline while the shard is still held: it waits for the renewal (or for the
        self-fence, after which the shard's next owner resolves the record). Whatever the
        firing's state: a final record dropped here would stay `running` for as long as
        the renewed session keeps the shard."""
        return self.fencing.fence_for(shard) is None and self.fencing.owns(shard) is not None

    def submit(self, shard: int, write: FencedWrite, done: Callable[[Any, Optional[BaseException]], None]) -> None:
        """A record write, counted against its shard until it finished."""
        self._count(shard, +1)

        def finished(result: Any, error: Optional[BaseException]) -> None:
            try:
                done(result, error)
            finally:
                if not self._count(shard, -1):
                    self.on_settled(shard)

        self.commits.submit(write, finished, within=RECORD_WAIT_S)

    def _count(self, shard: int, delta: int) -> int:
        n = self.in_flight.get(shard, 0) + delta
        if n > 0:
            self.in_flight[shard] = n
        else:
            self.in_flight.pop(shard, None)
        return max(n, 0)

    # --- writes ----------------------------------------------------------------------
    def write(self, f: Firing, state: str, answer: Optional[tuple] = None, **fields: Any) -> None:
        """Update the firing's record to ``state``, compared with the revision this agent
        wrote last; made again while etcd does not answer and the shard is held.
        ``answer``: (marker key or None, status document) of a final state, written in the
        same transaction (agent/cloud/answers.py)."""
        if f.claim.soft:   # a progress update is in flight: this write follows it, from the revision it sets
            f.claim.after.append(lambda: self.write(f, state, answer, **fields))
            return
        e = f.entry
        fence = self.fencing.fence_for(e.shard)
        if fence is None:
            if self.waits(e.shard):  # counted as in flight until _rewrite runs
                self._count(e.shard, +1)
                f.claim.writing += 1
                self.loop.call_later(FENCE_WAIT_S, self._rewrite, f, state, fields, f.claim.rev, answer)
            return
        key = self.key(f)
        rec = self.document(f, state, fence, **fields)
        rev = f.claim.rev
        f.claim.record = rec
        f.claim.writing += 1
        ops = self.ops(f, key, json.dumps(rec))
        if answer is not None and answer[0]:
            ops.append(Put(answer[0], json.dumps(answer[1])))
        if answer is not None:
            ops += self.final_ops(f, state)

        def done(r: Any, error: Optional[BaseException]) -> None:
            f.claim.writing -= 1
            if error is None and r.succeeded:
                f.claim.rev = r.revision
            elif isinstance(error, (EtcdUnavailable, EtcdError)):
                # transient: again while we still hold the shard (still counted as in flight)
                self._count(e.shard, +1)
                f.claim.writing += 1
                self.loop.call_later(WRITE_RETRY_S, self._rewrite, f, state, fields, rev, answer)
            elif error is not None and not isinstance(error, StaleToken):
                log.warning("run record write failed", extra={"fields": {"job": e.job.id, "error": str(error)}})

        self.submit(e.shard, FencedWrite(fence, (Mod(key) == rev,), tuple(ops)), done)

    def _rewrite(self, f: Firing, state: str, fields: dict, rev: int, answer: Optional[tuple]) -> None:
        f.claim.writing -= 1
        shard = f.entry.shard
        self._count(shard, -1)
        if f.claim.rev == rev and self.fencing.owns(shard) is not None:
            self.write(f, state, answer=answer, **fields)

    def write_progress(self, f: Firing, progress: dict) -> bool:
        """The running record's ``progress``, written only while no other write of the
        firing is in flight; a write that comes meanwhile waits for this one (write()), so
        the final record never races a progress update. False: not written now."""
        e = f.entry
        fence = self.fencing.fence_for(e.shard)
        if fence is None or f.claim.writing or not f.claim.rev:
            return False
        key, rev = self.key(f), f.claim.rev
        rec = self.document(f, RecordState.RUNNING, fence, progress=progress)
        ops = self.ops(f, key, json.dumps(rec))
        f.claim.writing += 1
        f.claim.soft = True

        def done(r: Any, error: Optional[BaseException]) -> None:
            f.claim.writing -= 1
            f.claim.soft = False
            if error is None and r.succeeded:
                f.claim.rev, f.claim.record = r.revision, rec
            after, f.claim.after = f.claim.after, []
            for write in after:
                write()

        self.submit(e.shard, FencedWrite(fence, (Mod(key) == rev,), tuple(ops)), done)
        return True

    def write_not_run(self, f: Firing, state: str, reason: str, answer: tuple[dict, Optional[str]]) -> bool:
        """The final record of a firing that did not run (misfired, cancelled, failed
        before start): created, or updated from the revision this agent knows. False when
        the shard has no fence now (nothing written)."""
        e = f.entry
        fence = self.fencing.fence_for(e.shard)
        if fence is None:
            return False
        key = self.key(f)
        rec = self.document(f, state, fence, reason=reason, ended_at=rfc(utcnow()))
        cmp = (Mod(key) == f.claim.rev,) if f.claim.rev else (Create(key) == 0,)
        ops = self.ops(f, key, json.dumps(rec))
        doc, answer_key = answer
        if answer_key:
            ops.append(Put(answer_key, json.dumps(doc)))
        ops += self.final_ops(f, state)
        self._submit_until_answered(e.shard, FencedWrite(fence, cmp, tuple(ops)))
        return True

    def _submit_until_answered(self, shard: int, write: FencedWrite) -> None:
        """A write whose firing is already forgotten: made again (WRITE_RETRY_S later) while
        etcd does not answer it and the shard is held under the same fence, and counted as
        in flight meanwhile (the shard is not handed over with its record unwritten). Its
        compare lets it land once: a retry after a write that did land finds the record."""
        def done(r: Any, error: Optional[BaseException]) -> None:
            if isinstance(error, (EtcdUnavailable, EtcdError)):
                self._count(shard, +1)
                self.loop.call_later(WRITE_RETRY_S, again)
            elif error is not None and not isinstance(error, StaleToken):
                log.warning("run record write failed", extra={"fields": {"shard": shard, "error": str(error)}})

        def again() -> None:
            fence = self.fencing.fence_for(shard)
            if fence is not None and fence.token == write.fence.token:
                self.submit(shard, write, done)
            elif fence is None and self.waits(shard):   # past the renew deadline, still held
                self._count(shard, +1)
                self.loop.call_later(FENCE_WAIT_S, again)
            if not self._count(shard, -1):
                self.on_settled(shard)   # the shard left: its next owner resolves the firing

        self.submit(shard, write, done)
