"""Fixtures shared by the kernel tests: a throwaway job user and a run directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

from tests.support.kernel import require_kernel


@pytest.fixture(scope="module")
def job_user():
    """A temporary unprivileged system user (removed afterwards)."""
    require_kernel(os.geteuid() == 0 and shutil.which("useradd") is not None, "needs root and useradd")
    name = f"mw-test-{os.getpid() % 100000}"
    subprocess.run(["userdel", name], capture_output=True)
    subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
                    "--shell", "/usr/sbin/nologin", name], check=True, capture_output=True)
    yield name
    subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
    subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def base_dir():
    d = tempfile.mkdtemp(prefix="mw-exec-", dir="/tmp")
    os.chmod(d, 0o711)   # the job user must be able to reach its work dir
    yield d
    shutil.rmtree(d, ignore_errors=True)
