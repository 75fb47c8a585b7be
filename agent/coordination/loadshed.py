"""Load-aware placement: an agent whose loop stays late hands some of its shards to peers
with headroom, and takes them back once it keeps up again. A small, pure policy.

The signal is the event loop's lag (agent/runtime/loop.py: how late the agent starts what
falls due, its timers and its firings' admission, claims and spawns).
While it stays above ``high_s`` for ``sustain_s`` the agent is *overloaded* (its member
record says so) and, if some other available member is not, it halves the weight it
publishes as its capacity (never below ``floor`` of its configured one): the bounded-load
rendezvous plan (hrw.py) then gives it fewer shards, and moves only those (about the share
the weight took). While the lag stays below ``low_s`` for ``recover_s`` the weight doubles
back, one step at a time. Between two changes at least ``hold_s`` pass, and the two bounds
are far apart (hysteresis): a burst, or a shard move's own cost, does not make the shards
flap between agents. Overload everywhere moves nothing: no peer has headroom.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

HIGH_S = 0.5
LOW_S = 0.05
SUSTAIN_S = 10.0
RECOVER_S = 60.0
HOLD_S = 30.0
STEP = 0.5
FLOOR = 0.25


@dataclass
class LoadShedding:
    high_s: float = HIGH_S
    low_s: float = LOW_S
    sustain_s: float = SUSTAIN_S
    recover_s: float = RECOVER_S
    hold_s: float = HOLD_S
    step: float = STEP
    floor: float = FLOOR
    weight: float = 1.0             # the share of its configured capacity the agent publishes
    overloaded: bool = False
    lag_s: float = 0.0
    _over_since: Optional[float] = None
    _under_since: Optional[float] = None
    _changed_at: Optional[float] = None

    def observe(self, lag_s: float, now: float, peers_with_headroom: bool) -> bool:
        """One lag sample (each second or so). True when what the member record says
        (weight, overloaded) changed and must be published."""
        self.lag_s = lag_s
        if lag_s > self.high_s:
            self._over_since = now if self._over_since is None else self._over_since
            self._under_since = None
        elif lag_s < self.low_s:
            self._under_since = now if self._under_since is None else self._under_since
            self._over_since = None
        else:
            self._over_since = self._under_since = None
        was = (self.weight, self.overloaded)
        self.overloaded = self._over_since is not None and now - self._over_since >= self.sustain_s
        if self._changed_at is None or now - self._changed_at >= self.hold_s:
            if self.overloaded and peers_with_headroom and self.weight > self.floor:
                self.weight = max(self.floor, self.weight * self.step)
                self._changed_at = now
            elif self._under_since is not None and now - self._under_since >= self.recover_s and self.weight < 1.0:
                self.weight = min(1.0, self.weight / self.step)
                self._changed_at = now
        return (self.weight, self.overloaded) != was

    def record(self) -> dict:
        """What the member record carries (``load``)."""
        return {"lag_s": round(self.lag_s, 3), "overloaded": self.overloaded, "weight": self.weight}
