"""The job-store workload of the multi-agent tests: templates that record their own side
effects (tests/jobs/record.sh), job documents for them, and reading the effects back."""

from __future__ import annotations

import collections
import os
from datetime import datetime, timezone
from typing import Any

JOBS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs")   # tests/jobs/*.sh
RECORD = os.path.join(JOBS, "record.sh")


def templates(out: str) -> dict:
    """`rec` appends "<job> <fire id> <attempt> <pid>" to ``out`` (after sleeping, exits
    with the given code); `tree` leaves a process tree that ignores SIGTERM."""
    return {"rec": {"argv": [RECORD, out, "{sleep}", "{code}"],
                    "params": {"sleep": r"^[0-9.]+$", "code": r"^[0-9]+$"}, "user": "root", "allow_root": True,
                    "allow_exec": ["/bin/*", "/usr/bin/*", RECORD]},
            "tree": {"argv": ["/bin/sh", "-c", "trap '' TERM; (trap '' TERM; echo $$ > \"$0\"; sleep 60) & sleep 60",
                              "{pidfile}"], "params": {"pidfile": r"^/[A-Za-z0-9/._-]+$"}, "user": "root",
                     "allow_root": True}}


def effects_file(tmp_path: Any) -> str:
    """The file a test's recording runs append their effects to, in a directory the job
    users can write (``tmp_path``/out)."""
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    os.chmod(out_dir, 0o777)
    return str(out_dir / "effects.txt")


def now() -> datetime:
    """The wall clock in UTC, as job documents and run records carry it."""
    return datetime.now(timezone.utc)


def job(job_id: str, schedule: dict, **kw) -> dict:
    """An unsigned `rec` job (tests store it through Cluster.signing, which binds and signs)."""
    d = {"v": 1, "id": job_id, "template": "rec", "params": {"sleep": "0", "code": "0"}, "schedule": schedule}
    d.update(kw)
    return d


def effects(out: str) -> collections.Counter:
    """Side effects per (job, fire id), as the job scripts wrote them."""
    c: collections.Counter = collections.Counter()
    if os.path.exists(out):
        with open(out) as fh:
            for line in fh:
                parts = line.split()
                if len(parts) == 4:
                    c[(parts[0], parts[1])] += 1
    return c
