"""Layout of an audit directory and the byte-level reading both writer and verifier need.

    audit-000001.jsonl   closed (rotated) files, oldest first
    audit-000007.jsonl   the current file (highest number)
    checkpoints.jsonl    checkpoint chain: one record per closed file, retired file and
                         periodic/stop position of the current file
    .lock                flock held by the one writer
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Iterator, Optional

FILE_RE = re.compile(r"^audit-(\d{6,})\.jsonl$")
CHECKPOINTS = "checkpoints.jsonl"
LOCK = ".lock"


def file_name(n: int) -> str:
    return f"audit-{n:06d}.jsonl"


def file_number(name: str) -> Optional[int]:
    m = FILE_RE.match(name)
    return int(m.group(1)) if m else None


def list_files(directory: str) -> list[tuple[int, str]]:
    """(number, name) of the audit files in the directory, in order."""
    out = []
    for name in os.listdir(directory):
        n = file_number(name)
        if n is not None:
            out.append((n, name))
    out.sort()
    return out


@dataclass
class Line:
    no: int          # 1-based line number
    offset: int      # byte offset of the line's first byte
    raw: bytes       # without the newline
    complete: bool   # False for a last line without newline (torn or being written)


def iter_lines(path: str, chunk: int = 1 << 20, hasher=None) -> Iterator[Line]:
    """Stream the lines of a file with their offsets; feeds every byte to ``hasher``."""
    with open(path, "rb") as fh:
        buf = b""
        base = 0  # offset of buf[0]
        no = 0
        while True:
            data = fh.read(chunk)
            if not data:
                break
            if hasher is not None:
                hasher.update(data)
            buf += data
            start = 0
            while True:
                nl = buf.find(b"\n", start)
                if nl < 0:
                    break
                no += 1
                yield Line(no, base + start, buf[start:nl], True)
                start = nl + 1
            base += start
            buf = buf[start:]
        if buf:
            yield Line(no + 1, base, buf, False)


@dataclass
class Tail:
    size: int
    lines: list[Line]          # the last complete lines (up to ``want``), oldest first; no numbers
    fragment: bytes            # bytes after the last newline (a torn write), may be empty
    fragment_offset: int


def read_tail(path: str, want: int = 8, max_bytes: int = 4 << 20) -> Tail:
    """The last few complete lines and any trailing fragment, reading backwards."""
    with open(path, "rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        pos = size
        buf = b""
        while pos > 0 and buf.count(b"\n") <= want and size - pos < max_bytes:
            step = min(65536, pos)
            pos -= step
            fh.seek(pos)
            buf = fh.read(step) + buf
    last_nl = buf.rfind(b"\n")
    if last_nl < 0:
        return Tail(size, [], buf, pos)
    fragment = buf[last_nl + 1:]
    body = buf[:last_nl]
    parts = body.split(b"\n")
    offsets = []
    off = pos
    for p in parts:
        offsets.append(off)
        off += len(p) + 1
    lines = [Line(0, o, p, True) for o, p in zip(offsets, parts)]
    if pos > 0:
        lines = lines[1:]  # the first piece may be cut
    return Tail(size, lines[-want:], fragment, pos + last_nl + 1)


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
