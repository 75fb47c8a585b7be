"""Run job processes: fork/exec under quotas, as the template's user, reaped by one thread.

Life of a run (cf. Nomad's task runner hooks)::

    start()  [caller's thread, normally the daemon's event loop]
      prepare: user lookup, argv resolution, clean env, run dir, quota slot (cgroup)
      fork -> child: own process group, stdio, chdir, setgroups/setgid/setuid, rlimits,
              then BLOCKS on a pipe
      parent: setpgid, attach child to its cgroup, run the poststart hooks (the BPF
              sensor starts tracking the pid here), release the child, wait for exec
    reaper   [ONE adapter thread, "millwright-reaper"]
      pidfd of the leader + stdout/stderr pipes in one poll(); timers for timeout and
      kill grace; a watch tick that polls the backend for quota events (oom, pids)
      leader exit -> SIGKILL what is left of the group/cgroup, reap orphans of the
      group, read usage, remove the cgroup -> on_exit(handle, result)

`on_exit(handle, result)` runs ON THE REAPER THREAD: the daemon passes a function that
only posts to its loop (``lambda h, r: loop.post(self._run_ended, h, r)``). It is called
exactly once per start(), also for runs that never got a process (spawn_error).

Because the child waits for the parent before exec, nothing the job does happens before
it is in its cgroup and before every poststart hook ran: no exec is missed by the sensor.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import logging
import os
import pwd
import queue
import resource
import select
import shutil
import signal
import subprocess
import threading
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Optional

from agent.execute import metrics as m
from agent.execute.backends import QuotaBackend, Slot, Usage, probe, safe_name
from agent.execute.limits import Limits, default_limits

log = logging.getLogger("millwright.execute")

# Python 3.12 warns on fork() in a threaded process; our child only makes system calls
# (no locks, no imports, no logging) before exec, which is what makes it safe.
warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks.*", category=DeprecationWarning)

REASONS = ("succeeded", "failed", "timed_out", "killed", "oom", "pids_limit", "spawn_error")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_RESET_SIGNALS = tuple(getattr(signal, n) for n in (
    "SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGPIPE", "SIGXFSZ", "SIGXCPU", "SIGUSR1", "SIGUSR2",
    "SIGCHLD", "SIGALRM", "SIGTSTP", "SIGTTIN", "SIGTTOU") if hasattr(signal, n))
# The launcher of the default ("shim") spawn mode. Forking a large Python process costs
# tens of milliseconds (page tables, copy-on-write faults); subprocess's vfork path costs
# about one. But a vfork child cannot wait for our go-ahead or switch users, so it execs
# this constant script, which blocks on stdin (the go pipe) while the agent puts it into
# its cgroup, sets its rlimits and runs the poststart hooks, then execs the job (through
# setpriv when a user switch is needed). The job's argv are positional parameters
# ("$@"): never parsed by the shell.
SHIM_SH = "/bin/sh"
SHIM_SCRIPT = 'read -r _ || exit 126\nexec </dev/null\nunset PWD OLDPWD\nexec "$@"'
_MAXFD = os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 65536


def rfc3339(ts: Optional[float]) -> Optional[str]:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# --------------------------------------------------------------------------- data


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
    run_id: str = ""
    attempt: int = 1
    env: dict[str, str] = field(default_factory=dict)   # extra variables (never PATH tricks from the cloud)
    cwd: Optional[str] = None              # None: a fresh per-run work dir owned by the user


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
    stdout_path: Optional[str] = None
    stderr_path: Optional[str] = None
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    output_dropped_bytes: int = 0
    backend: str = ""

    def to_dict(self) -> dict:
        """The fields a run record / status document carries."""
        return {"exit_code": self.exit_code, "signal": self.signal, "reason": self.reason,
                "error": self.error, "usage": self.usage.to_dict(),
                "started_at": rfc3339(self.started_at), "ended_at": rfc3339(self.ended_at),
                "duration_s": round(self.duration_s, 6)}


class RunHandle:
    """What start() returns. pid/pgid are set when start() returns (None on spawn_error);
    `result` once the run ended. terminate() may be called from any thread."""

    def __init__(self, executor: "Executor", spec: RunSpec):
        self._executor = executor
        self.spec = spec
        self.run_key = spec.run_key
        self.pid: Optional[int] = None
        self.pgid: Optional[int] = None
        self.cgroup: Optional[dict[str, str]] = None
        self.run_dir: Optional[str] = None
        self.started_at: Optional[float] = None
        self.result: Optional[RunResult] = None
        self.done = threading.Event()

    def terminate(self, reason: str = "killed", grace_s: Optional[float] = None) -> None:
        """SIGTERM to the process group; SIGKILL to the group and its cgroup after the
        grace period (the run's kill_grace_s by default). The run ends with `reason`
        (e.g. "killed" for a cancel, "timed_out"). No-op once the run ended. A prepared
        run that was never released is discarded: its launcher exits without exec'ing the
        job, and the run ends with `reason`."""
        if self._executor._discard_held(self, reason):
            return
        self._executor._reaper.post(self._executor._terminate, self, reason, grace_s)

    def wait(self, timeout: Optional[float] = None) -> Optional[RunResult]:
        self.done.wait(timeout)
        return self.result

    def __repr__(self) -> str:
        return f"RunHandle({self.run_key!r}, pid={self.pid})"


class _Stream:
    __slots__ = ("rfd", "wfd", "path", "written", "dropped", "limit")

    def __init__(self, rfd: int, path: str, limit: int):
        self.rfd = rfd
        self.path = path
        self.wfd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)  # state files are root-only (issue 16)
        self.written = 0
        self.dropped = 0
        self.limit = limit

    def feed(self, data: bytes) -> None:
        keep = max(0, min(len(data), self.limit - self.written))
        if keep:
            view = memoryview(data)[:keep]
            while view:
                n = os.write(self.wfd, view)
                view = view[n:]
            self.written += keep
        self.dropped += len(data) - keep

    def close(self) -> None:
        for fd in (self.rfd, self.wfd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.rfd = self.wfd = -1


class _Run:
    """Reaper-owned state of one run."""

    def __init__(self, handle: RunHandle, on_exit: Callable[[RunHandle, RunResult], Any]):
        self.handle = handle
        self.on_exit = on_exit
        self.slot: Optional[Slot] = None
        self.pidfd: Optional[int] = None
        self.streams: list[_Stream] = []
        self.phase = "starting"          # starting -> running -> draining -> done
        self.kill_reason: Optional[str] = None
        self.error: Optional[str] = None
        self.status: Optional[int] = None
        self.rusage: Any = None
        self.t0 = time.monotonic()
        self.t_end: Optional[float] = None
        self.ended_at: Optional[float] = None
        self.timers: list["_Timer"] = []
        self.popen: Optional[subprocess.Popen] = None
        self.usage: Optional[Usage] = None
        self.drain_started = 0.0
        self.work_dir_created: Optional[str] = None
        self.grace = 5.0
        self.go: Optional[tuple] = None  # (go_w, err_r, path, cwd) while prepared, not released
        self.on_release: Optional[Callable[[RunHandle, bool], Any]] = None
        self.guard: Optional[Callable[[], bool]] = None


class _Timer:
    __slots__ = ("when", "fn", "args", "cancelled")

    def __init__(self, when, fn, args):
        self.when, self.fn, self.args, self.cancelled = when, fn, args, False

    def cancel(self) -> None:
        self.cancelled = True
        self.fn, self.args = _noop, ()   # no reference cycle run -> timers -> timer -> run


def _noop(*_: Any) -> None:
    pass


USER_CACHE_S = 10.0
_users: dict[str, tuple[float, Any]] = {}
_users_lock = threading.Lock()


def _lookup_user(name: str) -> Optional[tuple[Any, tuple[int, ...]]]:
    """(passwd entry, groups) of a run-as user, or None. Cached for USER_CACHE_S: NSS
    reads /etc/passwd and /etc/group on every call (a quarter of a millisecond per spawn
    on a busy gateway), and the few templates' users hardly ever change."""
    now = time.monotonic()
    with _users_lock:
        hit = _users.get(name)
        if hit is not None and now - hit[0] < USER_CACHE_S:
            return hit[1]
    try:
        pw = pwd.getpwnam(name)
        value = (pw, tuple(os.getgrouplist(pw.pw_name, pw.pw_gid)))
    except KeyError:
        value = None
    with _users_lock:
        if len(_users) > 256:
            _users.clear()
        _users[name] = (now, value)
    return value


class SpawnError(Exception):
    def __init__(self, stage: str, message: str):
        super().__init__(message)
        self.stage = stage


# --------------------------------------------------------------------------- child


def _child(go_r: int, err_w: int, out_w: int, errp_w: int, cwd: str, ids: Optional[tuple],
           rlimits: list, path: str, argv: list, env: dict) -> None:  # pragma: no cover - runs in the child
    """Between fork and exec: system calls only. Never returns."""
    stage = "setup"
    try:
        for s in _RESET_SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        os.setpgid(0, 0)
        stage = "stdio"
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(errp_w, 2)
        stage = "user"
        if ids is not None:
            uid, gid, groups = ids
            os.setgroups(groups)
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        stage = "chdir"
        os.chdir(cwd)
        stage = "rlimit"
        for res, val in rlimits:
            hard = resource.getrlimit(res)[1]
            if hard != resource.RLIM_INFINITY:
                val = min(val, hard)
            resource.setrlimit(res, (val, val))
        stage = "wait"
        if os.read(go_r, 1) != b"g":
            os._exit(126)
        os.closerange(3, err_w)
        os.closerange(err_w + 1, _MAXFD)
        stage = "exec"
        os.execve(path, argv, env)
    except BaseException as exc:  # noqa: BLE001 - nothing may escape into the parent's code
        try:
            os.write(err_w, f"{stage}:{getattr(exc, 'errno', 0) or 0}:{exc}".encode()[:1000])
        except BaseException:  # noqa: BLE001
            pass
    os._exit(127)


# --------------------------------------------------------------------------- executor


class Executor:
    """Start runs under a quota backend; one reaper thread reports their ends.

    Threading: start() is meant to be called from one thread (the daemon's loop);
    terminate(), usage() and live() are safe from any thread; on_exit callbacks and
    poststart hooks: see the module docstring.
    """

    def __init__(self, backend: QuotaBackend, base_dir: str, *, output_max_bytes: int = 1024 * 1024,
                 kill_grace_s: float = 5.0, poststart: Optional[list] = None, watch_interval_s: float = 0.2,
                 subreaper: bool = True, keep_work_dir: bool = False, drain_timeout_s: float = 5.0,
                 spawn_mode: str = "auto"):
        self.backend = backend
        self._setpriv = shutil.which("setpriv", path=DEFAULT_PATH)
        if spawn_mode == "auto":
            spawn_mode = "shim" if (self._setpriv and os.access(SHIM_SH, os.X_OK)) else "fork"
        if spawn_mode not in ("shim", "fork"):
            raise ValueError(f"spawn_mode must be auto, shim or fork, not {spawn_mode!r}")
        self.spawn_mode = spawn_mode
        self.base_dir = os.path.abspath(base_dir)
        self.output_max_bytes = int(output_max_bytes)
        self.kill_grace_s = float(kill_grace_s)
        self.poststart: list[Callable[[RunHandle], Any]] = list(poststart or [])
        self.watch_interval_s = watch_interval_s
        self.keep_work_dir = keep_work_dir
        self.drain_timeout_s = drain_timeout_s
        self._lock = threading.Lock()
        self._live: dict[str, _Run] = {}
        os.makedirs(self.base_dir, mode=0o711, exist_ok=True)
        try:
            os.chmod(self.base_dir, 0o711)   # job users traverse to their work dir, list nothing
        except OSError:
            pass
        if subreaper:
            _set_child_subreaper()
        self._reaper = _Reaper(self)
        self._reaper.start()
        self._releaser = _Releaser(self)

    @classmethod
    def from_config(cls, execute_config: Any, base_dir: str, root_name: str = "millwright",
                    reclaim: bool = True, **kw: Any) -> "Executor":
        """The daemon's constructor: probe the configured backend (reclaiming run cgroups
        a dead predecessor left) and apply execute.* settings."""
        backend = probe(execute_config.quota_backend, root_name=root_name, reclaim=reclaim)
        log.info("quota backend", extra={"fields": {"backend": backend.name, "why": backend.why}})
        ex = cls(backend, base_dir, output_max_bytes=execute_config.output_max_bytes,
                 kill_grace_s=execute_config.kill_grace_s, **kw)
        ex.default_limits = default_limits(execute_config)
        return ex

    default_limits = Limits()

    # --- public -------------------------------------------------------------------
    def start(self, spec: RunSpec, on_exit: Callable[[RunHandle, RunResult], Any]) -> RunHandle:
        """Start a run; always returns a handle, on_exit(handle, result) follows exactly
        once on the reaper thread. Raises ValueError only for a run_key already live."""
        return self._start(spec, on_exit, hold=False)

    def prepare(self, spec: RunSpec, on_exit: Callable[[RunHandle, RunResult], Any], *,
                release_at: Optional[float] = None,
                on_release: Optional[Callable[[RunHandle, bool], Any]] = None,
                guard: Optional[Callable[[], bool]] = None) -> RunHandle:
        """Everything start() does except letting the job exec: the launcher waits in its
        quota container (pid known, poststart hooks done) until release(). This takes the
        costly part (cgroup, fork, user lookup) off the due time. With ``release_at``
        (time.monotonic()) the reaper thread releases it then, off the caller's busy loop,
        and calls ``on_release(handle, ok)`` there; if ``guard()`` (thread-safe) is false at
        that moment the run is discarded with reason ``fenced`` instead. terminate() before
        the release discards it; on_exit follows exactly once either way."""
        handle = self._start(spec, on_exit, hold=True)
        if release_at is not None:
            with self._lock:
                run = self._live.get(handle.run_key)
                held = run is not None and run.handle is handle and run.go is not None
            if held:
                run.on_release = on_release
                run.guard = guard
                self._releaser.at(release_at, run)
        return handle

    def release(self, handle: RunHandle) -> bool:
        """Let a prepared run exec its job (microseconds: one pipe write). False if it was
        not prepared, already released, discarded or could not be confined."""
        with self._lock:
            run = self._live.get(handle.run_key)
            if run is None or run.handle is not handle or run.go is None:
                return False
        self._go(run)
        self._reaper.post(self._register, run)
        return run.error is None

    def _timed_release(self, run: _Run) -> None:
        # read both first: a discarded run may be finalised (fields cleared) by the reaper
        # before this thread gets to the callback
        guard, on_release = run.guard, run.on_release
        if guard is not None and not guard():
            ok = False
            self._discard_held(run.handle, "fenced")
        else:
            ok = self.release(run.handle)
        if on_release is not None:
            try:
                on_release(run.handle, ok)
            except Exception:
                log.exception("on_release callback failed", extra={"fields": {"run": run.handle.run_key}})

    def _discard_held(self, handle: RunHandle, reason: str) -> bool:
        with self._lock:
            run = self._live.get(handle.run_key)
            if run is None or run.handle is not handle or run.go is None:
                return False
            go_w, err_r, _, _ = run.go
            run.go = None
        run.kill_reason = reason
        for fd in (go_w, err_r):
            if fd >= 0:
                os.close(fd)   # the launcher's read of the go pipe fails: it exits without exec
        if handle.pid:
            _kill(handle.pid)
        self._reaper.post(self._register, run)
        return True

    def _start(self, spec: RunSpec, on_exit: Callable[[RunHandle, RunResult], Any], hold: bool) -> RunHandle:
        t0 = time.perf_counter()
        handle = RunHandle(self, spec)
        run = _Run(handle, on_exit)
        run.grace = self.kill_grace_s if spec.kill_grace_s is None else float(spec.kill_grace_s)
        with self._lock:
            if spec.run_key in self._live:
                raise ValueError(f"run {spec.run_key!r} is already live")
            self._live[spec.run_key] = run
        try:
            self._spawn(run, hold)
        except SpawnError as exc:   # before fork: no process
            run.error = str(exc)
            m.SPAWN_ERRORS.labels(exc.stage).inc()
            log.warning("run could not start", extra={"fields": {
                "run": spec.run_key, "stage": exc.stage, "error": str(exc)}})
            self._reaper.post(self._finalize, run)
            return handle
        except Exception as exc:    # a bug or an unexpected OS error: still one clean result
            log.exception("starting a run failed", extra={"fields": {"run": spec.run_key}})
            run.error = f"internal error: {exc}"
            m.SPAWN_ERRORS.labels("internal").inc()
            if handle.pid is None:
                self._reaper.post(self._finalize, run)
                return handle
            _kill(handle.pid)       # a process exists: let the reaper reap it
            with self._lock:
                go, run.go = run.go, None
            for fd in (go or ())[:2]:
                if fd >= 0:
                    os.close(fd)
        m.SPAWN_SECONDS.labels(self.backend.name).observe(time.perf_counter() - t0)
        m.RUNS_RUNNING.inc()
        with self._lock:
            held = run.go is not None
        if not held:
            self._reaper.post(self._register, run)
        return handle

    def usage(self, handle: RunHandle) -> Usage:
        """Usage of a live run so far (cgroup backends; rlimit: polled figures only)."""
        with self._lock:
            run = self._live.get(handle.run_key)
        if run is None or run.slot is None:
            return handle.result.usage if handle.result else Usage()
        return self.backend.usage(run.slot)

    def live(self) -> list[RunHandle]:
        with self._lock:
            return [r.handle for r in self._live.values()]

    def close(self, timeout: float = 15.0, close_backend: bool = True) -> None:
        """Terminate live runs (reason "killed"), wait for them, stop the reaper."""
        for h in self.live():
            h.terminate("killed")
        deadline = time.monotonic() + timeout
        for h in self.live():
            h.wait(max(0.0, deadline - time.monotonic()))
        self._releaser.stop()
        self._reaper.stop()
        self._reaper.join(timeout=5)
        for _ in range(50):   # run cgroups the kernel did not let go of at once
            self._reaper.retry_orphan_slots()
            if not self._reaper.orphan_slots:
                break
            time.sleep(0.02)
        if close_backend:
            self.backend.close()

    # --- spawning (caller's thread) -------------------------------------------------
    def _prepare(self, run: _Run) -> tuple:
        spec = run.handle.spec
        if not spec.argv or not all(isinstance(a, str) and "\0" not in a for a in spec.argv):
            raise SpawnError("argv", "argv must be a non-empty list of strings without NUL")
        ids = None
        home = None
        name = None
        if spec.user is not None:
            looked_up = _lookup_user(spec.user)
            if looked_up is None:
                raise SpawnError("user", f"user {spec.user!r} does not exist on this node")
            pw, groups = looked_up
            if os.geteuid() != 0 and pw.pw_uid != os.geteuid():
                raise SpawnError("user", f"cannot run as {spec.user!r}: the agent is not root")
            if pw.pw_uid != os.geteuid() or pw.pw_gid != os.getegid() or os.geteuid() == 0:
                ids = (pw.pw_uid, pw.pw_gid, list(groups))
            home, name = pw.pw_dir, pw.pw_name
        else:
            try:
                pw = pwd.getpwuid(os.geteuid())
                home, name = pw.pw_dir, pw.pw_name
            except KeyError:
                pass
        env = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8"}
        path = spec.argv[0]
        if not os.path.isabs(path):
            found = shutil.which(path, path=env["PATH"])
            if not found:
                raise SpawnError("exec", f"{path!r} not found on {env['PATH']}")
            path = found
        run_dir = os.path.join(self.base_dir, safe_name(spec.run_key))
        try:
            os.makedirs(run_dir, mode=0o711, exist_ok=True)
            cwd = spec.cwd
            if cwd is None:
                cwd = os.path.join(run_dir, "work")
                os.makedirs(cwd, mode=0o700, exist_ok=True)
                if ids is not None:
                    os.chown(cwd, ids[0], ids[1])
                run.work_dir_created = cwd
            run.handle.run_dir = run_dir
            out = os.path.join(run_dir, "stdout.log")
            err = os.path.join(run_dir, "stderr.log")
        except OSError as exc:
            raise SpawnError("workdir", f"cannot prepare {run_dir}: {exc.strerror}") from None
        if not home or not os.path.isdir(home):
            home = cwd
        env.update({"HOME": home, "TMPDIR": cwd})
        if name:
            env.update({"USER": name, "LOGNAME": name})
        for k, v in spec.env.items():
            if isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v:
                env[k] = v
        env.update({"MILLWRIGHT_JOB_ID": spec.job_id, "MILLWRIGHT_RUN_ID": spec.run_id or spec.run_key,
                    "MILLWRIGHT_ATTEMPT": str(spec.attempt)})
        return ids, path, env, cwd, out, err

    def _spawn(self, run: _Run, hold: bool = False) -> None:
        spec = run.handle.spec
        ids, path, env, cwd, out_path, err_path = self._prepare(run)
        if self.spawn_mode == "shim":
            try:
                st = os.stat(path)
            except OSError as exc:
                raise SpawnError("exec", f"exec {path}: {exc.strerror}") from None
            if not (os.path.isfile(path) and st.st_mode & 0o111):
                raise SpawnError("exec", f"exec {path}: not an executable file")
        limits = spec.limits
        try:
            run.slot = self.backend.create(safe_name(spec.run_key), limits)
        except OSError as exc:
            raise SpawnError("cgroup", f"cannot create the run's quota container: {exc.strerror or exc}") from None
        run.handle.cgroup = dict(run.slot.paths) or None
        rlimits = self.backend.child_rlimits(limits, spec.timeout_s)
        limit = self.output_max_bytes if spec.output_max_bytes is None else int(spec.output_max_bytes)
        fds: list[int] = []
        try:
            for _ in range(4):
                fds.extend(os.pipe())
            go_r, go_w, err_r, err_w, out_r, out_w, ep_r, ep_w = fds
            run.streams = [_Stream(out_r, out_path, limit), _Stream(ep_r, err_path, limit)]
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            raise SpawnError("pipes", f"cannot create pipes: {exc.strerror}") from None
        run.t0 = time.monotonic()   # started_at and t0 are set again at the release (_go)
        if self.spawn_mode == "shim":
            os.close(err_r)
            os.close(err_w)
            argv = [SHIM_SH, "-c", SHIM_SCRIPT, "millwright-run"]
            if ids is not None:
                uid, gid, groups = ids
                argv += [self._setpriv, f"--reuid={uid}", f"--regid={gid}",
                         f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups", "--"]
            argv += [path] + list(spec.argv[1:])
            try:
                popen = subprocess.Popen(argv, stdin=go_r, stdout=out_w, stderr=ep_w, cwd=cwd, env=env,
                                         start_new_session=True, close_fds=True, restore_signals=True)
            except OSError as exc:
                for fd in (go_r, go_w, out_w, ep_w):
                    os.close(fd)
                raise SpawnError("exec", f"cannot start the launcher in {cwd}: {exc.strerror or exc}") from None
            run.popen = popen
            pid = popen.pid
            err_r = -1
        else:
            pid = os.fork()
            if pid == 0:  # pragma: no cover - child
                _child(go_r, err_w, out_w, ep_w, cwd, ids, rlimits, path, list(spec.argv), env)
            os.close(err_w)
            rlimits = []   # the child set them itself
        for fd in (go_r, out_w, ep_w):
            os.close(fd)
        for s in run.streams:
            os.set_blocking(s.rfd, False)
        run.handle.pid = run.handle.pgid = pid
        if self.spawn_mode == "fork":
            try:
                os.setpgid(pid, pid)
            except OSError:
                pass  # the child did it already (or died: reported through the err pipe)
        try:
            run.pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            run.pidfd = None   # kernel < 5.3: the reaper polls waitpid instead
        try:
            self.backend.attach(run.slot, pid)
            for res, val in rlimits:
                resource.prlimit(pid, res, (val, val))
            for hook in list(self.poststart):
                try:
                    hook(run.handle)
                except Exception as exc:
                    raise SpawnError("poststart", f"poststart hook {getattr(hook, '__qualname__', hook)} failed: {exc}") from None
        except (OSError, SpawnError) as exc:  # never exec a run we could not confine or track
            if not isinstance(exc, SpawnError):
                exc = SpawnError("cgroup", f"cannot confine the run: {exc.strerror or exc}")
            _kill(pid)
            run.error = str(exc)
            m.SPAWN_ERRORS.labels(exc.stage).inc()
            os.close(go_w)
            go_w = -1
        with self._lock:
            run.go = (go_w, err_r, path, cwd)
        if not hold or run.error:
            self._go(run)

    def _go(self, run: _Run) -> None:
        """Release the launcher (one byte on the go pipe), then collect a fork-mode child's
        exec error. Caller's thread."""
        with self._lock:
            go, run.go = run.go, None
        if go is None:
            return
        go_w, err_r, path, cwd = go
        spec = run.handle.spec
        released = False
        if go_w >= 0:
            run.handle.started_at = time.time()
            run.t0 = time.monotonic()
            try:
                os.write(go_w, b"g\n")
                released = True
            except BrokenPipeError:
                pass   # the child died during setup: its reason is in the err pipe
            finally:
                os.close(go_w)
        msg = b""
        while err_r >= 0:
            try:
                chunk = os.read(err_r, 1024)
            except InterruptedError:
                continue
            if not chunk:
                os.close(err_r)
                break
            msg += chunk
        if msg:
            stage, _, rest = msg.decode(errors="replace").partition(":")
            code, _, text = rest.partition(":")
            detail = os.strerror(int(code)) if code.isdigit() and int(code) else text
            what = {"exec": f"exec {path}", "chdir": f"chdir {cwd}", "user": f"switch to user {spec.user}",
                    "rlimit": "set rlimits"}.get(stage, stage)
            run.error = f"{what}: {detail}"
            m.SPAWN_ERRORS.labels(stage if stage in ("exec", "chdir", "user", "rlimit", "stdio") else "child").inc()
        elif not released and run.error is None:
            run.error = "the child exited before exec"
        if run.error:
            log.warning("run could not start", extra={"fields": {"run": spec.run_key, "error": run.error}})

    # --- reaper thread ----------------------------------------------------------------
    def _register(self, run: _Run) -> None:
        r = self._reaper
        run.phase = "running"
        if run.pidfd is not None:
            r.watch_fd(run.pidfd, ("pid", run, None))
        else:
            r.polled.add(run)
        for s in run.streams:
            r.watch_fd(s.rfd, ("out", run, s))
        t = run.handle.spec.timeout_s
        if t and t > 0:
            run.timers.append(r.call_at(run.t0 + t, self._terminate, run.handle, "timed_out", None))
        r.running.add(run)

    def _run_of(self, handle: RunHandle) -> Optional[_Run]:
        with self._lock:
            return self._live.get(handle.run_key)

    def _terminate(self, handle: RunHandle, reason: str, grace_s: Optional[float]) -> None:
        run = self._run_of(handle)
        if run is None or run.phase != "running" or run.handle is not handle:
            return
        if run.kill_reason is None:
            run.kill_reason = reason
        _killpg(handle.pgid, signal.SIGTERM)
        grace = run.grace if grace_s is None else float(grace_s)
        run.timers.append(self._reaper.call_at(time.monotonic() + grace, self._hard_kill, run))
        log.info("terminating run", extra={"fields": {"run": handle.run_key, "reason": reason, "grace_s": grace}})

    def _hard_kill(self, run: _Run) -> None:
        if run.phase in ("running", "draining"):
            _killpg(run.handle.pgid, signal.SIGKILL)
            if run.slot is not None:
                self.backend.kill_all(run.slot)

    def _watch(self) -> None:
        r = self._reaper
        for run in list(r.polled):
            self._poll_exit(run)
        running = [x for x in r.running if x.phase == "running" and x.slot is not None]
        if running:
            try:
                hits = self.backend.check_all([x.slot for x in running])
            except Exception:  # a backend read error must not stop the reaper
                log.exception("quota check failed")
                hits = {}
            for run in running:
                reason = hits.get(run.slot.name)
                if reason and run.kill_reason is None:
                    run.kill_reason = reason
                    log.warning("run hit its quota", extra={"fields": {"run": run.handle.run_key, "reason": reason}})
                    self._hard_kill(run)
        r.retry_orphan_slots()

    def _poll_exit(self, run: _Run) -> None:
        try:
            pid, status, ru = os.wait4(run.handle.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status, ru = run.handle.pid, 0, None
        if pid:
            self._reaper.polled.discard(run)
            self._leader_exited(run, status, ru)

    def _on_pidfd(self, run: _Run) -> None:
        try:
            pid, status, ru = os.wait4(run.handle.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status, ru = run.handle.pid, 0, None
        if not pid:
            return
        self._reaper.unwatch_fd(run.pidfd)
        os.close(run.pidfd)
        run.pidfd = None
        self._leader_exited(run, status, ru)

    def _leader_exited(self, run: _Run, status: int, rusage: Any) -> None:
        run.status, run.rusage = status, rusage
        if run.popen is not None:   # we reaped it: subprocess must never waitpid() it again
            run.popen.returncode = os.waitstatus_to_exitcode(status)
        run.t_end = time.monotonic()
        run.ended_at = time.time()
        run.phase = "draining"
        self._reaper.running.discard(run)
        run.drain_started = run.t_end
        # the leader is gone: whatever it left behind is killed now
        _killpg(run.handle.pgid, signal.SIGKILL)
        if run.slot is not None and self.backend.members(run.slot):
            self.backend.kill_all(run.slot)
        self._drain(run, 0)

    def _drain(self, run: _Run, n: int) -> None:
        _reap_group(run.handle.pgid)
        left = self.backend.members(run.slot) if run.slot is not None else []
        if left and time.monotonic() - run.drain_started < self.drain_timeout_s:
            if n % 5 == 4:
                self._hard_kill(run)
            run.timers.append(self._reaper.call_at(time.monotonic() + min(0.1, 0.002 * 2 ** n), self._drain, run, n + 1))
            return
        if not left:
            # what members() no longer lists may have turned zombie after the first sweep
            _reap_group(run.handle.pgid)
        if left:
            log.warning("processes of a run survived SIGKILL", extra={"fields": {
                "run": run.handle.run_key, "pids": left[:10]}})
        elif run.slot is not None and not run.slot.removed:
            # usage first (it lives in the cgroup), then the cgroup itself; the kernel
            # may report EBUSY for a moment after the last task exited: retry shortly
            if run.usage is None:
                run.usage = self._read_usage(run)
            if not self.backend.remove(run.slot) and time.monotonic() - run.drain_started < self.drain_timeout_s:
                run.timers.append(self._reaper.call_at(time.monotonic() + min(0.1, 0.002 * 2 ** n), self._drain, run, n + 1))
                return
        self._finalize(run)

    def _read_usage(self, run: _Run) -> Usage:
        try:
            return self.backend.usage(run.slot, run.rusage)
        except Exception:
            log.exception("reading usage failed")
            return Usage()

    def _finalize(self, run: _Run) -> None:
        r = self._reaper
        for t in run.timers:
            t.cancel()
        run.timers.clear()
        run.on_release = run.guard = None
        r.running.discard(run)
        r.polled.discard(run)
        if run.pidfd is not None:
            r.unwatch_fd(run.pidfd)
            os.close(run.pidfd)
            run.pidfd = None
        handle, spec = run.handle, run.handle.spec
        usage = run.usage or Usage()
        if run.slot is not None:
            if run.usage is None:
                usage = self._read_usage(run)
            if not run.slot.removed and not self.backend.remove(run.slot):
                m.CGROUP_CLEANUP_FAILURES.inc()
                r.orphan_slots.append((run.slot, time.monotonic()))
        for s in run.streams:
            r.unwatch_fd(s.rfd)
            _drain_stream(s)
            s.close()
        if run.work_dir_created and not self.keep_work_dir:
            shutil.rmtree(run.work_dir_created, ignore_errors=True)
        exit_code = sig = None
        if run.status is not None:
            code = os.waitstatus_to_exitcode(run.status)
            exit_code, sig = (code, None) if code >= 0 else (None, -code)
        if run.error:
            reason = "spawn_error"
        elif run.kill_reason:
            reason = run.kill_reason
        elif usage.oom_kills > 0:
            reason = "oom"
        elif usage.pids_max_events > 0:
            reason = "pids_limit"
        elif exit_code == 0:
            reason = "succeeded"
        else:
            reason = "failed"
        out, err = (run.streams + [None, None])[:2]
        t_end = run.t_end or time.monotonic()
        result = RunResult(
            run_key=handle.run_key, reason=reason, exit_code=exit_code if not run.error else None,
            signal=sig, error=run.error, usage=usage, pid=handle.pid, started_at=handle.started_at,
            ended_at=run.ended_at or time.time(), duration_s=max(0.0, t_end - run.t0) if handle.pid else 0.0,
            stdout_path=out.path if out else None, stderr_path=err.path if err else None,
            stdout_bytes=out.written if out else 0, stderr_bytes=err.written if err else 0,
            output_dropped_bytes=(out.dropped + err.dropped) if out and err else 0,
            backend=self.backend.name)
        run.phase = "done"
        with self._lock:
            self._live.pop(handle.run_key, None)
        if handle.pid is not None:
            m.RUNS_RUNNING.dec()
        m.RUNS_FINISHED.labels(reason).inc()
        if reason in ("oom", "pids_limit"):
            m.QUOTA_KILLS.labels(reason).inc()
        m.RUN_CPU.inc(max(0.0, usage.cpu_s))
        m.RUN_THROTTLED.inc(max(0.0, usage.throttled_s))
        m.RUN_OOM_KILLS.inc(max(0, usage.oom_kills))
        if usage.max_rss_bytes:
            m.RUN_PEAK_MEM.observe(usage.max_rss_bytes)
        if result.output_dropped_bytes:
            m.OUTPUT_TRUNCATED.inc(result.output_dropped_bytes)
        handle.result = result
        log.debug("run ended", extra={"fields": {"run": handle.run_key, "reason": reason, "exit_code": exit_code}})
        try:
            run.on_exit(handle, result)
        except Exception:
            log.exception("on_exit callback failed", extra={"fields": {"run": handle.run_key}})
        handle.done.set()


# --------------------------------------------------------------------------- reaper


class _Releaser:
    """Releases prepared runs at their time. Its own thread, started on first use: a
    condition wait wakes within microseconds, where the reaper's poll() counts whole
    milliseconds, and nothing else runs on it (a release is one pipe write)."""

    def __init__(self, ex: "Executor"):
        self.ex = ex
        self.cv = threading.Condition()
        self.heap: list = []
        self.seq = itertools.count()
        self.thread: Optional[threading.Thread] = None
        self.stopping = False

    def at(self, when: float, run: _Run) -> None:
        with self.cv:
            if self.stopping:
                return
            heapq.heappush(self.heap, (when, next(self.seq), run))
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="millwright-release", daemon=True)
                self.thread.start()
            self.cv.notify()

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.heap.clear()
            self.cv.notify()
        if self.thread is not None:
            self.thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.stopping and (not self.heap or self.heap[0][0] > time.monotonic()):
                    self.cv.wait(None if not self.heap else self.heap[0][0] - time.monotonic())
                if self.stopping:
                    return
                _, _, run = heapq.heappop(self.heap)
            try:
                self.ex._timed_release(run)
            except Exception:
                log.exception("releasing a prepared run failed", extra={"fields": {"run": run.handle.run_key}})


class _Reaper(threading.Thread):
    """The executor's one adapter thread: poll() over pidfds and output pipes, a timer
    heap, and a command queue fed by post()."""

    def __init__(self, ex: Executor):
        super().__init__(name="millwright-reaper", daemon=True)
        self.ex = ex
        self.poller = select.poll()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.poller.register(self.wake_r, select.POLLIN)
        self.fds: dict[int, tuple] = {}
        self.cmds: "queue.SimpleQueue" = queue.SimpleQueue()
        self.timers: list = []
        self.seq = itertools.count()
        self.running: set = set()
        self.polled: set = set()
        self.orphan_slots: list = []
        self._stopping = False

    # any thread
    def post(self, fn: Callable, *args: Any) -> None:
        self.cmds.put((fn, args))
        try:
            os.write(self.wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def stop(self) -> None:
        self.post(self._set_stop)

    # reaper thread
    def _set_stop(self) -> None:
        self._stopping = True

    def call_at(self, when: float, fn: Callable, *args: Any) -> _Timer:
        t = _Timer(when, fn, args)
        heapq.heappush(self.timers, (when, next(self.seq), t))
        return t

    def watch_fd(self, fd: int, what: tuple) -> None:
        self.fds[fd] = what
        self.poller.register(fd, select.POLLIN)

    def unwatch_fd(self, fd: int) -> None:
        if self.fds.pop(fd, None) is not None:
            try:
                self.poller.unregister(fd)
            except (KeyError, ValueError):
                pass

    def retry_orphan_slots(self) -> None:
        keep = []
        for slot, since in self.orphan_slots:
            self.ex.backend.kill_all(slot)
            if not self.ex.backend.remove(slot):
                keep.append((slot, since))
        self.orphan_slots = keep

    def _safe(self, fn: Callable, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("reaper handler %s failed", getattr(fn, "__qualname__", fn))

    def run(self) -> None:
        ex = self.ex
        next_watch = time.monotonic()
        while True:
            now = time.monotonic()
            while self.timers and (self.timers[0][2].cancelled or self.timers[0][0] <= now):
                _, _, t = heapq.heappop(self.timers)
                if not t.cancelled:
                    fn, args = t.fn, t.args
                    t.fn, t.args = _noop, ()
                    self._safe(fn, *args)
            if (self.running or self.polled or self.orphan_slots) and now >= next_watch:
                self._safe(ex._watch)
                next_watch = now + (0.02 if self.polled else ex.watch_interval_s)
            if self._stopping and not self.fds_for_runs():
                break
            wait = 1.0
            if self.timers:
                wait = min(wait, self.timers[0][0] - now)
            if self.running or self.polled or self.orphan_slots:
                wait = min(wait, next_watch - now)
            try:
                events = self.poller.poll(max(0, int(wait * 1000) + (1 if wait > 0 else 0)))
            except InterruptedError:
                events = []
            for fd, ev in events:
                if fd == self.wake_r:
                    try:
                        while os.read(self.wake_r, 4096):
                            pass
                    except (BlockingIOError, OSError):
                        pass
                    continue
                what = self.fds.get(fd)
                if what is None:
                    continue
                kind, run, stream = what
                if kind == "pid":
                    self._safe(ex._on_pidfd, run)
                else:
                    self._safe(self._on_output, run, stream, ev)
            while True:
                try:
                    fn, args = self.cmds.get_nowait()
                except queue.Empty:
                    break
                self._safe(fn, *args)
        os.close(self.wake_r)
        os.close(self.wake_w)

    def fds_for_runs(self) -> bool:
        return bool(self.running or self.polled)

    def _on_output(self, run: _Run, s: _Stream, ev: int) -> None:
        try:
            data = os.read(s.rfd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            s.feed(data)
        else:   # EOF: every writer is gone
            self.unwatch_fd(s.rfd)


# --------------------------------------------------------------------------- helpers


def _drain_stream(s: _Stream) -> None:
    if s.rfd < 0:
        return
    for _ in range(64):
        try:
            data = os.read(s.rfd, 65536)
        except (BlockingIOError, OSError):
            return
        if not data:
            return
        s.feed(data)


def _killpg(pgid: Optional[int], sig: int) -> None:
    if not pgid:
        return
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap_group(pgid: Optional[int]) -> None:
    """Reap zombies of the run's process group that became our children (we are a
    child subreaper), never anyone else's children."""
    if not pgid:
        return
    for _ in range(10000):
        try:
            res = os.waitid(os.P_PGID, pgid, os.WEXITED | os.WNOHANG)
        except ChildProcessError:
            return
        except OSError as exc:
            if exc.errno == errno.EINTR:
                continue
            return
        if res is None:
            return


_subreaper_done = False


def _set_child_subreaper() -> None:
    """Orphans of a run re-parent to the agent (not to an init that may never reap
    them), so the reaper can collect them by process group."""
    global _subreaper_done
    if _subreaper_done:
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_CHILD_SUBREAPER = 36
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl")
        _subreaper_done = True
    except Exception as exc:  # not fatal: orphans go to init instead
        log.warning("cannot become a child subreaper", extra={"fields": {"error": str(exc)}})
