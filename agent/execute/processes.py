"""Process helpers of the executor: a process's state from /proc, signals to a process or
a process group, reaping a run's process group, and the child subreaper flag.

A run's processes are found and reaped by its process group, never by touching the
agent's other children."""

from __future__ import annotations

import errno
import logging
import os
import signal
from typing import Optional

log = logging.getLogger(__name__)


def proc_state(pid: int) -> Optional[tuple[str, int]]:
    """(state letter, pgid) of a process, None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    rest = data[data.rfind(b")") + 2:].split()
    return rest[0].decode(), int(rest[2])


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    st = proc_state(pid)
    return st is not None and st[0] not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, by scanning /proc."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_state(int(name))
            if st and st[1] == pgid and st[0] not in ("Z", "X"):
                out.append(int(name))
    return out


def killpg(pgid: Optional[int], sig: int) -> None:
    """Signal a process group; nothing when there is no group (None, 0) or it is gone."""
    if not pgid:
        return
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill(pid: int) -> None:
    """SIGKILL one process, if it still exists."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def reap_group(pgid: Optional[int]) -> None:
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


_subreaper_set = False


def set_child_subreaper() -> None:
    """Orphans of a run re-parent to the agent (not to an init that may never reap
    them), so the reaper can collect them by process group. Once per process."""
    global _subreaper_set
    if _subreaper_set:
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_CHILD_SUBREAPER = 36
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl")
        _subreaper_set = True
    except Exception as exc:  # not fatal: orphans go to init instead
        log.warning("cannot become a child subreaper", extra={"fields": {"error": str(exc)}})
