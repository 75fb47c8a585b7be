"""Waiting for a condition in a test: poll it until it holds or a deadline passes."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(pred: Callable[[], T], timeout: float, interval: float = 0.02, what: str = "condition",
             errors: tuple[type[BaseException], ...] = ()) -> T:
    """``pred()``'s first true value; AssertionError naming ``what`` once ``timeout`` seconds
    passed without one. An exception of a type in ``errors`` counts as "not yet" (a scrape
    of an agent that is frozen on purpose); any other exception fails at once."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            v = pred()
        except errors:
            v = None  # type: ignore[assignment]
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
