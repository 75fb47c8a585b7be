"""Job isolation (issue 34; docs/security.md, "Job isolation"): real jobs through the real
Executor try, from inside, what a hostile job on a gateway would, as an unprivileged job
and as an allow_root job, on each quota backend this host has: reach the agent's etcd and
broker, read its config, keys and audit key, signal and read another job's process and the
agent, release a waiting launcher early through /proc/<pid>/fd/0; and what a template
allows still works (network any, a listed capability)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from agent.execute import Executor, Limits, RunSpec
from agent.runtime import kernel as kcalls
from agent.execute.backends import probe
from agent.execute.isolation import Isolation
from agent.execute.netfilter import table_name
from tests.support.kernel import require_kernel

PY = "/usr/bin/python3"
# The attacks, run by the job: argv[1] is a JSON list of [name, kind, target]; prints a JSON
# map name -> "ok" or the error's name.
ATTACK = r"""
import json, os, signal, socket, sys
out = {}
for name, kind, target in json.loads(sys.argv[1]):
    try:
        if kind == "connect":
            s = socket.create_connection(("127.0.0.1", int(target)), timeout=3); s.close()
        elif kind == "read":
            open(target, "rb").read(1)
        elif kind == "list":
            os.listdir(target)
        elif kind == "signal":
            os.kill(int(target), signal.SIGTERM)
        elif kind == "write":
            with open(target, "w") as fh:
                fh.write("g\n")
        elif kind == "append_env":   # the run's own progress FIFO or result file, named in its environment
            with open(os.environ[target], "a") as fh:
                fh.write("{}\n")
        elif kind == "replace_env":
            os.replace(os.environ[target], os.environ[target] + ".mine")
        elif kind == "status":
            fields = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
            out[name] = {k: fields[k].strip() for k in ("CapEff", "CapBnd", "NoNewPrivs", "Uid", "Gid")}
            continue
        elif kind == "umask":
            out[name] = oct(os.umask(0o077))
            continue
        out[name] = "ok"
    except OSError as exc:
        out[name] = type(exc).__name__
print(json.dumps(out))
"""


def _available() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "needs root"
    try:
        from agent.execute import netfilter
        netfilter._lib()
    except OSError as exc:
        return False, str(exc)
    return True, ""


BACKENDS = ["cgroup1", "rlimit"]


@pytest.fixture(params=BACKENDS)
def agent(request, etcd_server, mosquitto_server):
    """An isolating executor of a fake agent: its config dir, keys, audit key and state dir
    hold secrets; its coordination endpoints are a real etcd and a real mosquitto."""
    ok, why = _available()
    require_kernel(ok, why)
    backend = probe(request.param, root_name=f"millwright-test-iso-{os.getpid()}")
    require_kernel(backend.name == request.param, f"{request.param} unusable: {backend.why}")
    top = tempfile.mkdtemp(prefix="mw-iso-", dir="/tmp")
    os.chmod(top, 0o755)
    etc = os.path.join(top, "millwright")
    state = os.path.join(top, "state")
    audit = os.path.join(state, "audit")
    for d in (etc, audit):
        os.makedirs(d)
    secrets = {}
    for name in ("agent.yaml", "keys.yaml", "audit.key"):
        path = os.path.join(etc, name)
        with open(path, "w") as fh:
            fh.write(f"secret {name}\n")
        os.chmod(path, 0o644)   # readable by everyone on the host: only the namespace hides it
        secrets[name] = path
    with open(os.path.join(audit, "audit-000001.jsonl"), "w") as fh:
        fh.write("{}\n")
    base = os.path.join(state, "runs")
    name = f"millwright-test-iso-{os.getpid()}"
    iso = Isolation(name, [etc, state, audit] + list(secrets.values()), [base],
                    [etcd_server.endpoint, f"mqtt://127.0.0.1:{mosquitto_server.port}"])
    ex = Executor(backend, base, isolation=iso)
    ns = {"ex": ex, "secrets": secrets, "state": state, "audit": audit, "etc": etc, "name": name,
          "etcd_port": etcd_server.port, "mqtt_port": mosquitto_server.port}
    yield ns
    ex.close()
    shutil.rmtree(top, ignore_errors=True)
    # the table goes with the executor
    r = subprocess.run(["nft", "list", "table", "inet", table_name(name)], capture_output=True)
    assert r.returncode != 0, "the nftables table outlived the executor"


def run(ex: Executor, key: str, argv: list, user: str, **kw) -> tuple:
    h = ex.start(RunSpec(key, argv, user=user, timeout_s=30, **kw), lambda h, r: None)
    r = h.wait(40)
    assert r is not None
    out = open(r.stdout_path).read() if r.stdout_path else ""
    err = open(r.stderr_path).read() if r.stderr_path else ""
    return r, out, err


def attack(ex: Executor, key: str, user: str, checks: list, **kw) -> dict:
    r, out, err = run(ex, key, [PY, "-c", ATTACK, json.dumps(checks)], user, **kw)
    assert r.reason == "succeeded", (r.reason, r.error, err)
    return json.loads(out)


def victim(ex: Executor, key: str, user: str, **kw):
    """A job with a secret in its environment, sleeping; its pid once it runs."""
    h = ex.start(RunSpec(key, ["/bin/sleep", "60"], user=user, env={"VICTIM_SECRET": "s3cret"}, **kw),
                 lambda h, r: None)
    assert h.pid
    return h


AS = [("job user", {"user": "millwright-jobs"}),
      ("root job", {"user": "root", "allow_root": True})]


@pytest.mark.parametrize("who,spec", AS, ids=["job_user", "root"])
def test_a_job_cannot_reach_coordination_read_secrets_or_touch_other_runs(agent, who, spec):
    ex = agent["ex"]
    others = [victim(ex, "victim-user", "millwright-jobs"), victim(ex, "victim-root", "root", allow_root=True)]
    # a prepared run whose launcher waits (armed, its due time far away)
    waiting = ex.prepare(RunSpec("waiting", ["/bin/true"], user=spec["user"], allow_root=spec.get("allow_root", False)),
                         lambda h, r: None, release_at=time.monotonic() + 60, guard=lambda: True,
                         guard_until=time.monotonic() + 120)
    try:
        checks = [["etcd", "connect", agent["etcd_port"]], ["broker", "connect", agent["mqtt_port"]]]
        checks += [[f"read {n}", "read", p] for n, p in agent["secrets"].items()]
        checks += [["list state", "list", agent["state"]], ["list audit", "list", agent["audit"]],
                   ["list etc", "list", agent["etc"]],
                   ["agent environ", "read", f"/proc/{os.getpid()}/environ"],
                   ["signal agent", "signal", os.getpid()],
                   ["go channel", "write", f"/proc/{waiting.pid}/fd/0"],
                   ["status", "status", ""], ["umask", "umask", ""]]
        for o in others:
            checks += [[f"signal {o.run_key}", "signal", o.pid], [f"environ {o.run_key}", "read", f"/proc/{o.pid}/environ"],
                       [f"cmdline {o.run_key}", "read", f"/proc/{o.pid}/cmdline"],
                       [f"progress {o.run_key}", "write", os.path.join(o.run_dir, "progress")],
                       [f"result {o.run_key}", "write", os.path.join(o.run_dir, "result.json")]]
        checks += [["replace own result", "replace_env", "MILLWRIGHT_RESULT"],
                   ["replace own progress", "replace_env", "MILLWRIGHT_PROGRESS"]]
        res = attack(ex, f"attacker-{who}", spec["user"], checks, allow_root=spec.get("allow_root", False))
        status, umask = res.pop("status"), res.pop("umask")
        assert all(v != "ok" for v in res.values()), {k: v for k, v in res.items() if v == "ok"}
        assert res["etcd"] == res["broker"] == "ConnectionRefusedError"
        assert umask == "0o77"
        assert int(status["CapEff"], 16) == 0
        if who == "root job":
            assert status["Uid"].split()[0] == "0" and status["NoNewPrivs"] == "1"
            assert int(status["CapBnd"], 16) == 0
        else:
            assert int(status["Uid"].split()[0]) >= 70000
        # the victims are alive and the waiting launcher was not released
        for o in others:
            assert o.result is None and os.kill(o.pid, 0) is None
        assert waiting.result is None and ex.runs.held(waiting) is not None
        with open(f"/proc/{waiting.pid}/cmdline", "rb") as fh:
            assert b"millwright-run" in fh.read()   # still the launcher, not the job
        # its own progress FIFO and result file it can write (and only those)
        own = attack(ex, f"own-{who}", spec["user"], [["progress", "append_env", "MILLWRIGHT_PROGRESS"],
                                                      ["result", "append_env", "MILLWRIGHT_RESULT"]],
                     allow_root=spec.get("allow_root", False))
        assert own == {"progress": "ok", "result": "ok"}
    finally:
        waiting.terminate("killed")
        for o in others:
            o.terminate("killed")
        for h in [waiting] + others:
            h.wait(20)


def test_runs_get_their_own_ids_and_a_root_run_only_its_listed_capabilities(agent):
    ex = agent["ex"]
    a = attack(ex, "ids-a", "millwright-jobs", [["s", "status", ""]])["s"]
    b = attack(ex, "ids-b", "millwright-jobs", [["s", "status", ""]])["s"]
    assert a["Uid"] != b["Uid"] and a["Gid"] != b["Gid"]
    root = attack(ex, "caps", "root", [["s", "status", ""]], allow_root=True, capabilities=("net_raw",))["s"]
    assert int(root["CapEff"], 16) == 1 << 13 == int(root["CapBnd"], 16)
    # any name that resolves to uid 0 needs allow_root
    r, _, _ = run(ex, "alias", ["/bin/true"], "root")
    assert r.reason == "spawn_error" and "allow_root" in r.error


@pytest.mark.parametrize("who,spec", AS, ids=["job_user", "root"])
def test_a_confined_launcher_is_born_with_the_runs_ids_without_setpriv(agent, who, spec):
    """The launcher of a confined run comes from a thread of the agent that took the run's
    ids for itself: while it waits for its go byte it already is the run's user, its chain
    holds no setpriv, and the agent's own threads keep theirs (the agent is not dumpable:
    no process of the run may trace the thread that had its ids)."""
    import ctypes

    ex = agent["ex"]
    assert ex.thread_switch
    h = ex.prepare(RunSpec(f"born-{who}", ["/bin/true"], limits=Limits(0.5, 64, 16), **spec),
                   lambda h, r: None, release_at=time.monotonic() + 30, guard=lambda: True,
                   guard_until=time.monotonic() + 60)
    try:
        assert h.pid
        # (posix_spawn returns as the launcher's exec replaces its memory: its argv may be
        # in place a moment later)
        deadline = time.monotonic() + 5
        while not (cmd := open(f"/proc/{h.pid}/cmdline", "rb").read().split(b"\0"))[0] and time.monotonic() < deadline:
            time.sleep(0.005)
        status = dict(line.split(":", 1) for line in open(f"/proc/{h.pid}/status").read().splitlines())
        uid, gid = (int(status[k].split()[0]) for k in ("Uid", "Gid"))
        assert os.path.basename(cmd[0]) in (b"lksh", b"bash") and b"setpriv" not in b" ".join(cmd), cmd
        assert gid >= 70000 and (uid == 0) == (spec["user"] == "root") and (uid == 0 or uid == gid)
        assert (os.getuid(), os.getgid()) == (0, 0)   # the agent's thread that spawned it kept its ids
        assert ctypes.CDLL(None).prctl(3, 0, 0, 0, 0) == 0   # PR_GET_DUMPABLE
    finally:
        h.terminate()
        h.wait(20)


@pytest.mark.parametrize("network,reaches_local,refused_as", [
    ("any", True, None), ("internet", False, "ConnectionRefusedError"), ("none", False, "OSError")])
def test_network_policy(agent, network, reaches_local, refused_as):
    ex = agent["ex"]
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    try:
        checks = [["local", "connect", srv.getsockname()[1]], ["etcd", "connect", agent["etcd_port"]]]
        for who, spec in AS:
            res = attack(ex, f"net-{network}-{who.split()[0]}", spec["user"], checks, network=network,
                         allow_root=spec.get("allow_root", False))
            assert (res["local"] == "ok") == reaches_local, res
            assert res["etcd"] != "ok", res
            if refused_as == "OSError":   # no interface at all: unreachable
                assert res["local"] != "ok"
            elif refused_as:
                assert res["local"] == refused_as, res
    finally:
        srv.close()


def test_the_agent_keeps_its_own_namespaces_and_leaves_none_behind(agent):
    """A spawn moves the spawning thread into the jobs' namespaces and back: this thread
    still sees the secrets and the host network afterwards."""
    ex = agent["ex"]
    before = os.readlink("/proc/thread-self/ns/mnt"), os.readlink("/proc/thread-self/ns/net")
    cwd = os.getcwd()
    run(ex, "ns-none", ["/bin/true"], "millwright-jobs", network="none")
    run(ex, "ns-root", ["/bin/true"], "root", allow_root=True)
    assert (os.readlink("/proc/thread-self/ns/mnt"), os.readlink("/proc/thread-self/ns/net")) == before
    assert os.getcwd() == cwd
    with open(agent["secrets"]["keys.yaml"]) as fh:
        assert fh.read().startswith("secret")


def test_landlock_scopes_signals_here():
    """This kernel confines root runs with Landlock's signal scope (Linux 6.12); without it
    they fall back to a PID namespace of their own."""
    require_kernel(os.geteuid() == 0, "needs root")
    require_kernel(kcalls.landlock_abi() >= kcalls.LANDLOCK_SCOPE_ABI,
                   f"Landlock ABI {kcalls.landlock_abi()} cannot scope signals", limit="landlock")


def test_loader_keeps_only_bpf_and_perfmon():
    require_kernel(os.geteuid() == 0, "needs root")
    code = ("from agent.signals.loader import drop_privileges, environment; drop_privileges(); "
            "print([l.split()[1] for l in open('/proc/self/status') if l.startswith(('CapEff', 'CapBnd'))])")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env={"PYTHONPATH": root}, check=True).stdout
    assert json.loads(out.replace("'", '"')) == ["000000c000000000", "000000c000000000"]
