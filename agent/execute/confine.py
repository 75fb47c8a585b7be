"""What confines one run (docs/security.md, "Job isolation"): its ids from the reserved
range, its network policy, the capabilities a root run keeps, and the setpriv options that
apply them in the launcher's exec chain.

The reserved range (RUN_ID_FIRST..RUN_ID_LAST, no passwd or group entries) is split into
one block per network policy, so that the agent's nftables rules match a run's sockets by
uid or gid alone, written once at start (agent/execute/netfilter.py): nothing per run.

* a run of a non-root user gets uid = gid = an id of its policy's block, never shared with
  a live run, and the template user's groups as supplementary groups: runs cannot signal,
  trace or read each other, whatever template they come from;
* a root run (allow_root) stays uid 0 but gets such an id as its gid and no supplementary
  groups (two cap-less uid-0 processes with different gids cannot trace each other, and
  the gid is what the nftables rules match), loses every capability its template does not
  list (bounding set too: what exec gives root is its bounding set), and gets
  no_new_privs.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Optional

from agent.runtime.kernel import cap_name

NETWORK_POLICIES = ("none", "internet", "any")
DEFAULT_NETWORK = "internet"

RUN_ID_FIRST = 70000
RUN_ID_LAST = 79999
# the owner of what the agent shares with root runs (their work directory's owner: a root
# run reaches its own through the group); never a run's id
RUN_FILES_ID = RUN_ID_FIRST
# policy -> (first, last) id of its block
ID_BLOCKS = {"none": (71000, 73999), "internet": (74000, 76999), "any": (77000, 79999)}

class RunIds:
    """Hands out the ids of the reserved range, per network policy block, never one a live
    run holds. Each block is walked from a random start: a returned id comes back only
    after the rest of its block (a file a run left in /tmp keeps its uid until then), and
    two executors on one host (tests) rarely pick the same id. Thread-safe."""

    def __init__(self, blocks: Optional[dict[str, tuple[int, int]]] = None):
        self.blocks = dict(blocks or ID_BLOCKS)
        self._lock = threading.Lock()
        self._live: set[int] = set()
        self._next = {p: random.randint(lo, hi) for p, (lo, hi) in self.blocks.items()}

    def take(self, policy: str) -> int:
        lo, hi = self.blocks[policy]
        with self._lock:
            n = self._next[policy]
            for _ in range(hi - lo + 1):
                if n > hi:
                    n = lo
                if n not in self._live:
                    self._live.add(n)
                    self._next[policy] = n + 1
                    return n
                n += 1
        raise OSError(0, f"every id of the {policy!r} block ({lo}-{hi}) is held by a live run")

    def give_back(self, n: int) -> None:
        with self._lock:
            self._live.discard(n)

    def live(self) -> int:
        with self._lock:
            return len(self._live)


@dataclass
class Confinement:
    """One run's confinement, decided when it is staged (its id held until it ends)."""

    run_id: int                    # its id from the reserved range (to give back)
    uid: int
    gid: int
    groups: list[int]
    network: str                   # none | internet | any
    root: bool                     # a root run: capabilities dropped, no_new_privs, own domain
    capabilities: list[int] = field(default_factory=list)   # a root run keeps these

    def setpriv_args(self, setpriv: str) -> list[str]:
        """The user switch and privilege drop, as setpriv options (then "--" and what to
        exec)."""
        groups = f"--groups={','.join(map(str, self.groups))}" if self.groups else "--clear-groups"
        if not self.root:
            return [setpriv, f"--reuid={self.uid}", f"--regid={self.gid}", groups, "--"]
        keep = "".join(f",+{cap_name(c)}" for c in sorted(self.capabilities))
        return [setpriv, f"--regid={self.gid}", groups, f"--inh-caps=-all{keep}", f"--bounding-set=-all{keep}",
                "--no-new-privs", "--"]
