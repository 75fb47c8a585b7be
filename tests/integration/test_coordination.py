"""Shard ownership on a real etcd with real agent processes (issue 2 acceptance)."""

from __future__ import annotations

import shutil
import signal
import time

import pytest

from tests.support.kernel import require_kernel
from tests.support.cluster import Cluster, check_history
from tests.support.network import NftBlock
from tests.support.waiting import wait_for

FENCED_WRITES = {"MILLWRIGHT_TEST_FENCED_WRITES_S": "1.0"}


@pytest.fixture
def cluster(etcd_server, tmp_path):
    c = Cluster(etcd_server, str(tmp_path / "agents"), ttl=4, renew_deadline=2.5, retry_period=0.5,
                env=FENCED_WRITES)
    yield c
    c.close()


def assert_history_clean(c: Cluster) -> dict:
    h = check_history(c.client, c.keys)
    assert h["problems"] == [], h["problems"][:5]
    assert h["fenced_writes"] > 0
    return h


def test_three_agents_balanced_and_fourth_moves_about_a_quarter(cluster):
    for i in range(3):
        cluster.start(f"a{i}")
    wait_for(lambda: cluster.converged({"a0": 1, "a1": 1, "a2": 1}), 15, what="3-way plan")
    before = cluster.owners()
    share = 64 / 3
    for agent, n in cluster.counts().items():
        assert abs(n - share) <= 0.2 * share, (agent, n)
    cluster.start("a3")
    wait_for(lambda: cluster.converged({"a0": 1, "a1": 1, "a2": 1, "a3": 1}), 15, what="4-way plan")
    after = cluster.owners()
    moved = sum(1 for s in before if before[s] != after.get(s))
    for agent, n in cluster.counts().items():
        assert abs(n - 16) <= 0.2 * 16, (agent, n)
    # the ideal is 16 (1/4 of 64); bounded-load rendezvous adds a few from re-balancing
    assert 16 <= moved <= 24, moved
    assert_history_clean(cluster)


def test_weighted_capacity(cluster):
    cluster.start("big", capacity=2.0)
    cluster.start("small", capacity=1.0)
    wait_for(lambda: cluster.converged({"big": 2.0, "small": 1.0}), 15, what="weighted plan")
    c = cluster.counts()
    assert abs(c["big"] - 64 * 2 / 3) <= 0.2 * 64 * 2 / 3
    assert abs(c["small"] - 64 / 3) <= 0.2 * 64 / 3
    # a part wired into the daemon (issue 49's second sample change) answers in its status
    disk = _status(cluster.agents["big"])["state_disk"]
    assert disk["free_bytes"] > 0 and 0 < disk["free_ratio"] <= 1 and disk["error"] is None, disk


def test_kill9_failover_within_ttl_plus_one(cluster):
    for i in range(3):
        cluster.start(f"a{i}")
    wait_for(lambda: cluster.converged({"a0": 1, "a1": 1, "a2": 1}), 15, what="3-way plan")
    victim_shards = {s for s, a in cluster.owners().items() if a == "a1"}
    assert victim_shards
    t0 = time.monotonic()
    cluster.agents["a1"].kill()
    wait_for(lambda: all(cluster.owners().get(s) in ("a0", "a2") for s in victim_shards), cluster.ttl + 3,
             what="survivors to own a1's shards")
    elapsed = time.monotonic() - t0
    assert elapsed <= cluster.ttl + 1.0, elapsed
    assert "a1" not in cluster.members()
    assert_history_clean(cluster)


def test_sigterm_hands_over_before_the_ttl_and_exits_zero(cluster):
    for i in range(3):
        cluster.start(f"a{i}")
    wait_for(lambda: cluster.converged({"a0": 1, "a1": 1, "a2": 1}), 15, what="3-way plan")
    leaving = {s for s, a in cluster.owners().items() if a == "a2"}
    t0 = time.monotonic()
    cluster.agents["a2"].proc.send_signal(signal.SIGTERM)
    # contract: a drained agent revokes its lease, so peers own its shards well before the
    # lease could have expired (at least TTL minus a keepalive interval after the signal).
    # Measured ~0.1 s (a figure, not the bound); the bound is half the TTL, which holds at
    # load 10 and still tells a revoke from an expiry; polled at a fortieth of it.
    wait_for(lambda: all(cluster.owners().get(s) in ("a0", "a1") for s in leaving), 10, interval=0.05,
             what="handover")
    elapsed = time.monotonic() - t0
    print(f"\nSIGTERM hand-over in {elapsed:.2f} s")
    assert elapsed < cluster.ttl / 2, elapsed
    assert cluster.agents["a2"].proc.wait(10) == 0
    assert "draining" in cluster.agents["a2"].log_text()
    assert_history_clean(cluster)


def _status(agent) -> dict:
    from agent.daemon.admin import query

    return query(agent.config["admin"]["socket"])


def test_partitioned_agent_self_fences_before_its_lease_expires(cluster, etcd_server):
    require_kernel(shutil.which("nft") is not None, "nft (nftables) is not installed")
    cluster.start("a0")
    cluster.start("a1")
    cut = cluster.start("cut", endpoint_host="127.0.0.2")
    wait_for(lambda: cluster.all_owned_by({"a0", "a1", "cut"}) and len(cluster.counts()) == 3, 15, what="split")
    cut_shards = {s for s, a in cluster.owners().items() if a == "cut"}
    try:
        block = NftBlock("127.0.0.2", etcd_server.port).__enter__()
    except Exception as exc:  # nft present but unusable here
        require_kernel(False, f"nftables unusable: {exc}")
    with block:
        # one loop watches both sides, each poll first asking the agent, then etcd: the
        # agent must report itself fenced in a poll where etcd still shows its shard keys
        # (its lease has not expired), and its peers take the shards only after that
        t0 = time.monotonic()
        t_fence = t_gone = None
        held_at_fence: set = set()
        while t_gone is None and time.monotonic() - t0 < cluster.ttl + 10:
            fenced = _status(cut)["session"]["fenced"] is not None
            owners = cluster.owners()
            held = {s for s, a in owners.items() if a == "cut"}
            if fenced and t_fence is None:
                t_fence, held_at_fence = time.monotonic() - t0, held
                assert _status(cut)["shards"]["count"] == 0
            if all(owners.get(s) in ("a0", "a1") for s in cut_shards):
                t_gone = time.monotonic() - t0
            time.sleep(0.05)
        assert t_fence is not None, f"the cut agent had not fenced itself when its peers took its shards ({t_gone})"
        assert held_at_fence, f"the agent fenced at {t_fence:.2f} s, after its lease had expired"
        assert t_gone is not None and t_fence < t_gone, (t_fence, t_gone)
        print(f"\nfenced {t_fence:.2f} s after the cut, peers owned its shards at {t_gone:.2f} s")
    # after the partition heals, the agent comes back, gets a new lease and shards again
    wait_for(lambda: cluster.counts().get("cut", 0) > 0 and cluster.all_owned_by({"a0", "a1", "cut"}), 20,
             what="cut agent to rejoin")
    assert "self-fenced" in cut.log_text()
    assert_history_clean(cluster)


def test_sigstopped_agent_never_writes_with_a_stale_token(cluster):
    for i in range(3):
        cluster.start(f"a{i}")
    wait_for(lambda: cluster.converged({"a0": 1, "a1": 1, "a2": 1}), 15, what="3-way plan")
    paused = cluster.agents["a0"]
    paused_shards = {s for s, a in cluster.owners().items() if a == "a0"}
    paused.signal(signal.SIGSTOP)
    wait_for(lambda: all(cluster.owners().get(s) in ("a1", "a2") for s in paused_shards), cluster.ttl + 3,
             what="takeover from the paused agent")
    paused.signal(signal.SIGCONT)  # it wakes up believing it owns shards; fencing must stop it
    wait_for(lambda: cluster.counts().get("a0", 0) > 0 and cluster.all_owned_by({"a0", "a1", "a2"}), 20,
             what="paused agent to rejoin")
    time.sleep(0.5)
    h = assert_history_clean(cluster)
    assert h["releases"] > 0


def test_etcd_down_five_seconds_then_everyone_recovers(cluster, etcd_server):
    for i in range(3):
        cluster.start(f"a{i}")
    wait_for(lambda: cluster.converged({"a0": 1, "a1": 1, "a2": 1}), 15, what="3-way plan")
    etcd_server.stop()
    time.sleep(5)
    etcd_server.start()
    wait_for(lambda: cluster.all_owned_by({"a0", "a1", "a2"}) and len(cluster.counts()) == 3, 25,
             what="recovery after etcd restart")
    for a in cluster.agents.values():
        assert a.alive()
    assert_history_clean(cluster)


def test_pause_etcd_agents_fence_and_recover(cluster, etcd_server):
    for i in range(2):
        cluster.start(f"a{i}")
    wait_for(lambda: cluster.all_owned_by({"a0", "a1"}) and len(cluster.counts()) == 2, 15, what="split")
    etcd_server.pause()
    time.sleep(4)
    states = [_status(a)["session"] for a in cluster.agents.values()]
    etcd_server.resume()
    assert all(s["fenced"] for s in states), states
    wait_for(lambda: cluster.all_owned_by({"a0", "a1"}) and len(cluster.counts()) == 2, 25, what="recovery")
    assert_history_clean(cluster)
