"""CPU pressure on the host (PSI), read as evidence about the agent itself: while runnable
tasks wait for a CPU, the keepalive thread waits too, and a keepalive that leaves late
leaves less room before the renew deadline. The lease policy answers with faster
keepalives (agent/supervision/leasepolicy.py), never with a hand-off: a busy CPU slows
the agent, it does not stop it.
"""

from __future__ import annotations

import os
from typing import Optional

# some avg10 (percent of the last 10 s in which at least one runnable task waited)
HIGH_PCT = 40.0
# below this again counts as relieved (the gap keeps a value near the line from flapping)
RELIEVED_PCT = 20.0


def read_cpu_pressure(proc: str = "/proc") -> Optional[float]:
    """``some avg10`` of /proc/pressure/cpu, in percent; None without PSI (kernel < 4.20,
    ``psi=0``) or on a line it cannot read. Never raises."""
    try:
        with open(os.path.join(proc, "pressure", "cpu"), encoding="ascii") as fh:
            for line in fh:
                parts = line.split()
                if parts and parts[0] == "some":
                    vals = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
                    return float(vals["avg10"])
    except (OSError, ValueError, KeyError):
        return None
    return None


class CpuPressureRule:
    """High once ``some avg10`` reaches ``high_pct``; relieved once it falls below
    ``relieved_pct``. ``observe`` returns True while high (every observation: the caller
    keeps the fast interval), False on the observation that relieves it, None otherwise."""

    def __init__(self, high_pct: float = HIGH_PCT, relieved_pct: float = RELIEVED_PCT):
        if not 0 <= relieved_pct <= high_pct <= 100:
            raise ValueError("0 <= relieved_pct <= high_pct <= 100")
        self.high_pct = high_pct
        self.relieved_pct = relieved_pct
        self.high = False
        self.last: Optional[float] = None

    def observe(self, avg10: Optional[float]) -> Optional[bool]:
        self.last = avg10
        if avg10 is None:
            return None
        if avg10 >= self.high_pct or (self.high and avg10 >= self.relieved_pct):
            self.high = True
            return True
        if self.high:
            self.high = False
            return False
        return None
