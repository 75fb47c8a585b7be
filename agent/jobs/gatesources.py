"""Where production gates get their values: a retained MQTT topic (a TopicValues the cloud
component fills from its broker link), a key below ``gates/`` in etcd (one prefix watch),
or a local probe command (run on a thread of its own, never on the loop).

A gate is named by what it reads (``Thing``): two templates' gates on the same topic, key
or command share one value. Values are not trusted (docs/security.md): a gate only ever
holds back work a signed job allows.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from agent.coordination.watch import PrefixWatch, WatchEvent
from agent.execute.processes import reap_group

if TYPE_CHECKING:
    from agent.config import Gate
    from agent.coordination.etcd import KV
    from agent.coordination.keys import Keys
    from agent.runtime.loop import EventLoop

log = logging.getLogger(__name__)

Thing = tuple   # ("mqtt", topic, equals) | ("etcd", key, equals) | ("command", argv tuple, timeout_s)

PROBE_FRESH_S = 1.0     # a probe's answer stands this long; a start asks for a new one after
PROBE_EVERY_S = 1.0     # while a firing waits on a command gate (or a run may be stopped by it), probed this often
PROBE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def thing_of(g: Gate) -> Thing:
    if g.mqtt:
        return ("mqtt", g.mqtt, g.equals or "")
    if g.etcd:
        return ("etcd", g.etcd, g.equals or "")
    return ("command", tuple(g.command), float(g.timeout_s))


class TopicValues(Protocol):
    """The last value of each gate topic on the plant broker (the cloud component's link)."""

    def value(self, topic: str) -> Optional[bytes]:
        """The topic's last (retained) payload; None when there is none or the broker is
        unreachable (unknown)."""

    def listen(self, fn: Callable[[str], None]) -> None:
        """``fn(topic)``, from any thread, when a topic's value may have changed (all of
        them when the link went down or came back)."""


class EtcdGateValues:
    """The values of the keys below ``<prefix>gates/``, from one watch (loop thread reads;
    the watch's thread posts)."""

    def __init__(self, client: Any, keys: Keys, loop: EventLoop, on_change: Callable[[str, str], None]):
        self.client = client
        self.prefix = keys.prefix
        self.loop = loop
        self.on_change = on_change
        self.values: dict[str, bytes] = {}
        self.known = False   # a snapshot came: an absent key is closed, not unknown

    def value(self, key: str) -> Optional[bytes]:
        return self.values.get(key)

    def start_watches(self) -> list[PrefixWatch]:
        w = PrefixWatch(self.client, self.prefix + "gates/", "gates",
                        on_snapshot=lambda kvs, rev: self.loop.post(self._snapshot, kvs),
                        on_events=lambda evs, rev: self.loop.post(self._events, evs))
        return [w.start()]

    def _key(self, kv: KV) -> str:
        return kv.key[len(self.prefix):]

    def _snapshot(self, kvs: list[KV]) -> None:
        old, self.values = self.values, {self._key(kv): kv.value for kv in kvs}
        self.known = True
        for key in set(old) | set(self.values):
            if old.get(key) != self.values.get(key):
                self.on_change("etcd", key)

    def _events(self, events: list[WatchEvent]) -> None:
        for ev in events:
            key = self._key(ev.kv)
            before = self.values.get(key)
            if ev.kind == "delete":
                self.values.pop(key, None)
            else:
                self.values[key] = ev.kv.value
            if before != self.values.get(key):
                self.on_change("etcd", key)


class Probes:
    """Command gates: each probe runs on a thread of its own (at most one per command at
    a time) and posts its answer to the loop; answers stand PROBE_FRESH_S."""

    def __init__(self, loop: EventLoop, on_result: Callable[[Thing, bool, str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.loop = loop
        self.on_result = on_result
        self.clock = clock
        self.results: dict[Thing, tuple[bool, float]] = {}
        self.in_flight: set[Thing] = set()
        self.interest: dict[Thing, int] = {}   # waiting firings and stoppable runs that need fresh answers
        self.timers: dict[Thing, Any] = {}

    def state(self, thing: Thing) -> Optional[bool]:
        """The probe's answer while it is fresh, else None."""
        r = self.results.get(thing)
        return r[0] if r is not None and self.clock() - r[1] < PROBE_FRESH_S else None

    def probe(self, thing: Thing) -> None:
        if thing in self.in_flight:
            return
        self.in_flight.add(thing)
        threading.Thread(target=self._run, args=(thing,), name="millwright-gate-probe", daemon=True).start()

    def hold(self, thing: Thing) -> None:
        """Keep ``thing`` fresh (probed every PROBE_EVERY_S) until release()."""
        self.interest[thing] = self.interest.get(thing, 0) + 1
        if self.state(thing) is None:
            self.probe(thing)

    def release(self, thing: Thing) -> None:
        n = self.interest.get(thing, 0) - 1
        if n > 0:
            self.interest[thing] = n
            return
        self.interest.pop(thing, None)
        timer = self.timers.pop(thing, None)
        if timer is not None:
            timer.cancel()

    def _run(self, thing: Thing) -> None:   # its own thread
        _, argv, timeout = thing
        ok, detail = False, ""
        try:
            proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, env={"PATH": PROBE_PATH, "LANG": "C.UTF-8"},
                                    cwd="/", close_fds=True, start_new_session=True)
            try:
                code = proc.wait(timeout)
                ok, detail = code == 0, f"exit {code}"
            except subprocess.TimeoutExpired:
                detail = f"no answer within {timeout:g} s"
            try:
                os.killpg(proc.pid, signal.SIGKILL)   # it, or what it left behind
            except OSError:
                pass
            proc.wait()
            reap_group(proc.pid)
        except OSError as exc:
            detail = f"cannot run: {exc.strerror or exc}"
        self.loop.post(self._done, thing, ok, detail)

    def _done(self, thing: Thing, ok: bool, detail: str) -> None:
        self.in_flight.discard(thing)
        self.results[thing] = (ok, self.clock())
        self.on_result(thing, ok, detail)
        if thing in self.interest and thing not in self.timers:
            self.timers[thing] = self.loop.call_later(PROBE_EVERY_S, self._again, thing)

    def _again(self, thing: Thing) -> None:
        self.timers.pop(thing, None)
        if thing in self.interest:
            self.probe(thing)
