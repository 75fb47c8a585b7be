"""agent/execute/pspawn.py: the launcher's child is the one subprocess.Popen made (fds,
working directory, session, signals), and a failed chdir or exec is the call's error."""

from __future__ import annotations

import os
import signal

import pytest

from agent.execute import pspawn
from tests.support.kernel import require_kernel



@pytest.fixture(autouse=True)
def _posix_spawn_closefrom():
    require_kernel(pspawn.available(), "glibc without posix_spawn_file_actions_addclosefrom_np (needs glibc 2.34)")


def _run(argv: list[str], cwd: str) -> tuple[str, int]:
    r, w = os.pipe()
    try:
        pid = pspawn.spawn(argv, {"PATH": "/usr/bin:/bin", "ONLY": "this"}, cwd, r, w, w)
    finally:
        os.close(w)
    out = b""
    while chunk := os.read(r, 65536):
        out += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return out.decode(), pid


def test_the_child_gets_its_pipes_cwd_env_and_session_and_nothing_else(tmp_path):
    # an inheritable fd of the agent's must not reach a job (a free number: a fixed one may
    # be another thread's, or EBUSY while that thread opens it)
    leak = os.open("/dev/null", os.O_RDONLY)
    os.set_inheritable(leak, True)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    old_pipe = signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        # the fds are listed last, by `ls` in the shell's own process (exec): while a pipeline
        # starts, the shell holds the next pipe's fds (listing /proc/$$/fd then raced it)
        out, pid = _run(["/bin/sh", "-c", 'pwd; env | sort | tr "\\n" " "; echo; cut -d" " -f6 /proc/$$/stat; '
                         'exec ls /proc/self/fd'], str(tmp_path))
        # the signal state as exec left it (a shell would set its own mask)
        status, _ = _run(["/bin/cat", "/proc/self/status"], str(tmp_path))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        signal.signal(signal.SIGPIPE, old_pipe)
        os.close(leak)
    cwd, env, session, *fds = out.splitlines()
    sig = dict(line.split(":\t", 1) for line in status.splitlines() if line.startswith("Sig"))
    assert cwd == str(tmp_path)
    assert sorted(fds, key=int) == ["0", "1", "2", "3"]   # 3: the directory `ls` reads
    assert "ONLY=this" in env.split() and "PATH=/usr/bin:/bin" in env.split()
    assert int(sig["SigBlk"], 16) == 0   # the spawning thread's mask is not inherited
    assert not int(sig["SigIgn"], 16) & (1 << (signal.SIGPIPE - 1))   # SIGPIPE back to default
    assert int(session) == pid   # a session (and process group) of its own


def _fails(error: type, argv: list[str], cwd: str) -> None:
    """The spawn fails with ``error``, or, where the C library's CLONE_VFORK child is run as
    a plain fork (qemu-user, the arm64 package test), the child exits 127 (glibc's spawn
    error status): either way the failure reaches the agent."""
    try:
        pid = pspawn.spawn(argv, {}, cwd, 0, 1, 2)
    except error:
        return
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 127, status


def test_a_failed_exec_or_chdir_is_the_calls_error(tmp_path):
    _fails(FileNotFoundError, [str(tmp_path / "no-such-launcher")], str(tmp_path))
    _fails(FileNotFoundError, ["/bin/true"], str(tmp_path / "no-such-dir"))
    os.chmod(tmp_path, 0o755)
    plain = tmp_path / "not-executable"
    plain.write_text("#!/bin/sh\n")
    _fails(PermissionError, [str(plain)], str(tmp_path))
