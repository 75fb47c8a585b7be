"""Opening an audit directory for writing: the one-writer lock, and where both chains
resume after a clean stop or a crash.

Bytes after the last newline of a file (a torn write) are terminated and kept as
evidence; the writer then chains around them with a ``recovered`` record naming their
offset, size and hash. A complete record that only lacks its newline is kept as a
record. A start not preceded by a clean ``stop`` head of the current file, a current
file that lacks its link to the previous one (a crash during a rotation), or audit files
gone while checkpoints remain, are named too (:attr:`Resume.recovered_reason`).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from dataclasses import dataclass
from typing import Any, Optional

from agent.audit.files import CHECKPOINTS, LOCK, file_name, file_number, iter_lines, list_files, read_tail
from agent.audit.record import GENESIS, BadRecord, line_hash, open_record


class AuditError(Exception):
    """The audit log cannot be opened (key, directory, lock); one line for the operator."""


def lock_directory(directory: str) -> int:
    """Create the directory if needed and take its writer lock; returns the lock's fd
    (closing it releases the lock)."""
    try:
        os.makedirs(directory, mode=0o750, exist_ok=True)
        lock_fd = os.open(os.path.join(directory, LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise AuditError(f"cannot use audit directory {directory}: {exc.strerror}") from None
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock_fd)
        raise AuditError(f"audit directory {directory} is in use by another writer") from None
    return lock_fd


@dataclass
class CheckpointTail:
    """The checkpoints file as found: its chain's last seq and hash, its size, the
    records at its tail (oldest first) and a torn last line (offset, bytes)."""

    seq: int
    hash: str
    size: int
    recent: list[dict]
    torn: Optional[tuple[int, bytes]]


def read_checkpoints(directory: str) -> CheckpointTail:
    cp_path = os.path.join(directory, CHECKPOINTS)
    tail = CheckpointTail(0, GENESIS, 0, [], None)
    if os.path.exists(cp_path):
        found = read_tail(cp_path)
        tail.size = found.size
        for ln in found.lines:
            try:
                rec = open_record(ln.raw, None)
            except BadRecord:
                continue
            tail.recent.append(rec)
            tail.seq, tail.hash = rec["seq"], line_hash(ln.raw)
        if found.fragment:
            tail.torn = (found.fragment_offset, found.fragment)
    return tail


@dataclass
class Resume:
    """Where the main chain continues: the current file (open for appending, its size and
    running SHA-256 so far), the chain's last record, and what the writer must record
    before anything else."""

    n: int
    fd: int
    size: int
    sha: Any
    seq: int
    last_hash: str
    first_seq: int
    link: Optional[dict]             # the previous file's closed checkpoint the current file must start with
    link_checkpointed: bool          # the checkpoints file already holds that closed checkpoint
    recovered_reason: Optional[str]
    torn: Optional[tuple[int, bytes]]   # (offset, bytes) of a torn write in the current file


def resume_chain(directory: str, key: bytes, checkpoints: CheckpointTail) -> Resume:
    """Open the current file for appending (terminating a torn last line) and find where
    the chain resumes. A directory without audit files starts file 1, or continues the
    numbering and the chain the checkpoints recorded."""
    cp_recent = checkpoints.recent
    files = list_files(directory)
    seq, last_hash = 0, GENESIS
    sha = hashlib.sha256()
    size = 0
    torn = None
    need_newline = False
    recovered_reason = None
    link_prev = None  # n when the current file must start with a checkpoint of file n
    last_cp = cp_recent[-1] if cp_recent else None
    if not files:
        known = [r for r in cp_recent if isinstance(r.get("last_seq"), int) and isinstance(r.get("last_hash"), str)]
        nums = [n for n in (file_number(str(r.get("file", ""))) for r in cp_recent) if n is not None]
        n = max(nums) + 1 if nums else 1
        if known:
            seq, last_hash = known[-1]["last_seq"], known[-1]["last_hash"]
            recovered_reason = "files_missing"
        first_seq = seq + 1
        fd = os.open(os.path.join(directory, file_name(n)), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    else:
        n, name = files[-1]
        path = os.path.join(directory, name)
        found_first = None
        last = None
        for ln in iter_lines(path, hasher=sha):
            if not ln.complete:
                torn = (ln.offset, ln.raw)
                break
            try:
                rec = open_record(ln.raw, None)
            except BadRecord:
                continue
            if found_first is None:
                found_first = rec["seq"]
            last = (rec["seq"], line_hash(ln.raw))
        size = os.path.getsize(path)
        if torn is not None:
            # a complete record that only lacks its newline is kept as a record
            try:
                rec = open_record(torn[1], key)
                if last is None or (rec["seq"] == last[0] + 1 and rec["prev"] == last[1]):
                    last = (rec["seq"], line_hash(torn[1]))
                    found_first = found_first or rec["seq"]
                    torn = None
                    recovered_reason = "unclean_shutdown"
                    need_newline = True
            except BadRecord:
                pass
        if last is not None:
            seq, last_hash = last
        elif n > 1:
            prev_path = os.path.join(directory, file_name(n - 1))
            prev_last = last_record(prev_path) if os.path.exists(prev_path) else None
            if prev_last is not None:
                seq, last_hash = prev_last
                link_prev = n - 1
        first_seq = found_first if found_first is not None else seq + 1
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        if need_newline or torn is not None:
            os.write(fd, b"\n")
            size += 1
            sha.update(b"\n")
        clean = (torn is None and recovered_reason is None and checkpoints.torn is None and last_cp is not None
                 and last_cp.get("kind") == "head" and last_cp.get("clean") is True
                 and last_cp.get("file") == name and last_cp.get("last_seq") == seq
                 and last_cp.get("last_hash") == last_hash)
        if torn is not None:
            recovered_reason = "torn_write"
        elif not clean and recovered_reason is None and (seq > 0 or link_prev or last_cp is not None):
            recovered_reason = "unclean_shutdown"

    link = None
    link_checkpointed = False
    if link_prev is not None:
        # crashed during a rotation: the previous file must be checkpointed and linked
        prev_name = file_name(link_prev)
        link = file_info(os.path.join(directory, prev_name), prev_name)
        link_checkpointed = any(r.get("kind") == "closed" and r.get("file") == prev_name for r in cp_recent)
    return Resume(n=n, fd=fd, size=size, sha=sha, seq=seq, last_hash=last_hash, first_seq=first_seq, link=link,
                  link_checkpointed=link_checkpointed, recovered_reason=recovered_reason, torn=torn)


def torn_fields(name: str, offset: int, data: bytes) -> dict:
    """The fields of a ``recovered`` record that name a torn write kept as evidence."""
    return {"torn_file": name, "torn_offset": offset, "torn_bytes": len(data),
            "torn_sha256": hashlib.sha256(data).hexdigest()}


def last_record(path: str) -> Optional[tuple[int, str]]:
    """(seq, hash) of the last parseable complete record of a file."""
    tail = read_tail(path, want=16)
    for ln in reversed(tail.lines):
        try:
            rec = open_record(ln.raw, None)
        except BadRecord:
            continue
        return rec["seq"], line_hash(ln.raw)
    return None


def file_info(path: str, name: str) -> dict:
    """A closed checkpoint for an existing file, computed by reading it."""
    sha = hashlib.sha256()
    first = last = None
    for ln in iter_lines(path, hasher=sha):
        if not ln.complete:
            continue
        try:
            rec = open_record(ln.raw, None)
        except BadRecord:
            continue
        if first is None:
            first = rec["seq"]
        last = (rec["seq"], line_hash(ln.raw))
    size = os.path.getsize(path)
    return {"kind": "closed", "file": name, "first_seq": first or 0, "last_seq": last[0] if last else 0,
            "last_hash": last[1] if last else GENESIS, "records": (last[0] - first + 1) if last and first else 0,
            "bytes": size, "sha256": sha.hexdigest()}
