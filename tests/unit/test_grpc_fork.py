"""gRPC's fork handlers are off in every process that imports the agent (agent/__init__.py).

With them on, a fork() of a process that has used gRPC waits for gRPC's threads to stop;
one that waits for the GIL the forking thread holds never does, and the fork hangs for
good (seen in the chaos test: an etcd member's restart, a Popen with preexec_fn, stuck in
gRPC's prefork handler for 20 minutes)."""

from __future__ import annotations

import subprocess
import sys

from tests.support.commands import millwright_env

# forks (Popen with preexec_fn: a real fork, not vfork) while another thread is inside
# gRPC, connecting a channel to a port nobody listens on
SCRIPT = r"""
import os, subprocess, sys, threading, time
import agent.coordination.etcd   # the agent's way in to gRPC
import grpc

print("setting", os.environ.get("GRPC_ENABLE_FORK_SUPPORT"))
ch = grpc.insecure_channel("127.0.0.1:9")
stop = time.monotonic() + 1.5

def connect():
    while time.monotonic() < stop:
        try:
            grpc.channel_ready_future(ch).result(timeout=0.05)
        except grpc.FutureTimeoutError:
            pass

t = threading.Thread(target=connect)
t.start()
rcs = [subprocess.Popen(["/bin/true"], preexec_fn=lambda: None).wait() for _ in range(20)]
t.join()
print("forks", len(rcs), "failed", sum(1 for rc in rcs if rc))
"""


def _run(env_value: str | None) -> subprocess.CompletedProcess:
    # without this process's own setting (importing the agent made it)
    env = {k: v for k, v in millwright_env().items() if not k.startswith("GRPC_")}
    env["GRPC_VERBOSITY"] = "debug"
    if env_value is not None:
        env["GRPC_ENABLE_FORK_SUPPORT"] = env_value
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60)


def test_importing_the_agent_turns_grpc_fork_handlers_off_and_forks_beside_grpc_never_enter_them():
    res = _run(None)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "setting 0" in res.stdout
    assert "forks 20 failed 0" in res.stdout
    # with the handlers on, forks beside a busy channel log fork_posix.cc lines at debug
    # verbosity (the prefork handler skipping itself): seen on every run without the setting
    assert "fork_posix" not in res.stderr


def test_an_operator_setting_is_kept():
    # "false" (not "1"): a fork with the handlers on is what may hang
    res = _run("false")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "setting false" in res.stdout
    assert "fork_posix" not in res.stderr
