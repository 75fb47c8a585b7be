"""Runs die with their agent (agent/execute/guard.py), on every quota backend usable here:
an "agent" process runs an Executor and a run whose tree ignores SIGTERM; the agent is
SIGKILLed; every process of the run must go. Also: the keeper's deadman, and that it
never signals a process group whose leader was reaped (the pid may be reused)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from agent.execute import Executor, RunSpec
from agent.execute.backends import BackendUnavailable, Cgroup1Backend, Cgroup2Backend, RlimitBackend, probe
from agent.execute.guard import RunGuard, kill_runs
from tests.support.kernel import require_kernel
from tests.support.processes import group_alive
from tests.support.waiting import wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TREE = "trap '' TERM; (trap '' TERM; sleep 60) & (trap '' TERM; sh -c 'sleep 60') & echo ready; sleep 60"

AGENT = f"""
import os, sys, time
sys.path.insert(0, {ROOT!r})
from agent.execute import Executor, RunSpec
from agent.execute.backends import probe
b = probe(sys.argv[1], root_name=sys.argv[2], reclaim=True)
assert b.name == sys.argv[1], b.why
ex = Executor(b, sys.argv[3])
# two runs at once first: afterwards one slot is free in the pool, one holds the run below
warm = [ex.start(RunSpec(k, ["/bin/sleep", "0.2"]), lambda h, r: None) for k in ("w1", "w2")]
assert all(w.wait(10) is not None for w in warm)
h = ex.start(RunSpec("t", ["/bin/sh", "-c", {TREE!r}]), lambda h, r: None)
assert ex.slots.free() == 1 or b.name == "rlimit", ex.slots.free()
print(h.pgid, flush=True)
time.sleep(120)
"""


def usable(name: str) -> bool:
    if name == "rlimit":
        return True
    cls = Cgroup2Backend if name == "cgroup2" else Cgroup1Backend
    b = cls(root_name=f"millwright-test-guard-{os.getpid()}")
    try:
        b.setup()
    except (BackendUnavailable, OSError):
        return False
    b.close()
    return True


@pytest.mark.parametrize("backend", ["cgroup2", "cgroup1", "rlimit"])
def test_a_killed_agents_run_dies_with_it(backend, tmp_path):
    if backend == "cgroup2":  # a declared host limit on the CI host (README, testing)
        require_kernel(usable("cgroup2"), "no usable (delegated) cgroup2 hierarchy on this host", limit="cgroup2")
    if backend != "rlimit":
        require_kernel(os.geteuid() == 0 and usable(backend), f"{backend} unusable here (needs root)")
    root = f"millwright-test-guard-{os.getpid()}-{backend}"
    agent = subprocess.Popen([sys.executable, "-c", AGENT, backend, root, str(tmp_path / "runs")],
                             stdout=subprocess.PIPE, text=True)
    try:
        pgid = int(agent.stdout.readline())
        wait_for(lambda: len(group_alive(pgid)) >= 4, 10, what="the run's tree")
        cg_dirs = [os.path.join(m, root) for m in ("/sys/fs/cgroup/memory", "/sys/fs/cgroup/pids")]

        def run_cgroups():
            return [x for d in cg_dirs if os.path.isdir(d) for x in os.listdir(d)
                    if os.path.isdir(os.path.join(d, x))]

        if backend == "cgroup1":   # the run's slot and a free one in the pool
            assert len(run_cgroups()) == 4, run_cgroups()
        agent.kill()
        agent.wait()
        wait_for(lambda: not group_alive(pgid), 10, interval=0.005, what="the run to die with its agent")
        if backend == "cgroup1":   # the keeper removed the emptied run cgroups, the pooled one too
            wait_for(lambda: not run_cgroups(), 10, what="run cgroups removed")
    finally:
        if agent.poll() is None:
            agent.kill()
        if backend != "rlimit":
            b = probe(backend, root_name=root, reclaim=True)
            b.close()


def test_deadman_kills_the_runs_of_an_agent_that_stopped_renewing(tmp_path):
    ex = Executor(RlimitBackend(), str(tmp_path / "runs"))
    try:
        h = ex.start(RunSpec("t", ["/bin/sh", "-c", TREE]), lambda h, r: None)
        wait_for(lambda: len(group_alive(h.pgid)) >= 4, 10, what="the run's tree")
        ex.guard.set_deadline(time.monotonic() + 60)   # renewed...
        ex.guard.set_deadline(time.monotonic() + 0.3)  # ...then no more
        r = h.wait(10)
        assert r is not None and r.signal == signal.SIGKILL
        wait_for(lambda: not group_alive(h.pgid), 5, what="the whole tree")
    finally:
        ex.close()


def test_keeper_restarts_and_still_guards_the_live_runs(tmp_path):
    ex = Executor(RlimitBackend(), str(tmp_path / "runs"))
    try:
        old = ex.guard.pid
        os.kill(old, signal.SIGKILL)
        time.sleep(0.1)
        h = ex.start(RunSpec("t", ["/bin/sh", "-c", TREE]), lambda h, r: None)
        assert ex.guard.pid != old and ex.guard.restarts == 1
        ex.guard.set_deadline(time.monotonic() + 0.2)
        assert h.wait(10) is not None
    finally:
        ex.close()


def test_a_group_whose_leader_was_reaped_is_never_signalled():
    """kill_runs with a reaped leader's pgid: a process that now has that pid as its group
    (pid reuse) is left alone; only cgroup members would be killed."""
    bystander = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        n = kill_runs({bystander.pid: (False, ())}, give_up_after_s=0.2)
        assert n == 0
        assert bystander.poll() is None
        n = kill_runs({bystander.pid: (True, ())}, give_up_after_s=2)   # the leader is ours: killed
        assert n == 1
        assert bystander.wait(5) == -signal.SIGKILL
    finally:
        if bystander.poll() is None:
            bystander.kill()
            bystander.wait()


def test_run_guard_tells_the_keeper_in_order():
    g = RunGuard()
    try:
        g.pooled(["/x/y", "/x/z"])
        g.unpooled(["/x/z"])
        g.add(123456789, ["/x/y"])
        g.leader_exited(123456789)
        g.remove(123456789)
        g.remove(42)   # unknown: nothing sent
        assert g.guarded() == set()
    finally:
        g.close()
