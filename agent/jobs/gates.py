"""Production gates: a template's (local config: the cloud cannot invent one) conditions
that must all hold when a run starts (docs/jobs.md). A StartPolicy: a firing whose gate
is closed waits (status ``waiting``, reason ``gate:<name>``) until the gates open, its
window closes, or the template's ``gate_timeout_s`` passes (it ends ``failed``, reason
``gate_timeout``); and a RunListener: with ``while_running: stop`` a run is stopped
(SIGTERM, SIGKILL after kill_grace_s; outcome ``gate_closed``) when one of its gates is
seen closed (unknown, e.g. the broker unreachable, stops nothing).

Values come from gatesources.py; changes wake the firings waiting on them at once. Every
gate change and every decision (waits, released, timed out, run stopped) is an audit
record. Gate values are not trusted: they only ever hold back work a signed job allows
(docs/security.md).

Loop thread only.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from agent.jobs.firing import FiringState
from agent.jobs.gatesources import EtcdGateValues, Probes, Thing, TopicValues, thing_of
from agent.jobs.metrics import GATE_CHANGES, GATE_OPEN
from agent.jobs.startpolicy import GO, Verdict, end, wait
from agent.jobs.states import EndReason, RecordState

if TYPE_CHECKING:
    from agent.config import Gate, Template
    from agent.coordination.keys import Keys
    from agent.jobs.firing import Firing
    from agent.jobs.seams import AuditSink
    from agent.runtime.loop import EventLoop

log = logging.getLogger(__name__)

STATE_NAMES = {True: "open", False: "closed", None: "unknown"}


def gated(templates: dict[str, Template]) -> bool:
    """Whether any template has gates (no gate, no policy: nothing is watched)."""
    return any(t is not None and t.gates for t in templates.values())


def topics_of(templates: dict[str, Template]) -> set[str]:
    """The MQTT topics the templates' gates read (the cloud component subscribes to them)."""
    return {g.mqtt for t in templates.values() if t is not None for g in t.gates.values() if g and g.mqtt}


class GatePolicy:
    """StartPolicy and RunListener of the templates' ``gates`` (loop thread)."""

    name = "gate"

    def __init__(self, templates: dict[str, Template], loop: EventLoop, audit: AuditSink, *,
                 topics: Optional[TopicValues] = None, client: Any = None, keys: Optional[Keys] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.templates = templates
        self.loop = loop
        self.audit = audit
        self.topics = topics
        self.clock = clock
        self.etcd = EtcdGateValues(client, keys, loop, self.changed) if keys is not None else None
        self.probes = Probes(loop, self._probed, clock)
        self.names: dict[Thing, set[str]] = {}   # what a gate reads -> its names in the templates
        for t in templates.values():
            for name, g in (t.gates if t is not None else {}).items():
                if g is not None:
                    self.names.setdefault(thing_of(g), set()).add(name)
        self.last: dict[Thing, Optional[bool]] = {}
        self.waiters: dict[Thing, dict[str, Callable[[], None]]] = {}   # firing key -> its wake
        self.running: dict[str, Firing] = {}     # runs a closing gate stops (while_running: stop)
        if topics is not None:
            topics.listen(lambda topic: loop.post(self.changed, "mqtt", topic))
        for thing in self.names:
            self._show(thing, self.state(thing), changed=False)

    def start_watches(self) -> list:
        """The etcd gates' watch (the daemon starts it with each session)."""
        return self.etcd.start_watches() if self.etcd is not None else []

    # --- values --------------------------------------------------------------------------
    def _gates(self, template: str) -> list[tuple[str, Gate]]:
        t = self.templates.get(template)
        return sorted((n, g) for n, g in t.gates.items() if g is not None) if t is not None and t.gates else []

    def state(self, thing: Thing) -> Optional[bool]:
        """True open, False closed, None unknown (a start treats it as closed)."""
        kind, source = thing[0], thing[1]
        if kind == "command":
            return self.probes.state(thing)
        if kind == "mqtt":
            value = self.topics.value(source) if self.topics is not None else None
        elif self.etcd is None or not self.etcd.known:
            return None
        else:
            value = self.etcd.value(source)
            if value is None:
                return False   # no such key: closed
        return None if value is None else value == thing[2].encode()

    def gate_state(self, template: str) -> dict[str, str]:
        """Each gate of ``template`` as open / closed / unknown (status, waiting marks)."""
        return {n: STATE_NAMES[self.state(thing_of(g))] for n, g in self._gates(template)}

    def changed(self, kind: str, source: str) -> None:
        """A topic's or key's value may have changed (any thread's news, on the loop)."""
        for thing in [t for t in self.names if t[0] == kind and t[1] == source]:
            self._changed(thing)

    def _changed(self, thing: Thing) -> None:
        """Audit and metric when the gate's state changed; wake who waits on it; stop the
        runs it guards when it closed."""
        now = self.state(thing)
        if self.last.get(thing, "?") == now:
            return
        self._show(thing, now)
        self.audit.record("gate", event="changed", gate=sorted(self.names[thing]), source=thing[0],
                          state=STATE_NAMES[now])
        self._wake(thing)
        if now is False:
            self._stop_runs(thing)

    def _probed(self, thing: Thing, ok: bool, detail: str) -> None:
        before = self.last.get(thing, "?")
        if before != ok:
            self._show(thing, ok)
            self.audit.record("gate", event="changed", gate=sorted(self.names.get(thing, ())), source="command",
                              state=STATE_NAMES[ok], detail=detail)
            if ok is False:
                self._stop_runs(thing)
        self._wake(thing)   # a firing that waited for this answer looks again, whatever it is

    def _show(self, thing: Thing, state: Optional[bool], changed: bool = True) -> None:
        self.last[thing] = state
        for n in self.names.get(thing, ()):
            GATE_OPEN.labels(n).set({True: 1, False: 0, None: -1}[state])
            if changed:
                GATE_CHANGES.labels(n, STATE_NAMES[state]).inc()

    def _wake(self, thing: Thing) -> None:
        for wake in list(self.waiters.get(thing, {}).values()):
            wake()

    # --- StartPolicy ---------------------------------------------------------------------
    def judge(self, f: Firing) -> Verdict:
        gates = self._gates(f.entry.job.template)
        if not gates:
            return GO
        job = f.entry.job
        for name, g in gates:
            state = self.state(thing_of(g))
            if state is True:
                continue
            thing = thing_of(g)
            if state is None and thing[0] == "command":
                self.probes.probe(thing)
                if f.notes.get(self.name) is None:   # asking, not closed: no waiting status for it
                    return wait(f"probe:{name}", quiet=True)
            since = f.notes.setdefault(self.name, self.clock())
            limit = self.templates[job.template].gate_timeout_s
            if limit is not None and self.clock() - since >= limit:
                f.notes.pop(self.name, None)
                self.audit.record("gate", event="gate_timeout", job=job.id, fire_id=f.fire_id, attempt=f.attempt,
                                  gate=name, waited_s=round(self.clock() - since, 3))
                return end(RecordState.FAILED, EndReason.GATE_TIMEOUT,
                           f"gate {name} stayed {STATE_NAMES[state]} for {limit:g} s (gate_timeout_s)")
            reason = f"gate:{name}"
            if f.wait_reason != reason:
                self.audit.record("gate", event="waits", job=job.id, fire_id=f.fire_id, attempt=f.attempt, gate=name,
                                  state=STATE_NAMES[state])
            return wait(reason, f"gate {name} is {STATE_NAMES[state]} ({_what(g)})")
        if f.notes.pop(self.name, None) is not None:
            self.audit.record("gate", event="released", job=job.id, fire_id=f.fire_id, attempt=f.attempt,
                              gates=[n for n, _ in gates])
        return GO

    def subscribe(self, f: Firing, wake: Callable[[], None]) -> Callable[[], None]:
        gates = self._gates(f.entry.job.template)
        if not gates:
            return _nothing
        things = {thing_of(g) for _, g in gates}
        for thing in things:
            self.waiters.setdefault(thing, {})[f.key] = wake
            if thing[0] == "command":
                self.probes.hold(thing)
        timer = None
        since, limit = f.notes.get(self.name), self.templates[f.entry.job.template].gate_timeout_s
        if since is not None and limit is not None:
            timer = self.loop.call_later(max(0.0, since + limit - self.clock()), wake)

        def cancel() -> None:
            for thing in things:
                w = self.waiters.get(thing)
                if w is not None and w.pop(f.key, None) is not None and not w:
                    del self.waiters[thing]
                if thing[0] == "command":
                    self.probes.release(thing)
            if timer is not None:
                timer.cancel()

        return cancel

    # --- RunListener ---------------------------------------------------------------------
    def run_started(self, f: Firing) -> None:
        t = self.templates.get(f.entry.job.template)
        if t is None or t.while_running != "stop" or not t.gates:
            return
        self.running[f.key] = f
        for _, g in self._gates(f.entry.job.template):
            if g.command:
                self.probes.hold(thing_of(g))

    def run_ended(self, f: Firing) -> None:
        if self.running.pop(f.key, None) is None:
            return
        for _, g in self._gates(f.entry.job.template):
            if g.command:
                self.probes.release(thing_of(g))

    def _stop_runs(self, thing: Thing) -> None:
        for f in list(self.running.values()):
            gates = self._gates(f.entry.job.template)
            closed = [n for n, g in gates if thing_of(g) == thing and self.state(thing) is False]
            if not closed or f.state != FiringState.RUNNING or f.handle is None:
                continue
            self.audit.record("gate", event="stop", job=f.entry.job.id, fire_id=f.fire_id, attempt=f.attempt,
                              gate=closed[0])
            log.info("run stopped: its gate closed", extra={"fields": {"job": f.entry.job.id, "gate": closed[0]}})
            f.handle.terminate(EndReason.GATE_CLOSED)


def _what(g: Gate) -> str:
    if g.mqtt:
        return f"mqtt {g.mqtt} must be {g.equals!r}"
    if g.etcd:
        return f"etcd {g.etcd} must be {g.equals!r}"
    return f"probe {g.command[0]} must exit 0"


def _nothing() -> None:
    pass
