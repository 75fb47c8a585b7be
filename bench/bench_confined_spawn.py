#!/usr/bin/python3
"""How long a confined root run's launcher spawn holds its caller, alone and beside a busy
thread of the agent (issue 36: the ~100 ms outliers at the job's clock).

A root run's launcher comes from a thread of its own (agent/execute/namespaces.py): a new
Landlock domain, the jobs' mount namespace, the run's capabilities (threadcreds.become),
then posix_spawn; the daemon's loop waits for that thread. Each step is a system call
through ctypes. A call that drops the GIL must win it back, and beside a thread that runs
Python (a retention pass parsing a shard, the reaper, an etcd worker) that costs up to the
switch interval (5 ms) every time. agent/runtime/kernel.py keeps the GIL for the calls that
never wait; ``--drop-gil`` runs the same steps with every call dropping it (the layout
before), as the peer.

Prints p50 / p99 / max of the spawn's wall time per mode, N spawns of /bin/true each.

    /usr/bin/python3 bench/bench_confined_spawn.py [--spawns 200]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent.execute import pspawn, threadcreds  # noqa: E402
from agent.execute.confine import Confinement  # noqa: E402
from agent.execute.namespaces import JobNamespaces, _in_thread  # noqa: E402
from agent.runtime import kernel as k  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


class Busy:
    """A thread that runs Python without pause (what a retention pass does for a while)."""

    def __init__(self) -> None:
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        doc = json.dumps({"runs": list(range(200))})
        while not self.stop:
            json.loads(doc)

    def __enter__(self) -> "Busy":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop = True
        self.thread.join()


def spawns(ns: JobNamespaces, n: int) -> list[float]:
    """n confined root spawns of /bin/true, each on a thread of its own; wall seconds each."""
    conf = Confinement(70000, 0, 70000, [], "host", True, [])
    null = os.open("/dev/null", os.O_RDWR)
    pids: list[int] = []

    def confined() -> None:
        if ns.landlock:
            k.landlock_scope_self()
        k.unshare(k.CLONE_FS)
        k.setns(ns.jobs_mnt, k.CLONE_NEWNS)
        threadcreds.become(conf)
        pids.append(pspawn.spawn(["/bin/true"], {"PATH": "/bin"}, "/", null, null, null))

    took = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            _in_thread(confined, "bench-confine")
            took.append(time.perf_counter() - t)
    finally:
        for pid in pids:
            os.waitpid(pid, 0)
        os.close(null)
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spawns", type=int, default=200)
    a = ap.parse_args()
    if os.geteuid() != 0 or not threadcreds.available() or not pspawn.available():
        print("needs root, a per-thread user switch and posix_spawn here", file=sys.stderr)
        return 2
    expose = tempfile.mkdtemp(prefix="mw-bench-spawn-")
    ns = JobNamespaces([], [expose])
    rows = []
    try:
        for label, drop in (("kernel.py as shipped (quick calls keep the GIL)", False),
                            ("--drop-gil: every call drops the GIL", True)):
            k._quick = k.libc() if drop else None   # quick() loads its PyDLL again when None
            for beside in ("alone", "beside a busy thread"):
                if beside == "alone":
                    took = spawns(ns, a.spawns)
                else:
                    with Busy():
                        took = spawns(ns, a.spawns)
                rows.append((label, beside, took))
    finally:
        k._quick = None
        ns.close()
        os.rmdir(expose)
    print(f"confined root spawn (Landlock domain, jobs' mount namespace, capabilities, posix_spawn), "
          f"{a.spawns} each, wall ms on its caller")
    print("| system calls | machine | p50 | p99 | max |")
    print("| --- | --- | --- | --- | --- |")
    for label, beside, took in rows:
        print(f"| {label} | {beside} | {pct(took, 50) * 1e3:.2f} | {pct(took, 99) * 1e3:.2f} | {max(took) * 1e3:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
