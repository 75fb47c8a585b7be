"""A confined run's user switch made by the thread that spawns its launcher, instead of
by an exec of setpriv in the launcher's chain.

Linux keeps credentials per thread; only glibc makes set*id() calls change every thread
of a process (its setxid broadcast). So a thread of the agent of its own, one that ends
after the spawn, makes the raw system calls for itself alone, then spawns the launcher,
which is born with the run's ids (a vfork child takes its thread's credentials): the
same ids, groups, capabilities and no_new_privs that ``Confinement.setpriv_args`` gives
setpriv, without setpriv's exec (~1.7 ms of CPU per run on the reference VM, and one
exec event more for the sensor). The thread cannot come back (a non-root run's ids drop
every capability), and it never runs anything of the agent's after the spawn.

Architectures whose system call numbers are not listed here keep setpriv.
"""

from __future__ import annotations

import ctypes
import os
import platform
from typing import Optional

from agent.execute.confine import Confinement
from agent.runtime import kernel as k

# (setgroups, setresuid, setresgid, capset): the raw calls, 32-bit id variants on the 32-bit
# arches (their 16-bit originals would truncate the reserved range's ids)
_NR = {"x86_64": (116, 117, 119, 126), "aarch64": (159, 147, 149, 91), "riscv64": (159, 147, 149, 91),
       "armv7l": (206, 208, 210, 185), "armv6l": (206, 208, 210, 185), "i686": (206, 208, 210, 185)}
_CAP_V3 = 0x20080522   # _LINUX_CAPABILITY_VERSION_3


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _numbers() -> Optional[tuple[int, int, int, int]]:
    return _NR.get(platform.machine())


def available() -> bool:
    return _numbers() is not None


def _call(nr: int, what: str, *args: object) -> None:
    if k.quick().syscall(nr, *args) != 0:   # set*id, capset: return at once
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


PR_SET_DUMPABLE = 4


def not_dumpable() -> None:
    """The agent's process is not dumpable (no core dump; only CAP_SYS_PTRACE may trace it
    or read its /proc files): a thread of it that took a run's ids must not be traceable by
    that run's processes."""
    k.prctl(PR_SET_DUMPABLE, 0)


def become(conf: Confinement) -> None:
    """The calling thread takes the run's credentials, for good (see the module
    docstring): what setpriv does with ``conf.setpriv_args()``. OSError if a step fails
    (the thread must then not spawn anything)."""
    nrs = _numbers()
    if nrs is None:
        raise OSError(0, f"no per-thread user switch on {platform.machine()}")
    setgroups, setresuid, setresgid, capset = nrs
    groups = (ctypes.c_uint32 * max(1, len(conf.groups)))(*conf.groups)
    _call(setgroups, "setgroups", ctypes.c_size_t(len(conf.groups)), groups)
    _call(setresgid, "setresgid", ctypes.c_uint32(conf.gid), ctypes.c_uint32(conf.gid), ctypes.c_uint32(conf.gid))
    if not conf.root:
        # every capability goes with uid 0 (no keep-caps): effective, permitted, ambient
        _call(setresuid, "setresuid", ctypes.c_uint32(conf.uid), ctypes.c_uint32(conf.uid),
              ctypes.c_uint32(conf.uid))
        return
    # a root run: uid 0 kept, only its template's capabilities, in the bounding set too
    # (what exec gives root), inheritable the same, no ambient ones, no_new_privs
    keep = set(conf.capabilities)
    k.drop_bounding_except(keep)
    k.prctl(k.PR_CAP_AMBIENT, k.PR_CAP_AMBIENT_CLEAR_ALL)
    k.prctl(k.PR_SET_NO_NEW_PRIVS, 1)
    mask = 0
    for cap in keep:
        mask |= 1 << cap
    data = (_CapData * 2)()
    for i in range(2):
        word = (mask >> (32 * i)) & 0xFFFFFFFF
        data[i].effective = data[i].permitted = data[i].inheritable = word
    _call(capset, "capset", ctypes.byref(_CapHeader(_CAP_V3, 0)), ctypes.byref(data))
