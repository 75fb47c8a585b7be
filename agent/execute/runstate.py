"""The executor's state of a run while it lives: its phase, the per-run record that the
spawning thread, the release thread (or, for an armed run, the reaper) and the reaper share,
and the table of live runs."""

from __future__ import annotations

import enum
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

from agent.execute.backends import Slot, Usage
from agent.execute.output import OutputStream
from agent.execute.runs import RunHandle, RunResult

if TYPE_CHECKING:  # pragma: no cover
    from agent.execute.reaper import Timer


class RunPhase(enum.Enum):
    """starting -> running -> draining -> done. A run is *running* from its registration
    with the reaper (its launcher released, or never held) until its leader exited;
    *draining* while what it left behind is killed, reaped and its cgroup removed."""

    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    DONE = "done"


class GoPipe(NamedTuple):
    """A held launcher's go pipe: while a run has one, its job has not been released."""

    go_w: int     # the writer of the launcher's stdin (-1: closed, the launcher will not exec)
    err_r: int    # the reader of a fork-mode child's exec-error pipe (-1: none)
    path: str     # the job's executable, and
    cwd: str      # its working directory, for a spawn error's message


class Run:
    """One live run: what its handle does not show. The spawning thread fills it, the
    release thread (an armed run: the reaper) releases it, the reaper thread ends it; ``go`` is changed only under
    the RunTable's lock."""

    def __init__(self, handle: RunHandle, on_exit: Callable[[RunHandle, RunResult], Any]):
        self.handle = handle
        self.on_exit = on_exit
        self.slot: Optional[Slot] = None
        self.slot_back = False      # its slot went back to the pool (or was removed)
        self.left_behind = False    # processes outlived its leader: its slot is not reused
        self.pidfd: Optional[int] = None
        self.streams: list[OutputStream] = []
        self.phase = RunPhase.STARTING
        self.kill_reason: Optional[str] = None
        self.error: Optional[str] = None
        self.status: Optional[int] = None
        self.rusage: Any = None
        self.t0 = time.monotonic()
        self.t_end: Optional[float] = None
        self.ended_at: Optional[float] = None
        self.timers: list["Timer"] = []
        self.popen: Optional[subprocess.Popen] = None
        self.usage: Optional[Usage] = None
        self.drain_started = 0.0
        self.work_dir_created: Optional[str] = None
        self.grace = 5.0
        self.go: Optional[GoPipe] = None   # while prepared, not released
        self.on_release: Optional[Callable[[RunHandle, bool], Any]] = None
        self.guard: Optional[Callable[[], bool]] = None
        self.armed_at: Optional[float] = None   # wall clock: its launcher releases itself then
        self.confinement: Any = None   # an isolated run's Confinement (its id is given back at its end)
        self.progress: Any = None      # its ProgressChannel (agent/execute/progress.py), once spawned
        self.on_progress: Optional[Callable[[RunHandle, list], Any]] = None   # (handle, new valid lines)


class RunTable:
    """The live runs by run key (at most one per key), and which of them are *armed*
    (prepared with an armed launcher, not released yet). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, Run] = {}
        self._armed: set[Run] = set()

    def add(self, run: Run) -> None:
        """ValueError if a run of the same key is live."""
        key = run.handle.run_key
        with self._lock:
            if key in self._runs:
                raise ValueError(f"run {key!r} is already live")
            self._runs[key] = run

    def get(self, run_key: str) -> Optional[Run]:
        with self._lock:
            return self._runs.get(run_key)

    def remove(self, run_key: str) -> None:
        with self._lock:
            self._runs.pop(run_key, None)

    def handles(self) -> list[RunHandle]:
        with self._lock:
            return [r.handle for r in self._runs.values()]

    def held(self, handle: RunHandle) -> Optional[Run]:
        """The run of exactly this handle while it is prepared and not released."""
        with self._lock:
            run = self._runs.get(handle.run_key)
            return run if run is not None and run.handle is handle and run.go is not None else None

    def hold(self, run: Run, go: GoPipe) -> None:
        """The run's launcher waits for its go byte; armed if its own timer may release it."""
        with self._lock:
            run.go = go
            if run.armed_at is not None and go.go_w >= 0:
                self._armed.add(run)

    def is_held(self, run: Run) -> bool:
        with self._lock:
            return run.go is not None

    def take_go(self, run: Run) -> Optional[GoPipe]:
        """The run's go pipe, once: whoever gets it releases or discards the launcher."""
        with self._lock:
            go, run.go = run.go, None
            self._armed.discard(run)
            return go

    def take_held(self, handle: RunHandle, keep: Callable[[Run], bool]) -> Optional[tuple[Run, GoPipe]]:
        """The run of this handle and its go pipe if it is held and not ``keep(run)``
        (called under the lock)."""
        with self._lock:
            run = self._runs.get(handle.run_key)
            if run is None or run.handle is not handle or run.go is None or keep(run):
                return None
            go, run.go = run.go, None
            self._armed.discard(run)
            return run, go

    def armed(self) -> list[Run]:
        with self._lock:
            return list(self._armed)

    def any_armed(self) -> bool:
        return bool(self._armed)   # a snapshot: the reaper's loop decides only whether to tick
