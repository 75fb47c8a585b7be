#!/usr/bin/env python3
"""jobs/get benchmark: signed request -> answer latency over MQTT for BENCH_JOBS jobs (1,000) at
BENCH_RATE requests per second (200, open loop) for BENCH_SECONDS (10), two real agents,
real etcd and mosquitto. Each request asks for one random job by id; the owner of its shard
checks the signature, reads the job and its last runs from etcd and answers under its own
prefix (agents/<id>/get/<correlation>). Then one signed filter over every job, followed
page by page (mqtt.get_page_bytes each) to the end.

    /usr/bin/python3 bench/bench_jobs_get.py

Prints p50/p99/max and how many requests were answered, and the filter's pages and time.
The jobs are stored by pushing them (the real ingest path) before the measurement starts.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from agent.cloud.asking import Asker, query_doc  # noqa: E402
from agent.cloud.mqtt import MqttLink  # noqa: E402
from tests.support.cloudkit import KID, TEMPLATES, StatusCollector, job_doc, signed, write_keys  # noqa: E402
from agent.cloud.topics import Topics  # noqa: E402
from agent.config import MqttConfig  # noqa: E402
from agent.demo.services import EtcdServer, MosquittoServer  # noqa: E402
from tests.support.cluster import Cluster  # noqa: E402
from tests.support.waiting import wait_for  # noqa: E402

JOBS = int(os.environ.get("BENCH_JOBS", "1000"))
RATE = float(os.environ.get("BENCH_RATE", "200"))
SECONDS = float(os.environ.get("BENCH_SECONDS", "10"))


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def main() -> int:
    base = tempfile.mkdtemp(prefix="mw-bench-get-")
    etcd = EtcdServer(os.path.join(base, "etcd"))
    mq = MosquittoServer(os.path.join(base, "mq"))
    for s in (etcd, mq):
        os.makedirs(s.dir, exist_ok=True)
        s.start()
    keys = os.path.join(base, "keys.yaml")
    ring = write_keys(keys)
    cl = Cluster(etcd, os.path.join(base, "agents"), shards=64, ttl=10, renew_deadline=6, retry_period=1,
                 extra={"mqtt": {"url": mq.url}, "signing": {"keys_file": keys}, "templates": TEMPLATES,
                        "bpf": {"enabled": False}})
    topics = Topics("t")
    col = StatusCollector(mq.url, "t").start()
    sent: dict[str, float] = {}
    got: dict[str, float] = {}
    lock = threading.Lock()

    class TimedAsker(Asker):
        def _msg(self, msg):
            t = time.monotonic()
            super()._msg(msg)
            with lock:
                for corr, answers in self.answers.items():
                    if answers:
                        got.setdefault(corr, t)

    asker = TimedAsker(MqttConfig(url=mq.url), "t", ring, KID)
    pusher = MqttLink(MqttConfig(url=mq.url), "bench-get-pusher", clean_session=True, max_inflight=1000)
    try:
        cl.start("b1")
        cl.start("b2")
        wait_for(lambda: cl.all_owned_by({"b1", "b2"}) and len(set(cl.owners().values())) == 2, 60, what="2 agents")
        pusher.start()
        assert pusher.wait_connected(10) and asker.start(10)
        ids = [f"get-{i:05d}" for i in range(JOBS)]
        for j in ids:
            pusher.publish(topics.push, signed(job_doc(j), ring), 1)
        wait_for(lambda: len({d["job_id"] for d in col.docs("accepted")}) >= JOBS, 300, 0.2, what="jobs stored")
        time.sleep(1.0)
        n = int(RATE * SECONDS)
        t0 = time.monotonic()
        for i in range(n):
            target = t0 + i / RATE
            delay = target - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            corr = f"c{i}"
            payload = asker.signed(query_doc("t", corr, job_id=random.choice(ids)))
            with lock:
                sent[corr] = time.monotonic()
            asker.link.publish(topics.jobs_get, payload, 1)  # open loop: no wait for the PUBACK
        send_rate = n / (time.monotonic() - t0)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(got) < n:
            time.sleep(0.1)
        lat = [got[c] - sent[c] for c in sent if c in got]
        load = os.getloadavg()
        print(f"jobs/get: {JOBS} jobs, {n} signed requests at {send_rate:.0f}/s (asked {RATE:g}/s), 2 agents, 64 shards")
        print(f"  answered {len(lat)}/{n}; latency p50 {pct(lat, 50) * 1000:.1f} ms, p99 {pct(lat, 99) * 1000:.1f} ms, "
              f"max {max(lat) * 1000:.1f} ms")
        t1 = time.monotonic()
        listing = asker.list({}, timeout=120)
        took = time.monotonic() - t1
        sizes = [size for _, _, size in listing["pages"]]
        print(f"  filter over every job: {len(listing['jobs'])} jobs in {len(sizes)} pages (largest {max(sizes)} bytes), "
              f"{took:.2f}s, complete {listing['complete']}")
        print(f"  load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        return 0 if len(lat) == n else 1
    finally:
        asker.stop()
        pusher.stop()
        col.stop()
        cl.close()
        for s in (mq, etcd):
            s.close()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
