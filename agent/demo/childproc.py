"""Child processes of the demo and the test fixtures that die with the process that
started them, started without a fork() (etcd, brokers, agents: agent/demo/services.py)."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

# SIGKILL the child when the thread that started it dies, so a test run that is itself
# killed never leaves etcd, brokers or agents behind. setpriv (util-linux, essential on
# Debian and Ubuntu) sets it after the exec, so the Popen needs no preexec_fn: without
# one, subprocess takes its vfork path and never calls fork(). A fork() of a process that
# has used gRPC runs gRPC's event-engine fork handlers whatever GRPC_ENABLE_FORK_SUPPORT
# says (python3-grpcio 1.51): they wait for its pool threads in the parent and start new
# ones in the child, which can hang (seen for good under qemu-user on arm64).
DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "KILL", "--"]


def spawn_dying_with_parent(argv: list[str], **popen: Any) -> subprocess.Popen:
    """``subprocess.Popen(argv, **popen)`` in a new session, killed when its starter dies,
    started without a fork() (see DIE_WITH_PARENT)."""
    if "preexec_fn" in popen:
        raise ValueError("spawn_dying_with_parent never forks: no preexec_fn")
    if shutil.which(DIE_WITH_PARENT[0]) is None:
        raise RuntimeError("setpriv not found (util-linux): run `make setup` (scripts/setup-host.sh) as root")
    return subprocess.Popen([*DIE_WITH_PARENT, *argv], start_new_session=True, **popen)
