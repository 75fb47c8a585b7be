"""Quoting user input in error messages: short, and safe for any value. A leaf."""

from __future__ import annotations

from typing import Any


def short(value: Any, limit: int = 60) -> str:
    """repr(value), cut to ``limit`` characters with ``...`` (a 1 MB field never floods a
    log line or an error document)."""
    try:
        text = repr(value)
    except Exception:  # exotic objects whose repr fails
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
