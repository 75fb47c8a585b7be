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
    "legacy": {**TEMPLATES["flush"]},   # removed by the reload: its held job ends unknown_template
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
        # jobs this agent holds (due in 30 days): one signed by the key the reload retires,
        # one of the template the reload removes
        pusher.push(signed(job_doc("held-old-kid"), ring, KID))
        pusher.push(signed(job_doc("held-legacy", template="legacy"), ring, PLANT_KID))
        assert world.col.wait(lambda m: {"held-old-kid", "held-legacy"} <= set(accepted(world.col)), 20)
        before = status(a)["config"]["digest"]
        # the reload: cloud-2 added, cloud-1 retired a minute ago, a new template, one removed,
        # new labels
        now = datetime.now(timezone.utc)
        new_entries = dict(entries)
        new_entries[KID] = {**entries[KID], "retired_after": rfc(now - timedelta(minutes=1))}
        new_entries[NEW_KID] = {"alg": "hmac-sha256", "secret": generate_hmac_secret()}
        new_ring = write_keys(world.keys_file, new_entries)
        cfg = dict(a.config)
        cfg["templates"] = {**{k: v for k, v in cfg["templates"].items() if k != "legacy"}, "flush2": NEW_TEMPLATE}
        cfg["labels"] = {"line": "7"}
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
        # the held jobs: rejected as at load, from the store
        def stored_rejection(job_id):
            return [d for d in world.col.docs("rejected") if d.get("job_id") == job_id and d.get("source") == "store"]
        wait_for(lambda: stored_rejection("held-old-kid") and stored_rejection("held-legacy"), 10,
                 what="the held jobs rejected")
        assert stored_rejection("held-old-kid")[0]["reason"] == "key_retired"
        assert stored_rejection("held-legacy")[0]["reason"] == "unknown_template"
        # the member record carries the new labels and templates, under the same lease
        member = json.loads(world.cluster.client.get(world.cluster.keys.member("a1")).value)
        assert member["labels"] == {"line": "7"} and "flush2" in member["templates"] and "legacy" not in member["templates"]
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
        assert {"signing.keys", "templates", "labels"} <= set(reloads[0]["changed"])
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
        shown = millwright("status", "--socket", a.config["admin"]["socket"]).stdout
        assert f"config    {st['digest']}" in shown and "last reload refused" in shown, shown
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


def _client_pki(directory: str):
    """A CA, mosquitto's server certificate and the CA's issuer of client certificates."""
    from agent.demo.pki import ThrowawayCA, TlsFiles

    ca = ThrowawayCA(directory, "reload test CA")
    files = TlsFiles(ca.path, os.path.join(directory, "server.pem"), os.path.join(directory, "server.key"))
    ca.issue("localhost", files.cert, files.key, hosts=("localhost", "127.0.0.1"))
    return files, ca.issue


def test_sighup_renews_the_mqtt_client_certificate(etcd_server, tmp_path):
    """The agent's client certificate renewed at the same path (same CA): a reload makes a
    new client with it, and the broker's log shows the reconnect under the new identity."""
    from agent.config import MqttConfig, TLSConfig
    from agent.demo.services import MosquittoServer
    from tests.support.cloudkit import StatusCollector
    from tests.support.cluster import Cluster

    pki, issue = _client_pki(str(tmp_path / "pki"))
    cert, key = str(tmp_path / "pki" / "a1.pem"), str(tmp_path / "pki" / "a1.key")
    issue("a1-gen1", cert, key)
    cloud_cert, cloud_key = str(tmp_path / "pki" / "cloud.pem"), str(tmp_path / "pki" / "cloud.key")
    issue("cloud", cloud_cert, cloud_key)
    log_path = str(tmp_path / "broker.log")   # a file log: mosquitto's stdout is block-buffered
    conf = ("require_certificate true\nuse_identity_as_username true\nlog_type notice\nlog_timestamp true\n"
            f"log_dest file {log_path}\n")
    with MosquittoServer(str(tmp_path / "mosquitto"), tls=pki, extra_conf=conf) as mq:
        c = Cluster(etcd_server, str(tmp_path / "agents"), shards=8,
                    extra={"mqtt": {"url": mq.url, "tls": {"ca": pki.ca, "cert": cert, "key": key},
                                    "reconnect_min_s": 0.2, "reconnect_max_s": 1.0}, "templates": TEMPLATES})
        col = StatusCollector(mq.url, "t", extra_filters=("millwright/t/agents/#",),
                              mqtt_cfg=MqttConfig(url=mq.url, tls=TLSConfig(ca=pki.ca, cert=cloud_cert, key=cloud_key)))
        col.start()
        try:
            a = c.start("a1")

            def broker_log() -> str:
                with open(log_path, errors="replace") as fh:
                    return fh.read()
            wait_for(lambda: "u'a1-gen1'" in broker_log(), 30, what="the agent connected with gen1")
            wait_for(lambda: status(a).get("cloud", {}).get("connected"), 30, what="the agent reports connected")
            issue("a1-gen2", cert, key)   # renewed at the same path
            # pushes keep coming across the swap: none is lost
            from agent.cloud.mqtt import MqttLink
            from tests.support.cloud import T

            push_link = MqttLink(MqttConfig(url=mq.url, tls=TLSConfig(ca=pki.ca, cert=cloud_cert, key=cloud_key)),
                                 "reload-pusher", clean_session=False, reconnect_min_s=0.2, reconnect_max_s=1.0)
            push_link.start()
            assert push_link.wait_connected(10)
            ids = [f"swap-{i:03d}" for i in range(200)]

            def feed():
                for j in ids:
                    push_link.publish(T.push, signed(job_doc(j), c.ring), qos=1)
                    time.sleep(0.005)
            import threading

            feeder = threading.Thread(target=feed, daemon=True)
            feeder.start()
            time.sleep(0.3)
            t_hup = time.monotonic()
            a.signal(signal.SIGHUP)
            wait_for(lambda: "u'a1-gen2'" in broker_log(), 30, what="the reconnect with the renewed certificate")
            print(f"\nSIGHUP -> the broker logs the new certificate's connection: {time.monotonic() - t_hup:.3f} s")
            wait_for(lambda: status(a).get("cloud", {}).get("connected"), 30, what="connected again")
            # presence: online again on the new connection (retained, the last word). The old
            # client ends with a clean DISCONNECT, yet under push load the broker still
            # publishes its will now and then (about 1 swap in 10 here; see the commit):
            # counted and printed, not asserted
            assert col.wait(lambda m: len([d for d in col.docs() if d.get("state") == "online"]) >= 2, 10), col.docs()
            wills = [d for d in col.docs() if d.get("state") == "offline"]
            presence = [d for d in col.docs() if d.get("state") in ("online", "offline")]
            assert presence[-1]["state"] == "online", presence
            print(f"will published during the swap: {len(wills)} time(s)")
            feeder.join(30)
            assert col.wait(lambda m: set(ids) <= set(accepted(col)), 60), set(ids) - set(accepted(col))
            push_link.stop()
            lines = broker_log().splitlines()
            gone = [ln for ln in lines if "disconnected" in ln.lower() and "millwright-t-a1" in ln]
            new = [ln for ln in lines if "u'a1-gen2'" in ln]
            print("\n" + "\n".join(gone[-1:] + new[:1]))
            if gone:
                gap = int(new[0].split(":")[0]) - int(gone[-1].split(":")[0])
                print(f"broker log: disconnect -> reconnect with the new certificate within {gap} s "
                      "(mosquitto's timestamps are whole seconds)")
            # a clean DISCONNECT: the broker published no will (its log names none)
            assert not any("will" in ln.lower() and "millwright-t-a1" in ln for ln in lines), lines
            reloads = [r for r in c.audit("a1") if r.get("type") == "config_reload"]
            assert [r["result"] for r in reloads] == ["applied"] and reloads[0]["changed"] == ["mqtt.tls"], reloads
            assert a.alive()
        finally:
            col.stop()
            c.close()


def test_etcd_channel_reconfigured_keeps_the_lease_and_the_watch(etcd_server):
    """What a reload of etcd.tls does to the client (EtcdClient.reconfigure): the channel is
    made again; a lease granted on the old one is kept alive on the new one, and a watch
    resumes from its revision, missing nothing written meanwhile."""
    import threading

    from agent.config import EtcdConfig
    from agent.coordination.etcd import EtcdClient
    from agent.coordination.watch import PrefixWatch

    c = EtcdClient(EtcdConfig(endpoints=[etcd_server.endpoint], request_timeout_s=2.0, insecure=True))
    seen: list[str] = []
    lock = threading.Lock()

    def events(evs, rev):
        with lock:
            seen.extend(e.kv.key for e in evs)

    w = PrefixWatch(c, "/reload-test/", "test", on_snapshot=lambda kvs, rev: None, on_events=events).start()
    try:
        lease, _ = c.lease_grant(5)
        c.put("/reload-test/before", "1", lease=lease)
        wait_for(lambda: "/reload-test/before" in seen, 10, what="the first event")
        c.reconfigure(None, None)
        c.put("/reload-test/after", "2", lease=lease)
        assert c.lease_keepalive(lease) > 0
        wait_for(lambda: "/reload-test/after" in seen, 10, what="the watch resumed on the new channel")
        assert c.get("/reload-test/before") is not None   # the lease, and so its keys, lived on
    finally:
        w.stop()
        c.close()
