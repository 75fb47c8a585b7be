"""Quotas on the real kernel with the cgroup v1 backend (this machine is a v1 hybrid).

Needs root. Under MILLWRIGHT_REQUIRE_KERNEL=1 these fail instead of skipping.
Each test process uses its own cgroup root (millwright-test-<pid>) and removes it.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from agent.execute import Admission, Budget, Executor, Limits, RunSpec, effective_limits
from agent.execute.backends import BackendUnavailable, Cgroup1Backend
from agent.execute.processes import alive
from agent.runtime.loop import EventLoop
from tests.support.kernel import armed_launcher, require_kernel
from tests.support.processes import PY, Collector, children_zombies, zombies_left, executor_kind

ROOT_NAME = f"millwright-test-{os.getpid()}"


# --------------------------------------------------------------------------- fixtures


def _cgroup1() -> Cgroup1Backend:
    require_kernel(os.geteuid() == 0, "cgroup quota tests need root")
    b = Cgroup1Backend(root_name=ROOT_NAME)
    try:
        b.setup()
    except (BackendUnavailable, OSError) as exc:
        require_kernel(False, f"cgroup v1 unusable: {exc}")
    return b


def _run_dirs(b: Cgroup1Backend) -> list[str]:
    """Every run cgroup of backend b that exists: under its roots, and its top-level
    <root>@<run> cgroups in the cpu hierarchies."""
    out = []
    for root in b.roots.values():
        if os.path.isdir(root):
            out += [os.path.join(root, d) for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))]
    for mnt in b.flat.values():
        out += [os.path.join(mnt, d) for d in os.listdir(mnt) if d.startswith(f"{b.root_name}@")]
    return out


def _slot_names(b: Cgroup1Backend) -> list[str]:
    root = b.roots["memory"]
    return [d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))]


@pytest.fixture(scope="module")
def backend():
    b = _cgroup1()
    yield b
    b.reclaim()
    b.close()
    for root in b.roots.values():
        assert not os.path.exists(root), f"cgroup root {root} left behind"
    assert _run_dirs(b) == []


@pytest.fixture
def executor(backend, base_dir):
    ex = Executor(backend, base_dir, kill_grace_s=1.0, watch_interval_s=0.05)
    yield ex
    ex.close(close_backend=False)


# --------------------------------------------------------------------------- acceptance 1


def test_memory_hog_is_killed_with_reason_oom_and_neighbour_is_unaffected(executor):
    from agent.runtime.metrics import sample

    kills = sample("millwright_quota_kills_total", {"reason": "oom"}) or 0.0
    c = Collector()
    hog = executor.start(RunSpec("hog", [PY, "-c", "b=[]\nwhile True: b.append(bytearray(8 << 20))"],
                                 limits=Limits(cpu=1.0, memory_mb=64, pids=16), timeout_s=60), c)
    calm = executor.start(RunSpec("calm", [PY, "-c", "import time; b=bytearray(24 << 20); time.sleep(1.5); print('ok')"],
                                  limits=Limits(cpu=1.0, memory_mb=96, pids=16), timeout_s=60), c)
    r_hog, r_calm = c.wait(["hog", "calm"])
    assert r_hog.reason == "oom", r_hog
    assert r_hog.usage.oom_kills >= 1
    assert r_hog.signal == 9
    assert r_calm.reason == "succeeded", r_calm
    assert open(r_calm.stdout_path).read() == "ok\n"
    assert r_calm.usage.oom_kills == 0
    assert hog.result is r_hog and calm.result is r_calm
    assert sample("millwright_quota_kills_total", {"reason": "oom"}) == kills + 1
    assert sample("millwright_run_oom_kills_total") >= 1


def test_fork_bomb_is_stopped_by_the_pids_limit(executor):
    c = Collector()
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    h = executor.start(RunSpec("bomb", [PY, "-c", bomb], limits=Limits(cpu=0.5, memory_mb=256, pids=24),
                               timeout_s=60), c)
    (r,) = c.wait(["bomb"])
    assert r.reason == "pids_limit", r
    assert r.usage.pids_max_events > 0
    assert not os.path.exists(h.cgroup["pids"])   # all forks gone, cgroup removed
    assert zombies_left([h.pgid]) == []


def test_cpu_hog_is_held_to_its_quota(executor):
    c = Collector()
    quota = 0.5
    # The quota is a ceiling; this shared 2-core box is often saturated by other work,
    # which would starve the run *below* its quota. Give the run's own cpu cgroup a large
    # weight (test only: the product leaves it at one process's) so that the measurement
    # shows the ceiling, not the neighbours.
    h = executor.start(RunSpec("cpuhog", [PY, "-c", "while True: pass"],
                               limits=Limits(cpu=quota, memory_mb=64, pids=8), timeout_s=60), c)
    with open(os.path.join(h.cgroup["cpu"], "cpu.shares"), "w") as fh:
        fh.write("262144")
    time.sleep(0.5)                      # warm-up: interpreter start
    u0, t0 = executor.usage(h).cpu_s, time.monotonic()
    time.sleep(5.0)
    u1, t1 = executor.usage(h).cpu_s, time.monotonic()
    h.terminate("killed", grace_s=0.5)
    (r,) = c.wait(["cpuhog"])
    rate = (u1 - u0) / (t1 - t0)
    print(f"cpu hog: {rate:.3f} cores used over {t1 - t0:.2f} s with a quota of {quota}")
    assert quota * 0.85 <= rate <= quota * 1.15, rate
    assert r.reason == "killed"
    assert r.usage.throttled_s > 0
    assert r.usage.cpu_s >= u1


# --------------------------------------------------------------------------- acceptance 2


def test_budget_of_two_runs_ten_due_jobs_never_more_than_two_at_once(executor, base_dir):
    """The daemon's pattern: admission on the loop thread, on_exit posted to the loop."""
    loop = EventLoop()
    adm = Admission(Budget(max_concurrent=2, memory_mb=1024, cpu=2.0))
    marks = os.path.join(base_dir, "marks")
    os.makedirs(marks)
    state = {"running": 0, "max": 0, "done": [], "waiting_seen": 0}
    script = f'echo "$(date +%s%N) start" >> {marks}/$MILLWRIGHT_JOB_ID; sleep 0.3; echo "$(date +%s%N) end" >> {marks}/$MILLWRIGHT_JOB_ID'

    def start(key):
        state["running"] += 1
        state["max"] = max(state["max"], state["running"])
        executor.start(RunSpec(key, ["/bin/sh", "-c", script], job_id=key,
                               limits=Limits(cpu=0.25, memory_mb=32, pids=8), timeout_s=30),
                       lambda h, r: loop.post(ended, h, r))

    def ended(h, r):
        state["running"] -= 1
        state["done"].append(r)
        for key in adm.release(h.run_key):
            start(key)
        if len(state["done"]) == 10:
            loop.stop()

    def submit():
        for i in range(10):
            key = f"job{i}"
            d = adm.request(key, due=1000.0 + i, demand=Limits(cpu=0.25, memory_mb=32))
            if d == "admitted":
                start(key)
            else:
                assert d == "waiting"
                state["waiting_seen"] += 1

    loop.post(submit)
    t = threading.Thread(target=loop.run)
    t.start()
    t.join(60)
    assert not t.is_alive()
    assert len(state["done"]) == 10 and all(r.reason == "succeeded" for r in state["done"])
    assert state["max"] == 2 and adm.max_seen_concurrent == 2 and state["waiting_seen"] == 8
    # from the side effects the processes wrote themselves
    events = []
    for name in os.listdir(marks):
        for line in open(os.path.join(marks, name)):
            ts, what = line.split()
            events.append((int(ts), 1 if what == "start" else -1))
    events.sort(key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    assert len(events) == 20 and peak <= 2
    # admitted in due-time order
    starts = sorted((min(int(l.split()[0]) for l in open(os.path.join(marks, n))), n) for n in os.listdir(marks))
    assert {n for _, n in starts[:2]} == {"job0", "job1"}


# --------------------------------------------------------------------------- acceptance 4


def test_a_thousand_short_runs_leave_no_cgroups_fds_or_zombies(backend, base_dir):
    """1,000 short runs, 8 at a time: their slots are reused (a few made, none left over
    the pool's bound while it lives), and once the executor closed no cgroup, no fd and
    no zombie is left."""
    ex = Executor(backend, base_dir, kill_grace_s=1.0, slot_pool=4)
    closed = False
    try:
        c = Collector()
        fds_before = set(os.listdir("/proc/self/fd"))
        # warm-up so lazily opened fds (e.g. /dev/null) are counted in the baseline
        ex.start(RunSpec("warm", ["/bin/true"], limits=Limits(0.1, 16, 8)), c)
        c.wait(["warm"])
        n, parallel = 1000, 8
        sem = threading.Semaphore(parallel)
        pgids = set()

        def done(h, r):
            pgids.add(h.pgid)
            c(h, r)
            sem.release()

        for i in range(n):
            sem.acquire()
            ex.start(RunSpec(f"short-{i}", ["/bin/true"], limits=Limits(0.1, 16, 8)), done)
        results = c.wait([f"short-{i}" for i in range(n)], timeout=300)
        assert all(r.reason == "succeeded" for r in results), {r.reason for r in results}
        assert not ex.live()
        slots = _slot_names(backend)
        assert len(slots) == ex.slots.free() <= 4, slots   # only the pool's free slots, empty
        assert all(open(os.path.join(d, "cgroup.procs")).read() == "" for d in _run_dirs(backend))
        assert ex.slots.reused >= n - 100, (ex.slots.made, ex.slots.reused)
        assert zombies_left(pgids) == []
        assert c.threads == {"millwright-reaper"}
        ex.close(close_backend=False)
        closed = True
        assert _run_dirs(backend) == []
        # only fds of the kinds the executor opens (pipes, pidfds, cgroup and run files): other
        # threads of this pytest process (watches, agents' fixtures) may open unrelated fds
        new = set(os.listdir("/proc/self/fd")) - fds_before
        assert [fd for fd in new if executor_kind(fd)] == []
    finally:
        if not closed:
            ex.close(close_backend=False)


# --------------------------------------------------------------------------- issue 3 execution


def test_a_runs_work_dir_goes_with_the_run_whether_it_left_files_or_not(executor):
    """The executor removes an empty work dir with one rmdir and falls back to a tree
    removal; both must leave no work dir, and keep the run's output files."""
    c = Collector()
    empty = executor.start(RunSpec("wd-empty", ["/bin/true"], limits=Limits(0.1, 16, 8)), c)
    full = executor.start(RunSpec("wd-full", ["/bin/sh", "-c", "mkdir -p a/b && echo x > a/b/f && echo y > g && echo ok"],
                                  limits=Limits(0.1, 16, 8)), c)
    r_empty, r_full = c.wait(["wd-empty", "wd-full"])
    assert r_empty.reason == r_full.reason == "succeeded", (r_empty, r_full)
    for h in (empty, full):
        assert h.run_dir and not os.path.exists(os.path.join(h.run_dir, "work")), os.listdir(h.run_dir)
    assert open(r_full.stdout_path).read() == "ok\n"


def test_a_runs_work_dir_belongs_to_its_user_and_is_its_home_when_the_user_has_none(executor, job_user):
    """The work dir is the run user's (chown'd for another user; made by the agent for its
    own), writable by the job, its TMPDIR, and its HOME when the user's home is missing."""
    import pwd

    c = Collector()
    script = 'stat -c "%U:%G %a" .; touch mine && echo "home=$HOME tmp=$TMPDIR pwd=$(pwd)"'
    executor.start(RunSpec("wd-user", ["/bin/sh", "-c", script], user=job_user, limits=Limits(0.1, 16, 8)), c)
    executor.start(RunSpec("wd-root", ["/bin/sh", "-c", script], user="root", limits=Limits(0.1, 16, 8)), c)
    as_user, as_root = c.wait(["wd-user", "wd-root"])
    assert as_user.reason == as_root.reason == "succeeded", (as_user, as_root, open(as_user.stderr_path).read())
    pw = pwd.getpwnam(job_user)
    group = __import__("grp").getgrgid(pw.pw_gid).gr_name
    stat_line, env = open(as_user.stdout_path).read().splitlines()
    assert stat_line == f"{job_user}:{group} 700"
    vars_ = dict(kv.split("=", 1) for kv in env.split())
    assert vars_["tmp"] == vars_["pwd"] and vars_["pwd"].endswith("/work")
    assert vars_["home"] == (pw.pw_dir if os.path.isdir(pw.pw_dir) else vars_["pwd"])
    assert open(as_root.stdout_path).read().splitlines()[0] == "root:root 700"


def _launcher_argv(pid: int) -> list:
    """A held launcher's argv. Popen returns once the child's exec began (its close-on-exec
    pipe closed), a moment before the new image's arguments are in place: /proc then shows
    an empty command line."""
    deadline = time.monotonic() + 5
    while True:
        argv = open(f"/proc/{pid}/cmdline").read().split("\0")
        if argv != [""] or time.monotonic() > deadline:
            return argv
        time.sleep(0.001)


def test_a_user_switch_happens_exactly_when_the_run_users_ids_differ_from_the_agents(executor, job_user):
    """A root agent's root job skips setpriv (an exec of ~1.7 ms CPU per run) when the
    agent already acts with root's groups, and goes through it when they differ or the
    user is another; either way the job has exactly its user's uid, gid and groups."""
    import pwd

    c = Collector()
    script = 'id -u; id -g; id -G'
    root_groups = {0, *os.getgrouplist("root", 0)}
    agent_like_root = executor.group_set == frozenset(root_groups)
    cases = [("sw-root", "root", agent_like_root), ("sw-user", job_user, False)]
    launchers = {}
    for key, user, _ in cases:
        h = executor.prepare(RunSpec(key, ["/bin/sh", "-c", script], user=user, limits=Limits(0.1, 16, 8)), c)
        launchers[key] = _launcher_argv(h.pid)
        executor.release(h)
    executor.group_set = frozenset(root_groups | {4242})   # an agent with one group more than root's
    h = executor.prepare(RunSpec("sw-root-other-groups", ["/bin/sh", "-c", script], user="root",
                                 limits=Limits(0.1, 16, 8)), c)
    launchers["sw-root-other-groups"] = _launcher_argv(h.pid)
    executor.release(h)
    cases.append(("sw-root-other-groups", "root", False))
    results = dict(zip([k for k, _, _ in cases], c.wait([k for k, _, _ in cases])))
    for key, user, same in cases:
        pw = pwd.getpwnam(user)
        assert results[key].reason == "succeeded", (key, results[key])
        uid, gid, groups = open(results[key].stdout_path).read().splitlines()
        assert (int(uid), int(gid)) == (pw.pw_uid, pw.pw_gid)
        assert {int(g) for g in groups.split()} == {pw.pw_gid, *os.getgrouplist(user, pw.pw_gid)}
        switched = any(os.path.basename(a) == "setpriv" for a in launchers[key])
        assert switched is not same, (key, launchers[key])


def test_timeout_kills_a_process_tree_whose_child_ignores_sigterm(executor, base_dir):
    c = Collector()
    pidfile = os.path.join(base_dir, "child.pid")
    script = (f"sh -c 'trap \"\" TERM; echo $$ > {pidfile}; while :; do sleep 0.1; done' & "
              "trap 'exit 143' TERM; while :; do sleep 0.1; done")
    h = executor.start(RunSpec("tree", ["/bin/sh", "-c", script], timeout_s=0.8, kill_grace_s=1.0,
                               limits=Limits(0.5, 64, 32)), c)
    (r,) = c.wait(["tree"])
    assert r.reason == "timed_out", r
    child = int(open(pidfile).read())
    assert child != h.pid and not alive(child)
    assert zombies_left([h.pgid]) == []
    assert not os.path.exists(h.cgroup["memory"])


def test_leader_ignoring_sigterm_is_killed_after_the_grace_period(executor, base_dir):
    c = Collector()
    ready = os.path.join(base_dir, "stubborn.ready")
    script = ("import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "open(sys.argv[1], 'w').close()\ntime.sleep(60)")
    h = executor.start(RunSpec("stubborn", [PY, "-c", script, ready], kill_grace_s=0.3, limits=Limits(0.5, 64, 8)), c)
    # SIGTERM only once the handler is installed (Python's start takes longer on a loaded host)
    deadline = time.monotonic() + 30
    while not os.path.exists(ready):
        assert time.monotonic() < deadline, "the job never installed its SIGTERM handler"
        time.sleep(0.02)
    h.terminate("killed")
    (r,) = c.wait(["stubborn"])
    assert r.reason == "killed" and r.signal == 9
    assert r.duration_s >= 0.3


def test_runs_as_the_template_user_with_a_clean_env_and_bounded_output(executor, job_user):
    c = Collector()
    import pwd

    pw = pwd.getpwnam(job_user)
    os.environ["MILLWRIGHT_SECRET_LEAK"] = "x"
    try:
        script = ("import os, sys\n"
                  "print(os.getuid(), os.getgid(), os.getpgid(0) == os.getpid(), os.getcwd())\n"
                  "print(sorted(os.environ.items()))\n"
                  "sys.stderr.write('e' * 100000)\n")
        h = executor.start(RunSpec("user", [PY, "-c", script], user=job_user, job_id="j1", run_id="f1.2", attempt=2,
                                   fire_id="f1", output_max_bytes=5000, limits=Limits(0.5, 64, 16)), c)
        (r,) = c.wait(["user"])
    finally:
        del os.environ["MILLWRIGHT_SECRET_LEAK"]
    assert r.reason == "succeeded", (r, open(r.stderr_path).read()[:300])
    first, second = open(r.stdout_path).read().splitlines()
    uid, gid, own_group, cwd = first.split()
    assert (int(uid), int(gid), own_group) == (pw.pw_uid, pw.pw_gid, "True")
    assert cwd.startswith(h.run_dir) and cwd.endswith("/work")
    env = dict(eval(second))
    assert set(env) == {"PATH", "HOME", "LANG", "TMPDIR", "USER", "LOGNAME", "MILLWRIGHT_JOB_ID",
                        "MILLWRIGHT_FIRE_ID", "MILLWRIGHT_RUN_ID", "MILLWRIGHT_ATTEMPT", "MILLWRIGHT_PROGRESS",
                        "MILLWRIGHT_RESULT"}
    assert (env["MILLWRIGHT_PROGRESS"], env["MILLWRIGHT_RESULT"]) == (os.path.join(h.run_dir, "progress"),
                                                                      os.path.join(h.run_dir, "result.json"))
    assert (env["MILLWRIGHT_JOB_ID"], env["MILLWRIGHT_FIRE_ID"], env["MILLWRIGHT_RUN_ID"],
            env["MILLWRIGHT_ATTEMPT"]) == ("j1", "f1", "f1.2", "2")
    assert env["USER"] == job_user and env["HOME"] == cwd
    assert os.path.getsize(r.stderr_path) == 5000 and r.output_dropped_bytes == 95000
    assert not os.path.exists(cwd)   # the scratch dir is removed, the output kept


def test_unknown_user_is_a_clear_spawn_error(executor):
    c = Collector()
    h = executor.start(RunSpec("nouser", ["/bin/true"], user="mw-no-such-user-xyz"), c)
    (r,) = c.wait(["nouser"])
    assert r.reason == "spawn_error" and "does not exist" in r.error and h.pid is None


def test_missing_binary_is_a_spawn_error(executor):
    c = Collector()
    executor.start(RunSpec("nobin", ["/usr/lib/millwright/jobs/missing"]), c)
    (r,) = c.wait(["nobin"])
    assert r.reason == "spawn_error" and "No such file" in r.error


def test_poststart_hooks_run_before_the_job_does_anything(executor, base_dir):
    c = Collector()
    seen = []
    marker = os.path.join(base_dir, "ran")

    def hook(handle):
        # the process exists, its cgroups are known and it has not exec'ed the job yet
        # (it joins them by itself before it may: test_the_launcher_joins_its_cgroups_...)
        with open(f"/proc/{handle.pid}/cmdline", "rb") as fh:
            cmd = fh.read()
        seen.append((handle.run_key, f"/{ROOT_NAME}/" in handle.cgroup["memory"], b"touch" not in cmd.split(b"\0")[0]))
        if handle.run_key == "vetoed":
            raise RuntimeError("sensor could not track the pid")

    executor.poststart.append(hook)
    try:
        executor.start(RunSpec("tracked", ["/usr/bin/touch", marker]), c)
        executor.start(RunSpec("vetoed", ["/usr/bin/touch", marker + ".no"]), c)
        r1, r2 = c.wait(["tracked", "vetoed"])
    finally:
        executor.poststart.remove(hook)
    assert seen == [("tracked", True, True), ("vetoed", True, True)]
    assert r1.reason == "succeeded" and os.path.exists(marker)
    assert r2.reason == "spawn_error" and "poststart" in r2.error and not os.path.exists(marker + ".no")


def test_fork_spawn_mode_same_behaviour(backend, base_dir, job_user):
    ex = Executor(backend, base_dir, spawn_mode="fork", kill_grace_s=0.5)
    try:
        c = Collector()
        ex.start(RunSpec("f-ok", ["/usr/bin/id", "-un"], user=job_user, limits=Limits(0.5, 64, 8)), c)
        ex.start(RunSpec("f-missing", ["/nonexistent/x"]), c)
        ex.start(RunSpec("f-timeout", ["/bin/sleep", "30"], timeout_s=0.3), c)
        ok, missing, to = c.wait(["f-ok", "f-missing", "f-timeout"])
        assert ok.reason == "succeeded" and open(ok.stdout_path).read().strip() == job_user
        assert missing.reason == "spawn_error" and "No such file" in missing.error
        assert to.reason == "timed_out"
    finally:
        ex.close(close_backend=False)


@pytest.mark.parametrize("mode", ["shim", "fork"])
def test_prepared_run_execs_only_when_released_and_a_discarded_one_never(backend, base_dir, job_user, mode):
    """prepare() does the costly part ahead of the due time: the launcher waits in its
    cgroup until release(). terminate() before release() discards it: the job never
    execs and the run ends once, with the given reason, leaving nothing behind."""
    ex = Executor(backend, base_dir, spawn_mode=mode, kill_grace_s=0.5, watch_interval_s=0.05)
    try:
        c = Collector()
        marker = os.path.join(base_dir, f"released-{mode}")
        never = os.path.join(base_dir, f"discarded-{mode}")
        os.chmod(base_dir, 0o777)
        h = ex.prepare(RunSpec(f"rel-{mode}", ["/usr/bin/touch", marker], user=job_user, limits=Limits(0.5, 64, 8)), c)
        d = ex.prepare(RunSpec(f"dis-{mode}", ["/usr/bin/touch", never], user=job_user), c)
        time.sleep(0.3)
        assert h.pid and alive(h.pid) and not os.path.exists(marker)   # held, not exec'ed
        with open(f"/proc/{h.pid}/cgroup") as fh:
            assert f"/{ROOT_NAME}/" in fh.read()   # already confined
        assert f"rel-{mode}" not in c.results
        d.terminate("shard_lost")
        assert ex.release(d) is False                # a discarded run cannot be released
        assert ex.release(h) is True
        assert ex.release(h) is False                # once only
        rel, dis = c.wait([f"rel-{mode}", f"dis-{mode}"])
        assert rel.reason == "succeeded" and os.path.exists(marker)
        assert dis.reason == "shard_lost" and not os.path.exists(never)
        assert {h.run_key, d.run_key}.isdisjoint(k.run_key for k in ex.live())
        assert zombies_left([h.pgid, d.pgid]) == []
    finally:
        os.chmod(base_dir, 0o711)
        ex.close(close_backend=False)


def test_timed_release_happens_at_its_time_unless_the_guard_says_fenced(executor, base_dir):
    """release_at: the executor's own thread lets the job exec at that time; a guard that
    is false by then (the lease the claim was made under ran out) discards the run."""
    c = Collector()
    released = []
    marker, never = os.path.join(base_dir, "timed"), os.path.join(base_dir, "fenced")
    at = time.monotonic() + 0.5
    h = executor.prepare(RunSpec("timed", ["/bin/sh", "-c", 'date +%s.%N > "$0"', marker]), c,
                         release_at=at, on_release=lambda hh, ok: released.append((hh.run_key, ok, time.monotonic())),
                         guard=lambda: True)
    executor.prepare(RunSpec("fenced", ["/usr/bin/touch", never]), c, release_at=at,
                     on_release=lambda hh, ok: released.append((hh.run_key, ok, time.monotonic())),
                     guard=lambda: False)
    wall_at = time.time() + (at - time.monotonic())
    timed, fenced = c.wait(["timed", "fenced"])
    assert timed.reason == "succeeded" and float(open(marker).read()) >= wall_at - 0.005
    assert fenced.reason == "fenced" and not os.path.exists(never)
    assert sorted((k, ok) for k, ok, _ in released) == [("fenced", False), ("timed", True)]
    assert all(t >= at for _, _, t in released)
    assert h.started_at >= wall_at - 0.005


# --------------------------------------------------------------------------- armed launcher (issue 18)


def _clock_job(path: str) -> list:
    return ["/bin/sh", "-c", 'date +%s.%N > "$0"', path]


# The executor's armed launcher shells (agent/execute/armed.py); the tests of launcher
# semantics run with each (tests/kernel/test_armed_launcher.py: the scripts alone, and mksh)
ARMED = ["bash", "lksh"]


def test_the_executor_arms_with_lksh_when_mksh_is_installed(executor):
    """mksh's lksh is the armed launcher where installed (a third of bash's CPU per run);
    bash otherwise (tests/unit/test_armed.py)."""
    from agent.execute import armed

    armed_launcher("lksh")
    c = Collector()
    now = time.monotonic()
    h = executor.prepare(RunSpec("armed-lksh", ["/bin/true"]), c, release_at=now + 0.5, guard=lambda: True,
                         guard_until=now + 60)
    argv = _launcher_argv(h.pid)
    (r,) = c.wait(["armed-lksh"])
    # the script, after the launcher's own rlimits (agent/execute/launch.py, ulimit_lines)
    assert executor.armed_launcher == armed.LKSH and argv[:2] == ["/bin/lksh", "-c"]
    assert argv[2].endswith(armed.KSH_SCRIPT)
    assert r.reason == "succeeded"


@pytest.mark.parametrize("launcher", ARMED)
def test_armed_launcher_released_early_execs_at_once(executor, base_dir, launcher):
    """release() before the due time (the go byte) lets the armed job exec then, not at
    its due time."""
    executor.armed_launcher = armed_launcher(launcher)
    c = Collector()
    marker = os.path.join(base_dir, "armed-early")
    now = time.monotonic()
    h = executor.prepare(RunSpec("armed-early", _clock_job(marker)), c, release_at=now + 30, guard=lambda: True,
                         guard_until=now + 90)
    time.sleep(0.2)
    assert h.pid and alive(h.pid) and not os.path.exists(marker)
    released = time.time()
    assert executor.release(h) is True
    (r,) = c.wait(["armed-early"])
    assert r.reason == "succeeded" and released <= float(open(marker).read()) < released + 1.0


@pytest.mark.parametrize("launcher", ARMED)
def test_armed_launcher_releases_itself_at_its_time_while_the_release_thread_is_stuck(executor, base_dir, job_user,
                                                                                        launcher):
    """guard_until covering the release time arms the launcher: the kernel's timer, not a
    thread of the agent, lets the job exec. Shown by blocking the only release thread
    (an on_release callback that does not return): the armed job still runs, at its time,
    as its user, with exactly the clean environment; the release thread, once free,
    reports it released."""
    executor.armed_launcher = armed_launcher(launcher)
    c = Collector()
    os.chmod(base_dir, 0o777)
    gate = threading.Event()
    released = []
    marker, env_out = os.path.join(base_dir, "armed"), os.path.join(base_dir, "armed-env")
    now = time.monotonic()
    executor.prepare(RunSpec("blocker", ["/bin/true"]), c, release_at=now + 0.2,
                     on_release=lambda h, ok: gate.wait(30), guard=lambda: True, guard_until=now + 60)
    at = now + 0.6
    script = 'date +%s.%N > "$0"; id -un >> "$0"; env > "$1"'
    h = executor.prepare(RunSpec("armed", ["/bin/sh", "-c", script, marker, env_out], user=job_user), c,
                         release_at=at, on_release=lambda hh, ok: released.append(ok),
                         guard=lambda: True, guard_until=now + 60)
    wall_at = time.time() + (at - time.monotonic())
    try:
        deadline = time.monotonic() + 20
        while not (os.path.exists(marker) and os.path.getsize(marker) and os.path.exists(env_out)) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        assert released == [], "the release thread is still held by the blocker's callback"
        ran_at, user = open(marker).read().split()
    finally:
        gate.set()
    armed, _ = c.wait(["armed", "blocker"])
    assert armed.reason == "succeeded" and float(ran_at) >= wall_at and user == job_user
    env = dict(line.split("=", 1) for line in open(env_out).read().splitlines())
    assert set(env) - {"PWD", "SHLVL", "_"} == {"PATH", "HOME", "LANG", "TMPDIR", "USER", "LOGNAME",
                                                 "MILLWRIGHT_JOB_ID", "MILLWRIGHT_FIRE_ID", "MILLWRIGHT_RUN_ID",
                                                 "MILLWRIGHT_ATTEMPT", "MILLWRIGHT_PROGRESS", "MILLWRIGHT_RESULT"}
    assert released == [True] and h.started_at == pytest.approx(wall_at, abs=0.01)


# the armed scripts' own variable names: a template's env that names them reaches the job as given
SCRIPT_NAMES = {k: f"job's {k}" for k in ("m", "d", "t", "r", "n", "s", "u", "nx")}


@pytest.mark.parametrize("launcher", ARMED)
def test_armed_launcher_exports_exactly_the_clean_environment(executor, base_dir, launcher):
    """Nothing of the armed launcher's shell (SHLVL, _, PWD) reaches the job, and nothing
    of its script: the template's variables arrive as given, also those named like the
    script's own."""
    executor.armed_launcher = armed_launcher(launcher)
    c = Collector()
    now = time.monotonic()
    executor.prepare(RunSpec("armed-env", ["/usr/bin/env"], job_id="j1", run_id="f1.1", fire_id="f1", attempt=1,
                             env=dict(SCRIPT_NAMES)),
                     c, release_at=now + 0.3, guard=lambda: True, guard_until=now + 60)
    (r,) = c.wait(["armed-env"])
    env = dict(line.split("=", 1) for line in open(r.stdout_path).read().splitlines())
    assert r.reason == "succeeded" and set(env) - set(SCRIPT_NAMES) == {
        "PATH", "HOME", "LANG", "TMPDIR", "USER", "LOGNAME", "MILLWRIGHT_JOB_ID", "MILLWRIGHT_FIRE_ID",
        "MILLWRIGHT_RUN_ID", "MILLWRIGHT_ATTEMPT", "MILLWRIGHT_PROGRESS", "MILLWRIGHT_RESULT"}
    assert {k: env.get(k) for k in SCRIPT_NAMES} == SCRIPT_NAMES


@pytest.mark.parametrize("launcher", ARMED)
def test_armed_launcher_discarded_before_its_time_never_execs(executor, base_dir, launcher):
    """A cancel (terminate) between the claim and the due time closes the armed launcher's
    go pipe: it exits without exec'ing, as with the thread-released launcher."""
    executor.armed_launcher = armed_launcher(launcher)
    c = Collector()
    never = os.path.join(base_dir, "armed-never")
    released = []
    now = time.monotonic()
    h = executor.prepare(RunSpec("armed-cancel", _clock_job(never)), c, release_at=now + 1.5,
                         on_release=lambda hh, ok: released.append(ok), guard=lambda: True, guard_until=now + 60)
    time.sleep(0.2)
    assert h.pid and alive(h.pid) and not os.path.exists(never)
    h.terminate("cancelled")
    (r,) = c.wait(["armed-cancel"])
    time.sleep(1.6)   # past its due time: its timer would have fired by now
    assert r.reason == "cancelled" and r.started_at is None and not os.path.exists(never)
    assert released in ([], [False])


@pytest.mark.parametrize("launcher", ARMED)
def test_armed_launcher_whose_guard_fails_before_its_time_never_execs(executor, base_dir, launcher):
    """guard_until is a promise (the lease's validity only grows); should the guard turn
    false before the due time anyway (a lease revoked from outside), the reaper's watch
    discards the armed launcher: the run ends ``fenced`` and the job never execs."""
    executor.armed_launcher = armed_launcher(launcher)
    c = Collector()
    never = os.path.join(base_dir, "armed-fenced")
    valid = threading.Event()
    valid.set()
    now = time.monotonic()
    executor.prepare(RunSpec("armed-fenced", _clock_job(never)), c, release_at=now + 2.0,
                     guard=valid.is_set, guard_until=now + 60)
    time.sleep(0.2)
    valid.clear()
    (r,) = c.wait(["armed-fenced"])
    assert r.reason == "fenced" and r.started_at is None
    time.sleep(max(0.0, now + 2.2 - time.monotonic()))
    assert not os.path.exists(never)


@pytest.mark.parametrize("launcher", ARMED)
def test_every_armed_launcher_execs_its_job_when_its_timer_and_the_go_byte_meet(base_dir, launcher):
    """The release thread's "g" and close land at the armed launcher's due time: bash's
    timed read may then consume the "g" and still report the timeout (lksh's reads the
    two bytes at once). Such a launcher must exec the job, not take the following EOF for
    a discard (found by bench_trigger: 1 in ~1,500 runs exited 126 without exec). 600
    runs, 100 a second, as root through setpriv like the scheduler's; every one must
    succeed."""
    from agent.execute.backends import RlimitBackend

    shell = armed_launcher(launcher)
    ex = Executor(RlimitBackend(), base_dir, watch_interval_s=0.05)
    ex.armed_launcher = shell
    c = Collector()
    n = 600
    try:
        t0 = time.monotonic() + 0.5
        for i in range(n):
            at = t0 + i * 0.01
            ex.prepare(RunSpec(f"meet-{i}", ["/bin/true"], user="root"), c, release_at=at,
                       guard=lambda: True, guard_until=at + 60)
            while time.monotonic() < at - 0.25:
                time.sleep(0.002)
        results = c.wait([f"meet-{i}" for i in range(n)], timeout=120)
    finally:
        ex.close(close_backend=False)
    failed = [(r.run_key, r.reason, r.exit_code) for r in results if r.reason != "succeeded"]
    assert failed == []


def test_prepare_without_guard_until_is_not_armed(executor, base_dir):
    """No promise about the guard: the launcher waits for the release thread, which checks
    the guard at the due time (the pre-issue-18 path); a launcher is never armed then."""
    c = Collector()
    now = time.monotonic()
    h = executor.prepare(RunSpec("not-armed", ["/bin/true"]), c, release_at=now + 0.3, guard=lambda: True)
    short = executor.prepare(RunSpec("too-short", ["/bin/true"]), c, release_at=now + 0.3, guard=lambda: True,
                             guard_until=now + 0.4)
    cmds = [_launcher_argv(x.pid)[0] for x in (h, short)]
    r = c.wait(["not-armed", "too-short"])
    assert cmds == ["/bin/sh", "/bin/sh"] and [x.reason for x in r] == ["succeeded", "succeeded"]


def test_an_ended_runs_group_is_swept_again_for_late_zombies(executor):
    """A member of a run's process group that turns zombie after the run's last sweep
    (still being re-parented then) is reaped by the later sweeps (REAP_AGAIN_S), which
    the reaper makes for all ended runs together; once the last is due, none is left."""
    from agent.execute.reaper import REAP_AGAIN_S

    late = subprocess.Popen(["/bin/sh", "-c", "exit 0"], start_new_session=True)   # its own group
    deadline = time.monotonic() + 5
    while not children_zombies([late.pid]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert children_zombies([late.pid]), "the test's process did not turn zombie"
    reaper = executor.reaper
    reaper.post(reaper.reap_again, late.pid)
    assert zombies_left([late.pid], timeout=REAP_AGAIN_S[0] + 2) == [], "the zombie was not swept"
    time.sleep(REAP_AGAIN_S[-1] + 0.5)
    assert all(not q for q in reaper.resweeps.values())


def test_effective_limits_reach_the_cgroup(executor):
    from agent.config import Resources

    lim = effective_limits({"cpu": 2.0, "memory_mb": 48}, Resources(cpu=0.25, memory_mb=256, pids=12))
    c = Collector()
    h = executor.start(RunSpec("lim", ["/bin/sleep", "5"], limits=lim), c)
    b = executor.backend
    mem = open(os.path.join(h.cgroup["memory"], "memory.limit_in_bytes")).read().strip()
    quota = open(os.path.join(h.cgroup["cpu"], "cpu.cfs_quota_us")).read().strip()
    pids = open(os.path.join(h.cgroup["pids"], "pids.max")).read().strip()
    h.terminate()
    c.wait(["lim"])
    assert (int(mem), int(quota), int(pids)) == (48 << 20, 25000, 12)
    assert b.name == "cgroup1"


def test_reclaim_kills_and_removes_stale_run_cgroups(backend):
    slot = backend.create("stale-run", Limits(0.1, 32, 8))
    assert slot.paths["cpu"] == os.path.join(backend.mounts["cpu"], f"{ROOT_NAME}@stale-run")   # top level
    assert slot.paths["memory"] == os.path.join(backend.roots["memory"], "stale-run")
    p = subprocess.Popen(["/bin/sleep", "60"])
    backend.attach(slot, p.pid)
    reaped = threading.Thread(target=p.wait)   # like init reaping a dead agent's orphans
    reaped.start()
    try:
        assert backend.members(slot) == [p.pid]
        assert backend.reclaim() >= 1
    finally:
        p.kill()
        reaped.join(5)
    assert p.returncode == -9
    assert not any(os.path.exists(d) for d in slot.paths.values())


# --------------------------------------------------------------------------- issue 18: cheaper cgroup work


def _thread_cgroups() -> str:
    with open(f"/proc/self/task/{threading.get_native_id()}/cgroup") as fh:
        return fh.read()


@pytest.mark.parametrize("limits", [Limits(cpu=1.0, memory_mb=128, pids=64), Limits(cpu=0.1, memory_mb=16, pids=4)])
@pytest.mark.parametrize("armed", [False, True])
def test_the_launcher_joins_its_cgroups_itself_and_no_thread_of_the_agent_moves(executor, limits, armed, monkeypatch):
    """The launcher writes itself into each of its cgroups through the files its slot keeps
    open (inherited fds), before it may exec: the job runs inside every one of them, the
    agent writes no pid into them and its own threads never leave their cgroups, however
    tight the run's limits."""
    c = Collector()
    home = _thread_cgroups()
    written: list[str] = []
    fs = executor.backend.fs
    monkeypatch.setattr(fs, "write", lambda path, data, w=fs.write: (written.append(path), w(path, data))[1])
    spec = RunSpec(f"born-{armed}", ["/bin/cat", "/proc/self/cgroup"], limits=limits)
    if armed:
        h = executor.prepare(spec, c, release_at=time.monotonic() + 0.05, guard=lambda: True,
                             guard_until=time.monotonic() + 10)
    else:
        h = executor.start(spec, c)
    slot = executor.runs.get(h.run_key).slot
    (r,) = c.wait([spec.run_key])
    assert _thread_cgroups() == home
    assert r.reason == "succeeded", r
    assert slot.joined == {"memory", "cpu", "pids", "cpuacct"}
    mine = {ctrl: path for _, ctrls, path in (line.split(":", 2) for line in open(r.stdout_path).read().splitlines())
            for ctrl in ctrls.split(",")}
    for ctrl in ("memory", "cpu", "pids", "cpuacct"):
        assert os.path.join(executor.backend.mounts[ctrl], mine[ctrl].lstrip("/")) == h.cgroup[ctrl], (ctrl, mine)
    assert not [p for p in written if p.endswith(("cgroup.procs", "tasks"))], written


def test_a_launcher_that_cannot_join_its_cgroups_never_execs_the_job(executor, base_dir):
    """A slot whose cgroup went away under it (its `tasks` file open, the directory
    removed): the launcher's join fails and it ends without exec'ing the job."""
    marker = os.path.join(base_dir, "ran-outside")
    spec = RunSpec("no-join", ["/usr/bin/touch", marker], limits=Limits(0.5, 64, 16))
    staged = executor.stage(spec)
    assert staged.error is None
    os.rmdir(staged.slot.paths["pids"])   # empty: the kernel lets it go; the fd stays open
    c = Collector()
    executor.start(spec, c, staged=staged)
    (r,) = c.wait(["no-join"])
    # failed (exit 126), or spawn_error when its go byte found it gone already
    assert (r.reason, r.exit_code) in (("failed", 126), ("spawn_error", None)), r
    assert "I/O error" in (r.stderr_tail or "") or "No such device" in (r.stderr_tail or ""), r.stderr_tail
    assert not os.path.exists(marker)
    assert not os.path.exists(staged.slot.paths["memory"])   # not reused: removed


def test_a_slot_is_reused_only_after_a_clean_end_and_the_pool_keeps_at_most_its_size(backend, base_dir):
    """Eight runs at once with a pool of three: three slots stay, the others are removed;
    the next runs take the pooled ones (same cgroups, limits rewritten where they
    differ, usage counted from zero again); a run that left a process behind its leader
    gives its slot up for good."""
    ex = Executor(backend, base_dir, kill_grace_s=1.0, slot_pool=3)
    try:
        c = Collector()
        keys = [f"wide-{i}" for i in range(8)]
        hs = [ex.start(RunSpec(k, [PY, "-c", "import time; sum(range(10**6)); time.sleep(0.3)"],
                               limits=Limits(0.5, 64, 16)), c) for k in keys]
        first = c.wait(keys)
        assert all(r.reason == "succeeded" for r in first), first
        assert ex.slots.free() == 3 and len(_slot_names(backend)) == 3
        pooled = {h.cgroup["memory"] for h in hs} & {os.path.join(backend.roots["memory"], n)
                                                      for n in _slot_names(backend)}
        assert len(pooled) == 3
        h = ex.start(RunSpec("again", [PY, "-c", "pass"], limits=Limits(0.25, 48, 8)), c)
        (r,) = c.wait(["again"])
        assert h.cgroup["memory"] in pooled and r.reason == "succeeded"
        assert open(os.path.join(h.cgroup["memory"], "memory.limit_in_bytes")).read().strip() == str(48 << 20)
        assert open(os.path.join(h.cgroup["cpu"], "cpu.cfs_quota_us")).read().strip() == "25000"
        assert open(os.path.join(h.cgroup["pids"], "pids.max")).read().strip() == "8"
        assert 0 < r.usage.cpu_s < min(x.usage.cpu_s for x in first)   # its own, not the slot's total
        # a process outlives the leader (its own session): killed with the cgroup, and the
        # slot is not handed out again
        h2 = ex.start(RunSpec("leaves", ["/bin/sh", "-c", "setsid sleep 30 & sleep 0.2"], limits=Limits(0.25, 48, 8)), c)
        (r2,) = c.wait(["leaves"])
        assert r2.reason == "succeeded" and h2.cgroup["memory"] in pooled
        assert not os.path.exists(h2.cgroup["memory"]) and ex.slots.free() == 2
        hs3 = [ex.start(RunSpec(f"after-{i}", ["/bin/true"], limits=Limits(0.25, 48, 8)), c) for i in range(3)]
        c.wait([f"after-{i}" for i in range(3)])
        assert h2.cgroup["memory"] not in {x.cgroup["memory"] for x in hs3}
    finally:
        ex.close(close_backend=False)
    assert _run_dirs(backend) == []


def test_a_cluster_leaves_no_agent_cgroup_root_behind(etcd_server, tmp_path):
    """Test clusters kill -9 their agents, which skips the agents' own cleanup: the fixture
    removes each agent's cgroup root (every hierarchy), or months of CI runs on one host
    would leave thousands of empty cgroups."""
    import glob

    from agent.execute.backends import run_root_name
    from tests.support.cluster import Cluster
    from tests.support.jobs import job, templates
    from tests.support.waiting import wait_for

    # fails under MILLWRIGHT_REQUIRE_KERNEL=1 if cgroup v1 cannot be used; require_kernel,
    # not _cgroup1(): closing a second backend of ROOT_NAME would remove the module
    # backend's roots under the tests that follow
    require_kernel(os.geteuid() == 0 and Cgroup1Backend().mounts != {}, "cgroup v1 tests need root and v1 hierarchies")
    out = str(tmp_path / "effects.txt")
    os.chmod(tmp_path, 0o777)
    c = Cluster(etcd_server, str(tmp_path / "agents"), ttl=4, extra={
        "templates": templates(out), "execute": {"quota_backend": "cgroup1"}})
    try:
        a = c.start("cg0")
        wait_for(lambda: c.converged({"cg0": 1}), 20, what="shards")
        store = c.job_store()
        store.create(job("cg-long", {}, params={"sleep": "30", "code": "0"}))
        wait_for(lambda: any(r["state"] == "running" for r in c.run_records().values()), 20,
                 what="a run in flight")
        root = run_root_name("cg0", a.config["state_dir"])
        # the running record is the claim, written before the run's cgroups are made
        wait_for(lambda: [x for d in glob.glob(f"/sys/fs/cgroup/*/{root}") for x in os.scandir(d) if x.is_dir()]
                 and glob.glob(f"/sys/fs/cgroup/*/{root}@*"),
                 20, what="the run's cgroups, top-level cpu one included (without them the test proves nothing)")
    finally:
        c.close()  # kill -9, then the fixture's cleanup
    assert glob.glob(f"/sys/fs/cgroup/*/{root}") == []
    assert glob.glob(f"/sys/fs/cgroup/*/{root}/*") == []
    assert glob.glob(f"/sys/fs/cgroup/*/{root}@*") == []


# --------------------------------------------------------------------------- issue 18: runs weigh as processes

BUSY = """import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
t0 = float(sys.argv[2]); t1 = t0 + float(sys.argv[3])
while time.time() < t0:
    time.sleep(0.005)
c0 = time.process_time()
while time.time() < t1:
    pass
print(time.process_time() - c0)
"""


class _NestedCpu(Cgroup1Backend):
    """The layout before issue 18: every run's cpu cgroup under the agent's root."""

    FLAT = ()


@pytest.mark.parametrize("layout", ["product", "nested"])
def test_a_busy_run_weighs_one_ordinary_process_on_a_contended_cpu(base_dir, layout):
    """Four busy runs and one busy process started by hand share one CPU for 2 s. The
    kernel divides a cgroup's weight among its members: with the runs' cpu cgroups under
    one root (the old layout) the four together weigh one process, each getting a quarter
    of the process's CPU time. With each run's cpu cgroup at the top level (the product),
    each run gets about as much as the process."""
    require_kernel(os.geteuid() == 0, "cgroup quota tests need root")
    b = (Cgroup1Backend if layout == "product" else _NestedCpu)(root_name=f"{ROOT_NAME}-{layout}")
    try:
        b.setup()
    except (BackendUnavailable, OSError) as exc:
        require_kernel(False, f"cgroup v1 unusable: {exc}")
    ex = Executor(b, base_dir, kill_grace_s=1.0, watch_interval_s=0.05)
    ordinary = None
    try:
        cpu = str(max(os.sched_getaffinity(0)))
        t0, span = repr(time.time() + 1.5), "2.0"     # every process spins in the same window
        c = Collector()
        keys = [f"busy{i}" for i in range(4)]
        for k in keys:
            h = ex.start(RunSpec(k, [PY, "-c", BUSY, cpu, t0, span], limits=Limits(cpu=1.0, memory_mb=64, pids=8),
                                 timeout_s=30), c)
            assert (os.path.dirname(h.cgroup["cpu"]) == b.mounts["cpu"]) == (layout == "product")
        ordinary = subprocess.Popen([PY, "-c", BUSY, cpu, t0, span], stdout=subprocess.PIPE, text=True)
        own = float(ordinary.communicate(timeout=30)[0])
        runs = [float(open(r.stdout_path).read()) for r in c.wait(keys)]
    finally:
        if ordinary is not None and ordinary.poll() is None:
            ordinary.kill()
            ordinary.wait()
        ex.close(close_backend=False)
        b.reclaim()
        b.close()
    ratio = [r / own for r in runs]
    print(f"{layout}: cpu s per run {[round(r, 3) for r in runs]}, ordinary {own:.3f}, "
          f"run / ordinary {[round(x, 2) for x in ratio]}")
    assert own > 0.1, "the ordinary process hardly ran: the measurement says nothing"
    assert _run_dirs(b) == []
    if layout == "nested":
        assert max(ratio) < 0.5, ratio     # one weight shared by all four
    else:
        assert min(ratio) > 0.6, ratio     # each about as much as the ordinary process


# --------------------------------------------------------------------------- issue 18 staging


def test_a_staged_run_starts_in_the_directories_and_cgroups_made_ahead_on_another_thread(executor, backend,
                                                                                         monkeypatch):
    """stage() on another thread makes the run's work dir, output files and quota
    container; start() with it runs the job there without making them on its own thread (the point: the
    loop does no blocking file-system work), and the run's end removes both as for any
    run."""
    from agent.execute import launch

    makers: list[str] = []
    prepare, create = launch.prepare_process, backend.create
    monkeypatch.setattr(launch, "prepare_process",
                        lambda *a: (makers.append(threading.current_thread().name), prepare(*a))[1])
    monkeypatch.setattr(backend, "create", lambda *a: (makers.append(threading.current_thread().name), create(*a))[1])
    spec = RunSpec("st-used", ["/bin/sh", "-c", 'pwd; cat /proc/self/cgroup'], limits=Limits(0.1, 16, 8))
    out: list = []
    t = threading.Thread(target=lambda: out.append(executor.stage(spec)), name="stager")
    t.start()
    t.join()
    staged = out[0]
    assert staged.error is None and staged.slot is not None
    work = staged.work_dir_created
    assert work and os.path.isdir(work)
    cgroup_dirs = sorted(staged.slot.paths.values())
    assert cgroup_dirs and all(os.path.isdir(d) for d in cgroup_dirs)
    # no output file yet: the reaper makes one when the run writes to it
    assert not any(os.path.exists(p) for p in (staged.process.out, staged.process.err))
    c = Collector()
    h = executor.start(spec, c, staged=staged)
    (r,) = c.wait(["st-used"])
    assert r.reason == "succeeded", r
    pwd, *cg = open(r.stdout_path).read().splitlines()
    assert pwd == work
    where = {line.split(":", 2)[1]: line.split(":", 2)[2] for line in cg}
    for ctrl in ("memory", "pids"):   # the job's own /proc/self/cgroup: in the staged ones
        assert os.path.join(backend.mounts[ctrl], where[ctrl].lstrip("/")) == staged.slot.paths[ctrl], \
            (where, staged.slot.paths)
    assert h.cgroup == staged.slot.paths
    assert makers == ["stager", "stager"]
    assert not os.path.exists(work)
    # the slot went back to the pool for another run, empty
    assert all(os.path.isdir(d) and open(os.path.join(d, "cgroup.procs")).read() == "" for d in cgroup_dirs)
    assert executor.slots.free() == 1


def test_an_unstaged_run_leaves_no_cgroup_and_no_directory(backend, base_dir):
    """A run staged with its claim but never started (fenced, cancelled) gives back its
    quota container (to the pool, or removed where the pool is full) and its empty run
    and work directories."""
    for size in (1, 0):
        ex = Executor(backend, base_dir, slot_pool=size)
        try:
            spec = RunSpec("st-dropped", ["/bin/true"], limits=Limits(0.1, 16, 8))
            fds_before = set(os.listdir("/proc/self/fd"))
            staged = ex.stage(spec)
            assert staged.error is None
            run_dir, work = staged.process.run_dir, staged.work_dir_created
            cgroup_dirs = list(staged.slot.paths.values())
            assert os.path.isdir(work) and all(os.path.isdir(d) for d in cgroup_dirs)
            assert staged.slot.join_fds   # the cgroups' tasks files, for the launcher to join by
            ex.unstage(staged)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and os.path.exists(run_dir):
                time.sleep(0.01)
            assert not os.path.exists(run_dir)
            if size:
                assert ex.slots.free() == 1 and all(os.path.isdir(d) for d in cgroup_dirs)
            else:
                assert not any(os.path.exists(d) for d in cgroup_dirs)
                assert set(os.listdir("/proc/self/fd")) <= fds_before   # and their fds were closed
        finally:
            ex.close(close_backend=False)
        assert not any(os.path.exists(d) for d in cgroup_dirs)


def test_a_staging_error_is_the_runs_spawn_error_and_nothing_is_left(executor):
    """A user missing on this node, found while staging on another thread, is reported by
    start() as the run's spawn_error (exactly one on_exit), as an unstaged start would."""
    spec = RunSpec("st-nouser", ["/bin/true"], user="no-such-user-mw", limits=Limits(0.1, 16, 8))
    staged = executor.stage(spec)
    assert staged.error is not None and staged.error.stage == "user" and staged.slot is None
    c = Collector()
    calls = []
    executor.start(spec, lambda h, r: (calls.append(r), c(h, r)), staged=staged)
    (r,) = c.wait(["st-nouser"])
    assert r.reason == "spawn_error" and "does not exist" in (r.error or ""), r
    time.sleep(0.2)
    assert len(calls) == 1
