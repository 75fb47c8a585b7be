"""`millwright bpf check` against the real machine (acceptance 5)."""

from __future__ import annotations

import json
import os

from tests.support.commands import millwright
from tests.support.kernel import require_kernel

from agent.signals import check


def _run(*args):
    return millwright("bpf", "check", *args)


def test_check_names_missing_headers_with_empty_dir(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _run("--headers-dir", str(empty))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "MISSING kernel headers" in r.stdout
    assert f"{empty}/build/include/generated/autoconf.h" in r.stdout
    assert "linux-headers-$(uname -r)" in r.stdout and "nvidia-l4t-kernel-headers" in r.stdout
    doc = json.loads(_run("--headers-dir", str(empty), "--json").stdout)
    assert not doc["ok"]
    (hdr,) = [i for i in doc["items"] if i["name"] == "kernel headers"]
    assert not hdr["ok"] and any("autoconf.h" in m for m in hdr["missing"])
    assert set(hdr["fix"]) == {"debian", "ubuntu", "jetson"}


def test_check_passes_on_this_host_and_lists_every_tracepoint():
    require_kernel(os.geteuid() == 0 and check.preflight() is None, f"host not ready: {check.preflight()}")
    r = _run("--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["ok"], r.stdout
    names = {i["name"] for i in doc["items"]}
    for tp in ("sched:sched_process_exec", "sched:sched_process_fork", "sched:sched_process_exit",
               "syscalls:sys_enter_execve", "tcp:tcp_retransmit_skb", "tcp:tcp_receive_reset",
               "tcp:tcp_send_reset", "sock:inet_sock_set_state"):
        assert f"tracepoint {tp}" in names
    assert any(i["name"] == "bcc" and "BCC 0." in i["detail"] for i in doc["items"])


def test_check_with_wrong_tracefs_names_it(tmp_path):
    r = _run("--tracefs", str(tmp_path))
    assert r.returncode == 1
    assert f"no tracefs events/ under {tmp_path}" in r.stdout
