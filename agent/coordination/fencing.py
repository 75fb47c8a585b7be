"""Fenced writes: the one helper every writer for a shard goes through.

The fencing token is the shard key's create revision. A transaction that compares it
succeeds only while the key this agent created still exists, so an agent that lost its
shard (lease expired, partitioned, paused) can never write for it again, whatever its
local state believes. Mirrors etcd's concurrency.Mutex.IsOwner().
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence, Union

from agent.coordination.etcd import Create, EtcdClient, Txn, TxnResult
from agent.coordination.keys import Keys
from agent.runtime.metrics import counter

FENCED = counter("millwright_fenced_writes_total", "Shard-guarded transactions by result", ("result",))


@dataclass(frozen=True)
class Fence:
    """The right to write for one shard: its key and the create revision we hold."""

    shard: int
    key: str
    token: int


class StaleToken(Exception):
    """The shard is no longer ours: the write was refused by etcd."""


def fenced_txn(client: EtcdClient, fence: Fence, compare: Iterable[Any] = (), success: Iterable[Any] = (),
               failure: Iterable[Any] = (), timeout: float | None = None) -> TxnResult:
    """Run a transaction that also requires `fence` to be current.

    Returns the result when the fence holds (`succeeded` then reflects the caller's own
    compares). Raises StaleToken when the shard was lost. To tell the two apart in one
    round trip, the failure branch reads the shard key.
    """
    guard = Create(fence.key) == fence.token
    compares = list(compare)
    if not compares:
        r = client.txn([guard], success, [], timeout=timeout)
        if not r.succeeded:
            FENCED.labels("stale").inc()
            raise StaleToken(f"shard {fence.shard}: token {fence.token} is stale")
        FENCED.labels("ok").inc()
        return r
    # Nested txn: outer checks the fence, inner runs the caller's compare/success/failure.
    from etcd3 import transactions as tx

    inner = tx.Txn(compare=compares, success=list(success), failure=list(failure))
    r = client.txn([guard], [inner], [], timeout=timeout)
    if not r.succeeded:
        FENCED.labels("stale").inc()
        raise StaleToken(f"shard {fence.shard}: token {fence.token} is stale")
    inner_resp = r.responses[0]
    FENCED.labels("ok" if inner_resp.succeeded else "compare_failed").inc()
    return TxnResult(inner_resp.succeeded, r.revision, list(inner_resp.responses))


@dataclass(frozen=True)
class FencedWrite:
    """One write of a batch: its caller's compares and operations, under ``fence``."""

    fence: Fence
    compare: tuple = ()
    success: tuple = ()
    failure: tuple = ()


# A batch's path of nested transactions: the batch (one op per fence), a fence's guard (one
# op per write), a write (its compares and operations). etcd bounds each path's ops
# together by --max-txn-ops (128 by default): BATCH_MAX writes of a few ops each stay
# well within it, whatever their fences.
BATCH_MAX = 64


def fenced_batch(client: EtcdClient, writes: Sequence[FencedWrite],
                 timeout: float | None = None) -> list[Union[TxnResult, StaleToken]]:
    """Run several fenced writes in ONE transaction: per fence a nested transaction that
    compares it, holding per write a nested transaction of the write's own compares, so
    each write keeps its own outcome. Returns, per write in order, its result (``succeeded``
    reflects its compares) or the StaleToken of a fence that is no longer current (only the
    writes under that fence fail). No two writes may put the same key (etcd refuses the
    whole batch): the caller keeps them apart. Raises EtcdUnavailable/EtcdError for the
    whole batch: then the outcome of every write is unknown."""
    if len(writes) > BATCH_MAX:
        raise ValueError(f"a fenced batch holds at most {BATCH_MAX} writes, not {len(writes)}")
    groups: dict[tuple[str, int], list[int]] = {}
    for i, w in enumerate(writes):
        groups.setdefault((w.fence.key, w.fence.token), []).append(i)
    ops = [Txn([Create(key) == token],
               [Txn(list(writes[i].compare), list(writes[i].success), list(writes[i].failure)) for i in members], [])
           for (key, token), members in groups.items()]
    r = client.txn([], ops, [], timeout=timeout)
    out: list[Union[TxnResult, StaleToken, None]] = [None] * len(writes)
    for members, guarded in zip(groups.values(), r.responses):
        if not guarded.succeeded:
            w = writes[members[0]]
            stale = StaleToken(f"shard {w.fence.shard}: token {w.fence.token} is stale")
            FENCED.labels("stale").inc(len(members))
            for i in members:
                out[i] = stale
            continue
        for i, inner in zip(members, guarded.responses):
            FENCED.labels("ok" if inner.succeeded else "compare_failed").inc()
            out[i] = inner
    return out  # type: ignore[return-value]   # every write has its outcome


def fence_for(keys: Keys, shard: int, token: int) -> Fence:
    return Fence(shard, keys.shard(shard), token)
