"""The etcd adapter against a real etcd: watches that neither leak threads nor spin nor
miss events across a broken connection, endpoint failover, authentication, and the
agent's behaviour on bad config and an unreachable etcd."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import urllib.request

import psutil
import pytest

from agent.config import EtcdConfig
from agent.coordination.etcd import EtcdClient, EtcdError, EtcdUnavailable
from agent.coordination.watch import PrefixWatch
from agent.demo.services import AgentProcess, free_port
from tests.support.commands import millwright
from tests.support.waiting import wait_for


def test_watch_resumes_after_etcd_restart_without_missing_or_repeating_events(etcd_server):
    client = EtcdClient(EtcdConfig(endpoints=[etcd_server.endpoint], request_timeout_s=1.0))
    seen: list[str] = []
    snapshots: list[int] = []
    w = PrefixWatch(client, "/t/", "test", on_snapshot=lambda kvs, rev: snapshots.append(rev),
                    on_events=lambda evs, rev: seen.extend(e.kv.value.decode() for e in evs), max_backoff_s=0.5)
    w.start()
    wait_for(lambda: snapshots, 5, what="snapshot")
    for i in range(5):
        client.put(f"/t/k{i}", f"v{i}")
    wait_for(lambda: len(seen) == 5, 5, what="first events")
    etcd_server.stop()
    time.sleep(1)
    etcd_server.start()
    # written right after the restart, possibly before the watch reconnected
    writer = EtcdClient(EtcdConfig(endpoints=[etcd_server.endpoint], request_timeout_s=2.0))
    for i in range(5, 10):
        writer.put(f"/t/k{i}", f"v{i}")
    wait_for(lambda: len(seen) >= 10, 15, what="events after the restart")
    time.sleep(0.5)
    assert seen == [f"v{i}" for i in range(10)]  # in order, none missed, none repeated
    assert w.restarts >= 1
    w.stop()
    assert not w.alive()
    client.close()
    writer.close()


def test_a_watch_whose_backlog_passes_grpcs_message_limit_relists_instead_of_retrying_for_ever(etcd_server):
    """Resumed far behind, a watch gets up to 1,000 revisions in one response: 60 values
    of 100 KiB pass gRPC's 4 MiB receive limit. The watch lists the prefix afresh (in
    pages) and goes on from there; before, it retried the same revision for ever."""
    writer = EtcdClient(EtcdConfig(endpoints=[etcd_server.endpoint], request_timeout_s=5.0))
    client = EtcdClient(EtcdConfig(endpoints=[etcd_server.endpoint], request_timeout_s=5.0))
    start = writer.put("/big/first", "x") + 1
    for i in range(60):
        writer.put(f"/big/k{i:02d}", "v" * (100 << 10))
    listed: list[set] = []
    seen: list[str] = []
    w = PrefixWatch(client, "/big/", "big", on_snapshot=lambda kvs, rev: listed.append({kv.key for kv in kvs}),
                    on_events=lambda evs, rev: seen.extend(e.kv.key for e in evs), start_revision=start,
                    max_backoff_s=0.5).start()
    try:
        wait_for(lambda: listed, 15, what="a relist after the too-large response")
        assert listed[0] == {"/big/first"} | {f"/big/k{i:02d}" for i in range(60)}
        writer.put("/big/after", "1")
        wait_for(lambda: "/big/after" in seen, 5, what="events after the relist")
        assert w.restarts >= 1
    finally:
        w.stop()
        client.close()
        writer.close()


def test_puts_only_watch_gets_no_deletes_and_no_previous_values(etcd_server):
    """The cloud's watches look only at writes: etcd sends them no delete events and no
    previous values; a watch without the option still gets both."""
    client = EtcdClient(EtcdConfig(endpoints=[etcd_server.endpoint], request_timeout_s=1.0))
    got: dict[bool, list] = {True: [], False: []}
    listed: set = set()
    watches = [PrefixWatch(client, "/po/", f"po-{flag}", on_snapshot=lambda kvs, rev, flag=flag: listed.add(flag),
                           on_events=lambda evs, rev, flag=flag: got[flag].extend(evs), puts_only=flag).start()
               for flag in (True, False)]
    try:
        wait_for(lambda: listed == {True, False}, 5, what="both watches listed (events follow the snapshot)")
        client.put("/po/a", "1")
        client.put("/po/a", "2")
        client.delete("/po/a")
        client.put("/po/b", "3")
        wait_for(lambda: len(got[False]) == 4 and len(got[True]) == 3, 5, what="events")
        assert [(e.kind, e.kv.value, e.prev) for e in got[True]] == [("put", b"1", None), ("put", b"2", None),
                                                                    ("put", b"3", None)]
        assert [e.kind for e in got[False]] == ["put", "put", "delete", "put"]
        assert got[False][1].prev is not None and got[False][1].prev.value == b"1"
    finally:
        for w in watches:
            w.stop()
        client.close()


def test_watch_neither_leaks_threads_nor_spins_while_etcd_is_down(etcd_server):
    client = EtcdClient(EtcdConfig(endpoints=[etcd_server.endpoint], request_timeout_s=0.5))
    base = threading.active_count()
    watches = [PrefixWatch(client, f"/p{i}/", f"w{i}", lambda k, r: None, lambda e, r: None, max_backoff_s=1.0).start()
               for i in range(4)]
    time.sleep(0.5)
    etcd_server.stop()
    proc = psutil.Process()
    cpu0 = sum(proc.cpu_times()[:2])
    time.sleep(4)
    cpu = sum(proc.cpu_times()[:2]) - cpu0
    restarts = sum(w.restarts for w in watches)
    # capped exponential backoff: a handful of reconnect attempts per watch, not thousands
    assert restarts <= 4 * 8, restarts
    assert cpu < 1.0, f"{cpu:.2f} s of CPU in 4 s while etcd was down"
    assert threading.active_count() <= base + 4 + 2
    for w in watches:
        w.stop()
    wait_for(lambda: not any(w.alive() for w in watches), 5, what="watch threads to end")
    etcd_server.start()
    # start/stop cycles do not accumulate threads
    for _ in range(10):
        PrefixWatch(client, "/q/", "cycle", lambda k, r: None, lambda e, r: None).start().stop()
    time.sleep(0.5)
    assert threading.active_count() <= base + 2
    client.close()


def test_watches_of_a_client_share_one_stream_and_survive_each_others_start_and_stop(etcd_server):
    """Several prefix watches on one client: one thread serves them all; starting and
    stopping watches while events flow neither loses nor repeats another watch's events,
    a stopped watch hears nothing more, and the thread ends with the last watch."""
    client = EtcdClient(EtcdConfig(endpoints=[etcd_server.endpoint], request_timeout_s=2.0))
    writer = EtcdClient(EtcdConfig(endpoints=[etcd_server.endpoint], request_timeout_s=2.0))
    base = threading.active_count()
    seen: dict[str, list[str]] = {"a": [], "b": [], "c": []}
    snaps: dict[str, list[int]] = {"a": [], "b": [], "c": []}

    def watch(name: str, start_revision=None) -> PrefixWatch:
        return PrefixWatch(client, f"/s/{name}/", name, on_snapshot=lambda kvs, rev: snaps[name].append(len(kvs)),
                           on_events=lambda evs, rev: seen[name].extend(e.kv.value.decode() for e in evs),
                           start_revision=start_revision).start()

    writer.put("/s/a/0", "a0")
    wa = watch("a")
    wait_for(lambda: snaps["a"], 5, what="a's snapshot")
    assert snaps["a"] == [1]
    stop = threading.Event()
    written: list[str] = []

    def write() -> None:
        i = 1
        while not stop.is_set():
            for name in "abc":
                writer.put(f"/s/{name}/{i}", f"{name}{i}")
            written.append(str(i))
            i += 1
            time.sleep(0.005)

    t = threading.Thread(target=write)
    t.start()
    try:
        time.sleep(0.2)
        wb = watch("b")            # joins the running stream: a re-open for a
        time.sleep(0.2)
        wc = watch("c")
        time.sleep(0.2)
        wb.stop()                  # leaves it: another re-open
        heard_b = len(seen["b"])
        time.sleep(0.3)
    finally:
        stop.set()
        t.join()
    n = int(written[-1])
    wait_for(lambda: len(seen["a"]) == n and seen["c"][-1:] == [f"c{n}"], 10, what="the last events")
    assert seen["a"] == [f"a{i}" for i in range(1, n + 1)]       # none lost, none repeated
    first_c = int(seen["c"][0][1:])
    assert seen["c"] == [f"c{i}" for i in range(first_c, n + 1)]  # from its snapshot on, in order
    assert snaps["c"] == [first_c - 1]                            # the snapshot held what came before
    assert len(seen["b"]) == heard_b                              # nothing after stop()
    assert seen["b"] == [f"b{i}" for i in range(int(seen["b"][0][1:]), int(seen["b"][0][1:]) + heard_b)]
    assert threading.active_count() <= base + 3  # one watch thread, gRPC's request thread and its channel poller
    assert wa.alive() and wc.alive() and not wb.alive()
    wa.stop()
    wc.stop()
    wait_for(lambda: threading.active_count() <= base, 5, what="the watch thread to end")
    assert not wa.alive()
    client.close()
    writer.close()


def test_client_fails_over_to_the_next_endpoint(etcd_server):
    dead = f"http://127.0.0.1:{free_port()}"
    client = EtcdClient(EtcdConfig(endpoints=[dead, etcd_server.endpoint], request_timeout_s=0.5))
    with pytest.raises(EtcdUnavailable):
        client.put("/f/x", "1")
    assert client.endpoint == etcd_server.endpoint
    client.put("/f/x", "1")
    assert client.get("/f/x").value == b"1"
    client.close()


def _etcdctl(endpoint: str, *args: str, user: str | None = None) -> None:
    env = {**os.environ, "ETCDCTL_API": "3"}
    cmd = ["etcdctl", f"--endpoints={endpoint}"] + ([f"--user={user}"] if user else []) + list(args)
    subprocess.run(cmd, check=True, env=env, capture_output=True)


def test_agent_with_username_and_password(etcd_server, tmp_path):
    ep = etcd_server.endpoint
    _etcdctl(ep, "user", "add", "root:rootpw")
    _etcdctl(ep, "user", "add", "mw:mwpw")
    _etcdctl(ep, "role", "add", "mw")
    _etcdctl(ep, "role", "grant-permission", "mw", "--prefix=true", "readwrite", "/millwright/")
    _etcdctl(ep, "user", "grant-role", "mw", "mw")
    _etcdctl(ep, "auth", "enable", user="root:rootpw")
    a = AgentProcess("auth", str(tmp_path), {"cluster": "au", "bpf": {"enabled": False},
                                             "etcd": {"endpoints": [ep], "username": "mw", "password": "mwpw",
                                                      "insecure": True,  # a password over http: labs only
                                                      "lease_ttl_s": 4, "renew_deadline_s": 2.5,
                                                      "retry_period_s": 0.5},
                                             "execute": {"kill_grace_s": 1.0}}).start()
    try:
        c = EtcdClient(EtcdConfig(endpoints=[ep], username="mw", password="mwpw"))
        wait_for(lambda: len(c.get_prefix("/millwright/au/shards/")[0]) == 64, 20, what="shards under auth")
        bad = EtcdClient(EtcdConfig(endpoints=[ep], username="mw", password="wrong"))
        # refused for the password, not a timeout or an unreachable server (EtcdUnavailable)
        with pytest.raises(EtcdError, match="authentication failed") as info:
            bad.get("/millwright/au/shards/0000")
        assert not isinstance(info.value, EtcdUnavailable)
    finally:
        a.terminate()


def test_bad_config_gives_one_line_per_problem_and_exit_2(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("cluster: 'a b'\nshards: 0\netcd: {lease_ttl_s: 5, renew_deadline_s: 6, insecure: true}\nnope: 1\n")
    r = millwright("run", "-c", str(cfg))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 4, r.stderr
    assert all(str(cfg) in l for l in lines)
    assert "Traceback" not in r.stderr
    assert any("etcd.renew_deadline_s" in l for l in lines)
    r = millwright("config", "check", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "cannot read" in r.stderr and "Traceback" not in r.stderr


def test_unreachable_etcd_at_start_logs_retrying_and_counts_it(tmp_path):
    port = free_port()
    mport = free_port()
    a = AgentProcess("lonely", str(tmp_path), {"cluster": "un", "bpf": {"enabled": False},
                                               "metrics": {"listen": f"127.0.0.1:{mport}"},
                                               "etcd": {"endpoints": [f"http://127.0.0.1:{port}"],
                                                        "request_timeout_s": 0.5, "insecure": True}}).start()
    try:
        wait_for(lambda: "etcd unreachable; retrying" in a.log_text(), 20, interval=0.2, what="retry log line")

        def failed() -> float:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=2).read().decode()
            except OSError:
                return 0
            for line in body.splitlines():
                if line.startswith('millwright_lease_renewals_total{result="failed"}'):
                    return float(line.split()[-1])
            return 0

        wait_for(lambda: failed() >= 2, 20, interval=0.2, what="failed renewals metric")
        assert a.alive()
        assert "Traceback" not in a.log_text()
    finally:
        assert a.terminate() == 0
