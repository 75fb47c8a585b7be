"""The state disk watcher (agent/execute/statedisk.py): gauges from statvfs, one audit
record per crossing of the low line, a statvfs error reported and retried."""

from __future__ import annotations

import os
from types import SimpleNamespace

from agent.execute.statedisk import StateDisk
from agent.runtime.metrics import REGISTRY
from agent.runtime.loop import EventLoop


class Audit:
    def __init__(self):
        self.records = []

    def record(self, type_, **fields):
        self.records.append((type_, fields))


def test_crossings_are_recorded_once_each_and_the_gauge_follows():
    free = [50, 4, 3, 60]   # of 100 blocks of 4 KiB
    calls = []

    def statvfs(path):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(5, "Input/output error")
        return SimpleNamespace(f_bavail=free[min(len(calls), 4) - 1], f_blocks=100, f_frsize=4096)

    loop, audit = EventLoop(), Audit()
    d = StateDisk("/var/lib/millwright", loop, audit, every_s=60, statvfs=statvfs)
    d.start()
    assert d.free_bytes == 50 * 4096 and d.status()["low"] is False and audit.records == []
    d.sample()
    assert d.low and audit.records == [("state_disk", {"event": "low", "free_bytes": 4 * 4096, "free_ratio": 0.04,
                                                       "low_ratio": 0.05, "path": "/var/lib/millwright"})]
    d.sample()   # statvfs fails: reported, the last figures kept, nothing recorded
    assert d.error == "Input/output error" and d.low and len(audit.records) == 1
    d.sample()
    assert d.error is None and not d.low and audit.records[-1][1]["event"] == "recovered"
    assert REGISTRY.get_sample_value("millwright_state_disk_free_bytes") == 60 * 4096
    assert REGISTRY.get_sample_value("millwright_state_disk_free_ratio") == 0.6
    d.stop()


def test_the_real_file_system_is_read():
    d = StateDisk(os.getcwd(), EventLoop(), Audit())
    d.start()
    d.stop()
    assert d.error is None and d.free_bytes > 0 and 0 < d.free_ratio <= 1
