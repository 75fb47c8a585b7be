#!/usr/bin/env python3
"""Audit log throughput and verify speed.

Prints, each next to a peer measured in the same run so the figures compare across
machines:
  1. records/s sustained with fsync every 1 s  (peer: plain json.dumps + write, no chain, no MAC)
  2. records/s sustained with fsync on every record (peer: write + fsync of the same lines)
  3. verify speed in records/s (peer: json.loads of the same lines)
  4. caller cost of append() in microseconds (what the event loop pays)

Usage: bench/bench_audit.py [--seconds S] [--dir DIR]   (DIR must be on a real disk)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent.audit import AuditLog  # noqa: E402
from agent.audit.files import list_files  # noqa: E402
from agent.audit.verify import verify  # noqa: E402

KEY = os.urandom(32)


def fields(i: int) -> dict:
    """A typical run_end record (~300 bytes on disk)."""
    return {"event": "run_end", "job": f"coolant-flush-line{i % 7}-20261202", "run_id": f"r-{i}",
            "fire_id": "2026-12-02T12:00:00Z", "attempt": 1, "state": "succeeded", "exit_code": 0,
            "shard": i % 64, "reason": "exit_code"}


def sustained(d: str, fsync_interval_s: float, seconds: float, qmax: int) -> tuple[float, int, float]:
    """Writer throughput over a window: the producer keeps the queue fed without overflowing it."""
    log = AuditLog(d, "", key=KEY, fsync_interval_s=fsync_interval_s, queue_max=qmax,
                   rotate_bytes=16 << 20, keep_files=64, agent_id="bench")
    start_written = log.stats["written"]
    t0 = time.perf_counter()
    i = 0
    chunk = max(1, min(200, qmax // 10))
    while time.perf_counter() - t0 < seconds:
        if log.queue_depth > qmax - chunk:
            time.sleep(0.001)
            continue
        for _ in range(chunk):
            log.append("job", **fields(i))
            i += 1
    elapsed = time.perf_counter() - t0
    written = log.stats["written"] - start_written  # written within the window (the backlog is not counted)
    dropped = log.stats["dropped"]
    log.close(timeout=600)
    total = log.stats["written"]
    size = sum(os.path.getsize(os.path.join(d, n)) for _, n in list_files(d))
    return written / elapsed, dropped, size / max(1, total)


def peer_plain(d: str, n: int, fsync_each: bool) -> float:
    path = os.path.join(d, "plain.jsonl")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    t0 = time.perf_counter()
    buf = []
    for i in range(n):
        line = json.dumps(fields(i), sort_keys=True, separators=(",", ":")).encode() + b"\n"
        if fsync_each:
            os.write(fd, line)
            os.fsync(fd)
        else:
            buf.append(line)
            if len(buf) >= 512:
                os.write(fd, b"".join(buf))
                buf = []
    if buf:
        os.write(fd, b"".join(buf))
    os.fsync(fd)
    elapsed = time.perf_counter() - t0
    os.close(fd)
    os.unlink(path)
    return n / elapsed


def append_cost(d: str, n: int = 100000) -> float:
    log = AuditLog(d, "", key=KEY, queue_max=n + 10, agent_id="bench")
    log._io_lock.acquire()  # measure only the caller side
    try:
        t0 = time.perf_counter()
        for i in range(n):
            log.job("run_end", "coolant-flush-line3", run_id=f"r-{i}", state="succeeded", exit_code=0)
        per_call = (time.perf_counter() - t0) / n
    finally:
        log._io_lock.release()
    log.close(timeout=600)
    return per_call * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0, help="duration of each sustained run")
    ap.add_argument("--dir", default="/var/tmp", help="parent directory on the disk under test")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="millwright-bench-audit-", dir=args.dir)
    try:
        print(f"audit bench in {root} (cpus: {os.cpu_count()}, load: {os.getloadavg()[0]:.1f})")

        d1 = os.path.join(root, "fsync1s")
        rate1, drop1, bpr = sustained(d1, 1.0, args.seconds, 50000)
        peer1 = peer_plain(root, int(max(rate1, 1000) * 1.0), fsync_each=False)
        print(f"fsync every 1 s:      {rate1:10.0f} records/s sustained ({bpr:.0f} B/record, {drop1} dropped)"
              f"   peer json+write: {peer1:10.0f}/s  ratio {rate1 / peer1:.2f}")

        d2 = os.path.join(root, "fsync0")
        rate2, drop2, _ = sustained(d2, 0.0, args.seconds, 200)
        peer2 = peer_plain(root, max(200, int(rate2)), fsync_each=True)
        print(f"fsync every record:   {rate2:10.0f} records/s sustained ({drop2} dropped)"
              f"            peer write+fsync: {peer2:9.0f}/s  ratio {rate2 / peer2:.2f}")

        t0 = time.perf_counter()
        report = verify(d1, KEY)
        vt = time.perf_counter() - t0
        assert report.ok, report.problem
        lines = []
        for _, name in list_files(d1):
            with open(os.path.join(d1, name), "rb") as fh:
                lines.extend(fh.read().split(b"\n")[:-1])
        t0 = time.perf_counter()
        for raw in lines:
            json.loads(raw)
        pt = time.perf_counter() - t0
        print(f"verify:               {report.records / vt:10.0f} records/s ({report.records} records, {vt:.2f} s)"
              f"   peer json.loads: {len(lines) / pt:10.0f}/s  ratio {report.records / vt / (len(lines) / pt):.2f}")

        d3 = os.path.join(root, "append")
        print(f"append() caller cost: {append_cost(d3):10.2f} us/call (queue only; never waits for the disk)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
