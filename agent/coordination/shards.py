"""Shard ownership: which shards this agent should hold, claims, releases and losses.

Owned by the loop thread. Inputs are the members/ and shards/ watches, session events
and results of etcd operations run on worker threads. Desired ownership is weighted
rendezvous hashing over *available* live members, each weighted by the capacity its member
record publishes: an agent whose loop stays late publishes less of it (loadshed.py) and so
holds fewer shards. A shard is claimed with a
create-revision==0 transaction bound to the session lease; its create revision becomes
the fencing token. The desired owner of an unowned shard claims it at once; the others
wait in rank order (a short stagger each) so a slow owner never leaves a shard orphaned.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from agent.coordination import hrw
from agent.coordination.etcd import KV, Create, Delete, EtcdClient, Put
from agent.coordination.fencing import Fence, StaleToken, fenced_txn
from agent.coordination.keys import Keys
from agent.coordination.loadshed import LoadShedding
from agent.coordination.watch import WatchEvent
from agent.coordination.worker import EtcdWorkers
from agent.runtime.loop import EventLoop, Timer
from agent.runtime.metrics import counter, gauge

log = logging.getLogger(__name__)

SHARDS_OWNED = gauge("millwright_shards_owned", "Shards this agent holds")
SHARD_EVENTS = counter("millwright_shard_events_total", "Shard ownership changes", ("event",))
MEMBERS = gauge("millwright_members", "Live members seen in etcd")
LOAD_WEIGHT = gauge("millwright_placement_weight", "Share of its configured capacity this agent publishes "
                    "(below 1 while its loop stays late: it holds fewer shards)")

LOAD_TICK_S = 1.0   # how often the loop's lag is sampled for load-aware placement


@dataclass(frozen=True)
class Holder:
    agent: str
    token: int  # create revision
    lease: int


@dataclass
class Member:
    agent: str
    capacity: float
    available: bool
    lease: int
    labels: dict = field(default_factory=dict)        # targeting (agent/coordination/placement.py)
    templates: frozenset = frozenset()                # template names this agent can run
    overloaded: bool = False                          # its loop stays late (loadshed.py)


class ShardManager:
    def __init__(self, agent_id: str, shards: int, keys: Keys, client: EtcdClient, workers: EtcdWorkers,
                 loop: EventLoop, on_acquired: Callable[[Fence], None], on_lost: Callable[[int, str], None],
                 busy: Callable[[int], bool] = lambda s: False, claim_stagger_s: float = 0.3,
                 clock: Callable[[], float] = time.monotonic, own_old_leases: Callable[[], set] = set):
        self.me = agent_id
        self.shards = shards
        self.keys = keys
        self.client = client
        self.workers = workers
        self.loop = loop
        self.on_acquired = on_acquired
        self.on_lost = on_lost
        self.busy = busy
        self.claim_stagger_s = claim_stagger_s
        self.clock = clock
        self.members: dict[str, Member] = {}
        self.holders: dict[int, Holder] = {}
        self.mine: dict[int, Fence] = {}
        self.lease: Optional[int] = None  # current session lease, None while fenced
        self.registered = False
        self.draining = False
        self.unavailable_reason: Optional[str] = None  # voluntary hand-off (health policy)
        self._claiming: set[int] = set()
        self._releasing: set[int] = set()
        self._fallback: dict[int, Any] = {}  # shard -> loop timer
        self._reconcile_timer: Optional[Timer] = None
        self.members_rev = 0
        self.shards_rev = 0
        self.own_old_leases = own_old_leases  # leases this agent abandoned (their keys are ours to take back)
        self._last_busy: Optional[str] = None
        self._plan_key: tuple = ()
        self._plan_cache: dict[int, str] = {}
        self.followers: list["ShardManager"] = []  # pool managers: reconcile when we do
        # shards the last reconcile wanted to hand over but kept for their runs: only these
        # make a run's end worth a reconcile (release_idle), which at 100 runs/s would
        # otherwise walk every shard after nearly every run
        self._kept_busy: set[int] = set()
        self.load = LoadShedding()
        self._load_timer: Any = None

    # --- views --------------------------------------------------------------------
    def available_members(self) -> dict[str, float]:
        return {m.agent: m.capacity for m in self.members.values() if m.available}

    def desired(self) -> dict[int, str]:
        return self._plan(self.available_members())

    def _plan(self, members: dict[str, float]) -> dict[int, str]:
        key = tuple(sorted(members.items()))
        if key != self._plan_key:
            self._plan_key, self._plan_cache = key, hrw.assignment(self.shards, members)
        return self._plan_cache

    def owns(self, shard: int) -> Optional[Fence]:
        """The fence for shard if this agent may act for it right now."""
        if self.lease is None or shard in self._releasing:
            return None
        return self.mine.get(shard)

    # --- watch input ------------------------------------------------------------------
    def members_snapshot(self, kvs: list[KV], rev: int) -> None:
        self.members = {}
        for kv in kvs:
            self._member_put(kv)
        self.members_rev = rev
        self.reconcile_soon()

    def members_events(self, events: list[WatchEvent], rev: int) -> None:
        for ev in events:
            agent = ev.kv.key[len(self.keys.members_prefix()):]
            if ev.kind == "put":
                self._member_put(ev.kv)
            else:
                self.members.pop(agent, None)
                if agent == self.me:
                    self.registered = False
        self.members_rev = rev
        self.reconcile_soon()

    def _member_put(self, kv: KV) -> None:
        agent = kv.key[len(self.keys.members_prefix()):]
        try:
            info = json.loads(kv.value)
            cap = float(info.get("capacity", 1.0))
            available = bool(info.get("available", True))
        except (ValueError, TypeError, AttributeError):
            cap, available, info = 1.0, True, {}
        labels, templates = info.get("labels"), info.get("templates")
        labels = {str(k): v for k, v in labels.items() if isinstance(v, str)} if isinstance(labels, dict) else {}
        templates = frozenset(t for t in templates if isinstance(t, str)) if isinstance(templates, list) else frozenset()
        load = info.get("load") if isinstance(info, dict) else None
        overloaded = isinstance(load, dict) and load.get("overloaded") is True
        self.members[agent] = Member(agent, cap if cap > 0 else 1.0, available, kv.lease, labels, templates,
                                     overloaded)
        if agent == self.me and kv.lease == self.lease:
            self.registered = True

    def shards_snapshot(self, kvs: list[KV], rev: int) -> None:
        old = self.holders
        self.holders = {}
        for kv in kvs:
            s = self.keys.shard_number(kv.key)
            self.holders[s] = Holder(kv.value.decode(errors="replace"), kv.create_revision, kv.lease)
        self.shards_rev = rev
        for s in list(self.mine):
            h = self.holders.get(s)
            if h is None or h.token != self.mine[s].token:
                self._lose(s, "key_gone")
        del old
        self.reconcile_soon()

    def shards_events(self, events: list[WatchEvent], rev: int) -> None:
        for ev in events:
            try:
                s = self.keys.shard_number(ev.kv.key)
            except ValueError:
                continue
            if ev.kind == "put":
                self.holders[s] = Holder(ev.kv.value.decode(errors="replace"), ev.kv.create_revision, ev.kv.lease)
                if s in self.mine and self.mine[s].token != ev.kv.create_revision:
                    self._lose(s, "replaced")
            else:
                self.holders.pop(s, None)
                if s in self.mine:
                    self._lose(s, "key_gone")
        self.shards_rev = rev
        self.reconcile_soon()

    # --- session input -------------------------------------------------------------------
    def session_granted(self, lease_id: int, capacity: float, info: dict) -> None:
        self.lease = lease_id
        self.registered = False
        self._register(capacity, info)

    def _member_record(self, capacity: float, info: dict, lease: int) -> str:
        """Our member record: the configured capacity times the load weight (what the plan
        weighs us by), whether we take shards at all, and the load behind the weight."""
        return json.dumps({"v": 1, "agent": self.me, "capacity": round(capacity * self.load.weight, 6),
                           "available": self.unavailable_reason is None and not self.draining,
                           "reason": self.unavailable_reason, "lease": f"{lease:x}",
                           "load": self.load.record(), **info})

    def _register(self, capacity: float, info: dict) -> None:
        lease = self.lease
        assert lease is not None  # registered only under a session lease
        key = self.keys.member(self.me)
        value = self._member_record(capacity, info, lease)
        self._member_value = (capacity, info)
        if self._load_timer is None:
            LOAD_WEIGHT.set(self.load.weight)
            self._load_timer = self.loop.call_later(LOAD_TICK_S, self._load_tick)

        def op():
            # Never overwrite a live registration bound to another lease: that is either our
            # previous incarnation (it expires within the TTL) or a duplicate agent id.
            r = self.client.txn([Create(key) == 0], [Put(key, value, lease=lease)], [])
            if r.succeeded:
                return "registered"
            cur = self.client.get(key)
            if cur is None:
                return "retry"
            if cur.lease == lease:
                self.client.put(key, value, lease=lease)
                return "registered"
            if cur.lease in self.own_old_leases():
                self.client.lease_revoke(cur.lease)  # our own previous session: free it now
                return "retry"
            return f"busy:{cur.lease:x}"

        def done(result, error):
            if lease != self.lease:
                return
            if error is not None or result == "retry" or (result or "").startswith("busy"):
                if result and result.startswith("busy") and result != self._last_busy:
                    self._last_busy = result
                    log.warning("member key held by another lease (previous incarnation or duplicate agent_id); "
                                "waiting for it to expire", extra={"fields": {"lease": result[5:]}})
                elif error is not None:
                    log.warning("member registration failed; retrying", extra={"fields": {"error": str(error)}})
                self.loop.call_later(0.05 if result == "retry" else 0.5, self._register_again, lease)
                return
            self._last_busy = None
            self.registered = True
            log.info("registered as member", extra={"fields": {"lease": f"{lease:x}"}})
            self.reconcile_soon()

        self.workers.submit(op, done)

    def _register_again(self, lease: int) -> None:
        if lease == self.lease and not self.registered:
            self._register(*self._member_value)

    def member_changed(self, capacity: float, fields: dict) -> None:
        """A reload changed capacity, labels or templates: our member record is put again
        under the same lease; the plan (and each placement pool) follows from the watch."""
        if self.lease is None:
            return   # no session yet: its first registration reads the running config
        cap, info = self._member_value
        self._member_value = (capacity, {**info, **fields})
        self.update_member()

    def update_member(self) -> None:
        """Re-publish our member record (availability changed)."""
        if self.lease is not None and self.registered:
            lease = self.lease
            cap, info = self._member_value
            value = self._member_record(cap, info, lease)
            self.workers.submit(lambda: self.client.put(self.keys.member(self.me), value, lease=lease),
                                lambda r, e: None)

    def hand_off(self, reason: str) -> None:
        """Publish this agent as unavailable (the health policy's voluntary hand-off), so
        peers take its shards: the member record says so (the watch then reconciles), and
        shards kept for their runs are reconsidered now."""
        self.unavailable_reason = reason
        self.update_member()
        self.release_idle()

    def take_back(self) -> None:
        """Available again after a hand-off: the member record says so, and shards kept
        for their runs are reconsidered now."""
        self.unavailable_reason = None
        self.update_member()
        self.release_idle()

    def _load_tick(self) -> None:
        """Sample the loop's lag; publish the member record when the load policy changed
        what it says (weight, overloaded). Ticks while a session lease is held."""
        self._load_timer = None
        if self.lease is None:
            return
        headroom = any(m.available and not m.overloaded for a, m in self.members.items() if a != self.me)
        if self.load.observe(self.loop.lag(), self.clock(), headroom):
            LOAD_WEIGHT.set(self.load.weight)
            (log.warning if self.load.overloaded else log.info)("load changed: member record updated",
                                                               extra={"fields": self.load.record()})
            self.update_member()
        self._load_timer = self.loop.call_later(LOAD_TICK_S, self._load_tick)

    def fence(self, reason: str) -> None:
        """Stop acting for every shard at once (renew deadline passed or lease lost)."""
        self.lease = None
        self.registered = False
        for s in list(self.mine):
            self._lose(s, reason)
        self._claiming.clear()
        self._releasing.clear()
        for t in self._fallback.values():
            t.cancel()
        self._fallback.clear()

    # --- reconcile ---------------------------------------------------------------------
    def reconcile_soon(self) -> None:
        """Reconcile within 10 ms (once, however often asked); the followers too."""
        if self._reconcile_timer is None:
            self._reconcile_timer = self.loop.call_later(0.01, self.reconcile)
        for f in self.followers:
            f.reconcile_soon()

    def _count_owned(self) -> None:
        SHARDS_OWNED.set(len(self.mine))

    def may_claim(self) -> bool:
        """Whether this agent may take an unowned shard at all (pools: only if eligible)."""
        return True

    def _would_claim(self) -> bool:
        """Whether this agent claims a free shard that the plan does not give to a peer."""
        return not self.draining and not self.unavailable_reason and self.may_claim()

    def reconcile(self) -> None:
        self._reconcile_timer = None
        MEMBERS.set(len(self.members))
        self._count_owned()
        if self.lease is None or not self.registered:
            return
        members = self.available_members()
        plan = self._plan(members)
        self._kept_busy.clear()
        for s in range(self.shards):
            holder = self.holders.get(s)
            want = plan.get(s)
            if holder is None:
                if s in self._claiming or not self._would_claim():
                    continue
                if want == self.me or want is None:
                    self._claim(s)
                elif s not in self._fallback and self.me in members:
                    rank = hrw.ranking(s, members).index(self.me)
                    self._fallback[s] = self.loop.call_later(self.claim_stagger_s * rank, self._fallback_claim, s)
                continue
            if holder.agent == self.me and holder.lease == self.lease:
                if s not in self.mine:
                    self._acquire(s, holder.token)  # our claim's reply was lost; the key is ours
                # a shard no available member is planned for (want None: our own member
                # record not seen yet, or none available) stays with us while we would
                # claim it were it free: releasing it would only make us claim it again
                planned_away = want != self.me and not (want is None and self._would_claim())
                if (planned_away or self.draining) and s not in self._releasing:
                    if self.busy(s):
                        self._kept_busy.add(s)
                    else:
                        self._release(s)

    def _fallback_claim(self, s: int) -> None:
        self._fallback.pop(s, None)
        if s not in self.holders and s not in self._claiming and self.lease is not None and self._would_claim():
            self._claim(s)

    def _claim(self, s: int) -> None:
        key, lease = self.keys.shard(s), self.lease
        assert lease is not None  # claims are made only under a session lease
        self._claiming.add(s)
        t = self._fallback.pop(s, None)
        if t is not None:
            t.cancel()

        def op():
            return self.client.txn([Create(key) == 0], [Put(key, self.me, lease=lease)], [])

        def done(r, error):
            self._claiming.discard(s)
            if lease != self.lease:
                return
            if error is not None:
                log.debug("claim failed", extra={"fields": {"shard": s, "error": str(error)}})
                self.reconcile_soon()
                return
            if r.succeeded:
                self._acquire(s, r.revision)
                self.holders[s] = Holder(self.me, r.revision, lease)

        self.workers.submit(op, done)

    def _acquire(self, s: int, token: int) -> None:
        if s in self.mine:
            return
        fence = Fence(s, self.keys.shard(s), token)
        self.mine[s] = fence
        self._count_owned()
        SHARD_EVENTS.labels("acquired").inc()
        log.debug("shard acquired", extra={"fields": {"shard": s, "token": token}})
        self.on_acquired(fence)

    def _lose(self, s: int, reason: str) -> None:
        fence = self.mine.pop(s, None)
        self._releasing.discard(s)
        if fence is None:
            return
        self._count_owned()
        SHARD_EVENTS.labels("released" if reason == "released" else "lost").inc()
        self.on_lost(s, reason)

    def _release(self, s: int) -> None:
        fence = self.mine[s]
        self._releasing.add(s)

        def op():
            return fenced_txn(self.client, fence, success=[Delete(fence.key)])

        def done(r, error):
            if isinstance(error, StaleToken) or error is None:
                if self.mine.get(s) == fence:
                    self._lose(s, "released")
                return
            self._releasing.discard(s)
            self.reconcile_soon()

        self.workers.submit(op, done)

    def waiting_on_runs(self) -> bool:
        """Whether the last reconcile kept a shard (here or in a pool) for its runs."""
        return bool(self._kept_busy) or any(f._kept_busy for f in self.followers)

    def release_idle(self) -> None:
        """Called when runs end: shards waiting to move may go now."""
        if self.waiting_on_runs():
            self.reconcile_soon()

    def drain(self) -> None:
        self.draining = True
        for t in self._fallback.values():
            t.cancel()
        self._fallback.clear()
        self.update_member()
        self.reconcile_soon()
