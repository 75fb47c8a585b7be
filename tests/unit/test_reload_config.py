"""Reload's view of the config (agent/config.py classify, diff, apply_live) and the key
ring's in-place replacement (agent/jobs/signing.py)."""

from __future__ import annotations

import dataclasses
import typing

import yaml

from agent.config import Config, apply_live, classify, diff, parse_config, reference_markdown
from agent.jobs.signing import KeyRing, generate_hmac_secret

LIVE = {"capacity", "labels", "templates", "retention", "quarantine", "etcd.tls", "etcd.password",
        "mqtt.tls", "mqtt.password"}


def _all_paths(cls=Config, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        yield prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _all_paths(hints[f.name], prefix + f.name + ".")


def test_every_field_is_classified_and_the_live_whitelist_is_as_documented():
    c = classify()
    live = {k for k, v in c.items() if v}
    assert live == LIVE
    # every key is either classified itself or under a live section (which covers its subtree)
    for path in _all_paths():
        assert path in c or any(path.startswith(k + ".") for k in live), path
    ref = reference_markdown()
    assert "| `templates` |" in ref and "Reload: live." in ref.split("| `templates` |")[1].splitlines()[0]
    assert "Reload: live." not in ref.split("| `cluster` |")[1].splitlines()[0]


def _cfg(**extra) -> Config:
    base = {"cluster": "t", "agent_id": "a1", "etcd": {"insecure": True}, "mqtt": {"insecure": True}}
    base.update(extra)
    return parse_config(yaml.safe_dump(base))


def test_diff_names_live_and_restart_only_keys():
    old = _cfg()
    new = _cfg(cluster="u", labels={"line": "2"}, shards=16, quarantine={"strikes": 5},
               templates={"t1": {"argv": ["/bin/true"]}})
    live, restart = diff(old, new)
    assert set(live) == {"labels", "quarantine", "templates"}
    assert set(restart) == {"cluster", "shards"}
    assert diff(old, _cfg()) == ([], [])
    _, restart = diff(old, _cfg(mqtt={"insecure": True, "keepalive_s": 10}))
    assert restart == ["mqtt.keepalive_s"]


def test_apply_live_changes_the_running_objects_in_place():
    running = _cfg(templates={"old": {"argv": ["/bin/true"]}})
    templates, quarantine = running.templates, running.quarantine
    apply_live(running, _cfg(templates={"new": {"argv": ["/bin/true"]}}, quarantine={"strikes": 7}, capacity=2.0))
    assert running.templates is templates and set(templates) == {"new"}
    assert running.quarantine is quarantine and quarantine.strikes == 7
    assert running.capacity == 2.0


def test_keyring_replace_in_place_and_digest():
    a = KeyRing.from_mapping({"k1": {"alg": "hmac-sha256", "secret": generate_hmac_secret()}})
    b = KeyRing.from_mapping({"k2": {"alg": "hmac-sha256", "secret": generate_hmac_secret()}})
    held = a
    d = a.digest()
    assert d == a.digest() and d != b.digest()
    a.replace(b)
    assert held.kids == ["k2"] and held.digest() == b.digest()
