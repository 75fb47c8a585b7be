"""Reload (issue 52, acceptance 1 and 2): a real `millwright run` agent, real etcd and
mosquitto. SIGHUP during a run swaps the keys and adds a template without touching the run;
a reload that changes a restart-only key, or breaks the config, is refused whole."""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import datetime, timedelta, timezone

import pytest
import yaml

from agent.cloud.ingest import push_digest
from agent.daemon.admin import query
from agent.jobs.signing import KeyRing, generate_hmac_secret
from tests.support.cloud import CloudWorld, Pusher, accepted, wait_agent_connected
from tests.support.cloudkit import KID, TEMPLATES, job_doc, rfc, signed
from tests.support.commands import millwright
from tests.support.waiting import wait_for

SLOW = os.environ.get("MILLWRIGHT_SLOW") == "1"
RUN_S = 300 if SLOW else 20
PLANT_KID = "plant-1"   # signs the long run's job: it stays in the keys file
NEW_KID = "cloud-2"

RELOAD_TEMPLATES = {
    **TEMPLATES,
    "soak": {"argv": ["/bin/sleep", "{s}"], "params": {"s": "^[0-9]{1,4}$"}, "user": "root", "allow_root": True,
             "allow_exec": ["/bin/sleep", "/usr/bin/sleep"]},
}
NEW_TEMPLATE = {"argv": ["/bin/true", "{line}"], "params": {"line": "^[0-9]{1,2}$"}, "user": "root",
                "allow_root": True, "allow_exec": ["/bin/true", "/usr/bin/true"]}


def write_keys(path: str, entries: dict) -> KeyRing:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        yaml.safe_dump(entries, fh)
    return KeyRing.load(path)


def write_config(agent, cfg: dict) -> None:
    with open(os.open(agent.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
        yaml.safe_dump(cfg, fh)


def status(agent) -> dict:
    return query(agent.config["admin"]["socket"])


def runs_of(world, job_id: str) -> list[dict]:
    return list(world.cluster.job_runs(job_id).values())


@pytest.fixture
def world(etcd_server, mosquitto_server, tmp_path):
    w = CloudWorld(etcd_server, mosquitto_server, tmp_path, RELOAD_TEMPLATES, 8)
    yield w
    w.close()


def _agent_with_a_long_run(world, run_s: float, job_id: str = "long"):
    """Agent a1 with a keys file of cloud-1 and plant-1, running a job of ``run_s`` seconds."""
    secrets = {KID: generate_hmac_secret(), PLANT_KID: generate_hmac_secret()}
    entries = {kid: {"alg": "hmac-sha256", "secret": s} for kid, s in secrets.items()}
    ring = write_keys(world.cluster.keys_file, entries)
    write_keys(world.keys_file, entries)
    a = world.cluster.start("a1", extra={"signing": {"keys_file": world.keys_file}})
    wait_for(lambda: world.cluster.all_owned_by({"a1"}), 30, what="a1 owns all shards")
    wait_agent_connected(world.col, "a1")
    pusher = Pusher(world.mq.url, "reload-pusher")
    pusher.push(signed(job_doc(job_id, template="soak", at_offset_s=1, params={"s": str(int(run_s))}),
                       ring, PLANT_KID))
    wait_for(lambda: any(r.get("state") == "running" for r in runs_of(world, job_id)), 30, what="the run started")
    return a, ring, entries, pusher


def test_sighup_during_a_run_swaps_keys_and_templates(world):
    a, ring, entries, pusher = _agent_with_a_long_run(world, RUN_S)
    try:
        before = status(a)["config"]["digest"]
        # the reload: cloud-2 added, cloud-1 retired a minute ago, a new template
        now = datetime.now(timezone.utc)
        new_entries = dict(entries)
        new_entries[KID] = {**entries[KID], "retired_after": rfc(now - timedelta(minutes=1))}
        new_entries[NEW_KID] = {"alg": "hmac-sha256", "secret": generate_hmac_secret()}
        new_ring = write_keys(world.keys_file, new_entries)
        cfg = dict(a.config)
        cfg["templates"] = {**cfg["templates"], "flush2": NEW_TEMPLATE}
        write_config(a, cfg)
        t_hup = time.monotonic()
        a.signal(signal.SIGHUP)
        wait_for(lambda: status(a)["config"]["digest"] != before, 20, interval=0.05, what="the reload applied")
        t_applied = time.monotonic()
        fresh = signed(job_doc("new-kid"), new_ring, NEW_KID)
        pusher.push(fresh)
        assert world.col.wait(lambda m: "new-kid" in accepted(world.col), 10)
        t_accepted = time.monotonic()
        old = signed(job_doc("old-kid"), new_ring, KID)
        pusher.push(old)
        assert world.col.wait(lambda m: any(d.get("push_sha256") == push_digest(old)
                                            for d in world.col.docs("rejected")), 10)
        rej = [d for d in world.col.docs("rejected") if d.get("push_sha256") == push_digest(old)]
        assert rej[0]["reason"] == "key_retired", rej
        print(f"\nSIGHUP -> applied {t_applied - t_hup:.3f} s; applied -> push with the new kid accepted "
              f"{t_accepted - t_applied:.3f} s (SIGHUP -> accepted {t_accepted - t_hup:.3f} s)")
        # a job of the new template runs
        pusher.push(signed(job_doc("tpl-new", template="flush2", at_offset_s=1), new_ring, NEW_KID))
        wait_for(lambda: any(r.get("state") == "succeeded" for r in runs_of(world, "tpl-new")), 30,
                 what="the new template's job ran")
        # the run that was live during the reload ends succeeded, once
        wait_for(lambda: any(r.get("state") not in ("running", None) for r in runs_of(world, "long")),
                 RUN_S + 30, interval=0.5, what="the long run ended")
        runs = runs_of(world, "long")
        assert [r["state"] for r in runs] == ["succeeded"], runs
        reloads = [r for r in world.cluster.audit("a1") if r.get("type") == "config_reload"]
        assert [r["result"] for r in reloads] == ["applied"], reloads
        assert {"signing.keys", "templates"} <= set(reloads[0]["changed"])
        assert a.alive()
    finally:
        pusher.stop()


def test_refused_reloads_keep_the_running_config(world):
    a, ring, entries, pusher = _agent_with_a_long_run(world, 15)
    try:
        st = status(a)["config"]
        good = dict(a.config)
        broken_regex = json.loads(json.dumps(good))
        broken_regex["templates"]["flush"]["params"]["line"] = "^([0-9]$"
        cases = {
            "cluster": ({**good, "cluster": "other"}, "reload refused: cluster is restart-only"),
            "yaml": ("cluster: [unclosed\n", "invalid YAML"),
            "regex": (broken_regex, "templates.flush.params.line"),
        }
        for name, (cfg, want) in cases.items():
            if isinstance(cfg, str):
                with open(a.config_path, "w") as fh:
                    fh.write(cfg)
            else:
                write_config(a, cfg)
            # --socket: a broken config names no socket (the agent reports what is wrong with it)
            r = millwright("reload", "-c", a.config_path, "--socket", a.config["admin"]["socket"], timeout=90)
            lines = [line for line in r.stderr.splitlines() if line.strip()]
            print(f"\n{name}: exit {r.returncode}: {lines}")
            assert r.returncode == 2, (name, r.stdout, r.stderr)
            assert len(lines) == 1 and want in lines[0], (name, lines)
            now = status(a)["config"]
            assert now["digest"] == st["digest"], (name, now)
            assert now["last_refusal"] and want in now["last_refusal"]["problems"][0]
        write_config(a, good)
        r = millwright("reload", "-c", a.config_path, timeout=90)
        assert r.returncode == 0 and "unchanged" in r.stdout, (r.stdout, r.stderr)
        wait_for(lambda: any(r.get("state") not in ("running", None) for r in runs_of(world, "long")), 60,
                 interval=0.5, what="the run ended")
        assert [r["state"] for r in runs_of(world, "long")] == ["succeeded"]
        assert a.alive()
        results = [r["result"] for r in world.cluster.audit("a1") if r.get("type") == "config_reload"]
        assert results == ["refused", "refused", "refused", "unchanged"], results
    finally:
        pusher.stop()
