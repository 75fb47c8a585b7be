"""Run job processes: fork/exec under quotas, as the template's user, reaped by one thread.

Modules: runs (spec, handle, result), launch (the process up to exec), reaper (the
adapter thread and process helpers), release (timed release of prepared runs), guard
(runs die with the agent); this module ties them together.

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

import logging
import os
import shutil
import signal
import threading
import time
from typing import Any, Callable, Optional

from agent.execute import metrics as m
from agent.execute.armed import pick_launcher
from agent.execute.backends import QuotaBackend, Usage, probe
from agent.execute.guard import RunGuard
from agent.execute.launch import DEFAULT_PATH, SHIM_SH, SpawnError, Staged, go, spawn, stage
from agent.execute.limits import Limits, default_limits
from agent.execute.reaper import Reaper, _drain_stream, _kill, _killpg, _reap_group, _Run, _set_child_subreaper
from agent.execute.release import Releaser
from agent.execute.runs import REASONS, RunHandle, RunResult, RunSpec, rfc3339, tail_text

log = logging.getLogger("millwright.execute")

# An armed launcher (prepare(..., guard_until=...)) is used only if its guard is known to
# hold this long past the release time; and a discard this close to the release time is
# not trusted to beat the launcher's own timer (the run is released, then terminated).
ARM_MARGIN_S = 0.5
ARM_DISCARD_MARGIN_S = 0.002

__all__ = ["Executor", "RunSpec", "RunResult", "RunHandle", "REASONS", "rfc3339"]


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
                 spawn_mode: str = "auto", guard: bool = True):
        self.backend = backend
        self._setpriv = shutil.which("setpriv", path=DEFAULT_PATH)
        if spawn_mode == "auto":
            spawn_mode = "shim" if (self._setpriv and os.access(SHIM_SH, os.X_OK)) else "fork"
        if spawn_mode not in ("shim", "fork"):
            raise ValueError(f"spawn_mode must be auto, shim or fork, not {spawn_mode!r}")
        self.spawn_mode = spawn_mode
        # (shell, script) of the armed launcher, picked once; None: runs are never armed
        self.armed_launcher = pick_launcher() if spawn_mode == "shim" else None
        self.can_arm = self.armed_launcher is not None
        self.base_dir = os.path.abspath(base_dir)
        self.ids = (os.geteuid(), os.getegid())   # the agent's own user and group
        # ... and every group it acts with: a run user with exactly these needs no switch
        self.group_set = frozenset(os.getgroups()) | {self.ids[1]}
        self.output_max_bytes = int(output_max_bytes)
        self.kill_grace_s = float(kill_grace_s)
        self.poststart: list[Callable[[RunHandle], Any]] = list(poststart or [])
        self.watch_interval_s = watch_interval_s
        self.keep_work_dir = keep_work_dir
        self.drain_timeout_s = drain_timeout_s
        self._lock = threading.Lock()
        self._live: dict[str, _Run] = {}
        self.armed: set[_Run] = set()   # prepared with an armed launcher, not released yet (under _lock)
        os.makedirs(self.base_dir, mode=0o711, exist_ok=True)
        try:
            os.chmod(self.base_dir, 0o711)   # job users traverse to their work dir, list nothing
        except OSError:
            pass
        if subreaper:
            _set_child_subreaper()
        # runs die with the agent: a keeper process kills them when our end of its pipe closes
        self.guard: Optional[RunGuard] = RunGuard() if guard else None
        self._reaper = Reaper(self)
        self._reaper.start()
        self._releaser = Releaser(self)

    @classmethod
    def from_config(cls, execute_config: Any, base_dir: str, root_name: str = "millwright",
                    reclaim: bool = True, **kw: Any) -> "Executor":
        """The daemon's constructor: probe the configured backend (reclaiming run cgroups
        a dead predecessor left) and apply execute.* settings."""
        backend = probe(execute_config.quota_backend, root_name=root_name, reclaim=reclaim,
                        runs_weight=execute_config.max_concurrent)
        log.info("quota backend", extra={"fields": {"backend": backend.name, "why": backend.why}})
        ex = cls(backend, base_dir, output_max_bytes=execute_config.output_max_bytes,
                 kill_grace_s=execute_config.kill_grace_s, **kw)
        ex.default_limits = default_limits(execute_config)
        return ex

    default_limits = Limits()

    # --- public -------------------------------------------------------------------
    def stage(self, spec: RunSpec) -> Staged:
        """Make a run's directories and quota container now, on the calling
        thread (any thread; its blocking file-system and cgroup steps then stay off the
        thread that starts runs on time). Pass the result to start() or prepare() of the
        same spec, or to unstage() if the run will not start. Never raises for the run's
        own errors: start()/prepare() report them as the run's spawn_error."""
        return stage(self, spec)

    def unstage(self, staged: Staged) -> None:
        """A staged run that will not start: its quota container and directories go (on
        the reaper thread)."""
        self._reaper.post(self._drop_staged, staged)

    def _drop_staged(self, staged: Staged) -> None:
        if staged.slot is not None:
            self._remove_slot(staged.slot)
        prepared = staged.process
        dirs = [staged.work_dir_created] if staged.work_dir_created else []
        if prepared is not None:
            dirs.append(prepared.run_dir)   # then the run dir (no output file is made before a start)
        for path in dirs:
            try:
                os.rmdir(path)
            except OSError:
                pass

    def start(self, spec: RunSpec, on_exit: Callable[[RunHandle, RunResult], Any], *,
              guard: Optional[Callable[[], bool]] = None, staged: Optional[Staged] = None) -> RunHandle:
        """Start a run; always returns a handle, on_exit(handle, result) follows exactly
        once on the reaper thread. Raises ValueError only for a run_key already live.
        ``guard()`` (thread-safe; e.g. "the lease this run was claimed under is valid") is
        checked by the reaper on every watch tick: once false, the run is terminated with
        reason ``fenced`` (kill_grace_s later SIGKILLed), independently of the caller's
        thread. ``staged``: stage(spec)'s result, made earlier on another thread."""
        return self._start(spec, on_exit, hold=False, guard=guard, staged=staged)

    def prepare(self, spec: RunSpec, on_exit: Callable[[RunHandle, RunResult], Any], *,
                release_at: Optional[float] = None,
                on_release: Optional[Callable[[RunHandle, bool], Any]] = None,
                guard: Optional[Callable[[], bool]] = None,
                guard_until: Optional[float] = None, staged: Optional[Staged] = None) -> RunHandle:
        """Everything start() does except letting the job exec: the launcher waits in its
        quota container (pid known, poststart hooks done) until release(). This takes the
        costly part (cgroup, fork, user lookup) off the due time. With ``release_at``
        (time.monotonic()) the release thread releases it then, off the caller's busy loop,
        and calls ``on_release(handle, ok)`` there; if ``guard()`` (thread-safe) is false at
        that moment the run is discarded with reason ``fenced`` instead. terminate() before
        the release discards it; on_exit follows exactly once either way.

        ``guard_until`` (time.monotonic()): guard() cannot turn false before then (e.g. the
        lease's local validity, which only grows while the lease lives). If it covers
        release_at with ARM_MARGIN_S to spare, the launcher is *armed*: it releases itself
        at release_at on a kernel timer (agent/execute/armed.py), so no
        thread of this busy process is on the due time's path; the release thread still
        runs then, for on_release and as a backstop (its go byte releases the launcher if
        it has not gone yet)."""
        arm_at = None
        if release_at is not None and self.can_arm and (
                guard is None or (guard_until is not None and release_at + ARM_MARGIN_S <= guard_until)):
            arm_at = time.time() + (release_at - time.monotonic())
        handle = self._start(spec, on_exit, hold=True, guard=guard, arm_at=arm_at, staged=staged)
        if release_at is not None:
            with self._lock:
                run = self._live.get(handle.run_key)
                held = run is not None and run.handle is handle and run.go is not None
            if held and run is not None:
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
        go(self, run)
        self._reaper.post(self._register, run)
        return run.error is None

    def _timed_release(self, run: _Run) -> None:
        # read both first: a discarded run may be finalised (fields cleared) by the reaper
        # before this thread gets to the callback
        guard, on_release = run.guard, run.on_release
        if guard is not None and not guard() and self._discard_held(run.handle, "fenced"):
            ok = False
        else:
            ok = self.release(run.handle)
            if ok and guard is not None and not guard():
                # an armed launcher past its time (guard_until was wrong): it may have
                # exec'd, so it counts as released and is terminated like a running run
                self._reaper.post(self._terminate, run.handle, "fenced", None)
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
            if run.armed_at is not None and time.time() >= run.armed_at - ARM_DISCARD_MARGIN_S:
                return False   # its own timer may have released it: released_armed() then terminate
            go_w, err_r, _, _ = run.go
            run.go = None
            self.armed.discard(run)
        run.kill_reason = reason
        for fd in (go_w, err_r):
            if fd >= 0:
                os.close(fd)   # the launcher's read of the go pipe fails: it exits without exec
        if handle.pid:
            _kill(handle.pid)
        self._reaper.post(self._register, run)
        return True

    def release_armed(self, handle: RunHandle) -> None:
        """An armed run whose launcher may have released itself and that the release
        thread has not got to yet: account it as released now (on_release included), so
        a terminate() that follows stops it like any running run."""
        with self._lock:
            run = self._live.get(handle.run_key)
            if run is None or run.handle is not handle or run.go is None or run.armed_at is None:
                return
        early = run.armed_at - time.time()
        if early > 0:   # at most ARM_DISCARD_MARGIN_S: the go byte must not beat the due time
            time.sleep(early)
        self._timed_release(run)

    def _start(self, spec: RunSpec, on_exit: Callable[[RunHandle, RunResult], Any], hold: bool,
               guard: Optional[Callable[[], bool]] = None, arm_at: Optional[float] = None,
               staged: Optional[Staged] = None) -> RunHandle:
        t0 = time.perf_counter()
        if staged is not None and staged.run_key != spec.run_key:
            raise ValueError(f"staged run {staged.run_key!r} is not {spec.run_key!r}")
        handle = RunHandle(self, spec)
        run = _Run(handle, on_exit)
        run.guard = guard
        run.grace = self.kill_grace_s if spec.kill_grace_s is None else float(spec.kill_grace_s)
        with self._lock:
            if spec.run_key in self._live:
                raise ValueError(f"run {spec.run_key!r} is already live")
            self._live[spec.run_key] = run
        try:
            spawn(self, run, hold, arm_at=arm_at, staged=staged)
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
                self.armed.discard(run)
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
        if self.guard is not None:
            self.guard.close()
        for _ in range(50):   # run cgroups the kernel did not let go of at once
            self._reaper.retry_orphan_slots()
            if not self._reaper.orphan_slots:
                break
            time.sleep(0.02)
        if close_backend:
            self.backend.close()

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
        with self._lock:
            armed = list(self.armed)
        for run in armed:
            # guard_until promised it could not happen before the due time; if it does
            # (a lease revoked from outside), the armed launcher must not go by itself
            guard = run.guard
            if guard is not None and not guard():
                self._discard_held(run.handle, "fenced")
        for run in list(r.running):
            # the lease this run was claimed under may have run out: kill it on this thread,
            # however busy the caller's loop is (self-fence timing, docs/execution.md)
            guard = run.guard
            if guard is not None and run.phase == "running" and run.kill_reason is None and not guard():
                self._terminate(run.handle, "fenced", None)
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
        leader, pgid = run.handle.pid, run.handle.pgid
        assert leader is not None and pgid is not None  # polled only once spawned
        try:   # exited? (not reaped yet: the guard must hear of it before the pid is freed)
            if os.waitid(os.P_PID, leader, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return
        except ChildProcessError:
            pass
        if self.guard is not None:
            self.guard.leader_exited(pgid)
        try:
            pid, status, ru = os.wait4(leader, os.WNOHANG)
        except ChildProcessError:
            pid, status, ru = leader, 0, None
        if pid:
            self._reaper.polled.discard(run)
            self._leader_exited(run, status, ru)

    def _on_pidfd(self, run: _Run) -> None:
        leader, pgid, pidfd = run.handle.pid, run.handle.pgid, run.pidfd
        assert leader is not None and pgid is not None and pidfd is not None  # watched only once spawned
        if self.guard is not None:   # the leader exited; its pid is freed by the wait4 below
            self.guard.leader_exited(pgid)
        try:
            pid, status, ru = os.wait4(leader, os.WNOHANG)
        except ChildProcessError:
            pid, status, ru = leader, 0, None
        if not pid:
            return
        self._reaper.unwatch_fd(pidfd)
        os.close(pidfd)
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
        left = self.backend.members(run.slot) if run.slot is not None else []
        if left and run.slot is not None:
            self.backend.kill_all(run.slot)
        # nothing alive in the run's cgroups: nothing can appear there any more, so the
        # first drain round need not list them again (a run's end is the reaper's hot path)
        self._drain(run, 0, known_empty=not left)

    def _drain(self, run: _Run, n: int, known_empty: bool = False) -> None:
        _reap_group(run.handle.pgid)
        left = self.backend.members(run.slot) if run.slot is not None and not known_empty else []
        if left and time.monotonic() - run.drain_started < self.drain_timeout_s:
            if n % 5 == 4:
                self._hard_kill(run)
            run.timers.append(self._reaper.call_at(time.monotonic() + min(0.1, 0.002 * 2 ** n), self._drain, run, n + 1))
            return
        if not left and not known_empty:
            # what members() no longer lists may have turned zombie after the first sweep
            # (with known_empty no listing came between: the sweep above is just as late)
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
        if run.slot is None:
            return Usage()
        try:
            return self.backend.usage(run.slot, run.rusage)
        except Exception:
            log.exception("reading usage failed")
            return Usage()

    def _remove_slot(self, slot: Any) -> None:
        """A run's quota container goes; one the kernel does not let go of yet is retried
        by the watch tick (orphan_slots). Reaper thread."""
        if not slot.removed and not self.backend.remove(slot):
            m.CGROUP_CLEANUP_FAILURES.inc()
            self._reaper.orphan_slots.append((slot, time.monotonic()))

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
        handle = run.handle
        usage = run.usage or Usage()
        if run.slot is not None:
            if run.usage is None:
                usage = self._read_usage(run)
            self._remove_slot(run.slot)
        if self.guard is not None and handle.pgid:
            self.guard.remove(handle.pgid)
        if handle.pgid:
            # a member still being re-parented to us (its parent mid-exit) at the last sweep
            # turns zombie after it: sweep the group again shortly. The group's number is not
            # handed out again while any of its zombies exists, so this reaps only this run's.
            r.reap_again(handle.pgid)
        for s in run.streams:
            r.unwatch_fd(s.rfd)
            _drain_stream(s)   # a file is made only for what comes (none for a silent run)
            s.close()
        if run.work_dir_created and not self.keep_work_dir:
            try:
                os.rmdir(run.work_dir_created)   # most jobs leave it empty: one syscall
            except OSError:
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
            stdout_path=out.path if out and out.created else None,   # None: it wrote nothing, no file
            stderr_path=err.path if err and err.created else None,
            stdout_bytes=out.written if out else 0, stderr_bytes=err.written if err else 0,
            stderr_tail=tail_text(bytes(err.tail), err.written) if err else None,
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

