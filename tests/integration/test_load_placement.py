"""Load-aware placement with real agents and etcd: an agent whose loop stays late (here:
held by a handler that sleeps, again and again) says so in its member record, publishes
half its weight and hands shards to its peer, which has headroom; the peer takes them."""

from __future__ import annotations

import json
import os
import threading
import time

from tests.support.cluster import Cluster
from tests.support.jobs import effects_file, templates
from tests.support.kernel import require_kernel
from tests.support.local_agent import KILL_GRACE_S, RENEW_S, TTL_S, LocalAgent
from tests.support.waiting import wait_for


def member(c: Cluster, agent_id: str) -> dict:
    kv = c.client.get(c.keys.member(agent_id))
    return json.loads(kv.value) if kv is not None else {}


def test_an_agent_whose_loop_stays_late_hands_shards_to_a_peer_with_headroom(etcd_server, tmp_path):
    require_kernel(os.geteuid() == 0, "the agent's executor makes its run directories as root: needs root")
    c = Cluster(etcd_server, str(tmp_path / "agents"), shards=16, ttl=TTL_S, renew_deadline=RENEW_S,
                retry_period=0.3)
    slow = LocalAgent(c, "slow", {"templates": templates(effects_file(tmp_path)), "mqtt": {"url": "mqtt://127.0.0.1:9"},
                                  "execute": {"quota_backend": "rlimit", "kill_grace_s": KILL_GRACE_S}})
    holding = threading.Event()
    try:
        slow.start()
        c.start("quick")
        wait_for(lambda: c.counts() == {"slow": 8, "quick": 8}, 30, interval=0.1, what="an even split")
        assert member(c, "slow")["load"]["overloaded"] is False and member(c, "slow")["capacity"] == 1.0

        def hold_the_loop() -> None:
            while not holding.is_set():
                slow.agent.loop.post(time.sleep, 0.7)   # every due timer waits behind it
                time.sleep(0.75)
        threading.Thread(target=hold_the_loop, daemon=True).start()
        wait_for(lambda: member(c, "slow").get("load", {}).get("overloaded") is True, 40, interval=0.2,
                 what="the slow agent's member record saying it is overloaded")
        rec = member(c, "slow")
        assert rec["load"]["weight"] == 0.5 and rec["capacity"] == 0.5 and rec["available"] is True
        assert member(c, "quick")["load"]["overloaded"] is False
        wait_for(lambda: c.counts()["quick"] > 8 and c.counts()["slow"] < 8
                 and sum(c.counts().values()) == 16, 30, interval=0.1, what="shards moved to the peer")
        assert c.counts()["slow"] >= 4   # bounded: half the weight, not every shard
    finally:
        holding.set()
        slow.stop()
        c.close()
