"""The executor's one adapter thread, ``millwright-reaper``: one epoll over the runs'
pidfds and output pipes, a timer heap any thread may add to, and a command queue; and
everything that happens to a run on it, from its registration to its end (on_exit).

Life of a run here: registered once its launcher is released (or never held): pidfd and
output pipes watched, its timeout timer set. An armed run (its launcher releases itself
on a kernel timer) is released here too, on this thread's timer heap, a few
milliseconds after its due time: a short job has usually ended by then, so its release,
its exit and its end are one wake-up of this thread, with no hand-off between threads. A
watch tick polls the backend for quota events (oom, pids) and the runs' guards. When the
leader exits, what is left of the group and cgroup is SIGKILLed, orphans of the group
are reaped, usage is read once, the slot goes back to the pool, and on_exit(handle,
result) is called, exactly once per run, after the rest of the wake-up's work (the runs
that ended together reach the caller's loop together).

Orphans of a run re-parent to the agent (a child subreaper), and are collected by
process group, never touching the agent's other children."""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import os
import queue
import select
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from agent.execute import metrics as m
from agent.execute.backends import QuotaBackend, Slot, Usage
from agent.execute.backends.pool import SlotPool
from agent.execute.output import OutputStream
from agent.execute.processes import killpg, reap_group
from agent.execute.rmtree import remove_tree
from agent.execute.runs import ExitReason, RunHandle, RunResult, tail_text
from agent.execute.runstate import Run, RunPhase, RunTable

if TYPE_CHECKING:  # pragma: no cover
    from agent.execute.guard import RunGuard
    from agent.execute.launch import Staged

log = logging.getLogger(__name__)

REAP_AGAIN_S = (0.2, 1.0, 3.0)   # after a run ended, its process group is swept for zombies again
RESWEEP_TICK_S = 0.1             # ... in sweeps of every group due, at most this often
LAUNCHER_FAILED = 126           # a launcher's exit code when it ends without exec'ing the job
POLLED_WATCH_S = 0.02            # the watch tick while a leader is polled (no pidfd: kernel < 5.3)


class Timer:
    """An entry of the reaper's timer heap (call_at); cancel() from the reaper thread."""

    __slots__ = ("when", "fn", "args", "cancelled")

    def __init__(self, when: float, fn: Callable, args: tuple):
        self.when, self.fn, self.args, self.cancelled = when, fn, args, False

    def cancel(self) -> None:
        """Any thread: it will not run (if it has not begun)."""
        self.cancelled = True
        self.fn, self.args = _noop, ()   # no reference cycle run -> timers -> timer -> run


def _noop(*_: Any) -> None:
    pass


class Reaper(threading.Thread):
    """The executor's one adapter thread. Its public methods that change runs (register,
    terminate, finish, drop_staged) may be called from any thread: they post to it.

    ``discard_held(handle, reason)`` is the executor's: it discards a prepared run that
    has not been released (True if it did), for armed runs whose guard turned false."""

    def __init__(self, backend: QuotaBackend, slots: SlotPool, runs: RunTable, guard: Optional["RunGuard"],
                 discard_held: Callable[[RunHandle, str], bool], *, watch_interval_s: float = 0.2,
                 drain_timeout_s: float = 5.0, keep_work_dir: bool = False,
                 release_confinement: Callable[[Any], None] = lambda conf: None,
                 discard: Optional[Callable[[str], bool]] = None):
        super().__init__(name="millwright-reaper", daemon=True)
        self.backend = backend
        self.slots = slots
        self.runs = runs
        self.guard = guard
        self.discard_held = discard_held
        self.watch_interval_s = watch_interval_s
        self.drain_timeout_s = drain_timeout_s
        self.keep_work_dir = keep_work_dir
        self.release_confinement = release_confinement
        # a run's non-empty work dir goes to the cleaner (agent/execute/cleanup.py)
        self.discard: Callable[[str], bool] = discard or _remove_now
        self.ep = select.epoll()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.ep.register(self.wake_r, select.EPOLLIN)
        self.fds: dict[int, tuple] = {}
        self.cmds: "queue.SimpleQueue" = queue.SimpleQueue()
        self.timers: list = []
        self.seq = itertools.count()
        # other threads add timers and commands: they wake this thread only if it sleeps
        # past what they add (_sleep_until: when its wait ends; -inf while it is awake)
        self._tlock = threading.Lock()
        self._sleep_until = float("-inf")
        self._ending: list[tuple[Run, RunResult]] = []   # on_exit calls of this wake-up
        self.running: set[Run] = set()
        self.polled: set[Run] = set()
        self.throttled: set[Run] = set()   # runs whose progress FIFO spent its budget this tick
        self.orphan_slots: list[tuple[Slot, float]] = []
        # process groups of ended runs to sweep for zombies again, REAP_AGAIN_S after their
        # end: one FIFO per delay (so in time order), swept together every RESWEEP_TICK_S,
        # so that the sweeps cost no timer wake-ups of their own per run
        self.resweeps: dict[float, collections.deque] = {d: collections.deque() for d in REAP_AGAIN_S}
        self.next_resweep = 0.0
        self._stopping = False

    # --- any thread -------------------------------------------------------------------
    def post(self, fn: Callable, *args: Any) -> None:
        """Run fn(*args) on the reaper thread, after everything posted before."""
        self.cmds.put((fn, args))
        with self._tlock:
            asleep = self._sleep_until > float("-inf")
        if asleep:
            self._wake()

    def _wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def on_thread(self) -> bool:
        return threading.current_thread() is self

    def call_at(self, when: float, fn: Callable, *args: Any) -> Timer:
        """fn(*args) on the reaper thread at ``when`` (time.monotonic()). Any thread; the
        reaper is woken only if it would sleep past ``when``."""
        t = Timer(when, fn, args)
        with self._tlock:
            heapq.heappush(self.timers, (when, next(self.seq), t))
            wake = when < self._sleep_until
        if wake:
            self._wake()
        return t

    def stop(self) -> None:
        """The thread ends once no run's pidfd or pipe is watched any more."""
        self.post(self._set_stop)

    def register(self, run: Run) -> None:
        """A run whose job was released (or is not held): watch it until it ends."""
        if self.on_thread():
            self._register(run)
        else:
            self.post(self._register, run)

    def terminate(self, handle: RunHandle, reason: str, grace_s: Optional[float]) -> None:
        """SIGTERM to a running run's group, SIGKILL ``grace_s`` (None: its own grace) later."""
        if self.on_thread():
            self._terminate(handle, reason, grace_s)
        else:
            self.post(self._terminate, handle, reason, grace_s)

    def finish(self, run: Run) -> None:
        """A run that never got a process (spawn error): its result and on_exit."""
        self.post(self._finalize, run)

    def drop_staged(self, staged: "Staged") -> None:
        """A staged run that will not start: its quota container and directories go."""
        self.post(self._drop_staged, staged)

    # --- reaper thread ----------------------------------------------------------------
    def _set_stop(self) -> None:
        self._stopping = True

    def reap_again(self, pgid: int) -> None:
        """Sweep an ended run's process group for zombies again later (REAP_AGAIN_S): a
        member still being re-parented to us at its last sweep turns zombie after it.
        Reaper thread."""
        now = time.monotonic()
        for delay, q in self.resweeps.items():
            q.append((now + delay, pgid))

    def _resweep(self, now: float) -> None:
        for q in self.resweeps.values():
            while q and q[0][0] <= now:
                reap_group(q.popleft()[1])

    def _resweep_due(self) -> Optional[float]:
        """When the next sweep tick is due (None: nothing to sweep)."""
        heads = [q[0][0] for q in self.resweeps.values() if q]
        if not heads:
            return None
        return max(min(heads), self.next_resweep)

    def watch_fd(self, fd: int, what: tuple) -> None:
        self.fds[fd] = what
        self.ep.register(fd, select.EPOLLIN)

    def unwatch_fd(self, fd: int) -> None:
        if self.fds.pop(fd, None) is not None:
            try:
                self.ep.unregister(fd)
            except (KeyError, ValueError, OSError):
                pass

    def retry_orphan_slots(self) -> None:
        """Remove the run cgroups the kernel did not let go of at once (reaper thread, or
        any thread once the reaper stopped)."""
        keep = []
        for slot, since in self.orphan_slots:
            self.backend.kill_all(slot)
            if not self.slots.discard(slot):
                keep.append((slot, since))
        self.orphan_slots = keep

    def _safe(self, fn: Callable, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("reaper handler %s failed", getattr(fn, "__qualname__", fn))

    def _watching(self) -> bool:
        return bool(self.running or self.polled or self.orphan_slots or self.runs.any_armed())

    def run(self) -> None:
        next_watch = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                due = []
                with self._tlock:
                    while self.timers and (self.timers[0][2].cancelled or self.timers[0][0] <= now):
                        _, _, t = heapq.heappop(self.timers)
                        if not t.cancelled:
                            due.append(t)
                for t in due:
                    if not t.cancelled:
                        fn, args = t.fn, t.args
                        t.fn, t.args = _noop, ()
                        self._safe(fn, *args)
                if self._watching() and now >= next_watch:
                    self._safe(self._watch)
                    next_watch = now + (POLLED_WATCH_S if self.polled else self.watch_interval_s)
                resweep_at = self._resweep_due()
                if resweep_at is not None and now >= resweep_at:
                    self._safe(self._resweep, now)
                    self.next_resweep = now + RESWEEP_TICK_S
                    resweep_at = self._resweep_due()
                self._deliver()
                if self._stopping and not self.fds_for_runs():
                    break
                wait = 1.0
                if self._watching():
                    wait = min(wait, next_watch - now)
                if resweep_at is not None:
                    wait = min(wait, resweep_at - now)
                with self._tlock:
                    if self.timers:
                        wait = min(wait, self.timers[0][0] - now)
                    if not self.cmds.empty():
                        wait = 0.0
                    wait = max(0.0, wait)
                    self._sleep_until = now + wait
                try:
                    events = self.ep.poll(wait)
                except InterruptedError:
                    events = []
                with self._tlock:
                    self._sleep_until = float("-inf")
                pidfds = []
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
                        pidfds.append(run)   # after the output that came with it
                    elif kind == "progress":
                        self._safe(self._on_progress, run)
                    else:
                        self._safe(self._on_output, run, stream, ev)
                for run in pidfds:
                    if run.pidfd is not None:
                        self._safe(self._on_pidfd, run)
                while True:
                    try:
                        fn, args = self.cmds.get_nowait()
                    except queue.Empty:
                        break
                    self._safe(fn, *args)
                self._deliver()
        finally:
            self._deliver()
            os.close(self.wake_r)
            os.close(self.wake_w)
            self.ep.close()

    def _deliver(self) -> None:
        """on_exit of the runs that ended in this wake-up, in order, then their handles."""
        ending, self._ending = self._ending, []
        for run, result in ending:
            handle = run.handle
            try:
                run.on_exit(handle, result)
            except Exception:
                log.exception("on_exit callback failed", extra={"fields": {"run": handle.run_key}})
            handle.done.set()

    def fds_for_runs(self) -> bool:
        return bool(self.running or self.polled)

    def _on_output(self, run: Run, s: OutputStream, ev: int) -> None:
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

    def _on_progress(self, run: Run) -> None:
        """New bytes on a run's progress FIFO: valid lines reset its step timer and go to
        its on_progress; a run past its budget is not read again until the next tick."""
        ch = run.progress
        if ch is None or ch.fd < 0:
            return
        if ch.read():
            self.unwatch_fd(ch.fd)
            self.throttled.add(run)
        batch = ch.take()
        if batch and run.on_progress is not None:
            try:
                run.on_progress(run.handle, batch)
            except Exception:
                log.exception("on_progress callback failed", extra={"fields": {"run": run.handle.run_key}})

    def _step_due(self, run: Run) -> None:
        """The step timer: killed (step_timed_out) once no valid progress line came for
        step_timeout_s, else looked at again when that is next possible."""
        ch = run.progress
        if ch is None or run.phase != RunPhase.RUNNING or run.kill_reason is not None or not ch.step_timeout_s:
            return
        self._on_progress(run)   # lines written just now count
        left = ch.last_mono + ch.step_timeout_s - time.monotonic()
        if left > 0:
            run.timers.append(self.call_at(time.monotonic() + left, self._step_due, run))
        else:
            self._terminate(run.handle, ExitReason.STEP_TIMED_OUT, None)

    # --- a run's life on the reaper thread --------------------------------------------
    def _register(self, run: Run) -> None:
        run.phase = RunPhase.RUNNING
        if run.pidfd is not None:
            self.watch_fd(run.pidfd, ("pid", run, None))
        else:
            self.polled.add(run)
        for s in run.streams:
            self.watch_fd(s.rfd, ("out", run, s))
        t = run.handle.spec.timeout_s
        if t and t > 0:
            run.timers.append(self.call_at(run.t0 + t, self._terminate, run.handle, ExitReason.TIMED_OUT, None))
        ch = run.progress
        if ch is not None and ch.fd >= 0:
            ch.last_mono = run.t0   # the step timer counts from the release
            self.watch_fd(ch.fd, ("progress", run, None))
            if ch.step_timeout_s:
                run.timers.append(self.call_at(run.t0 + ch.step_timeout_s, self._step_due, run))
        self.running.add(run)

    def _terminate(self, handle: RunHandle, reason: str, grace_s: Optional[float]) -> None:
        run = self.runs.get(handle.run_key)
        if run is None or run.phase != RunPhase.RUNNING or run.handle is not handle:
            return
        if run.kill_reason is None:
            run.kill_reason = reason
        killpg(handle.pgid, signal.SIGTERM)
        grace = run.grace if grace_s is None else float(grace_s)
        run.timers.append(self.call_at(time.monotonic() + grace, self._hard_kill, run))
        log.info("terminating run", extra={"fields": {"run": handle.run_key, "reason": reason, "grace_s": grace}})

    def _hard_kill(self, run: Run) -> None:
        if run.phase in (RunPhase.RUNNING, RunPhase.DRAINING):
            killpg(run.handle.pgid, signal.SIGKILL)
            if run.slot is not None:
                self.backend.kill_all(run.slot)

    def _watch(self) -> None:
        for run in list(self.polled):
            self._poll_exit(run)
        for run in self.throttled:   # a new tick: their progress FIFOs are read again
            if run.progress is not None and run.progress.fd >= 0:
                run.progress.refill()
                self.watch_fd(run.progress.fd, ("progress", run, None))
        self.throttled.clear()
        for run in self.runs.armed():
            # guard_until promised it could not happen before the due time; if it does
            # (a lease revoked from outside), the armed launcher must not go by itself
            guard = run.guard
            if guard is not None and not guard():
                self.discard_held(run.handle, ExitReason.FENCED)
        for run in list(self.running):
            # the lease this run was claimed under may have run out: kill it on this thread,
            # however busy the caller's loop is (self-fence timing, docs/execution.md)
            guard = run.guard
            if guard is not None and run.phase == RunPhase.RUNNING and run.kill_reason is None and not guard():
                self._terminate(run.handle, ExitReason.FENCED, None)
        running = [x for x in self.running if x.phase == RunPhase.RUNNING and x.slot is not None]
        if running:
            try:
                hits = self.backend.check_all([x.slot for x in running if x.slot is not None])
            except Exception:  # a backend read error must not stop the reaper
                log.exception("quota check failed")
                hits = {}
            for run in running:
                reason = hits.get(run.slot.name) if run.slot is not None else None
                if reason and run.kill_reason is None:
                    run.kill_reason = reason
                    log.warning("run hit its quota", extra={"fields": {"run": run.handle.run_key, "reason": reason}})
                    self._hard_kill(run)
        self.retry_orphan_slots()

    def _poll_exit(self, run: Run) -> None:
        leader = run.handle.pid
        assert leader is not None  # polled only once spawned
        try:   # exited? (not reaped yet: the guard must hear of it before the pid is freed)
            if os.waitid(os.P_PID, leader, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return
        except ChildProcessError:
            pass
        self.polled.discard(run)
        self._leader_exited(run)

    def _on_pidfd(self, run: Run) -> None:
        pidfd = run.pidfd
        assert pidfd is not None  # watched only once spawned
        self.unwatch_fd(pidfd)
        os.close(pidfd)
        run.pidfd = None
        self._leader_exited(run)

    def _leader_exited(self, run: Run) -> None:
        """The leader exited and is not reaped yet: as a zombie it keeps its pid, the run's
        process group id, from being given to another process while the rest of the group
        is killed and the run guard told."""
        leader, pgid = run.handle.pid, run.handle.pgid
        assert leader is not None and pgid is not None
        run.t_end = time.monotonic()
        run.ended_at = time.time()
        run.phase = RunPhase.DRAINING
        self.running.discard(run)
        run.drain_started = run.t_end
        contained = run.slot is not None and self.backend.contains_runs
        left = self.backend.members(run.slot) if contained and run.slot is not None else []
        # the leader is gone: whatever it left behind is killed now
        killpg(pgid, signal.SIGKILL)
        if self.guard is not None:
            if contained and not left:
                # nothing of the run is alive (its cgroups hold every process it had): the
                # keeper forgets it, in one line, before the leader's pid is freed
                self.guard.remove(pgid)
            else:   # from the reap on, the keeper finds it by its cgroups only
                self.guard.leader_exited(pgid)
        try:
            pid, status, ru = os.wait4(leader, os.WNOHANG)
        except ChildProcessError:
            pid, status, ru = leader, 0, None
        run.status, run.rusage = (status, ru) if pid else (0, None)
        if run.popen is not None:   # we reaped it: subprocess must never waitpid() it again
            run.popen.returncode = os.waitstatus_to_exitcode(run.status)
        if not contained and run.slot is not None:
            left = self.backend.members(run.slot)   # (a group scan: after the reap, cheap when empty)
        if left and run.slot is not None:
            run.left_behind = True   # its slot is not reused
            self.backend.kill_all(run.slot)
        # nothing alive in the run's cgroups: nothing can appear there any more, so the
        # first drain round need not list them again (a run's end is the reaper's hot path)
        self._drain(run, 0, known_empty=not left)

    def _drain(self, run: Run, n: int, known_empty: bool = False) -> None:
        reap_group(run.handle.pgid)
        left = self.backend.members(run.slot) if run.slot is not None and not known_empty else []
        if left and time.monotonic() - run.drain_started < self.drain_timeout_s:
            if n % 5 == 4:
                self._hard_kill(run)
            run.timers.append(self.call_at(time.monotonic() + min(0.1, 0.002 * 2 ** n), self._drain, run, n + 1))
            return
        if not left and not known_empty:
            # what members() no longer lists may have turned zombie after the first sweep
            # (with known_empty no listing came between: the sweep above is just as late)
            reap_group(run.handle.pgid)
        if left:
            log.warning("processes of a run survived SIGKILL", extra={"fields": {
                "run": run.handle.run_key, "pids": left[:10]}})
        elif run.slot is not None and not run.slot_back:
            # usage first (it lives in the cgroup, read once), then the slot goes back to the
            # pool or is removed; the kernel may report EBUSY for a moment after the last
            # task exited: retry shortly
            if run.usage is None:
                run.usage = self._read_usage(run)
            if self.slots.give_back(run.slot, clean=n == 0 and self._clean(run)):
                run.slot_back = True
            elif time.monotonic() - run.drain_started < self.drain_timeout_s:
                run.timers.append(self.call_at(time.monotonic() + min(0.1, 0.002 * 2 ** n), self._drain, run, n + 1))
                return
        self._finalize(run)

    @staticmethod
    def _clean(run: Run) -> bool:
        """The run left its slot as it found it: nothing outlived its leader, no quota event,
        and not 126 (what a launcher that could not join its slot exits with: a slot whose
        cgroup went away must not fail every run after it)."""
        u = run.usage
        return (not run.left_behind and run.kill_reason not in (ExitReason.OOM, ExitReason.PIDS_LIMIT)
                and (u is None or (u.oom_kills == 0 and u.pids_max_events == 0))
                and (run.status is None or os.waitstatus_to_exitcode(run.status) != LAUNCHER_FAILED))

    def _read_usage(self, run: Run) -> Usage:
        """The run's usage, read once at its end (the slot's counters become its base)."""
        if run.slot is None:
            return Usage()
        try:
            return self.backend.usage(run.slot, run.rusage, final=True)
        except Exception:
            log.exception("reading usage failed")
            return Usage()

    def _give_back(self, slot: Slot, clean: bool) -> None:
        """A run's quota container goes back to the pool or is removed; one the kernel does
        not let go of yet is retried by the watch tick (orphan_slots), never reused."""
        if not slot.removed and not self.slots.give_back(slot, clean):
            m.CGROUP_CLEANUP_FAILURES.inc()
            self.orphan_slots.append((slot, time.monotonic()))

    def _drop_staged(self, staged: "Staged") -> None:
        if staged.slot is not None:
            self._give_back(staged.slot, True)   # no process ever ran in it
        prepared = staged.process
        if prepared is not None and prepared.confinement is not None:
            self.release_confinement(prepared.confinement)
        dirs = [staged.work_dir_created] if staged.work_dir_created else []
        if prepared is not None:
            for path in prepared.channel:   # its progress FIFO and result file
                try:
                    os.unlink(path)
                except OSError:
                    pass
            dirs.append(prepared.run_dir)   # then the run dir (no output file is made before a start)
        for path in dirs:
            try:
                os.rmdir(path)
            except OSError:
                pass

    def _finalize(self, run: Run) -> None:
        for t in run.timers:
            t.cancel()
        run.timers.clear()
        run.on_release = run.guard = None
        self.running.discard(run)
        self.polled.discard(run)
        self.throttled.discard(run)
        progress = result = result_error = None
        if run.progress is not None:
            ch, run.progress = run.progress, None
            self.unwatch_fd(ch.fd)
            result, result_error = ch.finish()
            batch = ch.take()
            if batch and run.on_progress is not None:
                self._safe(run.on_progress, run.handle, batch)
            progress = ch.summary() if ch.lines or ch.invalid else None
        run.on_progress = None
        if run.pidfd is not None:
            self.unwatch_fd(run.pidfd)
            os.close(run.pidfd)
            run.pidfd = None
        handle = run.handle
        usage = run.usage or Usage()
        if run.slot is not None and not run.slot_back:
            if run.usage is None:
                usage = run.usage = self._read_usage(run)
            run.slot_back = True
            self._give_back(run.slot, self._clean(run))
        if self.guard is not None and handle.pgid:
            self.guard.remove(handle.pgid)
        if handle.pgid:
            # a member still being re-parented to us (its parent mid-exit) at the last sweep
            # turns zombie after it: sweep the group again shortly. The group's number is not
            # handed out again while any of its zombies exists, so this reaps only this run's.
            self.reap_again(handle.pgid)
        for s in run.streams:
            self.unwatch_fd(s.rfd)
            s.drain()   # a file is made only for what comes (none for a silent run)
            s.close()
        if run.work_dir_created and not self.keep_work_dir:
            try:
                os.rmdir(run.work_dir_created)   # most jobs leave it empty: one syscall
            except OSError:
                # whatever the job left (any depth, any count) is the cleaner's, on its own
                # thread: here one rename, so no run's end waits for a delete
                self.discard(run.work_dir_created)
        if run.confinement is not None:   # nothing of the run is left: its id may serve another
            conf, run.confinement = run.confinement, None
            self.release_confinement(conf)
        exit_code = sig = None
        if run.status is not None:
            code = os.waitstatus_to_exitcode(run.status)
            exit_code, sig = (code, None) if code >= 0 else (None, -code)
        reason = str(_exit_reason(run, usage, exit_code))
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
            backend=self.backend.name, progress=progress, result=result, result_error=result_error)
        run.phase = RunPhase.DONE
        self.runs.remove(handle.run_key)
        if handle.pid is not None:
            m.RUNS_RUNNING.dec()
        m.RUNS_FINISHED.labels(reason).inc()
        if reason in (ExitReason.OOM, ExitReason.PIDS_LIMIT):
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
        self._ending.append((run, result))   # on_exit at the end of this wake-up (_deliver)


def _remove_now(path: str) -> bool:
    """Without a cleaner (a Reaper built on its own, in tests): the same walk, here."""
    parent, name = os.path.split(os.path.normpath(path))
    fd = os.open(parent or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return remove_tree(fd, name, 1 << 62).done
    finally:
        os.close(fd)


def _exit_reason(run: Run, usage: Usage, exit_code: Optional[int]) -> str:
    """Why a run ended: a spawn error, then the reason it was killed for, then a quota
    the kernel enforced by itself, then its exit code."""
    if run.error:
        return ExitReason.SPAWN_ERROR
    if run.kill_reason:
        return run.kill_reason
    if usage.oom_kills > 0:
        return ExitReason.OOM
    if usage.pids_max_events > 0:
        return ExitReason.PIDS_LIMIT
    if exit_code == 0:
        return ExitReason.SUCCEEDED
    return ExitReason.FAILED
