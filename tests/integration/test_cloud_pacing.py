"""Issue 50, section 3: on the aws-iot-core profile the status outbox keeps the broker's
publish rate on a real mosquitto. The outbox, its publisher and a paced MqttLink run
in-process; statuses come three times faster than the rate (100 firings/s, three statuses
each), with presence, jobs/get replies and audit checkpoints on the same connection. A
counting subscriber in a process of its own (mosquitto_sub, so the agent's threads do not
delay its clock) stamps what arrives of the connection's topics: no second over the
profile's 100; a second subscriber reads them: every final status there, each job's
statuses in order. The figures (most
in a second, lag p99, statuses coalesced) are printed for the closing note, not asserted."""

from __future__ import annotations

import collections
import shutil
import subprocess
import threading
import time

from agent.brokerlimits import effective_profile
from agent.cloud.mqtt import MqttLink
from agent.cloud.outbox import Outbox, OutboxPublisher, window_for
from agent.cloud.pacing import paced
from agent.cloud.presence import presence_doc
from agent.cloud.topics import Topics
from agent.config import MqttConfig
from tests.support.cloudkit import StatusCollector

FIRINGS_PER_S = 100
SECONDS = 4.0
STATES = ("scheduled", "running", "succeeded")


def _max_in_any_second(times: list[float]) -> int:
    times = sorted(times)
    best, j = 0, 0
    for i, t in enumerate(times):
        while times[j] <= t - 1.0:
            j += 1
        best = max(best, i - j + 1)
    return best


def test_the_outbox_keeps_the_aws_iot_core_publish_rate(mosquitto_server, tmp_path):
    cfg = MqttConfig(url=mosquitto_server.url, profile="aws-iot-core")
    profile = effective_profile(cfg)
    assert profile.publish_rate == 100
    topics = Topics("t", "a1")
    counter = subprocess.Popen([shutil.which("mosquitto_sub") or "mosquitto_sub", "-h", mosquitto_server.host,
                                "-p", str(mosquitto_server.port), "-q", "1", "-i", "pacing-counter",
                                "-t", topics.agent_prefix("a1") + "#", "-F", "%U %t"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    # everything the agent's connection publishes, counted where a cloud subscriber sees it
    collector = StatusCollector(mosquitto_server.url, "t", extra_filters=(topics.agent_prefix("a1") + "#",),
                                agents=()).start()
    time.sleep(0.5)   # the counter subscribed too (a missed message fails the count check below)
    coalesced: list[int] = []
    ob = Outbox(str(tmp_path / "outbox.sqlite"), 100000, coalesce_above=int(2 * profile.publish_rate),
                on_coalesce=coalesced.append)
    pub = None

    def on_connect(generation: int, session_present: bool) -> None:
        link.publish(topics.presence(), presence_doc("a1", "online"), 1, True)

    raw = MqttLink(cfg, "millwright-t-a1", clean_session=False, on_connect=on_connect,
                   on_publish=lambda mid: pub.on_publish(mid), topic_kind=topics.kind,
                   reconnect_min_s=0.2, reconnect_max_s=2.0)
    link, pacer = paced(raw, profile.publish_rate, topics.kind)
    assert pacer is not None and pacer.cap == 95
    pub = OutboxPublisher(ob, link, window=window_for(profile.max_inflight), pacer=pacer)
    pub.start()
    link.start()
    assert link.wait_connected(10)
    stop = threading.Event()

    def replies() -> None:   # a flood of jobs/get replies beside the statuses (a worker's thread)
        n = 0
        while not stop.is_set():
            n += 1
            link.publish(topics.get_reply(f"q{n}"), b'{"v":1,"jobs":[]}', 1)
            time.sleep(0.005)

    replier = threading.Thread(target=replies, daemon=True)
    produced: dict[str, float] = {}   # job -> when its final status was made
    try:
        replier.start()
        t0 = time.monotonic()
        ticks = int(FIRINGS_PER_S * SECONDS)
        for k in range(ticks + 2):
            # firing k is scheduled, k-1 runs, k-2 succeeds: 300 statuses a second
            now = time.monotonic()
            items = []
            for lag, state in enumerate(STATES):
                i = k - lag
                if 0 <= i < ticks:
                    job = f"j{i}"
                    items.append((topics.status(job), {"v": 1, "job_id": job, "fire_id": "f1", "state": state,
                                                       "agent": "a1", "made": now}, None))
                    if state == "succeeded":
                        produced[job] = now
            ob.enqueue_many(items)
            if k % 50 == 0:
                ob.enqueue(topics.checkpoint(), {"v": 1, "agent": "a1", "checkpoint": k})
            if k % 100 == 0:
                link.publish(topics.presence(), presence_doc("a1", "online"), 1, True)
            time.sleep(max(0.0, t0 + (k + 1) / FIRINGS_PER_S - time.monotonic()))
        made_s = time.monotonic() - t0

        def finals_in(msgs) -> bool:
            return len({d.get("job_id") for _, _, d in msgs if d.get("state") == "succeeded"}) >= len(produced)
        assert collector.wait(finals_in, 120), (len(collector.messages), ob.depth)
        stop.set()
        replier.join(5)
        assert pub.flush(30)
        time.sleep(1.5)   # what is still on its way to the subscriber
        drained_s = time.monotonic() - t0
        with collector.lock:
            messages = list(collector.messages)
        counter.terminate()
        out, _ = counter.communicate(timeout=10)
        arrivals = [float(line.split()[0]) for line in out.splitlines() if line.strip()]
        assert len(arrivals) >= len(messages) > 0
        per_second = collections.Counter(int(at) for at in arrivals)
        # the broker's limit: no second over 100
        assert max(per_second.values()) <= 100, sorted(per_second.items())
        sliding = _max_in_any_second(arrivals)
        # every final status arrived, and each job's statuses in their order
        got: dict[str, list[str]] = collections.defaultdict(list)
        final_at: dict[str, float] = {}
        for at, topic, d in messages:
            if topics.kind(topic) == "status":
                got[d["job_id"]].append(d["state"])
                if d["state"] == "succeeded":
                    final_at.setdefault(d["job_id"], at)
        assert set(final_at) == set(produced)
        for job, states in got.items():
            assert states[-1] == "succeeded" and states == sorted(states, key=STATES.index), (job, states)
        kinds = collections.Counter(topics.kind(t) for _, t, _ in messages)
        lags = sorted(final_at[j] - produced[j] for j in produced)
        p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))]
        print(f"\npacing (aws-iot-core, cap {pacer.cap}/s): {3 * ticks} statuses made in {made_s:.1f} s "
              f"({3 * ticks / made_s:.0f}/s), all out in {drained_s:.1f} s; arrivals per calendar second "
              f"max {max(per_second.values())}, in any second max {sliding} (counted by mosquitto_sub; {len(arrivals)} in all); by kind {dict(kinds)}; "
              f"coalesced {sum(coalesced)}; final status lag p50 {lags[len(lags) // 2]:.2f} s, "
              f"p99 {p99:.2f} s, max {lags[-1]:.2f} s; pacer taken {pacer.taken}")
    finally:
        if counter.poll() is None:
            counter.kill()
            counter.wait()
        stop.set()
        pub.stop()
        link.stop()
        collector.stop()
        ob.close()
