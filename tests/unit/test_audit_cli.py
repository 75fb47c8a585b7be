"""`millwright audit verify` and `millwright audit show`."""

from __future__ import annotations

import json
import os
import time

import pytest

from agent.audit import AuditLog
from agent.audit.files import file_name
from agent.audit.record import parse_time
from agent.runtime.timefmt import format_ts
from agent.cli import main


@pytest.fixture
def env(tmp_path):
    d = tmp_path / "audit"
    kf = tmp_path / "audit.key"
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"audit:\n  dir: {d}\n  key_file: {kf}\netcd: {{insecure: true}}\n")
    log = AuditLog(str(d), str(kf), rotate_bytes=4096, agent_id="gw-01")
    log.agent_start(version="0.1.0", agent_id="gw-01", pid=1)
    for i in range(40):
        log.job("accepted", f"job-{i % 4}", shard=i % 3)
    log.exec(pid=7, filename="/bin/sh", argv=["sh", "-c", "echo a b"], job="job-1", run_id="r1")
    log.policy_violation(job="job-1", pid=8, path="/usr/bin/curl", rule="allow_exec", action="killed")
    log.close()
    return {"dir": str(d), "key": str(kf), "cfg": str(cfg)}


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_verify_good_log_from_config(env, capsys):
    code, out, err = run(capsys, "audit", "verify", "-c", env["cfg"])
    files = len([n for n in os.listdir(env["dir"]) if n.startswith("audit-")])
    assert files > 1
    # 43 records written plus a checkpoint record opening each rotated-to file
    assert code == 0 and out.startswith(f"ok: {43 + files - 1} records in {files} files") and "0 gaps" in out


def test_verify_dir_and_key_overrides(env, capsys, tmp_path):
    empty_cfg = tmp_path / "empty.yaml"
    empty_cfg.write_text("etcd: {insecure: true}\n")
    code, out, _ = run(capsys, "audit", "verify", env["dir"], "--key-file", env["key"], "-c", str(empty_cfg))
    assert code == 0 and out.startswith("ok:")


def test_verify_reports_the_first_bad_record(env, capsys):
    path = os.path.join(env["dir"], file_name(2))
    with open(path, "rb") as fh:
        lines = fh.read().split(b"\n")
    seq = json.loads(lines[2])["seq"]
    lines[2] = lines[2].replace(b'"shard":', b'"shard":1')
    with open(path, "wb") as fh:
        fh.write(b"\n".join(lines))
    code, out, err = run(capsys, "audit", "verify", "-c", env["cfg"])
    assert code == 1
    assert out.strip() == (f"FAILED: {path} line 3 (seq {seq}): mac mismatch: the record was edited, "
                           f"or written without the audit key")
    assert "verified before the failure" in err


@pytest.mark.parametrize("argv_extra, message", [
    (["/nonexistent/audit"], "audit directory /nonexistent/audit does not exist"),
    (["--key-file", "/nonexistent/audit.key"], "audit key file /nonexistent/audit.key does not exist"),
])
def test_verify_user_errors_are_one_line(env, capsys, argv_extra, message):
    code, out, err = run(capsys, "audit", "verify", "-c", env["cfg"], *argv_extra)
    assert code == 2 and err == f"millwright: {message}\n" and out == ""


def test_verify_refuses_a_readable_key(env, capsys):
    os.chmod(env["key"], 0o644)
    code, _, err = run(capsys, "audit", "verify", "-c", env["cfg"])
    assert code == 2 and "accessible by group or others (mode 0644)" in err and err.count("\n") == 1


def test_verify_missing_explicit_config_is_a_config_error(capsys, tmp_path):
    code, _, err = run(capsys, "audit", "verify", "-c", str(tmp_path / "nope.yaml"))
    assert code == 2 and err.startswith("millwright: config: ") and err.count("\n") == 1


def test_show_filters_by_type_and_job(env, capsys):
    code, out, _ = run(capsys, "audit", "show", "-c", env["cfg"], "--job", "job-1", "--type", "exec,policy_violation")
    assert code == 0
    rows = out.splitlines()
    assert rows[0].startswith("TIME (UTC)")
    assert len(rows) == 3 and " exec " in rows[1] and "argv=" in rows[1] and "policy_violation" in rows[2]
    code, out, _ = run(capsys, "audit", "show", "-c", env["cfg"], "--job", "job-2", "--json")
    recs = [json.loads(x) for x in out.splitlines()]
    assert len(recs) == 10 and {r["job"] for r in recs} == {"job-2"} and all("mac" in r for r in recs)


def test_show_filters_by_time(env, capsys):
    code, out, _ = run(capsys, "audit", "show", "-c", env["cfg"], "--since", "10m", "--json")
    files = len([n for n in os.listdir(env["dir"]) if n.startswith("audit-")])
    assert code == 0 and len(out.splitlines()) == 43 + files - 1
    future = format_ts(time.time() + 3600)
    code, out, err = run(capsys, "audit", "show", "-c", env["cfg"], "--since", future)
    assert code == 0 and out.splitlines()[1:] == [] and "no matching records" in err
    code, out, _ = run(capsys, "audit", "show", "-c", env["cfg"], "--until", "2000-01-01T00:00:00+02:00", "--json")
    assert out == ""


def test_show_bad_time_is_a_user_error(env, capsys):
    code, _, err = run(capsys, "audit", "show", "-c", env["cfg"], "--since", "yesterday")
    assert code == 2 and "neither an RFC3339 time" in err and err.count("\n") == 1


def test_parse_time_forms():
    assert parse_time("2026-12-02T12:00:00Z") == parse_time("2026-12-02T14:00:00+02:00")
    assert parse_time("2026-12-02T12:00:00.5Z") % 1 == 0.5
    assert parse_time("2h", now=10000.0) == 10000.0 - 7200
    assert parse_time("90s", now=100.0) == 10.0
    with pytest.raises(ValueError):
        parse_time("2026-13-02T12:00:00Z")


def test_show_type_checkpoint_lists_the_checkpoints_verify_counts(env, capsys):
    """`--type checkpoint` includes the checkpoint chain (checkpoints.jsonl: closed,
    retired and head checkpoints), as many as `audit verify` counts; fails on a build that
    listed only the checkpoint records inside the audit files."""
    code, out, _ = run(capsys, "audit", "verify", "-c", env["cfg"])
    counted = int(out.split(" checkpoints")[0].rsplit(" ", 1)[1])
    code, out, _ = run(capsys, "audit", "show", "-c", env["cfg"], "--type", "checkpoint")
    rows = out.splitlines()[1:]
    chain = [r for r in rows if " cp " in r]
    assert code == 0 and counted > 0 and len(chain) == counted, out
    assert {r.split("kind=")[1].split()[0] for r in chain} >= {"closed", "head"}
    # the checkpoint records that open each rotated-to file are still listed, in time order
    assert len(rows) > len(chain) and [r[:23] for r in rows] == sorted(r[:23] for r in rows)
    code, out, _ = run(capsys, "audit", "show", "-c", env["cfg"], "--type", "checkpoint", "--json")
    assert len(out.splitlines()) == len(rows) and all(json.loads(x)["type"] == "checkpoint" for x in out.splitlines())
    code, out, _ = run(capsys, "audit", "show", "-c", env["cfg"], "--job", "job-1")
    assert " cp " not in out   # checkpoints name no job
