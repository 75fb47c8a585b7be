"""Finished runs' cgroups are removed at a quiet moment, the queue of those waiting is
bounded, and a run key started again never inherits a queued cgroup (issue 18).

The backend is a fake of our own QuotaBackend interface (it records removals); the
executor's reaper thread is real.
"""

from __future__ import annotations

import threading
import time

from agent.execute import Executor, Limits
from agent.execute.backends import QuotaBackend, Slot
from agent.execute.executor import REMOVALS_MAX


class RecordingBackend(QuotaBackend):
    name = "recording"

    def __init__(self) -> None:
        self.removed: list[str] = []

    def remove(self, slot: Slot) -> bool:
        self.removed.append(slot.name)
        slot.removed = True
        return True


def _on_reaper(ex: Executor, fn) -> None:
    done = threading.Event()
    ex._reaper.post(lambda: (fn(), done.set()))
    assert done.wait(10)


def _until(cond) -> None:
    deadline = time.monotonic() + 10
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)


def _queue(ex: Executor, names: list[str]) -> list[Slot]:
    slots = [Slot(n, Limits(), {"memory": f"/nowhere/{n}"}) for n in names]
    _on_reaper(ex, lambda: [ex._remove_later(s) for s in slots])
    return slots


def _executor(tmp_path, due_near: list[bool]) -> tuple[Executor, RecordingBackend]:
    b = RecordingBackend()
    ex = Executor(b, str(tmp_path / "runs"), subreaper=False, guard=False)
    # a release time is always near while due_near[0]: nothing may be removed then
    ex._due_times = lambda: [time.monotonic()] if due_near[0] else []  # type: ignore[method-assign]
    return ex, b


def test_removal_waits_while_a_release_time_is_near_and_happens_when_quiet(tmp_path):
    due_near = [True]
    ex, b = _executor(tmp_path, due_near)
    try:
        _queue(ex, ["a", "b", "c"])
        _on_reaper(ex, lambda: None)
        assert b.removed == [] and list(ex._reaper.removals) == ["a", "b", "c"]
        due_near[0] = False
        _until(lambda: len(b.removed) == 3)   # the reaper's next pass is quiet
        assert b.removed == ["a", "b", "c"] and not ex._reaper.removals
    finally:
        ex.close()


def test_the_queue_of_cgroups_waiting_for_removal_is_bounded_oldest_first(tmp_path):
    due_near = [True]
    ex, b = _executor(tmp_path, due_near)
    try:
        names = [f"run-{i}" for i in range(REMOVALS_MAX + 10)]
        _queue(ex, names)
        _on_reaper(ex, lambda: None)
        assert len(ex._reaper.removals) == REMOVALS_MAX
        assert b.removed == names[:10]
        assert list(ex._reaper.removals) == names[10:]
    finally:
        ex.close()
    # close() removes what is still queued, however busy
    assert b.removed == names and not ex._reaper.removals


def test_a_run_key_started_again_gets_its_queued_cgroup_removed_first(tmp_path):
    due_near = [True]
    ex, b = _executor(tmp_path, due_near)
    try:
        _queue(ex, ["again", "other"])
        ex.take_removal("again")
        assert b.removed == ["again"] and list(ex._reaper.removals) == ["other"]
        ex.take_removal("never-queued")
        assert b.removed == ["again"]
    finally:
        ex.close()
