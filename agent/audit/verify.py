"""Verification of an audit directory: chain, MACs, checkpoints; the first problem, precisely.

Order of work:

1. ``checkpoints.jsonl`` is verified as its own chain (form, MAC, seq, prev) and indexed:
   ``closed`` (file hash, size, last record of a rotated file), ``retired`` (removed by
   retention, with its last record so the next file can still be linked) and ``head``
   (a position of the current file, written periodically and at every clean stop).
2. Files ``audit-000001.jsonl`` .. the highest number known from the directory or the
   checkpoints are walked in order as one chain. A number that is neither present nor
   retired is a deleted file. Each line is checked for form, MAC, seq continuity and the
   link to the previous record; an invalid line is accepted only when the next record is
   a ``recovered`` record (MAC'd, so only the key holder writes it) naming exactly its
   offset, size and hash: that is a torn write after a crash.
3. At the end of each file it is compared with its ``closed`` checkpoint (last seq, last
   hash, size, SHA-256) and its ``head`` checkpoints (every recorded position must still
   be there with the same hash): this is what catches a truncated tail or a rewrite.

Verification stops at the first problem: everything after a break is unproven anyway,
and an auditor needs the exact place to start looking.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

from agent.audit.files import CHECKPOINTS, Line, file_name, file_number, iter_lines, list_files
from agent.audit.record import GENESIS, BadRecord, line_hash, open_record


@dataclass
class Problem:
    file: str
    line: Optional[int]
    seq: Optional[int]
    what: str

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f" line {self.line}"
        if self.seq is not None:
            where += f" (seq {self.seq})"
        return f"{where}: {self.what}"


@dataclass
class Report:
    directory: str
    problem: Optional[Problem] = None
    records: int = 0
    files: int = 0
    first_seq: Optional[int] = None
    last_seq: Optional[int] = None
    last_hash: Optional[str] = None
    gaps: int = 0
    dropped: int = 0
    recovered: int = 0
    checkpoints: int = 0
    retired: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.problem is None

    def summary(self) -> str:
        parts = [f"{self.records} records in {self.files} file{'s' if self.files != 1 else ''}"]
        if self.first_seq is not None:
            parts[0] += f" (seq {self.first_seq}..{self.last_seq})"
        parts.append(f"{self.checkpoints} checkpoints")
        parts.append(f"{self.gaps} gaps ({self.dropped} records or events lost)")
        parts.append(f"{self.recovered} recoveries")
        if self.retired:
            parts.append(f"{len(self.retired)} files removed by retention")
        return ", ".join(parts)


class _Fail(Exception):
    def __init__(self, problem: Problem):
        super().__init__(str(problem))
        self.problem = problem


@dataclass
class _Loc:
    file: str
    line: int
    seq: int


@dataclass
class FileResult:
    name: str
    sha256: str
    bytes: int
    records: int = 0
    first_seq: Optional[int] = None
    last_seq: Optional[int] = None
    last_hash: Optional[str] = None
    last_line: int = 0
    fragment: Optional[Line] = None


class ChainChecker:
    """Checks records of one chain, possibly spread over several files, in order."""

    def __init__(self, key: bytes, seq: int = 0, prev: str = GENESIS):
        self.key = key
        self.expected_seq = seq + 1
        self.prev_hash = prev
        self.prev_prev_hash: Optional[str] = None
        self.last: Optional[_Loc] = None

    def reset(self, seq: int, prev: str) -> None:
        self.expected_seq = seq + 1
        self.prev_hash = prev
        self.prev_prev_hash = None
        self.last = None

    def check_file(self, path: str, name: str, on_record: Callable[[dict, Line], None]) -> FileResult:
        sha = hashlib.sha256()
        res = FileResult(name, "", 0)
        pending: Optional[tuple[Line, str, Optional[int]]] = None
        for ln in iter_lines(path, hasher=sha):
            if not ln.complete:
                res.fragment = ln
                break
            try:
                rec: Optional[dict] = open_record(ln.raw, self.key)
                bad = None
            except BadRecord as exc:
                rec, bad = None, (str(exc), exc.rec.get("seq") if exc.rec else None)
            if pending is not None:
                if rec is not None and _excuses(rec, pending[0], name):
                    pending = None
                else:
                    raise _Fail(Problem(name, pending[0].no, pending[2], pending[1]))
            if rec is None:
                assert bad is not None
                pending = (ln, bad[0], bad[1])
                continue
            self._link(rec, ln, name)
            res.records += 1
            if res.first_seq is None:
                res.first_seq = rec["seq"]
            res.last_seq = rec["seq"]
            res.last_hash = self.prev_hash
            res.last_line = ln.no
            on_record(rec, ln)
        if pending is not None:
            raise _Fail(Problem(name, pending[0].no, pending[2], pending[1]))
        res.sha256 = sha.hexdigest()
        res.bytes = os.path.getsize(path)
        return res

    def _link(self, rec: dict, ln: Line, name: str) -> None:
        seq, expected = rec["seq"], self.expected_seq
        if seq != expected or rec["prev"] != self.prev_hash:
            last = self.last
            if last is not None and seq == expected - 1 and rec["prev"] == self.prev_prev_hash:
                raise _Fail(Problem(last.file, last.line, last.seq,
                                    f"record is not part of the chain: the next record ({name} line {ln.no}, "
                                    f"seq {seq}) links to the record before it, so this one was inserted "
                                    f"(with the audit key)"))
            where = f" ({last.file} line {last.line}, seq {last.seq})" if last else ""
            if seq > expected:
                what = (f"seq {seq} where {expected} was expected: {seq - expected} record(s) missing "
                        f"before this line (deleted, or lines reordered)")
            elif seq < expected:
                what = (f"seq {seq} where {expected} was expected: a repeated or out-of-order record "
                        f"(lines reordered or inserted)")
            elif last is None:
                what = ("prev does not link to the last record of the previous file or the retention "
                        "checkpoint (the previous file was altered, truncated or replaced)")
            else:
                what = f"prev does not match the hash of the previous record{where}: that record was altered"
            raise _Fail(Problem(name, ln.no, seq, what))
        self.prev_prev_hash = self.prev_hash
        self.prev_hash = line_hash(ln.raw)
        self.expected_seq = seq + 1
        self.last = _Loc(name, ln.no, seq)


def _excuses(rec: dict, bad: Line, name: str) -> bool:
    """A recovered record that names exactly this torn line."""
    return (rec.get("type") == "recovered" and rec.get("torn_file") == name
            and rec.get("torn_offset") == bad.offset and rec.get("torn_bytes") == len(bad.raw)
            and rec.get("torn_sha256") == hashlib.sha256(bad.raw).hexdigest())


def _num(name: object) -> Optional[int]:
    return file_number(name) if isinstance(name, str) else None


def verify(directory: str, key: bytes) -> Report:
    """Verify an audit directory; ``report.problem`` is the first problem, or None."""
    report = Report(directory)
    try:
        _verify(directory, key, report)
    except _Fail as f:
        report.problem = f.problem
    except FileNotFoundError as exc:  # a live log: retention removed a file while we read
        report.problem = Problem(os.path.basename(exc.filename or "?"), None, None,
                                 "disappeared while verifying (retention on a live log?); run verify again")
    return report


def _verify(directory: str, key: bytes, report: Report) -> None:
    present = dict(list_files(directory))
    cp_path = os.path.join(directory, CHECKPOINTS)

    # ---- 1. the checkpoint chain
    closed: dict[int, tuple[int, dict]] = {}
    retired: dict[int, tuple[int, dict]] = {}
    heads: dict[int, list[tuple[int, dict]]] = {}
    if not os.path.exists(cp_path):
        if present:
            raise _Fail(Problem(CHECKPOINTS, None, None,
                                "missing (deleted?): without it deleted or truncated audit files cannot be detected"))
    else:
        def on_cp(rec: dict, ln: Line) -> None:
            if rec["type"] != "checkpoint":
                return
            report.checkpoints += 1
            n = _num(rec.get("file"))
            if n is None:
                return
            kind = rec.get("kind")
            if kind == "closed":
                closed[n] = (ln.no, rec)
            elif kind == "retired":
                retired[n] = (ln.no, rec)
            elif kind == "head":
                heads.setdefault(n, []).append((ln.no, rec))

        cp_res = ChainChecker(key).check_file(cp_path, CHECKPOINTS, on_cp)
        if cp_res.fragment is not None:
            report.notes.append(f"{CHECKPOINTS}: incomplete last line at offset {cp_res.fragment.offset} "
                                f"(writer crashed or is writing)")

    known = set(present) | set(closed) | set(retired) | set(heads)
    if not known:
        return
    hi = max(known)

    # ---- 2. the main chain, file by file
    chain = ChainChecker(key)
    results: dict[int, FileResult] = {}
    cp_records: list[tuple[str, Line, dict]] = []

    def on_rec(rec: dict, ln: Line) -> None:
        report.records += 1
        if report.first_seq is None:
            report.first_seq = rec["seq"]
        report.last_seq = rec["seq"]
        report.last_hash = chain.prev_hash
        ty = rec["type"]
        if ty == "gap":
            report.gaps += 1
            lost = rec.get("dropped", rec.get("count", 0))
            report.dropped += lost if isinstance(lost, int) else 0
        elif ty == "recovered":
            report.recovered += 1
        elif ty == "checkpoint":
            cp_records.append((current_name, ln, rec))
        want = head_by_seq.get(rec["seq"])
        if want is not None and want[1].get("last_hash") != chain.prev_hash:
            raise _Fail(Problem(current_name, ln.no, rec["seq"],
                                f"differs from the position recorded in {CHECKPOINTS} line {want[0]} at "
                                f"{want[1].get('ts')}: records were rewritten after that checkpoint"))

    current_name = ""
    head_by_seq: dict[int, tuple[int, dict]] = {}
    for n in range(1, hi + 1):
        name = file_name(n)
        if n not in present:
            if n in retired:
                line_no, rec = retired[n]
                report.retired.append(name)
                if isinstance(rec.get("last_seq"), int) and isinstance(rec.get("last_hash"), str):
                    chain.reset(rec["last_seq"], rec["last_hash"])
                continue
            raise _Fail(Problem(name, None, _seq_range(n, closed, heads),
                                "file is missing (deleted): " + _missing_why(n, closed, heads, present)))
        current_name = name
        head_by_seq = {r["last_seq"]: (no, r) for no, r in heads.get(n, []) if isinstance(r.get("last_seq"), int)}
        res = chain.check_file(os.path.join(directory, name), name, on_rec)
        results[n] = res
        report.files += 1
        _check_file_end(n, res, hi, closed, heads, present, directory, report)

    # ---- 3. the checkpoint records inside the chain agree with the files they describe
    for where, ln, rec in cp_records:
        num = _num(rec.get("file"))
        if rec.get("kind") != "closed" or num is None or num not in results:
            continue
        r = results[num]
        if rec.get("sha256") != r.sha256 or rec.get("bytes") != r.bytes:
            raise _Fail(Problem(where, ln.no, rec["seq"],
                                f"checkpoint of {rec.get('file')} records sha256 {str(rec.get('sha256'))[:12]}… "
                                f"({rec.get('bytes')} bytes) but the file has {r.sha256[:12]}… ({r.bytes} bytes)"))


def _seq_range(n: int, closed: dict, heads: dict) -> Optional[int]:
    if n in closed:
        return closed[n][1].get("first_seq")
    return None


def _missing_why(n: int, closed: dict, heads: dict, present: dict) -> str:
    if n in closed:
        no, rec = closed[n]
        return (f"{CHECKPOINTS} line {no} recorded it closed with seq {rec.get('first_seq')}..{rec.get('last_seq')} "
                f"({rec.get('records')} records)")
    if n in heads:
        no, rec = heads[n][-1]
        return f"{CHECKPOINTS} line {no} recorded it at seq {rec.get('last_seq')}"
    later = [m for m in present if m > n]
    if later:
        return f"the numbering jumps to {file_name(min(later))}"
    return "it is named in the checkpoints"


def _check_file_end(n: int, res: FileResult, hi: int, closed: dict, heads: dict, present: dict,
                    directory: str, report: Report) -> None:
    name = res.name
    end_line = res.last_line + 1
    if res.fragment is not None:
        if n == hi:
            report.notes.append(f"{name}: incomplete last line at offset {res.fragment.offset} "
                                f"(writer crashed or is writing); not counted")
        else:
            raise _Fail(Problem(name, res.fragment.no, None, "incomplete line at the end of a closed file"))
    if n in closed:
        no, cp = closed[n]
        last = res.last_seq or 0
        want = cp.get("last_seq")
        if isinstance(want, int) and last < want:
            raise _Fail(Problem(name, end_line, last + 1,
                                f"{want - last} record(s) missing at the end: the file ends at line {res.last_line} "
                                f"(seq {last}) but {CHECKPOINTS} line {no} recorded it closed at seq {want} "
                                f"(truncated)"))
        if isinstance(want, int) and last > want:
            raise _Fail(Problem(name, res.last_line, last,
                                f"records after seq {want}, where {CHECKPOINTS} line {no} recorded the file closed"))
        if cp.get("last_hash") != res.last_hash or cp.get("sha256") != res.sha256 or cp.get("bytes") != res.bytes:
            raise _Fail(Problem(name, None, None,
                                f"file content differs from its closed checkpoint ({CHECKPOINTS} line {no}: "
                                f"sha256 {str(cp.get('sha256'))[:12]}…, {cp.get('bytes')} bytes; file: "
                                f"{res.sha256[:12]}…, {res.bytes} bytes)"))
    elif n < hi:
        later_nonempty = any(os.path.getsize(os.path.join(directory, file_name(m))) > 0
                             for m in present if m > n)
        if later_nonempty:
            raise _Fail(Problem(name, None, None,
                                f"no closed checkpoint for this rotated file in {CHECKPOINTS} "
                                f"(checkpoints removed or edited)"))
        report.notes.append(f"{name}: rotation was interrupted (the writer completes it on its next start)")
    for no, head in heads.get(n, []):
        want = head.get("last_seq")
        last = res.last_seq or 0
        if isinstance(want, int) and want > last:
            raise _Fail(Problem(name, end_line, last + 1,
                                f"{want - last} record(s) missing at the end: the file ends at line {res.last_line} "
                                f"(seq {last}) but {CHECKPOINTS} line {no} recorded seq {want} at {head.get('ts')} "
                                f"(tail truncated)"))
