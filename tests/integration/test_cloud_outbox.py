"""Acceptance 4: statuses produced while the broker is down (60 s) all arrive after it is
back, in order for each job. The outbox, publisher and MQTT link run in-process against a
real mosquitto; the statuses go in through the same sink the daemon calls."""

from __future__ import annotations

import os
import time

from agent.cloud.mqtt import MqttLink
from agent.cloud.outbox import Outbox, OutboxPublisher
from tests.support.cloudkit import StatusCollector
from agent.cloud.topics import Topics
from agent.config import MqttConfig


OUTAGE_S = float(os.environ.get("MILLWRIGHT_CLOUD_OUTAGE_S", "60"))
STATES = ["scheduled", "running", "retrying", "running", "succeeded"]


def test_broker_outage_statuses_arrive_in_order(mosquitto_server, tmp_path):
    # the shared fixture's broker persists sessions: the subscriber's survives the restart
    topics = Topics("t", "a1")
    collector = StatusCollector(mosquitto_server.url, "t").start()
    ob = Outbox(str(tmp_path / "outbox.sqlite"), 100000)
    pub = None
    link = MqttLink(MqttConfig(url=mosquitto_server.url), "millwright-t-outbox-test", clean_session=False,
                    on_publish=lambda mid: pub.on_publish(mid), topic_kind=topics.kind,
                    reconnect_min_s=0.2, reconnect_max_s=2.0)
    pub = OutboxPublisher(ob, link, window=32)
    pub.start()
    link.start()
    assert link.wait_connected(10)
    produced: list[tuple[str, str]] = []

    def sink(job: str, state: str, attempt: int) -> None:  # what agent.status_sinks gets
        ob.enqueue(topics.status(job), {"v": 1, "job_id": job, "run_id": f"{job}/r", "state": state,
                                        "attempt": attempt, "agent": "a1", "shard": 0,
                                        "ts": time.time(), "exit_code": 0 if state == "succeeded" else None,
                                        "reason": None, "usage": None})
        produced.append((job, state))

    try:
        for i in range(10):  # before the outage
            for a, st in enumerate(STATES):
                sink(f"pre-{i}", st, a)
        mosquitto_server.stop()
        # runs keep finishing for the whole outage
        jobs = 40
        step = OUTAGE_S / (jobs * len(STATES))
        t_end = time.monotonic() + OUTAGE_S
        for i in range(jobs):
            for a, st in enumerate(STATES):
                sink(f"out-{i}", st, a)
                time.sleep(step)
        time.sleep(max(0.0, t_end - time.monotonic()))
        assert not link.connected
        assert ob.depth >= jobs * len(STATES)  # all waiting durably
        mosquitto_server.start()
        total = len(produced)

        def seen_all(msgs):
            return len({d.get("seq") for _, _, d in msgs if d.get("job_id")}) >= total
        assert collector.wait(seen_all, 60), (len(collector.messages), total, ob.depth)
        assert pub.flush(10)
        # in order per job; transport duplicates (same seq) count once
        got: dict = {}
        seen = set()
        for _, _, d in collector.messages:
            if d["seq"] in seen:  # a transport duplicate (QoS 1 is at-least-once)
                continue
            seen.add(d["seq"])
            got.setdefault(d["job_id"], []).append(d["state"])
        want: dict = {}
        for job, st in produced:
            want.setdefault(job, []).append(st)
        assert got == want
        seqs = [d["seq"] for _, _, d in collector.messages]
        assert sorted(set(seqs)) == list(range(1, total + 1))
    finally:
        link.stop()
        pub.stop()
        ob.close()
        collector.stop()
