"""Progress and results (issue 37, acceptance 3): a real agent, etcd and mosquitto. A job
that reports progress and then hangs is killed step_timeout_s after its last line, one
that keeps reporting for longer than step_timeout_s is not; the cloud receives rate-limited
`in_progress` statuses and the final result; results larger than 4 KiB or invalid are
refused with a reason, never truncated. Times are the jobs' own (their log lines) and
the run records'."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from datetime import datetime

import pytest

from agent.coordination.jobstore import JobStore
from agent.runtime.timefmt import parse_rfc3339
from tests.support.cloud import CloudWorld, wait_agent_connected
from tests.support.cloudkit import SigningStore
from tests.support.commands import millwright
from tests.support.jobs import JOBS, effects_file
from tests.support.waiting import wait_for

PROGRESS = os.path.join(JOBS, "progress.sh")
STEP_S = 3.0
GRACE_S = 1.0   # the test cluster's execute.kill_grace_s


def templates(log: str) -> dict:
    """`prog` runs as root (confined: it reaches its files through its group), `user` as a
    job user (a uid of its own): both write their progress FIFO and result file."""
    prog = {"argv": [PROGRESS, log, "{secs}", "{every}", "{then}"],
            "params": {"secs": r"^[0-9]+$", "every": r"^[0-9.]+$", "then": r"^[a-z]+$"},
            "user": "root", "allow_root": True, "allow_exec": ["/bin/*", "/usr/bin/*", PROGRESS]}
    return {"prog": prog, "user": {**prog, "user": "nobody", "allow_root": False}}


@pytest.fixture
def world(etcd_server, mosquitto_server):
    """Agents whose state directory a job user can reach (as /var/lib/millwright is): the
    run paths in the environment are absolute."""
    top = pathlib.Path(tempfile.mkdtemp(prefix="mw-progress-", dir="/tmp"))
    os.chmod(top, 0o755)
    log = effects_file(top)
    open(log, "w").close()
    os.chmod(log, 0o666)   # root and job-user runs both log to it
    w = CloudWorld(etcd_server, mosquitto_server, top, templates(log), 8)
    w.log = log
    w.store = SigningStore(JobStore(w.cluster.client, w.cluster.keys, 8, "test"), w.ring, "t")
    yield w
    w.close()
    shutil.rmtree(top, ignore_errors=True)


def job(job_id: str, secs: int, every: float, then: str, template: str = "prog", **kw) -> dict:
    d = {"v": 1, "id": job_id, "template": template, "schedule": {},
         "params": {"secs": str(secs), "every": str(every), "then": then}, "timeout_s": 120}
    d.update(kw)
    return d


def log_lines(path: str, kind: str, job_id: str) -> list[list[str]]:
    with open(path) as fh:
        return [p for p in (ln.split() for ln in fh) if p[:2] == [kind, job_id]]


def final(world, job_id: str) -> dict:
    def done():
        recs = world.cluster.job_runs(job_id)
        rec = next(iter(recs.values()), None)
        return rec if rec and rec["state"] not in ("running", "retrying") else None
    return wait_for(done, 90, interval=0.2, what=f"{job_id} ends")


def test_a_hung_step_is_killed_step_timeout_after_its_last_line_and_steady_progress_is_not(world):
    world.cluster.start("a1")
    wait_agent_connected(world.col, "a1")
    world.store.create(job("hangs", 10, 1, "hang", step_timeout_s=STEP_S))
    world.store.create(job("steady", 12, 1, "result", step_timeout_s=STEP_S))   # reports 12 s > step_timeout_s

    hung = final(world, "hangs")
    assert (hung["state"], hung["reason"]) == ("timed_out", "step_timed_out")
    last = max(float(p[3]) for p in log_lines(world.log, "line", "hangs"))
    killed_after = parse_rfc3339(hung["ended_at"]).timestamp() - last
    # SIGTERM step_timeout_s after the last line; dead by kill_grace_s later (the contract's bound, + 1 s)
    assert STEP_S - 0.05 <= killed_after <= STEP_S + GRACE_S + 1.0, killed_after
    assert not log_lines(world.log, "end", "hangs")
    assert hung["progress"]["lines"] == len(log_lines(world.log, "line", "hangs"))
    assert hung["progress"]["step"] == f"block {hung['progress']['lines']}"

    steady = final(world, "steady")
    assert steady["state"] == "succeeded", steady
    assert steady["result"] == {"blocks": steady["progress"]["lines"], "found": "bearing wear 0.2 mm"}

    # the cloud: in_progress statuses, at most one a second per run, each with the step; then the result
    assert world.col.wait(lambda m: any(d.get("job_id") == "steady" and d.get("state") == "succeeded"
                                        for _, _, d in m), 20)
    ups = [(t, d) for t, _, d in world.col.messages if d.get("job_id") == "steady" and d.get("state") == "in_progress"]
    assert len(ups) >= 5
    gaps = [b[0] - a[0] for a, b in zip(ups, ups[1:])]
    assert min(gaps) >= 0.9, gaps   # rate-limited (STATUS_EVERY_S, seen on the collector's clock)
    assert all(d["progress"]["step"].startswith("block ") for _, d in ups)
    assert [d["progress"]["lines"] for _, d in ups] == sorted(d["progress"]["lines"] for _, d in ups)
    (end,) = [d for d in world.col.docs("succeeded") if d.get("job_id") == "steady"]
    assert end["result"]["found"] == "bearing wear 0.2 mm" and end["progress"]["lines"] >= 10

    # and `millwright runs --json`
    out = millwright("runs", "steady", "--json", "-c", world.cluster.agents["a1"].config_path)
    assert out.returncode == 0, out.stderr
    (run,) = json.loads(out.stdout)
    assert run["result"] == steady["result"]


def test_results_too_large_or_invalid_are_refused_with_a_reason_and_a_last_line_result_is_kept(world):
    world.cluster.start("a1")
    world.store.create(job("big", 1, 1, "big"))
    world.store.create(job("lastline", 2, 1, "lastline", template="user"))
    world.store.create(job("file", 1, 1, "result", template="user"))
    world.store.create(job("junk", 1, 1, "junk", step_timeout_s=30))

    big = final(world, "big")
    assert big["state"] == "succeeded" and "result" not in big
    assert big["result_error"].startswith("result refused: ") and "at most 4096" in big["result_error"]
    last = final(world, "lastline")
    assert last["result"] == {"blocks": last["progress"]["lines"] - 1} and last["progress"]["step"] == "done"
    assert final(world, "file")["result"]["found"] == "bearing wear 0.2 mm"
    junk = final(world, "junk")
    assert junk["progress"]["invalid"] == 3 and junk["progress"]["invalid_reason"].startswith("not JSON")
    assert junk["progress"]["lines"] == 1   # only its one real line counted


def test_jobs_without_the_new_fields_get_the_channel_but_no_step_timer(world):
    world.cluster.start("a1")
    world.store.create(job("plain", 3, 1, "hang", timeout_s=6))
    rec = final(world, "plain")
    assert (rec["state"], rec["reason"]) == ("timed_out", "timed_out")   # its overall timeout_s, as before
    started = parse_rfc3339(rec["started_at"])
    assert isinstance(started, datetime)
