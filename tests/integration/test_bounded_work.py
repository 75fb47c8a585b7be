"""Work a valid signer can cause is bounded (issue 34, acceptance 4): a per-second cron job
whose 64 dependencies never succeed holds at most one waiting firing (overlap applies to
waiting firings: every later one is misfired `overlap`), and its dependencies are watched,
not polled (the agent's etcd reads stay at a handful of full looks).

`make test` watches for 10 s; the release tier for 10 minutes
(MILLWRIGHT_BOUNDED_WORK_S=600)."""

from __future__ import annotations

import os
import time
import urllib.request

from agent.demo.services import free_port
from agent.jobs.dependencies import SAFETY_RECHECK_S
from agent.daemon.admin import query
from tests.support.cluster import recording_cluster
from tests.support.jobs import job
from tests.support.kernel import require_kernel
from tests.support.waiting import wait_for

WINDOW_S = float(os.environ.get("MILLWRIGHT_BOUNDED_WORK_S", "10"))
DEPS = 64


def etcd_reads(port: int) -> float:
    """The agent's etcd reads so far (get, paged range, last key)."""
    total = 0.0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("millwright_etcd_requests_total{") and any(
                    f'op="{op}"' in line for op in ("get", "range_page", "get_last")):
                total += float(line.split()[-1])
    return total


def test_a_per_second_cron_with_64_unmet_dependencies_holds_one_waiting_firing(etcd_server, tmp_path):
    require_kernel(os.geteuid() == 0, "the agent's runs are root jobs: needs root")
    port = free_port()
    c, out = recording_cluster(etcd_server, tmp_path, shards=4, extra={"metrics": {"listen": f"127.0.0.1:{port}"}})
    try:
        a = c.start("w0")
        wait_for(lambda: c.all_owned_by({"w0"}), 30, what="the agent holding every shard")
        deps = [f"never-{i:02d}" for i in range(DEPS)]
        c.job_store().create(job("needs-64", {"cron": "* * * * * *"}, depends_on=deps))
        wait_for(lambda: [d for d in c.statuses("w0") if d.get("state") == "waiting"], 20,
                 what="the first firing waiting for its dependencies")
        reads0, t0 = etcd_reads(port), time.monotonic()
        waiting = []
        while time.monotonic() - t0 < WINDOW_S:
            waiting.append(query(a.config["admin"]["socket"])["jobs"]["waiting"])
            time.sleep(0.25)
        reads = etcd_reads(port) - reads0
        assert max(waiting) == 1 and waiting[-1] == 1, waiting
        misfired = [d for d in c.statuses("w0") if d.get("state") == "misfired" and d.get("reason") == "overlap"]
        assert len(misfired) >= WINDOW_S - 5, len(misfired)   # each later firing ended at once
        # one full look (2 reads a dependency) per safety period, not one a second; the
        # rest of the agent (answers sweep, retention) reads a few hundred at most
        looks = WINDOW_S / SAFETY_RECHECK_S + 2
        assert reads <= looks * 2 * DEPS + 300, (reads, looks)
    finally:
        c.close()
