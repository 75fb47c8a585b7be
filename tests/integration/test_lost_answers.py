"""Scheduler decisions made on an answer that did not come: a session past its renew
deadline (no fence) while the shard is still held, a claim's reply lost, a read-back that
fails or comes before the claim landed (issue 18; the landing CI run's 2,000-job fault
test left a firing `running` on a live owner after the etcd restart).

Between the renew deadline and the loop's fence timer, a keepalive can still come back: the
session is then valid again, no self-fence happens, and the agent keeps its shards under the
same fence. Whatever the scheduler decided in that gap on "no fence" stays decided: a final
record it dropped, or a claim whose outcome it gave up reading, leaves the record `running`
for as long as the agent keeps the shard (no one else will resolve it). The same holds for
a claim of its own that it took for someone else's.

Each fault is made exactly where the scheduler meets it: ownership.fence_for() gives None for
the firing's shard while the shard stays held (owns()), as past the renew deadline; a
claim's transaction lands but raises, or lands only after its read-back. The agent, its
runs and etcd are real.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Iterator

import pytest

import agent.coordination.fencing as fencing
from agent.coordination.etcd import EtcdUnavailable
from agent.coordination.jobstore import JobStore
from agent.coordination.keys import shard_of
from agent.jobs.firing import FiringState
from agent.jobs.schedule import format_rfc3339
from tests.support.cluster import Cluster
from tests.support.waiting import wait_for
from tests.support.local_agent import LocalAgent, abandoned, recording_agent
from tests.support.jobs import effects, job
from tests.support.kernel import require_kernel
from tests.support.records import run_records


@pytest.fixture
def env(etcd_server, tmp_path):
    require_kernel(os.geteuid() == 0, "the agent's runs are root jobs in separate directories: needs root")
    c, la, out = recording_agent(etcd_server, tmp_path, "sl0", "rlimit")
    store = c.signing(JobStore(c.client, c.keys, c.shards, "test"))
    la.start()
    try:
        wait_for(lambda: c.all_owned_by({"sl0"}), 20, what="the agent holding every shard")
        wait_for(lambda: la.on_loop(lambda: all(la.agent.ownership.owns(s) for s in range(c.shards)) and
                                    set(la.scheduler.catalog.loaded) == set(range(c.shards))), 20, interval=0.05,
                 what="every shard loaded by the agent")
        yield c, la, store, out
    finally:
        la.stop()
        c.close()


class Lapse:
    """ownership.fence_for() as past the renew deadline for one shard (None), from start() to
    end(); owns() is untouched: the shard stays held. Either thread may call these."""

    def __init__(self, la: LocalAgent):
        self.ownership = la.agent.ownership   # what the scheduler asks (the Agent only delegates to it)
        self.real = self.ownership.fence_for
        self.seen: list[tuple[Any, Any]] = []   # (fence_for, owns) for the shard at start()

    def start(self, shard: int) -> None:
        self.ownership.fence_for = lambda s: None if s == shard else self.real(s)   # type: ignore[method-assign]
        self.seen.append((self.ownership.fence_for(shard), self.ownership.owns(shard)))

    def end(self) -> None:
        self.ownership.__dict__.pop("fence_for", None)   # the class's own again


def due_now(store: Any, job_id: str) -> None:
    store.create(job(job_id, {}, issued_at=format_rfc3339(datetime.now(timezone.utc).replace(microsecond=0))))


def patch_fenced_batch(monkeypatch: Any, fn: Callable[..., Any]) -> None:
    """Every batch of the scheduler's fenced writes (claims and record writes, each batch
    one transaction) through ``fn(client, writes, **kw)``."""
    monkeypatch.setattr(fencing, "fenced_batch", fn)


def writes_job(success: Any, job_id: str) -> bool:
    """Whether a write's operations write one of the job's run records."""
    keys = (getattr(op, "key", b"") for op in success)
    return any(f"/{job_id}/" in (k.decode() if isinstance(k, bytes) else str(k)) for k in keys)


def the_jobs(writes: Any, outcomes: Any, job_id: str) -> list:
    """The outcomes of a batch's writes of the job's run records."""
    return [r for w, r in zip(writes, outcomes) if writes_job(w.success, job_id)]


class ReadBacks:
    """The scheduler's etcd client, real, except that a read of one of the job's run
    records goes through ``hook(read)`` (``read()`` does the real read): the hook may fail
    it, hold it, or act around it."""

    def __init__(self, real: Any, job_id: str, hook: Callable[[Callable[[], Any]], Any]):
        self.real, self.job_id, self.hook = real, job_id, hook

    def get(self, key: str, **kw: Any) -> Any:
        def read() -> Any:
            return self.real.get(key, **kw)
        return self.hook(read) if f"/{self.job_id}/" in key and "/runs/" in key else read()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@contextlib.contextmanager
def read_backs(la: LocalAgent, job_id: str, hook: Callable[[Callable[[], Any]], Any]) -> Iterator[None]:
    """The scheduler reads the job's run records through ``hook`` (ReadBacks) meanwhile."""
    claims = la.scheduler.claims
    proxy = ReadBacks(la.on_loop(lambda: claims.client), job_id, hook)
    la.on_loop(lambda: setattr(claims, "client", proxy))
    try:
        yield
    finally:
        la.on_loop(lambda: setattr(claims, "client", proxy.real))


def final_record(c: Cluster, job_id: str) -> dict:
    """The job's one run record, once it is no longer `running` (20 s at most)."""
    def final():
        recs = [r for (j, _), r in run_records(c.client, c.keys).items() if j == job_id]
        return recs[0] if len(recs) == 1 and recs[0]["state"] != "running" else None
    try:
        return wait_for(final, 20, interval=0.1, what=f"{job_id}'s record final")
    except AssertionError:
        recs = {k: (r["state"], r["agent"], r["attempt"]) for k, r in run_records(c.client, c.keys).items()
                if k[0] == job_id}
        raise AssertionError(f"{job_id}'s record never became final: {recs}") from None


def no_self_fence(la: LocalAgent, fences: dict) -> None:
    """The agent kept every shard under the fence it held before (no self-fence, no loss)."""
    assert la.on_loop(lambda: la.agent.fenced_reason) is None
    assert la.on_loop(lambda: {s: la.agent.ownership.owns(s) for s in fences}) == fences


def test_a_run_that_ends_in_the_gap_gets_its_final_record_when_the_session_renews(env):
    """The run ends (Scheduler._ended) while the shard has no fence only because the session
    is past its renew deadline. Its final record must wait for the renewal and be written
    then, not be dropped: dropped, it stayed `running` under the renewed session."""
    c, la, store, out = env
    sch = la.scheduler
    lapse = Lapse(la)
    fences = la.on_loop(lambda: {s: la.agent.ownership.owns(s) for s in range(c.shards)})
    real_ended = sch._ended

    def ended(f: Any, result: Any) -> None:
        if f.entry.job.id != "ends-in-gap" or lapse.seen:
            real_ended(f, result)
            return
        lapse.start(f.entry.shard)
        try:
            real_ended(f, result)
        finally:
            lapse.end()

    la.on_loop(lambda: setattr(sch, "_ended", ended))
    try:
        due_now(store, "ends-in-gap")
        rec = final_record(c, "ends-in-gap")
    finally:
        la.on_loop(lambda: sch.__dict__.pop("_ended", None))
    ((fence, held),) = lapse.seen
    assert fence is None and held is not None   # the run did end in the gap
    assert (rec["state"], rec["attempt"], rec["agent"], rec["exit_code"]) == ("succeeded", 1, "sl0", 0), rec
    assert effects(out)[("ends-in-gap", rec["fire_id"])] == 1
    no_self_fence(la, fences)


def test_a_claim_whose_reply_and_read_back_fail_in_the_gap_runs_once(env, monkeypatch, caplog):
    """The claim's create lands but its reply is lost (EtcdUnavailable), and the read-back
    of the record fails too, in the gap. The claim may have landed and the shard is still
    held: the scheduler reads again instead of giving the firing up (given up, its record
    stayed `running` and the job never ran). The job then runs once, under its claim."""
    c, la, store, out = env
    sch = la.scheduler
    caplog.set_level(logging.DEBUG, logger="agent.jobs.scheduler")
    lapse = Lapse(la)
    fences = la.on_loop(lambda: {s: la.agent.ownership.owns(s) for s in range(c.shards)})
    jid = "lost-reply"
    lost: list[int] = []        # the landed claim's revision (its reply was lost)
    reads: list[str] = []       # the read-backs of the job's record: "failed", "real"
    lock = threading.Lock()
    real_batch = fencing.fenced_batch

    def fenced_batch(client: Any, writes: Any, **kw: Any) -> Any:
        out = real_batch(client, writes, **kw)
        with lock:
            mine = [r for r in the_jobs(writes, out, jid) if not isinstance(r, Exception) and r.succeeded]
            if not lost and mine:
                lost.append(mine[0].revision)
                raise EtcdUnavailable("the reply of the claim's batch was lost (injected)")
        return out

    def read_back(read: Callable[[], Any]) -> Any:
        """The first read-back fails, in the gap (which ends at the next read, 0.2 s later)."""
        with lock:
            first = not reads
            reads.append("failed" if first else "real")
        if first:
            lapse.start(sch.catalog.entries[jid].shard)
            raise EtcdUnavailable("etcd unreachable (injected)")
        lapse.end()
        return read()

    patch_fenced_batch(monkeypatch, fenced_batch)
    try:
        with read_backs(la, jid, read_back):
            due_now(store, jid)
            rec = final_record(c, jid)
    finally:
        lapse.end()
    assert len(lost) == 1, "the claim's reply was not lost"
    ((fence, held),) = lapse.seen
    assert fence is None and held is not None   # the read-back failed in the gap
    assert reads[:2] == ["failed", "real"], reads
    assert abandoned(caplog, jid) == []
    assert (rec["state"], rec["attempt"], rec["agent"]) == ("succeeded", 1, "sl0"), rec
    assert effects(out)[(jid, rec["fire_id"])] == 1
    no_self_fence(la, fences)


def test_a_claim_that_lands_after_its_read_back_found_nothing_is_still_ours(env, monkeypatch, caplog):
    """The claim's create does not answer (EtcdUnavailable) and etcd applies it only after
    the read-back found no record (a request it still held): the scheduler claims again,
    and that create finds the first claim's record. It is ours (same agent, attempt and
    start): the firing runs under it, once. Taken for someone else's, the record stayed
    `running` and the job never ran."""
    c, la, store, out = env
    caplog.set_level(logging.DEBUG, logger="agent.jobs.scheduler")
    fences = la.on_loop(lambda: {s: la.agent.ownership.owns(s) for s in range(c.shards)})
    jid = "lands-late"
    held: list[tuple] = []      # the first claim's batch, not sent yet
    landed: list[int] = []      # its revision, once applied after the read-back
    claims: list[str] = []      # each claim's outcome: "held", "created", "exists"
    lock = threading.Lock()
    real_batch = fencing.fenced_batch

    def fenced_batch(client: Any, writes: Any, **kw: Any) -> Any:
        mine = any(writes_job(w.success, jid) for w in writes)
        with lock:
            if mine and not claims:
                claims.append("held")
                held.append((client, writes, kw))
                raise EtcdUnavailable("no answer (injected): the create is still queued")
        out = real_batch(client, writes, **kw)
        if mine and len(claims) == 1:
            (r,) = the_jobs(writes, out, jid)
            claims.append("created" if r.succeeded else "exists")
        return out

    def read_back(read: Callable[[], Any]) -> Any:
        """The first read-back returns what etcd had; then the held create is applied."""
        kv = read()
        if held and not landed:
            client, writes, kwargs = held[0]
            (r,) = the_jobs(writes, real_batch(client, writes, **kwargs), jid)
            landed.append(r.revision)
        return kv

    patch_fenced_batch(monkeypatch, fenced_batch)
    with read_backs(la, jid, read_back):
        due_now(store, jid)
        rec = final_record(c, jid)
    assert claims == ["held", "exists"] and len(landed) == 1   # the second create found the first's record
    assert abandoned(caplog, jid) == []
    assert (rec["state"], rec["attempt"], rec["agent"]) == ("succeeded", 1, "sl0"), rec
    assert effects(out)[(jid, rec["fire_id"])] == 1
    no_self_fence(la, fences)


def test_a_claim_still_unresolved_when_its_shard_is_held_again_is_never_claimed_anew(
        env, etcd_server, monkeypatch, caplog):
    """The claim's create does not answer (it did not land) and its read-back is slow (it
    waits in a worker, as behind a queue of others after an etcd restart); meanwhile the
    agent fences itself, etcd comes back and the agent holds the shard again, under a new
    fence. When the read-back then finds no record, the firing belongs to the entry the
    fence took away: it must give up, not claim again under the new fence (it did, CI-style
    run 50, and its `running` record was left for ever on a live owner). The new entry
    runs the firing, once.

    The shard's load after the re-acquire is held until that old firing has decided, so the
    order is the bad one: old firing first, new entry second."""
    c, la, store, out = env
    sch = la.scheduler
    caplog.set_level(logging.DEBUG, logger="agent.jobs.scheduler")
    jid = "unresolved"
    shard = shard_of(jid, c.shards)
    reads_open, load_go, load_armed = threading.Event(), threading.Event(), threading.Event()
    reading = threading.Event()
    claims: list[tuple[int, bool]] = []   # (fence token, landed) of each claim of the job
    lock = threading.Lock()
    real_batch = fencing.fenced_batch

    def fenced_batch(client: Any, writes: Any, **kw: Any) -> Any:
        mine = [w for w in writes if writes_job(w.success, jid)]
        with lock:
            first = bool(mine) and not claims
            if first:
                claims.append((mine[0].fence.token, False))
        if first:
            raise EtcdUnavailable("no answer (injected): the create's batch did not land")
        out = real_batch(client, writes, **kw)
        if mine:
            with lock:
                for w, r in zip(writes, out):
                    if writes_job(w.success, jid):
                        claims.append((w.fence.token, not isinstance(r, Exception) and r.succeeded))
        return out

    def read_back(read: Callable[[], Any]) -> Any:
        """Each read-back waits for reads_open."""
        reading.set()
        assert reads_open.wait(30), "the read-back was never let go"
        return read()

    real_list = sch.catalog.store.list_shard

    def list_shard(storage: int, *a: Any, **kw: Any) -> Any:
        if load_armed.is_set() and storage == shard_of(jid, c.shards):
            assert load_go.wait(30), "the held load was never let go"
        return real_list(storage, *a, **kw)

    patch_fenced_batch(monkeypatch, fenced_batch)
    monkeypatch.setattr(sch.catalog.store, "list_shard", list_shard)
    try:
        with read_backs(la, jid, read_back):
            due_now(store, jid)
            assert reading.wait(20), "the claim was never read back"
            f = la.on_loop(lambda: next(iter(sch.catalog.entries[jid].firings.values())))
            old_fence = la.on_loop(lambda: la.agent.ownership.owns(shard))
            assert la.on_loop(lambda: f.state) == FiringState.CLAIMING   # its read-back waiting
            load_armed.set()
            etcd_server.pause()
            wait_for(lambda: not la.agent.ownership.owned, 20, interval=0.05, what="the agent fenced")
            etcd_server.resume()
            wait_for(lambda: la.on_loop(lambda: la.agent.ownership.owns(shard)) not in (None, old_fence), 30,
                     interval=0.05, what="the shard held again")
            reads_open.set()
            # the old firing decides while the new entry is not installed yet (its load is held)
            wait_for(lambda: la.on_loop(lambda: f.state) == FiringState.DONE, 20, interval=0.05,
                     what="the old firing ended")
            assert la.on_loop(lambda: sch.catalog.entries.get(jid)) is None   # the new entry is not there yet
            held_again = list(claims)
            load_go.set()
            rec = final_record(c, jid)
    finally:
        load_go.set()
        reads_open.set()
        if etcd_server.paused:
            etcd_server.resume()
    assert held_again == [(old_fence.token, False)], f"the old firing claimed again: {held_again}"
    assert (rec["state"], rec["attempt"], rec["agent"]) == ("succeeded", 1, "sl0"), rec
    assert effects(out)[(jid, rec["fire_id"])] == 1


def test_the_final_record_of_a_firing_that_never_ran_is_written_again_when_etcd_did_not_answer(env, monkeypatch):
    """A firing that expires waiting for its dependency ends `misfired`/expired without a
    run (RunRecords.write_not_run). Its write fails without landing (EtcdUnavailable, as
    when etcd is slow or cut off for a moment) while the shard stays held: the record must
    be written again, as a run's final record is (RunRecords.write), not left to the
    shard's next owner, which may never come."""
    c, la, store, out = env
    fences = la.on_loop(lambda: {s: la.agent.ownership.owns(s) for s in range(c.shards)})
    real_batch = fencing.fenced_batch
    failed: list[int] = []

    def fenced_batch(client: Any, writes: Any, **kw: Any) -> Any:
        if not failed and any(writes_job(w.success, "expires") for w in writes):
            failed.append(writes[0].fence.shard)
            raise EtcdUnavailable("test: etcd did not answer")
        return real_batch(client, writes, **kw)

    patch_fenced_batch(monkeypatch, fenced_batch)
    t = datetime.now(timezone.utc).replace(microsecond=0)
    store.create(job("expires", {}, depends_on=["never-stored"], issued_at=format_rfc3339(t),
                     not_after=format_rfc3339(t + timedelta(seconds=2))))
    rec = final_record(c, "expires")
    assert failed, "the record's first write was never made"
    assert (rec["state"], rec["reason"], rec["agent"]) == ("misfired", "expired", "sl0"), rec
    assert not effects(out)
    no_self_fence(la, fences)
