"""What kernel tests need from the machine, and how they refuse to pass without it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from typing import Iterator

import pytest

from agent.execute import armed
from tests.support.commands import millwright

REQUIRE_KERNEL = os.environ.get("MILLWRIGHT_REQUIRE_KERNEL") == "1"
# What the CI host is known not to have, by name (README, testing: "what this host cannot
# test"); .ci/run declares them. Only a named, declared limit may skip under CI.
HOST_LIMITS = {x for x in os.environ.get("MILLWRIGHT_HOST_LIMITS", "").split(",") if x}


def require_kernel(ok: bool, why: str, limit: str | None = None) -> None:
    """Skip a kernel test when the machine cannot run it, but fail under CI's
    MILLWRIGHT_REQUIRE_KERNEL=1: a skipped kernel test is never a pass there, unless the
    missing piece is a ``limit`` the host declared in MILLWRIGHT_HOST_LIMITS."""
    if ok:
        return
    if REQUIRE_KERNEL and limit not in HOST_LIMITS:
        pytest.fail(f"kernel requirement missing (MILLWRIGHT_REQUIRE_KERNEL=1): {why}")
    pytest.skip(why + (f" (declared host limit {limit!r}, see README testing)" if limit in HOST_LIMITS else ""))


def bpf_ok() -> tuple[bool, str]:
    """Whether `millwright bpf check` passes here (root, headers, tracefs, BCC)."""
    if os.geteuid() != 0:
        return False, "needs root"
    r = millwright("bpf", "check", timeout=120)
    return r.returncode == 0, (r.stdout + r.stderr)[-500:]


# The armed launchers under test (agent/execute/armed.py): the executor's candidates, and
# mksh running lksh's script with 32-bit arithmetic, which is what lksh has on 32-bit arches.
ARMED_LAUNCHERS = {"bash": armed.BASH, "lksh": armed.LKSH, "mksh": ("/bin/mksh", armed.KSH_SCRIPT)}


def armed_launcher(name: str) -> tuple[str, str]:
    """(shell, script) of an armed launcher; a shell that is not installed skips the test,
    or fails it under MILLWRIGHT_REQUIRE_KERNEL=1 (scripts/setup-host.sh installs mksh)."""
    shell, script = ARMED_LAUNCHERS[name]
    require_kernel(os.access(shell, os.X_OK), f"{shell} is not installed (apt-get install mksh)")
    return shell, script


@contextlib.contextmanager
def own_tmpfs(size: str, mode: str, prefix: str) -> Iterator[str]:
    """A tmpfs of its own (needs root), unmounted afterwards with whatever is left on it."""
    require_kernel(os.geteuid() == 0, "mounting a tmpfs needs root")
    path = tempfile.mkdtemp(prefix=prefix)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode={mode}", "tmpfs", path], check=True)
    try:
        yield path
    finally:
        if subprocess.run(["umount", path]).returncode != 0:
            subprocess.run(["umount", "-l", path], check=True)
        os.rmdir(path)
