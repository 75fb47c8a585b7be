"""Reading the audit log for people: filter by type, job and time; a table or JSON lines.

``show`` does not verify (use ``audit verify`` for that) and needs no key; lines that are
not records (a torn write) are skipped.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterator, Optional, TextIO

from agent.audit.files import iter_lines, list_files
from agent.runtime.timefmt import format_ts

_HIDDEN = ("v", "seq", "ts", "type", "prev", "mac", "agent", "job")


@dataclass
class Filter:
    types: Optional[set] = None
    job: Optional[str] = None
    since: Optional[float] = None   # epoch seconds
    until: Optional[float] = None

    def __post_init__(self) -> None:
        # records carry fixed-width UTC RFC3339 stamps, so string comparison is time comparison
        self._since = format_ts(self.since) if self.since is not None else None
        self._until = format_ts(self.until) if self.until is not None else None

    def match(self, rec: dict) -> bool:
        if self.types is not None and rec.get("type") not in self.types:
            return False
        if self.job is not None and rec.get("job") != self.job:
            return False
        ts = rec.get("ts")
        if not isinstance(ts, str):
            return self._since is None and self._until is None
        if self._since is not None and ts < self._since:
            return False
        if self._until is not None and ts > self._until:
            return False
        return True


def records(directory: str, flt: Filter) -> Iterator[tuple[bytes, dict]]:
    """(raw line, record) of matching records, oldest first."""
    for _, name in list_files(directory):
        try:
            lines = iter_lines(os.path.join(directory, name))
            for ln in lines:
                if not ln.complete or not ln.raw.startswith(b"{"):
                    continue
                try:
                    rec = json.loads(ln.raw)
                except ValueError:
                    continue
                if isinstance(rec, dict) and flt.match(rec):
                    yield ln.raw, rec
        except FileNotFoundError:  # removed by retention while we read
            continue


def _details(rec: dict, width: int = 160) -> str:
    parts = []
    for k in sorted(rec):
        if k in _HIDDEN:
            continue
        v = rec[k]
        s = v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
        if isinstance(v, str) and (not s or " " in s or "=" in s):
            s = json.dumps(s)
        parts.append(f"{k}={s}")
    text = " ".join(parts)
    return text if len(text) <= width else text[: width - 1] + "…"


def print_table(rows: Iterator[tuple[bytes, dict]], out: TextIO) -> int:
    n = 0
    out.write(f"{'TIME (UTC)':<23}  {'SEQ':>8}  {'TYPE':<16}  {'JOB':<24}  DETAILS\n")
    for _, rec in rows:
        ts = str(rec.get("ts", ""))[:23].replace("T", " ")
        job = str(rec.get("job") or "-")
        out.write(f"{ts:<23}  {rec.get('seq', ''):>8}  {str(rec.get('type', '')):<16}  {job:<24}  {_details(rec)}\n")
        n += 1
    return n


def print_json(rows: Iterator[tuple[bytes, dict]], out: TextIO) -> int:
    n = 0
    for raw, _ in rows:
        out.write(raw.decode("ascii", "replace") + "\n")
        n += 1
    return n
