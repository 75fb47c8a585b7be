"""CPU pressure as lease evidence (agent/supervision/cpupressure.py): PSI's text read,
and the high/relieved rule with its gap."""

from __future__ import annotations

import os

from agent.supervision.cpupressure import CpuPressureRule, read_cpu_pressure

PSI = ("some avg10=57.25 avg60=12.00 avg300=3.10 total=123456\n"
       "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")


def _proc(tmp_path, text):
    os.makedirs(tmp_path / "pressure")
    (tmp_path / "pressure" / "cpu").write_text(text)
    return str(tmp_path)


def test_some_avg10_is_read_and_a_missing_or_odd_file_gives_none(tmp_path):
    assert read_cpu_pressure(_proc(tmp_path / "a", PSI)) == 57.25
    assert read_cpu_pressure(str(tmp_path / "none")) is None
    assert read_cpu_pressure(_proc(tmp_path / "b", "some avg60=1.0\n")) is None
    assert read_cpu_pressure(_proc(tmp_path / "c", "some avg10=lots\n")) is None


def test_high_holds_through_the_gap_and_is_relieved_once():
    r = CpuPressureRule(high_pct=40, relieved_pct=20)
    assert [r.observe(v) for v in (5.0, None, 39.9)] == [None, None, None]
    assert r.observe(40.0) is True and r.observe(25.0) is True   # in the gap: still high
    assert r.observe(19.0) is False and r.high is False
    assert r.observe(19.0) is None and r.observe(30.0) is None   # relieved: the gap does not re-arm


def test_the_host_file_reads_when_psi_exists():
    v = read_cpu_pressure()
    assert v is None if not os.path.exists("/proc/pressure/cpu") else 0.0 <= v <= 100.0
