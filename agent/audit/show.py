"""Reading the audit log for people: filter by type, job and time; a table or JSON lines.

``show`` does not verify (use ``audit verify`` for that) and needs no key; lines that are
not records (a torn write) are skipped. Asked for ``checkpoint`` records, it also lists the
checkpoint chain (``checkpoints.jsonl``: the closed, retired and head checkpoints that
``audit verify`` counts), merged in time order; their SEQ is their own chain's (``cp N``).
"""

from __future__ import annotations

import heapq
import json
import os
from dataclasses import dataclass
from typing import Iterator, Optional, TextIO

from agent.audit.files import CHECKPOINTS, iter_lines, list_files
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
    """(raw line, record) of matching records of the audit files, oldest first."""
    for raw, rec, _ in _read(directory, [name for _, name in list_files(directory)], flt, False):
        yield raw, rec


def rows(directory: str, flt: Filter) -> Iterator[tuple[bytes, dict, bool]]:
    """(raw line, record, from the checkpoint chain) of what ``audit show`` lists: the
    matching records, and when the filter asks for checkpoints, the chain's too."""
    files = _read(directory, [name for _, name in list_files(directory)], flt, False)
    if flt.types is None or "checkpoint" not in flt.types:
        return files
    chain = _read(directory, [CHECKPOINTS], Filter(types={"checkpoint"}, job=flt.job, since=flt.since,
                                                   until=flt.until), True)
    return heapq.merge(files, chain, key=lambda row: str(row[1].get("ts", "")))


def _read(directory: str, names: list[str], flt: Filter, chain: bool) -> Iterator[tuple[bytes, dict, bool]]:
    for name in names:
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
                    yield ln.raw, rec, chain
        except FileNotFoundError:  # removed by retention while we read (or no checkpoints yet)
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


def print_table(listed: Iterator[tuple[bytes, dict, bool]], out: TextIO) -> int:
    n = 0
    out.write(f"{'TIME (UTC)':<23}  {'SEQ':>8}  {'TYPE':<16}  {'JOB':<24}  DETAILS\n")
    for _, rec, chain in listed:
        ts = str(rec.get("ts", ""))[:23].replace("T", " ")
        job = str(rec.get("job") or "-")
        seq = f"cp {rec.get('seq', '')}" if chain else rec.get("seq", "")
        out.write(f"{ts:<23}  {seq:>8}  {str(rec.get('type', '')):<16}  {job:<24}  {_details(rec)}\n")
        n += 1
    return n


def print_json(listed: Iterator[tuple[bytes, dict, bool]], out: TextIO) -> int:
    n = 0
    for raw, _, _ in listed:
        out.write(raw.decode("ascii", "replace") + "\n")
        n += 1
    return n
