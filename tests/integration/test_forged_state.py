"""etcd state forged by someone with write access to etcd but no signing key (issue 34,
acceptance 2): a signed job copied to another key or shard, a job signed in 2020 re-put
after retention removed it, forged `retrying` records (a negative attempt among them), a
forged `latest/` `succeeded` for a dependency, and records pre-created for a future
firing. Each makes nothing run that the signed job does not allow, and each is visible as
a status, a metric and an audit record.

One real agent process on a real etcd; the forger writes etcd directly. Absence of a run is
judged after a positive witness: the agent's own report that it refused what it found."""

from __future__ import annotations

import json
import os
import urllib.request
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from agent.coordination.keys import shard_of
from agent.demo.services import free_port
from agent.jobs.schedule import fire_id, format_rfc3339
from agent.jobs.signing import sign
from agent.daemon.admin import query
from tests.support.cloudkit import KID, bound
from tests.support.cluster import recording_cluster
from tests.support.jobs import effects, job, now
from tests.support.kernel import require_kernel
from tests.support.waiting import wait_for

SHARDS = 4


@pytest.fixture
def env(etcd_server, tmp_path):
    require_kernel(os.geteuid() == 0, "the agent's runs are root jobs in separate directories: needs root")
    port = free_port()
    c, out = recording_cluster(etcd_server, tmp_path, shards=SHARDS, extra={"metrics": {"listen": f"127.0.0.1:{port}"}})
    a = c.start("f0")
    try:
        wait_for(lambda: c.all_owned_by({"f0"}), 30, what="the agent holding every shard")
        yield c, a, out, port
    finally:
        c.close()


def rfc(t: datetime) -> str:
    return format_rfc3339(t.replace(microsecond=0))


def metric(port: int, name: str, **labels: str) -> float:
    """A counter's value on the agent's /metrics (0 when absent)."""
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
    return 0.0


def statuses(c: Any, job_id: str, **match: Any) -> list[dict]:
    return [d for d in c.statuses("f0") if d.get("job_id") == job_id and all(d.get(k) == v for k, v in match.items())]


def audit(c: Any, event: str, **match: Any) -> list[dict]:
    return [r for r in c.audit("f0") if r.get("event") == event and all(r.get(k) == v for k, v in match.items())]


def put(c: Any, key: str, value: Any) -> None:
    c.client.put(key, value if isinstance(value, (str, bytes)) else json.dumps(value))


def stored_value(c: Any, doc: dict, accepted_at: datetime) -> dict:
    """A job document as ingest stores it, signed by the cloud's key (the forger copies or
    re-puts signed documents; it cannot sign new ones)."""
    return dict(sign(bound(doc, c.cluster), c.ring, KID), _accepted={"at": rfc(accepted_at), "by": "gone"})


def loaded(a: Any) -> bool:
    try:
        return query(a.config["admin"]["socket"])["jobs"]["loading_shards"] == []
    except Exception:   # not listening yet
        return False


def restart(c: Any, a: Any) -> None:
    a.kill()
    a.start()
    wait_for(lambda: c.all_owned_by({"f0"}) and loaded(a), 60, interval=0.1, what="the agent back, every shard loaded")


def test_a_signed_job_copied_to_another_key_or_shard_runs_once_under_its_own_key(env):
    c, a, out, port = env
    due = now() + timedelta(seconds=4)
    c.job_store().create(job("flash-fw", {"at": rfc(due)}))
    home = shard_of("flash-fw", SHARDS)
    value = c.client.get(c.keys.job(home, "flash-fw")).value
    put(c, c.keys.job((home + 1) % SHARDS, "flash-fw"), value)        # another shard, same name
    put(c, c.keys.job(home, "flash-fw-2"), value)                      # another name
    wait_for(lambda: len(statuses(c, "flash-fw", state="rejected", reason="misplaced")) == 2, 20,
             what="both copies refused")
    wait_for(lambda: [r["state"] for r in c.job_runs("flash-fw").values()] == ["succeeded"], 30,
             what="the job's own run")
    restart(c, a)   # the copies are read again at load: refused again, nothing runs
    wait_for(lambda: len(statuses(c, "flash-fw", state="rejected", reason="misplaced")) == 4, 20,
             what="both copies refused at load")
    assert effects(out)[("flash-fw", fire_id("flash-fw", due.replace(microsecond=0)))] == 1
    assert sum(n for (j, _), n in effects(out).items() if j.startswith("flash-fw")) == 1
    # the audit log is written by its own thread, a few milliseconds after the status
    wait_for(lambda: len(audit(c, "rejected_stored", reason="misplaced")) == 4, 5, what="four audit records")
    assert metric(port, "millwright_jobs_rejected_stored_total", reason="misplaced") == 2


def test_a_job_signed_in_2020_re_put_after_retention_never_runs(env):
    c, a, out, port = env
    signed_at = datetime(2020, 3, 1, 8, tzinfo=timezone.utc)
    doc = job("fw-2020", {"at": rfc(signed_at + timedelta(hours=1))}, issued_at=rfc(signed_at))
    put(c, c.keys.job(shard_of("fw-2020", SHARDS), "fw-2020"), stored_value(c, doc, signed_at))
    (st,) = wait_for(lambda: statuses(c, "fw-2020", state="rejected"), 20, what="the re-put refused")
    assert st["reason"] == "too_old" and "a replay is never run" in st["detail"]
    assert not [k for k in effects(out) if k[0] == "fw-2020"] and c.job_runs("fw-2020") == {}
    # the audit writer appends on a thread of its own: the status may come first
    wait_for(lambda: [r["reason"] for r in audit(c, "rejected_stored", job="fw-2020")] == ["too_old"], 5,
             what="its one audit record")
    assert metric(port, "millwright_jobs_rejected_stored_total", reason="too_old") == 1


def test_forged_retrying_records_run_nothing_again(env):
    """`retrying` over a job's only attempt, and `attempt: -1000` on a job with retries: both
    foreign at load, each firing stays run once, and each job says so once."""
    c, a, out, port = env
    store = c.job_store()
    due = now() + timedelta(seconds=3)
    store.create(job("once", {"at": rfc(due)}))
    store.create(job("twice", {"at": rfc(due)}, retry={"max_attempts": 2}))
    wait_for(lambda: all([r["state"] for r in c.job_runs(j).values()] == ["succeeded"] for j in ("once", "twice")),
             30, what="both run and succeeded")
    a.kill()
    for jid, forged in (("once", {"state": "retrying", "retry_at": rfc(now())}),
                        ("twice", {"state": "retrying", "attempt": -1000, "retry_at": rfc(now())})):
        (fid, rec), = c.job_runs(jid).items()
        put(c, c.keys.run(shard_of(jid, SHARDS), jid, fid), dict(rec, **forged))
    restart(c, a)
    for jid, why in (("once", "`retrying` after attempt 1 of 1"), ("twice", "attempt -1000 is outside 1..2")):
        (st,) = wait_for(lambda: statuses(c, jid, state="rejected", reason="foreign_record"), 20,
                         what=f"{jid}'s forged record reported")
        assert st["count"] == 1 and why in st["records"][0]["why"] and st["source"] == "store"
        (rec,) = wait_for(lambda: audit(c, "foreign_record", job=jid), 5, what=f"{jid}'s audit record")
        assert (rec["where"], rec["count"]) == ("load", 1) and why in rec["records"][0]["why"]
    # the reports came after the records were judged: neither firing ran again
    assert sum(n for (j, _), n in effects(out).items() if j == "once") == 1
    assert sum(n for (j, _), n in effects(out).items() if j == "twice") == 1
    assert query(a.config["admin"]["socket"])["jobs"]["running"] == []
    assert metric(port, "millwright_foreign_records_total", where="load") == 2


def test_a_forged_latest_succeeded_satisfies_no_dependency(env):
    """`flash` depends on `backup`. A `succeeded` copy in latest/ for a backup that does not
    exist, then one for a backup job that exists but never ran (no run record behind the
    copy): neither starts `flash`, each is named in its waiting status."""
    c, a, out, port = env
    store = c.job_store()
    s = shard_of("backup", SHARDS)
    forged = {"v": 1, "job_id": "backup", "fire_id": "20200101T000000.000Z", "state": "succeeded", "attempt": 1,
              "agent": "gw-9", "fence": 1}
    put(c, c.keys.latest(s, "backup"), forged)
    store.create(job("flash", {}, depends_on=["backup"]))
    (st,) = wait_for(lambda: statuses(c, "flash", state="waiting"), 20, what="flash waiting")
    assert st["waiting_for"] == ["backup"] and st["not_believed"]["backup"].startswith("its newest record")
    # the backup job now exists, never ran: a forged copy naming its (real) firing
    due = now() + timedelta(days=30)
    store.create(job("backup", {"at": rfc(due)}))
    put(c, c.keys.latest(s, "backup"), dict(forged, fire_id=fire_id("backup", due.replace(microsecond=0)),
                                             fence=10 ** 6))
    wait_for(lambda: len(audit(c, "foreign_record", job="flash", where="dependency")) >= 1, 20,
             what="the forged dependency reported")
    assert query(a.config["admin"]["socket"])["jobs"]["waiting"] == 1   # still waiting, once
    assert not [k for k in effects(out) if k[0] == "flash"]
    assert metric(port, "millwright_foreign_records_total", where="dependency") >= 1


def test_a_record_pre_created_for_a_future_firing_neither_stops_nor_repeats_it(env):
    """Forged before the agent loads the shard: reported at load, and the firing's claim
    replaces it when it falls due. Forged after: the claim finds it, reports it and claims
    over it. Either way the firing runs once, on time."""
    c, a, out, port = env
    store = c.job_store()
    a.kill()
    due1 = now() + timedelta(seconds=30)
    store.create(job("early-forgery", {"at": rfc(due1)}))
    fid1 = fire_id("early-forgery", due1.replace(microsecond=0))
    fake = {"v": 1, "job_id": "early-forgery", "fire_id": fid1, "state": "succeeded", "attempt": 1, "agent": "gw-9"}
    put(c, c.keys.run(shard_of("early-forgery", SHARDS), "early-forgery", fid1), fake)
    restart(c, a)
    wait_for(lambda: statuses(c, "early-forgery", state="rejected", reason="foreign_record"), 20,
             what="the future forgery reported at load")
    due2 = now() + timedelta(seconds=8)
    store.create(job("late-forgery", {"at": rfc(due2)}))
    fid2 = fire_id("late-forgery", due2.replace(microsecond=0))
    wait_for(lambda: statuses(c, "late-forgery", state="scheduled"), 5, interval=0.05, what="late-forgery loaded")
    put(c, c.keys.run(shard_of("late-forgery", SHARDS), "late-forgery", fid2),
        dict(fake, job_id="late-forgery", fire_id=fid2))
    for jid, fid in (("early-forgery", fid1), ("late-forgery", fid2)):
        # one read: the forged record says succeeded too, and the claim over it names f0
        wait_for(lambda: [(k, r["state"], r["agent"]) for k, r in c.job_runs(jid).items()] == [(fid, "succeeded", "f0")],
                 60, what=f"{jid} run by the agent")
        assert effects(out)[(jid, fid)] == 1
        assert statuses(c, jid, state="running", reason="foreign_record")   # the claim over it, reported
    assert sorted((r["job"], r["where"]) for r in audit(c, "foreign_record")) == [
        ("early-forgery", "claim"), ("early-forgery", "load"), ("late-forgery", "claim")]
    assert metric(port, "millwright_foreign_records_total", where="load") == 1
    assert metric(port, "millwright_foreign_records_total", where="claim") == 2
