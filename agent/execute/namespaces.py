"""The namespaces runs start in, made once per executor and kept by file descriptor (so
nothing is left on the host when the agent ends, however it ends), and the way a
launcher is started inside them: the spawning thread enters them around its one spawn
call (setns is per thread; the launcher inherits the thread's namespaces), no process
and no exec of our own.

* the *jobs mount namespace*, a copy of the agent's (receiving later host mounts, sending
  none back) where the agent's secrets are covered: each hidden directory by an empty
  read-only tmpfs (the one holding the runs' directories shows only that), each hidden
  file by an empty mode-000 file (agent/execute/hiding.py decides which: directories
  whole wherever it can, as a file's cover goes when the file is renamed over); a cover
  the host detached since (a file replaced, a directory made again) is made again before
  every spawn and every second (``refresh``); ``/proc`` is a new proc instance with
  ``hidepid=invisible`` (a process is listed only to those who may trace it: a run sees
  its own processes, never the agent's or another run's), its ``sys``, ``sysrq-trigger``,
  ``irq`` and ``bus`` read-only; the cgroup file systems read-only; tracefs, debugfs and
  bpffs covered.
* the *none network namespace*: no interface but a loopback that is down.
* root runs start from a thread of their own that also enters a fresh Landlock domain
  scoped for signals and abstract Unix sockets (the run may signal only its own
  processes: not the agent, not another run, though they share uid 0); where Landlock
  cannot scope signals (Linux < 6.12) the thread makes a PID namespace instead, whose
  init is the launcher (then the job), which the kernel spares SIGTERM unless it handles
  it (SIGKILL still ends it).
"""

from __future__ import annotations

import _thread
import logging
import os
import stat
import threading
from typing import Any, Callable, Iterable, Optional

from agent.execute.confine import RUN_FILES_ID
from agent.execute.hiding import shared_dir
from agent.runtime import kernel as k

log = logging.getLogger(__name__)

PROC_READ_ONLY = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus")
SYS_COVERED = ("/sys/kernel/debug", "/sys/kernel/tracing", "/sys/fs/bpf")
BLANK_DIR = "/tmp"
RO = k.MS_RDONLY | k.MS_NOSUID | k.MS_NODEV | k.MS_NOEXEC
# how often covers are checked against the host's paths (besides before every spawn)
REFRESH_INTERVAL_S = 1.0
# a file re-covered after the start: /dev/null bound over it on a nodev mount (opening it fails)
NULL_DEVICE = "/dev/null"


def _identity(path: str) -> Optional[tuple[int, int]]:
    """(device, inode) of the host's ``path`` (None: absent): a cover is a mount on that
    inode, which the kernel detaches when the inode leaves the path (unlink, rename over)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _mountpoints() -> list[str]:
    out = []
    try:
        with open("/proc/thread-self/mountinfo") as fh:
            for line in fh:
                out.append(line.split()[4].replace("\\040", " "))
    except OSError:
        pass
    return out


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _in_thread(fn: Callable[[], Any], name: str) -> Any:
    """fn() on a new thread (namespace and Landlock changes that must not stay on the
    caller's), its result or exception here. A bare thread and one lock: the caller
    waits once, for the end (threading.Thread's start() waits for the start too)."""
    box: dict = {}
    done = _thread.allocate_lock()
    done.acquire()

    def body() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = exc
        finally:
            done.release()

    _thread.start_new_thread(body, ())
    done.acquire()
    if "error" in box:
        raise box["error"]
    return box.get("value")


class JobNamespaces:
    """The jobs mount namespace and the none network namespace, by fd, and the spawn of a
    launcher inside them."""

    def __init__(self, hide: Iterable[str], expose: Iterable[str], refresh_interval_s: float = REFRESH_INTERVAL_S):
        self.hidden: list[str] = []
        hide = sorted({os.path.realpath(p) for p in hide if p})
        # the host's inode at each hidden path as covered (taken before the covers: a change
        # in between is seen as one, and covered again: harmless)
        self._seen: dict[str, Optional[tuple[int, int]]] = {p: _identity(p) for p in hide}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: Optional[threading.Thread] = None
        self.recovered = 0   # covers made again after a host change (tests, the status)
        self.landlock = k.landlock_abi() >= k.LANDLOCK_SCOPE_ABI
        self.host_mnt = os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        self.host_net = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self.jobs_mnt = -1
        self.none_net = -1
        try:
            expose = [os.path.realpath(p) for p in expose]
            for path in expose:   # bound into the namespace now: it must exist
                os.makedirs(path, mode=0o711, exist_ok=True)
            self.jobs_mnt = _in_thread(lambda: self._make_mount_ns(list(hide), expose), "millwright-ns")
            self.none_net = _in_thread(self._make_net_ns, "millwright-ns")
        except BaseException:
            self.close()
            raise
        self.exposed = expose
        if refresh_interval_s > 0:
            self._watcher = threading.Thread(target=self._watch, args=(refresh_interval_s,),
                                             name="millwright-hide", daemon=True)
            self._watcher.start()

    # --- made once ------------------------------------------------------------------
    def _make_net_ns(self) -> int:
        k.unshare(k.CLONE_NEWNET)
        return os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)

    def _make_mount_ns(self, hide: list[str], expose: list[str]) -> int:
        k.unshare(k.CLONE_NEWNS)
        k.mount(None, "/", None, k.MS_REC | k.MS_SLAVE)
        keep = {p: os.open(p, os.O_PATH | os.O_CLOEXEC) for p in expose if os.path.isdir(p)}
        paths = sorted({os.path.realpath(p) for p in hide if p})
        files = {p: os.open(p, os.O_PATH | os.O_CLOEXEC) for p in paths if os.path.isfile(p)}
        try:
            # the empty mode-000 file bound over each hidden file (by fd: it may be under
            # /tmp), made on a tmpfs over /tmp for the set-up only (its binds outlive it)
            k.mount("none", BLANK_DIR, "tmpfs", k.MS_NOSUID | k.MS_NODEV | k.MS_NOEXEC, "mode=700,size=4k")
            try:
                blank = os.path.join(BLANK_DIR, "hidden")
                os.close(os.open(blank, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0))
                for fd in files.values():
                    k.mount(blank, f"/proc/self/fd/{fd}", None, k.MS_BIND)
            finally:
                k.umount(BLANK_DIR, k.MNT_DETACH)
            for path in files:
                k.mount(None, path, None, k.MS_REMOUNT | k.MS_BIND | RO)
                self.hidden.append(path)
            mounts = _mountpoints()
            for path in paths:
                if os.path.isdir(path) and shared_dir(path) is None and not any(_under(path, e) for e in keep):
                    # (a directory inside what runs must reach is never covered)
                    self._cover_dir(path, [e for e in keep if _under(e, path)], keep)
            for path in SYS_COVERED:
                if path in mounts:
                    k.mount("none", path, "tmpfs", RO, "mode=000,size=4k")
            for path in mounts:
                if _under(path, "/sys/fs/cgroup") and path != "/sys/fs/cgroup":
                    k.mount(None, path, None, k.MS_REMOUNT | k.MS_BIND | RO)
            k.mount("proc", "/proc", "proc", k.MS_NOSUID | k.MS_NODEV | k.MS_NOEXEC, "hidepid=invisible")
            for path in PROC_READ_ONLY:
                if os.path.exists(path):
                    k.mount(path, path, None, k.MS_BIND | k.MS_REC)
                    k.mount(None, path, None, k.MS_REMOUNT | k.MS_BIND | RO)
            return os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            for fd in list(keep.values()) + list(files.values()):
                os.close(fd)

    def _cover_dir(self, path: str, inside: list[str], keep: dict[str, int]) -> None:
        """An empty read-only tmpfs over ``path``; the exposed directories below it are
        bound back at their paths (the tmpfs is traversable, lists only them)."""
        # owned by the reserved id: a root run (uid 0) is no owner of it either
        mode = f"mode={'0711' if inside else '000'},uid={RUN_FILES_ID},gid={RUN_FILES_ID}"
        k.mount("none", path, "tmpfs", k.MS_NOSUID | k.MS_NODEV | k.MS_NOEXEC, f"{mode},size=64k")
        for e in inside:
            os.makedirs(e, mode=0o711, exist_ok=True)
            k.mount(f"/proc/self/fd/{keep[e]}", e, None, k.MS_BIND | k.MS_REC)
        k.mount(None, path, None, k.MS_REMOUNT | RO, mode)
        self.hidden.append(path)

    # --- the second line: covers made again after a host change ----------------------
    def refresh(self, everything: bool = False) -> list[str]:
        """Cover again, in the jobs' namespace, every hidden path that is no longer covered
        there: the kernel detaches a cover when its inode leaves the host's path (a file
        replaced by rename, a directory removed and made again), and a path that did not
        exist when the namespace was built had none. Returns the paths covered again.
        Before every spawn it looks only when a host inode changed (one lstat per hidden
        path); the periodic pass (``everything``) looks at the jobs' namespace itself (an
        inode number the file system gave again goes unseen by the first check). A
        directory covers what happens inside it: this is for the files covered alone and
        for the directories themselves."""
        if self.jobs_mnt < 0 or (not everything and all(_identity(p) == seen for p, seen in self._seen.items())):
            return []
        with self._lock:
            if self.jobs_mnt < 0:
                return []
            now = {p: _identity(p) for p in self._seen}
            done = _in_thread(self._recover, "millwright-ns")
            self._seen.update(now)
            self.recovered += len(done)
        if done:
            log.warning("hidden paths changed on the host: covered again in the jobs' namespace",
                        extra={"fields": {"paths": done}})
        return done

    def _recover(self) -> list[str]:
        """On a thread of its own (it ends after): each hidden path that runs would see
        uncovered, covered. A path that is a mount point there is left alone (an edit in
        place keeps the cover: nothing is stacked)."""
        k.unshare(k.CLONE_FS)   # (setns into a mount namespace needs a thread of its own)
        k.setns(self.jobs_mnt, k.CLONE_NEWNS)
        mounted = set(_mountpoints())
        done = []
        for path in self._seen:
            if path in mounted:
                continue
            try:
                st = os.lstat(path)   # what runs would now see there
            except OSError:
                continue   # absent (or inside a cover): nothing to hide
            try:
                if stat.S_ISDIR(st.st_mode):
                    if shared_dir(path) is not None or any(_under(e, path) for e in self.exposed):
                        log.critical("a hidden directory was replaced and cannot be covered again while runs "
                                     "must reach inside it; restart the agent", extra={"fields": {"path": path}})
                        continue
                    mode = f"mode=000,uid={RUN_FILES_ID},gid={RUN_FILES_ID}"
                    k.mount("none", path, "tmpfs", RO, f"{mode},size=4k")
                elif stat.S_ISLNK(st.st_mode):
                    # (a mount would follow it to where it points: the host's file there is
                    # not ours to cover; a link in a covered directory is covered with it)
                    log.critical("a hidden path became a symbolic link: not covered again",
                                 extra={"fields": {"path": path}})
                    continue
                else:
                    # a file, socket or FIFO: the null device over it, on a nodev mount (so
                    # opening it fails: a device is never opened through a nodev mount)
                    k.mount(NULL_DEVICE, path, None, k.MS_BIND)
                    k.mount(None, path, None, k.MS_REMOUNT | k.MS_BIND | RO)
            except OSError as exc:
                log.critical("cannot cover a hidden path again", extra={"fields": {
                    "path": path, "error": exc.strerror or str(exc)}})
                continue
            done.append(path)
        return done

    def _watch(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.refresh(everything=True)
            except Exception:   # noqa: BLE001 - the watcher outlives one failed pass
                log.exception("hidden paths: refresh failed")

    # --- per spawn -----------------------------------------------------------------
    def on_root_thread(self, start: Callable[[], Any]) -> Any:
        """start() on a thread of its own in a new Landlock domain (or, without Landlock
        signal scoping, making a new PID namespace for what it starts): a root run's."""
        def confined() -> Any:
            if self.landlock:
                k.landlock_scope_self()
            else:
                k.unshare(k.CLONE_NEWPID)
            return start()

        return _in_thread(confined, "millwright-confine")

    def on_own_thread(self, start: Callable[[], Any]) -> Any:
        """start() on a thread of its own, which ends after it (a run's spawn that takes
        the run's ids)."""
        return _in_thread(start, "millwright-spawn")

    def inside(self, network: str, spawn: Callable[[], Any], stay: bool = False) -> Any:
        """spawn() with the calling thread in the jobs' namespaces (and the none network
        namespace for ``network == "none"``), then back in the agent's; ``stay``: a thread
        that ends after the spawn stays there (it runs nothing of the agent's any more)."""
        # setns into a mount namespace needs a thread that shares no file-system attributes
        # (cwd, root, umask) with another: this one gets its own copy (a no-op once it has
        # one, unless a thread it started since shares it again)
        k.unshare(k.CLONE_FS)
        if stay:
            k.setns(self.jobs_mnt, k.CLONE_NEWNS)
            if network == "none":
                k.setns(self.none_net, k.CLONE_NEWNET)
            return spawn()
        cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            k.setns(self.jobs_mnt, k.CLONE_NEWNS)
            try:
                if network == "none":
                    k.setns(self.none_net, k.CLONE_NEWNET)
                    try:
                        return spawn()
                    finally:
                        self._back(self.host_net, k.CLONE_NEWNET)
                return spawn()
            finally:
                self._back(self.host_mnt, k.CLONE_NEWNS)
                os.fchdir(cwd)
        finally:
            os.close(cwd)

    @staticmethod
    def _back(fd: int, nstype: int) -> None:
        try:
            k.setns(fd, nstype)
        except OSError:   # the agent's thread would go on inside the jobs' namespaces
            log.critical("cannot return to the agent's namespace after a spawn; aborting")
            os.abort()

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(5)
        with self._lock:
            self._close_fds()

    def _close_fds(self) -> None:
        self.host_mnt = _closed(self.host_mnt)
        self.host_net = _closed(self.host_net)
        self.jobs_mnt = _closed(self.jobs_mnt)
        self.none_net = _closed(self.none_net)


def _closed(fd: int) -> int:
    """Close ``fd`` when it is open; what the attribute holds afterwards (-1: closed)."""
    if fd >= 0:
        os.close(fd)
        return -1
    return fd
