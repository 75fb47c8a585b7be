"""The status outbox on a state disk that fills up (issue 35): a real Outbox on a small
tmpfs mounted for the test, filled until SQLite's own writes fail with SQLITE_FULL, then
freed. Nothing raises into the writers, what was held is written in order once the disk
has room again, and the bound drops (and reports) exactly the excess."""

from __future__ import annotations

import errno
import logging
import os
import threading

import pytest

from agent.cloud.outbox import Outbox, OutboxPublisher, error_kind
from agent.cloud.outboxwriter import OutboxWriter
from agent.runtime.loop import EventLoop
from agent.runtime.metrics import sample
from tests.support.kernel import own_tmpfs
from tests.support.link import FakeLink
from tests.support.waiting import wait_for

TOPIC = "millwright/t/agents/a1/status/j"


@pytest.fixture
def small_disk():
    with own_tmpfs("1m", "0700", "mw-small-disk-") as path:
        yield path


def fill(disk: str) -> str:
    """Write a file until the file system says ENOSPC; returns its path."""
    filler = os.path.join(disk, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    try:
        while True:
            os.write(fd, b"\0")
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


@pytest.fixture
def loop():
    lp = EventLoop()
    t = threading.Thread(target=lp.run, name="test-loop", daemon=True)
    t.start()
    yield lp
    lp.stop()
    t.join(5)


def on_loop(lp: EventLoop):
    """The component's schedule: a timer on the loop, armed from any thread."""
    return lambda delay, fn: lp.post(lp.call_later, delay, fn)


def status(n: int, state: str = "running") -> dict:
    return {"v": 1, "job_id": f"j{n}", "state": state, "n": n}


def rows(ob: Outbox) -> list[tuple[int, dict]]:
    import json

    return [(seq, json.loads(payload)) for seq, _, payload, _ in ob.batch(0, 100000)]


def errors(kind: str) -> float:
    return sample("millwright_mqtt_outbox_write_errors_total", {"error": kind}) or 0.0


def test_a_full_state_disk_holds_statuses_and_writes_them_in_order_once_freed(small_disk, loop, caplog):
    caplog.set_level(logging.INFO, logger="agent.cloud.outboxwriter")
    records: list = []
    ob = Outbox(os.path.join(small_disk, "outbox.sqlite"), 1000)
    writer = OutboxWriter(ob, schedule=on_loop(loop), record=lambda t, **f: records.append((t, f)),
                          min_backoff_s=0.01, max_backoff_s=0.05)
    ob.on_drop = writer.dropped
    try:
        writer.write([(TOPIC, status(0), None)])
        assert ob.depth == 1 and not writer.failing
        before = errors("disk_full")
        filler = fill(small_disk)

        # the three writers: the loop's batches, a republished answer (marker), a checkpoint
        for n in range(1, 41, 4):
            writer.write([(TOPIC, status(n + i), None) for i in range(4)])
        writer.write([(TOPIC, status(41, "succeeded"), "answers/0/j41/run.1")])
        writer.write([("millwright/t/agents/a1/audit/checkpoint", {"v": 1, "n": 42, "kind": "head"}, None)])

        assert writer.failing and writer.held == 42
        assert ob.depth == 1                               # nothing reached SQLite
        assert sample("millwright_mqtt_outbox_held") == 42
        assert writer.has_marker("answers/0/j41/run.1")    # the answers' sweep leaves it to us
        assert [r for r in records if r[0] == "mqtt"] == [
            ("mqtt", {"event": "outbox_write_failed", "error": "disk_full",
                      "detail": "database or disk is full", "path": ob.path})]
        # the retry timer keeps trying (and failing) while the disk stays full
        wait_for(lambda: errors("disk_full") >= before + 3, 30, what="retries on the loop")
        assert writer.held == 42
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "agent.cloud.outboxwriter"]
        assert len(warned) == 1 and "held in memory" in warned[0].getMessage()  # once per outage

        os.unlink(filler)
        wait_for(lambda: not writer.failing, 30, what="the held statuses written")
        writer.write([(TOPIC, status(43, "succeeded"), None)])   # after the recovery: behind them

        got = rows(ob)
        assert [seq for seq, _ in got] == list(range(1, 45))     # one sequence, nothing lost
        assert [d["n"] for _, d in got] == list(range(44))       # in the order written
        assert ob.has_marker("answers/0/j41/run.1")
        assert writer.held == 0 and sample("millwright_mqtt_outbox_held") == 0
        (recovered,) = [f for t, f in records if t == "mqtt" and f["event"] == "outbox_write_recovered"]
        assert recovered["written"] == 42 and recovered["dropped"] == 0 and recovered["error"] == "disk_full"
        assert recovered["attempts"] >= 4
        assert any("writable again" in r.getMessage() for r in caplog.records)
        assert not [t for t, _ in records if t == "gap"]
    finally:
        writer.close()
        ob.close()


@pytest.mark.parametrize("policy,kept", [
    # 25 documents held with a bound of 10: every fifth is a final answer
    ("drop_oldest_terminal", [0, 5, 10, 15, 20, 21, 22, 23, 24, 19]),
    ("drop_oldest", list(range(15, 25))),
    ("reject_new", list(range(10))),
])
def test_the_memory_bound_drops_the_excess_by_policy_and_reports_it(small_disk, loop, policy, kept):
    records: list = []
    ob = Outbox(os.path.join(small_disk, "outbox.sqlite"), 10, policy)
    writer = OutboxWriter(ob, schedule=on_loop(loop), record=lambda t, **f: records.append((t, f)),
                          min_backoff_s=0.01, max_backoff_s=0.05)
    ob.on_drop = writer.dropped
    dropped_before = sample("millwright_mqtt_outbox_dropped_total", {"policy": policy}) or 0.0
    try:
        filler = fill(small_disk)
        for n in range(25):
            writer.write([(TOPIC, status(n, "succeeded" if n % 5 == 0 else "running"), None)])
        assert writer.held == 10
        assert sample("millwright_mqtt_outbox_dropped_total", {"policy": policy}) == dropped_before + 15
        writer.flush_gap()   # the publisher's tick
        assert [f for t, f in records if t == "gap"] == [
            {"source": "mqtt_outbox", "count": 15, "reason": f"outbox_full:{policy}"}]

        os.unlink(filler)
        wait_for(lambda: not writer.failing, 30, what="the held statuses written")
        assert sorted(d["n"] for _, d in rows(ob)) == sorted(kept)
        ns = [d["n"] for _, d in rows(ob)]
        assert ns == sorted(ns)                                   # still in the order written
        (recovered,) = [f for t, f in records if t == "mqtt" and f["event"] == "outbox_write_recovered"]
        assert recovered["written"] == 10 and recovered["dropped"] == 15
        writer.flush_gap()
        assert len([t for t, _ in records if t == "gap"]) == 1   # nothing more was lost
    finally:
        writer.close()
        ob.close()


def test_a_clean_stop_tries_once_more_then_reports_what_is_lost(small_disk, caplog):
    never = lambda delay, fn: None  # noqa: E731 - no retry timer: only close() writes again
    ob = Outbox(os.path.join(small_disk, "outbox.sqlite"), 1000)
    writer = OutboxWriter(ob, schedule=never, record=lambda t, **f: None)
    filler = fill(small_disk)
    try:
        writer.write([(TOPIC, status(n), None) for n in range(3)])
        assert writer.held == 3
        assert writer.close() == 3                  # still full: the one more try fails
        assert writer.held == 3
        (line,) = [r for r in caplog.records if "lost" in r.getMessage()]
        assert line.levelno == logging.WARNING and line.fields["count"] == 3
        writer.write([(TOPIC, status(9), None)])    # after the stop (the audit's last checkpoint)
        assert writer.held == 3 and ob.depth == 0
    finally:
        ob.close()

    os.unlink(filler)
    ob = Outbox(os.path.join(small_disk, "outbox.sqlite"), 1000)
    writer = OutboxWriter(ob, schedule=never, record=lambda t, **f: None)
    try:
        writer.write([(TOPIC, status(0), None)])
        filler = fill(small_disk)
        writer.write([(TOPIC, status(n), None) for n in range(1, 4)])
        assert writer.held == 3
        os.unlink(filler)
        assert writer.close() == 0                  # the disk has room again: written at the stop
        assert [d["n"] for _, d in rows(ob)] == [0, 1, 2, 3]
    finally:
        ob.close()


def test_the_publisher_waits_for_the_disk_with_one_warning_and_then_publishes(small_disk, caplog):
    """Rows are marked sent before they go out: while that write is refused nothing goes out."""
    caplog.set_level(logging.INFO, logger="agent.cloud.outbox")
    ob = Outbox(os.path.join(small_disk, "outbox.sqlite"), 1000)
    ob.enqueue_many([(TOPIC, status(n), None) for n in range(5)])
    link = FakeLink()
    pub = OutboxPublisher(ob, link)
    before = errors("disk_full")
    filler = fill(small_disk)
    pub.start()
    try:
        wait_for(lambda: errors("disk_full") >= before + 2, 30, what="the publisher trying again")
        assert link.sent == []
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "agent.cloud.outbox"]
        assert [r.getMessage() for r in warned] == ["status outbox cannot be written: nothing is published until it can be"]
        os.unlink(filler)
        wait_for(lambda: len(link.sent) == 5, 30, what="the rows published")
        assert [d["n"] for _, _, d in link.sent] == list(range(5))
        wait_for(lambda: any("writable again" in r.getMessage() for r in caplog.records), 30, what="the recovery line")
    finally:
        pub.stop()
        ob.close()


@pytest.mark.parametrize("message,kind", [
    ("database or disk is full", "disk_full"),
    ("disk I/O error", "io_error"),
    ("attempt to write a readonly database", "read_only"),
    ("database is locked", "locked"),
    ("unable to open database file", "cannot_open"),
    ("no such table: outbox", "other"),
])
def test_error_kinds_are_a_bounded_label(message, kind):
    import sqlite3

    assert error_kind(sqlite3.OperationalError(message)) == kind
    assert error_kind(OSError(errno.ENOSPC, "No space left on device")) == "disk_full"
    assert error_kind(OSError(errno.EROFS, "Read-only file system")) == "read_only"
