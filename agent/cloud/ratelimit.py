"""A token bucket: how the cloud channel bounds what others can make an agent do per second
(reports of unauthenticated input, jobs/get requests)."""

from __future__ import annotations

import threading
import time
from typing import Callable


class TokenBucket:
    """Thread-safe rate limit: take() is True while tokens last (``rate`` per second, at
    most ``burst`` saved up)."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens, self.at = burst, clock()
        self.lock = threading.Lock()

    def take(self, cost: float = 1.0) -> bool:
        """Take ``cost`` tokens if there are that many."""
        with self.lock:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
            if self.tokens >= cost:
                self.tokens -= cost
                return True
            return False
