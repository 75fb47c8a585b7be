"""The by-hand quick start (docs/quickstart.md, and its first part in the README) run as
written: every ``sh`` block in order, in one bash, on a fresh directory with free loopback
ports. A documented command that fails, or a config key the agent refuses, fails it; so
does an answer, status or record the guide promises and the commands do not give."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from agent.demo.services import REPO_ROOT, free_port
from tests.support.guide import GuideRun, shell_blocks
from tests.support.kernel import require_kernel

GUIDE = "docs/quickstart.md"
README_SECTION = "Quick start (five minutes)"
TIMEOUT_S = 240


def test_the_readme_quick_start_is_the_first_part_of_the_guide():
    readme = shell_blocks("README.md", REPO_ROOT, README_SECTION)
    guide = shell_blocks(GUIDE, REPO_ROOT)
    assert len(readme) >= 5, "the README's quick start lost its blocks"
    assert [b.text for b in readme] == [b.text for b in guide[:len(readme)]], \
        "README.md's quick start must be the first blocks of docs/quickstart.md, word for word"
    # and it reaches a running cron job and its statuses on its own
    text = "".join(b.text for b in readme)
    assert "millwright push" in text and "statuses.log" in text and '"cron"' in text


def _statuses(path: str) -> list[dict]:
    out = []
    with open(path) as fh:
        for line in fh:
            topic, _, payload = line.partition(" ")
            if "/status/" in topic:
                out.append(json.loads(payload))
    return out


def _documented_status_fields() -> str:
    with open(os.path.join(REPO_ROOT, "docs", "contract.md")) as fh:
        text = fh.read()
    return text.split("### Status document\n", 1)[1].split("\n## ", 1)[0]


@pytest.fixture
def guide_run(tmp_path):
    require_kernel(os.geteuid() == 0, "the quick start runs an agent as root (job isolation, cgroups)")
    missing = [t for t in ("etcd", "mosquitto", "mosquitto_sub", "curl", "bash") if shutil.which(t) is None]
    require_kernel(not missing, f"not installed: {missing}")
    mw = tmp_path / "mw"
    mw.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("MILLWRIGHT_CONFIG", "PYTHONPATH")}
    env.update(MW=str(mw), ETCD_PORT=str(free_port()), ETCD_PEER_PORT=str(free_port()),
               MQTT_PORT=str(free_port()), METRICS_PORT=str(free_port()))
    run = GuideRun(shell_blocks(GUIDE, REPO_ROOT), str(tmp_path / "out"), REPO_ROOT, env)
    try:
        yield run, str(mw)
    finally:
        run.stop()


def test_the_quick_start_runs_as_written(guide_run):
    run, mw = guide_run
    try:
        code = run.wait(TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"not done after {TIMEOUT_S}s: {run.failure()}\n--- agent.log:\n{_tail(mw, 'agent.log')}")
    assert code == 0 and run.reached() == "done", f"{run.failure()}\n--- agent.log:\n{_tail(mw, 'agent.log')}"

    # the keys file keygen made is one the agent accepts (it started with it): 0600
    assert os.stat(os.path.join(mw, "keys.yaml")).st_mode & 0o777 == 0o600

    pushed = run.output(run.block_of("line-check.json --key-file"))
    assert re.search(r"^accepted line-check-2 by gw-1 \(shard \d+\)$", pushed, re.M), pushed
    assert re.search(r"^issued_at \S+Z \(stamped", pushed, re.M), pushed

    # a file with its own issued_at pushed again is a repeat; one without it, stamped
    # anew, is a conflict whose answer says so and how to repeat the push
    again = run.output(run.block_of("line-check-once.json --key-file"))
    answers = [line for line in again.splitlines() if line.startswith(("accepted", "rejected"))]
    assert len(answers) == 3 and answers[0].startswith("accepted line-check-7-once by gw-1"), again
    assert answers[1].startswith("accepted line-check-7-once (repeat: already accepted)"), again
    stamp = re.search(r"^issued_at (\S+Z) \(stamped", pushed, re.M).group(1)
    assert re.fullmatch(r"rejected line-check-2: conflict: id: job line-check-2 already exists with different "
                        rf"content: only issued_at differs \(stored {stamp}, this push \S+Z\); to repeat the push, "
                        rf"sign it with the stored issued_at \(millwright push --issued-at {stamp}\)", answers[2]), again
    assert "\nexit status 1\n" in again, again

    statuses = _statuses(os.path.join(mw, "statuses.log"))
    cron = [d for d in statuses if d["job_id"] == "line-check-2"]
    states = [d["state"] for d in cron]
    assert states[:2] == ["accepted", "scheduled"] and "running" in states and "succeeded" in states, states
    runs = [d for d in cron if d["fire_id"] is not None]
    assert runs and all(d["run_id"] == f"{d['fire_id']}.{d['attempt']}" for d in runs), runs
    # one cancel, one answer to it with its documented reason; a firing claimed in the
    # claim lead before its due time when the cancel landed ends `cancelled` too, once
    cancelled = [d for d in cron if d["state"] == "cancelled"]
    answers = [d for d in cancelled if d["run_id"] is None]
    assert [(d["attempt"], d["reason"]) for d in answers] == [(None, "cancelled_by_cloud")], cancelled
    in_flight = [d for d in cancelled if d["run_id"] is not None]
    assert len(in_flight) <= 1 and all(d["reason"] == "cancelled" for d in in_flight), cancelled
    assert not [d for d in cron if d["state"] in ("succeeded", "failed") and
                d["run_id"] in {c["run_id"] for c in in_flight}], cron
    assert all(d["state"] != "accepted" or (d["attempt"], d["run_id"]) == (None, None) for d in statuses)
    # every field a status carried is in the contract
    documented = _documented_status_fields()
    fields = sorted({k for d in statuses for k in d})
    assert [f for f in fields if f"`{f}`" not in documented] == [], fields

    # logs names the run it shows, and the job printed the same run id the statuses carry
    i = run.block_of("millwright logs line-check-7-once")
    shown = re.search(r"^# line-check-7-once/(\S+) attempt (\d+) \(run_id (\S+)\): succeeded on gw-1; the latest "
                      r"run of line-check-7-once$", run.output(i, "err"), re.M)
    assert shown, run.output(i, "err")
    assert shown.group(3) == f"{shown.group(1)}.{shown.group(2)}"
    assert f"checking line 7, run {shown.group(3)}\n" in run.output(i)
    once = [d for d in statuses if d["job_id"] == "line-check-7-once" and d["state"] == "succeeded"]
    assert [d["run_id"] for d in once] == [shown.group(3)], once
    assert re.search(r"^millwright_runs_total\{result=\"succeeded\"\} [1-9]", run.output(i), re.M), run.output(i)
    assert re.search(r"^line-check-7-once .*succeeded", run.output(i), re.M), run.output(i)   # get

    # the audit log: the job's history from `accepted`, and the checkpoints verify counts
    audit = run.output(run.block_of("audit show --job line-check-2"))
    rows = [r for r in audit.splitlines() if re.search(r"\s+job\s+line-check-2\s", r)]
    events = [m.group(1) for r in rows for m in [re.search(r"event=(\w+)", r)] if m]
    assert events[0] == "accepted" and "run_start" in events and "run_end" in events, audit
    checkpoints = [r for r in audit.splitlines() if re.search(r"\scp \d+\s+checkpoint\s", r)]
    counted = re.search(r"^ok: .* (\d+) checkpoints", audit, re.M)
    assert checkpoints and counted and int(counted.group(1)) >= len(checkpoints), audit

    # after the cancel: out of the due list at once, and listed as cancelled
    after = run.output(run.block_of("millwright cancel line-check-2"))
    assert after.startswith("cancelled line-check-2 by gw-1"), after
    assert re.search(r"^runs +0 running, 0 waiting, 0 due soon$", after, re.M), after
    assert not re.search(r"^\s+line-check-2\s+\d{4}-", after, re.M), after
    assert re.search(r"^line-check-2 +\d+ +line-check +cancelled ", after, re.M), after

    # stopped cleanly: the log verifies after the agent's last record
    stop = run.output(run.block_of("kill $AGENT"))
    assert stop.startswith("ok: "), stop


def _tail(mw: str, name: str) -> str:
    try:
        with open(os.path.join(mw, name), errors="replace") as fh:
            return fh.read()[-4000:]
    except OSError:
        return "(none)"
