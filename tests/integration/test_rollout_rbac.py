"""Issue 54, acceptance 5: staged rollouts hold against a gateway's own etcd credentials.

A TLS etcd with authentication and one user per agent, made by the shipped
packaging/debian/examples/etcd-rbac.sh as an operator would: each agent may write only its
own rollout keys (``rollouts/<agent>/``) and read everyone's. A forger holding g1's
credentials (a compromised gateway) tries what broke the shared keys before: deleting the
others' claims, abort marks and failed outcomes, writing claims and starts in their name,
and a claim of its own naming another agent and its lease. Each attempt on another agent's
keys is refused (permission denied); the honest agents' runs, judged by their own side
effects, never overlap beyond ``max_concurrent``, and an abort stays an abort."""

from __future__ import annotations

import json
import threading

import pytest

from agent.config import EtcdConfig, TLSConfig
from agent.coordination.etcd import EtcdClient, EtcdError, EtcdUnavailable
from agent.coordination.keys import Keys, shard_of
from agent.demo.services import EtcdServer, make_pki
from agent.jobs import rollout as ro
from tests.support import history
from tests.support.rollouts import Fleet, running_at_once
from tests.support.waiting import wait_for

K = Keys("t")
AGENTS = ("g1", "g2", "g3", "g4")
PASSWORDS = {a: f"{a}-etcd-pw" for a in AGENTS}


@pytest.fixture
def pki(tmp_path):
    return make_pki(str(tmp_path / "pki"))


@pytest.fixture
def rbac_etcd(tmp_path, pki):
    with EtcdServer(str(tmp_path / "etcd"), tls=pki) as srv:
        srv.enable_auth("root-pw")
        for a in AGENTS:
            assert srv.add_agent("t", a, PASSWORDS[a]) == f"agent.t.{a}"
        srv.add_ops("cloud", "cloud-etcd-pw", "t")
        yield srv


def as_agent(srv, pki, agent: str) -> EtcdClient:
    return EtcdClient(EtcdConfig(endpoints=[srv.endpoint], request_timeout_s=3.0, tls=TLSConfig(ca=pki.ca),
                                 username=f"agent.t.{agent}", password=PASSWORDS[agent]))


def denied(op) -> bool:
    """True when etcd refuses ``op`` for its permissions; False when it was done."""
    try:
        op()
    except EtcdUnavailable:
        raise
    except EtcdError as e:
        assert "permission denied" in str(e).lower(), e
        return True
    return False


def fleet_of(srv, pki, tmp_path, **kw) -> Fleet:
    return Fleet(srv, tmp_path, etcd_access={"tls": {"ca": pki.ca}, "username": "cloud",
                                             "password": "cloud-etcd-pw"}, **kw)


def start(fleet: Fleet, agent: str) -> None:
    fleet.start(agent, etcd={"username": f"agent.t.{agent}", "password": PASSWORDS[agent]})


def test_an_agents_credentials_cannot_delete_or_forge_another_agents_rollout_keys(rbac_etcd, pki):
    g1, g2 = as_agent(rbac_etcd, pki, "g1"), as_agent(rbac_etcd, pki, "g2")
    base = "20261207T120000.000Z"
    theirs = K.rollout_firing("g2", 1, "fw", base)
    mark = K.rollout_aborted("g2", 1, "fw")
    doc = json.dumps({"agent": "g2", "fire_id": f"{base}@g2", "state": "failed"})
    for key in (theirs + ro.CLAIM, theirs + ro.START, theirs + ro.OUTCOME, mark):
        g2.put(key, doc)
    try:
        # everyone reads every agent's keys (what the rollout is derived from) ...
        assert g1.get(theirs + ro.CLAIM) is not None and len(g1.get_prefix(K.rollouts_prefix())[0]) == 4
        # ... and writes only its own
        for key in (theirs + ro.CLAIM, theirs + ro.START, theirs + ro.OUTCOME, mark):
            assert denied(lambda: g1.delete(key)), key
            assert denied(lambda: g1.put(key, "forged")), key
        assert denied(lambda: g1.put(K.rollout_firing("g3", 1, "fw", base) + ro.CLAIM, "forged"))
        assert denied(lambda: g1.put(K.rollouts_prefix() + "x", "forged"))   # outside any agent's prefix
        assert denied(lambda: g1.put(K.rollout_firing("g", 1, "fw", base) + ro.CLAIM, "x"))  # a prefix of g1's name
        from agent.coordination.etcd import Delete
        assert denied(lambda: g1.txn([], [Delete(K.rollouts_prefix(), K.rollouts_prefix()[:-1] + "0")], []))
        assert {kv.key for kv in g2.get_prefix(K.rollouts_prefix())[0]} == \
            {theirs + ro.CLAIM, theirs + ro.START, theirs + ro.OUTCOME, mark}
        # nor reach them through g2's session lease: revoking it (its claim would go at
        # once, its run not yet) or binding a key of its own to it
        lease, _ = g2.lease_grant(30)
        g2.put(theirs + ro.CLAIM, "{}", lease=lease)
        assert denied(lambda: g1.lease_revoke(lease))
        assert denied(lambda: g1.put(K.rollout_firing("g1", 1, "fw", base) + ro.CLAIM, "{}", lease=lease))
        assert g2.get(theirs + ro.CLAIM).lease == lease   # type: ignore[union-attr]
        # its own keys and the rest of the cluster's prefix: as before
        mine = K.rollout_firing("g1", 1, "fw", base) + ro.CLAIM
        assert not denied(lambda: g1.put(mine, "{}")) and not denied(lambda: g1.delete(mine))
        assert not denied(lambda: g1.put(K.prefix + "probe", "1")) and not denied(lambda: g1.delete(K.prefix + "probe"))
    finally:
        g1.close()
        g2.close()


class Forger(threading.Thread):
    """g1's credentials, in a loop until stopped: delete every rollout key of the job it can
    see, write claims and starts into other agents' prefixes, and claims and starts of its
    own that name another agent (with that agent's session lease where etcd lets it)."""

    def __init__(self, client: EtcdClient, job: str):
        super().__init__(daemon=True)
        self.client, self.job = client, job
        self.stop_ = threading.Event()
        self.refused = 0
        self.done: list[str] = []      # what etcd let it do to another agent's keys (must stay empty)
        self.own = 0
        self.errors: list[str] = []

    def run(self) -> None:
        shard = shard_of(self.job, 4)
        while not self.stop_.wait(0.05):
            try:
                kvs, _ = self.client.get_prefix(K.rollouts_prefix())
                members = {kv.key.rsplit("/", 1)[-1]: int(json.loads(kv.value).get("lease") or "0", 16)
                           for kv in self.client.get_prefix(K.members_prefix())[0]}
                bases = set()
                for kv in kvs:
                    where = K.split_rollout_key(kv.key)
                    if where is None or where[2] != self.job:
                        continue
                    if "/" in where[3]:
                        bases.add(where[3].split("/")[0])
                    if where[0] == "g1":
                        continue
                    if denied(lambda: self.client.delete(kv.key)):
                        self.refused += 1
                    else:
                        self.done.append(f"delete {kv.key}")
                for base in bases:
                    for victim, lease in members.items():
                        if victim == "g1":
                            continue
                        forged = json.dumps({"agent": victim, "fire_id": f"{base}@{victim}", "at": 0})
                        theirs = K.rollout_firing(victim, shard, self.job, base)
                        for name in (ro.CLAIM, ro.START):
                            if denied(lambda: self.client.put(theirs + name, forged)):
                                self.refused += 1
                            else:
                                self.done.append(f"put {theirs + name}")
                        mine = K.rollout_firing("g1", shard, self.job, base) + ro.CLAIM
                        if denied(lambda: self.client.put(mine, forged, lease=lease)):
                            self.client.put(mine, forged)   # (etcd refuses a lease whose keys it may not write)
                        self.client.delete(mine)            # its own place: gone again at once
                        self.own += 1
            except EtcdUnavailable:
                continue
            except Exception as e:   # noqa: BLE001 (reported by the test)
                self.errors.append(repr(e))
                return


def test_a_forger_with_one_agents_credentials_cannot_make_runs_overlap_beyond_max_concurrent(rbac_etcd, pki,
                                                                                             tmp_path):
    honest = AGENTS[1:]
    fleet = fleet_of(rbac_etcd, pki, tmp_path)
    forger = Forger(as_agent(rbac_etcd, pki, "g1"), "fw-rbac")
    try:
        for a in honest:
            start(fleet, a)
        wait_for(lambda: fleet.c.members() == set(honest), 60, what="3 members")
        forger.start()
        fleet.push("fw-rbac", {"max_concurrent": 1}, sleep="1")
        wait_for(lambda: set(fleet.finals("fw-rbac")) == set(honest), 90, interval=0.3, what="every agent ran")
        forger.stop_.set()
        forger.join(10)
        assert {r["state"] for r in fleet.finals("fw-rbac").values()} == {"succeeded"}
        effects = [se for se in history.parse_effects(fleet.out) if se.job == "fw-rbac"]
        assert sorted(se.agent for se in effects) == sorted(honest)
        assert running_at_once(effects, {}) == 1, sorted((se.agent, se.start, se.end) for se in effects)
        print(f"\nforger: {forger.refused} writes on other agents' keys refused, {forger.own} own claims made "
              f"and deleted")
        assert forger.errors == [] and forger.done == [] and forger.refused > 0 and forger.own > 0
    finally:
        forger.stop_.set()
        fleet.close()


def test_a_forger_with_one_agents_credentials_cannot_undo_an_abort(rbac_etcd, pki, tmp_path):
    first, *later = AGENTS[1:]
    fleet = fleet_of(rbac_etcd, pki, tmp_path, failing={first})
    g1 = as_agent(rbac_etcd, pki, "g1")
    try:
        start(fleet, first)   # alone: its failure aborts the rollout before the others join
        wait_for(lambda: fleet.c.members() == {first}, 60, what="the first member")
        fleet.push("fw-undo", {"max_concurrent": 1, "abort": {"failed_pct": 50, "min_finished": 1}}, sleep="0.2")
        shard = shard_of("fw-undo", 4)
        mark = K.rollout_aborted(first, shard, "fw-undo")
        wait_for(lambda: fleet.c.client.get(mark) is not None, 60, what="the abort mark")
        outcome = next(kv.key for kv in fleet.c.client.get_prefix(K.rollouts_prefix(first))[0]
                       if kv.key.endswith("/" + ro.OUTCOME))
        base = K.split_rollout_key(outcome)[3].split("/")[0]   # type: ignore[index]
        # the forger removes the mark and the failed outcome, and rewrites it as a success
        assert denied(lambda: g1.delete(mark)) and denied(lambda: g1.delete(outcome))
        assert denied(lambda: g1.put(outcome, json.dumps({"agent": first, "fire_id": f"{base}@{first}",
                                                          "state": "succeeded"})))
        # successes of its own (all it can add) do not bring the failed share under 50 %
        ok = json.dumps({"agent": "g1", "fire_id": f"{base}@g1", "state": "succeeded"})
        g1.put(K.rollout_firing("g1", shard, "fw-undo", base) + ro.OUTCOME, ok)
        for a in later:
            start(fleet, a)
        wait_for(lambda: set(fleet.finals("fw-undo")) == {first, *later}, 60, what="every agent final")
        finals = fleet.finals("fw-undo")
        assert finals[first]["state"] == "failed" and {finals[a]["state"] for a in later} == {"aborted"}
        assert [se.agent for se in history.parse_effects(fleet.out)
                if se.job == "fw-undo" and ro.rolled_back(se.fire_id) is None] == [first]
        assert fleet.c.client.get(mark) is not None
    finally:
        g1.close()
        fleet.close()
