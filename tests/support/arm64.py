"""The arm64 tier beside the rest of `make test` (issue 55).

The arm64 test (the package installed in an arm64 Debian 12 root under qemu-user, then
tests/unit there) is mostly emulated CPU: about 5 minutes cached, 13 from scratch. Run
after the suite it would push `make test` past its 25 minutes, so when it is selected the
session starts it at once, niced, in its own process group (packaging/test-arm64.sh on a
.deb built from the tree), and the test itself waits for that run's result and asserts
on it. The run is the same script, with the same checks, as when started in the test.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "packaging")
TEST_ID = "tests/packaging/test_packaging.py::test_arm64_install_and_unit_tests_under_qemu"

# the shell of the background run: build the .deb, then the arm64 test on it
SCRIPT = r"""
set -euo pipefail
out=$1
deb=$(bash "$2/build.sh" --out "$out" | tail -n 1)
case "$deb" in *_all.deb) ;; *) echo "build.sh gave no package: $deb" >&2; exit 1 ;; esac
exec bash "$2/test-arm64.sh" --deb "$deb"
"""


@dataclass
class BackgroundRun:
    proc: subprocess.Popen
    log_path: str
    out_dir: str
    started: float

    def wait(self, timeout: float) -> tuple[int, str, float]:
        """(exit code, output, seconds since start); the run is killed on timeout (-9)."""
        try:
            rc = self.proc.wait(timeout=max(1.0, timeout - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            stop(self)
            rc = -9
        with open(self.log_path, errors="replace") as fh:
            return rc, fh.read(), time.monotonic() - self.started


_run: Optional[BackgroundRun] = None


def selected(nodeids: list[str]) -> bool:
    return any(n == TEST_ID or n.endswith("::test_arm64_install_and_unit_tests_under_qemu") for n in nodeids)


def can_run() -> bool:
    """Root and the tools the script needs (the test itself says which are missing)."""
    tools = ["debootstrap", "unshare", "chroot", "flock", "update-binfmts", "dpkg-buildpackage", "lintian"]
    return os.geteuid() == 0 and all(shutil.which(t) for t in tools)


def start() -> BackgroundRun:
    """Start the arm64 run once per session (niced: the rest of the suite goes first)."""
    global _run
    if _run is None:
        out_dir = tempfile.mkdtemp(prefix="mw-arm64-")
        log_path = os.path.join(out_dir, "arm64.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(["nice", "-n", "10", "bash", "-c", SCRIPT, "arm64", os.path.join(out_dir, "deb"),
                                     PKG], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        _run = BackgroundRun(proc, log_path, out_dir, time.monotonic())
    return _run


def current() -> Optional[BackgroundRun]:
    return _run


def stop(run: BackgroundRun) -> None:
    if run.proc.poll() is None:
        try:
            os.killpg(run.proc.pid, signal.SIGTERM)
            run.proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(run.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            run.proc.wait()


def finish() -> None:
    """At the session's end: a run nobody waited for (its test deselected by -x, say) is
    stopped, and its build directory removed."""
    global _run
    if _run is not None:
        stop(_run)
        shutil.rmtree(_run.out_dir, ignore_errors=True)
        _run = None
