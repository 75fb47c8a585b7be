"""Group commit of fenced writes: the writes the loop submits within a short window leave
in ONE etcd transaction (fencing.fenced_batch), and each comes back with its own outcome.

A transaction costs the agent a round trip, two thread hand-offs and gRPC's work, and etcd
an fsync, whatever its size: one per write made the run records most of the agent's CPU.
A write says how long it may wait for others to join (``within``: 0 for the end of the
current loop tick); the batch leaves when the earliest of its writes must, or when it is
full (BATCH_MAX writes, MAX_BYTES of values).

Order: no two writes that touch the same key travel in one batch (etcd refuses it) or in
two batches at once. A write waits while a batch holding one of its keys is in flight, so
the writes of one key land in the order they were submitted.

Loop thread only; the transaction runs on the given workers.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from agent.coordination import fencing
from agent.coordination.etcd import TxnResult, op_key_value
from agent.coordination.fencing import BATCH_MAX, FencedWrite
from agent.runtime.metrics import histogram

if TYPE_CHECKING:
    from agent.coordination.worker import EtcdWorkers
    from agent.runtime.loop import EventLoop, Timer

log = logging.getLogger(__name__)

BATCH_WRITES = histogram("millwright_etcd_batch_writes", "Fenced writes per etcd transaction (group commit)",
                         buckets=(1, 2, 4, 8, 16, 32, 64))

MAX_BYTES = 512 << 10   # keys and values of one batch (etcd refuses requests over 1.5 MiB by default)

# done(result, error): result is the write's TxnResult (``succeeded``: its own compares
# held), or (TxnResult, what ``then`` returned) when it was given one; error is the
# StaleToken of its fence, or the exception of the whole batch (its outcome unknown).
Done = Callable[[Any, Optional[BaseException]], None]


@dataclass
class _Pending:
    write: FencedWrite
    done: Done
    then: Optional[Callable[[TxnResult], Any]]
    keys: frozenset
    size: int
    by: float


def _keys_and_size(write: FencedWrite) -> tuple[frozenset, int]:
    keys, size = set(), 0
    for op in (*write.success, *write.failure):
        key, value = op_key_value(op)
        if key is None:
            continue
        keys.add(key)
        size += len(key) + len(value)
    return frozenset(keys), size


class GroupCommit:
    def __init__(self, client: Any, loop: EventLoop, workers: EtcdWorkers, *, max_writes: int = BATCH_MAX,
                 max_bytes: int = MAX_BYTES):
        self.client = client
        self.loop = loop
        self.workers = workers
        self.max_writes = min(max_writes, BATCH_MAX)
        self.max_bytes = max_bytes
        self.spread = max(1, workers.max_threads)   # workers the work after a batch may use
        self.pending: list[_Pending] = []
        self.in_flight: set = set()      # keys of the batches on their way
        self._timer: Optional[Timer] = None
        self._timer_at = 0.0

    def submit(self, write: FencedWrite, done: Done, *, within: float = 0.0,
               then: Optional[Callable[[TxnResult], Any]] = None) -> None:
        """Send ``write`` in a batch that leaves within ``within`` seconds (0: at the end of
        this loop tick). ``then(result)`` runs on the worker after the batch, for a write
        that succeeded (its claimed run staged there, say, off the loop)."""
        keys, size = _keys_and_size(write)
        p = _Pending(write, done, then, keys, size, self.loop.clock() + max(0.0, within))
        self.pending.append(p)
        if len(self.pending) >= self.max_writes:
            self._arm(self.loop.clock())   # a batch may be full
        elif not (keys & self.in_flight):
            self._arm(p.by)

    def flush(self) -> None:
        """Send every write that may go now, whatever its window."""
        self._go(force=True)

    # --- the loop's -------------------------------------------------------------------------
    def _arm(self, at: float) -> None:
        if self._timer is not None:
            if self._timer_at <= at:
                return
            self._timer.cancel()
        self._timer_at = at
        self._timer = self.loop.call_at(at, self._due)

    def _rearm(self) -> None:
        """The timer for the earliest window among the writes free to go (none of their keys
        in flight, nor in an earlier write that waits)."""
        blocked = set(self.in_flight)
        earliest = None
        for p in self.pending:
            if p.keys & blocked:
                blocked |= p.keys
            elif earliest is None or p.by < earliest:
                earliest = p.by
        if earliest is not None:
            self._arm(earliest)

    def _due(self) -> None:
        self._timer = None
        self._go(force=False)

    def _go(self, force: bool) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        now = self.loop.clock()
        while self._send(now, force):
            pass
        self._rearm()

    def _send(self, now: float, force: bool) -> bool:
        """One batch of the pending writes that may travel together, oldest first: sent
        when it is full or one of its writes must go by ``now`` (``force``: in any case).
        False when none went."""
        batch: list[_Pending] = []
        rest: list[_Pending] = []
        keys: set = set()
        size = 0
        full = False
        for p in self.pending:
            if len(batch) >= self.max_writes or (batch and size + p.size > self.max_bytes):
                full = True
            if full or p.keys & keys or p.keys & self.in_flight:
                rest.append(p)
                keys |= p.keys   # a later write of the same key waits behind this one
                continue
            batch.append(p)
            keys |= p.keys
            size += p.size
        if not batch or not (force or full or any(p.by <= now for p in batch)):
            return False
        self.pending = rest
        flying = frozenset().union(*(p.keys for p in batch))
        self.in_flight |= flying
        BATCH_WRITES.observe(len(batch))
        writes = [p.write for p in batch]
        client, post = self.client, self.loop.post

        def op() -> list:
            outcomes = fencing.fenced_batch(client, writes)
            # a write with work after it (a claim: its run's staging) goes to the loop as soon
            # as that is done, as a callback of its own: a claim's run is not held back by
            # the staging of others, and a timer that falls due goes between their spawns.
            # Past THEN_CHUNK such writes, the rest of the work is spread over the pool (the
            # loop hands it out) while this worker does the first chunk. The other writes'
            # outcomes go with the batch's own answer (one wake-up).
            rest, work = [], []
            for p, r in zip(batch, outcomes):
                if p.then is not None and not isinstance(r, fencing.StaleToken):
                    work.append((p, r))
                else:
                    rest.append((p, r))
            chunks = _chunks(work, self.spread)
            if len(chunks) > 1:
                post(self._hand_out, chunks[1:])
            if chunks:
                _work(chunks[0], post)
            return rest

        def landed(rest: Any, error: Optional[BaseException]) -> None:
            self.in_flight -= flying
            if error is not None:   # the batch's outcome is unknown: each write's is
                rest = [(p, None) for p in batch]
            for p, r in rest:
                try:
                    if isinstance(r, fencing.StaleToken):
                        p.done(None, r)
                    else:
                        p.done(r, error)
                except Exception:   # one write's handler must not cost the others theirs
                    log.exception("fenced write handler failed")
            self._rearm()

        self.workers.submit(op, landed)
        return bool(self.pending)

    def _hand_out(self, chunks: list) -> None:
        """A batch's work after the transaction, beyond its first chunk, to other workers."""
        post = self.loop.post
        for chunk in chunks:
            self.workers.submit(functools.partial(_work, chunk, post), _nothing)


THEN_CHUNK = 4   # writes whose work one worker does before the rest is spread over the pool


def _chunks(work: list, spread: int) -> list:
    """``work`` in at most ``spread`` chunks of at least THEN_CHUNK (the first the largest)."""
    if not work:
        return []
    n = max(1, min(spread, -(-len(work) // THEN_CHUNK)))
    size = -(-len(work) // n)
    return [work[i:i + size] for i in range(0, len(work), size)]


def _work(chunk: list, post: Callable[..., None]) -> None:
    for p, r in chunk:
        post(p.done, _then(p, r), None)


def _nothing(result: Any, error: Optional[BaseException]) -> None:
    if error is not None:
        log.error("work after a fenced write failed", extra={"fields": {"error": str(error)}})


def _then(p: _Pending, r: Any) -> Any:
    """The write's outcome as its submitter asked for it (on the worker)."""
    if p.then is None or isinstance(r, fencing.StaleToken):
        return r
    extra = None
    if r.succeeded:
        try:
            extra = p.then(r)
        except Exception:
            log.exception("work after a fenced write failed")
    return r, extra
