#!/usr/bin/python3
"""Windows, gates and progress (issue 37): what they cost and how fast they act.

1. Gate-open -> run-start latency, per gate kind (a retained MQTT topic, an etcd key, a
   probe command: ``test -e FILE``, re-probed every second while a firing waits), on
   a real agent, etcd and mosquitto: each flip stores a job due now while its gate is
   closed, waits until the agent says it waits, opens the gate and reads the run's start
   from the job's own clock (tests/jobs/effect.sh); p50/p99 over ``--flips``.
2. Window-open -> first run: jobs due before their window (absolute ranges opening one
   after another) wait; the run's start minus the window's start.
3. The CPU cost of progress lines: runs through the real Executor that write ``--lines``
   progress lines as fast as they can, against the same runs writing none; the agent
   process's CPU (all threads) per run and per line.

    /usr/bin/python3 bench/bench_maintenance.py [--flips 50] [--windows 20] [--runs 20] [--lines 2000]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import time
from datetime import datetime, timedelta, timezone

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent.coordination.jobstore import JobStore  # noqa: E402
from agent.demo.services import EtcdServer, MosquittoServer  # noqa: E402
from agent.runtime.timefmt import format_rfc3339  # noqa: E402
from tests.support import history  # noqa: E402
from tests.support.cloud import CloudWorld, Pusher  # noqa: E402
from tests.support.cloudkit import SigningStore  # noqa: E402
from tests.support.jobs import effects_file  # noqa: E402
from tests.support.waiting import wait_for  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EFFECT = os.path.join(ROOT, "tests", "jobs", "effect.sh")
TOPIC, KEY = "plant/line2/state", "gates/line2"


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def ms(x: float) -> str:
    return f"{x * 1000:.1f} ms"


def templates(out: str, flag: str) -> dict:
    fx = {"argv": [EFFECT, out, "a1", "0", "0"], "user": "root", "allow_root": True,
          "allow_exec": ["/bin/*", "/usr/bin/*", EFFECT]}
    return {"fx": fx, "by_mqtt": {**fx, "gates": {"line": {"mqtt": TOPIC, "equals": "stopped"}}},
            "by_etcd": {**fx, "gates": {"line": {"etcd": KEY, "equals": "open"}}},
            "by_probe": {**fx, "gates": {"line": {"command": ["/usr/bin/test", "-e", flag]}}}}


def set_flag(path: str, value: str) -> None:
    """The probe gate's plant state: the file exists while the line is stopped."""
    if value == "open":
        open(path, "w").close()
    elif os.path.exists(path):
        os.unlink(path)


def starts(out: str) -> dict[str, float]:
    try:
        return {e.job: e.start for e in history.parse_effects(out)}
    except history.HistoryError:
        return {}


def world_bench(flips: int, windows: int) -> None:
    top = tempfile.mkdtemp(prefix="mw-bench-maint-")
    try:
        with EtcdServer(os.path.join(top, "etcd")) as etcd, MosquittoServer(os.path.join(top, "mq")) as mq:
            out = effects_file(pathlib.Path(top))
            flag = os.path.join(top, "line-stopped")
            w = CloudWorld(etcd, mq, pathlib.Path(top), templates(out, flag), 8)
            store = SigningStore(JobStore(w.cluster.client, w.cluster.keys, 8, "bench"), w.ring, "t")
            plc = Pusher(mq.url, client_id="bench-plc")
            try:
                w.cluster.start("a1")
                wait_for(lambda: w.cluster.all_owned_by({"a1"}), 30, what="a1 owns the shards")
                setters = {"mqtt": lambda v: plc.link.publish(TOPIC, v.encode(), qos=1, retain=True),
                           "etcd": lambda v: w.cluster.client.put(w.cluster.keys.prefix + KEY, v),
                           "probe": lambda v: set_flag(flag, v)}
                values = {"mqtt": ("running", "stopped"), "etcd": ("closed", "open"), "probe": ("closed", "open")}
                for kind in ("mqtt", "etcd", "probe"):
                    closed, opened = values[kind]
                    lat = []
                    for i in range(flips):
                        setters[kind](closed)
                        jid = f"{kind}-{i}"
                        store.create({"v": 1, "id": jid, "template": f"by_{kind}", "schedule": {}})
                        w.col.wait(lambda m: any(d.get("job_id") == jid and d.get("state") == "waiting"
                                                 for _, _, d in m[-50:]), 20)
                        t_open = time.time()
                        setters[kind](opened)
                        wait_for(lambda: jid in starts(out), 20, interval=0.01, what=f"{jid} starts")
                        lat.append(starts(out)[jid] - t_open)
                    print(f"gate open -> run start, {kind} gate, {flips} flips: p50 {ms(pct(lat, 50))}, "
                          f"p99 {ms(pct(lat, 99))}, max {ms(max(lat))}", flush=True)
                t0 = datetime.now(timezone.utc) + timedelta(seconds=3)
                opens = []
                for i in range(windows):
                    a = t0 + timedelta(seconds=0.7 * i)
                    opens.append(a)
                    store.create({"v": 1, "id": f"win-{i}", "template": "fx", "schedule": {},
                                  "window": [{"start": format_rfc3339(a),
                                              "end": format_rfc3339(a + timedelta(seconds=30))}]})
                wait_for(lambda: all(f"win-{i}" in starts(out) for i in range(windows)), 60, interval=0.1,
                         what="the windowed runs")
                got = starts(out)
                lat = [got[f"win-{i}"] - opens[i].timestamp() for i in range(windows)]
                print(f"window open -> first run, {windows} windows: p50 {ms(pct(lat, 50))}, "
                      f"p99 {ms(pct(lat, 99))}, max {ms(max(lat))}", flush=True)
            finally:
                plc.stop()
                w.close()
    finally:
        shutil.rmtree(top, ignore_errors=True)


def progress_cost(runs: int, lines: int) -> None:
    from agent.execute import Executor, Limits, RunSpec
    from agent.execute.backends import probe

    base = tempfile.mkdtemp(prefix="mw-bench-progress-")
    ex = Executor(probe("auto", root_name=f"millwright-bench-progress-{os.getpid()}"), base)
    script = ('i=0; while [ $i -lt "$1" ]; do '
              'echo "{\\"progress\\": 50, \\"step\\": \\"block $i\\", \\"detail\\": {\\"i\\": $i}}"; '
              'i=$((i+1)); done >> "$MILLWRIGHT_PROGRESS"')
    try:
        seen = [0]
        lock = threading.Lock()

        def count(h, batch):
            with lock:
                seen[0] += len(batch)

        res = {}
        for mode, n in (("none", 0), ("lines", lines), ("none", 0), ("lines", lines)):
            done = threading.Semaphore(0)
            c0, n0 = time.process_time(), seen[0]
            for i in range(runs):
                ex.start(RunSpec(f"{mode}-{n}-{i}-{time.monotonic_ns()}", ["/bin/sh", "-c", script, "sh", str(n)],
                                 limits=Limits(cpu=1.0, memory_mb=64, pids=16), step_timeout_s=30),
                         lambda h, r: done.release(), on_progress=count)
                done.acquire()
            res.setdefault(mode, []).append(((time.process_time() - c0) / runs, (seen[0] - n0) / runs))
        none = min(c for c, _ in res["none"])
        with_lines = min(c for c, _ in res["lines"])
        per_run = res["lines"][0][1]
        print(f"progress lines: {per_run:.0f} valid lines per run; agent CPU per run {ms(none)} without lines, "
              f"{ms(with_lines)} with; {(with_lines - none) / max(1, per_run) * 1e6:.1f} us per line", flush=True)
    finally:
        ex.close()
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flips", type=int, default=50)
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--only", choices=("world", "progress"))
    a = ap.parse_args()
    if a.only != "progress":
        world_bench(a.flips, a.windows)
    if a.only != "world":
        progress_cost(a.runs, a.lines)


if __name__ == "__main__":
    main()
