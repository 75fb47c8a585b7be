"""The scheduler's pieces, each built without an etcd: the catalog's trust check at load,
recovery of what earlier owners left, the outcome policy, admission holds, record
documents, claim read-backs, and the pipeline resolving an orphaned run."""

from __future__ import annotations

import base64
import dataclasses
import json
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest

from agent.config import parse_config
from agent.coordination import placement
from agent.coordination.etcd import KV
from agent.coordination.fencing import Fence
from agent.coordination.jobstore import StoredJob
from agent.coordination.keys import Keys, shard_of
from agent.execute.admission import Admission, Budget
from agent.execute.limits import Limits
from agent.jobs import outcomes, recovery
from agent.jobs.admitting import Admitter
from agent.jobs.catalog import JobCatalog, JobEntry
from agent.jobs.claims import Claim, ClaimKind, ClaimWriter
from agent.jobs.firing import ClaimState, Firing, FiringState
from agent.jobs.records import RunRecords
from agent.jobs.render import run_id
from agent.jobs.schedule import RetryPolicy, fire_id, format_rfc3339
from agent.jobs.scheduler import Scheduler
from agent.jobs.signing import KeyRing, sign
from agent.jobs.states import EndReason, RecordState
from agent.jobs.statuses import Statuses
from agent.runtime.loop import EventLoop

UTC = timezone.utc
SECRET = base64.b64encode(bytes(range(32))).decode()
RING = KeyRing.from_mapping({"cloud-1": {"alg": "hmac-sha256", "secret": SECRET}})
CFG = parse_config("cluster: plant-a\nagent_id: gw-1\nshards: 8\netcd: {insecure: true}\n"
                   "templates: {noop: {argv: [/bin/true], user: root, allow_root: true}}\n")
KEYS = Keys(CFG.cluster)
NOW = datetime.now(UTC).replace(microsecond=0)


class Agent:
    """The seams the jobs package asks of the agent, recorded."""

    def __init__(self, fence: Any = None):
        self.fence, self.statuses, self.audit, self.released = fence, [], [], 0

    def fence_for(self, unit: int) -> Any:
        return self.fence

    def owns(self, unit: int) -> Any:
        return self.fence

    def held(self, unit: int) -> Any:
        return self.fence

    def release_idle(self) -> None:
        self.released += 1

    def waiting_on_runs(self) -> bool:
        return True   # as while a shard waits to move: every settled shard is checked

    def publish_status(self, doc: dict) -> None:
        self.statuses.append(doc)

    def record(self, type_: str, **fields: Any) -> None:
        self.audit.append((type_, fields))

    def pool_of_unit(self, unit: int) -> str:
        return placement.DEFAULT_POOL

    def unit_of(self, pool: str, storage: int) -> int:
        return storage


class Workers:
    """An etcd worker pool that runs each call at once, on the caller's thread."""

    max_threads = 1

    def submit(self, op: Any, done: Any) -> None:
        try:
            result = op()
        except Exception as exc:
            done(None, exc)
            return
        done(result, None)


class InlineLoop(EventLoop):
    """A loop never run: what is posted to it runs at once, on the caller's thread."""

    def post(self, fn: Any, *args: Any) -> None:
        fn(*args)


def stored(job_id: str, schedule: dict, **kw: Any) -> StoredJob:
    doc = {"v": 1, "id": job_id, "cluster": CFG.cluster, "kind": "job", "template": "noop", "params": {},
           "schedule": schedule, "issued_at": format_rfc3339(NOW), **kw}
    if "cron" in schedule:
        doc.setdefault("not_after", None)   # a recurring job's lifetime is signed (here: until cancelled)
    signed = dict(sign(doc, RING, "cloud-1"), _accepted={"at": format_rfc3339(NOW - timedelta(hours=1)), "by": "x"})
    return StoredJob(shard_of(job_id, CFG.shards), signed, 7, 7)


def catalog_with(agent: Agent, listener: Any = None) -> JobCatalog:
    c = JobCatalog(CFG, None, KEYS, agent, agent, EventLoop(), Workers(), RING, audit=agent, statuses=agent)
    c.listener = listener
    c.loaded.update({s: 1 for s in range(CFG.shards)})   # as after each shard's load
    return c


EARLIER = format_rfc3339(NOW - timedelta(hours=2))


def entry(job_id: str = "j1", schedule: Any = None, **kw: Any) -> JobEntry:
    installed: list[JobEntry] = []
    c = catalog_with(Agent(), SimpleNamespace(job_installed=lambda e, r: installed.append(e)))
    c.job_stored(stored(job_id, schedule if schedule is not None else {"cron": "0 * * * *", "tz": "UTC"}, **kw))
    (e,) = installed
    return e


# --- catalog --------------------------------------------------------------------------------

def test_the_catalog_installs_a_job_signed_for_its_cluster_and_refuses_a_forged_one():
    agent, installed = Agent(), []
    c = catalog_with(agent, SimpleNamespace(job_installed=lambda e, r: installed.append(e.job.id)))
    c.job_stored(stored("good", {"delay_s": 60}))
    forged = stored("forged", {"delay_s": 60})
    forged.doc["params"] = {"x": "1"}          # changed after signing
    c.job_stored(forged)
    assert installed == ["good"] and set(c.entries) == {"good"}
    (st,) = agent.statuses
    assert (st["job_id"], st["state"], st["reason"], st["source"]) == ("forged", "rejected", "bad_signature", "store")
    assert [f["event"] for t, f in agent.audit] == ["rejected_stored"]


def test_the_catalog_tells_its_listener_of_a_cancel_and_a_dropped_shard():
    seen: list[tuple] = []
    listener = SimpleNamespace(job_installed=lambda e, r: seen.append(("installed", e.job.id)),
                               job_cancelled=lambda e, why: seen.append(("cancelled", e.job.id, why)),
                               job_dropped=lambda e, why: seen.append(("dropped", e.job.id, why)))
    c = catalog_with(Agent(), listener)
    s = stored("j1", {"delay_s": 60})
    c.job_stored(s)
    c.job_cancelled("j1")
    c.shard_lost(s.shard, "expired")
    assert seen == [("installed", "j1"), ("cancelled", "j1", "cancelled"), ("dropped", "j1", EndReason.SHARD_LOST)]
    assert c.entries == {} and c.by_shard == {}


def test_a_signed_job_copied_to_another_key_or_shard_is_refused_and_its_copy_cannot_cancel_the_real_one():
    agent, seen = Agent(), []
    c = catalog_with(agent, SimpleNamespace(job_installed=lambda e, r: seen.append(("installed", e.job.id)),
                                            job_cancelled=lambda e, why: seen.append(("cancelled", e.job.id))))
    real = stored("flash-fw", {"delay_s": 60})
    home = KEYS.job(real.shard, "flash-fw")
    c.job_stored(dataclasses.replace(real, key=home))
    other = (real.shard + 1) % CFG.shards
    c.job_stored(dataclasses.replace(real, shard=other, key=KEYS.job(other, "flash-fw")))      # another shard
    c.job_stored(dataclasses.replace(real, key=KEYS.job(real.shard, "flash-fw-2")))            # another name
    cancelled_copy = dict(real.doc, _cancelled={"at": "x", "by": "y"})
    c.job_stored(dataclasses.replace(real, doc=cancelled_copy, shard=other, key=KEYS.job(other, "flash-fw")))
    assert seen == [("installed", "flash-fw")]
    assert [(d["reason"], d["source"]) for d in agent.statuses] == [("misplaced", "store")] * 2
    assert all(f["reason"] == "misplaced" for t, f in agent.audit)


def test_a_one_shot_signed_long_ago_never_run_and_due_is_a_replay():
    agent, seen = Agent(), []
    c = catalog_with(agent, SimpleNamespace(job_installed=lambda e, r: seen.append(e.job.id)))
    old = format_rfc3339(NOW - timedelta(days=400))
    c.job_stored(stored("re-put-2020", {"at": format_rfc3339(NOW - timedelta(days=399))}, issued_at=old))
    c.job_stored(stored("far-ahead", {"at": format_rfc3339(NOW + timedelta(days=1))}, issued_at=old))
    c.job_stored(stored("fresh", {}))
    assert seen == ["far-ahead", "fresh"]
    (st,) = agent.statuses
    assert (st["job_id"], st["reason"]) == ("re-put-2020", "too_old") and "a replay is never run" in st["detail"]


def test_a_live_job_deleted_or_tombstoned_outside_retention_is_stopped_and_says_so():
    seen: list = []
    listener = SimpleNamespace(job_installed=lambda e, r: None,
                               job_cancelled=lambda e, why: seen.append(("cancelled", e.job.id, why)),
                               job_dropped=lambda e, why: seen.append(("dropped", e.job.id, why)))
    c = catalog_with(Agent(), listener)
    a, b = stored("a", {"cron": "* * * * *", "tz": "UTC"}), stored("b", {"cron": "* * * * *", "tz": "UTC"})
    for s in (a, b):
        c.job_stored(s)
        c.entries[s.id].next_due = NOW + timedelta(minutes=1)   # armed, as the scheduler does
    c._deleted("a")
    c.job_stored(dataclasses.replace(b, doc={"id": "b", "_tombstone": True, "_finished": {"at": "x", "reason": "y"}}))
    assert seen == [("cancelled", "a", "deleted"), ("dropped", "a", EndReason.DELETED), ("cancelled", "b", "tombstoned")]


# --- recovery -------------------------------------------------------------------------------

def record(job_id: str, due: datetime, state: str, attempt: int = 1, **kw: Any) -> dict:
    return {"v": 1, "job_id": job_id, "fire_id": fire_id(job_id, due), "state": state, "attempt": attempt,
            "agent": "gw-0", "fence": 3, **kw}


def test_recovery_sorts_what_earlier_owners_left():
    e = entry("j1", {"cron": "*/10 * * * *", "tz": "UTC"}, misfire="run_once", retry={"max_attempts": 3},
              issued_at=EARLIER)
    t0 = NOW.replace(second=0) - timedelta(minutes=NOW.minute % 10) - timedelta(minutes=30)
    t1, t2 = t0 + timedelta(minutes=10), t0 + timedelta(minutes=20)
    recs = {fire_id("j1", t0): (record("j1", t0, "succeeded"), 3),
            fire_id("j1", t1): (record("j1", t1, "retrying", retry_at=format_rfc3339(NOW)), 4),
            fire_id("j1", t2): (record("j1", t2, "running", attempt=2), 5)}
    r = recovery.recover(e, recs, CFG.agent_id, NOW)
    assert [(f.fire_id, at) for f, at in r.retrying] == [(fire_id("j1", t1), NOW)]
    ((orphan),) = r.orphans
    assert (orphan.fire_id, orphan.attempt, orphan.claim.rev) == (fire_id("j1", t2), 2, 5)
    assert r.foreign == [] and e.last_due_done == t2
    assert set(e.firings) == {fire_id("j1", t1), fire_id("j1", t2)}
    assert r.next_due is not None and r.next_due > NOW and not r.announce


@pytest.mark.parametrize("forge, why", [
    (lambda rec, due: dict(rec, attempt=-1000), "attempt -1000 is outside 1..2"),
    (lambda rec, due: dict(rec, state="retrying", attempt=2), "`retrying` after attempt 2 of 2"),
    (lambda rec, due: dict(rec, job_id="other"), "names job 'other'"),
    (lambda rec, due: dict(rec, state="paused"), "state 'paused' is not a run-record state"),
    (lambda rec, due: dict(rec, fence=99), "fence 99 cannot have fenced a write made at revision 5"),
])
def test_recovery_believes_no_record_the_signed_job_does_not_allow(forge, why):
    """A forged record is foreign: reported, never resolved or retried from, and its firing
    counts as handled (misfire recovery does not run it again)."""
    e = entry("j1", {"cron": "*/10 * * * *", "tz": "UTC"}, misfire="run_once", retry={"max_attempts": 2},
              issued_at=EARLIER)
    due = NOW.replace(second=0) - timedelta(minutes=NOW.minute % 10)
    rec = forge(record("j1", due, "running"), due)
    r = recovery.recover(e, {fire_id("j1", due): (rec, 5)}, CFG.agent_id, NOW)
    ((fid, reason, seen, rev),) = r.foreign
    assert why in reason and fid == fire_id("j1", due) and rev == 5 and seen.get("agent") == "gw-0"
    assert r.orphans == [] and r.retrying == [] and r.catch_up == [] and e.last_due_done == due


def test_recovery_believes_no_record_of_a_firing_off_the_schedule_or_far_ahead():
    e = entry("j1", {"cron": "*/10 * * * *", "tz": "UTC"}, misfire="run_once", issued_at=EARLIER)
    on = NOW.replace(second=0) - timedelta(minutes=NOW.minute % 10)
    off, ahead = on - timedelta(minutes=7), on + timedelta(hours=2)
    r = recovery.recover(e, {fire_id("j1", off): (record("j1", off, "succeeded"), 5),
                             fire_id("j1", ahead): (record("j1", ahead, "succeeded"), 6)}, CFG.agent_id, NOW)
    whys = sorted(w for _, w, _, _ in r.foreign)
    assert len(whys) == 2 and "is not a firing of the job's schedule" in whys[0] + whys[1]
    assert any("no claim is made that far ahead" in w for w in whys)
    assert e.last_due_done is None or e.last_due_done < ahead   # a future record moves nothing forward
    assert e.foreign_ahead == {fire_id("j1", ahead): 6}        # its firing's claim may replace it


def test_a_fenced_record_an_owner_with_a_fast_clock_wrote_ahead_is_believed_and_reported():
    """An owner whose clock ran 30 s ahead claimed and ran a firing 30 s early; the shard
    moved to an agent with the right clock. Its record is believed (running the firing
    again would run it twice) and reported as early; without a fence it is foreign."""
    e = entry("j1", {"cron": "*/10 * * * * *", "tz": "UTC"}, issued_at=EARLIER)
    now = NOW.replace(microsecond=0) - timedelta(seconds=NOW.second % 10)
    early = now + timedelta(seconds=30)
    r = recovery.recover(e, {fire_id("j1", early): (record("j1", early, "succeeded"), 6)}, CFG.agent_id, now)
    assert r.foreign == [] and e.foreign_ahead == {}
    ((fid, ahead, seen, rev),) = r.early
    assert fid == fire_id("j1", early) and ahead == 30.0 and rev == 6 and seen["agent"] == "gw-0"
    assert r.next_due == now + timedelta(seconds=10)   # the firings before it, with no record, still run

    e2 = entry("j1", {"cron": "*/10 * * * * *", "tz": "UTC"}, issued_at=EARLIER)
    unfenced = {k: v for k, v in record("j1", early, "succeeded").items() if k != "fence"}
    r2 = recovery.recover(e2, {fire_id("j1", early): (unfenced, 6)}, CFG.agent_id, now)
    assert r2.early == [] and "names no fence" in r2.foreign[0][1]
    assert e2.foreign_ahead == {fire_id("j1", early): 6}   # its firing's claim may replace it


@pytest.mark.parametrize("ahead_s", [-3.0, 2.0])
def test_a_firing_whose_record_the_load_found_is_neither_caught_up_nor_armed_again(ahead_s):
    """A one-shot due at a time with more than milliseconds (its fire id keeps milliseconds)
    whose run the dead owner left `running`: its record decides it (owner_lost). It is not
    run again as a missed firing, nor armed again when it is still ahead."""
    due = NOW + timedelta(seconds=ahead_s, microseconds=569009)
    e = entry("j1", {"at": format_rfc3339(due)}, issued_at=EARLIER)
    rec = dict(record("j1", due, "running"), fence=3)
    r = recovery.recover(e, {fire_id("j1", due): (rec, 5)}, CFG.agent_id, NOW + timedelta(microseconds=600000))
    ((orphan,),) = (r.orphans,)
    assert orphan.fire_id == fire_id("j1", due) and r.foreign == []
    assert r.catch_up == [] and r.next_due is None


# --- outcomes -------------------------------------------------------------------------------

def test_outcomes_map_end_reasons_to_record_states_and_retry_criteria():
    assert outcomes.record_state(EndReason.REPLACED) is RecordState.KILLED
    assert outcomes.record_state(EndReason.OOM) is RecordState.FAILED
    assert outcomes.criterion(EndReason.OOM) == "failed"
    assert outcomes.criterion(EndReason.AGENT_STOPPED) == "owner_lost"
    assert outcomes.criterion(EndReason.CANCELLED) is None
    job = SimpleNamespace(id="j1", retry=RetryPolicy(max_attempts=2, backoff_s=1.0), not_after=None)
    out = outcomes.after_run(job, EndReason.TIMED_OUT, "f1", 1, NOW, cancelled=False)
    assert out.state is RecordState.TIMED_OUT and out.retry_at == NOW + timedelta(seconds=1)
    assert out.record_state is RecordState.RETRYING
    assert outcomes.after_run(job, EndReason.TIMED_OUT, "f1", 2, NOW, cancelled=False).retry_at is None
    assert outcomes.after_run(job, EndReason.FAILED, "f1", 1, NOW, cancelled=True).retry_at is None
    assert outcomes.after_run(job, EndReason.AGENT_STOPPED, "f1", 1, NOW, cancelled=False).retry_at is None
    assert outcomes.after_owner_lost(job, "f1", 1, NOW) is None


# --- admission --------------------------------------------------------------------------------

def admitter(max_concurrent: int = 1) -> tuple[Admitter, list, Agent]:
    agent, claimed = Agent(), []
    st = Statuses(agent, KEYS, CFG.agent_id, CFG.shards)
    launcher = SimpleNamespace(limits=lambda e: Limits(cpu=0.1, memory_mb=10))
    a = Admitter(Admission(Budget(max_concurrent, 1000, 4)), launcher, st, lambda e: True,
                 lambda f, retry: claimed.append((f.fire_id, retry)), lambda f: claimed.append((f.fire_id, "never")))
    return a, claimed, agent


def test_paused_firings_are_held_and_claimed_in_due_order_on_resume():
    a, claimed, _ = admitter(4)
    e = entry()
    late, early = Firing(e, NOW + timedelta(seconds=2), "late"), Firing(e, NOW, "early")
    a.pause("etcd_retransmits")
    a.request(late)
    a.request(early)
    assert claimed == [] and late.state is FiringState.HELD
    a.resume()
    assert claimed == [("early", False), ("late", False)]


def test_a_firing_over_the_node_budget_waits_and_is_claimed_when_a_slot_frees():
    a, claimed, agent = admitter(1)
    e = entry()
    first, second = Firing(e, NOW, "first"), Firing(e, NOW + timedelta(seconds=1), "second")
    a.request(first)
    a.request(second)
    assert claimed == [("first", False)] and second.state is FiringState.WAITING
    assert agent.statuses[-1]["state"] == "waiting" and agent.statuses[-1]["reason"] == "quota"
    a.release(first)
    assert claimed == [("first", False), ("second", False)]


def test_a_wait_for_the_node_budget_counts_in_the_lag_a_pause_does_not():
    """Past capacity the backlog waits for admission (the runs in flight hold the node's
    budget): that wait is the agent's own, so a firing's lateness, which the loop's lag
    counts, runs from its due time once it asked for admission. A firing held while new
    runs are paused (a lease policy's decision) is ready only once it asks again."""
    import time as _time

    a, claimed, _ = admitter(1)
    e = entry()
    first = Firing(e, datetime.now(timezone.utc), "first")
    second = Firing(e, datetime.now(timezone.utc) - timedelta(seconds=1), "second")
    a.request(first)
    before = _time.monotonic()
    a.request(second)
    assert second.state is FiringState.WAITING and before <= second.ready_mono <= _time.monotonic()
    _time.sleep(0.05)
    a.release(first)
    assert claimed[-1] == ("second", False)
    second.mark_ready()   # the claim marks it again: the first mark stays
    assert _time.monotonic() - second.ready_mono >= 0.05

    b, _, _ = admitter(4)
    held = Firing(e, datetime.now(timezone.utc), "held")
    b.pause("etcd_retransmits")
    b.request(held)
    assert held.state is FiringState.HELD and not held.ready_mono
    _time.sleep(0.02)
    resumed = _time.monotonic()
    b.resume()
    assert held.ready_mono >= resumed   # ready from its release, not from its due time


# --- records and claims ---------------------------------------------------------------------

def test_a_record_names_its_fence_and_a_claim_resets_what_an_earlier_attempt_left():
    e = entry()
    f = Firing(e, NOW, fire_id("j1", NOW), attempt=2,
               claim=ClaimState({"state": "retrying", "exit_code": 3, "reason": "failed", "retry_at": "x"}, 9))
    rr = RunRecords(None, KEYS, Agent(), EventLoop(), Workers(), CFG.agent_id, CFG.shards, lambda s: None)
    rec = rr.document(f, RecordState.RUNNING, Fence(e.shard, KEYS.shard(e.shard), 41), started_at="t")
    assert (rec["state"], rec["attempt"], rec["fence"], rec["agent"]) == ("running", 2, 41, "gw-1")
    assert rec["exit_code"] is None and rec["reason"] is None and rec["retry_at"] is None
    ops = rr.ops(f, rr.key(f), json.dumps(rec))
    assert [op.key for op in ops] == [rr.key(f), KEYS.latest(e.shard, "j1")]


def test_a_claim_with_an_unknown_outcome_is_read_back_before_anything_is_decided(monkeypatch):
    e = entry()
    fence = Fence(e.shard, KEYS.shard(e.shard), 41)
    agent = Agent(fence)
    landed: dict[str, Any] = {}

    class Client:
        def get(self, key: str) -> Any:
            v = landed.get(key)
            return None if v is None else KV(key, v.encode(), 50, 50, 1, 0)

    def txn_without_answer(client: Any, writes: Any, **kw: Any) -> Any:
        for w in writes:
            landed[w.success[0].key] = w.success[0].value      # it landed, but no answer came
        raise TimeoutError("no answer")

    monkeypatch.setattr("agent.coordination.fencing.fenced_batch", txn_without_answer)
    rr = RunRecords(Client(), KEYS, agent, InlineLoop(), Workers(), CFG.agent_id, CFG.shards, lambda s: None)
    cw = ClaimWriter(Client(), agent, rr, InlineLoop(), Workers(), CFG.agent_id, lambda x: True,
                     SimpleNamespace(stage=lambda spec: "staged", unstage=lambda s: None))
    f = Firing(e, NOW, fire_id("j1", NOW))
    f.move(FiringState.CLAIMING)
    outcomes_seen: list = []
    cw.claim(f, fence, False, None, lambda g, c: outcomes_seen.append(c))
    assert outcomes_seen == []            # it waits for its batch
    rr.commits.flush()
    (c,) = outcomes_seen
    assert c.kind is ClaimKind.CLAIMED and f.claim.rev == 50 and f.claim.record["agent"] == "gw-1"

    # someone else's record at the key: foreign, with what it says
    g = Firing(e, NOW + timedelta(minutes=1), fire_id("j1", NOW + timedelta(minutes=1)))
    g.move(FiringState.CLAIMING)
    monkeypatch.setattr("agent.coordination.fencing.fenced_batch",
                        lambda *a, **k: (_ for _ in ()).throw(TimeoutError()))
    landed[rr.key(g)] = json.dumps({"agent": "gw-0", "attempt": 1, "started_at": "t"})
    cw.claim(g, fence, False, None, lambda g, c: outcomes_seen.append(c))
    rr.commits.flush()
    c2 = outcomes_seen[1]
    assert (c2.kind, c2.record["agent"], c2.rev) == (ClaimKind.FOREIGN, "gw-0", 50)


# --- the pipeline ------------------------------------------------------------------------------

@pytest.mark.parametrize("retry_on, state", [(["failed"], "failed"), (["owner_lost"], "retrying")])
def test_the_scheduler_resolves_a_run_left_running_by_an_owner_that_is_gone(retry_on, state, monkeypatch):
    """Built from the catalog and fakes of its seams: the orphan is failed owner_lost, or
    retried where the job opted in; the status names the previous agent."""
    agent = Agent()
    sched, c = _scheduler(agent)
    due = NOW - timedelta(minutes=5)
    s = stored("orphaned", {"at": format_rfc3339(due)}, retry={"max_attempts": 3, "on": retry_on}, issued_at=EARLIER)
    rec = record("orphaned", due, "running")
    c.loaded.pop(s.shard)
    c.store = SimpleNamespace(list_shard=lambda storage: ([s], 3))   # the shard's jobs and records, as listed
    monkeypatch.setattr("agent.jobs.catalog.records_by_job",
                        lambda client, prefix, rev: {"orphaned": {rec["fire_id"]: (rec, 5)}})
    c.shard_acquired(Fence(s.shard, KEYS.shard(s.shard), 1))
    st = [d for d in agent.statuses if d["job_id"] == "orphaned"]
    assert [(d["state"], d["reason"], d.get("previous_agent")) for d in st] == [(state, "owner_lost", "gw-0")]
    assert [f["event"] for t, f in agent.audit] == ["owner_lost"]


# --- cluster quotas ------------------------------------------------------------------------------

def test_the_shard_owner_accounts_for_its_documents_and_publishes_them_fenced(monkeypatch):
    from agent.coordination.watch import WatchEvent
    from agent.jobs import catalog as catalog_module

    fence = Fence(3, KEYS.shard(3), 9)
    agent = Agent(fence)
    c = catalog_with(agent)
    c.loaded.pop(3)
    listed = [dataclasses.replace(stored("a", {"delay_s": 60}), shard=3, size=100),
              dataclasses.replace(stored("b", {"delay_s": 60}), shard=3, size=50)]
    c.store = SimpleNamespace(list_shard=lambda storage: (listed, 20))
    monkeypatch.setattr(catalog_module, "records_by_job", lambda client, prefix, rev: {})
    writes: list = []
    monkeypatch.setattr(catalog_module, "fenced_txn", lambda client, f, success=(): writes.append((f, success)))
    c.shard_acquired(fence)
    assert c.usage[3] == [2, 150]
    kv = lambda key, value, rev: KV(key, value, rev, rev, 1, 0)   # noqa: E731
    k = KEYS.job(3, "c")
    c._jobs_events([WatchEvent("put", kv(k, b"x" * 30, 21), None),                 # created
                    WatchEvent("put", kv(k, b"x" * 40, 22), kv(k, b"x" * 30, 21)),  # rewritten
                    WatchEvent("delete", kv(KEYS.job(3, "a"), b"", 23), kv(KEYS.job(3, "a"), b"y" * 100, 7)),
                    WatchEvent("put", kv(KEYS.job(3, "old"), b"z" * 9, 19), None)], 23)  # before the load: counted
    assert c.usage[3] == [2, 90]
    c._publish_usage()
    ((f, (put,)),) = writes
    assert f == fence and put.key == KEYS.usage(3) and json.loads(put.value)["jobs"] == 2


def test_cluster_quota_refuses_what_would_pass_it_and_counts_its_own_stores():
    from agent.coordination.quota import ClusterQuota

    usage = {KEYS.usage(0): {"jobs": 3, "bytes": 1000}, KEYS.usage(1): {"jobs": 4, "bytes": 2000}}
    reads: list = []

    class Client:
        def get_prefix(self, prefix: str) -> Any:
            reads.append(prefix)
            return [KV(k, json.dumps(v).encode(), 1, 1, 1, 0) for k, v in usage.items()], 5

    t = [0.0]
    q = ClusterQuota(Client(), KEYS, max_jobs=9, max_mb=1, refresh_s=2.0, clock=lambda: t[0])
    assert q.check(100) is None
    q.stored(100)
    assert q.check(100) is None
    q.stored(100)
    assert "quotas.jobs is 9" in q.check(100)          # 7 published + 2 stored since
    assert len(reads) == 1                              # read once per refresh period
    t[0] = 3.0
    usage[KEYS.usage(1)] = {"jobs": 1, "bytes": 1024 * 1024 - 1000 - 500}   # 500 bytes left
    assert "quotas.stored_mb" in q.check(600) and q.check(100) is None and len(reads) == 2


def test_a_one_shot_due_finer_than_its_fire_id_is_done_with_its_record_not_run_again():
    """A fire id names its firing to the millisecond; an `at` time may carry microseconds.
    A record of that firing (here left running by a dead owner) covers it: recovery resolves
    it and does not also catch it up as missed."""
    due = NOW - timedelta(seconds=5) + timedelta(microseconds=123456)
    e = entry("fine", {"at": format_rfc3339(due)}, issued_at=EARLIER)
    rec = record("fine", due, "running")
    r = recovery.recover(e, {rec["fire_id"]: (rec, 5)}, CFG.agent_id, NOW)
    ((orphan),) = r.orphans
    assert orphan.due == due and r.catch_up == [] and r.skipped == 0


# --- issue 39: one name per meaning, one answer per cancel -------------------------------------

def test_a_runs_status_names_it_as_its_environment_does():
    """run_id is <fire_id>.<attempt> (MILLWRIGHT_RUN_ID, {run_id}), fire_id the firing; a
    status about the job alone has neither. Fails on a build whose run_id was the fire id."""
    agent = Agent()
    st, e = Statuses(agent, KEYS, CFG.agent_id, CFG.shards), entry()
    f = Firing(e, NOW, fire_id("j1", NOW), attempt=2)
    doc = st.doc(e, f, "running")
    assert (doc["run_id"], doc["fire_id"], doc["attempt"]) == (f"{f.fire_id}.2", f.fire_id, 2)
    assert run_id(f.fire_id, 2) == doc["run_id"]   # what launching puts in the run's environment
    doc = st.doc(e, None, "scheduled")
    assert (doc["run_id"], doc["fire_id"], doc["attempt"]) == (None, None, None)


def _scheduler(agent: Agent) -> tuple[Scheduler, JobCatalog]:
    lease = SimpleNamespace(lease_id=None, valid_until=0.0, is_valid=lambda: False)
    executor = SimpleNamespace(default_limits=Limits(), stage=lambda spec: None, unstage=lambda s: None)
    c = catalog_with(agent)
    sched = Scheduler(CFG, c, fencing=agent, lease=lease, loop=EventLoop(), client=None, keys=KEYS,
                      workers=Workers(), executor=executor, admission=Admission(Budget(4, 1000, 4)), sink=agent,
                      audit=agent)
    c.listener = sched
    return sched, c


@pytest.mark.parametrize("reason, statuses", [("cancelled", []), ("deleted", [("cancelled", "deleted")])])
def test_a_cancelled_job_leaves_the_due_list_at_once_and_a_cancel_is_answered_once(reason, statuses):
    """A cloud cancel is answered by ingest (`cancelled_by_cloud`): the owner publishes no
    second job-level `cancelled`; a stop nobody answered (a deleted key) is announced by
    the owner. Either way the job's timer and due time go at once. Fails on a build whose
    owner answered every cancel again and kept the due time (`in_s` growing negative)."""
    agent = Agent(fence=Fence(0, KEYS.shard(0), 1))
    sched, c = _scheduler(agent)
    c.job_stored(stored("cron-job", {"cron": "*/10 * * * * *", "tz": "UTC"}))
    assert [d["job_id"] for d in c.status()["due"]] == ["cron-job"]
    c.job_cancelled("cron-job", reason)
    assert c.status()["due"] == [] and c.entries["cron-job"].next_due is None
    # (a firing the cancel ends gets its own final status, run_id set: not counted here)
    assert [(d["state"], d["reason"]) for d in agent.statuses
            if d["state"] == "cancelled" and d["run_id"] is None] == statuses
    assert [f["event"] for t, f in agent.audit if t == "job"] == [reason]


def test_a_claim_that_finds_a_record_this_agent_wrote_under_its_fence_does_not_claim_over_it():
    """A claim that finds the firing's record written by this agent under the fence it holds
    (its final record, say) is not a foreign record to claim over: the firing was decided
    here, and running it again would run it twice."""
    fence = Fence(3, KEYS.shard(3), 41)
    agent = Agent(fence)
    sched, c = _scheduler(agent)
    claims: list = []
    sched.claims.claim = lambda f, *a, **kw: claims.append(f.fire_id)   # type: ignore[method-assign]
    e = entry("j1", {"at": format_rfc3339(NOW)}, issued_at=EARLIER)
    c.entries["j1"] = e
    for rec, claimed_over in ((dict(record("j1", NOW, "failed"), agent=CFG.agent_id, fence=41), False),
                              (dict(record("j1", NOW, "failed"), agent="gw-0", fence=12), True)):
        f = Firing(e, NOW, fire_id("j1", NOW))
        e.firings[f.fire_id] = f
        f.move(FiringState.CLAIMING)
        claims.clear()
        sched._claimed(f, Claim(ClaimKind.FOREIGN, record=rec, rev=50))
        assert bool(claims) is claimed_over, rec
        e.firings.pop(f.fire_id, None)


def test_a_firing_sent_back_to_its_start_policies_is_not_counted_late_for_that_wait():
    """Admitted, but a window closed before its claim: the firing waits on the window
    again, and its lateness (the lag) counts from its next admission request, not the
    first one: a window's wait is a policy's, not the agent's."""
    agent = Agent(Fence(0, KEYS.shard(0), 1))
    sched, c = _scheduler(agent)
    e = entry("j1", {"at": format_rfc3339(NOW)}, issued_at=EARLIER)
    c.entries["j1"] = e
    f = Firing(e, NOW, fire_id("j1", NOW))
    e.firings[f.fire_id] = f
    f.mark_ready()
    first = f.ready_mono
    f.move(FiringState.WAITING, wait_reason="quota")
    claims: list = []
    still = iter([False])                                           # the window closed once
    sched.starts.still = lambda g: next(still, True)                # type: ignore[method-assign]
    sched.claims.claim = lambda g, *a, **kw: claims.append(g)       # type: ignore[method-assign]
    import time as _time
    _time.sleep(0.02)
    sched._claim(f)                                                 # back to the policies, admitted again
    assert claims == [f] and f.ready_mono >= first + 0.02


def test_a_first_run_notes_its_lateness_from_the_later_of_due_and_claim_to_the_loop():
    """The lag sees a backlog of claims and spawns: a run's lateness is measured from its
    due time (claimed ahead) or when it was marked ready (a catch-up, or one that waited on purpose),
    and only the first attempt counts (a retry's delay is its backoff)."""
    import time as _time

    from agent.jobs.scheduler import _count_start

    class Noted:
        def __init__(self) -> None:
            self.late: list[float] = []

        def note_late(self, late: float) -> None:
            self.late.append(late)

    e = entry()
    ahead = Firing(e, datetime.now(timezone.utc) + timedelta(seconds=2), "ahead")
    ahead.mark_ready()
    ahead.mark_ready()                                   # a claim made again keeps the first mark
    assert 1.9 < ahead.ready_mono - _time.monotonic() <= 2.0
    ahead.started_mono = ahead.ready_mono + 0.3          # started 0.3 s after it was due
    caught_up = Firing(e, datetime.now(timezone.utc) - timedelta(seconds=60), "caught-up")
    caught_up.mark_ready()
    caught_up.started_mono = caught_up.ready_mono + 0.01   # 60 s after due, 10 ms after its claim
    retry = Firing(e, datetime.now(timezone.utc) - timedelta(seconds=5), "retry", attempt=2)
    retry.mark_ready()
    retry.started_mono = retry.ready_mono + 4.0
    loop = Noted()
    for f in (ahead, caught_up, retry):
        _count_start(loop, f, _time.time())
    assert [round(x, 3) for x in loop.late] == [0.3, 0.01]
