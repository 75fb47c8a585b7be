"""Starting a launcher with posix_spawn(3), called through ctypes, instead of subprocess.Popen.

Why: the daemon's loop starts launchers while its adapter threads (etcd workers, the
reaper, the audit writer) run Python too. Python 3.11's Popen (Debian 12) drops the GIL
several times per spawn (its pipe, the read of its exec-error pipe, closes) and holds it
while its vfork child runs up to its exec; each time another thread took the GIL
meanwhile, the spawning thread waits up to the switch interval (5 ms) to get it back.
Measured here with one CPU-bound thread beside it: Popen 14 ms per spawn, posix_spawn
0.5 ms. This is one call, which drops the GIL once, around the spawn itself.

The child is the one Popen made: fds 0-2 from the given pipes and nothing else inherited
(closefrom 3), the working directory set before exec (still as the agent's user, before
any user switch), a new session, default dispositions for the signals Python ignores or
handles, and an empty signal mask. glibc runs it as a CLONE_VFORK child and reports a
failed chdir or exec as the call's error.

Needs glibc >= 2.34 (posix_spawn_file_actions_addclosefrom_np: Debian 12 has 2.36,
Ubuntu 22.04 2.35); where it is missing, ``available()`` is False and the caller uses
Popen.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from typing import Iterable, Mapping, Optional, Sequence

from agent.runtime import kernel

POSIX_SPAWN_SETSIGDEF = 0x04
POSIX_SPAWN_SETSIGMASK = 0x08
POSIX_SPAWN_SETSID = 0x80          # glibc >= 2.26
_OPAQUE = 1024                     # bytes for glibc's posix_spawn_file_actions_t (80) / attr_t (336)
# set back to their default in a job's launcher: Python ignores SIGPIPE and SIGXFSZ (an
# ignored signal stays ignored across exec), the agent handles the others
RESET_SIGNALS = tuple(getattr(signal, n) for n in (
    "SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGPIPE", "SIGXFSZ", "SIGXCPU", "SIGUSR1", "SIGUSR2",
    "SIGCHLD", "SIGALRM", "SIGTSTP", "SIGTTIN", "SIGTTOU") if hasattr(signal, n))

# glibc's own reserved signals (thread cancellation and setxid: 32 and 33, below its
# SIGRTMIN): its posix_spawn child sets them to SIG_IGN before the exec unless they are in
# the sigdefault set, and an ignored signal stays ignored across exec, so every job would
# start with them ignored (Popen's child does not). sigaddset refuses them: _add_raw.
LIBC_RESERVED = tuple(range(32, signal.SIGRTMIN)) if hasattr(signal, "SIGRTMIN") else ()

_lock = threading.Lock()
_lib: Optional[tuple] = None       # (libc keeping the GIL, libc dropping it, attr and its buffers)
_missing: Optional[str] = None


def _load() -> Optional[tuple]:
    """The C library's functions and the spawn attributes shared by every spawn, or None."""
    global _lib, _missing
    with _lock:
        if _lib is not None or _missing is not None:
            return _lib
        try:
            quick = kernel.quick()      # user-space bookkeeping: keeps the GIL
            spawning = kernel.libc()    # the spawn: drops the GIL around it
            for fn in ("posix_spawn_file_actions_init", "posix_spawn_file_actions_destroy",
                       "posix_spawn_file_actions_adddup2", "posix_spawn_file_actions_addchdir_np",
                       "posix_spawn_file_actions_addclosefrom_np", "posix_spawnattr_init",
                       "posix_spawnattr_setflags", "posix_spawnattr_setsigdefault",
                       "posix_spawnattr_setsigmask", "sigemptyset", "sigaddset"):
                getattr(quick, fn).restype = ctypes.c_int
            spawning.posix_spawn.restype = ctypes.c_int
            attr = ctypes.create_string_buffer(_OPAQUE)
            sigdef = ctypes.create_string_buffer(_OPAQUE)
            empty = ctypes.create_string_buffer(_OPAQUE)
            ok = (quick.posix_spawnattr_init(attr) == 0 and quick.sigemptyset(sigdef) == 0
                  and quick.sigemptyset(empty) == 0
                  and all(quick.sigaddset(sigdef, int(s)) == 0 for s in RESET_SIGNALS)
                  and all(_add_raw(sigdef, s) for s in LIBC_RESERVED)
                  and quick.posix_spawnattr_setsigdefault(attr, sigdef) == 0
                  and quick.posix_spawnattr_setsigmask(attr, empty) == 0
                  and quick.posix_spawnattr_setflags(
                      attr, ctypes.c_short(POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK)) == 0)
            if not ok:
                raise OSError(ctypes.get_errno(), "posix_spawnattr setup failed")
            _lib = (quick, spawning, attr, sigdef, empty)   # the buffers live as long as attr
        except (OSError, AttributeError) as exc:
            _missing = str(exc)
        return _lib


def _add_raw(sigset: ctypes.Array, sig: int) -> bool:
    """sigaddset without glibc's check: Linux's sigset_t is an array of unsigned longs,
    signal n at bit n - 1."""
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    words = ctypes.cast(sigset, ctypes.POINTER(ctypes.c_ulong))
    words[(sig - 1) // bits] |= 1 << ((sig - 1) % bits)
    return True


def available() -> bool:
    return _load() is not None


def _cstrings(items: Iterable[str]) -> ctypes.Array:
    encoded: list[Optional[bytes]] = [os.fsencode(s) for s in items]
    encoded.append(None)   # the array's terminating NULL
    return (ctypes.c_char_p * len(encoded))(*encoded)


def spawn(argv: list[str], env: Mapping[str, str], cwd: Optional[str], stdin: int, stdout: int, stderr: int,
          inherit: Sequence[int] = ()) -> int:
    """Start argv[0] (an absolute path) and return its pid. OSError (with the errno of the
    failed step: chdir, exec) if it could not start. ``inherit``: fds the child gets as 3,
    4, ... (each numbered above those targets: a dup2 must not overwrite a later source).
    ``cwd`` None: the calling thread's working directory."""
    lib = _load()
    if lib is None:
        raise OSError(0, f"posix_spawn is not usable here: {_missing}")
    quick, spawning, attr, _, _ = lib
    actions = ctypes.create_string_buffer(_OPAQUE)
    if quick.posix_spawn_file_actions_init(actions) != 0:
        raise OSError(ctypes.get_errno(), "posix_spawn_file_actions_init")
    try:
        targets = [(stdin, 0), (stdout, 1), (stderr, 2)] + [(fd, 3 + i) for i, fd in enumerate(inherit)]
        if any(fd < len(targets) for fd in inherit):
            raise OSError(0, f"an fd to inherit is below {len(targets)}: {list(inherit)}")
        for fd, target in targets:
            err = quick.posix_spawn_file_actions_adddup2(actions, fd, target)
            if err:
                raise OSError(err, os.strerror(err))
        err = ((quick.posix_spawn_file_actions_addchdir_np(actions, os.fsencode(cwd)) if cwd is not None else 0)
               or quick.posix_spawn_file_actions_addclosefrom_np(actions, len(targets)))
        if err:
            raise OSError(err, os.strerror(err))
        pid = ctypes.c_int(0)
        envp = _cstrings(f"{k}={v}" for k, v in env.items())
        err = spawning.posix_spawn(ctypes.byref(pid), os.fsencode(argv[0]), actions, attr,
                                   _cstrings(argv), envp)
        if err:
            raise OSError(err, os.strerror(err))
        return pid.value
    finally:
        quick.posix_spawn_file_actions_destroy(actions)
