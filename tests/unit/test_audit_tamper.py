"""Acceptance 1: every kind of tampering is detected and reported at the right place."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from agent.audit import AuditLog
from agent.audit.files import CHECKPOINTS, file_name
from agent.audit.record import line_hash, seal
from agent.audit.verify import verify

KEY = bytes(range(32))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """Three rotated files plus the current one (about 25 records per file), built once."""
    base = tmp_path_factory.mktemp("pristine")
    d = str(base / "audit")
    log = AuditLog(d, str(base / "unused.key"), key=KEY, rotate_bytes=4096, keep_files=100,
                   fsync_interval_s=1.0, agent_id="gw-01")
    for i in range(90):
        log.job("accepted", f"job-{i:03d}", shard=i % 8, reason=None)
    assert log.close()
    names = sorted(n for n in os.listdir(d) if n.startswith("audit-"))
    assert len(names) >= 3
    assert verify(d, KEY).ok
    return d


@pytest.fixture
def log_dir(pristine, tmp_path):
    d = str(tmp_path / "audit")
    shutil.copytree(pristine, d)
    return d


def lines_of(d, n):
    with open(os.path.join(d, file_name(n)), "rb") as fh:
        return fh.read().split(b"\n")[:-1]


def write_lines(d, n, lines):
    with open(os.path.join(d, file_name(n)), "wb") as fh:
        fh.write(b"".join(line + b"\n" for line in lines))


def seq_at(d, n, line_no):
    return json.loads(lines_of(d, n)[line_no - 1])["seq"]


def last_file(d):
    return max(int(x[6:12]) for x in os.listdir(d) if x.startswith("audit-"))


def check(d, file_no, line, seq, *words):
    r = verify(d, KEY)
    assert not r.ok, "tampering went unnoticed"
    p = r.problem
    assert (p.file, p.line, p.seq) == (file_name(file_no), line, seq), str(p)
    for w in words:
        assert w in p.what, str(p)
    return p


def test_intact_log_verifies(log_dir):
    r = verify(log_dir, KEY)
    assert r.ok, str(r.problem)
    # 90 job records plus one checkpoint record at the start of every rotated-to file
    assert r.records == 90 + (r.files - 1) and r.files == last_file(log_dir)
    assert r.gaps == 0 and r.recovered == 0 and not r.notes


def test_edit_a_field(log_dir):
    lines = lines_of(log_dir, 2)
    seq = seq_at(log_dir, 2, 5)
    lines[4] = lines[4].replace(b'"event":"accepted"', b'"event":"rejected"')
    write_lines(log_dir, 2, lines)
    check(log_dir, 2, 5, seq, "mac mismatch")


def test_edit_spacing_only(log_dir):
    lines = lines_of(log_dir, 2)
    seq = seq_at(log_dir, 2, 7)
    lines[6] = lines[6].replace(b'","', b'", "', 1)
    write_lines(log_dir, 2, lines)
    check(log_dir, 2, 7, seq, "mac mismatch")


def test_delete_a_line(log_dir):
    lines = lines_of(log_dir, 2)
    seq_after = seq_at(log_dir, 2, 6)
    del lines[4]
    write_lines(log_dir, 2, lines)
    check(log_dir, 2, 5, seq_after, "1 record(s) missing")


def test_swap_two_lines(log_dir):
    lines = lines_of(log_dir, 2)
    seq6 = seq_at(log_dir, 2, 6)
    lines[4], lines[5] = lines[5], lines[4]
    write_lines(log_dir, 2, lines)
    check(log_dir, 2, 5, seq6, "missing before this line")


def _forged(before: bytes, key: bytes) -> bytes:
    prev = json.loads(before)
    body = {"v": 1, "seq": prev["seq"] + 1, "ts": prev["ts"], "type": "job", "event": "accepted",
            "job": "forged-job", "agent": "gw-01", "prev": line_hash(before)}
    line, _ = seal(body, key)
    return line[:-1]


def test_insert_forged_line_without_key(log_dir):
    lines = lines_of(log_dir, 2)
    forged = _forged(lines[3], b"x" * 32)
    lines.insert(4, forged)
    write_lines(log_dir, 2, lines)
    check(log_dir, 2, 5, json.loads(forged)["seq"], "mac mismatch")


def test_insert_forged_line_with_key(log_dir):
    lines = lines_of(log_dir, 2)
    forged = _forged(lines[3], KEY)
    lines.insert(4, forged)
    write_lines(log_dir, 2, lines)
    check(log_dir, 2, 5, json.loads(forged)["seq"], "inserted")


def test_truncate_the_tail(log_dir):
    n = last_file(log_dir)
    lines = lines_of(log_dir, n)
    assert len(lines) > 4
    first_missing = json.loads(lines[-3])["seq"]
    write_lines(log_dir, n, lines[:-3])
    check(log_dir, n, len(lines) - 2, first_missing, "3 record(s) missing at the end", "truncated")


def test_truncate_the_tail_mid_line(log_dir):
    n = last_file(log_dir)
    path = os.path.join(log_dir, file_name(n))
    lines = lines_of(log_dir, n)
    first_missing = json.loads(lines[-2])["seq"]
    size = os.path.getsize(path)
    os.truncate(path, size - len(lines[-1]) - 1 - len(lines[-2]) // 2)
    p = check(log_dir, n, len(lines) - 1, first_missing, "missing at the end")
    assert "2 record(s)" in p.what


def test_truncate_a_middle_file(log_dir):
    lines = lines_of(log_dir, 2)
    first_missing = json.loads(lines[-2])["seq"]
    write_lines(log_dir, 2, lines[:-2])
    check(log_dir, 2, len(lines) - 1, first_missing, "2 record(s) missing at the end", "closed")


def test_delete_a_file_in_the_middle(log_dir):
    os.unlink(os.path.join(log_dir, file_name(2)))
    r = verify(log_dir, KEY)
    assert not r.ok
    assert r.problem.file == file_name(2) and r.problem.line is None
    assert "missing (deleted)" in r.problem.what and "closed with seq" in r.problem.what


def test_delete_the_last_file(log_dir):
    n = last_file(log_dir)
    os.unlink(os.path.join(log_dir, file_name(n)))
    r = verify(log_dir, KEY)
    assert not r.ok and r.problem.file == file_name(n) and "missing" in r.problem.what


def test_delete_the_first_file_is_not_retention(log_dir):
    os.unlink(os.path.join(log_dir, file_name(1)))
    r = verify(log_dir, KEY)
    assert not r.ok and r.problem.file == file_name(1) and "missing" in r.problem.what


def test_delete_the_checkpoints(log_dir):
    os.unlink(os.path.join(log_dir, CHECKPOINTS))
    r = verify(log_dir, KEY)
    assert not r.ok and r.problem.file == CHECKPOINTS and "missing" in r.problem.what


def test_edit_the_checkpoints(log_dir):
    path = os.path.join(log_dir, CHECKPOINTS)
    with open(path, "rb") as fh:
        lines = fh.read().split(b"\n")[:-1]
    lines[1] = lines[1].replace(b'"kind":"closed"', b'"kind":"retired"')
    with open(path, "wb") as fh:
        fh.write(b"".join(x + b"\n" for x in lines))
    r = verify(log_dir, KEY)
    assert not r.ok and (r.problem.file, r.problem.line) == (CHECKPOINTS, 2) and "mac" in r.problem.what


def test_rewrite_of_a_closed_file_with_the_key_is_caught_by_its_checkpoint(log_dir):
    """Whoever holds the key can re-chain a file, but not its checkpointed hash (the anchor)."""
    lines = lines_of(log_dir, 2)
    last = json.loads(lines[-1])
    body = {k: v for k, v in last.items() if k != "mac"}
    body["job"] = "rewritten"
    new, _ = seal(body, KEY)
    lines[-1] = new[:-1]
    write_lines(log_dir, 2, lines)
    r = verify(log_dir, KEY)
    assert not r.ok
    assert r.problem.file == file_name(2) and "closed checkpoint" in r.problem.what


def test_verify_with_the_wrong_key(log_dir):
    r = verify(log_dir, b"y" * 32)
    assert not r.ok and r.problem.file == CHECKPOINTS and r.problem.line == 1 and "mac" in r.problem.what
