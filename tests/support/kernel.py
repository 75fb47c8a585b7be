"""What kernel tests need from the machine, and how they refuse to pass without it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REQUIRE_KERNEL = os.environ.get("MILLWRIGHT_REQUIRE_KERNEL") == "1"


def require_kernel(ok: bool, why: str) -> None:
    """Skip a kernel test when the machine cannot run it, but fail under CI's
    MILLWRIGHT_REQUIRE_KERNEL=1: a skipped kernel test is never a pass there."""
    if ok:
        return
    if REQUIRE_KERNEL:
        pytest.fail(f"kernel requirement missing (MILLWRIGHT_REQUIRE_KERNEL=1): {why}")
    pytest.skip(why)


def bpf_ok() -> tuple[bool, str]:
    """Whether `millwright bpf check` passes here (root, headers, tracefs, BCC)."""
    if os.geteuid() != 0:
        return False, "needs root"
    r = subprocess.run([sys.executable, "-m", "agent", "bpf", "check"], capture_output=True, text=True)
    return r.returncode == 0, (r.stdout + r.stderr)[-500:]
