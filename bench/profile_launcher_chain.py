#!/usr/bin/env python3
"""What a run's start costs outside the agent's Python, part by part (issue 36): the job
processes' CPU (launcher and job) was 3.5-3.7 ms per firing against APScheduler's 2.1-2.3
for the same job body, and the agent's run directories showed as slow system calls in
its profiles. This takes those parts apart on the host, each alone.

Launcher chain, CPU of the children per run (their rusage), blocks of each variant
alternated over three rounds:
- ``true``: /bin/true exec'd directly (the floor: one exec of a dynamic binary);
- ``launcher, exec true``: the armed launcher's shell (lksh where installed) exec'ing it;
- ``launcher, 3 joins, exec true``: the same after joining cgroup v1 cpu, memory and pids
  by writing "0" to inherited `tasks` fds, with the launcher's own lines (launch.join_lines);
- ``sh, exec true`` and ``launcher, 3 joins, exec sh, exec true``: a job whose body is a
  /bin/sh script, like the trigger benchmark's, directly and behind the launcher.

Run directories: a run's directory and its work directory made and removed (two mkdir,
two rmdir), CPU per run on the filesystem of ``--state-dir`` and on /dev/shm.

    /usr/bin/python3 bench/profile_launcher_chain.py [--runs 300] [--state-dir /var/lib/millwright]

Root, on a host with cgroup v1 cpu, memory and pids hierarchies (the joins are skipped
with a note elsewhere). Figures are printed, not judged.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent.execute.armed import pick_launcher  # noqa: E402
from agent.execute.backends.cgroup import NEEDED as HIERARCHIES  # noqa: E402
from agent.execute.launch import join_lines  # noqa: E402

JOIN = join_lines(len(HIERARCHIES))   # the launcher's own first lines: fds 3.. are the `tasks` files


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def cgroups(name: str) -> dict[str, str]:
    """A test cgroup in each v1 hierarchy (none when one is missing)."""
    if not all(os.path.exists(f"/sys/fs/cgroup/{h}/tasks") for h in HIERARCHIES):
        return {}
    out = {h: f"/sys/fs/cgroup/{h}/{name}" for h in HIERARCHIES}
    for d in out.values():
        os.makedirs(d, exist_ok=True)
    return out


def launcher_chain(runs: int, shell: str, groups: dict[str, str]) -> None:
    variants = {"true": (["/bin/true"], False),
                "launcher, exec true": ([shell, "-c", "exec /bin/true"], False),
                "sh, exec true": (["/bin/sh", "-c", "exec /bin/true"], False)}
    if groups:
        variants["launcher, 3 joins, exec true"] = ([shell, "-c", JOIN + "exec /bin/true"], True)
        variants["launcher, 3 joins, exec sh, exec true"] = (
            [shell, "-c", JOIN + "exec /bin/sh -c 'exec /bin/true'"], True)
    else:
        print("no cgroup v1 cpu, memory and pids hierarchies: the joins are not measured")
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(3):
        for name, (argv, join) in variants.items():
            c0 = children_cpu()
            for _ in range(runs):
                fds = [os.open(os.path.join(groups[h], "tasks"), os.O_WRONLY) for h in HIERARCHIES] if join else []
                p = subprocess.Popen(argv, pass_fds=fds, close_fds=True)
                for fd in fds:
                    os.close(fd)
                if p.wait() != 0:
                    raise SystemExit(f"{name}: exit {p.returncode}")
            cpu[name].append((children_cpu() - c0) / runs * 1e3)
    print(f"launcher chain ({shell}), CPU of the children per run, three rounds:")
    for name, v in cpu.items():
        print(f"  {name:40s} " + "  ".join(f"{x:.3f}" for x in v) + " ms")


def run_dirs(runs: int, parents: list[str]) -> None:
    print("a run directory and its work directory made and removed, CPU per run, two rounds:")
    for parent in parents:
        base = tempfile.mkdtemp(prefix="mw-dirs-", dir=parent)
        try:
            out = []
            for rnd in range(2):
                t0 = time.process_time()
                for i in range(runs * 10):
                    d = os.path.join(base, f"{rnd}-{i}")
                    os.mkdir(d, 0o711)
                    os.mkdir(os.path.join(d, "work"), 0o700)
                    os.rmdir(os.path.join(d, "work"))
                    os.rmdir(d)
                out.append((time.process_time() - t0) / (runs * 10) * 1e3)
        finally:
            os.rmdir(base)
        print(f"  {parent:40s} " + "  ".join(f"{x:.3f}" for x in out) + " ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=300, help="runs per variant and round")
    ap.add_argument("--state-dir", default=tempfile.gettempdir(),
                    help="a directory on the filesystem of the agent's state_dir (default: the temp dir)")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root (cgroup joins)")
    picked = pick_launcher()
    shell = picked[0] if picked else "/bin/sh"
    groups = cgroups(f"mw-launcher-chain-{os.getpid()}")
    try:
        launcher_chain(a.runs, shell, groups)
    finally:
        for d in groups.values():
            os.rmdir(d)
    run_dirs(a.runs, [a.state_dir] + (["/dev/shm"] if os.path.isdir("/dev/shm") else []))


if __name__ == "__main__":
    main()
