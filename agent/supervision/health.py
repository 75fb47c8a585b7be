"""Job health and exec policy: pure decisions from the kernel sensor's signals.

Two small policies, both deterministic and free of I/O, with the time passed in by the
caller (a monotonic clock), so they can be tested with a fake clock and driven by the
daemon's event loop:

* :class:`JobHealth` turns successive :class:`~agent.signals.SlotSignals` samples of one
  run into a state (healthy, degraded, stalled) using the template's
  :class:`~agent.config.HealthThresholds`, with hysteresis, and returns a
  :class:`HealthDecision` whenever the state changes. A stalled run must be ended with
  reason ``network_stall`` (``decision.end_run``).
* :class:`ExecPolicy` matches an exec's filename against the template's ``allow_exec``
  list (fnmatch on the full, normalised path); :meth:`ExecPolicy.for_run` gives the
  per-run checker that lets the executor's launcher (``/bin/sh`` shim, ``setpriv``)
  through before the job's own program starts.

The rules, thresholds and the integration guide are in docs/health.md. Everything here
runs on the loop thread; nothing blocks.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional

from agent.runtime.metrics import counter, gauge

if TYPE_CHECKING:
    from agent.config import HealthThresholds, Template
    from agent.signals.model import ExecEvent, SlotSignals

HEALTHY, DEGRADED, STALLED = "healthy", "degraded", "stalled"
STATES = (HEALTHY, DEGRADED, STALLED)
_LEVEL = {HEALTHY: 0, DEGRADED: 1, STALLED: 2}

HEALTH_CHANGES = counter("millwright_run_health_changes_total", "Run health state changes, by new state", ("state",))
RUNS_BY_HEALTH = gauge("millwright_runs_by_health", "Live runs by health state", ("state",))
EXEC_VIOLATIONS = counter("millwright_exec_policy_violations_total", "Execs outside a template's allow-list",
                          ("mode",))
for _s in STATES:  # export zeros from the start: dashboards see every series
    HEALTH_CHANGES.labels(_s)
    RUNS_BY_HEALTH.labels(_s)
for _m in ("enforce", "monitor"):
    EXEC_VIOLATIONS.labels(_m)

# Defaults of the hysteresis (docs/health.md, "Hysteresis").
CONFIRM_S = 1.0    # a rate-based worse state must hold this long (>= 2 samples) before it counts
CLEAR_S = 3.0      # a better state must hold this long (>= 2 samples) before the run recovers


# --------------------------------------------------------------------------- job health

@dataclass(frozen=True)
class HealthDecision:
    """A change of a run's health state.

    ``rule`` names the rule that decided the new state (``retrans_per_s_stalled``,
    ``stall_age``, ``retrans_per_s_degraded``, ``failed_connects`` or ``recovered``);
    ``evidence`` has the values that triggered it and the thresholds they were compared
    with. ``end_run`` is True when the run must be ended now with ``reason``
    (``network_stall``) and retried by its retry policy."""

    previous: str
    state: str
    rule: str
    at: float
    evidence: dict
    end_run: bool = False
    reason: Optional[str] = None
    slot: Optional[int] = None

    def to_record(self) -> dict:
        """Fields for an audit ``job`` record with event ``health`` (the daemon adds job, fire_id)."""
        doc = {"previous": self.previous, "state": self.state, "rule": self.rule, "evidence": dict(self.evidence),
               "end_run": self.end_run}
        if self.reason:
            doc["reason"] = self.reason
        if self.slot is not None:
            doc["slot"] = self.slot
        return doc


def classify(sig: SlotSignals, thresholds: HealthThresholds) -> tuple[str, str, bool, dict]:
    """The instantaneous state of one sample, without hysteresis.

    Returns ``(state, rule, immediate, evidence)``. ``immediate`` is True when the rule
    that decided is already an integral over time (a connection stuck for ``stall_age_s``,
    ``failed_connects`` in the sensor's window) and needs no confirmation; rate rules are
    not immediate. Rules are evaluated worst first; the first that matches decides.
    Degraded mode (``sig.available`` False) has no retransmit or connect counts: only the
    stall-age rule can fire."""
    t = thresholds
    available = bool(sig.available)
    rate = float(sig.retrans_per_s or 0.0) if available else 0.0
    age = float(sig.oldest_stall_age_s or 0.0)
    stalled_conns = int(sig.stalled_connections or 0)
    fails = int(sig.failed_connects_in_window or 0) if available else 0
    base = {"retrans_per_s": round(rate, 3), "oldest_stall_age_s": round(age, 3),
            "stalled_connections": stalled_conns, "failed_connects_in_window": fails, "available": available}
    if stalled_conns > 0 and age >= t.stall_age_s:
        return STALLED, "stall_age", True, {**base, "threshold": t.stall_age_s}
    if available and rate >= t.retrans_per_s_stalled:
        return STALLED, "retrans_per_s_stalled", False, {**base, "threshold": t.retrans_per_s_stalled}
    if available and fails >= t.failed_connects:
        return DEGRADED, "failed_connects", True, {**base, "threshold": t.failed_connects}
    if available and rate >= t.retrans_per_s_degraded:
        return DEGRADED, "retrans_per_s_degraded", False, {**base, "threshold": t.retrans_per_s_degraded}
    return HEALTHY, "recovered", False, base


class JobHealth:
    """Health of one run, from successive samples of its slot's signals.

    ``observe(sig, now)`` after each sample (``now``: monotonic seconds); it returns a
    :class:`HealthDecision` when the state changes, else None. Hysteresis (docs/health.md):

    * getting worse through a *rate* rule needs the condition (that level or worse) in
      consecutive samples spanning at least ``confirm_s``: one sample is never enough;
    * the stall-age and failed-connects rules are already measured over time by the
      sensor and apply at once;
    * getting better needs samples below the current level spanning at least ``clear_s``.

    A run that became stalled stays stalled (it is being ended). The run's entry in
    ``millwright_runs_by_health`` is kept here: call :meth:`close` when the run ends.
    """

    def __init__(self, thresholds: HealthThresholds, now: float, *, slot: Optional[int] = None, confirm_s: float = CONFIRM_S,
                 clear_s: float = CLEAR_S, end_on_stall: bool = True, track_metrics: bool = True):
        if confirm_s < 0 or clear_s < 0:
            raise ValueError("confirm_s and clear_s must not be negative")
        self.thresholds = thresholds
        self.slot = slot
        self.confirm_s = confirm_s
        self.clear_s = clear_s
        self.end_on_stall = end_on_stall
        self.state = HEALTHY
        self.rule = "start"
        self.evidence: dict = {}
        self.changed_at = now
        self.samples = 0
        self._at_least_since: dict[int, Optional[float]] = {1: None, 2: None}   # level -> first sample at/above it
        self._below_since: Optional[float] = None                                # first sample below current level
        self._track = track_metrics
        self._closed = False
        if track_metrics:
            RUNS_BY_HEALTH.labels(HEALTHY).inc()

    @property
    def stalled(self) -> bool:
        return self.state == STALLED

    def observe(self, sig: SlotSignals, now: float) -> Optional[HealthDecision]:
        self.samples += 1
        state, rule, immediate, evidence = classify(sig, self.thresholds)
        level = _LEVEL[state]
        for lvl in (1, 2):
            if level >= lvl:
                if self._at_least_since[lvl] is None:
                    self._at_least_since[lvl] = now
            else:
                self._at_least_since[lvl] = None
        cur = _LEVEL[self.state]
        if cur == 2:
            return None  # sticky: the run is being ended
        if level > cur:
            self._below_since = None
            since = self._at_least_since[level]
            if immediate or (since is not None and now - since >= self.confirm_s and now > since):
                return self._change(state, rule, now, evidence,
                                    confirmed_s=0.0 if immediate or since is None else now - since)
            # a stalled rate not yet confirmed may already confirm degraded
            if level == 2 and cur == 0:
                s1 = self._at_least_since[1]
                if s1 is not None and now - s1 >= self.confirm_s and now > s1:
                    ev = {**evidence, "threshold": self.thresholds.retrans_per_s_degraded}
                    return self._change(DEGRADED, "retrans_per_s_degraded", now, ev, confirmed_s=now - s1)
            return None
        if level < cur:
            if self._below_since is None:
                self._below_since = now
            if now - self._below_since >= self.clear_s and now > self._below_since:
                return self._change(state, "recovered" if state == HEALTHY else rule, now, evidence,
                                    confirmed_s=now - self._below_since)
            return None
        self._below_since = None
        return None

    def _change(self, state: str, rule: str, now: float, evidence: dict, confirmed_s: float) -> HealthDecision:
        prev = self.state
        self.state, self.rule, self.changed_at = state, rule, now
        self.evidence = {**evidence, "confirmed_s": round(confirmed_s, 3)}
        self._below_since = None
        HEALTH_CHANGES.labels(state).inc()
        if self._track and not self._closed:
            RUNS_BY_HEALTH.labels(prev).dec()
            RUNS_BY_HEALTH.labels(state).inc()
        end = state == STALLED and self.end_on_stall
        return HealthDecision(previous=prev, state=state, rule=rule, at=now, evidence=self.evidence, end_run=end,
                              reason="network_stall" if end else None, slot=self.slot)

    def close(self) -> None:
        """The run ended: remove it from ``millwright_runs_by_health`` (idempotent)."""
        if self._track and not self._closed:
            RUNS_BY_HEALTH.labels(self.state).dec()
        self._closed = True

    def status(self) -> dict:
        return {"state": self.state, "rule": self.rule, "since": self.changed_at, "evidence": dict(self.evidence)}


# --------------------------------------------------------------------------- exec policy

# What the executor's launcher execs before the job's own program (agent/execute/launch.py:
# SHIM_SH, the armed launcher's shells in agent/execute/armed.py, and setpriv found on
# DEFAULT_PATH). Both spellings: merged-/usr or not.
LAUNCHER_PATHS = ("/bin/sh", "/usr/bin/sh", "/bin/dash", "/usr/bin/dash", "/bin/bash", "/usr/bin/bash",
                  "/bin/lksh", "/usr/bin/lksh",
                  "/usr/bin/setpriv", "/bin/setpriv", "/usr/sbin/setpriv", "/sbin/setpriv")
LAUNCHER_MAX_EXECS = 4   # the shim execs at most: sh, setpriv (or setpriv, bash or lksh), then the job (slack for a re-exec)


@dataclass(frozen=True)
class Violation:
    """An exec outside the allow-list. ``rule`` is ``allow_exec`` (no pattern matched) or
    ``relative_path`` (the kernel reported a path that is not absolute, so it cannot be
    matched safely). ``action`` is ``kill`` (mode enforce: kill the run's process group,
    reason ``exec_policy``) or ``record`` (mode monitor)."""

    path: str
    rule: str
    mode: str
    action: str
    reason: str = "exec_policy"
    pid: Optional[int] = None
    argv: tuple = ()

    @property
    def verdict(self) -> str:
        """The ``verdict`` of the audit ``exec`` record: ``killed`` (enforce) or ``violation`` (monitor)."""
        return "killed" if self.action == "kill" else "violation"

    def to_record(self) -> dict:
        """Fields for ``audit.policy_violation(...)`` (the daemon adds job, run_id)."""
        return {"path": self.path, "rule": self.rule, "mode": self.mode,
                "action": "killed" if self.action == "kill" else "recorded", "pid": self.pid,
                "argv": list(self.argv)}


def normalise(path: str) -> str:
    """Lexical normalisation before matching: ``/a/./b//c/../d`` -> ``/a/b/d``, so that
    ``/usr/lib/jobs/../../../bin/sh`` can never match ``/usr/lib/jobs/*``. Symlinks are not
    resolved (the kernel reports the path that was executed)."""
    if not path.startswith("/"):
        return path
    p = os.path.normpath(path)
    return "/" + p.lstrip("/")  # normpath keeps a leading '//'


class ExecPolicy:
    """A template's allow-list: absolute paths and fnmatch globs on the full path.

    Glob semantics (``fnmatch.fnmatchcase``, case-sensitive): ``*`` matches any run of
    characters *including* ``/``, so ``/usr/lib/millwright/jobs/*`` also allows
    ``/usr/lib/millwright/jobs/sub/tool``; ``?`` one character; ``[seq]`` a set.
    Filenames are normalised (``..``, ``.``, ``//``) before matching. The template's own
    program (``argv[0]``) is always allowed (``allow_argv0``); everything else must match.
    An empty list therefore allows only the template's program (and the launcher).
    """

    def __init__(self, allow: Iterable[str], mode: str = "enforce", *,
                 launcher_paths: Iterable[str] = LAUNCHER_PATHS):
        if mode not in ("enforce", "monitor"):
            raise ValueError(f"exec policy mode must be enforce or monitor, not {mode!r}")
        self.patterns = tuple(allow)
        for p in self.patterns:
            if not isinstance(p, str) or not p.startswith("/"):
                raise ValueError(f"allow_exec entry {p!r} must be an absolute path or glob")
        self._exact = {normalise(p) for p in self.patterns if not any(c in p for c in "*?[")}
        self._globs = tuple(p for p in self.patterns if any(c in p for c in "*?["))
        self.mode = mode
        self.launcher_paths = frozenset(normalise(p) for p in launcher_paths)

    @classmethod
    def from_template(cls, template: Template, mode: str) -> "ExecPolicy":
        return cls(template.allow_exec, mode)

    def match(self, filename: str) -> Optional[str]:
        """The pattern that allows ``filename``, or None."""
        path = normalise(filename)
        if not path.startswith("/"):
            return None
        if path in self._exact:
            return path
        for g in self._globs:
            if fnmatch.fnmatchcase(path, g):
                return g
        return None

    def check(self, filename: str, *, pid: Optional[int] = None, argv: Iterable[str] = ()) -> Optional[Violation]:
        """Stateless check against the allow-list only (no launcher or argv[0] exemption)."""
        if self.match(filename) is not None:
            return None
        return self._violation(filename, pid, argv)

    def _violation(self, filename: str, pid: Optional[int], argv: Iterable[str]) -> Violation:
        rule = "allow_exec" if filename.startswith("/") else "relative_path"
        action = "kill" if self.mode == "enforce" else "record"
        EXEC_VIOLATIONS.labels(self.mode).inc()
        return Violation(path=normalise(filename), rule=rule, mode=self.mode, action=action, pid=pid,
                         argv=tuple(argv))

    def for_run(self, argv0: str, *, allow_argv0: bool = True,
                job_argv: Optional[list] = None) -> "RunExecPolicy":
        """The checker for one run whose job program is ``argv0`` (the resolved template argv[0]).
        With ``job_argv`` the launching phase ends only at an exec carrying the job's own
        argv: a job whose program is ``/bin/sh`` must not end it at the launcher's sh."""
        return RunExecPolicy(self, argv0, allow_argv0=allow_argv0, job_argv=job_argv)


class RunExecPolicy:
    """Exec policy of one run, including the launcher exemption.

    Phase *launching* lasts from the fork until the run's first exec of its own program
    (``argv0``). In that phase an exec of a launcher path (``/bin/sh`` shim, ``setpriv``;
    :data:`LAUNCHER_PATHS`) is allowed, at most :data:`LAUNCHER_MAX_EXECS` times. From the
    exec of ``argv0`` on, the launcher has no exemption: a job that runs ``/bin/sh`` must
    list it in ``allow_exec``. The exec of ``argv0`` itself is allowed (``allow_argv0``).
    """

    def __init__(self, policy: ExecPolicy, argv0: str, *, allow_argv0: bool = True,
                 job_argv: Optional[list] = None):
        self.policy = policy
        self.argv0 = normalise(argv0)
        self.job_argv = list(job_argv) if job_argv else None
        self.allow_argv0 = allow_argv0
        self.launching = True
        self.launcher_execs = 0
        self.violations = 0
        self.launch_ended_at: Optional[float] = None   # exec time of the job's own exec

    def check(self, filename: str, *, pid: Optional[int] = None, argv: Iterable[str] = (),
              argv_source: str = "kernel", exec_ts: Optional[float] = None) -> Optional[Violation]:
        """``argv_source`` other than ``kernel`` means the argv was read later from /proc (the
        exec raced the pid's registration), so it may already show a later exec of the same
        pid: such an argv never ends the launching phase at a launcher path.

        Events may arrive out of order (an exec that raced the pid's registration is
        delivered late): a launcher exec whose ``exec_ts`` is before the job's own exec
        belongs to the launching phase however late it is judged."""
        path = normalise(filename)
        if not self.launching and exec_ts is not None and self.launch_ended_at is not None \
                and exec_ts < self.launch_ended_at and path in self.policy.launcher_paths:
            return None
        if self.launching:
            argv = list(argv)
            if path == self.argv0 and (self._is_job_argv(argv) if argv_source == "kernel"
                                       else path not in self.policy.launcher_paths):
                self.launching = False
                self.launch_ended_at = exec_ts
                if self.allow_argv0:
                    return None
            elif path in self.policy.launcher_paths and self.launcher_execs < LAUNCHER_MAX_EXECS:
                self.launcher_execs += 1
                return None
        elif self.allow_argv0 and path == self.argv0:
            return None
        v = self.policy.check(filename, pid=pid, argv=argv)
        if v is not None:
            self.violations += 1
        return v

    def _is_job_argv(self, argv: list) -> bool:
        """The exec carries the job's own argv (the kernel may truncate args: prefixes)."""
        if self.job_argv is None or not argv:
            return True
        if len(argv) > len(self.job_argv):
            return False
        return all(j.startswith(a) for a, j in zip(argv[1:], self.job_argv[1:]))

    def check_event(self, ev: ExecEvent) -> Optional[Violation]:
        """Same for an :class:`~agent.signals.ExecEvent`."""
        return self.check(ev.filename, pid=ev.pid, argv=ev.argv, argv_source=ev.argv_source, exec_ts=ev.ts)
