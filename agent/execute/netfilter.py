"""The agent's nftables table: what a run of each network policy may not reach.

Runs are matched by the uid or gid of the socket's owner: every run's id comes from its
policy's block of the reserved range (agent/execute/confine.py), so the rules are written
once at start and nothing changes per run. The table is made through libnftables (ctypes)
with the ``owner`` flag: it belongs to the netlink socket the agent keeps open, so it goes
when the agent goes, however it ends (kill -9 included), and another process's
``nft flush ruleset`` (a firewall reload) leaves it alone.

* ``internet``: no loopback (nothing on the host: every local address goes through lo),
  except DNS to a local resolver; not the agent's etcd and broker endpoints;
* ``any``: loopback too, but not the coordination endpoints;
* ``none``: its own network namespace (agent/execute/namespaces.py); a packet of one of
  its ids in the host's namespace is dropped.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import re
import socket
from dataclasses import dataclass
from typing import Iterable, Optional
from urllib.parse import urlsplit

from agent.execute.confine import ID_BLOCKS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoint:
    """A coordination endpoint runs may not reach: addresses (empty: on this host, every
    local address) and a TCP port."""

    host: str
    port: int
    addresses: tuple[str, ...]
    local: bool


def resolve_endpoints(urls: Iterable[str]) -> list[Endpoint]:
    """etcd and broker URLs -> endpoints, resolved now (a name that does not resolve is
    logged and left out: its rule would match nothing)."""
    out = []
    for url in urls:
        parts = urlsplit(url)
        if not parts.hostname:
            continue
        port = parts.port or {"http": 2379, "https": 2379, "mqtt": 1883, "mqtts": 8883}.get(parts.scheme, 0)
        if not port:
            continue
        try:
            infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("a coordination endpoint does not resolve: runs are not kept from it", extra={"fields": {
                "endpoint": url, "error": str(exc)}})
            continue
        addrs = tuple(sorted({str(ipaddress.ip_address(str(i[4][0]).split("%")[0])) for i in infos}))
        out.append(Endpoint(parts.hostname, port, addrs, any(_is_local(a) for a in addrs)))
    return out


def _is_local(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    if ip.is_loopback or ip.is_unspecified:
        return True
    fam = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.bind((addr, 0))   # only an address of this host can be bound
        return True
    except OSError:
        return False


def table_name(name: str) -> str:
    """An nftables identifier for the agent's cgroup root name."""
    return re.sub(r"[^A-Za-z0-9_]", "_", name)[:60] or "millwright"


def ruleset(name: str, endpoints: Iterable[Endpoint], blocks: Optional[dict[str, tuple[int, int]]] = None) -> str:
    blocks = blocks or ID_BLOCKS
    coord = []
    for ep in endpoints:
        if ep.local:   # a local service listens on every local address: all of lo's traffic to the port
            coord.append(f'oif "lo" tcp dport {ep.port} reject with tcp reset')
        for addr in ep.addresses:
            if not ep.local:
                fam = "ip6" if ipaddress.ip_address(addr).version == 6 else "ip"
                coord.append(f"{fam} daddr {addr} tcp dport {ep.port} reject with tcp reset")
    lines = [f"table inet {table_name(name)} {{", "  flags owner", "  chain coordination {"]
    lines += [f"    {r}" for r in coord]
    lines += ["  }",
              "  chain internet {",
              "    jump coordination",
              '    oif "lo" meta l4proto { tcp, udp } th dport 53 accept',
              '    oif "lo" meta l4proto tcp reject with tcp reset',
              '    oif "lo" reject',
              "  }",
              "  chain any {",
              "    jump coordination",
              "  }",
              "  chain output {",
              "    type filter hook output priority filter; policy accept;"]
    for policy, verdict in (("internet", "jump internet"), ("any", "jump any"), ("none", "drop")):
        lo, hi = blocks[policy]
        lines += [f"    meta skuid {lo}-{hi} {verdict}", f"    meta skgid {lo}-{hi} {verdict}"]
    lines += ["  }", "}", ""]
    return "\n".join(lines)


class NetRules:
    """The agent's table, alive as long as this object (and its netlink socket) is."""

    def __init__(self, name: str, endpoints: Iterable[Endpoint]):
        self.name = table_name(name)
        self.endpoints = list(endpoints)
        self._lib = _lib()
        self._ctx = self._lib.nft_ctx_new(0)
        if not self._ctx:
            raise OSError(0, "nft_ctx_new failed")
        self._lib.nft_ctx_buffer_output(self._ctx)
        self._lib.nft_ctx_buffer_error(self._ctx)
        try:
            self.run(ruleset(self.name, self.endpoints))
        except OSError:
            self.close()
            raise

    def run(self, text: str) -> str:
        if not self._ctx:
            raise OSError(0, "nftables context closed")
        rc = self._lib.nft_run_cmd_from_buffer(self._ctx, text.encode())
        if rc != 0:
            err = (self._lib.nft_ctx_get_error_buffer(self._ctx) or b"").decode(errors="replace").strip()
            raise OSError(0, f"nftables: {err.splitlines()[0] if err else 'command failed'}")
        return (self._lib.nft_ctx_get_output_buffer(self._ctx) or b"").decode(errors="replace")

    def close(self) -> None:
        """The table goes with the context's socket."""
        if self._ctx:
            self._lib.nft_ctx_free(self._ctx)
            self._ctx = None


_nft: Optional[ctypes.CDLL] = None


def _lib() -> ctypes.CDLL:
    global _nft
    if _nft is None:
        try:
            lib = ctypes.CDLL("libnftables.so.1", use_errno=True)
        except OSError as exc:
            raise OSError(0, f"libnftables is not installed (Debian: libnftables1): {exc}") from None
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        for fn in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p]
        for fn in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p]
            getattr(lib, fn).restype = ctypes.c_char_p
        _nft = lib
    return _nft
