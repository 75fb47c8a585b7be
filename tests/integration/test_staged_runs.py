"""A run staged with its claim but never spawned leaves nothing behind (issue 18).

Scheduler._claim stages a run (its run and work directories, output files and quota
cgroups: Executor.stage) on the claim's etcd worker, right after the fenced create of its
record. These tests hold that worker inside stage(), after the run was really staged, and
take the firing away meanwhile: the agent is fenced (etcd stops answering), or the job is
cancelled or deleted. Then they let the claim finish and check, through the scheduler's
own paths, that the job did not run and that the staged run was handed back: no run
directory under the executor's base dir, and no run cgroup in any hierarchy.

The agent is the daemon's own (the Daemon with the parts `millwright run` wires into it)
on a thread of this process, so its executor's stage() can be wrapped; etcd is real.
"""

from __future__ import annotations

import glob
import logging
import os
import sys
import threading
from datetime import datetime, timezone
from typing import Any, Callable

import pytest

from agent.coordination.jobstore import JobStore
from agent.execute.backends import Cgroup1Backend, safe_name
from agent.jobs.firing import FiringState
from agent.jobs.schedule import format_rfc3339
from tests.support.waiting import wait_for
from tests.support.local_agent import LocalAgent, abandoned, recording_agent
from tests.support.jobs import effects, job
from tests.support.kernel import require_kernel
from tests.support.records import run_records


class StageGate:
    """Wraps the executor's stage(): the run of ``job_id`` is staged for real, then the
    claim's worker thread waits in stage() until open() (the claim's record is written by
    then, and the scheduler has not seen the claim's result yet)."""

    def __init__(self, executor: Any, job_id: str):
        self.real, self.job_id = executor.stage, job_id
        self.staged: list = []
        self.entered, self.go = threading.Event(), threading.Event()

    def __call__(self, spec: Any) -> Any:
        st = self.real(spec)
        if spec.job_id == self.job_id:
            self.staged.append(st)
            self.entered.set()
            self.go.wait(30)
        return st

    def open(self) -> None:
        self.go.set()


def leftovers(la: LocalAgent, staged: Any) -> list[str]:
    """What exists of a staged run: its run and work directories (and anything else of its
    name under the executor's base dir), its cgroups unless its slot went back to the
    executor's pool (empty, for another run), and any cgroup of its name in every cgroup v1
    hierarchy (under the agent's root, and top-level <root>@<run>)."""
    name = safe_name(staged.run_key)   # <base_dir>/<name>/work, <root>/<name>, <root>@<name>
    paths = [staged.process.run_dir, staged.work_dir_created]
    slot = staged.slot
    if slot is not None and slot.paths:
        pooled = la.executor.slots.holds(slot) and all(
            not open(os.path.join(d, "cgroup.procs")).read().strip() for d in slot.paths.values())
        paths += [] if pooled else sorted(slot.paths.values())
    paths += glob.glob(os.path.join(la.executor.base_dir, name + "*"))
    paths += glob.glob(f"/sys/fs/cgroup/*/{la.cgroup_root}/{name}") + glob.glob(f"/sys/fs/cgroup/*/{la.cgroup_root}@{name}")
    return sorted({p for p in paths if p and os.path.exists(p)})


@pytest.fixture(params=["cgroup1", "rlimit"])
def quota_backend(request) -> str:
    require_kernel(os.geteuid() == 0, "the agent's runs are root jobs in separate directories: needs root")
    if request.param == "cgroup1":
        # fails under MILLWRIGHT_REQUIRE_KERNEL=1 without cgroup v1 (no backend is set up
        # here: the agent makes and removes its own cgroup root)
        require_kernel(Cgroup1Backend().mounts != {}, "cgroup v1 hierarchies are not mounted")
    return request.param


@pytest.fixture
def env(etcd_server, tmp_path, quota_backend, monkeypatch):
    c, la, out = recording_agent(etcd_server, tmp_path, "st0", quota_backend)
    store = c.signing(JobStore(c.client, c.keys, c.shards, "test"))
    gates: list[StageGate] = []

    def gate(job_id: str) -> StageGate:
        g = StageGate(la.executor, job_id)
        monkeypatch.setattr(la.executor, "stage", g)
        gates.append(g)
        return g

    la.start()
    try:
        wait_for(lambda: c.all_owned_by({"st0"}), 20, what="the agent holding every shard")
        yield c, la, store, gate, out
    finally:
        for g in gates:
            g.open()
        if etcd_server.paused:
            etcd_server.resume()
        la.stop()
        c.close()


def held_claim(la: LocalAgent, store: Any, gate: Callable[[str], StageGate], job_id: str,
               **doc: Any) -> tuple[StageGate, Any]:
    """A job due now (``doc``: more of its fields), its firing's claim held in stage() with
    the run staged: (gate, firing)."""
    g = gate(job_id)
    store.create(job(job_id, {}, issued_at=format_rfc3339(datetime.now(timezone.utc).replace(microsecond=0)),
                     **doc))
    assert g.entered.wait(20), "the firing was never claimed"
    (staged,) = g.staged
    assert staged.error is None, staged.error
    f = la.on_loop(lambda: next(iter(la.scheduler.catalog.entries[job_id].firings.values())))
    assert la.on_loop(lambda: f.state) == FiringState.CLAIMING
    return g, f


def settle(la: LocalAgent, f: Any) -> None:
    """Until the claim's result was handled (the firing is done) and the executor's reaper
    did what it was told by then (an unstage() included)."""
    wait_for(lambda: la.on_loop(lambda: f.state) == FiringState.DONE, 20, interval=0.05, what="the firing done")
    la.reaper_idle()


def test_a_claim_fenced_in_flight_never_runs_and_its_staged_run_is_unstaged(env, etcd_server, quota_backend, caplog):
    """The agent fences itself (etcd stopped answering past the renew deadline) while a
    firing's claim is being staged: the scheduler drops the shard's jobs, and when the
    claim comes back _spawn finds no fence and unstages. After etcd is back, the agent
    (holding the shard again) resolves the record as owner_lost; the job never ran."""
    c, la, store, gate, out = env
    caplog.set_level(logging.DEBUG, logger="agent.jobs.scheduler")
    g, f = held_claim(la, store, gate, "fenced")
    before = leftovers(la, g.staged[0])
    assert any(p.startswith(la.executor.base_dir) for p in before), before
    if quota_backend == "cgroup1":
        assert any(p.startswith("/sys/fs/cgroup/") for p in before), before
    fid = f.fire_id
    assert run_records(c.client, c.keys)[("fenced", fid)]["state"] == "running"   # the claim landed
    etcd_server.pause()
    wait_for(lambda: not la.agent.ownership.owned, 20, interval=0.05, what="the agent fenced")
    assert la.on_loop(lambda: "fenced" not in la.scheduler.catalog.entries and la.agent.ownership.fence_for(f.entry.shard) is None)
    g.open()
    settle(la, f)
    # _spawn found no fence (the last word: on a loaded host an earlier firing of the job
    # can be given up as not_owner while the just-started agent still settles its shards;
    # the shard's next load fires it again, and that is the firing held here)
    assert abandoned(caplog, "fenced")[-1:] == ["fenced"]
    assert la.on_loop(lambda: f.key not in la.scheduler.admitter.admission.running)
    assert leftovers(la, g.staged[0]) == [], f"staged: {before}"
    etcd_server.resume()
    rec = wait_for(lambda: (lambda r: r if r["state"] != "running" else None)(
        run_records(c.client, c.keys)[("fenced", fid)]), 30, interval=0.2, what="the record resolved")
    assert (rec["state"], rec["reason"]) == ("failed", "owner_lost"), rec
    assert effects(out)[("fenced", fid)] == 0
    assert leftovers(la, g.staged[0]) == []


def test_a_claim_back_after_its_shard_was_held_again_does_not_run_beside_the_new_entry(env, etcd_server, caplog):
    """The agent fences itself while a firing's claim is being staged (its `running` record
    landed), takes its shards back under a new session and loads the job anew: that load
    read the record, and the new entry resolves it as owner_lost; this job retries
    owner_lost, so the new entry runs attempt 2. When the held claim then comes back (the
    shard is held, under the new fence), its firing must not run as well: attempt 1 would
    run beside attempt 2, the job twice (the claim path did so from ded4261 on)."""
    c, la, store, gate, out = env
    sch = la.scheduler
    caplog.set_level(logging.DEBUG, logger="agent.jobs.scheduler")
    jid = "held-again"
    g, f = held_claim(la, store, gate, jid, retry={"max_attempts": 2, "backoff_s": 0, "on": ["owner_lost"]})
    fid, shard = f.fire_id, f.entry.shard
    old_fence = la.on_loop(lambda: la.agent.ownership.owns(shard))
    assert run_records(c.client, c.keys)[(jid, fid)]["state"] == "running"   # the claim landed
    etcd_server.pause()
    wait_for(lambda: not la.agent.ownership.owned, 20, interval=0.05, what="the agent fenced")
    etcd_server.resume()
    # held again, the job installed anew from the shard's load (which read the record)
    wait_for(lambda: la.on_loop(lambda: sch.catalog.entries.get(jid, f.entry) is not f.entry), 30, interval=0.05,
             what="the job installed again")
    new_fence = la.on_loop(lambda: la.agent.ownership.fence_for(shard))
    assert new_fence is not None and new_fence.token != old_fence.token
    assert la.on_loop(lambda: f.state) == FiringState.CLAIMING
    g.open()   # the held claim comes back; the new entry's attempt 2 stages and runs too
    settle(la, f)
    rec = wait_for(lambda: (lambda r: r if r["state"] not in ("running", "retrying") else None)(
        run_records(c.client, c.keys)[(jid, fid)]), 30, interval=0.1, what="the record final")
    assert (rec["state"], rec["attempt"]) == ("succeeded", 2), rec
    assert effects(out)[(jid, fid)] == 1, "the firing ran twice (the held claim beside the new entry's retry)"
    assert "dropped" in abandoned(caplog, jid)
    assert leftovers(la, g.staged[0]) == []


@pytest.mark.parametrize("how", ["cancelled", "deleted"])
def test_a_job_cancelled_or_deleted_while_its_claim_is_in_flight_never_runs(env, quota_backend, how, caplog):
    """The job is cancelled (JobStore.cancel, as ingest does) or its key deleted while its
    firing's claim is being staged; the shard stays held. The firing must not start when
    the claim comes back: its staged run is handed back, a cancelled firing's record ends
    `cancelled`, and the job never ran. A round whose shard changed hands meanwhile (seen
    on a loaded CI host) checks only that, and the next round, with a new job, the rest."""
    c, la, store, gate, out = env
    caplog.set_level(logging.DEBUG, logger="agent.jobs.scheduler")
    moved = []
    for round_ in range(3):
        jid = f"gone-{how}-{round_}"
        g, f = held_claim(la, store, gate, jid)
        earlier = len(abandoned(caplog, jid))   # a shard re-acquired at start-up may abandon an earlier claim
        before = leftovers(la, g.staged[0])
        assert any(p.startswith(la.executor.base_dir) for p in before), before
        if quota_backend == "cgroup1":
            assert any(p.startswith("/sys/fs/cgroup/") for p in before), before
        fid = f.fire_id
        held = la.on_loop(lambda: la.agent.ownership.owns(f.entry.shard))
        if how == "cancelled":
            assert store.cancel(jid)[0] == "cancelled"
            wait_for(lambda: la.on_loop(lambda: la.scheduler.catalog.entries[jid].cancelled), 20, interval=0.05,
                     what="the cancel applied")
        else:
            c.client.delete(store.key(jid)[1])
            wait_for(lambda: la.on_loop(lambda: jid not in la.scheduler.catalog.entries), 20, interval=0.05,
                     what="the job dropped")
        # still ours, under the claim's fence (a keepalive slower than the renew deadline on
        # a loaded host makes the session invalid for a moment without a self-fence)
        fence = wait_for(lambda: la.on_loop(lambda: la.agent.ownership.fence_for(f.entry.shard)), 10, interval=0.05,
                         what="the shard held")
        g.open()
        settle(la, f)
        assert effects(out)[(jid, fid)] == 0, "the job ran"
        assert la.on_loop(lambda: f.key not in la.scheduler.admitter.admission.running)   # its node budget given back
        assert leftovers(la, g.staged[0]) == [], f"staged: {before}"
        if fence != held:
            moved.append((held, fence, abandoned(caplog, jid)[earlier:]))
            continue
        assert abandoned(caplog, jid)[earlier:] == ([] if how == "cancelled" else ["dropped"])
        if how == "cancelled":
            rec = wait_for(lambda: (lambda r: r if r["state"] != "running" else None)(
                run_records(c.client, c.keys)[(jid, fid)]), 20, interval=0.1, what="the record final")
            assert (rec["state"], rec["reason"]) == ("cancelled", "cancelled"), rec
        return
    pytest.fail(f"the shard changed hands in every round (fence held, fence after, abandons): {moved}")


@pytest.mark.parametrize("quota_backend", ["cgroup1"], indirect=True)
@pytest.mark.parametrize("how", ["cancelled", "deleted"])
def test_a_firing_waiting_out_a_lapsed_session_to_spawn_ends_when_its_job_goes(env, quota_backend, how, caplog):
    """The claim comes back while the agent has no fence for the shard only because its
    session is past the renew deadline (the shard still held): _spawn waits for the fence
    (FENCE_WAIT_S, through _when_current). The job was cancelled or deleted meanwhile, so
    when that wait comes back the firing must end there (Scheduler._discard), not stay
    claiming forever: the job never runs, its staged run goes, its admission slot is given
    back, its shard is not kept busy, and a cancelled firing's record ends `cancelled`.

    The lapse is made for the duration of that firing's first _spawn only (on the loop):
    ownership.fence_for gives None for its shard and _session_lapsed True; the delayed call
    then runs against the real agent."""
    c, la, store, gate, out = env
    sch = la.scheduler
    caplog.set_level(logging.DEBUG, logger="agent.jobs.scheduler")
    jid = f"lapsed-{how}"
    slots = la.on_loop(lambda: len(sch.admitter.admission.running))
    g, f = held_claim(la, store, gate, jid)
    shard, fid = f.entry.shard, f.fire_id
    # abandons logged so far are of earlier firings of the job (seen: a `not_owner` one when
    # the shard was lost and held again just after start, the job then installed anew)
    earlier = len(abandoned(caplog, jid))
    assert la.on_loop(lambda: (len(sch.admitter.admission.running), sch.busy(shard))) == (slots + 1, True)
    before = leftovers(la, g.staged[0])
    assert any(p.startswith(la.executor.base_dir) for p in before), before
    assert any(p.startswith("/sys/fs/cgroup/") for p in before), before

    real_spawn, real_lapsed, real_fence_for = sch._spawn, sch._session_lapsed, la.agent.ownership.fence_for
    spawns: list[FiringState] = []     # the firing's state right after each of its _spawn calls
    discarded_by: list[str] = []       # which scheduler method called _discard for it

    def spawn(g2: Any) -> None:
        if g2 is not f or spawns:
            real_spawn(g2)
            return
        la.agent.ownership.fence_for = lambda s: None if s == shard else real_fence_for(s)   # type: ignore[method-assign]
        sch._session_lapsed = lambda g3: True if g3 is f else real_lapsed(g3)     # type: ignore[method-assign]
        try:
            real_spawn(g2)
        finally:
            del la.agent.ownership.fence_for, sch._session_lapsed   # the real ones again (class attributes)
        spawns.append(g2.state)

    real_discard = sch._discard

    def discard(g2: Any) -> None:
        if g2 is f:
            discarded_by.append(sys._getframe(1).f_code.co_name)
        real_discard(g2)

    la.on_loop(lambda: (setattr(sch, "_spawn", spawn), setattr(sch, "_discard", discard)))
    try:
        if how == "cancelled":
            assert store.cancel(jid)[0] == "cancelled"
            wait_for(lambda: la.on_loop(lambda: sch.catalog.entries[jid].cancelled), 20, interval=0.05,
                     what="the cancel applied")
        else:
            c.client.delete(store.key(jid)[1])
            wait_for(lambda: la.on_loop(lambda: jid not in sch.catalog.entries), 20, interval=0.05, what="the job dropped")
        assert la.on_loop(lambda: f.state) == FiringState.CLAIMING
        g.open()
        settle(la, f)
    finally:
        la.on_loop(lambda: (sch.__dict__.pop("_spawn", None), sch.__dict__.pop("_discard", None)))
    assert la.on_loop(lambda: la.agent.ownership.fence_for(shard)) is not None   # the patches are gone; still ours
    # _spawn waited for the fence (the firing still claiming), and the wait ended it
    assert spawns == [FiringState.CLAIMING]
    assert discarded_by == ["_when_current"]
    assert effects(out)[(jid, fid)] == 0, "the job ran"
    assert abandoned(caplog, jid)[earlier:] == ([] if how == "cancelled" else ["dropped"])
    assert la.on_loop(lambda: len(sch.admitter.admission.running)) == slots   # its node budget given back
    assert leftovers(la, g.staged[0]) == [], f"staged: {before}"
    if how == "cancelled":
        rec = wait_for(lambda: (lambda r: r if r["state"] != "running" else None)(
            run_records(c.client, c.keys)[(jid, fid)]), 20, interval=0.1, what="the record final")
        assert (rec["state"], rec["reason"]) == ("cancelled", "cancelled"), rec
    # not kept busy (its cancelled record's write, if still in flight, ends)
    wait_for(lambda: la.on_loop(lambda: not sch.busy(shard)), 20, interval=0.05, what="the shard not busy")
    assert la.on_loop(lambda: f.state) == FiringState.DONE
    assert effects(out)[(jid, fid)] == 0, "the job ran"
