"""Admission control: a run starts only when it fits the node budget.

Pure logic, owned by the daemon's event loop (no locks, no threads, no clock of its
own). Runs that do not fit wait in due-time order (ties: arrival order) and are
admitted strictly from the head of that order: a big run at the head is never starved
by smaller runs behind it, and nothing overtakes a run that has waited longer. The
budget is never overcommitted: the sum of admitted demands stays within
max_concurrent, memory_mb and cpu at every instant.

Typical use by the daemon::

    d = admission.request(run_key, due, limits)    # "admitted" | "waiting" | "rejected"
    ...
    for key in admission.release(run_key):         # when a run ended
        start(key)                                 # admitted in due order
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

from agent.execute import metrics as m
from agent.execute.limits import Limits

ADMITTED = "admitted"
WAITING = "waiting"
REJECTED = "rejected"
EPS = 1e-9


@dataclass(frozen=True)
class Budget:
    max_concurrent: int
    memory_mb: float
    cpu: float

    @classmethod
    def from_config(cls, execute_config: Any) -> "Budget":
        return cls(int(execute_config.max_concurrent), float(execute_config.memory_mb), float(execute_config.cpu))


@dataclass(frozen=True)
class Demand:
    memory_mb: float = 0.0
    cpu: float = 0.0

    @classmethod
    def of(cls, limits: Union[Demand, Limits, None]) -> "Demand":
        """From a run's Limits; None, or a limit not set, counts as 0."""
        if isinstance(limits, Demand):
            return limits
        if limits is None:
            return cls()
        return cls(float(limits.memory_mb or 0), float(limits.cpu or 0))


class AdmissionError(ValueError):
    pass


class Admission:
    def __init__(self, budget: Budget, timer=time.perf_counter):
        if budget.max_concurrent < 1 or budget.memory_mb <= 0 or budget.cpu <= 0:
            raise AdmissionError(f"invalid budget {budget}")
        self.budget = budget
        self._timer = timer
        self._seq = itertools.count()
        self._heap: list[tuple[float, int, str]] = []         # (due, seq, key); lazy deletion
        self._waiting: dict[str, tuple[float, int, Demand]] = {}
        self.running: dict[str, Demand] = {}
        self.used_memory_mb = 0.0
        self.used_cpu = 0.0
        self.max_seen_concurrent = 0
        m.RUNS_WAITING.set(0)

    # --- queries ------------------------------------------------------------------
    def fits(self, d: Demand) -> bool:
        b = self.budget
        return (len(self.running) < b.max_concurrent
                and self.used_memory_mb + d.memory_mb <= b.memory_mb + EPS
                and self.used_cpu + d.cpu <= b.cpu + EPS)

    def never_fits(self, d: Demand) -> Optional[str]:
        b = self.budget
        if d.memory_mb > b.memory_mb + EPS:
            return f"memory {d.memory_mb:g} MiB exceeds the node budget of {b.memory_mb:g} MiB"
        if d.cpu > b.cpu + EPS:
            return f"cpu {d.cpu:g} exceeds the node budget of {b.cpu:g} cores"
        return None

    def is_waiting(self, key: str) -> bool:
        return key in self._waiting

    def waiting_keys(self) -> list[str]:
        """Waiting runs in the order they will be admitted."""
        return [k for _, _, k in sorted((due, seq, k) for k, (due, seq, _) in self._waiting.items())]

    def __len__(self) -> int:
        return len(self._waiting)

    # --- decisions ------------------------------------------------------------------
    def request(self, key: str, due: float, demand: Union[Demand, Limits, None]) -> str:
        """Ask to start run `key` (due time `due`, any comparable number, e.g. epoch s).

        Returns ADMITTED (start it now; it is counted as running), WAITING (it will be
        returned by a later release()/pump() call) or REJECTED (it can never fit this
        node: see never_fits()). A key already running or waiting raises AdmissionError.
        """
        t0 = self._timer()
        d = Demand.of(demand)
        if key in self.running or key in self._waiting:
            raise AdmissionError(f"run {key!r} is already {'running' if key in self.running else 'waiting'}")
        if self.never_fits(d):
            decision = REJECTED
        elif not self._waiting and self.fits(d):
            self._admit(key, d)
            decision = ADMITTED
        else:
            seq = next(self._seq)
            self._waiting[key] = (due, seq, d)
            heapq.heappush(self._heap, (due, seq, key))
            admitted = self._pump()
            decision = ADMITTED if key in admitted else WAITING
            # others admitted by this pump (an earlier-due waiter cannot be: it would
            # have been admitted before) — only `key` can be new here.
        m.RUNS_WAITING.set(len(self._waiting))
        m.ADMISSION_DECISIONS.labels(decision).inc()
        m.ADMISSION_SECONDS.observe(self._timer() - t0)
        return decision

    def release(self, key: str) -> list[str]:
        """Run `key` ended (or was never started after admission): free its share and
        return the waiting keys admitted now, in due order. Unknown keys are ignored."""
        t0 = self._timer()
        d = self.running.pop(key, None)
        if d is not None:
            self.used_memory_mb = max(0.0, self.used_memory_mb - d.memory_mb)
            self.used_cpu = max(0.0, self.used_cpu - d.cpu)
            if not self.running:
                self.used_memory_mb = self.used_cpu = 0.0   # no float drift
        admitted = self._pump()
        m.RUNS_WAITING.set(len(self._waiting))
        if admitted:
            m.ADMISSION_DECISIONS.labels(ADMITTED).inc(len(admitted))
        m.ADMISSION_SECONDS.observe(self._timer() - t0)
        return admitted

    def cancel(self, key: str) -> list[str]:
        """Drop a waiting run (cancelled, expired, shard lost). Removing the head may let
        others in: returns the keys admitted now (like release()). Unknown keys: []."""
        if self._waiting.pop(key, None) is None:
            return []
        admitted = self._pump()
        m.RUNS_WAITING.set(len(self._waiting))
        if admitted:
            m.ADMISSION_DECISIONS.labels(ADMITTED).inc(len(admitted))
        return admitted

    # --- internals ------------------------------------------------------------------
    def _admit(self, key: str, d: Demand) -> None:
        self.running[key] = d
        self.used_memory_mb += d.memory_mb
        self.used_cpu += d.cpu
        self.max_seen_concurrent = max(self.max_seen_concurrent, len(self.running))

    def _pump(self) -> list[str]:
        admitted: list[str] = []
        while self._heap:
            due, seq, key = self._heap[0]
            entry = self._waiting.get(key)
            if entry is None or entry[1] != seq:        # cancelled or re-queued: stale
                heapq.heappop(self._heap)
                continue
            d = entry[2]
            if not self.fits(d):
                break
            heapq.heappop(self._heap)
            del self._waiting[key]
            self._admit(key, d)
            admitted.append(key)
        return admitted
