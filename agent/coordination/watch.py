"""Prefix watches that survive broken connections without leaking or spinning, all on one stream.

python-etcd3's Watcher starts a thread that never ends and, after a broken connection,
re-opens its stream in a tight loop (100% CPU) and drops its callbacks. Here:
- every PrefixWatch of a client is served by one etcd watch stream and one thread (etcd
  multiplexes watches on a stream by watch id), because each stream costs two threads
  (gRPC adds one per stream for its requests) and ten wake-ups a second (gRPC polls a
  blocked stream every 0.1 s), whatever the agent is doing;
- a watch lists its prefix first and hands the loop a snapshot with its revision, then
  watches from revision + 1, so nothing between the list and the watch is missed;
- after a stream error the stream waits with capped exponential backoff and each watch
  resumes from the last revision it delivered + 1 (no event missed, none repeated);
- when a watch's revision was compacted, it lists again and delivers a fresh snapshot;
- adding or stopping a watch re-opens the stream at once, the others resuming as above;
  once stop() returns, the stopped watch's callbacks are not called again (unless one in
  flight outlasted stop's timeout);
- the thread ends when its last watch stops, and is joined by that stop().
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import etcd3.etcdrpc as rpc
import grpc
from etcd3 import utils as etcd_utils

from agent.coordination.etcd import KV, EtcdClient, EtcdError, EtcdUnavailable, as_kv
from agent.runtime.metrics import counter, gauge

log = logging.getLogger(__name__)

WATCH_RESTARTS = counter("millwright_etcd_watch_restarts_total", "Watch streams re-opened after an error", ("watch",))
WATCH_THREADS = gauge("millwright_etcd_watch_threads", "Live watch threads")


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" | "delete"
    kv: KV
    prev: Optional[KV]


class PrefixWatch:
    """Calls on_snapshot(kvs, revision) and on_events(events, revision) from the stream's
    thread (shared by the client's watches: callbacks must not block)."""

    def __init__(self, client: EtcdClient, prefix: str, name: str,
                 on_snapshot: Callable[[list[KV], int], None],
                 on_events: Callable[[list[WatchEvent], int], None],
                 start_revision: Optional[int] = None,
                 max_backoff_s: float = 2.0, puts_only: bool = False):
        """``puts_only``: etcd sends no delete events and no previous values (``prev`` is
        None): for watchers that only look at what was written (less for etcd to send and
        for this process to decode)."""
        self.client = client
        self.puts_only = puts_only
        self.prefix = prefix
        self.name = name
        self.on_snapshot = on_snapshot
        self.on_events = on_events
        self.max_backoff_s = max_backoff_s
        self._next_rev = start_revision  # None: list first
        self._stream: Optional[_WatchStream] = None
        self.stopped = False
        self.restarts = 0

    @property
    def next_revision(self) -> Optional[int]:
        return self._next_rev

    def start(self) -> "PrefixWatch":
        self._stream = _WatchStream.of(self.client)
        self._stream.add(self)
        return self

    def stop(self, timeout: float = 3.0) -> None:
        if self._stream is not None:
            self._stream.remove(self, timeout)

    def alive(self) -> bool:
        """Started, not stopped, and its stream's thread runs."""
        return bool(self._stream is not None and not self.stopped and self._stream.alive())


def _stream_owner(client: Any) -> Any:
    """The client that opens the streams (a view such as the scheduler's keys-only
    wrapper shares its client's stream)."""
    return getattr(client.open_watch, "__self__", client)


class _WatchStream:
    """One watch stream and its thread for every PrefixWatch of one client."""

    # the live stream of each client; a stream leaves when its last watch stops
    _by_client: dict[Any, "_WatchStream"] = {}
    _registry_lock = threading.Lock()  # taken before a stream's own lock

    @classmethod
    def of(cls, client: Any) -> "_WatchStream":
        owner = _stream_owner(client)
        with cls._registry_lock:
            s = cls._by_client.get(owner)
            if s is None:
                s = cls._by_client[owner] = cls(owner)
            return s

    def __init__(self, owner: Any):
        self.owner = owner
        self._lock = threading.Lock()
        self._delivering = threading.RLock()  # held while a watch's callback runs
        self._watches: list[PrefixWatch] = []
        self._changed = False                 # the set of watches changed: re-open
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._call: Any = None
        self._requests: Optional[queue.SimpleQueue] = None

    def alive(self) -> bool:
        t = self._thread
        return bool(t and t.is_alive())

    def add(self, w: PrefixWatch) -> None:
        with self._registry_lock, self._lock:
            self._watches.append(w)
            self._changed = True
            if self._thread is None:
                self._by_client[self.owner] = self
                self._thread = threading.Thread(target=self._run, name="etcd-watches", daemon=True)
                WATCH_THREADS.inc()
                self._thread.start()
        self._interrupt()

    def remove(self, w: PrefixWatch, timeout: float) -> None:
        with self._lock:
            if w.stopped:
                return
            w.stopped = True
            if w in self._watches:
                self._watches.remove(w)
            self._changed = True
            thread = self._thread if not self._watches else None
        self._interrupt()
        # wait (up to timeout, like the join below) for a callback in flight to return: none
        # starts after this (the thread checks w.stopped under this lock)
        if self._delivering.acquire(timeout=timeout):
            self._delivering.release()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _interrupt(self) -> None:
        """Make the thread re-read the set of watches: end the stream it reads, end its
        backoff wait."""
        self._wake.set()
        with self._lock:
            q, call = self._requests, self._call
        if q is not None:
            q.put(None)
        if call is not None:
            try:
                call.cancel()
            except Exception:
                pass

    @staticmethod
    def _requests_iter(q: "queue.SimpleQueue", first: list):
        yield from first
        while True:
            item = q.get()
            if item is None:
                return
            yield item

    def _run(self) -> None:
        backoff = 0.1
        try:
            while True:
                with self._registry_lock, self._lock:
                    if not self._watches:
                        self._thread = None
                        if self._by_client.get(self.owner) is self:
                            del self._by_client[self.owner]
                        return
                    self._changed = False
                    self._wake.clear()
                    watches = list(self._watches)
                error = False
                try:
                    for w in watches:
                        if w._next_rev is None:
                            kvs, rev = w.client.get_prefix(w.prefix)
                            with self._delivering:
                                if w.stopped:
                                    continue
                                w.on_snapshot(kvs, rev)
                                w._next_rev = rev + 1
                    if self._stream_once(watches):
                        backoff = 0.1  # the stream was healthy before it ended
                    with self._lock:
                        error = not self._changed
                except (EtcdUnavailable, EtcdError) as exc:
                    error = True
                    log.debug("watch list failed", extra={"fields": {"error": str(exc)}})
                except Exception:  # never let the watch thread die: the agent would go blind
                    error = True
                    log.exception("watch failed unexpectedly; restarting it")
                if not error:
                    continue  # watches added or stopped: re-open at once
                for w in watches:
                    if not w.stopped:
                        w.restarts += 1
                        WATCH_RESTARTS.labels(w.name).inc()
                self._wake.wait(backoff)
                backoff = min(min((w.max_backoff_s for w in watches), default=2.0), backoff * 2)
        finally:
            WATCH_THREADS.dec()

    def _stream_once(self, watches: list[PrefixWatch]) -> bool:
        """Run one stream for these watches until it ends; True if it was established."""
        creates = []
        for w in watches:
            key = w.prefix.encode()
            creates.append(rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
                key=key, range_end=etcd_utils.increment_last_byte(key),
                start_revision=w._next_rev, prev_kv=not w.puts_only,
                filters=[rpc.WatchCreateRequest.NODELETE] if w.puts_only else [])))
        q: queue.SimpleQueue = queue.SimpleQueue()
        pending = collections.deque(watches)  # etcd confirms creates in the order sent
        by_id: dict[int, PrefixWatch] = {}
        established = False
        gen = None
        try:
            call, gen = self.owner.open_watch(self._requests_iter(q, creates), ",".join(w.prefix for w in watches))
            with self._lock:
                self._requests, self._call = q, call
                if self._changed:
                    return established
            for resp in call:
                if resp.created and pending:
                    by_id[resp.watch_id] = pending.popleft()
                    established = True
                found = by_id.get(resp.watch_id)
                if found is None or found.stopped:
                    if self._changed:
                        return established
                    continue
                w = found
                if resp.compact_revision:
                    log.warning("watch revision compacted; relisting",
                                extra={"fields": {"watch": w.name, "compacted": resp.compact_revision}})
                    w._next_rev = None
                    return established
                if resp.canceled:
                    return established
                if resp.events:
                    events = [WatchEvent("delete" if ev.type == 1 else "put", as_kv(ev.kv),
                                         as_kv(ev.prev_kv) if ev.HasField("prev_kv") else None)
                              for ev in resp.events]
                    last = max(ev.kv.mod_revision for ev in resp.events)
                    with self._delivering:
                        if w.stopped:
                            continue
                        w.on_events(events, last)
                    w._next_rev = last + 1
            return established
        except ValueError as exc:  # a call on a channel another thread closed
            if gen is not None:
                self.owner.report_stream_failure(gen)
            log.debug("watch stream closed", extra={"fields": {"error": str(exc)}})
            return established
        except grpc.RpcError as exc:
            with self._lock:
                changed = self._changed
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                # A watch far behind gets up to 1,000 revisions in one response, which can
                # pass gRPC's 4 MiB limit: resuming at the same revision would fail for
                # ever. A paged list cannot be too large, so these watches start over from one.
                relisted = [w.name for w in watches if not w.stopped and w._next_rev is not None]
                for w in watches:
                    w._next_rev = None
                log.warning("watch response too large; relisting",
                            extra={"fields": {"watches": relisted, "error": exc.details()}})
                return established
            if not changed:
                log.debug("watch stream broke", extra={"fields": {"code": str(exc.code())}})
                if gen is not None:
                    self.owner.report_stream_failure(gen)
            return established
        finally:
            with self._lock:
                self._requests, self._call = None, None
            q.put(None)


class OnDemandWatch:
    """A watch that runs only while someone needs it: started at the first need, stopped
    ``idle_s`` after the last one went (a watch costs etcd and this process something even
    when nothing changes). Owned by the loop that ``call_later`` belongs to."""

    def __init__(self, call_later: Callable[[float, Callable[[], None]], Any],
                 make: Callable[[int], PrefixWatch], needed: Callable[[], bool], idle_s: float):
        self.call_later = call_later
        self.make = make          # revision -> a started PrefixWatch from that revision
        self.needed = needed
        self.idle_s = idle_s
        self.watch: Optional[PrefixWatch] = None
        self._idle_timer: Any = None

    @property
    def running(self) -> bool:
        return self.watch is not None

    def need_from(self, revision: int) -> None:
        """Make sure it watches (from ``revision`` when it starts now)."""
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if self.watch is None:
            self.watch = self.make(revision)

    def maybe_idle(self) -> None:
        """Called when a need went: if none is left, stop after ``idle_s``."""
        if not self.needed() and self.watch is not None and self._idle_timer is None:
            self._idle_timer = self.call_later(self.idle_s, self._stop_if_idle)

    def _stop_if_idle(self) -> None:
        self._idle_timer = None
        if not self.needed() and self.watch is not None:
            self.watch.stop(timeout=0.5)
            self.watch = None

    def stop(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if self.watch is not None:
            self.watch.stop(timeout=1.0)
            self.watch = None
