"""Cutting one loopback address:port off the network with nftables, from a test."""

from __future__ import annotations

import os
import subprocess


class NftBlock:
    """Drop TCP traffic to and from one loopback address:port, in a table of our own.

    Dropped in the input hook: the sender's transmit succeeds and the segment is lost
    on the way in, as on a real broken link, so the kernel retransmits (tcp_retransmit_skb,
    RetransSegs). Dropping in the output hook fails the transmit locally instead and the
    kernel counts no retransmit at all."""

    def __init__(self, addr: str, port: int):
        self.table = f"mw_test_{os.getpid()}_{port}"
        self.addr, self.port = addr, port
        self.active = False

    def __enter__(self):
        rules = f"""
table inet {self.table} {{
  chain inp {{ type filter hook input priority -10; policy accept;
    ip daddr {self.addr} tcp dport {self.port} drop
    ip saddr {self.addr} tcp sport {self.port} drop
  }}
}}"""
        subprocess.run(["nft", "-f", "-"], input=rules.encode(), check=True)
        self.active = True
        return self

    def remove(self):
        if self.active:
            subprocess.run(["nft", "delete", "table", "inet", self.table], check=False)
            self.active = False

    def __exit__(self, *exc):
        self.remove()
