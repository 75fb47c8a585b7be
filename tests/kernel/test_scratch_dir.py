"""A run's progress FIFO and result file in the executor's scratch directory
(execute.runtime_dir, a tmpfs on a real host): real processes, the rlimit backend.
The run directory keeps only what must outlive the run (its output); nothing of a run is
left in the scratch directory once it ended, and what a dead predecessor left there is
cleared when the executor starts."""

from __future__ import annotations

import os

from agent.execute import Executor, RunSpec
from agent.execute.backends import RlimitBackend
from tests.support.processes import Collector

JOB = ('echo \'{"progress": 50, "step": "half"}\' > "$MILLWRIGHT_PROGRESS"; '
       'printf \'{"ok": true}\' > "$MILLWRIGHT_RESULT"; '
       'echo "$MILLWRIGHT_PROGRESS $MILLWRIGHT_RESULT"')


def test_the_channel_lives_in_the_scratch_dir_and_goes_with_its_run(tmp_path):
    scratch = tmp_path / "scratch"
    ex = Executor(RlimitBackend(), str(tmp_path / "runs"), scratch_dir=str(scratch), watch_interval_s=0.05)
    c = Collector()
    try:
        h = ex.start(RunSpec("j1/f1/1", ["/bin/sh", "-c", JOB]), c)
        (r,) = c.wait(["j1/f1/1"])
    finally:
        ex.close()
    assert r.reason == "succeeded", r.error
    assert r.result == {"ok": True} and r.progress is not None and r.progress["step"] == "half"
    fifo, result = open(r.stdout_path).read().split()
    name = os.path.basename(h.run_dir)
    assert (fifo, result) == (str(scratch / f"{name}.progress"), str(scratch / f"{name}.result.json"))
    assert sorted(os.listdir(h.run_dir)) == ["stdout.log"]   # the output stays, no channel
    assert not scratch.exists()   # emptied run by run, removed by close()


def test_what_a_predecessor_left_is_cleared_and_an_unusable_dir_falls_back_to_the_run_dir(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "old-run.result.json").write_text('{"stale": true}')
    os.mkfifo(scratch / "old-run.progress")
    ex = Executor(RlimitBackend(), str(tmp_path / "runs"), scratch_dir=str(scratch))
    try:
        assert ex.scratch_dir == str(scratch) and os.listdir(scratch) == []
    finally:
        ex.close()
    (tmp_path / "file").write_text("")
    ex = Executor(RlimitBackend(), str(tmp_path / "runs2"), scratch_dir=str(tmp_path / "file" / "sub"))
    c = Collector()
    try:
        assert ex.scratch_dir is None
        h = ex.start(RunSpec("j2/f1/1", ["/bin/sh", "-c", JOB]), c)
        (r,) = c.wait(["j2/f1/1"])
    finally:
        ex.close()
    assert r.result == {"ok": True}
    assert open(r.stdout_path).read().split() == [os.path.join(h.run_dir, "progress"),
                                                  os.path.join(h.run_dir, "result.json")]


def test_a_run_whose_channel_cannot_be_opened_leaves_no_entry_and_closes_no_fd_twice(tmp_path, monkeypatch):
    """The spawn fails at its pipes (here: the progress FIFO cannot be opened, as at the fd
    limit): a clean `pipes` error, the channel's entries gone, and the run's end closes none
    of the fds the failure already closed (by then their numbers may be another's)."""
    import threading

    from agent.execute import launch

    def no_fds(*_a, **_k):
        raise OSError(24, "Too many open files")

    scratch = tmp_path / "scratch"
    ex = Executor(RlimitBackend(), str(tmp_path / "runs"), scratch_dir=str(scratch))
    c = Collector()
    hold = threading.Event()
    mine: list[int] = []
    try:
        ex.reaper.post(hold.wait, 10)   # the run's end waits until this test holds the freed fd numbers
        monkeypatch.setattr(launch, "ProgressChannel", no_fds)
        ex.start(RunSpec("j3/f1/1", ["/bin/sh", "-c", "true"]), c)
        monkeypatch.undo()
        for _ in range(4):
            mine.extend(os.pipe())   # the lowest free numbers: those the failure closed
        hold.set()
        (r,) = c.wait(["j3/f1/1"])
        for fd in mine:
            os.fstat(fd)   # still this test's: raises EBADF if the run's end closed it
        assert r.error is not None and "cannot create pipes" in r.error, r.error
        assert os.listdir(scratch) == []
    finally:
        hold.set()
        for fd in mine:
            try:
                os.close(fd)
            except OSError:
                pass
        ex.close()
    assert not scratch.exists()
