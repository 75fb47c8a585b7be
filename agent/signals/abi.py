"""The kernel ABI of bpf/sensor.c, mirrored in Python in exactly one place.

Every struct the C program shares with userspace (perf events, map keys and values)
has its ctypes twin here, with the same field names in the same order. The loader
compares these sizes with the ones BCC derived from the C source before the program
is used, and tests/unit/test_signals_abi.py parses sensor.c to check names and types,
so the two cannot drift silently.
"""

from __future__ import annotations

import ctypes as ct
import os
from typing import Any

SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bpf", "sensor.c")

EV_EXEC = 1
EV_CONN = 2

FNAME_LEN = 256
ARG_LEN = 128
ARGS_BUF = 1024
MAX_ARGS = 20

EXEC_ARGV_TRUNCATED = 1
EXEC_ARGV_MISSING = 2

MAX_SLOTS = 1024
MAX_TRACKED = 8192
MAX_SOCKS = 8192
MAX_EPS = 64

AF_INET = 2
AF_INET6 = 10

TCP_ESTABLISHED = 1
TCP_SYN_SENT = 2
TCP_CLOSE = 7
TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2",
              6: "TIME_WAIT", 7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING",
              12: "NEW_SYN_RECV"}

STREAK_SLACK_NS = 1_000_000_000
STREAK_DEFAULT_GAP_NS = 1_000_000_000


class ExecEventRaw(ct.Structure):
    _fields_ = [
        ("kind", ct.c_uint32),
        ("pid", ct.c_uint32),
        ("tid", ct.c_uint32),
        ("ppid", ct.c_uint32),
        ("uid", ct.c_uint32),
        ("gid", ct.c_uint32),
        ("slot", ct.c_uint32),
        ("argc", ct.c_uint16),
        ("args_len", ct.c_uint16),
        ("ts_ns", ct.c_uint64),
        ("flags", ct.c_uint32),
        ("_pad", ct.c_uint32),
        ("filename", ct.c_char * FNAME_LEN),
        ("args", ct.c_char * (ARGS_BUF + ARG_LEN)),
    ]


class ConnEventRaw(ct.Structure):
    _fields_ = [
        ("kind", ct.c_uint32),
        ("slot", ct.c_uint32),
        ("ts_ns", ct.c_uint64),
        ("skaddr", ct.c_uint64),
        ("duration_ns", ct.c_uint64),
        ("pid", ct.c_uint32),
        ("retrans", ct.c_uint32),
        ("family", ct.c_uint16),
        ("sport", ct.c_uint16),
        ("dport", ct.c_uint16),
        ("oldstate", ct.c_uint8),
        ("newstate", ct.c_uint8),
        ("saddr", ct.c_uint8 * 16),
        ("daddr", ct.c_uint8 * 16),
    ]


class SockInfo(ct.Structure):
    _fields_ = [
        ("start_ns", ct.c_uint64),
        ("est_ns", ct.c_uint64),
        ("streak_ns", ct.c_uint64),
        ("last_retrans_ns", ct.c_uint64),
        ("gap_ns", ct.c_uint64),
        ("slot", ct.c_uint32),
        ("pid", ct.c_uint32),
        ("retrans", ct.c_uint32),
        ("state", ct.c_uint32),
    ]


class SlotStats(ct.Structure):
    _fields_ = [
        ("retrans", ct.c_uint64),
        ("resets_rx", ct.c_uint64),
        ("resets_tx", ct.c_uint64),
        ("connects", ct.c_uint64),
        ("connect_failures", ct.c_uint64),
        ("execs", ct.c_uint64),
    ]


class EpKey(ct.Structure):
    _fields_ = [
        ("addr", ct.c_uint8 * 16),
        ("port", ct.c_uint16),
        ("family", ct.c_uint16),
    ]


class EpStats(ct.Structure):
    _fields_ = [
        ("retrans", ct.c_uint64),
        ("resets", ct.c_uint64),
        ("connect_failures", ct.c_uint64),
        ("last_retrans_ns", ct.c_uint64),
    ]


# C struct name -> ctypes mirror (used by the ABI test and the loader's size check)
MIRRORS = {
    "exec_event": ExecEventRaw,
    "conn_event": ConnEventRaw,
    "sock_info": SockInfo,
    "slot_stats": SlotStats,
    "ep_key": EpKey,
    "ep_stats": EpStats,
}

# map name -> (key ctype, value ctype); the perf event array is handled separately
MAPS = {
    "tracked": (ct.c_uint32, ct.c_uint32),
    "spawner": (ct.c_uint32, ct.c_uint32),
    "socks": (ct.c_uint64, SockInfo),
    "slot_stats": (ct.c_uint32, SlotStats),
    "endpoints": (EpKey, ct.c_uint32),
    "ep_stats": (ct.c_uint32, EpStats),
    "parent": (ct.c_uint32, ct.c_uint32),
    "exec_stash": (ct.c_uint32, ExecEventRaw),
    "exec_scratch": (ct.c_uint32, ExecEventRaw),
}

# The perf event arrays the program writes to: a job's events (the reader is woken at
# each), and execs outside any job (node activity; the reader is woken once per batch)
PERF_MAPS = ("events", "node_events")

# The tracepoints the program attaches to, and the fields it reads from each.
# Optional fields switch a -D flag on when the running kernel's format file has them.
TRACEPOINTS: dict[str, dict[str, Any]] = {
    "sched:sched_process_exec": {"required": ["filename", "old_pid"]},
    "sched:sched_process_fork": {"required": ["child_pid"]},
    "sched:sched_process_exit": {"required": [], "optional": {"HAVE_EXIT_GROUP_DEAD": ["group_dead"]}},
    "syscalls:sys_enter_execve": {"required": ["argv"]},
    "tcp:tcp_retransmit_skb": {"required": ["skaddr", "family", "dport", "daddr", "daddr_v6"]},
    "tcp:tcp_receive_reset": {"required": ["skaddr"],
                              "optional": {"HAVE_RR_ADDR": ["family", "dport", "daddr", "daddr_v6"]}},
    "tcp:tcp_send_reset": {"required": ["skaddr"]},
    "sock:inet_sock_set_state": {"required": ["skaddr", "oldstate", "newstate", "protocol", "family", "sport",
                                              "dport", "saddr", "daddr", "saddr_v6", "daddr_v6"]},
}


def stall_streak_active(now_ns: int, last_retrans_ns: int, gap_ns: int) -> bool:
    """Whether a retransmit streak is still going at `now_ns` (same rule as the C code:
    the next RTO comes within about twice the previous gap; a longer silence means the
    connection made progress)."""
    if not last_retrans_ns:
        return False
    gap = gap_ns or STREAK_DEFAULT_GAP_NS
    return now_ns - last_retrans_ns <= 2 * gap + STREAK_SLACK_NS


def sock_stall_start_ns(info: SockInfo, now_ns: int) -> int:
    """Monotonic ns since which a tracked socket has been stalled, 0 when it is not:
    a connect still in SYN_SENT, or an active retransmit streak."""
    if info.state == TCP_SYN_SENT:
        return info.start_ns
    if info.streak_ns and stall_streak_active(now_ns, info.last_retrans_ns, info.gap_ns):
        return info.streak_ns
    return 0


def addr_text(family: int, raw: bytes) -> str:
    import socket

    if family == AF_INET:
        return socket.inet_ntop(socket.AF_INET, bytes(raw[:4]))
    if family == AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, bytes(raw[:16]))
    return ""


def split_args(buf: bytes, argc: int) -> list[str]:
    """NUL-separated argv chunks -> list of str (undecodable bytes escaped)."""
    parts = buf.split(b"\0")
    return [p.decode("utf-8", "backslashreplace") for p in parts[:argc]]


def ep_key(family: int, raw: bytes, port: int) -> EpKey:
    k = EpKey()
    ct.memmove(k.addr, raw, len(raw))
    k.port = port
    k.family = family
    return k


def endpoint_keys(addrs: tuple[str, ...], port: int) -> list[EpKey]:
    """The keys of the endpoints map that stand for these addresses (text) and port."""
    import socket

    keys = []
    for a in addrs:
        if ":" in a:
            fam, raw = AF_INET6, socket.inet_pton(socket.AF_INET6, a)
            keys.append(ep_key(fam, raw, port))
        else:
            raw4 = socket.inet_pton(socket.AF_INET, a)
            keys.append(ep_key(AF_INET, raw4, port))
            # dual-stack sockets talk to IPv4 peers through v4-mapped IPv6 addresses
            keys.append(ep_key(AF_INET6, b"\0" * 10 + b"\xff\xff" + raw4, port))
    return keys
