"""The executor's one adapter thread, ``millwright-reaper``: poll() over the runs' pidfds
and output pipes, a timer heap and a command queue; and the process helpers it uses.

Orphans of a run re-parent to the agent (a child subreaper), and are collected by
process group, never touching the agent's other children."""

from __future__ import annotations

import collections
import errno
import heapq
import itertools
import logging
import os
import queue
import select
import signal
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from agent.execute.backends import Slot, Usage
from agent.execute.runs import RunHandle, RunResult

if TYPE_CHECKING:  # pragma: no cover
    from agent.execute.executor import Executor

log = logging.getLogger("millwright.execute")

REAP_AGAIN_S = (0.2, 1.0, 3.0)   # after a run ended, its process group is swept for zombies again
RESWEEP_TICK_S = 0.1             # ... in sweeps of every group due, at most this often


class _Stream:
    """One output pipe of a run and the log file it is copied to (the first ``limit``
    bytes). The reaper thread creates the file when the first byte comes (open()): a run
    that writes nothing has none, and costs the state disk no inode (made, then freed by
    retention: on ext4 without a journal every allocation scans past the inodes freed in
    the last minutes, issue 18's profile). ``tail`` > 0 keeps the end of what was written
    in memory: the final record's stderr_tail without reading the file back."""

    __slots__ = ("rfd", "wfd", "path", "written", "dropped", "limit", "tail", "_tail_max", "_unwritable",
                 "created")

    def __init__(self, rfd: int, path: str, limit: int, tail: int = 0):
        self.rfd = rfd
        self.path = path
        self.wfd = -1
        self.written = 0
        self.dropped = 0
        self.limit = limit
        self.tail = bytearray()
        self._tail_max = tail
        self._unwritable = False
        self.created = False   # the log file exists (the run wrote something)

    def open(self) -> bool:
        """Create (truncate) the log file, once; reaper thread. False if it cannot be
        created (logged once; the output is then counted as dropped)."""
        if self.wfd < 0 and not self._unwritable:
            try:
                self.wfd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)  # state files are root-only (issue 16)
                self.created = True
            except OSError as exc:
                self._unwritable = True
                log.warning("cannot create a run's output file", extra={"fields": {"path": self.path, "error": exc.strerror}})
        return self.wfd >= 0

    def feed(self, data: bytes) -> None:
        keep = max(0, min(len(data), self.limit - self.written)) if self.open() else 0
        if keep:
            view = memoryview(data)[:keep]
            if self._tail_max:
                self.tail += view[-self._tail_max:]
                del self.tail[:-self._tail_max]
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
        self._unwritable = True   # closed for good: a second (truncating) open would empty the file


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
        self.armed_at: Optional[float] = None   # wall clock: its launcher releases itself then


class _Timer:
    __slots__ = ("when", "fn", "args", "cancelled")

    def __init__(self, when, fn, args):
        self.when, self.fn, self.args, self.cancelled = when, fn, args, False

    def cancel(self) -> None:
        self.cancelled = True
        self.fn, self.args = _noop, ()   # no reference cycle run -> timers -> timer -> run


def _noop(*_: Any) -> None:
    pass



class Reaper(threading.Thread):
    """The executor's one adapter thread: poll() over pidfds and output pipes, a timer
    heap, and a command queue fed by post()."""

    def __init__(self, ex: "Executor"):
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
        # process groups of ended runs to sweep for zombies again, REAP_AGAIN_S after their
        # end: one FIFO per delay (so in time order), swept together every RESWEEP_TICK_S
        # (three timers per run cost ~50 of this thread's ~550 wake-ups/s at 100 runs/s:
        # most of them fell together with a run event's wake-up anyway)
        self.resweeps: dict[float, collections.deque] = {d: collections.deque() for d in REAP_AGAIN_S}
        self.next_resweep = 0.0
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

    def reap_again(self, pgid: int) -> None:
        """Sweep an ended run's process group for zombies again later (REAP_AGAIN_S): a
        member still being re-parented to us at its last sweep turns zombie after it."""
        now = time.monotonic()
        for delay, q in self.resweeps.items():
            q.append((now + delay, pgid))

    def _resweep(self, now: float) -> None:
        for q in self.resweeps.values():
            while q and q[0][0] <= now:
                _reap_group(q.popleft()[1])

    def _resweep_due(self) -> Optional[float]:
        """When the next sweep tick is due (None: nothing to sweep)."""
        heads = [q[0][0] for q in self.resweeps.values() if q]
        if not heads:
            return None
        return max(min(heads), self.next_resweep)

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
            if (self.running or self.polled or self.orphan_slots or ex.armed) and now >= next_watch:
                self._safe(ex._watch)
                next_watch = now + (0.02 if self.polled else ex.watch_interval_s)
            resweep_at = self._resweep_due()
            if resweep_at is not None and now >= resweep_at:
                self._safe(self._resweep, now)
                self.next_resweep = now + RESWEEP_TICK_S
                resweep_at = self._resweep_due()
            if self._stopping and not self.fds_for_runs():
                break
            wait = 1.0
            if self.timers:
                wait = min(wait, self.timers[0][0] - now)
            if self.running or self.polled or self.orphan_slots or ex.armed:
                wait = min(wait, next_watch - now)
            if resweep_at is not None:
                wait = min(wait, resweep_at - now)
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
