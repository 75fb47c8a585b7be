"""The scheduler's pieces, each built without an etcd: the catalog's trust check at load,
recovery of what earlier owners left, the outcome policy, admission holds, record
documents, claim read-backs, and the pipeline resolving an orphaned run."""

from __future__ import annotations

import base64
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
from agent.jobs.claims import ClaimKind, ClaimWriter
from agent.jobs.firing import ClaimState, Firing, FiringEnd, FiringState
from agent.jobs.records import RunRecords
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

    def submit(self, op: Any, done: Any) -> None:
        try:
            result = op()
        except Exception as exc:
            done(None, exc)
            return
        done(result, None)


def stored(job_id: str, schedule: dict, **kw: Any) -> StoredJob:
    doc = {"v": 1, "id": job_id, "cluster": CFG.cluster, "kind": "job", "template": "noop", "params": {},
           "schedule": schedule, "issued_at": format_rfc3339(NOW), **kw}
    signed = dict(sign(doc, RING, "cloud-1"), _accepted={"at": format_rfc3339(NOW - timedelta(hours=1)), "by": "x"})
    return StoredJob(shard_of(job_id, CFG.shards), signed, 7, 7)


def catalog_with(agent: Agent, listener: Any = None) -> JobCatalog:
    c = JobCatalog(CFG, None, KEYS, agent, agent, EventLoop(), Workers(), RING, audit=agent, statuses=agent)
    c.listener = listener
    c.loaded.update({s: 1 for s in range(CFG.shards)})   # as after each shard's load
    return c


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
                               job_cancelled=lambda e: seen.append(("cancelled", e.job.id)),
                               job_dropped=lambda e, why: seen.append(("dropped", e.job.id, why)))
    c = catalog_with(Agent(), listener)
    s = stored("j1", {"delay_s": 60})
    c.job_stored(s)
    c.job_cancelled("j1")
    c.shard_lost(s.shard, "expired")
    assert seen == [("installed", "j1"), ("cancelled", "j1"), ("dropped", "j1", EndReason.SHARD_LOST)]
    assert c.entries == {} and c.by_shard == {}


# --- recovery -------------------------------------------------------------------------------

def test_recovery_sorts_what_earlier_owners_left():
    e = entry("j1", {"cron": "*/10 * * * *", "tz": "UTC"}, misfire="run_once")
    t0 = NOW.replace(second=0) - timedelta(minutes=NOW.minute % 10) - timedelta(minutes=30)
    recs = {fire_id("j1", t0): ({"state": "succeeded", "attempt": 1}, 3),
            fire_id("j1", t0 + timedelta(minutes=10)): ({"state": "retrying", "attempt": 1,
                                                         "retry_at": format_rfc3339(NOW)}, 4),
            fire_id("j1", t0 + timedelta(minutes=20)): ({"state": "running", "attempt": 2, "agent": "gw-0"}, 5)}
    r = recovery.recover(e, recs, CFG.agent_id, NOW)
    assert [(f.fire_id, at) for f, at in r.retrying] == [(fire_id("j1", t0 + timedelta(minutes=10)), NOW)]
    ((orphan),) = r.orphans
    assert (orphan.fire_id, orphan.attempt, orphan.claim.rev) == (fire_id("j1", t0 + timedelta(minutes=20)), 2, 5)
    assert e.last_due_done == t0 + timedelta(minutes=20) and set(e.firings) == {f.fire_id for f, _ in r.retrying} | {
        orphan.fire_id}
    assert r.next_due is not None and r.next_due > NOW and not r.announce


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

    def txn_without_answer(client: Any, fence: Any, compare: Any = (), success: Any = (), **kw: Any) -> Any:
        landed[success[0].key] = success[0].value      # it landed, but no answer came
        raise TimeoutError("no answer")

    monkeypatch.setattr("agent.jobs.claims.fenced_txn", txn_without_answer)
    rr = RunRecords(Client(), KEYS, agent, EventLoop(), Workers(), CFG.agent_id, CFG.shards, lambda s: None)
    cw = ClaimWriter(Client(), agent, rr, EventLoop(), Workers(), CFG.agent_id, lambda x: True,
                     SimpleNamespace(stage=lambda spec: "staged", unstage=lambda s: None))
    f = Firing(e, NOW, fire_id("j1", NOW))
    f.move(FiringState.CLAIMING)
    outcomes_seen: list = []
    cw.claim(f, fence, False, None, lambda g, c: outcomes_seen.append(c))
    (c,) = outcomes_seen
    assert c.kind is ClaimKind.CLAIMED and f.claim.rev == 50 and f.claim.record["agent"] == "gw-1"

    # someone else's record at the key: given up, saying why
    g = Firing(e, NOW + timedelta(minutes=1), fire_id("j1", NOW + timedelta(minutes=1)))
    g.move(FiringState.CLAIMING)
    monkeypatch.setattr("agent.jobs.claims.fenced_txn", lambda *a, **k: (_ for _ in ()).throw(TimeoutError()))
    landed[rr.key(g)] = json.dumps({"agent": "gw-0", "attempt": 1, "started_at": "t"})
    cw.claim(g, fence, False, None, lambda g, c: outcomes_seen.append(c))
    assert (outcomes_seen[1].kind, outcomes_seen[1].why) == (ClaimKind.GIVE_UP, FiringEnd.ALREADY_CLAIMED)


# --- the pipeline ------------------------------------------------------------------------------

@pytest.mark.parametrize("retry_on, state", [(["failed"], "failed"), (["owner_lost"], "retrying")])
def test_the_scheduler_resolves_a_run_left_running_by_an_owner_that_is_gone(retry_on, state, monkeypatch):
    """Built from the catalog and fakes of its seams: the orphan is failed owner_lost, or
    retried where the job opted in; the status names the previous agent."""
    agent = Agent()
    lease = SimpleNamespace(lease_id=None, valid_until=0.0, is_valid=lambda: False)
    executor = SimpleNamespace(default_limits=Limits(), stage=lambda spec: None, unstage=lambda s: None)
    c = catalog_with(agent)
    sched = Scheduler(CFG, c, fencing=agent, lease=lease, loop=EventLoop(), client=None, keys=KEYS,
                      workers=Workers(), executor=executor, admission=Admission(Budget(4, 1000, 4)), sink=agent,
                      audit=agent)
    c.listener = sched
    due = NOW - timedelta(minutes=5)
    s = stored("orphaned", {"at": format_rfc3339(due)}, retry={"max_attempts": 3, "on": retry_on})
    rec = {"state": "running", "attempt": 1, "agent": "gw-0", "fire_id": fire_id("orphaned", due)}
    c.loaded.pop(s.shard)
    c.store = SimpleNamespace(list_shard=lambda storage: ([s], 3))   # the shard's jobs and records, as listed
    monkeypatch.setattr("agent.jobs.catalog.records_by_job",
                        lambda client, prefix, rev: {"orphaned": {rec["fire_id"]: (rec, 2)}})
    c.shard_acquired(Fence(s.shard, KEYS.shard(s.shard), 1))
    st = [d for d in agent.statuses if d["job_id"] == "orphaned"]
    assert [(d["state"], d["reason"], d.get("previous_agent")) for d in st] == [(state, "owner_lost", "gw-0")]
    assert [f["event"] for t, f in agent.audit] == ["owner_lost"]
