"""A prefix watch that survives broken connections without leaking or spinning.

python-etcd3's Watcher starts a thread that never ends and, after a broken connection,
re-opens its stream in a tight loop (100% CPU) and drops its callbacks. This watch:
- owns exactly one thread, joined by stop();
- lists the prefix first and hands the loop a snapshot with its revision, then watches
  from revision + 1, so nothing between the list and the watch is missed;
- after a stream error, waits with capped exponential backoff and resumes from the last
  revision it delivered + 1 (no event missed, none repeated);
- when that revision was compacted, lists again and delivers a fresh snapshot.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import etcd3.etcdrpc as rpc
import grpc
from etcd3 import utils as etcd_utils

from agent.coordination.etcd import KV, EtcdClient, EtcdError, EtcdUnavailable, _kv
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
    """Calls on_snapshot(kvs, revision) and on_events(events, revision) from its thread."""

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
        self._stop = threading.Event()
        self._call = None
        self._requests: Optional[queue.SimpleQueue] = None
        self._thread: Optional[threading.Thread] = None
        self.restarts = 0

    @property
    def next_revision(self) -> Optional[int]:
        return self._next_rev

    def start(self) -> "PrefixWatch":
        self._thread = threading.Thread(target=self._run, name=f"watch-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 3.0) -> None:
        self._stop.set()
        self._cancel_stream()
        if self._thread and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def alive(self) -> bool:
        return bool(self._thread and self._thread.is_alive())

    def _cancel_stream(self) -> None:
        q, call = self._requests, self._call
        if q is not None:
            q.put(None)
        if call is not None:
            try:
                call.cancel()
            except Exception:
                pass

    def _requests_iter(self, q: "queue.SimpleQueue", first):
        yield first
        while True:
            item = q.get()
            if item is None:
                return
            yield item

    def _run(self) -> None:
        WATCH_THREADS.inc()
        backoff = 0.1
        try:
            while not self._stop.is_set():
                try:
                    if self._next_rev is None:
                        kvs, rev = self.client.get_prefix(self.prefix)
                        self.on_snapshot(kvs, rev)
                        self._next_rev = rev + 1
                    if self._stream_once():
                        backoff = 0.1  # the stream was healthy before it broke
                except (EtcdUnavailable, EtcdError) as exc:
                    log.debug("watch list failed", extra={"fields": {"watch": self.name, "error": str(exc)}})
                except Exception:  # never let a watch thread die: the agent would go blind
                    log.exception("watch failed unexpectedly; restarting it", extra={"fields": {"watch": self.name}})
                if self._stop.is_set():
                    break
                self.restarts += 1
                WATCH_RESTARTS.labels(self.name).inc()
                self._stop.wait(backoff)
                backoff = min(self.max_backoff_s, backoff * 2)
        finally:
            WATCH_THREADS.dec()

    def _stream_once(self) -> bool:
        """Run one stream until it breaks; True if it was established."""
        key = self.prefix.encode()
        create = rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
            key=key, range_end=etcd_utils.increment_last_byte(key),
            start_revision=self._next_rev, prev_kv=not self.puts_only,
            filters=[rpc.WatchCreateRequest.NODELETE] if self.puts_only else []))
        q: queue.SimpleQueue = queue.SimpleQueue()
        self._requests = q
        established = False
        gen = None
        try:
            call, gen = self.client.open_watch(self._requests_iter(q, create), self.prefix)
            self._call = call
            if self._stop.is_set():
                return False
            for resp in call:
                if self._stop.is_set():
                    return established
                if resp.compact_revision:
                    log.warning("watch revision compacted; relisting",
                                extra={"fields": {"watch": self.name, "compacted": resp.compact_revision}})
                    self._next_rev = None
                    return established
                if resp.created:
                    established = True
                if resp.canceled:
                    return established
                if resp.events:
                    events = [WatchEvent("delete" if ev.type == 1 else "put", _kv(ev.kv),
                                         _kv(ev.prev_kv) if ev.HasField("prev_kv") else None)
                              for ev in resp.events]
                    last = max(ev.kv.mod_revision for ev in resp.events)
                    self.on_events(events, last)
                    self._next_rev = last + 1
            return established
        except ValueError as exc:  # a call on a channel another thread closed
            if gen is not None:
                self.client.report_stream_failure(gen)
            log.debug("watch stream closed", extra={"fields": {"watch": self.name, "error": str(exc)}})
            return established
        except grpc.RpcError as exc:
            if not self._stop.is_set():
                log.debug("watch stream broke", extra={"fields": {"watch": self.name, "code": str(exc.code())}})
                if gen is not None:
                    self.client.report_stream_failure(gen)
            return established
        finally:
            self._call = None
            self._requests = None
            q.put(None)
