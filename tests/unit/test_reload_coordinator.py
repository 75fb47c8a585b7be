"""The reload coordinator (agent/daemon/reload.py) with fakes for the parts it changes, and
`millwright reload` against an agent that predates reload (exit 3)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from argparse import Namespace

import yaml

from agent.config import load_config
from agent.daemon.admin import cli_reload
from agent.daemon.reload import Reloader
from agent.jobs.signing import KeyRing, generate_hmac_secret


class Loop:
    """Runs what is posted when the test says so (the loop thread)."""

    def __init__(self):
        self.posted: list = []
        self.cv = threading.Condition()

    def post(self, fn, *args):
        with self.cv:
            self.posted.append((fn, args))
            self.cv.notify_all()

    def run_one(self, timeout=5.0):
        with self.cv:
            assert self.cv.wait_for(lambda: self.posted, timeout)
            fn, args = self.posted.pop(0)
        fn(*args)


class Parts:
    def __init__(self):
        self.calls: list = []

    def keys_changed(self):
        self.calls.append("keys")

    def templates_changed(self, templates):
        self.calls.append(("templates", sorted(templates)))

    def member_changed(self, capacity, fields):
        self.calls.append(("member", capacity, fields["labels"]))

    def reconnect(self, mqtt):
        self.calls.append("mqtt")

    def reconfigure(self, tls, password):
        self.calls.append("etcd")


class Audit:
    def __init__(self):
        self.records: list = []

    def record(self, type_, **fields):
        self.records.append((type_, fields))


def write(path, data, mode=0o600):
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w") as fh:
        yaml.safe_dump(data, fh)


def make(tmp_path, **extra):
    keys = str(tmp_path / "keys.yaml")
    write(keys, {"k1": {"alg": "hmac-sha256", "secret": generate_hmac_secret()}})
    cfg_path = str(tmp_path / "agent.yaml")
    base = {"cluster": "t", "agent_id": "a1", "etcd": {"insecure": True}, "mqtt": {"insecure": True},
            "signing": {"keys_file": keys}, "state_dir": str(tmp_path / "state"),
            "templates": {"t1": {"argv": ["/bin/true"]}}, **extra}
    write(cfg_path, base)
    cfg = load_config(cfg_path)
    ring = KeyRing.load(keys)
    loop, parts, audit = Loop(), Parts(), Audit()
    r = Reloader(cfg, loop, audit, ring, catalog=parts, member=parts, broker=parts, channel=parts,
                 template_holders=[parts])
    return r, base, cfg_path, keys, ring, loop, parts, audit


def reload(r, loop):
    answers: list = []
    r.request(answers.append)
    loop.run_one()
    return answers[0]


def test_live_changes_are_applied_through_the_parts(tmp_path):
    r, base, cfg_path, keys, ring, loop, parts, audit = make(tmp_path)
    before = r.status()["digest"]
    assert reload(r, loop)["result"] == "unchanged" and parts.calls == []
    write(keys, {"k2": {"alg": "hmac-sha256", "secret": generate_hmac_secret()}})
    write(cfg_path, {**base, "labels": {"line": "2"}, "templates": {"t2": {"argv": ["/bin/true"]}}})
    answer = reload(r, loop)
    assert answer["result"] == "applied", answer
    assert set(answer["changed"]) == {"signing.keys", "labels", "templates"}
    assert ring.kids == ["k2"]   # the ring every part holds, replaced in place
    # the template holders (supervision's exec policies) first, then the catalog
    assert parts.calls == ["keys", ("templates", ["t2"]), ("templates", ["t2"]), ("member", 1.0, {"line": "2"})]
    assert r.cfg.labels == {"line": "2"} and r.status()["digest"] != before
    assert audit.records[-1][0] == "config_reload" and audit.records[-1][1]["result"] == "applied"


def test_a_restart_only_change_is_refused_whole(tmp_path):
    r, base, cfg_path, keys, ring, loop, parts, audit = make(tmp_path)
    before = r.status()["digest"]
    write(cfg_path, {**base, "cluster": "u", "labels": {"line": "2"}, "shards": 16})
    answer = reload(r, loop)
    assert answer["result"] == "refused"
    assert answer["problems"] == ["reload refused: cluster is restart-only", "reload refused: shards is restart-only"]
    assert parts.calls == [] and r.cfg.labels == {} and r.cfg.cluster == "t"
    assert r.status()["digest"] == before and r.status()["last_refusal"]["problems"] == answer["problems"]


def test_a_gate_change_waits_for_a_restart(tmp_path):
    r, base, cfg_path, keys, ring, loop, parts, audit = make(tmp_path)
    gated = {"argv": ["/bin/true"], "gates": {"door": {"etcd": "gates/door", "equals": "shut"}}}
    write(cfg_path, {**base, "templates": {"t1": {"argv": ["/bin/true"]}, "t2": gated}})
    answer = reload(r, loop)
    assert answer["problems"] == ["reload refused: templates.t2.gates is restart-only"], answer
    assert parts.calls == [] and set(r.cfg.templates) == {"t1"}


def test_a_renewed_certificate_at_the_same_path_reconnects(tmp_path):
    pki = tmp_path / "pki"
    pki.mkdir()
    ca, cert, key = (str(pki / n) for n in ("ca.pem", "c.pem", "c.key"))
    for p in (ca, cert, key):
        with open(p, "w") as fh:
            fh.write("one")
    r, base, cfg_path, keys, ring, loop, parts, audit = make(tmp_path, mqtt={"insecure": True, "tls": {
        "ca": ca, "cert": cert, "key": key}})
    with open(cert, "w") as fh:
        fh.write("renewed")
    assert reload(r, loop)["changed"] == ["mqtt.tls"] and parts.calls == ["mqtt"]
    # a key at another path is hidden from runs only from the next start: refused
    other = str(tmp_path / "elsewhere" / "c.key")
    os.makedirs(os.path.dirname(other))
    with open(other, "w") as fh:
        fh.write("two")
    write(cfg_path, {**base, "mqtt": {"insecure": True, "tls": {"ca": ca, "cert": cert, "key": other}}})
    answer = reload(r, loop)
    assert answer["result"] == "refused" and "hidden from runs" in answer["problems"][0], answer


def test_the_cli_says_when_the_agent_predates_reload(tmp_path, capsys):
    path = str(tmp_path / "old.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def old_agent():   # answers every connection with its status, reading nothing
        conn, _ = srv.accept()
        with conn:
            time.sleep(0.1)
            conn.sendall(json.dumps({"v": 1, "agent": "a1"}).encode())

    t = threading.Thread(target=old_agent, daemon=True)
    t.start()
    try:
        assert cli_reload(Namespace(socket=path, config=None, wait=False)) == 3
    finally:
        srv.close()
    assert "predates reload" in capsys.readouterr().err


def test_a_request_during_a_reload_is_answered_by_the_next_one(tmp_path):
    r, base, cfg_path, keys, ring, loop, parts, audit = make(tmp_path)
    first: list = []
    second: list = []
    r.request(first.append)
    write(cfg_path, {**base, "labels": {"line": "4"}})   # written after the first read may have begun
    r.request(second.append)
    loop.run_one()
    assert len(first) == 1 and second == []
    loop.run_one()
    assert second[0]["result"] in ("applied", "unchanged") and r.cfg.labels == {"line": "4"}
