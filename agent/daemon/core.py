"""The Daemon: owns the session, the shards and all agent state on one event loop.

Adapter threads (session keepalive, etcd watches and workers, MQTT, the BPF sensor, the
process reaper) only post events here. The Daemon builds the Ground (the values every part
may get), hands it to the wiring, and calls the parts through the Hooks the wiring filled.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Optional

from agent import __version__
from agent.audit import AuditLog, NullAudit
from agent.audit.events import describe_config
from agent.config import FENCE_KILL_MARGIN_S, Config, config_path, load_config, make_state_dir
from agent.coordination import placement
from agent.coordination.etcd import EtcdClient, Put
from agent.coordination.fencing import Fence, fenced_txn
from agent.coordination.keys import Keys
from agent.coordination.ownership import Ownership
from agent.coordination.pools import Placement
from agent.coordination.session import Session
from agent.coordination.shards import ShardManager
from agent.coordination.watch import PrefixWatch
from agent.coordination.worker import EtcdWorkers
from agent.daemon.ground import Audit, Ground
from agent.daemon.hooks import Hooks, Wired
from agent.errors import UserError
from agent.jobs.signing import load_keyring
from agent.runtime import logs, metrics
from agent.runtime.loop import EventLoop
from agent.runtime.metrics import counter, gauge

log = logging.getLogger(__name__)

FENCES = counter("millwright_self_fences_total", "Times the agent stopped acting for its shards", ("reason",))
ETCD_UP = gauge("millwright_etcd_up", "1 while the session lease is valid")
START_TIME = gauge("millwright_start_time_seconds", "Unix time the agent started")
# How long a thread that runs Python keeps the GIL while another waits for it (CPython's
# default is 5 ms). The loop, the spawn threads and the reaper each win the GIL back after
# every system call; beside a thread that computes (a retention pass, the json of an etcd
# page) each win waits up to this long, and a firing's path makes dozens of them.
GIL_SWITCH_S = 0.001
STOP_RECORD_S = 5.0  # after the last SIGKILL, how long a stop waits for final run records


class SdNotify:
    """systemd notify protocol (READY, WATCHDOG, STATUS) without python3-systemd."""

    def __init__(self) -> None:
        self.addr = os.environ.get("NOTIFY_SOCKET")
        usec = os.environ.get("WATCHDOG_USEC")
        self.watchdog_s = int(usec) / 1e6 if usec and usec.isdigit() else None

    def send(self, msg: str) -> None:
        if not self.addr:
            return
        addr = "\0" + self.addr[1:] if self.addr.startswith("@") else self.addr
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(msg.encode(), addr)
        except OSError:
            pass


class Daemon:
    """Owns the session, the shards and the event loop; the parts the wiring builds plug
    into its Hooks. Everything is built in the constructor: nothing is added later."""

    def __init__(self, cfg: Config, wire: Callable[[Ground], Wired]):
        self.cfg = cfg
        make_state_dir(cfg.state_dir)   # before any part makes files below it
        self.hooks = Hooks()   # the wiring's replaces it below; only the audit writer may call in before
        # the audit log first and closed last, so every part's records land in it
        self.audit: Audit = (AuditLog.from_config(cfg.audit, agent_id=cfg.agent_id, on_checkpoint=self._checkpoint)
                             if cfg.audit.dir else NullAudit())
        self.audit.config(**describe_config(cfg))
        # the signing key ring, loaded once: the cloud and the scheduler verify with the same ring
        self.keyring = load_keyring(cfg.signing.keys_file, self.audit)
        self.keys = Keys(cfg.cluster)
        self.loop = EventLoop()
        self.client = EtcdClient(cfg.etcd)
        self.workers = EtcdWorkers(self.loop.post, threads=2)
        self.notify = SdNotify()
        self.started_at = time.time()
        self.fenced_reason: Optional[str] = "starting"
        self.exit_code = 0
        self._fence_timer: Optional[Any] = None
        self._etcd_failures = 0
        self._stopping = False
        self.shards = ShardManager(cfg.agent_id, cfg.shards, self.keys, self.client, self.workers, self.loop,
                                   on_acquired=self._shard_acquired, on_lost=self._shard_lost,
                                   busy=self._shard_busy, own_old_leases=lambda: set(self.session.abandoned))
        # targeting: a shard space per placement pool, among its eligible agents
        self.placement = Placement(self.shards, cfg.cluster, on_acquired=self._shard_acquired,
                                   on_lost=self._shard_lost, busy=self._shard_busy,
                                   own_old_leases=lambda: set(self.session.abandoned))
        self.session = Session(self.client, cfg.etcd.lease_ttl_s, cfg.etcd.renew_deadline_s,
                               cfg.etcd.retry_period_s, self.loop.post,
                               on_granted=self._session_granted, on_renewed=self._session_renewed,
                               on_failed=self._session_failed, on_lost=self._session_lost)
        self.ownership = Ownership(self.session, self.shards, self.placement)
        self.watches: list[PrefixWatch] = []
        wired = wire(Ground(cfg=cfg, keys=self.keys, loop=self.loop, client=self.client, workers=self.workers,
                            session=self.session, shards=self.shards, placement=self.placement,
                            ownership=self.ownership, audit=self.audit, keyring=self.keyring,
                            stopping=lambda: self._stopping, status=self.status))
        self.hooks = wired.hooks
        self.components = wired.components
        self._probe_interval = float(os.environ.get("MILLWRIGHT_TEST_FENCED_WRITES_S", "0") or 0)

    @property
    def stopping(self) -> bool:
        """True once a graceful stop began (SIGTERM/SIGINT): periodic work stops re-arming."""
        return self._stopping

    # --- audit ---------------------------------------------------------------------
    def record(self, type_: str, **fields: Any) -> None:
        self.audit.record(type_, **fields)

    def _checkpoint(self, doc: dict) -> None:  # the audit writer's thread: hand over, never block
        for sink in self.hooks.checkpoint_sinks:
            try:
                sink(doc)
            except Exception:
                pass

    # --- session ---------------------------------------------------------------------
    def _session_granted(self, lease_id: int, ttl: int, valid_until: float) -> None:
        self._etcd_failures = 0
        log.info("session lease granted", extra={"fields": {"lease": f"{lease_id:x}", "ttl_s": ttl,
                                                            "endpoint": self.client.endpoint}})
        self.record("lease", event="granted", lease=f"{lease_id:x}", ttl_s=ttl, agent=self.cfg.agent_id)
        self.fenced_reason = None
        ETCD_UP.set(1)
        self._arm_fence(valid_until)
        for l in self.hooks.session_listeners:
            l.session_granted()
        self.shards.session_granted(lease_id, self.cfg.capacity,
                                    {"version": __version__, "host": socket.gethostname(),
                                     "started_at": self.started_at, "labels": dict(self.cfg.labels),
                                     "templates": sorted(self.cfg.templates),
                                     "templates_hash": placement.templates_digest(self.cfg.templates)})
        if not self.watches:
            self._start_watches()

    def _session_renewed(self, lease_id: int, ttl: int, valid_until: float, latency: float) -> None:
        if lease_id != self.shards.lease:
            return
        if self._etcd_failures:
            log.info("etcd reachable again", extra={"fields": {"endpoint": self.client.endpoint}})
        self._etcd_failures = 0
        self._arm_fence(valid_until)
        for l in self.hooks.session_listeners:
            l.session_renewed(latency)

    def _session_failed(self, error: str) -> None:
        for l in self.hooks.session_listeners:
            l.session_failed(error)
        self._etcd_failures += 1
        if self._etcd_failures == 1 or self._etcd_failures % 20 == 0:
            log.warning("etcd unreachable; retrying",
                        extra={"fields": {"endpoint": self.client.endpoint, "attempts": self._etcd_failures,
                                          "error": error}})

    def _session_lost(self, lease_id: int) -> None:
        if lease_id == self.shards.lease:
            self.self_fence("lease_lost")

    def _arm_fence(self, valid_until: float) -> None:
        if self._fence_timer is not None:
            self._fence_timer.cancel()
        self._fence_timer = self.loop.call_at(valid_until, self._fence_deadline)

    def _fence_deadline(self) -> None:
        self._fence_timer = None
        if self.shards.lease is not None and not self.session.is_valid():
            self.self_fence("renew_deadline")

    def self_fence(self, reason: str) -> None:
        """Stop acting for all shards now; a new session is opened and shards claimed again."""
        if self.shards.lease is None:
            return
        FENCES.labels(reason).inc()
        ETCD_UP.set(0)
        lease = self.shards.lease
        log.warning("self-fenced: stopped acting for all shards",
                    extra={"fields": {"reason": reason, "shards": len(self.shards.mine), "lease": f"{lease:x}"}})
        self.record("lease", event="self_fence", reason=reason, lease=f"{lease:x}", shards=sorted(self.shards.mine))
        self.fenced_reason = reason
        self.shards.fence(reason)
        self.placement.fence(reason)
        for w in self.watches:  # a stalled stream may never error: start clean on the new session
            w.stop(timeout=0.5)
        self.watches = []
        if not self._stopping:
            # the runs claimed under the old lease are being killed (kill_grace_s at most): do
            # not revoke it before they are dead, or a peer could take over and retry at once
            self.session.abandon(revoke_after_s=self.cfg.execute.kill_grace_s + FENCE_KILL_MARGIN_S)

    # --- watches -----------------------------------------------------------------------
    def _start_watches(self) -> None:
        post = self.loop.post
        m = PrefixWatch(self.client, self.keys.members_prefix(), "members",
                        on_snapshot=lambda kvs, rev: post(self._members_snapshot, kvs, rev),
                        on_events=lambda evs, rev: post(self._members_events, evs, rev))
        s = PrefixWatch(self.client, self.keys.shards_prefix(), "shards",
                        on_snapshot=lambda kvs, rev: post(self.shards.shards_snapshot, kvs, rev),
                        on_events=lambda evs, rev: post(self.shards.shards_events, evs, rev))
        p = PrefixWatch(self.client, self.keys.pools_prefix(), "pools",
                        on_snapshot=lambda kvs, rev: post(self.placement.snapshot, kvs, rev),
                        on_events=lambda evs, rev: post(self.placement.events, evs, rev))
        self.watches = [m.start(), s.start(), p.start()]
        for source in self.hooks.watch_sources:
            self.watches.extend(source())

    def _members_snapshot(self, kvs: list, rev: int) -> None:
        self.shards.members_snapshot(kvs, rev)
        self.placement.members_changed()

    def _members_events(self, events: list, rev: int) -> None:
        self.shards.members_events(events, rev)
        self.placement.members_changed()

    # --- shards ------------------------------------------------------------------------
    def _shard_acquired(self, fence: Fence) -> None:
        self.ownership.changed()
        self.record("shard", event="acquired", token=fence.token,
                    lease=f"{self.shards.lease:x}" if self.shards.lease else None, **self._where(fence.shard))
        for l in self.hooks.shard_listeners:
            l.shard_acquired(fence)
        if self._probe_interval:
            self.loop.call_later(0, self._probe, fence)

    def _shard_lost(self, shard: int, reason: str) -> None:
        self.ownership.changed()
        self.record("shard", event="released" if reason == "released" else "lost", reason=reason,
                    **self._where(shard))
        for l in self.hooks.shard_listeners:
            l.shard_lost(shard, reason)

    def _where(self, unit: int) -> dict:
        """A unit as an operator reads it: the shard, and its placement pool unless default."""
        if unit < self.cfg.shards:
            return {"shard": unit}
        return {"shard": unit % self.cfg.shards, "pool": self.placement.pool_of_unit(unit)}

    def _shard_busy(self, shard: int) -> bool:
        return any(check(shard) for check in self.hooks.busy_checks)

    def _probe(self, fence: Fence) -> None:
        """Test knob: periodic fenced writes that the history checker audits."""
        if self.shards.mine.get(fence.shard) != fence or self._stopping:
            return
        if self.ownership.fence_for(fence.shard) is not None:
            key = self.keys.prefix + f"test/probe/{fence.shard:04d}"
            value = json.dumps({"agent": self.cfg.agent_id, "token": fence.token})
            self.workers.submit(lambda: fenced_txn(self.client, fence, success=[Put(key, value)]),
                                lambda r, e: None)
        self.loop.call_later(self._probe_interval, self._probe, fence)

    # --- status -------------------------------------------------------------------------
    def status(self) -> dict:
        owned = sorted(self.shards.mine)
        doc = {
            "v": 1, "agent": self.cfg.agent_id, "cluster": self.cfg.cluster, "version": __version__,
            "uptime_s": round(time.time() - self.started_at, 1),
            "session": {"lease": f"{self.shards.lease:x}" if self.shards.lease else None,
                        "valid": self.session.is_valid(), "fenced": self.fenced_reason,
                        "valid_for_s": round(max(0.0, self.session.valid_until - time.monotonic()), 2),
                        "endpoint": self.client.endpoint},
            "members": {m.agent: {"capacity": m.capacity, "available": m.available, "overloaded": m.overloaded}
                        for m in self.shards.members.values()},
            "shards": {"owned": owned, "count": len(owned), "total": self.cfg.shards,
                       "draining": self.shards.draining, "load": self.shards.load.record()},
            "labels": dict(self.cfg.labels),
            "pools": self.placement.status(),
        }
        for name, provider in self.hooks.status_providers.items():
            try:
                doc[name] = provider()
            except Exception as exc:  # status must always answer
                doc[name] = {"error": str(exc)}
        return doc

    # --- lifecycle -----------------------------------------------------------------------
    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        self.loop.post(self._drain, signal.Signals(signum).name)

    def _drain(self, why: str) -> None:
        """Graceful stop, in this order, so that no shard leaves with a live run: claim
        nothing new and hand idle shards over; let runs finish for up to drain_timeout_s;
        then kill the rest (reason agent_stopped) and wait until their final records are
        written; only then stop (the lease is revoked in _shutdown, which frees the shards)."""
        if self._stopping:
            return
        self._stopping = True
        log.info("draining: handing shards over", extra={"fields": {"signal": why, "shards": len(self.shards.mine)}})
        self.notify.send("STOPPING=1")
        self.shards.drain()
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        give_up: list[float] = []   # set once the remaining runs were told to stop

        def busy() -> bool:
            return any(self._shard_busy(s) for s in self.placement.units())

        def wait_runs() -> None:
            now = time.monotonic()
            if not busy():
                self.loop.stop()
                return
            if not give_up and now >= deadline:
                n = sum(stop("agent_stopped") for stop in self.hooks.run_stoppers)
                log.warning("drain timeout: stopping the remaining runs", extra={"fields": {"runs": n}})
                # SIGKILL follows kill_grace_s after SIGTERM; then the records are written
                give_up.append(now + self.cfg.execute.kill_grace_s + STOP_RECORD_S)
            elif give_up and now >= give_up[0]:
                log.error("runs or their final records did not finish; stopping anyway")
                self.loop.stop()
                return
            self.loop.call_later(0.05, wait_runs)

        for hook in list(self.hooks.drain_hooks):
            hook(lambda: None)
        wait_runs()

    def request_reload(self) -> None:
        """SIGHUP: every reload hook, on the loop (agent/daemon/reload.py)."""
        for hook in self.hooks.reload_requests:
            self.loop.post(hook)

    def _install_signals(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self.request_stop(signum))
        signal.signal(signal.SIGHUP, lambda signum, frame: self.request_reload())

    def _watchdog(self) -> None:
        self.notify.send("WATCHDOG=1")
        if self.notify.watchdog_s:
            self.loop.call_later(self.notify.watchdog_s / 3, self._watchdog)

    def run(self) -> int:
        START_TIME.set(self.started_at)
        sys.setswitchinterval(GIL_SWITCH_S)
        log.info("agent starting", extra={"fields": {"agent": self.cfg.agent_id, "cluster": self.cfg.cluster,
                                                     "version": __version__, "config": self.cfg.source,
                                                     "endpoints": ",".join(self.cfg.etcd.endpoints)}})
        for c in self.components:
            c.start()
        self.audit.agent_start(version=__version__, agent_id=self.cfg.agent_id, pid=os.getpid(),
                               cluster=self.cfg.cluster)
        self.workers.start()
        self.session.start()
        if threading.current_thread() is threading.main_thread():
            self._install_signals()
        self.notify.send("READY=1")
        if self.notify.watchdog_s:
            self._watchdog()
        self.loop.watch_stalls(2.0)
        self.loop.run()
        return self._shutdown()

    def _shutdown(self) -> int:
        # Delete our shard keys and member key in one step by revoking the lease: peers see
        # them vanish together and claim at once.
        for w in self.watches:
            w.stop(timeout=1.0)
        # ...unless a run may still be alive (a drain that gave up): then the lease expires by
        # itself, after the executor and the run guard have killed what is left
        live = any(self._shard_busy(s) for s in self.placement.units())
        if live:
            log.warning("runs may still be alive: not revoking the lease, it expires by itself")
        self.session.stop(revoke=not live)
        self.workers.stop()
        self.audit.agent_stop(reason="drained" if self._stopping else "stopped", exit_code=self.exit_code)
        for c in reversed(self.components):
            try:
                c.stop()
            except Exception:
                log.exception("component stop failed")
        try:
            self.audit.close()   # last: every part's final records are in
        except Exception:
            log.exception("audit close failed")
        self.client.close()
        log.info("agent stopped", extra={"fields": {"exit_code": self.exit_code}})
        return self.exit_code


def cli_run(args) -> int:
    cfg = load_config(config_path(args.config))
    if os.geteuid() == 0:   # runs are isolated: a secret they could reach is a start-up error
        from agent.execute.hiding import plan

        refused = plan(cfg).refused
        if refused:
            raise UserError("; ".join(refused), 2)
    logs.setup(cfg.agent_id)
    try:
        metrics.serve(cfg.metrics.listen)
    except OSError as exc:
        raise UserError(f"metrics.listen {cfg.metrics.listen}: {exc.strerror or exc}") from None
    from agent.daemon.wiring import build

    return Daemon(cfg, build).run()
