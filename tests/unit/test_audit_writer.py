"""The audit writer: records, rotation, retention, checkpoints, recovery, never blocking."""

from __future__ import annotations

import json
import os
import stat
import threading

import pytest

from agent.audit import AuditError, AuditLog, MemoryAudit, NullAudit
from agent.audit.files import CHECKPOINTS, file_name, list_files
from agent.audit.keyfile import KeyFileError, load_key
from agent.audit.record import GENESIS, line_hash, parse_time
from agent.runtime.timefmt import format_ts
from tests.support.records import audit_records
from agent.audit.verify import verify
from agent.runtime.loop import EventLoop
from agent.runtime.metrics import sample

KEY = b"k" * 32


def records(d):
    return audit_records(d)


def cps(d):
    out = []
    with open(os.path.join(d, CHECKPOINTS), "rb") as fh:
        for x in fh.read().split(b"\n"):
            try:
                out.append(json.loads(x))
            except ValueError:
                pass
    return out


def open_log(tmp_path, **kw):
    kw.setdefault("key", KEY)
    return AuditLog(str(tmp_path / "audit"), str(tmp_path / "audit.key"), **kw)


def test_records_are_chained_and_carry_the_fields(tmp_path):
    before = sample("millwright_audit_records_total", {"type": "job"}) or 0
    log = open_log(tmp_path, agent_id="gw-01")
    log.agent_start(version="0.1.0", agent_id="gw-01", pid=os.getpid(), cluster="plant-a")
    log.job("accepted", "j1", shard=3)
    log.job("run_end", "j1", run_id="r1", state="failed", exit_code=2, reason="exit_code")
    log.exec(pid=42, ppid=1, uid=0, comm="sh", filename="/bin/sh", argv=["sh", "-c", "true"], job="j1", run_id="r1")
    log.lease("granted", lease_id=7, ttl_s=10)
    log.shard("acquired", 5, owner="gw-01", fencing_rev=99)
    log.policy_violation(job="j1", pid=43, path="/usr/bin/curl", rule="allow_exec", action="killed")
    log.config(source="/etc/millwright/agent.yaml", sha256="ab" * 32, summary={"shards": 64})
    log.gap(source="bpf", count=12, reason="perf_lost")
    log.agent_stop(reason="sigterm")
    assert log.close()
    d = str(tmp_path / "audit")
    recs = records(d)
    assert [r["type"] for r in recs] == ["agent_start", "job", "job", "exec", "lease", "shard",
                                         "policy_violation", "config", "gap", "agent_stop"]
    assert [r["seq"] for r in recs] == list(range(1, 11))
    assert recs[0]["prev"] == GENESIS and all(r["agent"] == "gw-01" for r in recs)
    assert recs[2] == {**recs[2], "event": "run_end", "job": "j1", "exit_code": 2, "reason": "exit_code"}
    assert "fire_id" not in recs[2]  # None fields are left out
    assert abs(parse_time(recs[0]["ts"]) - parse_time(format_ts(parse_time(recs[0]["ts"])))) < 1e-6
    assert (sample("millwright_audit_records_total", {"type": "job"}) or 0) - before == 2
    r = verify(d, KEY)
    assert r.ok and r.records == 10 and r.gaps == 1 and r.dropped == 12  # bpf events lost
    # the clean stop left a head checkpoint naming the last record
    head = cps(d)[-1]
    assert head["kind"] == "head" and head["clean"] is True and head["last_seq"] == 10


def test_helpers_reject_unknown_events_and_reserved_fields(tmp_path):
    log = open_log(tmp_path)
    try:
        with pytest.raises(ValueError):
            log.job("exploded", "j1")
        with pytest.raises(ValueError):
            log.append("job", seq=3)
        with pytest.raises(ValueError):
            log.append("Bad Type")
        assert log.append("exec", pid=1, filename="/x", argv=[object()])  # kept as text, never raises
    finally:
        log.close()
    rec = records(str(tmp_path / "audit"))[-1]
    assert rec["type"] == "exec" and "unserializable" in rec
    assert not log.append("exec", pid=1, filename="/x")  # closed: dropped, not raised


def test_memory_and_null_sinks_share_the_helpers():
    m = MemoryAudit()
    m.job("rejected", "j9", reason="bad_signature")
    assert m.of_type("job") == [{"type": "job", "event": "rejected", "job": "j9", "reason": "bad_signature"}]
    assert NullAudit().shard("lost", 3, reason="lease_expired")


def test_rotation_keeps_the_chain_and_checkpoints_each_closed_file(tmp_path):
    seen = []
    log = open_log(tmp_path, rotate_bytes=4096, keep_files=100, on_checkpoint=seen.append)
    for i in range(200):
        log.job("accepted", f"job-{i}", shard=i % 4)
    assert log.close()
    d = str(tmp_path / "audit")
    files = list_files(d)
    assert len(files) >= 5
    closed = [c for c in seen if c["kind"] == "closed"]
    assert [c["file"] for c in closed] == [name for _, name in files[:-1]]
    for n, name in files[1:]:
        with open(os.path.join(d, name), "rb") as fh:
            first = json.loads(fh.readline())
        with open(os.path.join(d, file_name(n - 1)), "rb") as fh:
            last_raw = fh.read().rstrip(b"\n").rsplit(b"\n", 1)[-1]
        assert first["type"] == "checkpoint" and first["file"] == file_name(n - 1)
        assert first["prev"] == line_hash(last_raw) and first["sha256"] == [c for c in closed if c["file"] == file_name(n - 1)][0]["sha256"]
    assert seen[-1]["kind"] == "head" and seen[-1]["clean"] is True
    assert seen == cps(d)  # the cloud gets exactly the records kept locally, mac included
    assert verify(d, KEY).ok


def test_retention_removes_old_files_and_verify_still_links(tmp_path):
    seen = []
    log = open_log(tmp_path, rotate_bytes=4096, keep_files=2, on_checkpoint=seen.append)
    for i in range(300):
        log.job("accepted", f"job-{i}")
    assert log.close()
    d = str(tmp_path / "audit")
    files = list_files(d)
    assert len(files) == 3 and files[0][0] > 1
    retired = [c["file"] for c in seen if c["kind"] == "retired"]
    assert retired == [file_name(n) for n in range(1, files[0][0])]
    r = verify(d, KEY)
    assert r.ok and r.retired == retired
    # a retained file deleted by hand is still noticed
    os.unlink(os.path.join(d, files[1][1]))
    assert not verify(d, KEY).ok


def test_fsync_on_every_record(tmp_path):
    log = open_log(tmp_path, fsync_interval_s=0)
    before = sample("millwright_audit_fsync_seconds_count") or 0
    for i in range(20):
        log.job("accepted", f"j{i}")
    assert log.flush()
    assert (sample("millwright_audit_fsync_seconds_count") or 0) - before >= 20
    log.close()
    assert verify(str(tmp_path / "audit"), KEY).ok


def test_stalled_writer_never_blocks_and_the_loss_is_a_gap(tmp_path):
    """Acceptance 3: the consumer is stopped; the daemon's loop keeps running."""
    dropped_before = sample("millwright_audit_dropped_records_total", {"reason": "queue_full"}) or 0
    log = open_log(tmp_path, queue_max=50)
    loop = EventLoop()
    results = []
    ticks = []

    def tick(i):
        results.append(log.job("accepted", f"stalled-{i}"))
        ticks.append(i)
        if i == 999:
            loop.stop()
        else:
            loop.post(tick, i + 1)

    log._io_lock.acquire()  # the writer thread blocks at its next write: a stalled disk
    try:
        loop.post(tick, 0)
        t = threading.Thread(target=loop.run, daemon=True)
        t.start()
        t.join(60)  # hang guard only
        assert not t.is_alive(), "the event loop was blocked by the audit log"
        assert len(ticks) == 1000
        assert sample("millwright_audit_queue_depth") == log.queue_depth <= 51
    finally:
        log._io_lock.release()
    accepted = sum(results)
    lost = 1000 - accepted
    assert 0 < accepted < 1000
    assert log.flush()  # the disk is back: the queue drains
    assert log.job("accepted", "after-the-stall")
    assert log.close()
    d = str(tmp_path / "audit")
    recs = records(d)
    # every run of drops is one gap record, placed exactly where the loss happened
    expected, pending = [], 0
    for i, ok in enumerate(results + [True]):
        if not ok:
            pending += 1
            continue
        if pending:
            expected.append(("gap", pending))
            pending = 0
        expected.append(("job", f"stalled-{i}" if i < 1000 else "after-the-stall"))
    got = [(r["type"], r["dropped"] if r["type"] == "gap" else r["job"]) for r in recs if r["type"] in ("job", "gap")]
    assert got == expected
    gaps = [r for r in recs if r["type"] == "gap"]
    assert gaps and all(g["reason"] == "queue_full" and g["types"] == {"job": g["dropped"]} for g in gaps)
    assert (sample("millwright_audit_dropped_records_total", {"reason": "queue_full"}) or 0) - dropped_before == lost
    r = verify(d, KEY)
    assert r.ok and r.gaps == len(gaps) and r.dropped == lost


def test_drops_at_shutdown_still_become_a_gap(tmp_path):
    log = open_log(tmp_path, queue_max=10)
    log._io_lock.acquire()
    try:
        oks = [log.job("accepted", f"j{i}") for i in range(100)]
    finally:
        log._io_lock.release()
    assert log.close()
    recs = records(str(tmp_path / "audit"))
    assert recs[-1]["type"] == "gap" and recs[-1]["dropped"] == oks.count(False)


def test_torn_last_line_is_chained_around(tmp_path):
    d = str(tmp_path / "audit")
    log = open_log(tmp_path)
    for i in range(5):
        log.job("accepted", f"j{i}")
    log.close()
    path = os.path.join(d, file_name(1))
    size = os.path.getsize(path)
    with open(path, "ab") as fh:  # a crash in the middle of a write
        fh.write(b'{"agent":"gw-01","event":"acc')
    assert verify(d, KEY).ok  # an unfinished last line is only noted
    log = open_log(tmp_path)
    log.job("accepted", "after")
    log.close()
    recs = records(d)
    rec = [r for r in recs if r["type"] == "recovered"]
    assert len(rec) == 1 and rec[0]["reason"] == "torn_write" and rec[0]["torn_offset"] == size
    assert rec[0]["torn_bytes"] == 29 and rec[0]["last_seq"] == 5 and rec[0]["seq"] == 6
    r = verify(d, KEY)
    assert r.ok and r.recovered == 1, r.problem
    # the excuse covers exactly that line: editing the fragment is caught
    with open(path, "rb") as fh:
        data = fh.read()
    with open(path, "wb") as fh:
        fh.write(data.replace(b'"event":"acc\n', b'"event":"rej\n'))
    r = verify(d, KEY)
    assert not r.ok and r.problem.line == 6 and "not a complete record" in r.problem.what


def test_complete_record_missing_only_its_newline_is_kept(tmp_path):
    d = str(tmp_path / "audit")
    log = open_log(tmp_path)
    for i in range(3):
        log.job("accepted", f"j{i}")
    log.close()
    path = os.path.join(d, file_name(1))
    with open(path, "rb") as fh:
        data = fh.read()
    with open(path, "wb") as fh:
        fh.write(data[:-1])
    # the stop head still names the last record, but the missing newline shows the crash
    open_log(tmp_path).close()
    recs = records(d)
    assert [r["type"] for r in recs] == ["job", "job", "job", "recovered"]
    assert recs[-1]["reason"] == "unclean_shutdown" and recs[-1]["last_seq"] == 3
    assert verify(d, KEY).ok


def test_clean_restart_needs_no_recovery_and_unclean_one_does(tmp_path):
    d = str(tmp_path / "audit")
    open_log(tmp_path).close()
    log = open_log(tmp_path)
    log.job("accepted", "j1")
    log.close()
    assert not [r for r in records(d) if r["type"] == "recovered"]
    # drop the clean-stop head: this is what a crash looks like
    path = os.path.join(d, CHECKPOINTS)
    with open(path, "rb") as fh:
        lines = fh.read().split(b"\n")[:-1]
    with open(path, "wb") as fh:
        fh.write(b"".join(x + b"\n" for x in lines[:-1]))
    open_log(tmp_path).close()
    rec = [r for r in records(d) if r["type"] == "recovered"]
    assert len(rec) == 1 and rec[0]["reason"] == "unclean_shutdown" and rec[0]["last_seq"] == 1
    assert verify(d, KEY).ok


def test_interrupted_rotation_is_completed_on_start(tmp_path):
    d = str(tmp_path / "audit")
    log = open_log(tmp_path)
    for i in range(5):
        log.job("accepted", f"j{i}")
    log.close()
    open(os.path.join(d, file_name(2)), "wb").close()  # crashed right after creating the next file
    log = open_log(tmp_path)
    log.job("accepted", "after")
    log.close()
    with open(os.path.join(d, file_name(2)), "rb") as fh:
        first = json.loads(fh.readline())
    assert first["type"] == "checkpoint" and first["file"] == file_name(1) and first["seq"] == 6
    assert any(c["kind"] == "closed" and c["file"] == file_name(1) for c in cps(d))
    r = verify(d, KEY)
    assert r.ok, r.problem


def test_one_writer_per_directory(tmp_path):
    log = open_log(tmp_path)
    try:
        with pytest.raises(AuditError, match="in use by another writer"):
            open_log(tmp_path)
    finally:
        log.close()
    open_log(tmp_path).close()  # released on close


def test_key_file_is_created_root_only_and_lax_modes_are_refused(tmp_path):
    kf = str(tmp_path / "etc" / "audit.key")
    log = AuditLog(str(tmp_path / "audit"), kf)
    log.close()
    assert stat.S_IMODE(os.stat(kf).st_mode) == 0o600
    assert len(load_key(kf)) == 32
    os.chmod(kf, 0o640)
    with pytest.raises(AuditError, match=r"accessible by group or others \(mode 0640\).*chmod 600"):
        AuditLog(str(tmp_path / "audit"), kf)
    os.chmod(kf, 0o600)
    with open(kf, "w") as fh:
        fh.write("short")
    with pytest.raises(KeyFileError, match="at least 32"):
        load_key(kf)
    with pytest.raises(KeyFileError, match="does not exist"):
        load_key(str(tmp_path / "nope.key"))


def test_unusable_directory_is_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(AuditError, match="cannot use audit directory"):
        AuditLog(str(blocker / "audit"), str(tmp_path / "k"), key=KEY)


def test_verify_while_the_writer_is_writing(tmp_path):
    d = str(tmp_path / "audit")
    log = open_log(tmp_path, rotate_bytes=8192, fsync_interval_s=0.01, checkpoint_interval_s=0.01)
    stop = threading.Event()

    def produce():
        i = 0
        while not stop.is_set():
            log.job("accepted", f"live-{i}")
            i += 1
            if i % 50 == 0:
                stop.wait(0.001)

    t = threading.Thread(target=produce)
    t.start()
    try:
        for _ in range(5):
            r = verify(d, KEY)
            assert r.ok, str(r.problem)
    finally:
        stop.set()
        t.join()
        log.close()
    assert verify(d, KEY).ok


def test_config_record_describes_the_file_without_secrets(tmp_path):
    from agent.audit import describe_config
    from agent.config import parse_config

    path = tmp_path / "agent.yaml"
    text = ("cluster: plant-b\nagent_id: gw-9\netcd:\n  endpoints: ['https://127.0.0.1:2379']\n  username: u\n"
            "  password: hunter2\n  tls: {ca: /etc/ssl/ca.pem}\n")
    path.write_text(text)
    cfg = parse_config(text, str(path))
    m = MemoryAudit()
    m.config(**describe_config(cfg))
    rec = m.of_type("config")[0]
    assert rec["source"] == str(path) and len(rec["sha256"]) == 64
    assert rec["summary"]["cluster"] == "plant-b" and "hunter2" not in json.dumps(rec)
    # the digest is not the file's: a hash of the whole file would let anyone holding the log
    # test password guesses against it
    import hashlib

    assert rec["sha256"] != hashlib.sha256(text.encode()).hexdigest()


def test_torn_checkpoint_line_is_chained_around_too(tmp_path):
    d = str(tmp_path / "audit")
    log = open_log(tmp_path)
    log.job("accepted", "j1")
    log.close()
    with open(os.path.join(d, CHECKPOINTS), "ab") as fh:
        fh.write(b'{"agent":null,"bytes":12')
    open_log(tmp_path).close()
    kinds = [(c["type"], c.get("kind")) for c in cps(d)]
    assert ("recovered", None) in kinds
    r = verify(d, KEY)
    assert r.ok, str(r.problem)
    assert [x["type"] for x in records(d)][-1] == "recovered"  # the main log saw an unclean stop too
