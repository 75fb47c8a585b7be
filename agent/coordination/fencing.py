"""Fenced writes: the one helper every writer for a shard goes through.

The fencing token is the shard key's create revision. A transaction that compares it
succeeds only while the key this agent created still exists, so an agent that lost its
shard (lease expired, partitioned, paused) can never write for it again, whatever its
local state believes. Mirrors etcd's concurrency.Mutex.IsOwner().
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from agent.coordination.etcd import Create, EtcdClient, TxnResult
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


def fence_for(keys: Keys, shard: int, token: int) -> Fence:
    return Fence(shard, keys.shard(shard), token)
