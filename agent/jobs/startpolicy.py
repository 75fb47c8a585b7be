"""Whether a firing may start now: the plant's rules, each a StartPolicy the pipeline asks
before a firing (or its next attempt) goes to admission and its claim.

A policy answers go, wait (with a reason: the firing waits, state `waiting`, and the policy
wakes it when its answer may have changed) or end (the firing ends without a run, with a
record state and a reason). Policies are asked in order; all must say go. With none, a
firing goes straight on, as before. A policy that must act on a run once it started (stop
it when a window closes, say) is also a RunListener (agent/jobs/firing.py); one that keeps
state in etcd per firing may also implement FinalOps, FiringDone or Installs below (a
staged rollout: agent/jobs/rollouts.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence, runtime_checkable

from agent.jobs.firing import Firing, FiringState
from agent.jobs.metrics import POLICY_DECISIONS, WAITING
from agent.jobs.states import JobState

if TYPE_CHECKING:
    from agent.jobs.catalog import JobEntry, Records
    from agent.jobs.statuses import Statuses
    from agent.runtime.loop import EventLoop


@dataclass(frozen=True)
class Verdict:
    kind: str            # "go", "wait" or "end"
    reason: str = ""     # wait: why (the status's reason, e.g. "window"); end: the record's reason
    state: str = ""      # end: the record state (misfired, failed, cancelled, ...); wait: the status
                         # state when not `waiting` (waiting_approval)
    detail: str = ""
    quiet: bool = False  # wait: only a moment (a probe in flight): no status, no mark


GO = Verdict("go")


def wait(reason: str, detail: str = "", quiet: bool = False, state: str = "") -> Verdict:
    return Verdict("wait", reason, state, detail=detail, quiet=quiet)


def end(state: str, reason: str, detail: str = "") -> Verdict:
    return Verdict("end", reason, state, detail)


class StartPolicy(Protocol):
    name: str   # its label in metrics and the key of its notes on a firing (Firing.notes)

    def judge(self, f: Firing) -> Verdict:
        """May ``f`` start now? Loop thread; must not block."""

    def subscribe(self, f: Firing, wake: Callable[[], None]) -> Callable[[], None]:
        """Call ``wake()`` (on the loop) when the verdict for ``f`` may have changed (also
        when it was go: a policy asked before the one ``f`` waits for may turn); returns
        what cancels that."""


# A policy that keeps state per firing (a staged rollout) also implements any of these;
# StartGate sorts its policies by them once, when it is built.
@runtime_checkable
class FinalOps(Protocol):
    def final_ops(self, f: Firing, state: str) -> list:
        """etcd ops to write in the transaction of ``f``'s final record (fenced with it)."""


@runtime_checkable
class FiringDone(Protocol):
    def done(self, f: Firing) -> None:
        """``f`` is DONE (recorded, abandoned or handed over)."""


@runtime_checkable
class Installs(Protocol):
    def installed(self, e: JobEntry, records: Records) -> None:
        """A job was (re)installed here, with the run records earlier owners left."""


class WaitMarks(Protocol):
    """Where a firing waiting on a policy is shown besides its status (etcd, for `jobs
    show` and `jobs/get`: agent/jobs/waitmarks.py)."""

    def waiting(self, f: Firing, reason: str, detail: str) -> None: ...

    def done(self, f: Firing) -> None: ...


Refuse = Callable[[Firing, str, str, str], None]   # (firing, record state, reason, detail)


class StartGate:
    """Asks the policies for each firing and keeps the waiting ones' subscriptions (loop
    thread)."""

    def __init__(self, policies: Sequence[StartPolicy], statuses: Statuses, loop: EventLoop,
                 marks: Optional[WaitMarks] = None):
        self.policies = list(policies)
        self.statuses = statuses
        self.loop = loop
        self.marks = marks
        self._final_ops = [p for p in self.policies if isinstance(p, FinalOps)]
        self._done = [p for p in self.policies if isinstance(p, FiringDone)]
        self._installs = [p for p in self.policies if isinstance(p, Installs)]
        self._cancels: dict[str, list[Callable[[], None]]] = {}   # firing key -> cancel its subscriptions
        self._waiting: dict[str, str] = {}        # firing key -> the policy it waits on
        self._counts: dict[str, int] = {}         # policy -> firings waiting on it

    def request(self, f: Firing, go: Callable[[Firing], None], refuse: Refuse) -> None:
        """``go(f)`` once every policy says go, ``refuse(...)`` if one says end."""
        self._unsubscribe(f)
        f.unmark_ready()
        for i, p in enumerate(self.policies):
            v = p.judge(f)
            if v.kind == "go":
                continue
            if v.kind == "end":
                POLICY_DECISIONS.labels(p.name, v.reason).inc()
                self.forget(f)
                refuse(f, v.state, v.reason, v.detail)
                return
            for later in self.policies[i + 1:]:   # what they noted no longer holds once this one waits
                f.notes.pop(later.name, None)
            if f.wait_reason != v.reason or f.state != FiringState.WAITING:
                f.move(FiringState.WAITING, wait_reason=v.reason)
                if not v.quiet:
                    POLICY_DECISIONS.labels(p.name, "wait").inc()
                    self.statuses.send(f.entry, f, v.state or JobState.WAITING, reason=v.reason,
                                       **({"detail": v.detail} if v.detail else {}))
                    if self.marks is not None:
                        self.marks.waiting(f, v.reason, v.detail)
            self._counted(f, p.name)
            self._cancels[f.key] = [q.subscribe(f, lambda: self._woken(f, go, refuse)) for q in self.policies[:i + 1]]
            return
        if f.key in self._waiting:
            POLICY_DECISIONS.labels(self._waiting[f.key], "go").inc()
        self.forget(f)
        go(f)

    def still(self, f: Firing) -> bool:
        """Do all policies still say go for ``f`` (asked again just before its claim: a
        window may have closed or a gate shut while it waited for node quota)?"""
        return all(p.judge(f).kind == "go" for p in self.policies)

    def _woken(self, f: Firing, go: Callable[[Firing], None], refuse: Refuse) -> None:
        if f.key in self._cancels and f.state == FiringState.WAITING:
            self.request(f, go, refuse)

    def _unsubscribe(self, f: Firing) -> None:
        for cancel in self._cancels.pop(f.key, ()):
            cancel()

    def _counted(self, f: Firing, policy: Optional[str]) -> None:
        """Keep millwright_firings_waiting{policy} (``policy`` None: ``f`` waits no more)."""
        before = self._waiting.pop(f.key, None)
        if before == policy:
            if policy is not None:
                self._waiting[f.key] = policy
            return
        for name, delta in ((before, -1), (policy, +1)):
            if name is not None:
                self._counts[name] = self._counts.get(name, 0) + delta
                WAITING.labels(name).set(self._counts[name])
        if policy is not None:
            self._waiting[f.key] = policy

    def forget(self, f: Firing) -> None:
        """``f`` no longer waits here (it went on, or ended otherwise)."""
        self._unsubscribe(f)
        if f.key in self._waiting:
            self._counted(f, None)
            if self.marks is not None:
                self.marks.done(f)

    # --- the per-firing hooks of the policies that have them (FinalOps, FiringDone, Installs)
    def final_ops(self, f: Firing, state: str) -> list:
        return [op for p in self._final_ops for op in p.final_ops(f, state)]

    def done(self, f: Firing) -> None:
        self.forget(f)
        for p in self._done:
            p.done(f)

    def installed(self, e: JobEntry, records: Records) -> None:
        for p in self._installs:
            p.installed(e, records)
