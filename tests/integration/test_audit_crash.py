"""Acceptance 2 (kill -9 during heavy writing, 20 times) and real disk errors."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time

from agent.audit import AuditLog
from agent.audit.files import list_files
from agent.audit.keyfile import load_key
from agent.audit.record import line_hash
from agent.audit.verify import verify

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _writer_child(d: str, kf: str, ready_fd: int) -> None:
    """Body of the forked writer process: write as fast as possible until killed."""
    try:
        log = AuditLog(d, kf, fsync_interval_s=0.02, rotate_bytes=64 * 1024, keep_files=1000,
                       checkpoint_interval_s=0.05, queue_max=2000, agent_id="crash")
        os.write(ready_fd, b"r")
        i = 0
        while True:
            i += 1
            if not log.job("run_end", f"job-{i % 97}", run_id=f"r{i}", state="succeeded", exit_code=0,
                           reason="x" * (i % 50)):
                os.sched_yield()
    finally:
        os._exit(1)


def _spawn_writer(d: str, kf: str) -> int:
    """Fork (not exec) so that 20 crashes do not pay 20 interpreter starts on a busy machine."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _writer_child(d, kf, w)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 60)  # hang guard only
        if not ready or os.read(r, 1) != b"r":
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("writer child failed to start")
    finally:
        os.close(r)
    return pid


def _hashes_by_seq(d):
    out = {}
    for _, name in list_files(d):
        with open(os.path.join(d, name), "rb") as fh:
            for raw in fh.read().split(b"\n"):
                try:
                    rec = json.loads(raw)
                except ValueError:
                    continue
                out[rec["seq"]] = (line_hash(raw), rec)
    return out


def test_kill_9_during_heavy_writing_20_times(tmp_path):
    d, kf = str(tmp_path / "audit"), str(tmp_path / "audit.key")
    rng = random.Random(8)
    crash_points = []
    for _ in range(20):
        pid = _spawn_writer(d, kf)
        try:
            time.sleep(rng.uniform(0.02, 0.15))
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        # everything written before the crash verifies, before any recovery
        r = verify(d, load_key(kf))
        assert r.ok, str(r.problem)
        last = r.last_seq or 0
        assert not crash_points or last > crash_points[-1][0]  # at least the recovered record was added
        crash_points.append((last, r.last_hash))
    log = AuditLog(d, kf)
    log.close()
    r = verify(d, load_key(kf))
    assert r.ok, str(r.problem)
    assert r.recovered == 20
    assert r.files > 1  # the crashes also hit rotations
    records = _hashes_by_seq(d)
    recovered = sorted(rec["seq"] for _, rec in records.values() if rec["type"] == "recovered")
    assert len(recovered) == 20
    for (seq, h), rseq in zip(crash_points, recovered):
        assert seq == 0 or records[seq][0] == h  # nothing verified before a crash was lost or rewritten
        assert seq < rseq <= seq + 3  # and the next start chained a recovered record right after it
        assert records[rseq][1]["last_seq"] >= seq


DISK_FULL = r"""
import os, resource, signal, sys, json
sys.path.insert(0, sys.argv[1])
from agent.audit import AuditLog
from agent.runtime.metrics import sample
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
log = AuditLog(sys.argv[2], sys.argv[3], fsync_interval_s=0.0, rotate_bytes=1 << 30, checkpoint_interval_s=0)
for i in range(5):
    log.job("accepted", "before-%d" % i)
assert log.flush()
size = os.path.getsize(os.path.join(sys.argv[2], "audit-000001.jsonl"))
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 100, hard))   # the disk is (nearly) full
for i in range(20):
    log.job("accepted", "during-%d" % i)
log.flush()
errors = sample("millwright_audit_write_errors_total")
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))         # space again
log.job("accepted", "after")
log.close()
print(json.dumps({"errors": errors, "dropped": sample("millwright_audit_dropped_records_total", {"reason": "write_error"})}))
"""


def test_write_errors_lose_records_as_a_gap_and_keep_the_chain(tmp_path):
    """A real EFBIG from the kernel (RLIMIT_FSIZE) stands in for a full disk."""
    d, kf = str(tmp_path / "audit"), str(tmp_path / "audit.key")
    out = subprocess.run([sys.executable, "-c", DISK_FULL, ROOT, d, kf], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert stats["errors"] >= 1 and stats["dropped"] >= 1
    r = verify(d, load_key(kf))
    assert r.ok, str(r.problem)
    recs = [rec for _, rec in sorted(_hashes_by_seq(d).items()) for rec in [rec[1]]]
    jobs = [x.get("job") for x in recs if x["type"] == "job"]
    gap = [x for x in recs if x["type"] == "gap"]
    assert len(gap) == 1 and gap[0]["reason"] == "write_error"
    assert gap[0]["dropped"] == 20 - sum(1 for j in jobs if j.startswith("during-")) == stats["dropped"]
    assert jobs[:5] == [f"before-{i}" for i in range(5)] and jobs[-1] == "after"
    assert r.gaps == 1
