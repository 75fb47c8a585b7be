#!/usr/bin/env python3
"""Push -> accepted while the job's owner is gone for good (cloud acceptance 5).

Two agents share the shards; the owner of the pushed job is SIGKILLed, so its persistent
MQTT session queues the push and nobody owning the shard answers. The surviving agent
ingests it after ``mqtt.ingest_grace_s`` (1.5 s here). Figure: publish -> `accepted`
status seen by a subscriber, over BENCH_TRIALS trials (default 5); the product's goal is
under 5 s. Real etcd, real mosquitto, real `millwright run` agents.

    /usr/bin/python3 bench/bench_push_gone.py
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.support.cloudkit import TEMPLATES, StatusCollector, job_doc, signed, write_keys  # noqa: E402
from agent.coordination.keys import shard_of  # noqa: E402
from agent.demo.services import EtcdServer, MosquittoServer  # noqa: E402
from tests.support.cluster import Cluster  # noqa: E402
from tests.support.waiting import wait_for  # noqa: E402
from tests.support.cloud import Pusher, accepted, wait_agent_connected  # noqa: E402

TRIALS = int(os.environ.get("BENCH_TRIALS", "5"))
SHARDS = 8
GRACE_S = 1.5
GOAL_S = 5.0


def trial(n: int, base: str, etcd: EtcdServer, mq: MosquittoServer, keys: str, ring) -> float:
    cl = Cluster(etcd, os.path.join(base, f"agents-{n}"), cluster="t", shards=SHARDS, ttl=4, renew_deadline=2.5,
                 retry_period=0.5,
                 extra={"mqtt": {"url": mq.url, "reconnect_min_s": 0.2, "reconnect_max_s": 1.0,
                                 "ingest_grace_s": GRACE_S},
                        "signing": {"keys_file": keys}, "templates": TEMPLATES, "bpf": {"enabled": False}})
    col = StatusCollector(mq.url, "t", extra_filters=("millwright/t/agents/#",)).start()
    pusher = None
    try:
        a, b = f"a{n}", f"b{n}"
        cl.start(a)
        victim = cl.start(b)
        wait_for(lambda: cl.all_owned_by({a, b}) and len(set(cl.owners().values())) == 2, 60,
                 what="two agents share the shards")
        wait_agent_connected(col, a)
        wait_agent_connected(col, b)
        owners = cl.owners()
        jid = next(f"gone-{n}-{i}" for i in range(10000) if owners[shard_of(f"gone-{n}-{i}", SHARDS)] == b)
        victim.kill()
        pusher = Pusher(mq.url, f"gone-pusher-{n}")
        t0 = time.monotonic()
        pusher.push(signed(job_doc(jid), ring))
        assert col.wait(lambda m: jid in accepted(col), 30), "push never accepted"
        elapsed = time.monotonic() - t0
        by = {d["agent"] for d in accepted(col)[jid].values()}
        assert by == {a}, by
        return elapsed
    finally:
        if pusher is not None:
            pusher.stop()
        col.stop()
        cl.close()


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="mw-bench-gone-") as base:
        etcd = EtcdServer(os.path.join(base, "etcd"))
        mq = MosquittoServer(os.path.join(base, "mq"))
        for s in (etcd, mq):
            os.makedirs(s.dir, exist_ok=True)
            s.start()
        try:
            keys = os.path.join(base, "keys.yaml")
            ring = write_keys(keys)
            times = []
            for n in range(TRIALS):
                t = trial(n, base, etcd, mq, keys, ring)
                times.append(t)
                print(f"  trial {n + 1}: accepted by the survivor {t:.2f} s after the push", flush=True)
        finally:
            mq.close()
            etcd.close()
    print(f"push -> accepted with its owner gone (ingest_grace_s {GRACE_S}): median {statistics.median(times):.2f} s, "
          f"max {max(times):.2f} s over {len(times)} trials (goal < {GOAL_S:g} s; load {os.getloadavg()[0]:.2f})")
    return 0 if max(times) < GOAL_S else 1


if __name__ == "__main__":
    sys.exit(main())
