"""Degraded mode on the real /proc (no BPF, no root needed)."""

from __future__ import annotations

import os
import queue
import subprocess
import time

from agent.runtime import metrics
from agent.signals import Sensor


def test_degraded_mode_polls_proc_for_processes_and_node_counters():
    q: "queue.Queue" = queue.Queue()
    execs = []
    s = Sensor(lambda fn, *a: q.put((fn, a)), on_exec=execs.append, enabled=False, proc_interval_s=0.1)
    assert s.start().startswith("degraded: ")
    assert metrics.sample("millwright_bpf_degraded") == 1
    try:
        s.watch_endpoint("127.0.0.1", 9)
        p = subprocess.Popen(["/bin/sh", "-c", "/bin/sleep 0.6; exit 0"])
        s.track(p.pid, 5)
        end = time.monotonic() + 5
        mine = []
        while time.monotonic() < end and not any(e.filename.endswith("sleep") for e in mine):
            try:
                fn, a = q.get(timeout=0.05)
                fn(*a)
            except queue.Empty:
                pass
            mine = [e for e in execs if e.slot == 5]
        p.wait()
        sleep = [e for e in mine if e.filename.endswith("sleep")]
        assert sleep, ([(e.pid, e.ppid, e.slot, e.filename) for e in execs if p.pid in (e.pid, e.ppid)], p.pid, s._published.tracked)
        assert sleep[0].argv == ["/bin/sleep", "0.6"] and sleep[0].ppid == p.pid
        assert sleep[0].source == "proc" and sleep[0].uid == os.getuid()
        node = s.node_signals()
        assert node.ts > 0 and node.active_opens >= 0 and node.retrans_segs >= 0
        ep = s.endpoint_signals("127.0.0.1", 9)
        assert ep.available is False and ep.stalled_sockets == 0
    finally:
        s.stop()
