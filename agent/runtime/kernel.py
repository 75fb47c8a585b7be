"""The few system calls job isolation needs that Python's os module lacks (Python 3.10+):
setns, unshare, mount, prctl, capset, landlock, through ctypes. Each raises OSError with
the call's errno.

All but mount and umount keep the GIL (``quick()``, a PyDLL): on a launcher's spawn path
each returns within microseconds, and a spawn thread makes some fifty of them. Through a
CDLL each one drops the GIL and must win it back, which beside a busy thread of the agent
costs up to the switch interval every time: ~70 ms per spawn, measured
(bench/bench_confined_spawn.py). The slow ones, unsharing a mount or network namespace,
run once, at start, before any run."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from typing import Optional

CLONE_FS = 0x00000200
CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_SLAVE = 1 << 19

PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

# Landlock (linux/landlock.h): a ruleset that handles no file-system or network access but
# scopes signals and abstract Unix sockets to the domain (ABI 6, Linux 6.12).
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET = 1
LANDLOCK_SCOPE_SIGNAL = 2
LANDLOCK_SCOPE_ABI = 6
_SYSCALLS = {  # landlock_create_ruleset, landlock_restrict_self: the same on every arch since 5.13
    "landlock_create_ruleset": 444, "landlock_restrict_self": 446,
}
# capget/capset numbers per architecture (the generic table's on arm64)
_CAPSET = {"x86_64": 126, "aarch64": 91, "armv7l": 185, "armv6l": 185, "i686": 185, "riscv64": 91}

_libc: Optional[ctypes.CDLL] = None
_quick: Optional[ctypes.CDLL] = None


def _load(kind: type) -> ctypes.CDLL:
    lib = kind(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    lib.syscall.restype = ctypes.c_long
    lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return lib


def libc() -> ctypes.CDLL:
    """The C library, dropping the GIL around each call: for calls that may wait (mount, posix_spawn)."""
    global _libc
    if _libc is None:
        _libc = _load(ctypes.CDLL)
    return _libc


def quick() -> ctypes.CDLL:
    """The C library, keeping the GIL: for system calls that return at once."""
    global _quick
    if _quick is None:
        _quick = _load(ctypes.PyDLL)
    return _quick


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def setns(fd: int, nstype: int) -> None:
    _check(quick().setns(fd, nstype), "setns")


def unshare(flags: int) -> None:
    _check(quick().unshare(flags), "unshare")


def mount(source: Optional[str], target: str, fstype: Optional[str], flags: int, data: Optional[str] = None) -> None:
    enc = (lambda s: None if s is None else os.fsencode(s))
    _check(libc().mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


MNT_DETACH = 2


def umount(target: str, flags: int = 0) -> None:
    _check(libc().umount2(os.fsencode(target), flags), f"umount {target}")


def prctl(option: int, a: int = 0, b: int = 0, c: int = 0, d: int = 0) -> int:
    return _check(quick().prctl(option, a, b, c, d), f"prctl {option}")


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where Landlock is missing or disabled."""
    ret = quick().syscall(_SYSCALLS["landlock_create_ruleset"], None, ctypes.c_size_t(0),
                         ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return int(ret) if ret > 0 else 0


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


def landlock_scope_self() -> None:
    """Put the calling thread (and what it starts from now on) into a new Landlock domain
    that may signal, and connect to abstract Unix sockets of, only its own domain. Needs
    no_new_privs or CAP_SYS_ADMIN; cannot be undone (call it on a thread that ends)."""
    attr = _RulesetAttr(0, 0, LANDLOCK_SCOPE_SIGNAL | LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET)
    fd = _check(quick().syscall(_SYSCALLS["landlock_create_ruleset"], ctypes.byref(attr),
                               ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0)), "landlock_create_ruleset")
    try:
        _check(quick().syscall(_SYSCALLS["landlock_restrict_self"], ctypes.c_int(fd), ctypes.c_uint32(0)),
               "landlock_restrict_self")
    finally:
        quick().close(fd)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def keep_only_capabilities(caps: set[int]) -> None:
    """The calling thread keeps exactly ``caps`` (effective and permitted; inheritable
    and ambient cleared) and drops every other capability from its bounding set, so no
    exec can give them back. Used by short-lived helper processes (single-threaded)."""
    last = cap_last_cap()
    for cap in range(last + 1):
        if cap not in caps:
            try:
                prctl(PR_CAPBSET_DROP, cap)
            except OSError:
                pass   # already gone, or no CAP_SETPCAP: the capset below still drops it
    try:
        prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    except OSError:
        pass
    mask = 0
    for cap in caps:
        mask |= 1 << cap
    data = (_CapData * 2)()
    for i in range(2):
        word = (mask >> (32 * i)) & 0xFFFFFFFF
        data[i].effective = data[i].permitted = word
        data[i].inheritable = 0
    header = _CapHeader(0x20080522, 0)   # _LINUX_CAPABILITY_VERSION_3
    number = _CAPSET.get(platform.machine())
    if number is None:
        raise OSError(0, f"capset: unknown system call number on {platform.machine()}")
    _check(quick().syscall(number, ctypes.byref(header), ctypes.byref(data)), "capset")


_cap_last: Optional[int] = None


def cap_last_cap() -> int:
    """The kernel's highest capability number (fixed while it runs: read once)."""
    global _cap_last
    if _cap_last is None:
        try:
            with open("/proc/sys/kernel/cap_last_cap") as fh:
                _cap_last = int(fh.read())
        except (OSError, ValueError):
            return 40
    return _cap_last


def drop_bounding_except(keep: set[int]) -> None:
    """PR_CAPBSET_DROP of every capability not in ``keep`` (the calling thread's bounding
    set). One prctl per capability: the loop calls libc directly (a root run's spawn
    thread makes some forty of these per run). OSError on the first refusal."""
    fn = quick().prctl
    for cap in range(cap_last_cap() + 1):
        if cap not in keep and fn(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl {PR_CAPBSET_DROP}: {os.strerror(err)}")


# capability names (capabilities(7)) -> numbers, for a template's `capabilities`
CAPABILITIES = {name: i for i, name in enumerate((
    "chown", "dac_override", "dac_read_search", "fowner", "fsetid", "kill", "setgid", "setuid", "setpcap",
    "linux_immutable", "net_bind_service", "net_broadcast", "net_admin", "net_raw", "ipc_lock", "ipc_owner",
    "sys_module", "sys_rawio", "sys_chroot", "sys_ptrace", "sys_pacct", "sys_admin", "sys_boot", "sys_nice",
    "sys_resource", "sys_time", "sys_tty_config", "mknod", "lease", "audit_write", "audit_control", "setfcap",
    "mac_override", "mac_admin", "syslog", "wake_alarm", "block_suspend", "audit_read", "perfmon", "bpf",
    "checkpoint_restore"))}


def capability_number(name: str) -> Optional[int]:
    """CAP_NET_RAW, cap_net_raw and net_raw all name capability 13; None if unknown."""
    key = name.strip().lower()
    if key.startswith("cap_"):
        key = key[4:]
    return CAPABILITIES.get(key)


def cap_name(n: int) -> str:
    """A capability's name as capabilities(7) spells it without CAP_ (its number if unknown)."""
    for name, i in CAPABILITIES.items():
        if i == n:
            return name
    return str(n)

