"""Windows, gates, progress and results (issue 37), each piece without an etcd: the
document fields and their bad_field errors, windows on a fake clock (DST included), the
start gate and the crowding rule behind a window, gates on fake sources, the progress
line parser and the rate-limited reports."""

from __future__ import annotations

import copy
import json
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from agent.config import parse_config
from agent.coordination.jobstore import StoredJob
from agent.execute.progress import MAX_LINE, ProgressChannel, check_result, parse_line
from agent.jobs import outcomes
from agent.jobs.catalog import JobEntry
from agent.jobs.crowding import Crowding
from agent.jobs.envelope import JobRejected
from agent.jobs.firing import ClaimState, Firing, FiringState
from agent.jobs.gates import GatePolicy
from agent.jobs.progress import ProgressReports
from agent.jobs.schedule import fire_id
from agent.jobs.startpolicy import GO, StartGate, wait
from agent.jobs.states import EndReason, RecordState
from agent.jobs.window import Window
from agent.jobs.windows import WindowPolicy
from tests.support.documents import parser, signed

UTC = timezone.utc
BERLIN = ZoneInfo("Europe/Berlin")
parse = parser({"t": parse_config("etcd: {insecure: true}\ntemplates: {t: {argv: [/bin/true]}}").templates["t"]})
BASE = {"v": 1, "id": "j1", "template": "t", "schedule": {"cron": "*/5 * * * * *", "tz": "UTC"}, "not_after": None}


def job(**kw: Any):
    doc = copy.deepcopy(BASE)
    doc.update(kw)
    return parse(signed(doc))


# --- the document ------------------------------------------------------------------------------

BAD = [
    ({"window": "nightly"}, "window"),
    ({"window": None}, "window"),
    ({"window": {"cron": "0 2 * * *"}}, "window.duration_s"),
    ({"window": {"duration_s": 60}}, "window.cron"),
    ({"window": {"cron": "0 2 * * *", "duration_s": 0}}, "window.duration_s"),
    ({"window": {"cron": "0 2 * * *", "duration_s": 7 * 86400 + 1}}, "window.duration_s"),
    ({"window": {"cron": "0 2 * * *", "duration_s": True}}, "window.duration_s"),
    ({"window": {"cron": "0 2 * * *", "duration_s": 60, "tz": "Mars/Olympus"}}, "window.tz"),
    ({"window": {"cron": "0 99 * * *", "duration_s": 60}}, "window.cron"),
    ({"window": {"cron": "0 2 * * *", "duration_s": 60, "end": "abort"}}, "window.end"),
    ({"window": {"cron": "0 2 * * *", "duration_s": 60, "when": 1}}, "window.when"),
    ({"window": {"cron": "0 2 * * *", "duration_s": 60, "ranges": []}}, "window.cron"),
    ({"window": []}, "window"),
    ({"window": [{"start": "2026-12-02T12:00:00Z"}]}, "window[0]"),
    ({"window": [{"start": "2026-12-02T12:00:00Z", "end": "noon"}]}, "window[0]"),
    ({"window": [{"start": "2026-12-02T12:00:00Z", "end": "2026-12-02T11:00:00Z"}]}, "window[0].end"),
    ({"window": {"ranges": "x", "end": "stop"}}, "window.ranges"),
    ({"window": {"ranges": [{"start": "2026-12-02T12:00:00Z", "end": "2026-12-02T13:00:00Z"}] * 65}}, "window.ranges"),
    ({"step_timeout_s": 0}, "step_timeout_s"),
    ({"step_timeout_s": -1}, "step_timeout_s"),
    ({"step_timeout_s": "10"}, "step_timeout_s"),
    ({"step_timeout_s": 7 * 86400 + 1}, "step_timeout_s"),
    ({"retry": {"on": ["window_open"]}}, "retry.on[0]"),
]


@pytest.mark.parametrize("changes,field", BAD, ids=[f for _, f in BAD])
def test_each_bad_value_of_a_new_field_is_bad_field_naming_it(changes, field):
    with pytest.raises(JobRejected) as ei:
        job(**changes)
    assert (ei.value.reason, ei.value.field) == ("bad_field", field), ei.value.detail
    assert ei.value.detail.startswith(field + ":")


def test_the_new_fields_parse_and_documents_without_them_are_as_before():
    j = job(window={"cron": "0 2 * * *", "duration_s": 3600, "tz": "Europe/Berlin", "end": "stop"},
            step_timeout_s=30, retry={"max_attempts": 2, "on": ["failed", "window_closed", "gate_closed"]})
    assert j.window is not None and j.window.end == "stop" and j.window.duration_s == 3600 and j.step_timeout_s == 30
    assert j.retry.retries("window_closed")
    bare = job()
    assert bare.window is None and bare.step_timeout_s is None
    assert bare.retry.on == ("failed", "timed_out")
    listed = job(window=[{"start": "2026-12-03T01:00:00+01:00", "end": "2026-12-03T02:00:00Z"}])
    assert listed.window.end == "finish" and listed.window.ranges[0][0] == datetime(2026, 12, 3, 0, 0, tzinfo=UTC)


def test_the_new_end_reasons_map_to_states_and_retry_criteria():
    assert outcomes.record_state(EndReason.STEP_TIMED_OUT) == RecordState.TIMED_OUT
    assert outcomes.criterion(EndReason.STEP_TIMED_OUT) == "timed_out"     # retried as timed_out
    assert outcomes.record_state(EndReason.WINDOW_CLOSED) == RecordState.KILLED
    assert outcomes.criterion(EndReason.WINDOW_CLOSED) == "window_closed"  # only where retry.on names it
    assert outcomes.criterion(EndReason.GATE_CLOSED) == "gate_closed"
    now = datetime(2026, 12, 2, 12, tzinfo=UTC)
    plain = job(retry={"max_attempts": 3})
    assert outcomes.after_run(plain, "window_closed", "f", 1, now, False).retry_at is None
    opted = job(retry={"max_attempts": 3, "on": ["window_closed"]})
    assert outcomes.after_run(opted, "window_closed", "f", 1, now, False).retry_at is not None
    assert outcomes.after_run(plain, "step_timed_out", "f", 1, now, False).retry_at is not None


# --- windows on a fake clock ---------------------------------------------------------------------

class FakeLoop:
    """call_later records (when, fn, args) on the fake clock; run_due() fires those due."""

    def __init__(self, clock: list):
        self.clock = clock
        self.timers: list = []

    def call_later(self, delay: float, fn: Any, *args: Any) -> Any:
        t = SimpleNamespace(when=self.clock[0] + timedelta(seconds=delay), fn=fn, args=args, cancelled=False)
        t.cancel = lambda: setattr(t, "cancelled", True)
        self.timers.append(t)
        return t

    def post(self, fn: Any, *args: Any) -> None:
        fn(*args)

    def run_due(self) -> None:
        for t in sorted([t for t in self.timers if not t.cancelled and t.when <= self.clock[0]], key=lambda t: t.when):
            self.timers.remove(t)
            t.fn(*t.args)

    def next_at(self) -> datetime:
        return min(t.when for t in self.timers if not t.cancelled)


class Audit:
    def __init__(self):
        self.records: list = []

    def record(self, type_: str, **fields: Any) -> None:
        self.records.append((type_, fields))


def firing(j: Any, due: datetime, **kw: Any) -> Firing:
    e = JobEntry(j, StoredJob(1, {"id": j.id}, 1, 1), 1, due - timedelta(days=1))
    f = Firing(e, due, fire_id(j.id, due), **kw)
    e.firings[f.fire_id] = f
    return f


def local(*a: int, fold: int = 0) -> datetime:
    return datetime(*a, tzinfo=BERLIN, fold=fold).astimezone(UTC)


def test_a_window_across_spring_forward_opens_and_closes_at_the_right_local_times():
    """`30 2 * * *` in Berlin on 29 March 2026: 02:30 does not exist; the window opens at the
    first valid instant (03:00 CEST, as a schedule would fire) and lasts its 3600 s of
    elapsed time (to 04:00 CEST). The policy on a fake clock waits, wakes, and lets it go
    exactly then."""
    clock = [local(2026, 3, 29, 1, 0)]
    loop, audit = FakeLoop(clock), Audit()
    pol = WindowPolicy(loop, 1.0, audit, cancel_job=lambda e, r: None, clock=lambda: clock[0])
    j = job(window={"cron": "30 2 * * *", "duration_s": 3600, "tz": "Europe/Berlin"})
    f = firing(j, clock[0])
    v = pol.judge(f)
    assert (v.kind, v.reason) == ("wait", "window") and "2026-03-29T01:00:00.000000Z" in v.detail
    woken: list = []
    pol.subscribe(f, lambda: woken.append(clock[0]))
    assert loop.next_at() - local(2026, 3, 29, 3, 0) < timedelta(milliseconds=5)   # 03:00 CEST = 01:00 UTC
    clock[0] = loop.next_at()
    loop.run_due()
    assert woken and pol.judge(f) is GO
    assert j.window.closes_at(clock[0]) == local(2026, 3, 29, 4, 0)
    clock[0] = local(2026, 3, 29, 3, 59, 59)
    assert pol.judge(f) is GO
    clock[0] = local(2026, 3, 29, 4, 0)
    assert pol.judge(f).kind == "wait"


def test_a_window_across_fall_back_opens_once_at_the_first_occurrence():
    """`30 2 * * *` on 25 October 2026: 02:30 happens twice (CEST, then CET); the window
    opens at the first (00:30 UTC) only, and its 1800 s end at the second 03:00 wall time,
    which is 02:00 CET; the next opens on the 26th at 02:30 CET."""
    w = Window.parse({"cron": "30 2 * * *", "duration_s": 1800, "tz": "Europe/Berlin"})
    first = local(2026, 10, 25, 2, 30, fold=0)
    assert w.next_open(local(2026, 10, 25, 0, 0)) == first == datetime(2026, 10, 25, 0, 30, tzinfo=UTC)
    assert w.closes_at(first) == datetime(2026, 10, 25, 1, 0, tzinfo=UTC)   # 02:00 CET
    assert not w.is_open(local(2026, 10, 25, 2, 30, fold=1))                 # the second 02:30
    assert w.next_open(local(2026, 10, 25, 2, 30, fold=1)) == local(2026, 10, 26, 2, 30)


def test_skip_misfires_at_once_retries_always_wait_and_no_window_ever_again_misfires():
    clock = [datetime(2026, 12, 2, 12, 0, 30, tzinfo=UTC)]
    pol = WindowPolicy(FakeLoop(clock), 1.0, Audit(), cancel_job=lambda e, r: None, clock=lambda: clock[0])
    win = {"cron": "0 * * * * *", "duration_s": 20, "tz": "UTC"}
    skip = firing(job(window=win, misfire="skip"), clock[0])
    assert (pol.judge(skip).kind, pol.judge(skip).state) == ("end", RecordState.MISFIRED)
    retry = firing(job(window=win, misfire="skip"), clock[0], claim=ClaimState({"state": "retrying"}, 5))
    assert pol.judge(retry).kind == "wait"
    past = firing(job(window=[{"start": "2026-12-01T00:00:00Z", "end": "2026-12-01T01:00:00Z"}]), clock[0])
    v = pol.judge(past)
    assert (v.kind, v.state, v.reason) == ("end", RecordState.MISFIRED, "window")
    # claimed ahead of its due time: judged at the due time
    ahead = firing(job(window=win), datetime(2026, 12, 2, 12, 1, 0, tzinfo=UTC))
    clock[0] = datetime(2026, 12, 2, 12, 0, 59, 800000, tzinfo=UTC)
    assert pol.judge(ahead) is GO


def test_end_stop_terminates_kill_grace_before_the_close_and_cancel_cancels_the_job():
    clock = [datetime(2026, 12, 2, 12, 0, 2, tzinfo=UTC)]
    loop, cancelled = FakeLoop(clock), []
    pol = WindowPolicy(loop, 3.0, Audit(), cancel_job=lambda e, r: cancelled.append((e.job.id, r)),
                       clock=lambda: clock[0])
    for end, expect in (("stop", []), ("cancel", [("j1", "window_closed")])):
        j = job(window={"cron": "0 * * * * *", "duration_s": 20, "tz": "UTC", "end": end})
        f = firing(j, clock[0])
        assert pol.judge(f) is GO
        f.state, stops = FiringState.RUNNING, []
        f.handle = SimpleNamespace(terminate=lambda reason, stops=stops: stops.append((clock[0], reason)))
        pol.run_started(f)
        assert loop.next_at() == datetime(2026, 12, 2, 12, 0, 17, tzinfo=UTC)   # 20 s window, 3 s grace
        clock[0] = loop.next_at()
        loop.run_due()
        assert stops == [(clock[0], EndReason.WINDOW_CLOSED)] and cancelled == expect
        clock[0] = datetime(2026, 12, 2, 12, 0, 2, tzinfo=UTC)
    # a run with less than kill_grace_s of its window left does not start
    clock[0] = datetime(2026, 12, 2, 12, 0, 18, tzinfo=UTC)
    assert pol.judge(firing(job(window={"cron": "0 * * * * *", "duration_s": 20, "end": "stop"}), clock[0])).kind == "wait"


# --- the start gate and crowding ------------------------------------------------------------------

class Policy:
    def __init__(self, name: str, verdicts: list):
        self.name, self.verdicts, self.subs = name, verdicts, []

    def judge(self, f: Firing) -> Any:
        return self.verdicts[0]

    def subscribe(self, f: Firing, wake: Any) -> Any:
        self.subs.append(wake)
        return lambda: self.subs.remove(wake)


def test_the_start_gate_waits_on_the_first_policy_that_says_so_and_listens_to_those_before_it():
    sent: list = []
    statuses = SimpleNamespace(send=lambda e, f, state, **kw: sent.append((state, kw.get("reason"))))
    marks = SimpleNamespace(log=[], waiting=lambda f, r, d: marks.log.append(("wait", r)),
                            done=lambda f: marks.log.append(("done",)))
    a, b = Policy("window", [GO]), Policy("gate", [wait("gate:line")])
    gate = StartGate([a, b], statuses, None)
    gate.marks = marks
    f = firing(job(), datetime(2026, 12, 2, 12, tzinfo=UTC))
    f.notes["gate"] = 1.0
    went: list = []
    gate.request(f, went.append, lambda *x: None)
    assert f.state == FiringState.WAITING and sent == [("waiting", "gate:line")] and len(a.subs) == len(b.subs) == 1
    a.verdicts[0] = wait("window")   # the window closed meanwhile: it wakes the firing
    a.subs[0]()
    assert f.wait_reason == "window" and "gate" not in f.notes and sent[-1] == ("waiting", "window")
    assert not gate.still(f)
    a.verdicts[0], b.verdicts[0] = GO, GO
    a.subs[0]()
    assert went == [f] and a.subs == b.subs == [] and marks.log == [("wait", "gate:line"), ("wait", "window"), ("done",)]


def crowded(misfire: str, overlap: str = "forbid", limit: int = 10):
    j = job(misfire=misfire, overlap=overlap, **({"misfire_limit": limit} if misfire == "run_all" else {}))
    waiting = firing(j, datetime(2026, 12, 2, 12, 0, 25, tzinfo=UTC))
    waiting.move(FiringState.WAITING, wait_reason="window")
    new = firing(j, datetime(2026, 12, 2, 12, 0, 30, tzinfo=UTC))
    gone: list = []
    c = Crowding(lambda g: gone.append(("unqueued", g.fire_id)), lambda g, why: gone.append((g.fire_id, why)))
    return c, waiting, new, gone


def test_behind_a_window_the_misfire_policy_decides_which_firings_wait():
    c, waiting, new, gone = crowded("run_once")
    assert c.admit(new.entry, new, [waiting])          # the newest waits; the one before is misfired `window`
    assert gone == [("unqueued", waiting.fire_id), (waiting.fire_id, "window")]
    c, waiting, new, gone = crowded("run_all", limit=3)
    e = new.entry
    assert not c.admit(e, new, [waiting]) and e.backlog == [new.due] and new.fire_id not in e.firings and gone == []
    e.backlog.append(new.due + timedelta(seconds=5))
    third = firing(e.job, new.due + timedelta(seconds=10))
    assert not c.admit(e, third, [waiting])            # four firings: the oldest goes
    assert gone == [("unqueued", waiting.fire_id), (waiting.fire_id, "window")] and len(e.backlog) == 3
    c, waiting, new, gone = crowded("run_once")
    waiting.claim = ClaimState({"state": "retrying"}, 4)   # a retry keeps its place: the overlap rule
    assert not c.admit(new.entry, new, [waiting]) and gone == [(new.fire_id, "overlap")]
    c, waiting, new, gone = crowded("skip", overlap="replace")
    waiting.wait_reason = "quota"                      # not behind a window: the overlap policy, as before
    assert c.admit(new.entry, new, [waiting]) and gone[-1] == (waiting.fire_id, EndReason.REPLACED)


# --- gates on fake sources ------------------------------------------------------------------------

GATED = parse_config("""
etcd: {insecure: true}
templates:
  t: {argv: [/bin/true]}
  g:
    argv: [/bin/true]
    gates: {line: {mqtt: plant/line2/state, equals: stopped}}
    gate_timeout_s: 30
    while_running: stop
""").templates


class Topics:
    def __init__(self):
        self.values: dict = {}
        self.fns: list = []

    def value(self, topic: str) -> Any:
        return self.values.get(topic)

    def listen(self, fn: Any) -> None:
        self.fns.append(fn)

    def set(self, topic: str, value: Any) -> None:
        self.values[topic] = value
        for fn in self.fns:
            fn(topic)


def gated_firing(template: str = "g") -> Firing:
    doc = dict(BASE, template=template)
    j = parser(GATED)(signed(doc))
    return firing(j, datetime(2026, 12, 2, 12, tzinfo=UTC))


def test_a_gate_holds_a_firing_until_its_value_matches_and_then_times_out_on_a_fake_clock():
    t, topics, audit = [100.0], Topics(), Audit()
    pol = GatePolicy(GATED, FakeLoop([datetime(2026, 12, 2, tzinfo=UTC)]), audit, topics=topics, clock=lambda: t[0])
    f = gated_firing()
    v = pol.judge(f)
    assert (v.kind, v.reason) == ("wait", "gate:line") and "unknown" in v.detail   # no value yet: closed
    woken: list = []
    cancel = pol.subscribe(f, lambda: woken.append(1))
    topics.set("plant/line2/state", b"running")
    assert pol.judge(f).kind == "wait" and woken == [1]
    topics.set("plant/line2/state", b"stopped")
    assert pol.judge(f) is GO and len(woken) == 2
    cancel()
    topics.set("plant/line2/state", b"running")
    g = gated_firing()
    pol.judge(g)
    t[0] += 30
    v = pol.judge(g)
    assert (v.kind, v.state, v.reason) == ("end", RecordState.FAILED, EndReason.GATE_TIMEOUT)
    assert pol.judge(gated_firing("t")) is GO                       # ungated templates are not asked
    events = [r["event"] for k, r in audit.records if k == "gate"]
    assert events.count("changed") == 3 and {"waits", "released", "gate_timeout"} <= set(events)


def test_while_running_stop_stops_a_run_when_its_gate_closes_and_not_when_it_is_unknown():
    topics = Topics()
    topics.values["plant/line2/state"] = b"stopped"
    pol = GatePolicy(GATED, FakeLoop([datetime(2026, 12, 2, tzinfo=UTC)]), Audit(), topics=topics)
    f = gated_firing()
    f.state, stops = FiringState.RUNNING, []
    f.handle = SimpleNamespace(terminate=stops.append)
    pol.run_started(f)
    del topics.values["plant/line2/state"]   # the broker went away: unknown
    topics.fns[0]("plant/line2/state")
    assert stops == []
    topics.set("plant/line2/state", b"running")
    assert stops == [EndReason.GATE_CLOSED]


# --- progress lines and results ---------------------------------------------------------------------

@pytest.mark.parametrize("line,ok", [
    (b'{"progress": 50, "step": "flush", "detail": {"l": 3}}', True),
    (b'{"step": "x"}', True),
    (b'{"result": {"a": 1}}', True),
    (b'{"progress": 101}', False),
    (b'{"progress": true}', False),
    (b'{"progress": NaN}', False),
    (b'{"step": 5}', False),
    (b'{"step": "' + b"x" * 201 + b'"}', False),
    (b'{"detail": []}', False),
    (b'{"other": 1}', False),
    (b'[1, 2]', False),
    (b'\xff{}', False),
])
def test_a_progress_line_is_valid_only_in_the_contracts_shape(line, ok):
    obj, why = parse_line(line)
    assert (obj is not None) == ok and (why is None) == ok


def test_results_over_4_kib_or_not_objects_are_refused_never_cut():
    assert check_result({"a": "x" * 4000}) is None
    assert "at most 4096" in check_result({"a": "x" * 4100})
    assert check_result([1]) == "not a JSON object"


def test_the_channel_splits_lines_across_reads_and_skips_an_overlong_one(tmp_path):
    import os

    fifo, res = str(tmp_path / "p"), str(tmp_path / "r")
    os.mkfifo(fifo)
    open(res, "w").close()
    ch = ProgressChannel(fifo, res, 10.0)
    ch.feed(b'{"progress": 1')
    ch.feed(b'0, "step": "a"}\n{"step": "b"}\n' + b"y" * (MAX_LINE + 10))
    ch.feed(b'zz\n{"step": "c", "result": {"n": 1}}\n')
    assert [d["step"] for d in ch.take()] == ["a", "b", "c"] and ch.invalid == 1
    assert ch.finish() == ({"n": 1}, None)
    assert not os.path.exists(fifo)
    with open(res, "w") as fh:
        fh.write(json.dumps({"from": "file"}))
    os.mkfifo(str(tmp_path / "p2"))
    ch2 = ProgressChannel(str(tmp_path / "p2"), res, None)
    ch2.feed(b'{"result": {"from": "line"}}\n')
    assert ch2.finish() == ({"from": "file"}, None)   # the file wins when the job wrote one


def test_progress_reports_are_rate_limited_and_the_newest_line_is_never_lost():
    t, clock = [0.0], [datetime(2026, 12, 2, tzinfo=UTC)]
    loop = FakeLoop(clock)
    sent, written = [], []
    statuses = SimpleNamespace(send=lambda e, f, state, **kw: sent.append((t[0], kw["progress"]["step"])))
    records = SimpleNamespace(write_progress=lambda f, p: written.append((t[0], p["step"])) or True)
    rep = ProgressReports(statuses, records, loop, clock=lambda: t[0])
    f = gated_firing("t")
    f.state, f.handle = FiringState.RUNNING, SimpleNamespace(pid=None)   # a RunHandle before its release
    for i in range(30):   # 30 lines in 3 s
        t[0] = i / 10
        clock[0] = datetime(2026, 12, 2, tzinfo=UTC) + timedelta(seconds=t[0])
        loop.run_due()
        rep.seen(f, f.handle, [{"step": f"s{i}", "at": 1.0}])
    t[0] = 10.0
    clock[0] = datetime(2026, 12, 2, tzinfo=UTC) + timedelta(seconds=10)
    loop.run_due()
    assert [s for _, s in sent][0] == "s0" and sent[-1][1] == "s29"
    assert all(b[0] - a[0] >= 1.0 - 1e-9 for a, b in zip(sent, sent[1:])) and len(sent) <= 5
    assert written[0][1] == "s0" and written[-1][1] == "s29" and len(written) == 2


def test_gate_config_errors_name_the_key():
    from agent.config import ConfigError

    with pytest.raises(ConfigError) as ei:
        parse_config("""
etcd: {insecure: true}
templates:
  t:
    argv: [/bin/true]
    gates:
      a: {mqtt: "plant/+/state", equals: x}
      b: {etcd: jobs/x, equals: "1"}
      c: {command: [rel]}
      d: {mqtt: plant/x}
      e: {}
      f: {command: [/bin/true], timeout_s: 0}
    gate_timeout_s: 0
    while_running: halt
""")
    keys = sorted(p.split(": ")[1] for p in ei.value.problems)
    assert keys == ["templates.t.gate_timeout_s", "templates.t.gates.a.mqtt", "templates.t.gates.b.etcd",
                    "templates.t.gates.c.command", "templates.t.gates.d.equals", "templates.t.gates.e",
                    "templates.t.gates.f.timeout_s", "templates.t.while_running"]


def test_a_window_shorter_than_kill_grace_with_end_stop_waits_without_spinning():
    clock = [datetime(2026, 12, 2, 12, 0, 0, 500000, tzinfo=UTC)]
    loop = FakeLoop(clock)
    pol = WindowPolicy(loop, 3.0, Audit(), cancel_job=lambda e, r: None, clock=lambda: clock[0])
    f = firing(job(window={"cron": "0 * * * * *", "duration_s": 2, "end": "stop"}), clock[0])
    assert pol.judge(f).kind == "wait"
    pol.subscribe(f, lambda: None)
    assert loop.next_at() >= datetime(2026, 12, 2, 12, 0, 2, tzinfo=UTC)   # the close, not now again
