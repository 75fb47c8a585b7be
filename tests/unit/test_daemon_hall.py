"""The hall (agent/daemon): the Daemon builds the Ground before any part, opens the audit
log first (a NullAudit without an audit dir, so no part checks for None), loads the key
ring once, and calls parts only through the Hooks the wiring filled."""

from __future__ import annotations

import logging

from agent.audit import AuditLog, NullAudit
from agent.audit.show import Filter, records
from agent.config import parse_config
from agent.coordination.fencing import Fence
from agent.daemon.core import Daemon
from agent.daemon.ground import Ground
from agent.daemon.hooks import Hooks, Wired


def config(tmp_path, audit: bool):
    audit_dir = f"{tmp_path}/audit" if audit else ""
    return parse_config(f"""
cluster: t
agent_id: a1
shards: 4
state_dir: {tmp_path}/state
etcd: {{endpoints: ["http://127.0.0.1:9"], insecure: true}}
mqtt: {{insecure: true}}
audit: {{dir: "{audit_dir}", key_file: {tmp_path}/audit.key}}
signing: {{keys_file: {tmp_path}/no-such-keys.yaml}}
""", "test")


class Wiring:
    """A wire function that keeps the Ground it was given and fills Hooks as a test says."""

    def __init__(self, fill=lambda g, hooks: None):
        self.grounds: list[Ground] = []
        self.fill = fill

    def __call__(self, g: Ground) -> Wired:
        self.grounds.append(g)
        hooks = Hooks()
        self.fill(g, hooks)
        return Wired(hooks, [])


def test_the_wiring_gets_the_daemons_own_values_once_and_no_audit_dir_is_a_null_audit(tmp_path, caplog):
    wire = Wiring()
    with caplog.at_level(logging.ERROR):
        d = Daemon(config(tmp_path, audit=False), wire)
    try:
        (g,) = wire.grounds
        assert isinstance(d.audit, NullAudit) and g.audit is d.audit
        assert (g.loop, g.client, g.session, g.shards, g.placement, g.ownership, g.keyring, g.keys) == \
            (d.loop, d.client, d.session, d.shards, d.placement, d.ownership, d.keyring, d.keys)
        assert g.stopping() is False and g.status()["agent"] == "a1"
        # the unusable keys file: one message per problem, from the one load
        assert [r.getMessage() for r in caplog.records] == ["signing keys unusable: no push or stored job will be accepted"]
        assert len(d.keyring) == 0
    finally:
        d.client.close()


def test_the_audit_log_is_open_before_the_parts_and_records_the_config_and_the_keyring_once(tmp_path):
    d = Daemon(config(tmp_path, audit=True), Wiring())
    try:
        assert isinstance(d.audit, AuditLog)
    finally:
        d.client.close()
        d.audit.close()
    recs = [rec for _, rec in records(f"{tmp_path}/audit", Filter())]
    assert [(r["type"], r.get("event")) for r in recs] == [("config", None), ("config", "signing_keys_unusable")]


def test_a_shard_acquired_updates_ownership_before_any_listener_hears_of_it(tmp_path):
    heard: list = []

    class Listener:
        def shard_acquired(self, fence: Fence) -> None:
            heard.append(("acquired", fence.shard, d.ownership.owned))

        def shard_lost(self, shard: int, reason: str) -> None:
            heard.append(("lost", shard, d.ownership.owned))

    d = Daemon(config(tmp_path, audit=False), Wiring(lambda g, hooks: hooks.shard_listeners.append(Listener())))
    try:
        fence = Fence(2, d.keys.shard(2), 7)
        d.shards.mine[2] = fence
        d._shard_acquired(fence)
        del d.shards.mine[2]
        d._shard_lost(2, "released")
        assert heard == [("acquired", 2, frozenset({2})), ("lost", 2, frozenset())]
    finally:
        d.client.close()


def test_status_sections_come_from_the_hooks_in_the_order_the_wiring_registered_them(tmp_path):
    def fill(g, hooks):
        hooks.status_providers["b"] = lambda: 1
        hooks.status_providers["a"] = lambda: 1 / 0

    d = Daemon(config(tmp_path, audit=False), Wiring(fill))
    try:
        doc = d.status()
        assert list(doc)[-2:] == ["b", "a"]
        assert doc["b"] == 1 and doc["a"] == {"error": "division by zero"}   # status always answers
    finally:
        d.client.close()
