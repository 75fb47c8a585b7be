"""/proc readers: node TCP counters (both modes) and the degraded-mode fallbacks
(new processes by polling /proc, stalled sockets towards an endpoint from /proc/net/tcp).
Pure functions over text where possible, so they are unit-tested without a kernel."""

from __future__ import annotations

import os
import socket
import struct
from typing import Iterable, Optional


def parse_snmp_like(text: str) -> dict[str, dict[str, int]]:
    """/proc/net/snmp and /proc/net/netstat: pairs of 'Proto: names' / 'Proto: values'."""
    out: dict[str, dict[str, int]] = {}
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for head, vals in zip(lines[0::2], lines[1::2]):
        p1, _, names = head.partition(":")
        p2, _, values = vals.partition(":")
        if p1 != p2:
            continue
        try:
            out[p1] = dict(zip(names.split(), (int(v) for v in values.split())))
        except ValueError:
            continue
    return out


def read_tcp_counters(root: str = "/proc") -> dict[str, int]:
    """RetransSegs, ActiveOpens, AttemptFails, EstabResets, OutRsts (+ TCPSynRetrans)."""
    out: dict[str, int] = {}
    for path, proto in ((f"{root}/net/snmp", "Tcp"), (f"{root}/net/netstat", "TcpExt")):
        try:
            with open(path) as f:
                out.update(parse_snmp_like(f.read()).get(proto, {}))
        except OSError:
            pass
    return out


def _hex_addr(text: str) -> str:
    """/proc/net/tcp address (host byte order words) -> printable IP."""
    raw = bytes.fromhex(text)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", struct.unpack(">I", raw)[0]))
    words = struct.unpack(">4I", raw)
    return socket.inet_ntop(socket.AF_INET6, struct.pack("<4I", *words))


def parse_proc_net_tcp(text: str) -> list[tuple[str, int, str, int, int, int, int]]:
    """(laddr, lport, raddr, rport, state, retransmits, inode) per socket; retransmits is
    the socket's current count of unrecovered RTOs (icsk_retransmits)."""
    rows = []
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 7:
            continue
        try:
            la, lp = parts[1].split(":")
            ra, rp = parts[2].split(":")
            rows.append((_hex_addr(la), int(lp, 16), _hex_addr(ra), int(rp, 16), int(parts[3], 16), int(parts[6], 16),
                         int(parts[9]) if len(parts) > 9 else 0))
        except ValueError:
            continue
    return rows


def read_tcp_sockets(root: str = "/proc") -> list[tuple[str, int, str, int, int, int, int]]:
    rows = []
    for name in ("tcp", "tcp6"):
        try:
            with open(f"{root}/net/{name}") as f:
                rows.extend(parse_proc_net_tcp(f.read()))
        except OSError:
            pass
    return rows


def socket_inodes(pid: int, root: str = "/proc") -> list[int]:
    """Inodes of the sockets process `pid` holds open."""
    out = []
    try:
        for fd in os.listdir(f"{root}/{pid}/fd"):
            try:
                link = os.readlink(f"{root}/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                out.append(int(link[8:-1]))
    except OSError:
        pass
    return out


def stalled_sockets_towards(endpoints: Iterable[tuple[tuple[str, ...], int]], root: str = "/proc") -> list[int]:
    """For each (addresses, port): sockets in SYN_SENT or with unrecovered retransmits."""
    rows = read_tcp_sockets(root)
    out = []
    for addrs, port in endpoints:
        wanted = set(addrs) | {"::ffff:" + a for a in addrs if ":" not in a}
        out.append(sum(1 for r in rows if r[3] == port and r[2] in wanted and (r[4] == 2 or r[5] > 0)))
    return out


def proc_status(pid: int, root: str = "/proc") -> Optional[dict[str, str]]:
    try:
        with open(f"{root}/{pid}/status") as f:
            return dict(ln.split(":", 1) for ln in f.read().splitlines() if ":" in ln)
    except OSError:
        return None


def proc_ppid(pid: int, root: str = "/proc") -> int:
    try:
        with open(f"{root}/{pid}/stat") as f:
            text = f.read()
        return int(text[text.rindex(")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def proc_cmdline(pid: int, root: str = "/proc") -> Optional[list[str]]:
    try:
        with open(f"{root}/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    if not raw:
        return None
    return [p.decode("utf-8", "backslashreplace") for p in raw.rstrip(b"\0").split(b"\0")]


def list_pids(root: str = "/proc") -> set[int]:
    try:
        return {int(n) for n in os.listdir(root) if n.isdigit()}
    except OSError:
        return set()
