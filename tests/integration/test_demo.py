"""`millwright demo` end to end (issue 10 acceptance): a shortened run must keep every
invariant (exactly-once, failover, audit verify), exit 0 and leave nothing behind."""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

from agent.config import EtcdConfig
from agent.coordination.etcd import EtcdClient
from agent.demo.services import REPO_ROOT as ROOT
from agent.demo.services import EtcdServer
from tests.support import history
from tests.support.kernel import require_kernel


def run_demo(*args: str, timeout: float = 150, tmpdir: str = "") -> subprocess.CompletedProcess:
    """The demo's result, with its pid (its nftables table is named after it); ``tmpdir``:
    its TMPDIR (where it makes its working directory)."""
    env = {**os.environ, "PYTHONPATH": ROOT, **({"TMPDIR": tmpdir} if tmpdir else {})}
    p = subprocess.Popen([sys.executable, "-m", "agent", "demo", *args], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    r.pid = p.pid
    return r


def nft_tables() -> str:
    r = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True)
    return r.stdout


def _effects(path: str) -> collections.Counter:
    """The demo jobs' own side effects: "<job> <fire id> <attempt> <pid> <uid>" lines."""
    c: collections.Counter = collections.Counter()
    if os.path.exists(path):
        for line in open(path):
            p = line.split()
            if len(p) >= 3:
                c[(p[0], p[1], int(p[2]))] += 1
    return c


def test_demo_keeps_its_invariants_and_cleans_up():
    """Judged from what the demo leaves behind (--keep), not from its own summary: its
    etcd data (restarted here, the whole history read and checked), the jobs' side
    effects, and `millwright audit verify` of every agent's log."""
    require_kernel(os.geteuid() == 0, "the demo needs root (job users, cgroups, BPF, nftables)")
    # a TMPDIR of its own (other demos may run on this host at the same time), which job
    # users can traverse like /tmp
    tmp = tempfile.mkdtemp(prefix="mw-test-demo-")
    os.chmod(tmp, 0o711)
    r = run_demo("--duration", "30", "--keep", tmpdir=tmp)
    out = r.stdout
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout ---\n{out[-6000:]}\n--- stderr ---\n{r.stderr[-3000:]}"
    m = re.search(r"kept (\S+) ", out)
    assert m, out[-3000:]
    base = m.group(1)
    try:
        # cleaned up: processes and the nftables table (the directory is kept on request)
        pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", out)]
        assert pids
        for pid in pids:
            if os.path.exists(f"/proc/{pid}"):
                with open(f"/proc/{pid}/stat") as fh:
                    assert fh.read().split(") ")[1][0] == "Z", f"pid {pid} still running after the demo"
        # its own table (other demos may run on this host at the same time)
        assert f"millwright_demo_{r.pid}\n" not in nft_tables() + "\n"
        # every agent's audit log verifies, checked by the CLI on its own
        configs = sorted(glob.glob(os.path.join(base, "agents", "*", "agent.yaml")))
        assert len(configs) == 3, configs
        for d in configs:
            v = subprocess.run([sys.executable, "-m", "agent", "audit", "verify", "-c", d], cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True)
            assert v.returncode == 0, (d, v.stdout[-2000:], v.stderr[-2000:])
        # the demo's etcd, restarted on its data: the complete history, strictly checked
        srv = EtcdServer(os.path.join(base, "etcd"))
        srv.start(timeout=30)
        client = EtcdClient(EtcdConfig(endpoints=[srv.endpoint], request_timeout_s=5.0))
        try:
            events = history.read_history(client, "/millwright/demo/")
        finally:
            client.close()
            srv.stop()
        rep = history.check(events, "/millwright/demo/")
        assert rep.problems == [], rep.problems[:10]
        runs = {}
        for e in events:
            if e.kind == "put" and "/runs/" in e.key:
                rec = json.loads(e.value)
                runs.setdefault((rec["job_id"], rec["fire_id"]), []).append(rec)
        # exactly once: each attempt ran at most once, and only after its running record
        fx = _effects(os.path.join(base, "out", "effects.log"))
        assert fx, "no job left a side effect"
        for (job, fire, attempt), n in fx.items():
            assert n == 1, f"({job}, {fire}) attempt {attempt} ran {n} times"
            assert any(r["state"] == "running" and r["attempt"] == attempt for r in runs.get((job, fire), [])), \
                f"({job}, {fire}) attempt {attempt} ran without a running record"
        # a failover happened: one lease expiry took several shards from one agent at once,
        # and every one of them was owned again afterwards by another agent
        owner, dropped = {}, collections.defaultdict(list)
        for e in events:
            if "/shards/" not in e.key:
                continue
            if e.kind == "delete":
                dropped[e.rev].append((e.key, owner.pop(e.key, None)))
            else:
                owner[e.key] = e.value.decode()
        expiries = [d for d in dropped.values() if len(d) >= 2 and len({a for _, a in d}) == 1]
        assert expiries, "no agent lost its shards in one revision"
        # the job over its memory limit did not succeed
        warm = [rs[-1] for (j, _), rs in runs.items() if j == "vision-warmup-cam1"]
        assert warm and all(r["state"] != "succeeded" for r in warm), warm
    finally:
        shutil.rmtree(base, ignore_errors=True)
    left = os.listdir(tmp)   # the kept working directory was the only one it made
    shutil.rmtree(tmp, ignore_errors=True)
    assert left == [], left


def test_demo_refuses_a_duration_too_short_for_a_failover():
    r = run_demo("--duration", "5", timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("millwright: --duration must be at least")
    assert "Traceback" not in r.stderr
