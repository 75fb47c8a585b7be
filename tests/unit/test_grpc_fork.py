"""Processes are started beside gRPC without fork() (issue 55).

python3-grpcio 1.51 (Debian 12) registers its event engine's fork handlers with
pthread_atfork whatever GRPC_ENABLE_FORK_SUPPORT says. So every fork() of a process that
has used gRPC waits for gRPC's pool threads in the parent and starts new pool threads in
the child before it can exec. Under qemu-user (the arm64 tier) such a child hung for good
in the clone() that makes its first thread, about one fork in five beside a connecting
channel; natively the parent-side wait is the hang the chaos test once met (an etcd
member's restart stuck in gRPC's prefork handler).

The agent's own setting (agent/__init__.py) still turns gRPC's iomgr handlers off. What
keeps a fork from ever entering the event engine's is that nothing forks: the test
services start with setpriv --pdeathsig (subprocess's vfork path), the launcher with
posix_spawn. Each check counts the C library's fork handlers run in a child interpreter
that has a gRPC channel connecting on another thread: it must stay 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.commands import millwright_env

# A C-level fork handler of our own (glibc's __register_atfork: pthread_atfork lives in
# libc_nonshared) counts the fork() calls, the way gRPC's own handlers would see them.
PRELUDE = r"""
import ctypes, os, subprocess, sys, threading, time
import agent.coordination.etcd   # the agent's way in to gRPC
import grpc

forks = [0]
def _prepare():
    forks[0] += 1
_handler = ctypes.CFUNCTYPE(None)(_prepare)
assert ctypes.CDLL(None).__register_atfork(_handler, None, None, None) == 0

print("setting", os.environ.get("GRPC_ENABLE_FORK_SUPPORT"))
ch = grpc.insecure_channel("127.0.0.1:9")
stop = time.monotonic() + 1.5

def connect():
    while time.monotonic() < stop:
        try:
            grpc.channel_ready_future(ch).result(timeout=0.05)
        except grpc.FutureTimeoutError:
            pass

busy = threading.Thread(target=connect)
busy.start()
"""

# the test services' way to start etcd, brokers and agents (agent/demo/services.py)
SERVICES = PRELUDE + r"""
from agent.demo import services

class TrueService(services._Child):
    name = "true"
    def _argv(self):
        return ["/bin/true"]

rcs = []
for _ in range(20):
    svc = TrueService()
    svc.spawn()
    rcs.append(svc.proc.wait())
    svc.logf.close()
busy.join()
print("spawned", len(rcs), "failed", sum(1 for rc in rcs if rc), "forks", forks[0])
"""

# the launcher's way to start a run (agent/execute/pspawn.py)
LAUNCHER = PRELUDE + r"""
from agent.execute import pspawn

rcs = []
for _ in range(20):
    pid = pspawn.spawn(["/bin/true"], {}, None, 0, 1, 2)
    rcs.append(os.waitpid(pid, 0)[1])
busy.join()
print("spawned", len(rcs), "failed", sum(1 for rc in rcs if rc), "forks", forks[0])
"""


def _run(script: str, env_value: str | None = None) -> subprocess.CompletedProcess:
    # without this process's own setting (importing the agent made it)
    env = {k: v for k, v in millwright_env().items() if not k.startswith("GRPC_")}
    env["GRPC_VERBOSITY"] = "debug"
    if env_value is not None:
        env["GRPC_ENABLE_FORK_SUPPORT"] = env_value
    # a hang guard only: under qemu the whole script takes a few seconds
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


def test_the_test_services_start_beside_grpc_without_a_fork():
    res = _run(SERVICES)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "setting 0" in res.stdout                       # importing the agent set it
    assert "spawned 20 failed 0 forks 0" in res.stdout, res.stdout
    assert "fork_posix" not in res.stderr                  # gRPC's iomgr handlers never ran


def test_the_launcher_starts_beside_grpc_without_a_fork():
    from agent.execute import pspawn
    if not pspawn.available():
        pytest.fail("posix_spawn is not usable here (glibc >= 2.34 needed): the launcher would fork")
    res = _run(LAUNCHER)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "spawned 20 failed 0 forks 0" in res.stdout, res.stdout


def test_an_operator_setting_is_kept():
    # "false" (not "1"): with gRPC's handlers on, a fork beside a busy channel may hang
    res = _run(SERVICES, "false")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "setting false" in res.stdout
    assert "spawned 20 failed 0 forks 0" in res.stdout, res.stdout


PARENT = r"""
from agent.demo import services

class Sleeper(services._Child):
    name = "sleeper"
    def _argv(self):
        return ["sleep", "120"]

svc = Sleeper()
svc.spawn()
print(svc.proc.pid, flush=True)
svc.proc.wait()
"""


def test_a_service_dies_with_the_process_that_started_it():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], env=millwright_env(), stdout=subprocess.PIPE,
                              text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 30                     # hang guards, not figures
        while time.monotonic() < deadline and _programs(child) != {b"sleep"}:
            time.sleep(0.01)
        assert _programs(child) == {b"sleep"}                # setpriv exec'd the service itself
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.05)
        assert not _alive(child), "the service outlived the process that started it"
    finally:
        if parent.poll() is None:
            parent.kill()


def _programs(pid: int) -> set[bytes]:
    """Which of setpriv and sleep the process's command line names (under qemu-user its
    first word is the emulator's)."""
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return {os.path.basename(w) for w in fh.read().split(b"\0")} & {b"setpriv", b"sleep"}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
