"""What a run is to the executor's callers: the spec it starts from, the handle it
returns, the result it reports, and the reasons a run ends with (see docs/execution.md)."""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Optional

from agent.execute.backends import Usage
from agent.execute.confine import DEFAULT_NETWORK
from agent.execute.limits import Limits


class ExitReason(str, enum.Enum):
    """Why a run ended, as the executor decides it. A member is its value: it compares
    equal to the string and prints and serialises as it, on every Python."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"            # a non-zero exit (or a signal the executor did not send)
    TIMED_OUT = "timed_out"      # RunSpec.timeout_s passed
    KILLED = "killed"            # terminate()'s default (a cancel), and Executor.close()
    OOM = "oom"                  # the run hit its memory limit
    PIDS_LIMIT = "pids_limit"    # the run hit its pids limit
    SPAWN_ERROR = "spawn_error"  # the job never executed (RunResult.error says why)
    FENCED = "fenced"            # the guard given to start()/prepare() turned false
    STEP_TIMED_OUT = "step_timed_out"   # no progress line for RunSpec.step_timeout_s

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


# what a run ends with when no caller terminates it with a reason of its own
REASONS = (ExitReason.SUCCEEDED, ExitReason.FAILED, ExitReason.TIMED_OUT, ExitReason.KILLED, ExitReason.OOM,
           ExitReason.PIDS_LIMIT, ExitReason.SPAWN_ERROR)
STDERR_TAIL_BYTES = 4096        # the end of a run's stderr carried in its final record and status


def tail_text(raw: bytes, total: int, limit: int = STDERR_TAIL_BYTES) -> Optional[str]:
    """The last ``limit`` bytes of an output of ``total`` bytes whose end is ``raw``, cut
    at a line start when there is one; None when there was no output."""
    raw = raw[-limit:] if limit > 0 else b""
    if not raw:
        return None
    if total > limit and b"\n" in raw[:-1]:
        raw = raw[raw.index(b"\n") + 1:]
    return raw.decode("utf-8", errors="replace")


def rfc3339(ts: Optional[float]) -> Optional[str]:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class RunSpec:
    run_key: str                           # unique among live runs (e.g. "<job_id>/<fire_id>/<attempt>")
    argv: list[str]                        # argv[0] absolute (or found on PATH); never a shell
    user: Optional[str] = None             # None: the agent's own user (dev/tests)
    limits: Limits = field(default_factory=Limits)
    timeout_s: Optional[float] = None      # None/0: no timeout
    kill_grace_s: Optional[float] = None   # None: the executor's default
    output_max_bytes: Optional[int] = None
    job_id: str = ""
    run_id: str = ""                       # one run (attempt) of a firing: "<fire_id>.<attempt>"
    attempt: int = 1
    fire_id: str = ""
    env: dict[str, str] = field(default_factory=dict)   # extra variables (never PATH tricks from the cloud)
    cwd: Optional[str] = None              # None: a fresh per-run work dir owned by the user
    # the template's confinement (applied when the executor isolates runs, docs/security.md)
    allow_root: bool = False               # a user that resolves to uid 0 may run
    network: str = DEFAULT_NETWORK         # none | internet | any
    capabilities: tuple[str, ...] = ()     # what a root run keeps (names as in capabilities(7))
    step_timeout_s: Optional[float] = None  # killed (step_timed_out) after this long without a progress line


@dataclass
class RunResult:
    run_key: str
    reason: str                            # one of REASONS, or the reason given to terminate()
    exit_code: Optional[int] = None        # None when killed by a signal or never started
    signal: Optional[int] = None
    error: Optional[str] = None            # spawn_error detail
    usage: Usage = field(default_factory=Usage)
    pid: Optional[int] = None
    started_at: Optional[float] = None     # epoch seconds
    ended_at: Optional[float] = None
    duration_s: float = 0.0                # monotonic
    stdout_path: Optional[str] = None      # None: the run wrote nothing there (no file is made)
    stderr_path: Optional[str] = None
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stderr_tail: Optional[str] = None     # its last STDERR_TAIL_BYTES (tail_text), kept in memory as it came
    output_dropped_bytes: int = 0
    backend: str = ""                      # the quota backend's name; "": the executor never saw the run
    progress: Optional[dict] = None        # its progress lines: count, the newest, invalid ones (progress.py)
    result: Optional[dict] = None          # its result document (at most 4 KiB)
    result_error: Optional[str] = None     # why what it wrote as its result was refused

    @classmethod
    def spawn_error(cls, run_key: str, error: str) -> "RunResult":
        """A run that failed before it reached the executor (its template unknown here, a
        parameter it cannot render): no process, no backend, nothing used."""
        return cls(run_key=run_key, reason=ExitReason.SPAWN_ERROR, error=error)

    def to_dict(self) -> dict:
        """The fields a run record / status document carries."""
        return {"exit_code": self.exit_code, "signal": self.signal, "reason": self.reason,
                "error": self.error, "usage": self.usage.to_dict(),
                "started_at": rfc3339(self.started_at), "ended_at": rfc3339(self.ended_at),
                "duration_s": round(self.duration_s, 6)}


class RunHandle:
    """What start() returns. pid/pgid are set when start() returns (None on spawn_error);
    `result` once the run ended. terminate() may be called from any thread.

    ``terminate_run(handle, reason, grace_s)`` is the executor's, called by terminate()."""

    def __init__(self, spec: RunSpec, terminate_run: Callable[["RunHandle", str, Optional[float]], None]):
        self._terminate_run = terminate_run
        self.spec = spec
        self.run_key = spec.run_key
        self.pid: Optional[int] = None
        self.pgid: Optional[int] = None
        self.cgroup: Optional[dict[str, str]] = None
        self.run_dir: Optional[str] = None
        self.started_at: Optional[float] = None
        self.result: Optional[RunResult] = None
        self.done = threading.Event()

    def terminate(self, reason: str = ExitReason.KILLED, grace_s: Optional[float] = None) -> None:
        """SIGTERM to the process group; SIGKILL to the group and its cgroup after the
        grace period (the run's kill_grace_s by default). The run ends with `reason`
        (e.g. "killed" for a cancel, "timed_out"). No-op once the run ended. A prepared
        run that was never released is discarded: its launcher exits without exec'ing the
        job, and the run ends with `reason`."""
        self._terminate_run(self, reason, grace_s)

    def wait(self, timeout: Optional[float] = None) -> Optional[RunResult]:
        self.done.wait(timeout)
        return self.result

    def __repr__(self) -> str:
        return f"RunHandle({self.run_key!r}, pid={self.pid})"
