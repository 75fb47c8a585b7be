"""A firing's states (agent/jobs/firing.py): one table, one way to move."""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from types import SimpleNamespace

from agent.jobs.firing import ACTIVE, NOT_STARTED, TERMINAL, TRANSITIONS, Firing, FiringState
from agent.jobs.outcomes import RETRYABLE

S = FiringState


def firing() -> Firing:
    entry = SimpleNamespace(job=SimpleNamespace(id="j1"))
    return Firing(entry, datetime(2026, 12, 2, 12, tzinfo=timezone.utc), "20261202T120000.000Z")


def test_every_state_has_a_row_and_only_done_is_final():
    assert set(TRANSITIONS) == set(FiringState)
    assert [s for s, to in TRANSITIONS.items() if not to] == [S.DONE]
    for s in FiringState:
        if s is not S.DONE:
            assert S.DONE in TRANSITIONS[s], s  # any live firing can be given up or finished


def test_busy_and_cancellable_states_split_the_live_ones():
    live = set(FiringState) - {S.DONE}
    assert ACTIVE | NOT_STARTED == live and not ACTIVE & NOT_STARTED


def test_a_run_that_fails_once_and_then_succeeds_moves_only_along_the_table(caplog):
    f = firing()
    assert f.state is S.PENDING
    with caplog.at_level(logging.ERROR, logger="agent.jobs.firing"):
        for to in (S.WAITING, S.CLAIMING, S.RUNNING, S.RETRYING, S.RETRYING_ADMISSION, S.CLAIMING, S.RUNNING, S.DONE):
            f.move(to)
    assert f.state is S.DONE and not caplog.records


def test_a_move_outside_the_table_is_logged_and_still_made(caplog):
    f = firing()
    f.move(S.DONE)
    with caplog.at_level(logging.ERROR, logger="agent.jobs.firing"):
        f.move(S.RUNNING)
    assert f.state is S.RUNNING
    assert [r.fields for r in caplog.records] == [{"job": "j1", "fire_id": f.fire_id, "from": "done", "to": "running"}]


def test_wait_reason_is_set_by_the_move_that_waits():
    f = firing()
    f.move(S.WAITING, wait_reason="quota")
    assert f.wait_reason == "quota"
    f.move(S.CLAIMING)
    assert f.wait_reason == "quota"  # kept for the record: why it had waited


def test_the_record_states_are_the_contract_ones():
    assert TERMINAL == {"succeeded", "failed", "timed_out", "killed", "cancelled", "misfired", "aborted"}
    assert RETRYABLE < TERMINAL
