"""Perf-buffer records of bpf/sensor.c decoded into the events the agent sees.

Pure functions of the bytes (plus a /proc fallback for an argv the kernel could not
read), so they are unit-tested without a kernel.
"""

from __future__ import annotations

import ctypes as ct

from agent.signals import abi, procfs
from agent.signals.model import ConnEvent, ExecEvent


def decode_exec(data: bytes, wall_offset: float) -> ExecEvent:
    """Bytes of a struct exec_event (possibly cut after args_len) -> ExecEvent."""
    raw = abi.ExecEventRaw()
    n = min(len(data), ct.sizeof(raw))
    ct.memmove(ct.addressof(raw), data, n)
    args_off = abi.ExecEventRaw.args.offset
    argbuf = data[args_off:args_off + raw.args_len]
    argv = abi.split_args(argbuf, raw.argc)
    argv_source = "kernel"
    if not argv:
        argv = procfs.proc_cmdline(raw.pid) or []
        argv_source = "proc" if argv else "none"
    ppid = raw.ppid or procfs.proc_ppid(raw.pid)
    return ExecEvent(pid=raw.pid, ppid=ppid, uid=raw.uid, gid=raw.gid,
                     filename=raw.filename.decode("utf-8", "backslashreplace"), argv=argv,
                     slot=raw.slot or None, ts=wall_offset + raw.ts_ns / 1e9, mono_ns=raw.ts_ns, tid=raw.tid,
                     argv_truncated=bool(raw.flags & abi.EXEC_ARGV_TRUNCATED), argv_source=argv_source)


def decode_conn(data: bytes, wall_offset: float) -> ConnEvent:
    raw = abi.ConnEventRaw()
    ct.memmove(ct.addressof(raw), data, min(len(data), ct.sizeof(raw)))
    if raw.newstate == abi.TCP_SYN_SENT:
        kind = "connect"
    elif raw.oldstate == abi.TCP_SYN_SENT and raw.newstate == abi.TCP_ESTABLISHED:
        kind = "established"
    elif raw.oldstate == abi.TCP_SYN_SENT and raw.newstate == abi.TCP_CLOSE:
        kind = "connect_failed"
    else:
        kind = "close"
    return ConnEvent(kind=kind, slot=raw.slot, pid=raw.pid, saddr=abi.addr_text(raw.family, bytes(raw.saddr)),
                     sport=raw.sport, daddr=abi.addr_text(raw.family, bytes(raw.daddr)), dport=raw.dport,
                     duration_s=raw.duration_ns / 1e9, retransmits=raw.retrans, ts=wall_offset + raw.ts_ns / 1e9,
                     mono_ns=raw.ts_ns)
