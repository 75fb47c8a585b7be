"""The state disk's free space, watched: runs, the outbox, the audit log and the run
records' local copies all write there, and a full disk is seen today only once writes
fail. A gauge lets an alert fire before (configs/alerts.yaml, MillwrightStateDiskLow),
and the audit log records each crossing of the low line, so an auditor sees when the
agent ran short.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional, Protocol

from agent.runtime.loop import EventLoop, Timer
from agent.runtime.metrics import gauge

log = logging.getLogger(__name__)

FREE_BYTES = gauge("millwright_state_disk_free_bytes", "Bytes free to the agent on the state directory's file system")
FREE_RATIO = gauge("millwright_state_disk_free_ratio", "Fraction of the state directory's file system free to the agent")
LOW_RATIO = 0.05     # below this the disk is low: an audit record, a warning
EVERY_S = 30.0       # one statvfs per period on the loop thread (microseconds)


class Recorder(Protocol):
    def record(self, type_: str, **fields: Any) -> None: ...


class StateDisk:
    """Samples the state directory's file system every ``every_s`` on the loop thread."""

    def __init__(self, state_dir: str, loop: EventLoop, audit: Recorder, every_s: float = EVERY_S,
                 low_ratio: float = LOW_RATIO, statvfs: Callable[[str], Any] = os.statvfs):
        self.state_dir = state_dir
        self.loop = loop
        self.audit = audit
        self.every_s = every_s
        self.low_ratio = low_ratio
        self._statvfs = statvfs
        self.free_bytes: Optional[int] = None
        self.free_ratio: Optional[float] = None
        self.low = False
        self.error: Optional[str] = None
        self._timer: Optional[Timer] = None

    def start(self) -> None:
        self.sample()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def sample(self) -> None:
        try:
            st = self._statvfs(self.state_dir)
        except OSError as exc:
            self.error = exc.strerror or str(exc)
        else:
            self.error = None
            self.free_bytes = st.f_bavail * st.f_frsize   # what an unprivileged writer may still use
            self.free_ratio = st.f_bavail / st.f_blocks if st.f_blocks else 0.0
            FREE_BYTES.set(self.free_bytes)
            FREE_RATIO.set(self.free_ratio)
            low = self.free_ratio < self.low_ratio
            if low != self.low:
                self.low = low
                event = "low" if low else "recovered"
                fields: dict[str, Any] = {"event": event, "free_bytes": self.free_bytes,
                          "free_ratio": round(self.free_ratio, 4), "low_ratio": self.low_ratio,
                          "path": self.state_dir}
                (log.warning if low else log.info)("state disk " + event, extra={"fields": fields})
                self.audit.record("state_disk", **fields)
        self._timer = self.loop.call_later(self.every_s, self.sample)

    def status(self) -> dict:
        return {"free_bytes": self.free_bytes, "free_ratio": None if self.free_ratio is None
                else round(self.free_ratio, 4), "low": self.low, "error": self.error}
