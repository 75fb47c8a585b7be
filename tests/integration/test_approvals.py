"""Four-eyes approval end to end: real `millwright run` agents, mosquitto, etcd, and the
`millwright push --save / --approve` CLI (issue 38, acceptance 3).

A template asks for an operator's and a quality engineer's signature. One signature: the
job is stored ``waiting_approval`` and never runs; a second operator's: still waiting; an
approval by a retired key, or made for another cluster: refused with its reason; a quality
engineer's: it runs, once. The audit log names every approval's key."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from agent.cloud.ingest import push_digest
from agent.jobs.signing import KeyRing, approve, generate_ed25519, sign
from tests.support import history
from tests.support.cloud import CloudWorld, Pusher, wait_agent_connected
from tests.support.commands import millwright
from tests.support.jobs import JOBS, effects_file
from tests.support.records import agent_audit
from tests.support.waiting import wait_for

EFFECT = os.path.join(JOBS, "effect.sh")
ROLES = {"op-1": "operator", "op-2": "operator", "qa-1": "quality", "qa-old": "quality"}


def write_yaml(path: str, data: dict) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        yaml.safe_dump(data, fh)


@pytest.fixture
def world(etcd_server, mosquitto_server, tmp_path):
    out = effects_file(tmp_path)
    templates = {"flash": {"argv": [EFFECT, out, "a1", "0", "0"], "user": "root", "allow_root": True,
                           "allow_exec": ["/bin/*", "/usr/bin/*", EFFECT],
                           "approvals": {"required": 2, "roles": ["operator", "quality"]}}}
    w = CloudWorld(etcd_server, mosquitto_server, tmp_path, templates, shards=4)
    pairs = {kid: generate_ed25519() for kid in ROLES}
    agents_ring = {kid: {"alg": "ed25519", "public_key": pub, "role": ROLES[kid]} for kid, (_, pub) in pairs.items()}
    agents_ring["qa-old"]["retired_after"] = "2020-01-01T00:00:00Z"
    with open(w.keys_file) as fh:
        agents_ring.update(yaml.safe_load(fh))   # the cloud's hmac key stays
    write_yaml(w.keys_file, agents_ring)
    w.signers = {}
    for kid, (seed, _) in pairs.items():
        path = str(tmp_path / f"{kid}.yaml")
        write_yaml(path, {kid: {"alg": "ed25519", "private_key": seed, "role": ROLES[kid]}})
        w.signers[kid] = path
    w.out = out
    yield w
    w.close()


def push(world, cfg: str, path: str, kid: str, *extra: str):
    r = millwright("push", "-c", cfg, path, "--key-file", world.signers[kid], "--kid", kid, "--timeout", "20", *extra)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def runs_of(world, job_id: str) -> dict:
    return world.cluster.job_runs(job_id)


def test_a_job_runs_once_two_roles_approved_it(world, tmp_path):
    a = world.cluster.start("a1")
    wait_for(lambda: world.cluster.all_owned_by({"a1"}), 30, what="a1 owns all shards")
    wait_agent_connected(world.col, "a1")
    cfg = a.config_path
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"v": 1, "id": "flash-1", "template": "flash", "schedule": {}}))
    signed_path = str(tmp_path / "signed.json")

    # one signature: stored, waiting for approval, never run
    r = push(world, cfg, str(job), "op-1", "--save", signed_path)
    assert r.returncode == 0 and r.stdout.startswith("waiting_approval flash-1"), (r.stdout, r.stderr)
    assert "1 of 2 approvals" in r.stdout and "missing role(s): quality" in r.stdout
    assert world.col.wait(lambda m: any(d.get("state") == "waiting_approval" and d.get("run_id")
                                        for _, _, d in m), 30)

    # a second operator: the same role counts once
    r = push(world, cfg, signed_path, "op-2", "--approve")
    assert r.returncode == 0 and r.stdout.startswith("waiting_approval flash-1"), (r.stdout, r.stderr)
    assert "1 of 2 approvals" in r.stdout
    assert len(json.load(open(signed_path))["approvals"]) == 1

    # a retired quality key: refused with its reason (and the stored job is unchanged)
    retired = str(tmp_path / "retired.json")
    with open(signed_path) as src, open(retired, "w") as dst:
        dst.write(src.read())
    r = push(world, cfg, retired, "qa-old", "--approve")
    assert r.returncode == 1 and "key_retired" in r.stdout and "approvals[1]" in r.stdout, (r.stdout, r.stderr)

    # an approval for another cluster: that document is refused (wrong_cluster), and its
    # approval lifted into this cluster's document does not verify (bad_signature)
    doc = json.load(open(signed_path))
    ring = KeyRing.load(world.signers["qa-1"])
    bare = {k: v for k, v in doc.items() if k != "approvals"}
    other = approve(sign({**bare, "cluster": "plant-b"}, KeyRing.load(world.signers["op-1"]), "op-1"), ring, "qa-1")
    elsewhere = str(tmp_path / "other.json")
    with open(elsewhere, "w") as fh:
        json.dump(other, fh)
    r = push(world, cfg, elsewhere, "op-2", "--approve")
    assert r.returncode == 1 and "wrong_cluster" in r.stdout, (r.stdout, r.stderr)
    lifted = json.dumps({**doc, "approvals": doc["approvals"] + [other["approvals"][0]]}).encode()
    pusher = Pusher(world.mq.url, "lift-pusher")
    try:
        pusher.push(lifted)
        assert world.col.wait(lambda m: any(d.get("push_sha256") == push_digest(lifted) and d.get("state") == "rejected"
                                            for _, _, d in m), 30)
    finally:
        pusher.stop()
    refusal = next(d for d in world.col.docs("rejected") if d.get("push_sha256") == push_digest(lifted))
    assert refusal["reason"] == "bad_signature" and "approvals[1]" in refusal["detail"], refusal

    # nothing ran so far
    assert runs_of(world, "flash-1") == {}
    assert not os.path.exists(world.out) or "flash-1" not in open(world.out).read()

    # the quality engineer approves: it runs, once
    r = push(world, cfg, signed_path, "qa-1", "--approve")
    assert r.returncode == 0 and r.stdout.startswith("accepted flash-1"), (r.stdout, r.stderr)
    wait_for(lambda: [x["state"] for x in runs_of(world, "flash-1").values()] == ["succeeded"], 30,
             what="flash-1 succeeded")
    effects = [se for se in history.parse_effects(world.out) if se.job == "flash-1"]
    assert len(effects) == 1
    # one key approves once
    r = push(world, cfg, signed_path, "qa-1", "--approve")
    assert r.returncode == 2 and "already signed" in r.stderr, (r.stdout, r.stderr)

    # the audit log: every approval with its key, and what the running agent decided
    audit = agent_audit(a)
    kids = {s["kid"] for rec in audit if rec.get("event") == "accepted" for s in rec.get("signers", [])}
    kids |= {rec.get("kid") for rec in audit if rec.get("event") == "approval"}
    assert {"op-1", "op-2", "qa-1"} <= kids
    approved = [rec for rec in audit if rec.get("event") == "approval_approved"]
    assert len(approved) == 1
    assert {(s["kid"], s["role"]) for s in approved[0]["signed_by"]} == {("op-1", "operator"), ("qa-1", "quality")}
    refused = [rec for rec in audit if rec.get("event") == "rejected" and rec.get("job") == "flash-1"]
    assert {rec["reason"] for rec in refused} >= {"key_retired", "bad_signature"}
    # jobs show says how it stands
    show = millwright("jobs", "show", "flash-1", "-c", cfg, "--json")
    view = json.loads(show.stdout)
    assert view["approval"]["ok"] and view["state"] == "succeeded"
