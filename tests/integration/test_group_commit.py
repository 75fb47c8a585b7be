"""Fenced writes in batches, against a real etcd: one transaction holds the writes of
several shards, each keeps its own outcome (landed, its compare failed, or its fence is
stale, which fails only that shard's writes), and the scheduler claims firings due
together in one transaction, each run once."""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Any

import agent.coordination.fencing as fencing
from agent.coordination.etcd import Create, Mod, Put
from agent.coordination.fencing import Fence, FencedWrite, StaleToken, fenced_batch
from agent.coordination.jobstore import JobStore
from agent.jobs.schedule import format_rfc3339
from tests.support.cluster import Cluster
from tests.support.jobs import effects, job, now
from tests.support.kernel import require_kernel
from tests.support.local_agent import recording_agent
from tests.support.records import run_records
from tests.support.waiting import wait_for


def test_each_write_of_a_batch_keeps_its_own_outcome_and_a_stale_fence_fails_only_its_shard(etcd_server, tmp_path):
    c = Cluster(etcd_server, str(tmp_path / "c"), shards=4)
    try:
        client = c.client
        client.put("/t/shards/0", "agent-a")
        held = Fence(0, "/t/shards/0", client.get("/t/shards/0").create_revision)
        client.put("/t/shards/1", "agent-b")
        stale = Fence(1, "/t/shards/1", client.get("/t/shards/1").create_revision + 1000)   # not the key's
        client.put("/t/runs/0/taken", "someone's")
        client.put("/t/runs/0/mine-2", "v1")
        rev2 = client.get("/t/runs/0/mine-2").mod_revision
        writes = [
            FencedWrite(held, (Create("/t/runs/0/mine") == 0,), (Put("/t/runs/0/mine", "claimed"),
                                                                 Put("/t/latest/0/j", "claimed"))),
            FencedWrite(stale, (Create("/t/runs/1/theirs") == 0,), (Put("/t/runs/1/theirs", "claimed"),)),
            FencedWrite(held, (Create("/t/runs/0/taken") == 0,), (Put("/t/runs/0/taken", "claimed"),)),
            FencedWrite(held, (Mod("/t/runs/0/mine-2") == rev2,), (Put("/t/runs/0/mine-2", "v2"),)),
        ]
        out = fenced_batch(client, writes)
        assert out[0].succeeded and out[3].succeeded and not out[2].succeeded
        assert isinstance(out[1], StaleToken)
        assert client.get("/t/runs/0/mine").value == b"claimed" and client.get("/t/latest/0/j").value == b"claimed"
        assert client.get("/t/runs/0/mine").mod_revision == out[0].revision == out[3].revision   # one transaction
        assert client.get("/t/runs/0/mine-2").value == b"v2"
        assert client.get("/t/runs/0/taken").value == b"someone's"
        assert client.get("/t/runs/1/theirs") is None
        # the same writes again: the creates find their records, the swap a newer revision
        again = fenced_batch(client, [writes[0], writes[3]])
        assert [r.succeeded for r in again] == [False, False]
    finally:
        c.close()


def test_firings_due_together_are_claimed_in_one_transaction_and_each_runs_once(etcd_server, tmp_path,
                                                                                  monkeypatch):
    require_kernel(os.geteuid() == 0, "the agent's runs are root jobs in separate directories: needs root")
    c, la, out = recording_agent(etcd_server, tmp_path, "gc0", "rlimit")
    store = c.signing(JobStore(c.client, c.keys, c.shards, "test"))
    batches: list[int] = []      # per batch, how many claims of the test's jobs it held
    lock = threading.Lock()
    real = fencing.fenced_batch

    def counting(client: Any, writes: Any, **kw: Any) -> Any:
        claims = sum(1 for w in writes if any(isinstance(cmp, Create) for cmp in w.compare))
        with lock:
            batches.append(claims)
        return real(client, writes, **kw)

    monkeypatch.setattr(fencing, "fenced_batch", counting)
    la.start()
    try:
        wait_for(lambda: c.all_owned_by({"gc0"}), 20, what="the agent holding every shard")
        wait_for(lambda: la.on_loop(lambda: set(la.scheduler.catalog.loaded) == set(range(c.shards))), 20,
                 interval=0.05, what="every shard loaded")
        due = now().replace(microsecond=0) + timedelta(seconds=4)
        ids = [f"together-{i}" for i in range(30)]
        for jid in ids:
            store.create(job(jid, {"at": format_rfc3339(due)}))

        def all_final() -> bool:
            recs = {j: r for (j, _), r in run_records(c.client, c.keys).items() if j in ids}
            return len(recs) == len(ids) and all(r["state"] == "succeeded" for r in recs.values())
        wait_for(all_final, 30, interval=0.2, what="every firing's record succeeded")
        ran = effects(out)
        assert sorted(j for j, _ in ran) == sorted(ids) and set(ran.values()) == {1}
        assert max(batches) > 1, f"claims per transaction: {batches}"
    finally:
        la.stop()
        c.close()
