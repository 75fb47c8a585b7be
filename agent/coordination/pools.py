"""Placement pools: a lease-bound shard space per target, shared by its eligible agents.

Every pool registered in etcd (pools/<pool>/spec, written with the pool's first job) gets
a shard manager on every agent. It is the same machinery as the cluster's shard space
(claims bound to the session lease, the key's create revision as fencing token, HRW with
bounded loads, fallback claims in rank order, hand-off once idle), with two differences:
the members it assigns shards to are the *eligible* ones only, and its keys live under
pools/<pool>/shards/. An agent that is not eligible never claims, and releases what it
holds. A fan-out pool has one shard space per eligible agent (pools/<pool>/agents/<id>/
shards/), held by that agent alone: each agent runs its own firing of the job.

The scheduler sees one integer per ownership unit: the cluster's shards are 0..S-1 as in
contract v1; the shards of the k-th pool this process learnt of are k*S .. k*S+S-1, so
``unit % S`` is always the job's storage shard (jobs/<shard>/<id>, runs/<shard>/...).
The numbering is local to the process; etcd only ever holds pool ids.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Optional

from agent.coordination import placement
from agent.coordination.etcd import KV
from agent.coordination.fencing import Fence
from agent.coordination.keys import Keys, PoolKeys
from agent.coordination.shards import ShardManager
from agent.coordination.watch import WatchEvent
from agent.runtime.metrics import gauge

log = logging.getLogger(__name__)

POOLS_WAITING = gauge("millwright_pools_waiting", "Placement pools with no eligible live agent",
                      ("reason",))
POOL_SHARDS_OWNED = gauge("millwright_pool_shards_owned", "Pool shards this agent holds")


class PoolShardManager(ShardManager):
    """A pool's shard space. Session, membership and drain state are the cluster
    manager's (``parent``): read through, never written here."""

    def __init__(self, parent: ShardManager, pool: str, spec: dict, keys: Keys, **kw: Any):
        self.parent = parent
        self.pool = pool
        self.spec = spec
        self.removed = False
        super().__init__(parent.me, parent.shards, keys, parent.client, parent.workers, parent.loop, **kw)

    # shared state of the cluster manager (base __init__ and fence() assign them: ignored)
    lease = property(lambda self: self.parent.lease, lambda self, v: None)
    registered = property(lambda self: self.parent.registered, lambda self, v: None)
    draining = property(lambda self: self.parent.draining, lambda self, v: None)
    unavailable_reason = property(lambda self: self.parent.unavailable_reason, lambda self, v: None)
    members = property(lambda self: self.parent.members, lambda self, v: None)

    @property
    def fanout(self) -> bool:
        return bool(self.spec.get("fanout"))

    def eligible_members(self) -> dict[str, float]:
        if self.removed:
            return {}
        return {m.agent: m.capacity for m in self.parent.members.values()
                if m.available and placement.eligible(m.agent, m.labels, m.templates, self.spec)}

    def available_members(self) -> dict[str, float]:
        members = self.eligible_members()
        if self.fanout:  # every eligible agent holds its own space
            return {self.me: members[self.me]} if self.me in members else {}
        return members

    def may_claim(self) -> bool:
        return self.me in self.available_members()

    def _count_owned(self) -> None:
        pass  # the cluster gauge counts cluster shards; Placement counts pool shards


class Placement:
    """The pools this agent knows, their managers, and the unit numbering. Loop thread."""

    def __init__(self, parent: ShardManager, cluster: str, on_acquired: Callable[[Fence], None],
                 on_lost: Callable[[int, str], None], busy: Callable[[int], bool],
                 own_old_leases: Callable[[], set]):
        self.parent = parent
        self.cluster = cluster
        self.keys = Keys(cluster)
        self.shards = parent.shards
        self.on_acquired = on_acquired
        self.on_lost = on_lost
        self.busy = busy
        self.own_old_leases = own_old_leases
        self.specs: dict[str, dict] = {}
        self.managers: dict[str, PoolShardManager] = {}
        self.index: dict[str, int] = {}           # pool -> k (units k*S ..)
        self.by_index: dict[int, PoolShardManager] = {}
        self.raw: dict[str, dict[str, KV]] = {}    # pool shard keys seen, also of pools not yet known
        self.rev = 0
        self.label_keys: set[str] = set()
        self._next_k = 1

    # --- units ----------------------------------------------------------------------------
    def unit_of(self, pool: str, storage_shard: int) -> Optional[int]:
        if pool == placement.DEFAULT_POOL:
            return storage_shard
        k = self.index.get(pool)
        return None if k is None else k * self.shards + storage_shard

    def pool_of_unit(self, unit: int) -> str:
        if unit < self.shards:
            return placement.DEFAULT_POOL
        m = self.by_index.get(unit // self.shards)
        return m.pool if m is not None else ""

    def manager_of(self, unit: int) -> ShardManager:
        if unit < self.shards:
            return self.parent
        m = self.by_index.get(unit // self.shards)
        return m if m is not None else self.parent

    def _unit_fence(self, m: PoolShardManager, fence: Optional[Fence]) -> Optional[Fence]:
        if fence is None:
            return None
        return Fence(self.index[m.pool] * self.shards + fence.shard, fence.key, fence.token)

    def owns(self, unit: int) -> Optional[Fence]:
        if unit < self.shards:
            return self.parent.owns(unit)
        m = self.by_index.get(unit // self.shards)
        return None if m is None else self._unit_fence(m, m.owns(unit % self.shards))

    def held(self, unit: int) -> Optional[Fence]:
        if unit < self.shards:
            return self.parent.mine.get(unit)
        m = self.by_index.get(unit // self.shards)
        return None if m is None else self._unit_fence(m, m.mine.get(unit % self.shards))

    def units(self) -> list[int]:
        out = list(self.parent.mine)
        for pool, m in self.managers.items():
            base = self.index[pool] * self.shards
            out.extend(base + s for s in m.mine)
        return out

    def is_fanout(self, pool: str) -> bool:
        m = self.managers.get(pool)
        return m is not None and m.fanout

    # --- lifecycle --------------------------------------------------------------------------
    def fence(self, reason: str) -> None:
        for m in self.managers.values():
            m.fence(reason)

    def changed(self) -> None:
        for m in self.managers.values():
            m.reconcile_soon()

    def _add(self, pool: str, spec: dict) -> None:
        k = self._next_k
        self._next_k += 1
        self.index[pool] = k
        fanout = bool(spec.get("fanout"))
        keys = PoolKeys(self.cluster, pool, self.parent.me if fanout else None)
        m = PoolShardManager(self.parent, pool, spec, keys,
                             on_acquired=lambda f, p=pool: self._acquired(p, f),
                             on_lost=lambda s, reason, kk=k: self.on_lost(kk * self.shards + s, reason),
                             busy=lambda s, kk=k: self.busy(kk * self.shards + s),
                             own_old_leases=self.own_old_leases)
        self.managers[pool] = m
        self.by_index[k] = m
        self.parent.followers.append(m)
        log.info("placement pool known", extra={"fields": {"pool": pool, "target": spec}})
        prefix = keys.shards_prefix()
        m.shards_snapshot([kv for key, kv in self.raw.get(pool, {}).items() if key.startswith(prefix)], self.rev)

    def _acquired(self, pool: str, fence: Fence) -> None:
        m = self.managers[pool]
        POOL_SHARDS_OWNED.set(sum(len(x.mine) for x in self.managers.values()))
        uf = self._unit_fence(m, fence)
        assert uf is not None
        self.on_acquired(uf)

    # --- watch input (pools/) ----------------------------------------------------------------
    def _split(self, key: str) -> tuple[str, str]:
        rest = key[len(self.keys.pools_prefix()):]
        pool, _, tail = rest.partition("/")
        return pool, tail

    def snapshot(self, kvs: list[KV], rev: int) -> None:
        self.rev = rev
        self.raw = {}
        specs = []
        for kv in kvs:
            pool, tail = self._split(kv.key)
            if tail == "spec":
                specs.append((pool, kv))
            else:
                self.raw.setdefault(pool, {})[kv.key] = kv
        for pool, m in self.managers.items():  # a restarted watch: managers resync
            prefix = m.keys.shards_prefix()
            m.shards_snapshot([kv for key, kv in self.raw.get(pool, {}).items() if key.startswith(prefix)], rev)
        for pool, kv in specs:
            self._spec_put(pool, kv)
        listed = {pool for pool, _ in specs}
        for pool in [p for p, m in self.managers.items() if p not in listed and not m.removed]:
            self._spec_gone(pool)  # removed while the watch was down

    def events(self, events: list[WatchEvent], rev: int) -> None:
        self.rev = rev
        for ev in events:
            pool, tail = self._split(ev.kv.key)
            if tail == "spec":
                if ev.kind == "put":
                    self._spec_put(pool, ev.kv)
                else:
                    self._spec_gone(pool)
                continue
            if ev.kind == "put":
                self.raw.setdefault(pool, {})[ev.kv.key] = ev.kv
            else:
                self.raw.get(pool, {}).pop(ev.kv.key, None)
                if not self.raw.get(pool):
                    self.raw.pop(pool, None)
            m = self.managers.get(pool)
            if m is not None and ev.kv.key.startswith(m.keys.shards_prefix()):
                m.shards_events([ev], rev)

    def _spec_put(self, pool: str, kv: KV) -> None:
        try:
            spec = json.loads(kv.value)
            if placement.pool_id(spec) != pool:
                raise ValueError("pool id does not match its spec")
        except (ValueError, TypeError, AttributeError) as exc:
            log.warning("ignoring a malformed pool spec", extra={"fields": {"pool": pool, "error": str(exc)}})
            return
        self.specs[pool] = spec
        m = self.managers.get(pool)
        if m is None:
            self._add(pool, spec)
            self.status()
        elif m.removed:
            m.removed = False
            m.reconcile_soon()

    def _spec_gone(self, pool: str) -> None:
        """Retention removed a pool without jobs: hand its shards back (nothing runs there)."""
        self.specs.pop(pool, None)
        m = self.managers.get(pool)
        if m is not None:
            m.removed = True
            m.reconcile_soon()
            self.parent.loop.call_later(0.5, self._forget, pool)

    def _forget(self, pool: str) -> None:
        """Drop a removed pool's manager once it holds nothing (bounded memory)."""
        m = self.managers.get(pool)
        if m is None or not m.removed:
            return
        if m.mine or m._claiming:
            self.parent.loop.call_later(0.5, self._forget, pool)
            return
        del self.managers[pool]
        self.by_index.pop(self.index.pop(pool), None)
        self.parent.followers.remove(m)
        log.info("placement pool removed", extra={"fields": {"pool": pool}})
        self.status()

    def members_changed(self) -> None:
        self.label_keys.update(k for m in self.parent.members.values() for k in m.labels)
        if self.managers:
            self.status()  # keeps the waiting gauge current

    # --- status -------------------------------------------------------------------------------
    def pool_state(self, pool: str) -> dict:
        """``active`` with its eligible agents, or ``waiting`` with a reason."""
        m = self.managers.get(pool)
        spec = self.specs.get(pool) or (m.spec if m is not None else {})
        eligible = sorted(m.eligible_members()) if m is not None else []
        doc: dict[str, Any] = {"pool": pool, "target": spec, "eligible": eligible,
                               "state": "active" if eligible else "waiting"}
        if not eligible:
            doc["reason"] = "no_eligible_agent"
            unknown = placement.unknown_keys(spec, self.label_keys | {k for mm in self.parent.members.values()
                                                                      for k in mm.labels})
            if unknown:
                doc["detail"] = f"no agent has published label key(s) {', '.join(unknown)} yet"
        return doc

    def status(self) -> dict:
        pools = {p: self.pool_state(p) for p in sorted(self.managers) if not self.managers[p].removed}
        for p, doc in pools.items():
            m = self.managers[p]
            doc["owned"] = sorted(m.mine)
        waiting = sum(1 for d in pools.values() if d["state"] == "waiting")
        POOLS_WAITING.labels("no_eligible_agent").set(waiting)
        return pools
