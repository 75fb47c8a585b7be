"""Issue 17 end to end with real `millwright run` agents, a real mosquitto and a real etcd:
an answer for every push whoever dies, a final status that outlives its agent's outbox,
jobs/get across a takeover, and the operator verbs (jobs list/show, runs, logs -f)."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid

import pytest
import yaml

from agent.cloud.asking import Asker
from agent.cloud.ingest import push_digest
from tests.support.cloudkit import KID, TEMPLATES, job_doc, signed
from agent.config import MqttConfig
from agent.coordination.keys import shard_of
from tests.support.commands import millwright, millwright_env
from tests.support.cloud import T, CloudWorld, Pusher
from tests.support.waiting import wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARDS = 8
TICK = {"argv": ["/bin/sh", "-c", "for i in 1 2 3 4 5 6 7 8; do echo tick $i; sleep 0.5; done; "
                 "echo why-it-failed >&2; exit 3"], "params": {}, "user": "root", "allow_root": True,
        "allow_exec": ["/bin/sh", "/bin/dash", "/usr/bin/dash", "/bin/sleep", "/usr/bin/sleep"]}
FAIL = {"argv": ["/bin/sh", "-c", "echo out; echo boom-on-stderr >&2; exit 3"], "params": {}, "user": "root", "allow_root": True,
        "allow_exec": ["/bin/sh", "/bin/dash", "/usr/bin/dash"]}


@pytest.fixture
def world(etcd_server, mosquitto_server, tmp_path):
    w = CloudWorld(etcd_server, mosquitto_server, tmp_path, {**TEMPLATES, "tick": TICK, "fail": FAIL}, SHARDS)
    yield w
    w.close()


def asker(world) -> Asker:
    """A cloud-side jobs/get client signing with the cluster's key."""
    a = Asker(MqttConfig(url=world.mq.url), "t", world.ring, KID)
    assert a.start(10), "the asker could not connect"
    return a


def _two_agents(world):
    a1 = world.cluster.start("a1")
    a2 = world.cluster.start("a2")
    wait_for(lambda: world.cluster.converged({"a1": 1.0, "a2": 1.0}), 40, what="two agents share the shards as planned")
    for aid in ("a1", "a2"):
        assert world.col.wait(lambda m: any(t == T.presence(aid) and d.get("state") == "online"
                                            for _, t, d in m), 30)
    return a1, a2


def _ids_on(owners: dict, agent: str, prefix: str, n: int) -> list[str]:
    out, i = [], 0
    while len(out) < n:
        j = f"{prefix}-{i}"
        if owners[shard_of(j, SHARDS)] == agent:
            out.append(j)
        i += 1
    return out


def test_every_push_is_answered_when_an_agent_dies_for_good(world):
    """Acceptance 1: 300 signed pushes + 6 bad ones to 2 agents, one kill -9'd mid-stream."""
    from agent.jobs.signing import KeyRing, generate_hmac_secret, sign

    a1, a2 = _two_agents(world)
    owners = world.cluster.owners()
    ids = [f"ans-{i:04d}" for i in range(300)]
    payloads = [signed(job_doc(j, line=str(i % 100)), world.ring) for i, j in enumerate(ids)]
    other = KeyRing.from_mapping({KID: {"alg": "hmac-sha256", "secret": generate_hmac_secret()}})
    unknown = KeyRing.from_mapping({"cloud-9": {"alg": "hmac-sha256", "secret": generate_hmac_secret()}})
    ut, bp = _ids_on(owners, "a1", "ut", 1)[0], _ids_on(owners, "a1", "bp", 1)[0]  # the dying agent's shards
    bad = {
        "bad_json": (b"{not json", None),
        "unknown_template": (signed(job_doc(ut, template="rm-rf"), world.ring), ut),
        "bad_param": (signed(job_doc(bp, line="x"), world.ring), bp),
        "bad_signature": (signed(job_doc("bsig"), other), "bsig"),
        "unsigned": (json.dumps(job_doc("nosig")).encode(), "nosig"),
        "unknown_kid": (json.dumps(sign(job_doc("ukid"), unknown, "cloud-9")).encode(), "ukid"),
    }
    authenticated = {"unknown_template", "bad_param"}
    pusher = Pusher(world.mq.url, "answers-pusher")
    kill = {}

    def accepted_ids():
        return {d["job_id"] for d in world.col.docs("accepted")}

    try:
        for p in payloads[:150]:
            pusher.push(p)
        assert world.col.wait(lambda m: len(accepted_ids() & set(ids)) >= 60, 60)
        a1.kill()  # for good, with pushes in flight
        kill["t"] = time.monotonic()
        for p, _ in bad.values():  # right after the kill
            pusher.push(p)
        for p in payloads[150:]:
            pusher.push(p)

        want_rej = {push_digest(p): reason for reason, (p, _) in bad.items() if reason in authenticated}

        def done(_):
            rej = {d.get("push_sha256") for d in world.col.docs("rejected")}
            return set(ids) <= accepted_ids() and set(want_rej) <= rej
        ok = world.col.wait(done, 90)
        elapsed = time.monotonic() - kill["t"]
        missing = sorted(set(ids) - accepted_ids())
        assert ok, (len(missing), missing[:5])
        by_job: dict = {}
        for d in world.col.docs("accepted"):
            by_job.setdefault(d["job_id"], {})[(d["agent"], d["seq"], d.get("published_by"))] = d
        only_republished = by_peer_first = only_marked = 0
        for j in ids:
            msgs = list(by_job[j].values())
            unmarked = [m for m in msgs if not m.get("redelivery")]
            # at most one first answer: a copy is unmarked only when its marker says the
            # answer was never handed to the broker. An answer a1 stamped handed and died
            # before sending comes back only marked (the cloud dedupes on job_id and answer)
            assert len(unmarked) <= 1 and msgs, (j, msgs)
            assert all(m["answer"] == "accepted" for m in msgs), msgs
            only_marked += not unmarked
            for m in msgs:
                if m.get("published_by"):  # a peer published what the dead agent wrote
                    assert m["published_by"] == "a2" and m["agent"] == "a1", m
            if unmarked and unmarked[0].get("published_by"):
                by_peer_first += 1  # never handed to the broker by a1: a2's is the first answer
            only_republished += sum(1 for m in msgs if m.get("redelivery"))
        for d in world.col.docs("rejected"):
            if d.get("push_sha256") in want_rej:
                assert d["reason"] == want_rej[d["push_sha256"]], d
                assert d["detail"]
        # the answers of the dead agent's shards came from a2, and no marker is left behind
        wait_for(lambda: not world.cluster.client.get_prefix(world.cluster.keys.answers_prefix())[0], 30,
                 what="every answer marker cleared")
        last = max(ts for ts, _, d in world.col.messages if d.get("state") in ("accepted", "rejected"))
        print(f"\n300 + 6 pushes, a1 kill -9'd after {60}+ answers: all answered {last - kill['t']:.2f}s after the kill "
              f"(waited {elapsed:.2f}s); first answer published by a2 for {by_peer_first} jobs; "
              f"{only_republished} marked re-publications, {only_marked} jobs answered by those alone; "
              f"load {os.getloadavg()[0]:.1f}")
    finally:
        pusher.stop()


def test_final_status_reaches_the_cloud_from_a_peer(world):
    """Acceptance 2: a run ends, its agent is kill -9'd before its outbox drained (held by
    the test knob), and the final status still arrives, published by the new owner."""
    world.cluster.env = {"MILLWRIGHT_TEST_HOLD_OUTBOX": "1"}
    a1 = world.cluster.start("a1")
    world.cluster.env = {}
    a2 = world.cluster.start("a2")
    wait_for(lambda: world.cluster.converged({"a1": 1.0, "a2": 1.0}), 40, what="two agents share the shards as planned")
    jid = _ids_on(world.cluster.owners(), "a1", "final", 1)[0]
    doc = job_doc(jid, template="fail")
    doc["params"], doc["schedule"] = {}, {}
    pusher = Pusher(world.mq.url, "final-pusher")
    try:
        pusher.push(signed(doc, world.ring))
        keys = world.cluster.keys

        def final_record():
            recs = list(world.cluster.job_runs(jid).values())
            return recs and recs[-1]["state"] == "failed" and recs[-1]
        rec = wait_for(final_record, 60, what="the run's final record")
        assert "boom-on-stderr" in rec["stderr_tail"]
        markers, _ = world.cluster.client.get_prefix(keys.answers_prefix(shard_of(jid, SHARDS)))
        assert {kv.key.rsplit("/", 1)[1] for kv in markers} >= {"accepted", "run." + rec["fire_id"]}
        assert not [d for d in world.col.docs() if d.get("job_id") == jid]  # a1's outbox holds everything
        a1.kill()
        t0 = time.monotonic()
        assert world.col.wait(lambda m: any(d.get("job_id") == jid and d.get("state") == "failed"
                                            for d in world.col.docs()), 60)
        took = time.monotonic() - t0
        fin = [d for d in world.col.docs("failed") if d.get("job_id") == jid]
        assert len({d["seq"] for d in fin}) == 1
        d = fin[0]
        # never handed to the broker by a1: a2's publication is the first answer, unmarked
        assert d["published_by"] == "a2" and d["agent"] == "a1" and "redelivery" not in d
        assert d["exit_code"] == 3 and "boom-on-stderr" in d["stderr_tail"] and d["fire_id"] == rec["fire_id"]
        assert world.col.wait(lambda m: any(x.get("job_id") == jid and x.get("state") == "accepted"
                                            for x in world.col.docs()), 30)
        print(f"\nfinal status republished by a2 {took:.2f}s after a1's kill -9 (lease TTL 4 s); "
              f"load {os.getloadavg()[0]:.1f}")
        assert a2.alive()
    finally:
        pusher.stop()


def test_jobs_get_answers_and_waits_for_a_takeover(world):
    """Acceptance 3 (behaviour): the owner answers, under its own prefix; a job on a shard
    being taken over is answered by the new owner after the takeover; filters answer per
    owned shards; params only when the signed query asks for them."""
    a1, a2 = _two_agents(world)
    owners = world.cluster.owners()
    on1 = _ids_on(owners, "a1", "get1", 3)
    on2 = _ids_on(owners, "a2", "get2", 3)
    pusher = Pusher(world.mq.url, "get-pusher")
    ask = asker(world)
    try:
        for j in on1 + on2:
            pusher.push(signed(job_doc(j), world.ring))
        assert world.col.wait(lambda m: set(on1 + on2) <= {d["job_id"] for d in world.col.docs("accepted")}, 30)
        ans = ask.get(on2[0])
        assert ans["found"] and ans["agent"] == "a2" and ans["job"]["id"] == on2[0]
        assert ans["job"]["state"] == "scheduled" and ans["job"]["next_due"] == ans["job"]["doc"]["schedule"]["at"]
        assert "sig" not in ans["job"]["doc"] and "params" not in ans["job"]["doc"]
        assert ask.get(on2[0], include=["params"])["job"]["doc"]["params"] == {"line": "3"}
        ans = ask.get("no-such-job")
        assert ans["found"] is False and ans["agent"] == owners[shard_of("no-such-job", SHARDS)]
        got = ask.wait(ask.ask(flt={"template": "flush"}), n=2)
        assert {agent for agent, _, _ in got} == {"a1", "a2"}
        assert sorted(s for _, d, _ in got for s in d["shards"]) == list(range(SHARDS))
        assert {j["id"] for _, d, _ in got for j in d["jobs"]} == set(on1 + on2)
        assert all(d["next"] is None for _, d, _ in got)
        got = ask.wait(ask.ask(flt={"state": "running"}), n=2)
        assert len(got) == 2 and all(not d["jobs"] for _, d, _ in got)
        assert ask.forged == 0

        a1.kill()
        t_kill = time.monotonic()
        corr = ask.ask(job_id=on1[0])  # its shard's owner is dead: answered after the takeover
        got = ask.wait(corr, timeout=40)
        shard = shard_of(on1[0], SHARDS)
        assert got, (f"no answer after the takeover ({time.monotonic() - t_kill:.1f}s after the kill; the agents "
                     f"hold a request lease TTL + 5 s): shard {shard} is owned by "
                     f"{world.cluster.owners().get(shard)!r} now; load {os.getloadavg()[0]:.1f}; a2's log tail:\n"
                     + "\n".join(a2.log_text().splitlines()[-30:]))
        agent, ans, _ = got[0]
        t_ans = time.monotonic()
        assert agent == "a2" and ans["found"] and ans["job"]["id"] == on1[0]
        assert world.cluster.owners()[shard_of(on1[0], SHARDS)] == "a2"
        assert ask.get("../etc")["error"] == "bad_field"
        print(f"\njobs/get for a job on a dead agent's shard answered by a2 within {t_ans - t_kill:.2f}s of the kill "
              f"(lease TTL 4 s); load {os.getloadavg()[0]:.1f}")
    finally:
        ask.stop()
        pusher.stop()


def test_an_unsigned_jobs_get_gets_no_answer(world):
    """Issue 34, acceptance 3: a jobs/get that is unsigned, signed with another key, or bound
    to another cluster gets no answer from any agent (it is counted, audited and reported on
    an agent's `rejected` topic); the same question signed is answered."""
    from agent.cloud.asking import query_doc
    from agent.jobs.signing import KeyRing, generate_hmac_secret, sign

    _two_agents(world)
    other = KeyRing.from_mapping({KID: {"alg": "hmac-sha256", "secret": generate_hmac_secret()}})
    ask = asker(world)
    try:
        tries = {"unsigned": json.dumps(query_doc("t", "q-unsigned", flt={})).encode(),
                 "bad_signature": json.dumps(sign(query_doc("t", "q-forged", flt={}), other, KID)).encode(),
                 "wrong_cluster": ask.signed(query_doc("plant-b", "q-elsewhere", flt={})),
                 "wrong_kind": ask.signed(dict(query_doc("t", "q-kind", flt={}), kind="job"))}
        for payload in tries.values():
            assert ask.send(payload)
        signed_corr = ask.ask(flt={})
        assert len(ask.wait(signed_corr, n=2, timeout=30)) == 2  # both agents answer the signed one
        time.sleep(1.0)  # the unsigned ones went in first: had anyone answered, it would be here
        with ask.cond:
            assert set(ask.answers) == {signed_corr}, sorted(ask.answers)
        digests = {push_digest(p): reason for reason, p in tries.items()}
        assert world.col.wait(lambda m: {d.get("push_sha256") for _, t, d in m if T.kind(t) == "rejected"
                                         and d.get("kind") == "get"} >= set(digests), 20)
        for _, t, d in world.col.messages:
            if T.kind(t) == "rejected" and d.get("push_sha256") in digests:
                assert d["reason"] == digests[d["push_sha256"]] and set(d) == {"v", "state", "kind", "reason", "agent",
                                                                                 "ts", "push_sha256", "seq"}, d
        wait_for(lambda: {r.get("push_sha256") for r in world.cluster.audit() if r.get("kind") == "get"
                          and r.get("event") == "rejected_unauthenticated"} >= set(digests), 20,
                 what="an audit record of each unauthenticated jobs/get")
    finally:
        ask.stop()


def test_cli_jobs_runs_logs_against_a_running_cluster(world, tmp_path):
    """Acceptance 4: the operator verbs read etcd (and the run's directory), --json parses."""
    # a per-run agent id: its runs' cgroups (/millwright-<id>/) must not collide with another
    # test run's agent on this machine
    aid = "cli-" + uuid.uuid4().hex[:6]
    a1 = world.cluster.start(aid)
    wait_for(lambda: world.cluster.all_owned_by({aid}), 30, what="the agent owns all shards")
    assert world.col.wait(lambda m: any(t == T.presence(aid) and d.get("state") == "online"
                                        for _, t, d in m), 30)
    cfg = a1.config_path
    pusher = Pusher(world.mq.url, "cli-pusher")
    try:
        tick = job_doc("cli-tick", template="tick")
        tick["params"], tick["schedule"] = {}, {}
        pusher.push(signed(tick, world.ring))
        pusher.push(signed(job_doc("cli-later"), world.ring))
        wait_for(lambda: any(r["state"] == "running" for r in world.cluster.job_runs("cli-tick").values()), 60,
                 what="tick running")

        follow = subprocess.Popen([sys.executable, "-m", "agent", "logs", "-c", cfg, "cli-tick", "-f"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                  env=millwright_env())
        lines: "queue.Queue" = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(line) for line in follow.stdout], daemon=True)
        reader.start()
        first = lines.get(timeout=30)
        assert first.startswith("tick ")
        # still running when the first line arrived: -f follows a live run
        assert list(world.cluster.job_runs("cli-tick").values())[-1]["state"] == "running"
        assert follow.wait(60) == 0
        reader.join(10)
        err = follow.stderr.read()
        out = "".join(lines.get_nowait() for _ in range(lines.qsize()))
        recs = list(world.cluster.job_runs("cli-tick").values())
        assert first + out == "".join(f"tick {i}\n" for i in range(int(first.split()[1]), 9)) and "why-it-failed" in err, (err, [{k: r.get(k) for k in ("state", "reason", "exit_code", "stderr_tail")} for r in recs])

        r = millwright("jobs", "list", "-c", cfg, "--json")
        assert r.returncode == 0, r.stderr
        jobs = {j["id"]: j for j in json.loads(r.stdout)}
        assert jobs["cli-tick"]["state"] == "failed" and jobs["cli-later"]["state"] == "scheduled"
        r = millwright("jobs", "list", "-c", cfg, "--state", "scheduled", "--json")
        assert [j["id"] for j in json.loads(r.stdout)] == ["cli-later"]
        r = millwright("jobs", "list", "-c", cfg, "--template", "tick")
        assert r.returncode == 0 and "cli-tick" in r.stdout and "cli-later" not in r.stdout and "STATE" in r.stdout
        r = millwright("jobs", "show", "cli-tick", "-c", cfg, "--json")
        shown = json.loads(r.stdout)
        assert shown["runs"][-1]["exit_code"] == 3 and "why-it-failed" in shown["runs"][-1]["stderr_tail"]
        r = millwright("jobs", "show", "cli-later", "-c", cfg)
        assert r.returncode == 0 and "next due" in r.stdout and "cli-later" in r.stdout
        r = millwright("runs", "cli-tick", "-c", cfg, "--json")
        runs = json.loads(r.stdout)
        assert len(runs) == 1 and runs[0]["state"] == "failed"
        r = millwright("runs", "cli-tick", "-c", cfg)
        assert "FIRE_ID" in r.stdout and runs[0]["fire_id"] in r.stdout
        r = millwright("logs", f"cli-tick/{runs[0]['fire_id']}", "-c", cfg, "--json")
        logs = json.loads(r.stdout)
        assert logs["stdout"].count("tick") == 8 and "why-it-failed" in logs["stderr"]
        # the terminal status carried the stderr tail to the cloud too
        assert any(d.get("job_id") == "cli-tick" and "why-it-failed" in (d.get("stderr_tail") or "")
                   for d in world.col.docs("failed"))
        # errors: one line, no traceback
        r = millwright("jobs", "show", "nope", "-c", cfg)
        assert r.returncode == 1 and "no job nope" in r.stderr and "Traceback" not in r.stderr
        r = millwright("runs", "../x", "-c", cfg)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        elsewhere = tmp_path / "elsewhere.yaml"
        c = yaml.safe_load(open(cfg))
        c["agent_id"] = "another-gateway"
        elsewhere.write_text(yaml.safe_dump(c))
        r = millwright("logs", "cli-tick", "-c", str(elsewhere))
        assert r.returncode == 1 and f"agent {aid}" in r.stderr and "Traceback" not in r.stderr, r.stderr
        c["etcd"]["endpoints"] = ["http://127.0.0.1:1"]
        c["etcd"]["request_timeout_s"] = 0.5
        elsewhere.write_text(yaml.safe_dump(c))
        r = millwright("jobs", "list", "-c", str(elsewhere))
        assert r.returncode == 4 and "cannot read etcd" in r.stderr and "Traceback" not in r.stderr, r.stderr
    finally:
        pusher.stop()


def test_answer_markers_sweep_clear_and_bound(etcd_server):
    """Answers against a real etcd: the owner republishes a dead writer's marker once,
    rebuilt from the fact it answers; a marker without a fact is deleted unpublished and
    audited; a delivered marker is deleted; a marker older than keep_s is dropped (the bound)."""
    from agent.cloud.answers import Answers, marker_value
    from agent.config import EtcdConfig
    from agent.coordination.etcd import EtcdClient
    from agent.coordination.keys import Keys

    client = EtcdClient(EtcdConfig(endpoints=[etcd_server.endpoint], request_timeout_s=2.0))
    keys = Keys("t")
    client.put(keys.member("alive"), "{}")
    now = time.time()
    ts = lambda dt: time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime(now - dt))  # noqa: E731
    docs = {"dead": {"job_id": "j1", "state": "accepted", "agent": "gone", "ts": ts(1), "push_sha256": "0123456789abcdef"},
            "handed": {"job_id": "j5", "state": "accepted", "agent": "gone", "ts": ts(1), "handed": True},
            "alive": {"job_id": "j2", "state": "accepted", "agent": "alive", "ts": ts(1)},
            "old": {"job_id": "j3", "state": "failed", "agent": "gone", "ts": ts(3600)},
            "other_shard": {"job_id": "j4", "state": "accepted", "agent": "gone", "ts": ts(1)},
            "forged": {"job_id": "j7", "state": "accepted", "agent": "gone", "ts": ts(1)},
            "not_its_writer": {"job_id": "j8", "state": "accepted", "agent": "gone", "ts": ts(1)}}
    shard_of_name = {"dead": 1, "handed": 1, "alive": 1, "old": 2, "other_shard": 5, "forged": 1, "not_its_writer": 1}
    for name, d in docs.items():
        client.put(keys.answer(shard_of_name[name], d["job_id"], "accepted"), marker_value(d))
        if name not in ("forged", "not_its_writer"):  # the fact: the job its writer created
            client.put(keys.job(shard_of_name[name], d["job_id"]), json.dumps(
                {"id": d["job_id"], "_accepted": {"at": ts(2), "by": d["agent"]}}))
    client.put(keys.job(1, "j8"), json.dumps({"id": "j8", "_accepted": {"at": ts(2), "by": "someone-else"}}))
    # a final run whose marker says something else than its fenced record
    record = {"v": 1, "job_id": "j9", "fire_id": "20261201T120000.000Z", "state": "failed", "attempt": 2,
              "agent": "gone", "shard": 1, "ended_at": ts(1), "exit_code": 3, "reason": "exit_code", "fence": 7,
              "stderr_tail": "why\n", "usage": None, "due": ts(5), "health": None}
    client.put(keys.run(1, "j9", record["fire_id"]), json.dumps(record))
    client.put(keys.answer(1, "j9", "run." + record["fire_id"]), marker_value(
        {"job_id": "j9", "run_id": record["fire_id"] + ".2", "fire_id": record["fire_id"], "state": "succeeded", "exit_code": 0, "agent": "gone",
         "ts": ts(1), "note": "anything a client wrote"}))
    published, audited = [], []
    ans = Answers(client, keys, "me", enqueue=lambda j, d, k: published.append((j, d, k)), in_outbox=lambda k: False,
                  owned=lambda: frozenset({1, 2}), fence_for=lambda s: None, keep_s=600, republish_after_s=30,
                  record=lambda *a, **k: audited.append(k))
    assert ans.sweep() == 3
    by_job = {p[0]: p for p in published}
    assert set(by_job) == {"j1", "j5", "j9"}
    _, doc5, _ = by_job["j5"]
    assert doc5["redelivery"] is True and "handed" not in doc5  # stamped handed: may repeat a1's
    assert doc5["answer"] == "accepted"   # what the cloud dedupes answers on, with job_id
    _, doc, key = by_job["j1"]
    assert doc["published_by"] == "me" and "redelivery" not in doc and doc["agent"] == "gone"  # never handed
    assert doc["push_sha256"] == "0123456789abcdef" and doc["ts"] == ts(2)  # the stored job's _accepted.at
    _, run, _ = by_job["j9"]  # rebuilt from the fenced record, not the marker's words
    assert (run["state"], run["exit_code"], run["attempt"], run["stderr_tail"]) == ("failed", 3, 2, "why\n")
    assert "note" not in run and (run["run_id"], run["fire_id"]) == (record["fire_id"] + ".2", record["fire_id"])
    assert run["answer"] == "run." + record["fire_id"]
    assert sorted((a["job"], a["reason"]) for a in audited if a.get("event") == "answer_unfounded") == [
        ("j7", "no_job"), ("j8", "other_writer")]
    remaining = {kv.key for kv in client.get_prefix(keys.answers_prefix())[0]}
    assert keys.answer(1, "j7", "accepted") not in remaining and keys.answer(1, "j8", "accepted") not in remaining
    assert ans.sweep(force=True) == 0  # already on its way: not enqueued twice
    # cheap when nothing changed: a new marker waits for a change of members or shards, or
    # the periodic full sweep
    client.put(keys.answer(1, "j6", "accepted"), marker_value(dict(docs["dead"], job_id="j6")))
    client.put(keys.job(1, "j6"), json.dumps({"id": "j6", "_accepted": {"at": ts(2), "by": "gone"}}))
    assert ans.sweep() == 0
    client.put(keys.member("newcomer"), "{}")
    assert ans.sweep() == 1 and published[-1][0] == "j6"
    ans.connected = lambda: False
    assert ans.sweep(force=True) == 0  # broker unreachable: nothing is read
    ans.connected = lambda: True
    remaining = {kv.key for kv in client.get_prefix(keys.answers_prefix())[0]}
    assert keys.answer(2, "j3", "accepted") not in remaining  # expired: the bound
    assert keys.answer(5, "j4", "accepted") in remaining      # not our shard
    ans.start()
    try:
        ans.delivered([key])
        wait_for(lambda: key not in {kv.key for kv in client.get_prefix(keys.answers_prefix())[0]}, 10,
                 what="delivered marker deleted")
    finally:
        ans.stop()
        client.close()


def test_handing_stamps_only_existing_markers(etcd_server):
    from agent.cloud.answers import Answers, marker_value
    from agent.config import EtcdConfig
    from agent.coordination.etcd import EtcdClient
    from agent.coordination.keys import Keys

    client = EtcdClient(EtcdConfig(endpoints=[etcd_server.endpoint], request_timeout_s=2.0))
    keys = Keys("t")
    live, gone = keys.answer(1, "j1", "accepted"), keys.answer(1, "j2", "accepted")
    client.put(live, marker_value({"job_id": "j1", "state": "accepted"}))
    ans = Answers(client, keys, "me", enqueue=None, in_outbox=None, owned=frozenset, fence_for=lambda s: None)
    ans.handing([(live, b'{"job_id":"j1","state":"accepted","seq":7}'), (gone, b'{"job_id":"j2","seq":8}')])
    assert json.loads(client.get(live).value) == {"job_id": "j1", "state": "accepted", "handed": True}
    assert client.get(gone) is None  # a marker already cleared is never recreated
    client.close()


def test_push_exit_codes_no_answer_and_broker_unreachable(world, tmp_path):
    """`millwright push`: 3 when no agent answers in time, 4 when the broker is unreachable."""
    from agent.demo.services import free_port

    cfg = {"cluster": "t", "agent_id": "cli", "mqtt": {"url": world.mq.url, "insecure": True},
           "etcd": {"insecure": True}, "signing": {"keys_file": world.keys_file}}
    path = tmp_path / "cli.yaml"
    path.write_text(yaml.safe_dump(cfg))
    job = tmp_path / "job.json"
    job.write_text(json.dumps(job_doc("nobody-home")))
    r = millwright("push", "-c", str(path), str(job), "--key-file", world.keys_file, "--kid", KID, "--timeout", "2")
    assert r.returncode == 3 and "no status for nobody-home" in r.stderr and "Traceback" not in r.stderr, r.stderr
    cfg["mqtt"]["url"] = f"mqtt://127.0.0.1:{free_port()}"
    path.write_text(yaml.safe_dump(cfg))
    r = millwright("push", "-c", str(path), str(job), "--key-file", world.keys_file, "--kid", KID, "--timeout", "2")
    assert r.returncode == 4 and "cannot connect to the broker" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_delivered_markers_trickling_in_are_deleted_in_one_transaction(etcd_server):
    """Deletes after PUBACK are off the answer's path: markers delivered within
    CLEAR_LINGER_S of each other go in one etcd transaction (one revision), not one each."""
    from agent.cloud.answers import CLEAR_LINGER_S, Answers, marker_value
    from agent.config import EtcdConfig
    from agent.coordination.etcd import EtcdClient
    from agent.coordination.keys import Keys
    from tests.support.history import read_history

    client = EtcdClient(EtcdConfig(endpoints=[etcd_server.endpoint], request_timeout_s=2.0))
    keys = Keys("t")
    markers = [keys.answer(3, f"trickle-{i}", "accepted") for i in range(4)]
    for k in markers:
        client.put(k, marker_value({"job_id": k, "state": "accepted"}))
    ans = Answers(client, keys, "me", enqueue=None, in_outbox=lambda k: False, owned=frozenset,
                  fence_for=lambda s: None).start()
    try:
        ans.delivered(markers[:1])
        time.sleep(CLEAR_LINGER_S / 5)
        ans.delivered(markers[1:3])
        time.sleep(CLEAR_LINGER_S / 5)
        ans.delivered(markers[3:])
        wait_for(lambda: not client.get_prefix(keys.answers_prefix(3))[0], 10, what="markers deleted")
        deletes = [e for e in read_history(client, keys.answers_prefix(3)) if e.kind == "delete"]
        assert sorted(e.key for e in deletes) == sorted(markers)
        assert len({e.rev for e in deletes}) == 1, [e.rev for e in deletes]
    finally:
        ans.stop()
        client.close()


def test_sweep_of_a_cluster_without_markers_reads_no_shard(etcd_server):
    """An idle cluster has no answer markers: a full sweep over 64 owned shards costs one
    count, not a read per shard; once a marker exists the owner's shard is read again and
    a dead writer's answer is republished."""
    from agent.cloud.answers import Answers, marker_value
    from agent.config import EtcdConfig
    from agent.coordination.etcd import EtcdClient
    from agent.coordination.keys import Keys
    from agent.runtime.metrics import sample

    def range_pages_read() -> float:
        """Paged range requests this process made so far (our etcd client counts each)."""
        return sample("millwright_etcd_requests_total", {"op": "range_page", "result": "ok"}) or 0.0

    client = EtcdClient(EtcdConfig(endpoints=[etcd_server.endpoint], request_timeout_s=2.0))
    keys = Keys("idle")
    published = []
    ans = Answers(client, keys, "me", enqueue=lambda j, d, k: published.append(j), in_outbox=lambda k: False,
                  owned=lambda: frozenset(range(64)), fence_for=lambda s: None)
    try:
        before = range_pages_read()
        assert ans.sweep(force=True) == 0
        assert range_pages_read() - before == 1  # the member ids; no shard's markers
        doc = {"job_id": "j1", "state": "accepted", "agent": "gone",
               "ts": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())}
        client.put(keys.answer(7, "j1", "accepted"), marker_value(doc))
        client.put(keys.job(7, "j1"), json.dumps({"id": "j1", "_accepted": {"at": doc["ts"], "by": "gone"}}))
        before = range_pages_read()
        assert ans.sweep(force=True) == 1 and published == ["j1"]
        assert range_pages_read() - before == 1 + 64  # the members, then each owned shard
    finally:
        client.close()
