"""The cgroup v2 backend and the rlimit backend.

cgroup v2: this dev machine is a v1 hybrid whose cgroup2 mount (/sys/fs/cgroup/unified)
has no memory/cpu/pids controllers, so the v2 backend runs its real code paths against a
temporary directory tree that mimics cgroupfs semantics (controller delegation, the
"no internal processes" EBUSY rule, cgroup.procs moves), with real job processes. A real
cgroup2 test runs where the machine has a usable hierarchy and is skipped here.

rlimit: real processes under RLIMIT_* and the RSS/pids poll, as an unprivileged user.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import tempfile

import pytest

from agent.execute import Executor, Limits, RunSpec, probe
from agent.execute.backends import BackendUnavailable, Cgroup2Backend, CgroupFS, RlimitBackend, safe_name
from agent.execute.processes import alive
from tests.support.kernel import require_kernel
from tests.support.processes import PY, Collector, zombies_left, stderr_tail

CONTROLLERS = "cpu io memory pids"


class TreeFS(CgroupFS):
    """cgroupfs semantics on a plain directory (enough for the backend's code paths)."""

    def __init__(self, mount: str, overrides: dict | None = None):
        self.mount = mount
        self.overrides = overrides or {}   # run-name prefix -> {file: content}
        self.writes: list[tuple[str, str]] = []

    def populate(self, path: str, controllers: str = "") -> None:
        files = {"cgroup.procs": "", "cgroup.controllers": controllers, "cgroup.subtree_control": "",
                 "cgroup.kill": "", "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
                 "cpu.stat": "usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\nthrottled_usec 250000\n",
                 "memory.peak": "12345678\n", "memory.current": "4096\n", "pids.events": "max 0\n",
                 "memory.swap.max": "max\n", "memory.max": "max\n", "memory.oom.group": "0\n",
                 "cpu.max": "max 100000\n", "cpu.weight": "100\n", "pids.max": "max\n"}
        for prefix, extra in self.overrides.items():
            if os.path.basename(path).startswith(prefix):
                files.update(extra)
        for name, content in files.items():
            with open(os.path.join(path, name), "w") as fh:
                fh.write(content)

    def mkdir(self, path: str) -> None:
        if os.path.isdir(path):
            return
        os.mkdir(path)
        parent = self.read(os.path.join(os.path.dirname(path), "cgroup.subtree_control"))
        self.populate(path, parent)

    def rmdir(self, path: str) -> None:
        if [p for p in self.read(os.path.join(path, "cgroup.procs")).split() if alive(int(p))]:
            raise OSError(errno.EBUSY, "Device or resource busy")
        shutil.rmtree(path)

    def write(self, path: str, data: str) -> None:
        self.writes.append((os.path.relpath(path, self.mount), data))
        d, name = os.path.split(path)
        if name == "cgroup.procs":
            for root, _dirs, _files in os.walk(self.mount):   # a move: out of every other cgroup
                f = os.path.join(root, "cgroup.procs")
                pids = [p for p in open(f).read().split() if p != data.strip()]
                open(f, "w").write("\n".join(pids))
            open(path, "a").write(data.strip() + "\n")
            return
        if name == "cgroup.subtree_control":
            have = set(self.read(os.path.join(d, "cgroup.controllers")).split())
            enabled = set(self.read(path).split())
            for tok in data.split():
                c = tok[1:]
                if c not in have:
                    raise OSError(errno.ENOENT, "No such file or directory")
                enabled.add(c) if tok[0] == "+" else enabled.discard(c)
            if enabled and d != self.mount and self.read(os.path.join(d, "cgroup.procs")).split():
                raise OSError(errno.EBUSY, "Device or resource busy")   # no internal processes
            open(path, "w").write(" ".join(sorted(enabled)))
            return
        if not os.path.exists(path):
            raise OSError(errno.EACCES, "Permission denied")   # cgroupfs: no new files
        open(path, "w").write(data)


@pytest.fixture
def tree():
    mount = tempfile.mkdtemp(prefix="mw-cg2-")
    fs = TreeFS(mount)
    fs.populate(mount, CONTROLLERS)
    with open(os.path.join(mount, "cgroup.subtree_control"), "w") as fh:
        fh.write(CONTROLLERS)
    svc = os.path.join(mount, "system.slice", "millwright.service")
    os.makedirs(svc)
    fs.populate(os.path.dirname(svc), CONTROLLERS)
    fs.populate(svc, CONTROLLERS)
    with open(os.path.join(svc, "cgroup.procs"), "w") as fh:
        fh.write(f"{os.getpid()}\n")
    yield mount, fs
    shutil.rmtree(mount, ignore_errors=True)


def _v2(mount, fs) -> Cgroup2Backend:
    b = Cgroup2Backend(mount=mount, self_path="/system.slice/millwright.service", root_name="mw-test", fs=fs)
    b.setup()
    return b


# --------------------------------------------------------------------------- cgroup v2 on a tree


def test_cgroup2_setup_moves_the_agent_to_a_leaf_then_enables_controllers(tree):
    mount, fs = tree
    svc = os.path.join(mount, "system.slice", "millwright.service")
    # enabling controllers with the agent still inside fails like the kernel does
    with pytest.raises(OSError) as exc:
        fs.write(os.path.join(svc, "cgroup.subtree_control"), "+memory")
    assert exc.value.errno == errno.EBUSY
    b = _v2(mount, fs)
    assert open(os.path.join(svc, "cgroup.procs")).read().split() == []
    assert open(os.path.join(svc, "mw-test.agent", "cgroup.procs")).read().split() == [str(os.getpid())]
    assert set(open(os.path.join(svc, "cgroup.subtree_control")).read().split()) >= {"memory", "cpu", "pids"}
    assert set(open(os.path.join(svc, "mw-test", "cgroup.subtree_control")).read().split()) == {"memory", "cpu", "pids"}
    assert b.name == "cgroup2" and "mw-test" in b.why
    assert open(os.path.join(svc, "mw-test", "cpu.weight")).read() == "100"   # runs_weight 1: one process


@pytest.mark.parametrize("runs_weight,weight", [(4, "400"), (500, "10000")])
def test_cgroup2_runs_root_weighs_runs_weight_processes(tree, runs_weight, weight):
    mount, fs = tree
    b = Cgroup2Backend(mount=mount, self_path="/system.slice/millwright.service", root_name="mw-test", fs=fs,
                       runs_weight=runs_weight)
    b.setup()
    assert open(os.path.join(b.root, "cpu.weight")).read() == weight   # at most the kernel's 10000


def test_cgroup2_agent_in_the_root_cgroup_leaves_the_runs_weight_alone(tree):
    mount, fs = tree
    b = Cgroup2Backend(mount=mount, self_path="/", root_name="mw-test", fs=fs, runs_weight=8)
    b.setup()
    assert b.root == os.path.join(mount, "mw-test")
    assert open(os.path.join(b.root, "cpu.weight")).read() == "100\n"   # beside system.slice: no boost


def test_cgroup2_without_delegated_controllers_is_unavailable(tree):
    mount, fs = tree
    with open(os.path.join(mount, "system.slice", "millwright.service", "cgroup.controllers"), "w") as fh:
        fh.write("hugetlb")
    b = Cgroup2Backend(mount=mount, self_path="/system.slice/millwright.service", root_name="mw-test", fs=fs)
    with pytest.raises(BackendUnavailable, match="lacks controllers memory, cpu, pids"):
        b.setup()


def test_cgroup2_run_limits_usage_and_cleanup_with_real_processes(tree, base_dir):
    mount, fs = tree
    b = _v2(mount, fs)
    seen = {}

    def hook(h):
        d = h.cgroup["unified"]
        for f in ("memory.max", "memory.oom.group", "cpu.max", "pids.max", "cgroup.procs", "memory.swap.max"):
            seen[f] = open(os.path.join(d, f)).read().strip()
        seen["pid"] = str(h.pid)

    ex = Executor(b, base_dir, poststart=[hook], watch_interval_s=0.05)
    try:
        c = Collector()
        h = ex.start(RunSpec("v2-run", [PY, "-c", "print('hi')"], limits=Limits(cpu=0.5, memory_mb=64, pids=16)), c)
        (r,) = c.wait(["v2-run"])
    finally:
        ex.close(close_backend=False)
    assert seen == {"memory.max": str(64 << 20), "memory.oom.group": "1", "cpu.max": "50000 100000",
                    "pids.max": "16", "cgroup.procs": seen["pid"], "memory.swap.max": "0", "pid": seen["pid"]}
    assert r.reason == "succeeded" and open(r.stdout_path).read() == "hi\n"
    assert (r.usage.cpu_s, r.usage.throttled_s, r.usage.max_rss_bytes) == (1.5, 0.25, 12345678)  # parsed from the files
    assert not os.path.exists(h.cgroup["unified"])
    b.close()
    assert not os.path.exists(os.path.join(mount, "system.slice", "millwright.service", "mw-test"))


def test_cgroup2_a_slot_serves_the_next_run_counted_from_its_last_and_with_its_own_limits(tree, base_dir):
    """A v2 slot given back after a clean run is reset (memory.peak through its own fd)
    and serves the next run: the limits that differ are rewritten, and the next run's
    usage is counted from what the slot's counters held at the last run's end (this tree's
    counters never move: the second run used nothing)."""
    mount, fs = tree
    b = _v2(mount, fs)
    ex = Executor(b, base_dir, watch_interval_s=0.05)
    try:
        c = Collector()
        h1 = ex.start(RunSpec("v2-first", ["/bin/true"], limits=Limits(cpu=0.5, memory_mb=64, pids=16)), c)
        (r1,) = c.wait(["v2-first"])
        assert ex.slots.free() == 1
        fs.writes.clear()
        h2 = ex.start(RunSpec("v2-second", ["/bin/true"], limits=Limits(cpu=0.5, memory_mb=32, pids=16)), c)
        (r2,) = c.wait(["v2-second"])
    finally:
        ex.close(close_backend=False)
    d = h1.cgroup["unified"]
    assert h2.cgroup["unified"] == d and r1.reason == r2.reason == "succeeded"
    written = {os.path.basename(p): v for p, v in fs.writes}
    assert written.get("memory.max") == str(32 << 20) and "cpu.max" not in written and "pids.max" not in written
    assert (r1.usage.cpu_s, r1.usage.throttled_s) == (1.5, 0.25)
    assert (r2.usage.cpu_s, r2.usage.throttled_s) == (0.0, 0.0)
    assert not os.path.exists(d)   # removed with the pool at close


@pytest.mark.parametrize("events,reason", [({"memory.events": "oom 1\noom_kill 1\noom_group_kill 1\n"}, "oom"),
                                           ({"pids.events": "max 4\n"}, "pids_limit")])
def test_cgroup2_quota_events_end_the_run_with_their_reason(tree, base_dir, events, reason):
    mount, fs = tree
    fs.overrides = {"slot-": events}   # every run slot of this test (it has one run)
    b = _v2(mount, fs)
    ex = Executor(b, base_dir, watch_interval_s=0.05)
    try:
        c = Collector()
        h = ex.start(RunSpec("quota-run", ["/bin/sleep", "30"], limits=Limits(0.5, 64, 16), timeout_s=20), c)
        (r,) = c.wait(["quota-run"])
    finally:
        ex.close(close_backend=False)
    assert r.reason == reason and r.signal == 9
    assert ("mw-test.agent" not in h.cgroup["unified"]) and not os.path.exists(h.cgroup["unified"])
    assert any(path.endswith("cgroup.kill") and data == "1" for path, data in fs.writes)


def test_cgroup2_real_hierarchy_when_usable(base_dir):
    """Runs only where the machine has a usable (delegated) cgroup2 hierarchy."""
    try:
        b = probe("cgroup2", root_name=f"millwright-test-{os.getpid()}", setup=False)
    except BackendUnavailable as exc:  # pragma: no cover
        b, why = None, str(exc)
    else:
        why = b.why
    # the require_kernel path: a failure under MILLWRIGHT_REQUIRE_KERNEL=1 unless the CI
    # host declares it has no delegated cgroup2 hierarchy (README, testing)
    require_kernel(b is not None and b.name == "cgroup2", f"no usable cgroup2 hierarchy here: {why}",
                   limit="cgroup2")
    b = probe("cgroup2", root_name=f"millwright-test-{os.getpid()}")  # pragma: no cover - not on this host
    ex = Executor(b, base_dir)
    try:
        c = Collector()
        ex.start(RunSpec("hog2", [PY, "-c", "b=[]\nwhile True: b.append(bytearray(8 << 20))"],
                         limits=Limits(1.0, 64, 16), timeout_s=60), c)
        (r,) = c.wait(["hog2"])
        assert r.reason == "oom"
    finally:
        ex.close()


def test_probe_on_this_host_explains_its_choice():
    b = probe("auto", setup=False)
    assert b.name in ("cgroup2", "cgroup1", "rlimit") and b.why
    if os.geteuid() == 0 and b.name == "cgroup1":
        assert "cgroup2" in b.why   # says why the better backend was not taken


# --------------------------------------------------------------------------- rlimit


@pytest.fixture
def rlimit_executor(base_dir):
    require_kernel(os.geteuid() == 0, "the rlimit tests switch to an unprivileged user (need root)")
    ex = Executor(RlimitBackend(), base_dir, watch_interval_s=0.05, kill_grace_s=0.5)
    yield ex
    ex.close()


def test_a_runs_output_files_and_stderr_tail_come_from_the_reaper(rlimit_executor, job_user):
    """The reaper creates a run's output file when its first byte comes (a silent run has
    none: no inode made and freed again per run) and keeps the end of its stderr in
    memory: the result's stderr_tail is what reading the file gives."""
    c = Collector()
    loud = "import sys\nfor i in range(900): sys.stderr.write(f'complaint {i:04d}\\n')\nsys.exit(3)\n"
    rlimit_executor.start(RunSpec("r-silent", ["/bin/true"], user=job_user), c)
    rlimit_executor.start(RunSpec("r-loud", [PY, "-c", loud], user=job_user), c)
    silent, noisy = c.wait(["r-silent", "r-loud"])
    assert silent.reason == "succeeded" and silent.stderr_tail is None and silent.stderr_bytes == 0
    assert silent.stdout_path is None and silent.stderr_path is None
    silent_dir = os.path.join(rlimit_executor.base_dir, safe_name("r-silent"))
    assert os.path.isdir(silent_dir) and os.listdir(silent_dir) == []   # kept (for `millwright logs`), empty
    assert noisy.stdout_path is None   # it wrote only to stderr
    assert os.listdir(os.path.dirname(noisy.stderr_path)) == ["stderr.log"]
    assert noisy.exit_code == 3 and noisy.stderr_bytes == os.path.getsize(noisy.stderr_path) == 900 * 15
    assert noisy.stderr_tail == stderr_tail(noisy.stderr_path)
    assert noisy.stderr_tail.startswith("complaint ") and noisy.stderr_tail.endswith("complaint 0899\n")
    assert os.stat(noisy.stderr_path).st_mode & 0o777 == 0o600


def test_rlimit_memory_over_limit_is_killed_by_the_rss_poll(rlimit_executor, job_user):
    c = Collector()
    hog = "import time\nb=[]\nwhile True:\n    b.append(bytearray(4 << 20)); time.sleep(0.03)\n"
    rlimit_executor.start(RunSpec("r-hog", [PY, "-c", hog], user=job_user, limits=Limits(0.5, 64, 16), timeout_s=60), c)
    rlimit_executor.start(RunSpec("r-calm", [PY, "-c", "print(1)"], user=job_user, limits=Limits(0.5, 64, 16)), c)
    hog_r, calm_r = c.wait(["r-hog", "r-calm"])
    assert hog_r.reason == "oom" and hog_r.signal == 9
    assert hog_r.usage.max_rss_bytes > 64 << 20
    assert calm_r.reason == "succeeded"


def test_rlimit_fork_bomb_is_stopped(rlimit_executor, job_user):
    c = Collector()
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    h = rlimit_executor.start(RunSpec("r-bomb", [PY, "-c", bomb], user=job_user, limits=Limits(0.5, 512, 12),
                                      timeout_s=60), c)
    (r,) = c.wait(["r-bomb"])
    assert r.reason == "pids_limit"
    assert zombies_left([h.pgid]) == []
    assert not any(True for _ in _group(h.pgid))


def _group(pgid):
    from agent.execute.processes import group_members

    return group_members(pgid)


@pytest.mark.parametrize("launcher", ["posix_spawn", "popen"])
def test_the_launcher_gives_the_job_the_same_start_by_posix_spawn_and_by_its_popen_fallback(
        rlimit_executor, job_user, base_dir, monkeypatch, launcher):
    """The shim launcher is started with posix_spawn (agent/execute/pspawn.py), or with
    subprocess.Popen where glibc lacks posix_spawn_file_actions_addclosefrom_np (< 2.34,
    no machine here: the fallback is forced). Either way the job gets only its pipes on fds
    0-2 (an inheritable fd of the agent's does not reach it), its work dir, its own session
    and no blocked signal. Ignored signals: posix_spawn resets the ones Python or the agent
    ignore or handle (pspawn.RESET_SIGNALS) and glibc's reserved 32 and 33, which its spawn
    child would otherwise leave ignored (this test found it: pspawn.LIBC_RESERVED); Popen
    resets SIGPIPE and SIGXFSZ only, so a signal the agent itself was started with ignored
    (nohup: SIGHUP) stays ignored in the fallback's jobs. The expectation is the test
    process's own ignored set less what the launcher resets."""
    from agent.execute import pspawn

    assert rlimit_executor.spawn_mode == "shim"   # the launcher path both starts take
    if launcher == "popen":
        monkeypatch.setattr(pspawn, "available", lambda: False)
    else:
        require_kernel(pspawn.available(), "glibc without posix_spawn_file_actions_addclosefrom_np")
    script = ('pwd; echo "$$ $(cut -d" " -f6 /proc/$$/stat)"; grep -E "^Sig(Blk|Ign):" /proc/self/status; '
              'exec ls /proc/self/fd')
    leak_r, leak_w = os.pipe()
    os.set_inheritable(leak_r, True)
    try:
        c = Collector()
        rlimit_executor.start(RunSpec(f"r-{launcher}", ["/bin/sh", "-c", script], user=job_user), c)
        (res,) = c.wait([f"r-{launcher}"])
    finally:
        for fd in (leak_r, leak_w):
            os.close(fd)
    assert res.reason == "succeeded", (res.reason, res.error)
    cwd, ids, blk, ign, *fds = open(res.stdout_path).read().splitlines()
    assert sorted(fds, key=int) == ["0", "1", "2", "3"]   # 3: the directory `ls` reads
    assert cwd.startswith(base_dir) and cwd.endswith("/work"), cwd
    pid, sid = ids.split()
    assert pid == sid   # its own session
    assert blk.split() == ["SigBlk:", "0000000000000000"]
    reset = ({int(sig) for sig in pspawn.RESET_SIGNALS} | set(pspawn.LIBC_RESERVED) if launcher == "posix_spawn"
             else {int(signal.SIGPIPE), int(signal.SIGXFSZ)})
    ours = int(next(line for line in open("/proc/self/status") if line.startswith("SigIgn:")).split()[1], 16)
    assert ign.split()[0] == "SigIgn:"
    assert _signals(int(ign.split()[1], 16)) == _signals(ours) - reset


def _signals(mask: int) -> set[int]:
    return {n + 1 for n in range(64) if mask >> n & 1}
