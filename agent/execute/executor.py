"""Run job processes: fork/exec under quotas, as the template's user, reaped by one thread.

The executor ties the parts together (docs/execution.md has the module map): runs (spec,
handle, result), runstate (the live runs), launch (the process up to exec), reaper (the
adapter thread that ends runs), release (timed release of prepared runs), guard (runs
die with the agent), backends (quotas).

Life of a run (cf. Nomad's task runner hooks)::

    start()  [caller's thread, normally the daemon's event loop]
      stage (or staged ahead on another thread): user lookup, argv resolution, clean
              env, run dir, a quota slot from the pool (cgroups reused run after run)
      spawn -> launcher: own session, stdio, cwd, joins its cgroups itself (the
              slot's `tasks` files, inherited), [setpriv], then BLOCKS on a pipe
      parent: run guard, the poststart hooks (the BPF sensor starts tracking the pid
              here), release the launcher (or arm it: it releases itself at its due time)
    reaper   [ONE adapter thread, "millwright-reaper"]
      pidfd of the leader + stdout/stderr pipes in one epoll; timers for timeout, kill
      grace and an armed run's release accounting; a watch tick that polls the backend
      for quota events (oom, pids)
      leader exit -> SIGKILL what is left of the group/cgroup, reap orphans of the
      group, read usage once, give the slot back -> on_exit(handle, result)

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
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from agent.execute import metrics as m
from agent.execute import pspawn, threadcreds
from agent.execute.armed import pick_launcher
from agent.execute.backends import QuotaBackend, Usage, probe
from agent.execute.backends.pool import DEFAULT_SIZE as DEFAULT_POOL
from agent.execute.backends.pool import SlotPool
from agent.execute.cleanup import Cleaner
from agent.execute.confine import RUN_FILES_ID
from agent.execute.guard import RunGuard
from agent.execute.isolation import Isolation
from agent.execute.launch import DEFAULT_PATH, SHIM_SH, SpawnError, Staged, go, job_rlimits, spawn, stage
from agent.execute.limits import Limits, default_limits
from agent.execute.processes import kill, set_child_subreaper
from agent.execute.progress import scratch_dir as make_scratch_dir
from agent.execute.reaper import Reaper
from agent.execute.release import Releaser
from agent.execute.runs import ExitReason, RunHandle, RunResult, RunSpec
from agent.execute.runstate import Run, RunTable

if TYPE_CHECKING:
    from agent.config import Config, ExecuteConfig

log = logging.getLogger(__name__)

# An armed launcher (prepare(..., guard_until=...)) is used only if its guard is known to
# hold this long past the release time; and a discard this close to the release time is
# not trusted to beat the launcher's own timer (the run is released, then terminated).
ARM_MARGIN_S = 0.5
ARM_DISCARD_MARGIN_S = 0.002
# An armed run is accounted as released (on_release, the backstop go byte, watched by the
# reaper) this long after its due time, on the reaper's thread: its launcher went by itself
# at the due time, and a short job has ended by then, so release and end are one wake-up.
ARMED_RELEASE_LAG_S = 0.005

# under the base dir (so a rename away from every run's dir): the cleaner's trash and
# quarantine; a dot name, never a run dir's (safe_name strips leading dots)
CLEANUP_DIR = ".cleanup"


class Executor:
    """Start runs under a quota backend; one reaper thread reports their ends.

    Threading: start() is meant to be called from one thread (the daemon's loop);
    terminate(), usage() and live() are safe from any thread; on_exit callbacks and
    poststart hooks: see the module docstring.
    """

    def __init__(self, backend: QuotaBackend, base_dir: str, *, output_max_bytes: int = 1024 * 1024,
                 kill_grace_s: float = 5.0, poststart: Optional[list] = None, watch_interval_s: float = 0.2,
                 subreaper: bool = True, keep_work_dir: bool = False, drain_timeout_s: float = 5.0,
                 spawn_mode: str = "auto", guard: bool = True, isolation: Optional[Isolation] = None,
                 slot_pool: int = DEFAULT_POOL, scratch_dir: Optional[str] = None,
                 cleanup: Optional[dict] = None):
        self.backend = backend
        # confines every run with a user (docs/security.md); None: runs as before (tests, dev)
        self.isolation = isolation
        self.job_rlimits = job_rlimits()
        self.setpriv = shutil.which("setpriv", path=DEFAULT_PATH)   # the user switch of shim mode
        if spawn_mode == "auto":
            spawn_mode = "shim" if (self.setpriv and os.access(SHIM_SH, os.X_OK)) else "fork"
            if spawn_mode == "fork":
                # a fork() beside gRPC runs its event-engine fork handlers (docs/execution.md)
                log.warning("spawn mode fork: %s missing; every run forks the agent (install util-linux)",
                            "setpriv" if not self.setpriv else SHIM_SH)
        if spawn_mode not in ("shim", "fork"):
            raise ValueError(f"spawn_mode must be auto, shim or fork, not {spawn_mode!r}")
        self.spawn_mode = spawn_mode
        # confined runs' launchers come from a thread that took the run's ids (no setpriv)
        self.thread_switch = (isolation is not None and spawn_mode == "shim" and threadcreds.available()
                              and pspawn.available())
        if self.thread_switch:
            # such a thread shares the agent's memory while it has a run's ids: only a
            # process with CAP_SYS_PTRACE may trace a non-dumpable process, so no process of
            # the run can trace it, whatever fs.suid_dumpable says (the kernel would make the
            # agent non-dumpable at the first switch anyway; this makes it so from the start)
            threadcreds.not_dumpable()
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
        self.runs = RunTable()
        os.makedirs(self.base_dir, mode=0o711, exist_ok=True)
        try:
            os.chmod(self.base_dir, 0o711)   # job users traverse to their work dir, list nothing
            if isolation is not None:   # a root run (uid 0) must not own it either
                os.chown(self.base_dir, RUN_FILES_ID, RUN_FILES_ID)
        except OSError:
            pass
        # runs' progress FIFOs and result files (progress.py); None: in their run dirs
        self.scratch_dir = scratch_dir and make_scratch_dir(scratch_dir, RUN_FILES_ID if isolation else None)
        if subreaper:
            set_child_subreaper()
        # runs die with the agent: a keeper process kills them when our end of its pipe closes
        self.guard: Optional[RunGuard] = RunGuard() if guard else None
        # run slots (quota containers) reused run after run; the run guard removes them
        # with the agent
        self.slots = SlotPool(backend, slot_pool, on_made=self.guard.pooled if self.guard else (lambda d: None),
                              on_removed=self.guard.unpooled if self.guard else (lambda d: None))
        # what runs leave (work dirs, old run dirs) is removed on its own thread, from a
        # trash in the base dir (a rename away: the same file system); ``cleanup``: Cleaner's
        # bounds (pass_entries, max_tries, max_tree_entries, max_quarantined, retry_s)
        self.cleaner = Cleaner(os.path.join(self.base_dir, CLEANUP_DIR), **(cleanup or {}))
        self.cleaner.start()
        self.reaper = Reaper(backend, self.slots, self.runs, self.guard, self._discard_held,
                             watch_interval_s=watch_interval_s,
                             drain_timeout_s=drain_timeout_s, keep_work_dir=keep_work_dir,
                             release_confinement=isolation.release if isolation is not None else (lambda c: None),
                             discard=self.cleaner.discard)
        self.reaper.start()
        self._releaser = Releaser(self._timed_release)

    @classmethod
    def from_config(cls, execute_config: ExecuteConfig, base_dir: str, root_name: str = "millwright",
                    reclaim: bool = True, agent_config: Optional[Config] = None, **kw: Any) -> "Executor":
        """The daemon's constructor: probe the configured backend (reclaiming run cgroups
        a dead predecessor left) and apply execute.* settings. With ``agent_config`` (the
        whole Config) and root, every run is isolated (docs/security.md): an isolation that
        cannot be set up is an error, never a silent fallback."""
        runtime_dir = execute_config.runtime_dir
        if runtime_dir and "scratch_dir" not in kw:   # one per agent, as its cgroup root
            kw["scratch_dir"] = os.path.join(os.path.abspath(runtime_dir), root_name)
        if agent_config is not None and os.geteuid() == 0 and "isolation" not in kw:
            exposed = [os.path.abspath(base_dir)] + ([kw["scratch_dir"]] if kw.get("scratch_dir") else [])
            kw["isolation"] = Isolation.from_config(agent_config, root_name, exposed)
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
        self.reaper.drop_staged(staged)

    def start(self, spec: RunSpec, on_exit: Callable[[RunHandle, RunResult], Any], *,
              guard: Optional[Callable[[], bool]] = None, staged: Optional[Staged] = None,
              on_progress: Optional[Callable[[RunHandle, list], Any]] = None) -> RunHandle:
        """Start a run; always returns a handle, on_exit(handle, result) follows exactly
        once on the reaper thread. Raises ValueError only for a run_key already live.
        ``guard()`` (thread-safe; e.g. "the lease this run was claimed under is valid") is
        checked by the reaper on every watch tick: once false, the run is terminated with
        reason ``fenced`` (kill_grace_s later SIGKILLed), independently of the caller's
        thread. ``staged``: stage(spec)'s result, made earlier on another thread.
        ``on_progress(handle, lines)``: the run's new valid progress lines, on the reaper
        thread (agent/execute/progress.py)."""
        return self._start(spec, on_exit, hold=False, guard=guard, staged=staged, on_progress=on_progress)

    def prepare(self, spec: RunSpec, on_exit: Callable[[RunHandle, RunResult], Any], *,
                release_at: Optional[float] = None,
                on_release: Optional[Callable[[RunHandle, bool], Any]] = None,
                guard: Optional[Callable[[], bool]] = None,
                guard_until: Optional[float] = None, staged: Optional[Staged] = None,
                on_progress: Optional[Callable[[RunHandle, list], Any]] = None) -> RunHandle:
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
        thread of this busy process is on the due time's path; the reaper accounts for it
        ARMED_RELEASE_LAG_S after its due time, on its own thread: on_release, and a go
        byte as a backstop (it releases the launcher if it has not gone yet). A run
        discarded before then gets no on_release."""
        arm_at = None
        if release_at is not None and self.can_arm and (
                guard is None or (guard_until is not None and release_at + ARM_MARGIN_S <= guard_until)):
            arm_at = time.time() + (release_at - time.monotonic())
        handle = self._start(spec, on_exit, hold=True, guard=guard, arm_at=arm_at, staged=staged,
                             on_progress=on_progress)
        if release_at is not None:
            run = self.runs.held(handle)
            if run is not None:
                run.on_release = on_release
                run.guard = guard
                if run.armed_at is not None:   # it goes by itself: accounted on the reaper
                    self.reaper.call_at(release_at + ARMED_RELEASE_LAG_S, self._armed_release, run)
                else:
                    self._releaser.at(release_at, run)
        return handle

    def release(self, handle: RunHandle) -> bool:
        """Let a prepared run exec its job (microseconds: one pipe write). False if it was
        not prepared, already released, discarded or could not be confined."""
        run = self.runs.held(handle)
        if run is None:
            return False
        go(self, run)
        self.reaper.register(run)
        return run.error is None

    def terminate(self, handle: RunHandle, reason: str = ExitReason.KILLED, grace_s: Optional[float] = None) -> None:
        """handle.terminate(): discard a prepared run not yet released, else SIGTERM its
        group and SIGKILL it grace_s later (on the reaper thread). Any thread."""
        if self._discard_held(handle, reason):
            return
        self.release_armed(handle)
        self.reaper.terminate(handle, reason, grace_s)

    def _armed_release(self, run: Run) -> None:
        """The reaper's accounting of an armed run after its due time, unless a release or
        a discard took it already."""
        if self.runs.held(run.handle) is not None:
            self._timed_release(run)

    def _timed_release(self, run: Run) -> None:
        """The release of a prepared run at its time (the release thread's; the reaper's
        for an armed run)."""
        # read both first: a discarded run may be finalised (fields cleared) by the reaper
        # before this thread gets to the callback
        guard, on_release = run.guard, run.on_release
        if guard is not None and not guard() and self._discard_held(run.handle, ExitReason.FENCED):
            ok = False
        else:
            ok = self.release(run.handle)
            if ok and guard is not None and not guard():
                # an armed launcher past its time (guard_until was wrong): it may have
                # exec'd, so it counts as released and is terminated like a running run
                self.reaper.terminate(run.handle, ExitReason.FENCED, None)
        if on_release is not None:
            try:
                on_release(run.handle, ok)
            except Exception:
                log.exception("on_release callback failed", extra={"fields": {"run": run.handle.run_key}})

    def _discard_held(self, handle: RunHandle, reason: str) -> bool:
        """A prepared run not released yet ends with ``reason`` without exec'ing its job.
        False if it is not held, or is armed and its own timer may have released it
        (release_armed() then, and terminate it)."""
        taken = self.runs.take_held(handle, keep=_timer_may_have_fired)
        if taken is None:
            return False
        run, pipe = taken
        run.kill_reason = reason
        for fd in (pipe.go_w, pipe.err_r):
            if fd >= 0:
                os.close(fd)   # the launcher's read of the go pipe fails: it exits without exec
        if handle.pid:
            kill(handle.pid)
        self.reaper.register(run)
        return True

    def release_armed(self, handle: RunHandle) -> None:
        """An armed run whose launcher may have released itself and that the reaper has not
        accounted for yet: account it as released now (on_release included), so a
        terminate() that follows stops it like any running run."""
        run = self.runs.held(handle)
        if run is None or run.armed_at is None:
            return
        early = run.armed_at - time.time()
        if early > 0:   # at most ARM_DISCARD_MARGIN_S: the go byte must not beat the due time
            time.sleep(early)
        self._timed_release(run)

    def _start(self, spec: RunSpec, on_exit: Callable[[RunHandle, RunResult], Any], hold: bool,
               guard: Optional[Callable[[], bool]] = None, arm_at: Optional[float] = None,
               staged: Optional[Staged] = None, on_progress: Optional[Callable[[RunHandle, list], Any]] = None
               ) -> RunHandle:
        t0 = time.perf_counter()
        if staged is not None and staged.run_key != spec.run_key:
            raise ValueError(f"staged run {staged.run_key!r} is not {spec.run_key!r}")
        handle = RunHandle(spec, self.terminate)
        run = Run(handle, on_exit)
        run.guard = guard
        run.on_progress = on_progress
        run.grace = self.kill_grace_s if spec.kill_grace_s is None else float(spec.kill_grace_s)
        self.runs.add(run)
        try:
            spawn(self, run, hold, arm_at=arm_at, staged=staged)
        except SpawnError as exc:   # before fork: no process
            run.error = str(exc)
            m.SPAWN_ERRORS.labels(exc.stage).inc()
            log.warning("run could not start", extra={"fields": {
                "run": spec.run_key, "stage": exc.stage, "error": str(exc)}})
            self.reaper.finish(run)
            return handle
        except Exception as exc:    # a bug or an unexpected OS error: still one clean result
            log.exception("starting a run failed", extra={"fields": {"run": spec.run_key}})
            run.error = f"internal error: {exc}"
            m.SPAWN_ERRORS.labels("internal").inc()
            if handle.pid is None:
                self.reaper.finish(run)
                return handle
            kill(handle.pid)        # a process exists: let the reaper reap it
            pipe = self.runs.take_go(run)
            for fd in (pipe or ())[:2]:
                if fd >= 0:
                    os.close(fd)
        m.SPAWN_SECONDS.labels(self.backend.name).observe(time.perf_counter() - t0)
        m.RUNS_RUNNING.inc()
        if not self.runs.is_held(run):
            self.reaper.register(run)
        return handle

    def usage(self, handle: RunHandle) -> Usage:
        """Usage of a live run so far (cgroup backends; rlimit: polled figures only)."""
        run = self.runs.get(handle.run_key)
        if run is None or run.slot is None:
            return handle.result.usage if handle.result else Usage()
        return self.backend.usage(run.slot)

    def live(self) -> list[RunHandle]:
        return self.runs.handles()

    def close(self, timeout: float = 15.0, close_backend: bool = True) -> None:
        """Terminate live runs (reason "killed"), wait for them, stop the reaper."""
        for h in self.live():
            h.terminate(ExitReason.KILLED)
        deadline = time.monotonic() + timeout
        for h in self.live():
            h.wait(max(0.0, deadline - time.monotonic()))
        self._releaser.stop()
        self.reaper.stop()
        self.reaper.join(timeout=5)
        self.reaper.orphan_slots += [(s, time.monotonic()) for s in self.slots.close()]
        self.cleaner.stop()   # what is left in its trash is removed after the next start
        self.cleaner.join(timeout=5)
        if self.guard is not None:
            self.guard.close()
        for _ in range(50):   # run cgroups the kernel did not let go of at once
            self.reaper.retry_orphan_slots()
            if not self.reaper.orphan_slots:
                break
            time.sleep(0.02)
        if self.scratch_dir is not None:
            try:
                os.rmdir(self.scratch_dir)   # empty once every run ended
            except OSError:
                pass
        if close_backend:
            self.backend.close()
        if self.isolation is not None:   # the nftables table goes with it; namespaces with their last process
            self.isolation.close()


def _timer_may_have_fired(run: Run) -> bool:
    """An armed launcher this close to its due time may have released itself."""
    return run.armed_at is not None and time.time() >= run.armed_at - ARM_DISCARD_MARGIN_S
