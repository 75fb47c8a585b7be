"""What runs leave in their work directories is removed off the thread that ends runs
(agent/execute/cleanup.py): real processes (the rlimit backend), on a tmpfs of the test's
own (mounted, then unmounted whatever is left: 200,000 files are made in seconds there, and
no leftover chain reaches pytest's own recursive removal of tmp_path).

Figures (the time from a job's exit to its final status, other runs' end delays, the
removal times) are printed with -s; asserted is only the behaviour: every run ends, the
trees are gone or set aside and reported, and the cleanup goes on for later runs."""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import time

import pytest

from agent.execute import RunSpec
from agent.execute.backends import RlimitBackend
from agent.execute.cleanup import STUCK_PREFIX, Cleaner
from agent.execute.rmtree import remove_tree
from agent.execute.executor import CLEANUP_DIR, Executor
from agent.runtime.metrics import sample
from tests.support.kernel import own_tmpfs
from tests.support.processes import PY, Collector

DEEP = 5000
MANY = 200_000
# each job prints the time it is done, as its last act: its exit follows at once
DEEP_JOB = f"import os,time\nfor _ in range({DEEP}):\n os.mkdir('d'); os.chdir('d')\nprint(repr(time.time()))"
MANY_JOB = ("import os,time\nfd=os.open('.',os.O_RDONLY)\n"
            f"for i in range({MANY}): os.close(os.open(str(i),os.O_CREAT|os.O_WRONLY,0o600,dir_fd=fd))\n"
            "print(repr(time.time()))")
SHORT_JOB = "date +%s.%N"


@pytest.fixture
def fs():
    with own_tmpfs("1g", "0711", "mw-cleanup-") as path:
        yield path


@pytest.fixture(params=["nofile-1024", "nofile-high"])
def nofile(request):
    """The agent's open-file soft limit for the test: 1,024 (a shutil.rmtree of a deep
    chain runs out of descriptors there) or the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1024 if request.param == "nofile-1024" else hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        yield want
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class Timed(Collector):
    """A Collector that also keeps when each run's end was delivered (wall clock)."""

    def __init__(self):
        super().__init__()
        self.at = {}

    def __call__(self, handle, result):
        self.at[handle.run_key] = time.time()
        super().__call__(handle, result)


def _end_delay(ex, c, key, argv):
    """Start one run; the time from the job's last act (the time it printed) to its final
    status."""
    ex.start(RunSpec(key, argv), c)
    (r,) = c.wait([key], timeout=120)
    assert r.reason == "succeeded", (r.reason, r.error, r.stderr_tail)
    with open(r.stdout_path) as fh:
        done = float(fh.read().split()[-1])
    return c.at[key] - done, r


def _short_runs(ex, c, prefix, n):
    return [_end_delay(ex, c, f"{prefix}/{i}", ["/bin/sh", "-c", SHORT_JOB])[0] for i in range(n)]


def _ms(xs):
    return f"median {statistics.median(xs) * 1e3:.1f} ms, max {max(xs) * 1e3:.1f} ms"


def test_a_deep_chain_and_200000_files_end_their_runs_at_once_and_are_removed(fs, nofile):
    base = os.path.join(fs, "runs")
    reports = []
    ex = Executor(RlimitBackend(), base, watch_interval_s=0.05, guard=False,
                  cleanup={"on_report": reports.append})
    c = Timed()
    removed0 = sample("millwright_cleanup_trees_total", {"event": "removed"}) or 0.0
    try:
        idle = _short_runs(ex, c, "idle", 10)   # other runs' end delays with nothing to clean
        deep_s, deep = _end_delay(ex, c, "deep/f/1", [PY, "-c", DEEP_JOB])
        t_many = time.monotonic()
        many_s, many = _end_delay(ex, c, "many/f/1", [PY, "-c", MANY_JOB])
        make_s = time.monotonic() - t_many
        busy = _short_runs(ex, c, "busy", 10)   # while the cleaner removes the 200,000 files
        pending = sample("millwright_cleanup_pending_trees") or 0.0
        t0 = time.monotonic()
        assert ex.cleaner.wait_idle(300), "the cleaner did not finish"
        drain_s = time.monotonic() - t0
        for r in (deep, many):   # the work dir is gone from the run dir, its output stays
            assert os.listdir(os.path.dirname(r.stdout_path)) == ["stdout.log"]
        assert os.listdir(os.path.join(base, CLEANUP_DIR, "trash")) == []
        assert [(r.event, r.name.rsplit(".", 1)[-1]) for r in reports] == [("removed", "work")] * 2
        assert sorted(r.entries for r in reports) == [DEEP + 1, MANY + 1]
        assert sample("millwright_cleanup_trees_total", {"event": "removed"}) == removed0 + 2
        # and on for later runs
        _end_delay(ex, c, "later/f/1", [PY, "-c", "import time\nfor i in range(100): open(str(i), 'w')\n"
                                                  "print(repr(time.time()))"])
        assert ex.cleaner.wait_idle(60)
        assert len(reports) == 3 and reports[-1].event == "removed" and reports[-1].entries == 101
    finally:
        ex.close()
    print(f"\n[{nofile=}] exit to final status: {DEEP}-deep chain {deep_s * 1e3:.1f} ms, "
          f"{MANY} files {many_s * 1e3:.1f} ms (made in {make_s:.1f} s); other runs' ends: idle {_ms(idle)}, "
          f"while cleaning {_ms(busy)} (trees pending after them: {pending:.0f}); removal: "
          + ", ".join(f"{r.entries} entries in {r.seconds:.2f} s" for r in reports[:2])
          + f"; drained {drain_s:.2f} s after the short runs")


def _files(path, n):
    os.makedirs(path)
    for i in range(n):
        open(os.path.join(path, str(i)), "w").close()
    return path


def test_a_tree_over_its_budget_is_quarantined_then_stuck_once_the_quarantine_is_full(fs):
    reports = []
    cl = Cleaner(os.path.join(fs, ".cleanup"), pass_entries=100, max_tree_entries=250, max_quarantined=1,
                 on_report=reports.append)
    cl.start()
    try:
        for name in ("big1", "big2"):
            assert cl.discard(_files(os.path.join(fs, name), 300))
            assert cl.wait_idle(30)
        assert [(r.event, r.entries) for r in reports] == [("quarantined", 251), ("stuck", 251)]
        assert os.listdir(cl.quarantine) == [reports[0].name] and len(os.listdir(reports[0].where)) == 49
        assert os.listdir(cl.trash) == [STUCK_PREFIX + reports[1].name]
        # never looked at again; a later tree is removed all the same
        assert cl.discard(_files(os.path.join(fs, "small"), 10))
        assert cl.wait_idle(30)
        assert reports[-1].event == "removed" and reports[-1].entries == 11
        assert len(os.listdir(os.path.join(cl.trash, STUCK_PREFIX + reports[1].name))) == 49
    finally:
        cl.stop()
        cl.join(5)


def test_a_mount_point_is_never_crossed_and_its_tree_is_quarantined_after_its_tries(fs):
    tree = _files(os.path.join(fs, "tree"), 3)
    inner = os.path.join(tree, "mnt")
    os.mkdir(inner)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", inner], check=True)
    reports = []
    cl = Cleaner(os.path.join(fs, ".cleanup"), max_tries=3, retry_s=0.01, on_report=reports.append)
    try:
        open(os.path.join(inner, "keep"), "w").close()
        cl.start()
        assert cl.discard(tree)
        assert cl.wait_idle(30)
        (r,) = reports
        assert r.event == "quarantined" and "mount point" in (r.reason or "") and "3 times" in (r.reason or "")
        assert os.listdir(os.path.join(r.where, "mnt")) == ["keep"]   # nothing of the other fs removed
    finally:
        cl.stop()
        cl.join(5)
        subprocess.run(["umount", "-l", os.path.join(cl.quarantine, reports[0].name, "mnt") if reports else inner])


def test_symbolic_links_are_removed_never_followed(fs):
    outside = _files(os.path.join(fs, "outside"), 2)
    tree = os.path.join(fs, "tree")
    os.makedirs(os.path.join(tree, "a", "b"))
    os.symlink(outside, os.path.join(tree, "a", "to-dir"))
    os.symlink(os.path.join(outside, "0"), os.path.join(tree, "a", "b", "to-file"))
    os.symlink(outside, os.path.join(fs, "top-link"))
    fd = os.open(fs, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert remove_tree(fd, "tree", 1000).done
        assert remove_tree(fd, "top-link", 1000).done   # a link as the tree itself: the link goes
    finally:
        os.close(fd)
    assert sorted(os.listdir(fs)) == ["outside"] and sorted(os.listdir(outside)) == ["0", "1"]


def test_a_walk_over_its_budget_goes_on_where_it_stopped(fs):
    """The work of a call is bounded; what it removed stays removed, so calls add up."""
    tree = os.path.join(fs, "t")
    d = tree
    for _ in range(30):
        d = os.path.join(d, "d")
    _files(d, 20)
    fd = os.open(fs, os.O_RDONLY | os.O_DIRECTORY)
    try:
        total, calls = 0, 0
        while True:
            p = remove_tree(fd, "t", 7)
            calls += 1
            assert p.error is None and p.removed <= 7
            total += p.removed
            if p.done:
                break
    finally:
        os.close(fd)
    assert total == 51 and calls == 8 and not os.path.exists(tree)


def test_retention_hands_old_run_dirs_to_the_cleaner_and_sizes_a_deep_one(fs):
    """Retention's disk pass (agent/jobs/retention.py): an old run dir holding a 5,000-deep
    chain is sized without a RecursionError and discarded (a rename) for the cleaner to
    remove; the cleaner's own directory is never a run dir to it."""
    from types import SimpleNamespace

    from agent.config import RetentionConfig
    from agent.jobs.retention import Retention

    base = os.path.join(fs, "runs")
    reports = []
    ex = Executor(RlimitBackend(), base, guard=False, cleanup={"on_report": reports.append})
    try:
        old = os.path.join(base, "old-run")
        d = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
        for name in ["old-run"] + ["d"] * DEEP:
            os.mkdir(name, dir_fd=d)
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=d)
            os.close(d)
            d = fd
        os.close(os.open("out.log", os.O_CREAT | os.O_WRONLY, dir_fd=d))
        os.close(d)
        cfg = SimpleNamespace(retention=RetentionConfig(run_output_s=0.0), shards=4, agent_id="a")
        ret = Retention(cfg, SimpleNamespace(post=lambda *a: None), client=None, keys=None, ownership=None,
                        audit=None, catalog=None, executor=ex, clock=lambda: time.time() + 10)
        result = ret.run_disk(set())
        assert result["run_dirs"] == 1 and not os.path.exists(old)
        assert ex.cleaner.wait_idle(60)
        assert [(r.event, r.entries) for r in reports] == [("removed", DEEP + 2)]
        assert sorted(os.listdir(base)) == [CLEANUP_DIR]
    finally:
        ex.close()


def test_a_tree_the_cleaner_gives_up_on_is_an_audit_record_of_the_daemon():
    from types import SimpleNamespace

    from agent.execute.cleanup import Report
    from agent.daemon.wiring import cleanup_report

    records = []
    agent = SimpleNamespace(record=lambda type_, **f: records.append((type_, f)))
    cleanup_report(agent, Report("removed", "x.work", 3, 0.1))
    cleanup_report(agent, Report("quarantined", "y.work", 251, 2.0, "more than 250 entries", "/q/y.work"))
    assert records == [("cleanup", {"event": "quarantined", "tree": "y.work", "entries": 251,
                                    "reason": "more than 250 entries", "where": "/q/y.work"})]


def test_a_walker_past_its_time_is_killed_and_counts_as_a_failed_try(fs):
    """A pass's helper process that does not finish in pass_timeout_s is killed; its tree
    is tried max_tries times, then set aside with the reason."""
    reports = []
    cl = Cleaner(os.path.join(fs, ".cleanup"), max_tries=2, retry_s=0.01, pass_timeout_s=0.0001,
                 on_report=reports.append)
    cl.start()
    try:
        assert cl.discard(_files(os.path.join(fs, "tree"), 1000))
        assert cl.wait_idle(60)
        (r,) = reports
        assert r.event == "quarantined" and "2 times" in (r.reason or "") and "walk over" in (r.reason or "")
        assert sample("millwright_cleanup_trees_total", {"event": "walker_failed"}) >= 2
    finally:
        cl.stop()
        cl.join(5)
