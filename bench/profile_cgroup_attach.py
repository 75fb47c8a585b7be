#!/usr/bin/env python3
"""What attaching a launcher to its cgroup v1 hierarchies costs the rest of the host
(issues 18, 36): the agent writing the launcher's pid to each hierarchy's cgroup.procs
(which takes the kernel's global cgroup_threadgroup_rwsem for writing) against the
launcher joining them itself (it writes "0" to each `tasks` file it inherited: a thread
moving itself takes no global lock, and no thread of the agent moves at all).

Blocks of runs alternate between the two ways (so both see the same machine load), each
run prepared like the scheduler does (held, then released). A probe process meanwhile
forks and reaps /bin/true in a loop and times each fork+exec+exit: forks and exits are
what the global lock stalls. Prints, per way, the time prepare() took on the calling
thread and the probe's fork times during that way's blocks.

Usage: profile_cgroup_attach.py [RUNS_PER_WAY]   (root; default 300)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent.execute import Executor, Limits, RunSpec  # noqa: E402
from agent.execute.backends import Cgroup1Backend  # noqa: E402

PROBE = r"""
import os, sys, time
out = []
end = time.time() + float(sys.argv[1])
while time.time() < end:
    t0 = time.time()
    pid = os.posix_spawn("/bin/true", ["/bin/true"], {})
    os.waitpid(pid, 0)
    out.append((t0, time.time() - t0))
    time.sleep(0.002)
print("\n".join(f"{a:.6f} {b:.6f}" for a, b in out))
"""


class PidAttach(Cgroup1Backend):
    """The other way: the launcher never joins by itself, the agent writes its pid."""

    def create(self, name, limits):
        slot = super().create(name, limits)
        for fd in slot.join_fds.values():
            self.fs.close_fd(fd)
        slot.join_fds.clear()
        return slot


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    block = 20
    tmp = tempfile.mkdtemp(prefix="mw-attach-")
    root = f"mw-attach-{os.getpid()}"
    ways = {"pid written to cgroup.procs": PidAttach(root_name=root + "-old"),
            "the launcher joins by itself": Cgroup1Backend(root_name=root + "-new")}
    exs = {}
    for name, b in ways.items():
        b.setup()
        exs[name] = Executor(b, os.path.join(tmp, str(len(exs))), guard=False)
    probe = subprocess.Popen([sys.executable, "-c", PROBE, str(3 + 2 * n * 0.012)], stdout=subprocess.PIPE, text=True)
    time.sleep(1)
    spans: dict[str, list[tuple[float, float]]] = {k: [] for k in ways}
    prep: dict[str, list[float]] = {k: [] for k in ways}
    done: list = []
    lim = Limits(cpu=1.0, memory_mb=256, pids=64)
    i = 0
    while i < n:
        for name, ex in exs.items():
            t_block = time.time()
            for j in range(block):
                t0 = time.perf_counter()
                h = ex.prepare(RunSpec(f"r{i + j}", ["/bin/true"], limits=lim), lambda h, r: done.append(r))
                prep[name].append(time.perf_counter() - t0)
                ex.release(h)
                time.sleep(0.01)
            spans[name].append((t_block, time.time()))
        i += block
    forks = [(float(a), float(b)) for a, b in (line.split() for line in probe.communicate()[0].splitlines() if line)]
    print(f"load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}; {n} runs per way, blocks of {block}, alternating")
    for name in ways:
        inside = [d for t, d in forks if any(a <= t <= b for a, b in spans[name])]
        p = [x * 1000 for x in prep[name]]
        f = [x * 1000 for x in inside]
        print(f"{name:36s} prepare() p50 {pct(p, 50):6.2f} ms p99 {pct(p, 99):6.2f} ms max {max(p):7.2f} ms | "
              f"probe fork+exec+exit n={len(f)} p50 {pct(f, 50):6.2f} ms p99 {pct(f, 99):6.2f} ms max {max(f or [0]):7.2f} ms")
    for ex in exs.values():
        ex.close()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
