"""Removing what runs leave behind, off the thread that ends runs.

A run's work directory is the job's to fill: a 5,000-deep chain of directories, hundreds of
thousands of files, a symlink to /etc. ``shutil.rmtree`` recurses once per level (a
RecursionError past ~1,000 levels in 3.10/3.11) and holds one descriptor per level (EMFILE at
an open-file soft limit of 1,024), and a big tree holds the caller for as long as the delete
takes. So the reaper never deletes a tree: ``Cleaner.discard`` renames it into a trash
directory (one system call, whatever the tree holds) and the cleaner's thread has it removed
by a helper process (so the walk never holds this interpreter's lock):

* ``remove_tree`` (agent/execute/rmtree.py, the helper's script): an iterative walk on descriptors (``openat``/``unlinkat`` through
  ``dir_fd``), holding at most three at a time whatever the depth; it never follows a
  symbolic link (``O_NOFOLLOW``, and ``unlink`` of a link removes the link) and never enters
  a directory of another file system (a mount point is refused, not crossed). It goes back up
  through ``..`` of the descriptor it holds and checks that the parent is the directory it
  came from (device and inode), so nothing renamed meanwhile makes it delete elsewhere.
* bounded work: a pass removes at most ``pass_entries`` entries; a tree that fails
  ``max_tries`` passes, or needs more than ``max_tree_entries`` removals, is moved into the
  quarantine (at most ``max_quarantined`` trees; beyond that it stays in the trash under a
  ``stuck.`` name that no pass looks at again). Either is reported, and never retried.
* the trash is the queue: it is on disk, so a tree a dead predecessor left there is removed
  after a restart, and nothing of it is held in memory but the tries of trees in it.

Outcomes go to ``on_report(report)`` on the cleaner's thread (the daemon posts them to its
loop, which writes the audit record). Runs never wait for it: a run's end is its rename.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable, NamedTuple, Optional

from agent.execute import metrics as m
from agent.execute import rmtree
from agent.execute.rmtree import Progress, remove_tree

__all__ = ["Cleaner", "Progress", "Report", "STUCK_PREFIX", "remove_tree"]

log = logging.getLogger(__name__)

STUCK_PREFIX = "stuck."
_WALKER = rmtree.__file__


class Report(NamedTuple):
    """What became of one discarded tree: event ``removed``, ``quarantined`` or ``stuck``
    (the quarantine was full: the tree stays in the trash, never looked at again)."""
    event: str
    name: str       # its name in the trash: <sequence>.<what it was>
    entries: int    # entries removed in all
    seconds: float  # from its discard to this outcome
    reason: Optional[str] = None
    where: Optional[str] = None   # a quarantined or stuck tree's path now


class _Tree:
    __slots__ = ("removed", "tries", "since", "not_before", "error")

    def __init__(self, since: float):
        self.removed = 0
        self.tries = 0
        self.since = since
        self.not_before = 0.0
        self.error: Optional[str] = None


class Cleaner(threading.Thread):
    """The one thread that removes discarded trees (see the module docstring). ``discard``
    is safe from any thread; everything else of it runs on its own thread."""

    def __init__(self, root: str, *, pass_entries: int = 50_000, max_tries: int = 5,
                 max_tree_entries: int = 2_000_000, max_quarantined: int = 32, retry_s: float = 30.0,
                 pass_timeout_s: float = 300.0, on_report: Optional[Callable[[Report], Any]] = None):
        super().__init__(name="millwright-cleaner", daemon=True)
        self.root = os.path.abspath(root)
        self.trash = os.path.join(self.root, "trash")
        self.quarantine = os.path.join(self.root, "quarantine")
        for d in (self.root, self.trash, self.quarantine):
            os.makedirs(d, mode=0o700, exist_ok=True)
            # the agent's own: no run user may enter what was a run's work dir once it is here
            os.chown(d, os.geteuid(), os.getegid())
            os.chmod(d, 0o700)
        self.pass_entries = max(1, int(pass_entries))
        self.max_tries = max(1, int(max_tries))
        self.max_tree_entries = int(max_tree_entries)
        self.max_quarantined = int(max_quarantined)
        self.retry_s = float(retry_s)
        self.pass_timeout_s = float(pass_timeout_s)
        self._child: Optional[subprocess.Popen] = None   # the walker of the pass under way
        self.on_report = on_report
        self._seq = itertools.count(1)
        self._prefix = f"{time.time_ns():x}"   # names unique across restarts, in discard order
        self._wake = threading.Event()
        self._halt = threading.Event()
        self._idle = threading.Event()
        self._trees: dict[str, _Tree] = {}   # trees now in the trash (pruned every pass)
        self._since: dict[str, float] = {}   # discard time by name, set by discard (any thread)
        self._lock = threading.Lock()
        self._gen = 0   # discards so far: a pass that began before the last one is not idle

    # --- any thread -------------------------------------------------------------------
    def discard(self, path: str) -> bool:
        """Move ``path`` (a directory on the trash's file system, no longer used by any
        process) into the trash and wake the cleaner. One rename, whatever it holds. False
        (logged, counted) if it cannot be moved: it stays, closed to everyone but the agent."""
        name = f"{self._prefix}-{next(self._seq):08d}.{os.path.basename(os.path.normpath(path))}"
        try:
            os.rename(path, os.path.join(self.trash, name))
        except FileNotFoundError:
            return True
        except OSError as exc:
            m.CLEANUP_TREES.labels("not_moved").inc()
            log.warning("a discarded directory cannot be moved to the trash", extra={"fields": {
                "path": path, "error": exc.strerror or str(exc)}})
            try:   # its owner (a run's user, maybe given to another run next) loses it
                os.chown(path, os.geteuid(), os.getegid(), follow_symlinks=False)
                os.chmod(path, 0o700, follow_symlinks=False)
            except (OSError, NotImplementedError):
                pass
            return False
        with self._lock:
            self._since[name] = time.monotonic()
            self._gen += 1
        m.CLEANUP_PENDING.inc()
        self._idle.clear()
        self._wake.set()
        return True

    def stop(self) -> None:
        self._halt.set()
        self._wake.set()
        child = self._child
        if child is not None:   # a long walk is not waited for: the trash keeps what is left
            try:
                child.kill()
            except OSError:
                pass

    def wait_idle(self, timeout: float) -> bool:
        """Test and shutdown helper: True once a pass found nothing left to do now."""
        self._wake.set()
        return self._idle.wait(timeout)

    # --- the cleaner's thread -------------------------------------------------------------
    def run(self) -> None:
        wait: Optional[float] = 0.0   # a predecessor's trash first
        while not self._halt.is_set():
            if wait is None or wait > 0:
                self._wake.wait(wait)
            self._wake.clear()
            if self._halt.is_set():
                break
            try:
                wait = self.one_pass()
            except Exception:   # a bug: logged, the thread goes on (every tree stays in the trash)
                log.exception("cleanup pass failed")
                wait = self.retry_s

    def one_pass(self) -> Optional[float]:
        """At most pass_entries removals over the trash, in one helper process (see
        _walk), trees with the least work done first (a small new tree is not held behind
        a big one). Returns how long to wait before the next pass (None: until a discard)."""
        now = time.monotonic()
        gen = self._gen
        try:
            names = [n for n in os.listdir(self.trash) if not n.startswith(STUCK_PREFIX)]
        except OSError as exc:
            log.warning("cleanup trash cannot be listed", extra={"fields": {"error": exc.strerror}})
            return self.retry_s
        with self._lock:
            since = {n: self._since.pop(n, now) for n in names}
        trees = {n: self._trees.get(n) or _Tree(since[n]) for n in names}
        self._trees = trees
        later: Optional[float] = None
        order = []
        for n in sorted(trees, key=lambda k: (trees[k].removed, k)):
            if trees[n].not_before > now:
                later = min(later or trees[n].not_before, trees[n].not_before)
            else:
                order.append(n)
        done = self._walk(order, trees) if order else {}
        for n in order:
            t, p = trees[n], done.get(n)
            if p is None:   # the budget did not reach it: the next pass
                later = now
                continue
            t.removed += p.removed
            m.CLEANUP_ENTRIES.inc(p.removed)
            if p.done:
                del trees[n]
                self._report(Report("removed", n, t.removed, time.monotonic() - t.since))
                continue
            if p.error is not None:
                t.tries += 1
                t.error = p.error
                t.not_before = time.monotonic() + self.retry_s
            if t.tries >= self.max_tries or t.removed > self.max_tree_entries:
                del trees[n]
                reason = (f"failed {t.tries} times: {t.error}" if t.tries >= self.max_tries
                          else f"more than {self.max_tree_entries} entries")
                self._set_aside(n, t, reason)
            elif p.error is None:
                later = now   # the budget ran out in it: go on in the next pass
            else:
                later = min(later or t.not_before, t.not_before)
        m.CLEANUP_PENDING.set(len(trees))
        if not trees and gen == self._gen:
            self._idle.set()
        if later is None:
            return None
        return max(0.0, later - time.monotonic())

    def _walk(self, order: list[str], trees: dict[str, "_Tree"]) -> dict[str, Progress]:
        """One helper process (agent/execute/rmtree.py, run as a script) removes up to
        pass_entries entries over ``order``: the walk holds no lock of this interpreter
        (its end-of-run thread is never held behind it), runs at a lower priority, and is
        killed past pass_timeout_s or at stop(). A helper that fails counts as a failed
        try of every tree it was given: so a tree that kills it is set aside in the end."""
        argv = [sys.executable or "/usr/bin/python3", "-I", "-S", _WALKER, self.trash, str(self.pass_entries)]
        for n in order:   # each with its own cap: a tree past max_tree_entries is set aside
            argv += [n, str(max(1, self.max_tree_entries - trees[n].removed + 1))]
        out: dict[str, Progress] = {}
        error = None
        try:
            with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                  close_fds=True, cwd="/") as child:
                self._child = child
                if self._halt.is_set():
                    child.kill()
                try:
                    stdout, stderr = child.communicate(timeout=self.pass_timeout_s)
                except subprocess.TimeoutExpired:
                    child.kill()
                    stdout, stderr = child.communicate()
                    error = f"walk over {self.pass_timeout_s:g} s"
                for line in stdout.decode(errors="replace").splitlines():
                    try:
                        doc = json.loads(line)
                        out[doc["name"]] = Progress(bool(doc["done"]), int(doc["removed"]), doc["error"])
                    except (ValueError, KeyError, TypeError):
                        error = f"bad answer {line[:200]!r}"
                if child.returncode != 0 and error is None:
                    error = f"walker exited {child.returncode}: {stderr.decode(errors='replace')[-300:]}"
        except OSError as exc:
            error = f"cannot start the walker: {exc.strerror or exc}"
        finally:
            self._child = None
        if error is not None and not self._halt.is_set():
            m.CLEANUP_TREES.labels("walker_failed").inc()
            log.warning("cleanup walker failed", extra={"fields": {"error": error}})
            for n in order:
                p = out.get(n)
                if p is None or not p.done:
                    out[n] = Progress(False, p.removed if p else 0, (p.error if p and p.error else error))
        return out

    def _set_aside(self, name: str, t: _Tree, reason: str) -> None:
        """A tree the cleaner gives up on: into the quarantine while it has room, else left
        in the trash as stuck. Never looked at again by a pass."""
        event, where = "quarantined", os.path.join(self.quarantine, name)
        try:
            full = len(os.listdir(self.quarantine)) >= self.max_quarantined
        except OSError:
            full = True
        if full:
            event, where = "stuck", os.path.join(self.trash, STUCK_PREFIX + name)
        try:
            os.rename(os.path.join(self.trash, name), where)
        except OSError as exc:   # stays in the trash: tried again after retry_s
            log.warning("cannot set aside a tree", extra={"fields": {"name": name, "error": exc.strerror}})
            t.tries = 0
            t.not_before = time.monotonic() + self.retry_s
            self._trees[name] = t
            return
        self._report(Report(event, name, t.removed, time.monotonic() - t.since, reason, where))

    def _report(self, r: Report) -> None:
        m.CLEANUP_TREES.labels(r.event).inc()
        m.CLEANUP_SECONDS.observe(r.seconds)
        if r.event == "removed":
            log.debug("discarded tree removed", extra={"fields": {"name": r.name, "entries": r.entries,
                                                                 "seconds": round(r.seconds, 3)}})
        else:
            log.warning("discarded tree set aside", extra={"fields": {
                "event": r.event, "name": r.name, "entries": r.entries, "reason": r.reason, "where": r.where}})
        if self.on_report is not None:
            try:
                self.on_report(r)
            except Exception:
                log.exception("cleanup report callback failed")
