"""The armed launcher's protocol, shell by shell (agent/execute/armed.py): each script run
directly with a go pipe, as spawn() starts it, without an executor. bash and lksh are the
executor's candidates; mksh runs lksh's script with 32-bit arithmetic (lksh's on 32-bit
arches). A shell that is not installed fails under MILLWRIGHT_REQUIRE_KERNEL=1.
"""

from __future__ import annotations

import math
import os
import subprocess
import time

import pytest

from agent.execute.launch import DEFAULT_PATH
from tests.support.kernel import armed_launcher

SHELLS = ["bash", "lksh", "mksh"]
CLEAN_ENV = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", "HOME": "/tmp", "TMPDIR": "/tmp", "USER": "root",
             "LOGNAME": "root", "MILLWRIGHT_JOB_ID": "j1", "MILLWRIGHT_FIRE_ID": "f1", "MILLWRIGHT_RUN_ID": "f1.1",
             "MILLWRIGHT_ATTEMPT": "1"}


class Launcher:
    """One armed launcher: its go pipe's writer, the process, and the file its job (a
    clock, unless given) writes when it runs. ``before``: on the pipe before it starts;
    ``eof``: the pipe closed then too."""

    def __init__(self, name: str, tmp_path, due: float, job=None, env=None, before: bytes = b"", eof: bool = False):
        shell, script = armed_launcher(name)
        self.marker = str(tmp_path / f"ran-{name}-{due}")
        job = job or ["/bin/sh", "-c", 'date +%s.%N > "$0"', self.marker]
        r, self.w = os.pipe()
        if before:
            os.write(self.w, before)
        if eof:
            self.close()
        self.proc = subprocess.Popen([shell, "-c", script, "millwright-run", str(int(due * 1e6))] + job,
                                     stdin=r, stdout=subprocess.PIPE, env=env or CLEAN_ENV, cwd="/tmp",
                                     start_new_session=True)
        os.close(r)

    def send(self, data: bytes) -> None:
        os.write(self.w, data)

    def close(self) -> None:
        if self.w >= 0:
            os.close(self.w)
            self.w = -1

    def wait(self, timeout: float = 10.0) -> tuple[int, float, bytes]:
        """(exit status, when it ended, its stdout)."""
        out, _ = self.proc.communicate(timeout=timeout)
        ended = time.time()
        self.close()
        return self.proc.returncode, ended, out

    def ran_at(self):
        return float(open(self.marker).read()) if os.path.exists(self.marker) else None


@pytest.mark.parametrize("shell", SHELLS)
def test_a_g_releases_it_before_its_due_time(shell, tmp_path):
    launcher = Launcher(shell, tmp_path, time.time() + 5)
    launcher.send(b"a\n")
    time.sleep(0.2)
    sent = time.time()
    launcher.send(b"g\n")
    rc, ended, _ = launcher.wait()
    assert rc == 0 and sent <= launcher.ran_at() < sent + 0.5


@pytest.mark.parametrize("shell", SHELLS)
def test_eof_before_its_due_time_ends_it_at_once_without_exec(shell, tmp_path):
    launcher = Launcher(shell, tmp_path, time.time() + 5)
    launcher.send(b"a\n")
    time.sleep(0.2)
    closed = time.time()
    launcher.close()
    rc, ended, _ = launcher.wait()
    assert rc == 126 and ended < closed + 0.5 and launcher.ran_at() is None


@pytest.mark.parametrize("shell", SHELLS)
def test_eof_before_the_arming_ends_it_without_exec(shell, tmp_path):
    launcher = Launcher(shell, tmp_path, time.time() + 5)
    launcher.close()
    rc, _, _ = launcher.wait()
    assert rc == 126 and launcher.ran_at() is None


@pytest.mark.parametrize("shell", SHELLS)
def test_a_late_launcher_sees_what_is_already_on_its_pipe(shell, tmp_path):
    """A launcher that reads its "a" after its due time still looks at the pipe: an EOF
    there (discarded, or the agent died) means no exec, a "g" or nothing means exec now.
    20 rounds: a check that only sometimes looks (mksh's read -t 0 looks only when its
    two clock reads fall in the same microsecond) fails here."""
    for i in range(20):
        t0 = time.time()
        due = t0 - 0.001 * (i + 1)
        discarded = Launcher(shell, tmp_path, due, before=b"a\n", eof=True)
        released = Launcher(shell, tmp_path, due - 1e-6, before=b"a\ng\n", eof=True)
        waiting = Launcher(shell, tmp_path, due - 2e-6, before=b"a\n")
        assert discarded.wait()[0] == 126 and discarded.ran_at() is None, f"round {i}"
        assert released.wait()[0] == 0 and released.ran_at() is not None, f"round {i}"
        rc, ended, _ = waiting.wait()
        assert rc == 0 and waiting.ran_at() < t0 + 0.5, f"round {i}"


def _at_fraction(lo: float, hi: float) -> float:
    """Wait until the wall clock's fraction of a second is in [lo, hi); the time then."""
    while True:
        now = time.time()
        frac = now - math.floor(now)
        if lo <= frac < hi:
            return now
        time.sleep(max(0.0, (lo - frac) % 1.0) or 0.001)


@pytest.mark.parametrize("shell", SHELLS)
def test_its_timer_releases_it_at_its_due_time(shell, tmp_path):
    """The due time's microseconds below the clock's (a borrow from the seconds) and a
    wait whose microseconds need zero padding (0.09 s, 1.04 s): each job runs at its due
    time, not 0.9 s later or never."""
    now = _at_fraction(0.90, 0.92)
    base = math.floor(now)
    dues = [base + 1.01, base + 1.95]   # 0.09 s left (borrow, padding), 1.04 s left (padding)
    launchers = [Launcher(shell, tmp_path, due) for due in dues]
    for launcher in launchers:
        launcher.send(b"a\n")
    for due, launcher in zip(dues, launchers):
        rc, _, _ = launcher.wait()
        ran_at = launcher.ran_at()
        assert rc == 0 and ran_at is not None and due <= ran_at < due + 0.15, (due, ran_at)


@pytest.mark.parametrize("shell", SHELLS)
def test_the_job_gets_exactly_the_clean_environment(shell, tmp_path):
    """Nothing of the shell ("_", SHLVL, PWD, KSH_VERSION) or of the script's own
    variables reaches the job; variables named like the script's reach it as given."""
    env = dict(CLEAN_ENV, **{k: f"job's {k}" for k in ("m", "d", "t", "r", "n", "s", "u", "nx", "w")})
    for release in (b"a\ng\n", b"a\n"):   # released early, and by its timer
        launcher = Launcher(shell, tmp_path, time.time() + 0.3, job=["/usr/bin/env", "-0"], env=env)
        launcher.send(release)
        rc, _, out = launcher.wait()
        got = dict(item.split("=", 1) for item in out.decode().split("\0") if item)
        assert rc == 0 and got == env
