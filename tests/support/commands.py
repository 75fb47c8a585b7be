"""Running the `millwright` command under test from a test, as an operator would: the
``agent`` package the tests import (a checkout, or /usr/lib/millwright when the package
tests run tests/unit against an installed .deb)."""

from __future__ import annotations

import os
import subprocess
import sys

from agent.demo.services import REPO_ROOT


def millwright_env() -> dict:
    """The environment of a `millwright` child: the agent under test first on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def millwright(*args: str, timeout: float = 60, cwd: str = REPO_ROOT) -> subprocess.CompletedProcess:
    """``millwright ARGS`` (``python -m agent``) run in ``cwd`` (where the agent under test
    lives unless given), its output as text."""
    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True, text=True, cwd=cwd,
                          env=millwright_env(), timeout=timeout)
