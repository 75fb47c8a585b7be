"""The Debian package: build + lintian, install in a clean Debian 12 root, upgrade N -> N+1,
and the same install (plus tests/unit) in an arm64 root under qemu-user-static.

Each test runs one of the packaging/*.sh scripts, which do the real work (debootstrap,
chroot, apt) and print their durations; this wrapper only makes `make test` cover them.
A missing prerequisite (not root, tools not installed, no binfmt_misc) skips locally and
FAILS under MILLWRIGHT_REQUIRE_KERNEL=1 (CI), through tests.support.kernel.require_kernel.

They are marked `slow`: `pytest -m "not slow"` leaves them out of a quick local run. The arm64
test starts with the session when it is selected and runs beside the other tests
(tests/support/arm64.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.support import arm64
from tests.support.kernel import require_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "packaging")

pytestmark = pytest.mark.slow

BUILD_TOOLS = ["dpkg-buildpackage", "dh", "dh_python3", "help2man", "lintian", "fakeroot"]
ROOT_TOOLS = ["debootstrap", "unshare", "chroot", "flock", "systemd-analyze"]


def _missing(tools: list[str]) -> list[str]:
    return [t for t in tools if shutil.which(t) is None]


def _require(tools: list[str], root: bool = False) -> None:
    missing = _missing(tools)
    require_kernel(not missing, f"missing tools {missing} (bash scripts/setup-host.sh installs them)")
    if root:
        require_kernel(os.geteuid() == 0, "packaging tests need root (debootstrap, chroot, mounts)")


def _run(args: list[str], timeout: float, env: dict | None = None) -> str:
    """Run a packaging script; on failure the assertion carries its output's tail."""
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )
    took = time.monotonic() - t0
    out = proc.stdout
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode} after {took:.0f}s:\n{out[-6000:]}"
    # The scripts' timing lines, visible with -rP / -s.
    sys.stdout.write("".join(l + "\n" for l in out.splitlines() if "PASS" in l or "built " in l))
    return out




@pytest.fixture(scope="module")
def deb(tmp_path_factory):
    """The package built from the current tree, linted (errors and warnings fail)."""
    _require(BUILD_TOOLS)
    out_dir = str(tmp_path_factory.mktemp("deb-out"))
    out = _run([os.path.join(PKG, "build.sh"), "--out", out_dir], timeout=600)
    path = out.strip().splitlines()[-1]
    assert path.endswith("_all.deb") and os.path.isfile(path), out
    return path


def test_build_is_lintian_clean_and_complete(deb):
    listing = subprocess.run(["dpkg-deb", "-c", deb], check=True, stdout=subprocess.PIPE, text=True).stdout
    # Every module of the agent tree at build time is in the package.
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "agent")):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in filenames:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)
                assert f"./usr/lib/millwright/{rel}" in listing, f"{rel} missing from the package"
    for path in ("./usr/bin/millwright", "./etc/millwright/agent.yaml",
                 "./lib/systemd/system/millwright.service", "./usr/share/man/man1/millwright.1.gz"):
        assert path in listing
    assert "dist-packages" not in listing
    fields = subprocess.run(["dpkg-deb", "-f", deb, "Architecture", "Depends"], check=True,
                            stdout=subprocess.PIPE, text=True).stdout
    assert "Architecture: all" in fields
    for dep in ("python3-etcd3", "python3-paho-mqtt", "python3-psutil", "python3-prometheus-client",
                "python3-yaml", "python3-croniter"):
        assert dep in fields


def test_install_in_clean_debian12_root(deb):
    _require(ROOT_TOOLS, root=True)
    _run([os.path.join(PKG, "test-install.sh"), "--deb", deb], timeout=1200)


def test_upgrade_keeps_config_and_state_and_restarts(deb):
    _require(ROOT_TOOLS + BUILD_TOOLS, root=True)
    _run([os.path.join(PKG, "test-upgrade.sh"), "--deb", deb], timeout=1200)


def test_arm64_install_and_unit_tests_under_qemu():
    """The arm64 tier: started with the session (tests/support/arm64.py), waited for here."""
    _require(ROOT_TOOLS + BUILD_TOOLS + ["update-binfmts"], root=True)
    require_kernel(os.path.exists("/usr/libexec/qemu-binfmt/aarch64-binfmt-P")
                   or shutil.which("qemu-aarch64-static") is not None,
                   "qemu-user-static is not installed (bash scripts/setup-host.sh)")
    require_kernel(os.path.exists("/proc/sys/fs/binfmt_misc"), "kernel without binfmt_misc")
    run = arm64.current() or arm64.start()
    rc, out, took = run.wait(timeout=2400)
    # the scripts' timing lines, visible with -rP / -s
    sys.stdout.write("".join(line + "\n" for line in out.splitlines() if "PASS" in line or "built " in line))
    assert rc == 0, f"test-arm64.sh exited {rc} after {took:.0f}s:\n{out[-6000:]}"
