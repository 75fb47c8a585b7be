"""A run that leaves a 5,000-deep chain in its work directory ends like any other in a real
agent (real etcd; issue 54, "no wedged runs"): its final record is written, its admission
slot is freed (max_concurrent 1: the next job runs), and the tree is removed by the cleaner.
The agent runs with an open-file soft limit of 1,024 (inherited from this test: a recursive
delete runs out of descriptors there) and with a high one."""

from __future__ import annotations

import os
import resource

import pytest

from tests.support.cluster import Cluster
from tests.support.processes import PY
from tests.support.waiting import wait_for

DEEP_JOB = "import os\nfor _ in range(5000):\n os.mkdir('d'); os.chdir('d')\n"
ALLOW = ["/bin/*", "/usr/bin/*"]


@pytest.fixture(params=["nofile-1024", "nofile-high"])
def nofile(request):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024 if request.param == "nofile-1024" else hard, hard))
    try:
        yield request.param
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def final(c: Cluster, job_id: str) -> dict:
    def done():
        rec = next(iter(c.job_runs(job_id).values()), None)
        return rec if rec and rec["state"] not in ("running", "retrying") else None
    return wait_for(done, 60, interval=0.1, what=f"{job_id}'s final record")


def test_a_deep_work_dir_neither_wedges_its_run_nor_the_next(etcd_server, tmp_path, nofile):
    tpl = {"deep": {"argv": [PY, "-c", DEEP_JOB], "user": "root", "allow_root": True, "allow_exec": ALLOW},
           "short": {"argv": ["/bin/true"], "user": "root", "allow_root": True, "allow_exec": ALLOW}}
    c = Cluster(etcd_server, str(tmp_path / "agents"), extra={
        "templates": tpl, "mqtt": {"url": "mqtt://127.0.0.1:9"},
        "execute": {"max_concurrent": 1, "memory_mb": 4096, "cpu": 4.0}})
    store = c.job_store()
    try:
        agent = c.start("a1")
        wait_for(lambda: c.all_owned_by({"a1"}), 20, what="a1 owns every shard")
        store.create({"v": 1, "id": "deep", "template": "deep", "schedule": {}})
        assert final(c, "deep")["state"] == "succeeded"
        store.create({"v": 1, "id": "after", "template": "short", "schedule": {}})
        assert final(c, "after")["state"] == "succeeded"   # the one admission slot was freed
        runs = os.path.join(agent.config["state_dir"], "runs")
        trash = os.path.join(runs, ".cleanup", "trash")
        wait_for(lambda: os.path.isdir(trash) and os.listdir(trash) == [], 30, what="the trash emptied")
        for d in os.listdir(runs):
            assert not os.path.exists(os.path.join(runs, d, "work")), d
        ends = [r for r in c.audit("a1") if r.get("type") == "job" and r.get("event") == "run_end"]
        assert sorted(r.get("job") for r in ends) == ["after", "deep"]
        assert not [r for r in c.audit("a1") if r.get("type") == "cleanup"]   # nothing set aside
    finally:
        c.close()
