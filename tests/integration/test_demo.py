"""`millwright demo` end to end (issue 10 acceptance): a shortened run must keep every
invariant (exactly-once, failover, audit verify), exit 0 and leave nothing behind."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile

from agent.demo.services import REPO_ROOT as ROOT
from tests.support.kernel import require_kernel


def run_demo(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "agent", "demo", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def nft_tables() -> str:
    r = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True)
    return r.stdout


def test_demo_keeps_its_invariants_and_cleans_up():
    require_kernel(os.geteuid() == 0, "the demo needs root (job users, cgroups, BPF, nftables)")
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "millwright-demo-*")))
    r = run_demo("--duration", "30")
    out = r.stdout
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout ---\n{out[-6000:]}\n--- stderr ---\n{r.stderr[-3000:]}"
    summary = out[out.index("== Summary"):]
    # exactly once, from run records and the jobs' own side effects
    assert re.search(r"^exactly-once OK +\d+ firings -> \d+ run records", summary, re.M), summary
    # one agent was SIGKILLed and all its shards moved, measured from etcd
    m = re.search(r"^failover +OK .* SIGKILLed .* holding (\d+) shards; .* ([\d.]+) s after the kill", summary, re.M)
    assert m and int(m.group(1)) > 0, summary
    # the job over its memory limit did not succeed
    assert re.search(r"^memory +OK ", summary, re.M), summary
    # `millwright audit verify` passed for the three agents, the killed one included
    assert len(re.findall(r"^(?:audit verify| {12}) OK +gw\d-\w+.*: ok: ", summary, re.M)) == 3, summary
    assert "RESULT: OK" in out
    # live progress: timestamped lines for the kill, the expired lease and the takeover
    assert re.search(r"^\d\d:\d\d:\d\d\.\d{3} +[\d.]+s +gw\d-\w+ +SIGKILL", out, re.M), out[-4000:]
    assert "lease of gw" in out and "failover complete" in out
    # cleaned up: processes, nftables table, temporary directory
    pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", out)]
    assert pids
    for pid in pids:
        if os.path.exists(f"/proc/{pid}"):
            with open(f"/proc/{pid}/stat") as fh:
                assert fh.read().split(") ")[1][0] == "Z", f"pid {pid} still running after the demo"
    # its own table (another demo may run on this host at the same time: the name has its pid)
    table = re.search(r"table inet (millwright_demo_\d+)", out)
    assert table, out[:2000]
    assert re.search(rf"\b{table.group(1)}\b", nft_tables()) is None
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "millwright-demo-*"))) <= before


def test_demo_refuses_a_duration_too_short_for_a_failover():
    r = run_demo("--duration", "5", timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("millwright: --duration must be at least")
    assert "Traceback" not in r.stderr
