"""The peer of the trigger benchmarks: APScheduler 3.x (in memory, no persistence, thread
pool) with the same schedule, starting the same job script with subprocess.Popen, as
the job's user (switched the way a Python scheduler does it). Meant to run in its own
process (bench_trigger.py starts it as a child).

Prerequisite: APScheduler 3.x (Debian: python3-apscheduler; scripts/setup-host.sh).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from trigger_workload import Workload, job_script, read_clocks  # noqa: E402
from thread_cpu import ThreadCPU  # noqa: E402


def run_apscheduler(w: Workload, start_ts: Optional[float] = None, user: str = "root", drain_s: float = 30.0) -> dict:
    import pwd

    from apscheduler.schedulers.background import BackgroundScheduler

    pw = pwd.getpwnam(user)
    switch: dict = {}
    if (pw.pw_uid, pw.pw_gid) != (os.geteuid(), os.getegid()):
        switch = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": os.getgrouplist(user, pw.pw_gid)}
    popen: list[float] = []
    procs = []
    lock = threading.Lock()
    tmp = tempfile.mkdtemp(prefix="mw-bench-peer-")
    script, out = job_script(tmp)

    def fire(jid, due_ts):
        p = subprocess.Popen([script], env={"PATH": "/usr/bin:/bin", "MILLWRIGHT_JOB_ID": jid},
                             stdin=subprocess.DEVNULL, close_fds=True, **switch)
        d = time.time() - due_ts
        with lock:
            popen.append(d)
            procs.append(p)

    sched = BackgroundScheduler(job_defaults={"misfire_grace_time": None, "coalesce": False},
                                executors={"default": {"type": "threadpool", "max_workers": 20}})
    sched.start()
    start = datetime.now(timezone.utc) + timedelta(seconds=5 + w.n * 0.0005)
    if start_ts is not None:
        start = datetime.fromtimestamp(start_ts, timezone.utc)
    due: dict[str, float] = {}
    due_off: dict[str, float] = {}
    for i, off in enumerate(w.offsets):
        jid = f"p{i:06d}"
        at = start + timedelta(seconds=off)
        due[jid] = at.timestamp()
        due_off[jid] = off
        sched.add_job(fire, "date", run_date=at, args=[jid, at.timestamp()])
    reaped = [0]

    def reap():
        while True:
            with lock:
                ps, procs[:] = list(procs), []
            for p in ps:
                p.wait()
                reaped[0] += 1
            if reaped[0] >= w.n:
                return
            time.sleep(0.2)

    r = threading.Thread(target=reap, name="reap", daemon=True)
    r.start()
    while time.time() < start.timestamp() - 0.5:
        time.sleep(0.1)
    cpu = ThreadCPU().start()
    deadline = start.timestamp() + w.span + drain_s
    k = 0
    while time.time() < deadline and reaped[0] < w.n:
        time.sleep(0.25)
        k += 1
        if k % 4 == 0:
            cpu.poll()
    time.sleep(0.5)
    cpu_window = cpu.stop()
    sched.shutdown(wait=True)
    r.join(10)
    lateness, counts = read_clocks(out, due)
    shutil.rmtree(tmp, ignore_errors=True)
    return {"scheduler": "apscheduler", "n": w.n, "start_ts": start.timestamp(), "due_off": due_off,
            "lateness": lateness, "counts": counts, "popen": popen, "cpu": cpu_window, "cpu_firings": reaped[0]}
