"""Health and lease decisions from kernel signals, end to end (issue 7, acceptance 1 and 2):
real etcd, real agents, real BCC, nftables blackholes in tables of our own."""

from __future__ import annotations

import collections
import json
import shutil
import socket
import threading
import time

import pytest

from agent.daemon.admin import query
from tests.support import history
from tests.support.cluster import Cluster
from tests.support.history import read_history
from tests.support.kernel import bpf_ok, require_kernel
from tests.support.network import NftBlock
from tests.support.waiting import wait_for

CONNECT = ("import socket, sys\n"
           "s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)\n"
           "s.sendall(b'ping'); s.recv(16)\n")


def net_template(host: str, port: int) -> dict:
    return {"argv": ["/usr/bin/python3", "-c", CONNECT, host, str(port)], "user": "nobody",
            "allow_exec": ["/usr/bin/python3*"], "network": "any",   # its target is on this host
            "health": {"stall_age_s": 2.0, "retrans_per_s_stalled": 100.0, "retrans_per_s_degraded": 50.0}}


class EchoServer:
    """A healthy TCP target on loopback."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.sendall(conn.recv(16))
                except OSError:
                    pass

    def close(self):
        self.sock.close()


@pytest.fixture
def kernel_ready():
    ok, why = bpf_ok()
    require_kernel(ok, f"BPF unavailable: {why}")
    require_kernel(shutil.which("nft") is not None, "nftables (nft) is not installed")


def test_etcd_blackhole_pauses_runs_before_the_renew_deadline(etcd_server, tmp_path, kernel_ready):
    echo = EchoServer()
    tpl = {"tick": {"argv": ["/bin/true"], "user": "nobody", "allow_exec": ["/bin/true"]}}
    c = Cluster(etcd_server, str(tmp_path / "agents"), ttl=8, renew_deadline=5, retry_period=0.5,
                extra={"templates": tpl})
    try:
        c.start("peer")
        cut = c.start("cut", endpoint_host="127.0.0.2", extra={"bpf": {"enabled": True}})
        wait_for(lambda: c.converged({"peer": 1, "cut": 1}), 60, what="plan")
        store = c.job_store()
        for i in range(24):
            store.create({"v": 1, "id": f"tick-{i}", "template": "tick", "params": {},
                          "schedule": {"cron": "* * * * * *"}})
        time.sleep(3)
        with NftBlock("127.0.0.2", etcd_server.port):
            t0 = time.monotonic()
            st = wait_for(lambda: (lambda s: s if s["health"]["runs_paused"] or s["session"]["fenced"] else None)(
                query(cut.config["admin"]["socket"])), 10, interval=0.02, what="pause or fence")
            t_pause = time.monotonic() - t0
            # the kernel saw the etcd path stall: runs paused while the session was still valid
            assert st["health"]["runs_paused"] and not st["session"]["fenced"], st
            print(f"\nruns paused {t_pause:.3f} s after the blackhole (renew deadline 5 s)")
            wait_for(lambda: "cut" not in c.counts(), 20, what="shards to move to the peer")
        wait_for(lambda: c.counts().get("cut", 0) > 0, 30, what="cut agent to come back")
        time.sleep(2)
        # no firing was ever started by two agents: every run key got its `running` put
        # (attempt 1) from exactly one agent, as the whole etcd history shows
        starts: dict[str, set] = {}
        for ev in read_history(c.client, c.keys.runs_prefix()):
            if ev.kind == "put":
                r = json.loads(ev.value)
                if r["state"] == "running" and r["attempt"] == 1:
                    starts.setdefault(ev.key, set()).add(r["agent"])
        assert starts and all(len(a) == 1 for a in starts.values())
        assert {a for s in starts.values() for a in s} == {"peer", "cut"}
    finally:
        c.close()
        echo.close()


def test_stalled_job_network_is_retried_then_quarantines_the_job_not_the_agent(etcd_server, tmp_path, kernel_ready):
    """Issue 54: a job whose runs stall on the network is the job's problem. Its runs are
    ended network_stall and retried; after 3 stalls the job is quarantined on that agent
    (its retry waits, reason quarantined) and the agent keeps every shard."""
    echo = EchoServer()
    c = Cluster(etcd_server, str(tmp_path / "agents"), ttl=4, renew_deadline=2.5, retry_period=0.5)
    try:
        sick = c.start("sick", extra={"bpf": {"enabled": True}, "templates": {"net": net_template("127.0.0.3", echo.port)}})
        wait_for(lambda: c.converged({"sick": 1}), 60, what="sick owns all shards")
        _, rev0 = c.client.get_prefix(c.keys.shards_prefix())
        store = c.job_store()
        with NftBlock("127.0.0.3", echo.port):
            for i in range(3):
                store.create({"v": 1, "id": f"net-{i}", "template": "net", "params": {}, "schedule": {},
                              "retry": {"max_attempts": 6, "backoff_s": 0.5, "max_backoff_s": 2, "jitter": 0}})
            # its runs stall, are ended with network_stall and retried; the third stall quarantines the job
            wait_for(lambda: {r["job"] for r in c.audit("sick") if r.get("type") == "quarantine"
                              and r.get("event") == "quarantined"} == {"net-0", "net-1", "net-2"},
                     90, interval=0.5, what="the three jobs quarantined")
            quarantined = [r for r in c.audit("sick") if r.get("type") == "quarantine" and r.get("event") == "quarantined"]
            assert {r["cause"] for r in quarantined} == {"network_stall"} and all(r["strikes"] == 3 for r in quarantined)
            # the retry of each waits, reason quarantined, with a status and a waiting mark
            wait_for(lambda: {d["job_id"] for d in c.statuses("sick")
                              if d["state"] == "waiting" and d.get("reason") == "quarantined"} == {"net-0", "net-1", "net-2"},
                     30, interval=0.5, what="waiting statuses")
            marks, _ = c.client.get_prefix(c.keys.waiting_prefix())
            assert sorted(json.loads(kv.value)["reason"] for kv in marks) == ["quarantined"] * 3
            stalls = [r for r in c.run_records().values() if "network_stall" in (r.get("reason") or "")]
            assert stalls and all(r["state"] == "retrying" for r in c.run_records().values())
            # the agent kept its shards: nothing left it in etcd's history, and it never said it was unavailable
            assert c.counts() == {"sick": c.shards}
            for ev in history.read_history(c.client, c.keys.prefix):
                if ev.rev > rev0 and ev.key.startswith(c.keys.shards_prefix()):
                    assert ev.kind == "put" and ev.value == b"sick", ev
            st = query(sick.config["admin"]["socket"])
            assert st["health"]["handoff"]["available"] is True
            assert st["quarantine"]["quarantined"] == 3
            assert not [r for r in c.audit("sick") if r.get("type") == "lease" and r.get("decision") == "hand_off"]
    finally:
        c.close()
        echo.close()


# Issue 54, acceptance 1: `make test` runs 36 s of violations; MILLWRIGHT_SLOW=1 the 2 minutes
# of the acceptance (or MILLWRIGHT_QUARANTINE_TEST_S seconds).
QUARANTINE_S = float(__import__("os").environ.get(
    "MILLWRIGHT_QUARANTINE_TEST_S", "120" if __import__("os").environ.get("MILLWRIGHT_SLOW") else "36"))


def test_a_job_violating_its_exec_policy_on_every_agent_leaves_every_shard_owned(etcd_server, tmp_path, kernel_ready):
    """A fan-out job execs a binary its template does not allow every 2 s on both agents
    (real BPF exec audit, enforce: each run is killed). Each agent quarantines that job
    (statuses, waiting marks, audit; released after hold_s and quarantined again on the
    next offence, the hold doubled); no agent hands a shard off, and an unrelated 1 s
    cron job keeps firing."""
    from agent.coordination.keys import shard_of
    from agent.runtime.timefmt import parse_rfc3339

    tpl = {"bad": {"argv": ["/bin/sh", "-c", "/bin/true; sleep 0.5"], "user": "nobody", "allow_exec": []},
           "tick": {"argv": ["/bin/true"], "user": "nobody", "allow_exec": ["/bin/true"]}}
    c = Cluster(etcd_server, str(tmp_path / "agents"), ttl=4, renew_deadline=2.5, retry_period=0.5,
                extra={"templates": tpl, "bpf": {"enabled": True}, "labels": {"line": "1"},
                       "quarantine": {"hold_s": 8.0, "max_hold_s": 30.0},
                       "retention": {"keep_runs": 1000}})
    agents = ("a", "b")
    try:
        for name in agents:
            c.start(name)
        wait_for(lambda: c.converged({n: 1 for n in agents}), 60, what="plan")
        _, rev0 = c.client.get_prefix(c.keys.prefix)
        store = c.job_store()
        store.create({"v": 1, "id": "tick", "template": "tick", "params": {}, "schedule": {"cron": "* * * * * *"}})
        store.create({"v": 1, "id": "bad", "template": "bad", "params": {}, "schedule": {"cron": "*/2 * * * * *"},
                      "target": {"labels": {"line": "1"}, "fanout": True}})
        t0 = time.time()
        owned_min, marks_seen = c.shards, set()
        while time.time() < t0 + QUARANTINE_S:
            owned_min = min(owned_min, len(c.owners()))
            kvs, _ = c.client.get_prefix(c.keys.waiting_prefix())
            marks_seen |= {(m["agent"], m["job_id"], m["reason"]) for m in (json.loads(kv.value) for kv in kvs)}
            time.sleep(0.5)
        t1 = time.time()
        # every shard stayed owned by its planned agent: no shard key changed after the plan
        # converged, and no member record ever said unavailable
        moves, unavailable = [], []
        for ev in history.read_history(c.client, c.keys.prefix):
            if ev.rev <= rev0:
                continue
            if ev.key.startswith(c.keys.shards_prefix()):
                moves.append((ev.kind, ev.key, ev.value))
            elif ev.key.startswith(c.keys.members_prefix()) and ev.kind == "put":
                if json.loads(ev.value).get("available") is False:
                    unavailable.append(ev.key)
        assert moves == [] and unavailable == [] and owned_min == c.shards
        assert c.converged({n: 1 for n in agents})
        assert not [r for r in c.audit() if r.get("type") == "lease" and r.get("decision") == "hand_off"]
        ran: dict = {}
        # the offending job ran, was killed for its exec and quarantined on each agent
        for name in agents:
            audit = c.audit(name)
            kills = [r for r in audit if r.get("type") == "policy_violation" and r.get("job") == "bad"]
            held = [r for r in audit if r.get("type") == "quarantine" and r.get("event") == "quarantined"]
            released = [r for r in audit if r.get("type") == "quarantine" and r.get("event") == "released"]
            assert kills and {k["action"] for k in kills} == {"killed"}, name
            assert held and {r["job"] for r in held} == {"bad"} and {r["cause"] for r in held} == {"exec_policy"}
            assert held[0]["strikes"] == 3 and held[0]["hold_s"] == 8.0
            if len(held) > 1:   # released after its hold, one offence quarantined it again, for twice as long
                assert released[0]["why"] == "expired" and held[1]["hold_s"] == 16.0 and held[1]["strikes"] == 1
            waits = [d for d in c.statuses(name) if d["job_id"] == "bad" and d["state"] == "waiting"]
            assert waits and {d["reason"] for d in waits} == {"quarantined"}, name
            assert (name, "bad", "quarantined") in marks_seen
            st = query(c.agents[name].config["admin"]["socket"])
            assert st["health"]["handoff"]["available"] is True
            # held means held: 3 runs struck it out, then one after each release (and one
            # more if the test ended between a release and that run's end)
            started = [r for r in c.run_records().values() if r["job_id"] == "bad" and r["agent"] == name
                       and r.get("started_at")]
            assert len(held) + 2 <= len(started) <= len(held) + 3, (name, len(started), len(held))
            ran[name] = len(started)
        # the unrelated 1 s job kept firing through the violations
        recs = [r for r in c.job_runs("tick").values() if t0 + 2 <= parse_rfc3339(r["due"]).timestamp() <= t1 - 2]
        dues = sorted(parse_rfc3339(r["due"]).timestamp() for r in recs)
        slices = {int((d - t0) // 5) for d in dues}
        assert slices >= set(range(1, int((t1 - 2 - t0) // 5))), (sorted(slices), len(dues))
        # lateness: the kernel's time of the job's own exec (its audit exec record) minus the due time
        due_of = {r["fire_id"]: parse_rfc3339(r["due"]).timestamp() for r in recs}
        exec_at: dict = {}
        for r in c.audit():
            if r.get("type") == "exec" and r.get("job") == "tick" and r.get("filename") == "/bin/true" \
                    and r.get("fire_id") in due_of and r.get("exec_ts"):
                exec_at[r["fire_id"]] = min(exec_at.get(r["fire_id"], r["exec_ts"]), r["exec_ts"])
        late = [exec_at[f] - due_of[f] for f in exec_at]
        assert late, "no exec of the tick job was audited"
        bad_runs = [r for r in c.run_records().values() if r["job_id"] == "bad"]
        print(f"\n{t1 - t0:.0f} s of exec violations every 2 s on {len(agents)} agents: shards owned min "
              f"{owned_min}/{c.shards}, shard moves {len(moves)}; tick firings {len(dues)} of "
              f"{int(t1 - 2) - int(t0 + 2)}, lateness (exec - due) max {max(late):.3f} s, "
              f"mean {sum(late) / len(late):.3f} s over {len(late)}; "
              f"bad firings {len(bad_runs)} ({dict(collections.Counter(r['state'] for r in bad_runs))}), started {ran}, "
              f"quarantines "
              f"{ {n: sum(1 for r in c.audit(n) if r.get('type') == 'quarantine' and r.get('event') == 'quarantined') for n in agents} }; "
              f"tick shard {shard_of('tick', c.shards)}")
    finally:
        c.close()


# `make test` flaps for 30 s (10 drops); `make test-release` runs the 5 minutes of the
# acceptance (MILLWRIGHT_FLAP_TEST_S=300): the hysteresis is the same, the longer run only
# gives a slow drift more time to show.
FLAP_S = float(__import__("os").environ.get("MILLWRIGHT_FLAP_TEST_S", "30"))


def test_a_flapping_link_causes_at_most_one_hand_off_in_five_minutes(etcd_server, tmp_path, kernel_ready):
    """Acceptance 4: the agent's links (etcd path and the jobs' target) drop for 200 ms
    every 3 s for 5 minutes (make test-release; make test: 30 s) while jobs keep
    running; hysteresis allows at most one hand-off."""
    import glob
    import os

    echo = EchoServer()
    tpl = {"net": net_template("127.0.0.3", echo.port),
           "tick": {"argv": ["/bin/true"], "user": "nobody", "allow_exec": ["/bin/true"]}}
    c = Cluster(etcd_server, str(tmp_path / "agents"), ttl=8, renew_deadline=5, retry_period=0.5,
                extra={"templates": tpl})
    try:
        c.start("steady", extra={"templates": {**tpl, "net": net_template("127.0.0.1", echo.port)}})
        flappy = c.start("flappy", endpoint_host="127.0.0.2", extra={"bpf": {"enabled": True}})
        wait_for(lambda: c.converged({"steady": 1, "flappy": 1}), 60, what="plan")
        kvs, rev0 = c.client.get_prefix(c.keys.shards_prefix())
        planned = {kv.key for kv in kvs if kv.value == b"flappy"}
        store = c.job_store()
        for i in range(16):
            store.create({"v": 1, "id": f"flap-net-{i}", "template": "net", "params": {},
                          "schedule": {"cron": "*/2 * * * * *"}, "overlap": "forbid",
                          "retry": {"max_attempts": 2, "backoff_s": 0.5}})
            store.create({"v": 1, "id": f"flap-tick-{i}", "template": "tick", "params": {},
                          "schedule": {"cron": "* * * * * *"}})
        end = time.monotonic() + FLAP_S
        drops = 0
        while time.monotonic() < end:
            with NftBlock("127.0.0.2", etcd_server.port), NftBlock("127.0.0.3", echo.port):
                time.sleep(0.2)
            drops += 1
            time.sleep(2.8)
        time.sleep(2)
        decisions = collections.Counter()
        for path in glob.glob(os.path.join(flappy.config["audit"]["dir"], "audit-*.jsonl")):
            for line in open(path):
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                # (a busy host's CPU pressure makes keepalives fast too: not the link's doing)
                if r.get("type") == "lease" and r.get("event") == "decision" and r.get("reason") != "cpu_pressure":
                    decisions[r["decision"]] += 1
        # hand-offs as etcd saw them (not as the agent says): over the whole history since the
        # plan converged, how often flappy went from holding all its planned shards to
        # holding fewer (a hand-off, a self-fence or an expired lease alike)
        held, whole, handoffs = set(planned), True, 0
        for ev in history.read_history(c.client, c.keys.prefix):
            if ev.rev <= rev0 or not ev.key.startswith(c.keys.shards_prefix()):
                continue
            if ev.kind == "delete" and ev.key in held:
                held.discard(ev.key)
                handoffs += whole
                whole = False
            elif ev.kind == "put" and ev.value == b"flappy":
                held.add(ev.key)
                whole = whole or held >= planned
        print(f"\n{drops} link drops of 200 ms over {FLAP_S:.0f} s: {handoffs} hand-off(s) in etcd; "
              f"the agent's decisions {dict(decisions)}")
        # the flaps were seen (the lease policy reacted), so the link really was disturbed
        assert decisions["pause_runs"] + decisions["renew_fast"] > 0, dict(decisions)
        assert handoffs <= 1, (handoffs, dict(decisions))
        # the test really flapped the link (at least half the planned rate on a loaded machine)
        assert drops >= FLAP_S / 6
        assert flappy.alive()
    finally:
        c.close()
        echo.close()
