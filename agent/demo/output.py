"""The demo's live output: one line per notable event, and how it reads times and prints
figures."""

from __future__ import annotations

import sys
import threading
import time
from datetime import datetime
from typing import Optional

from agent.runtime.timefmt import parse_rfc3339, utcnow


class Live:
    """One line per notable event: UTC wall time, seconds since the demo started, who, what."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.t0 = time.monotonic()
        self.lock = threading.Lock()

    def line(self, who: str, text: str) -> None:
        now = utcnow()
        with self.lock:
            print(f"{now:%H:%M:%S}.{now.microsecond // 1000:03d} {time.monotonic() - self.t0:5.1f}s  "
                  f"{who:<9} {text}", file=self.stream, flush=True)

    def phase(self, text: str) -> None:
        with self.lock:
            print(f"\n== {text}", file=self.stream, flush=True)

    def raw(self, text: str = "") -> None:
        with self.lock:
            print(text, file=self.stream, flush=True)


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(p / 100.0 * (len(s) - 1)))))]


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def parse_rfc(text: Optional[str]) -> Optional[datetime]:
    """A time from a status document or run record; None when absent or unreadable."""
    if not text:
        return None
    try:
        return parse_rfc3339(text)
    except ValueError:
        return None
