"""Hidden whatever happens later (issue 54, points 3 and 4; docs/security.md, "Job
isolation"): the jobs' mount namespace is built once, from the agent's configuration
(Isolation.from_config, as the daemon builds it); then, while the agent runs, its admin
socket is made in a directory that did not exist, its keys file and config are replaced
by rename (what ``sed -i``, configuration management and certificate renewal do) and a
TLS key is provisioned. A root run (uid 0, the hardest case: no permission bit stops it)
must read none of them, while it still reads a file the agent does not hide."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile

import pytest

from agent.execute import Executor, RunSpec
from agent.execute.backends import probe
from agent.execute.isolation import Isolation
from agent.execute.netfilter import table_name
from tests.kernel.test_isolation import _available
from tests.support.hidingconfig import make_config, write_file
from tests.support.kernel import require_kernel

PY = "/usr/bin/python3"
# argv[1]: a JSON list of [name, kind, target]; prints a JSON map name -> "ok" or the error
PROBE = r"""
import json, os, socket, sys
out = {}
for name, kind, target in json.loads(sys.argv[1]):
    try:
        if kind == "read":
            out[name] = open(target).read()
            continue
        elif kind == "list":
            os.listdir(target)
        elif kind == "connect":
            s = socket.socket(socket.AF_UNIX); s.settimeout(3); s.connect(target); s.close()
        out[name] = "ok"
    except OSError as exc:
        out[name] = type(exc).__name__
print(json.dumps(out))
"""


def _replace(path: str, text: str) -> None:
    """What sed -i and configuration management do: a new file renamed over the old one."""
    tmp = path + ".new"
    write_file(tmp, text)
    os.replace(tmp, path)


ADMIN_DIRS = ["beside", "run"]


@pytest.fixture(params=ADMIN_DIRS)
def hiding_agent(request, etcd_server, mosquitto_server):
    ok, why = _available()
    require_kernel(ok, why)
    name = f"millwright-test-hide-{os.getpid()}"
    backend = probe("rlimit", root_name=name)
    top = tempfile.mkdtemp(prefix="mw-hide-", dir="/tmp")
    os.chmod(top, 0o755)
    # the admin socket's directory does not exist when the namespace is built: beside the
    # config, or under /run as the package puts it (/run/millwright)
    run_dir = f"/run/mw-test-hide-{os.getpid()}"
    admin_dir = os.path.join(top, "admin") if request.param == "beside" else run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = make_config(top, os.path.join(admin_dir, "admin.sock"), etcd_server.endpoint,
                  f"mqtt://127.0.0.1:{mosquitto_server.port}")
    pub = os.path.join(top, "pub")
    os.makedirs(pub)
    write_file(os.path.join(pub, "open.txt"), "not a secret\n")
    base = os.path.join(cfg.state_dir, "runs")
    iso = Isolation.from_config(cfg, name, [base])
    ex = Executor(backend, base, isolation=iso)
    yield {"ex": ex, "cfg": cfg, "top": top, "pub": pub, "admin_dir": admin_dir, "iso": iso}
    ex.close()
    shutil.rmtree(top, ignore_errors=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    r = subprocess.run(["nft", "list", "table", "inet", table_name(name)], capture_output=True)
    assert r.returncode != 0, "the nftables table outlived the executor"


def probe_as_root(ex: Executor, key: str, checks: list) -> dict:
    h = ex.start(RunSpec(key, [PY, "-c", PROBE, json.dumps(checks)], user="root", allow_root=True, timeout_s=30),
                 lambda h, r: None)
    r = h.wait(40)
    assert r is not None and r.reason == "succeeded", (r and r.reason, r and r.error)
    return json.loads(open(r.stdout_path).read())


def test_what_comes_after_the_namespace_stays_hidden_from_a_root_run(hiding_agent):
    a = hiding_agent
    ex, cfg = a["ex"], a["cfg"]
    # the directories were made before the namespace, owner-only
    for d in (a["admin_dir"], os.path.join(a["top"], "tls")):
        assert os.path.isdir(d) and os.stat(d).st_mode & 0o777 == 0o700
    before = probe_as_root(ex, "before", [["keys", "read", cfg.signing.keys_file], ["config", "read", cfg.source],
                                          ["open", "read", os.path.join(a["pub"], "open.txt")]])
    assert before["keys"] != "secret keys, first\n" and before["config"] != open(cfg.source).read()
    assert before["open"] == "not a secret\n"

    # then, while the agent runs: its admin socket, a renamed keys file and config, a new TLS key
    # (made as the agent's admin server and a provisioning tool do: a directory if missing)
    os.makedirs(a["admin_dir"], mode=0o750, exist_ok=True)
    os.makedirs(os.path.dirname(cfg.etcd.tls.key), mode=0o755, exist_ok=True)
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(cfg.admin.socket)
    srv.listen(4)
    try:
        _replace(cfg.signing.keys_file, "secret keys, renewed\n")
        _replace(cfg.source, open(cfg.source).read() + "# edited by rename\n")
        write_file(cfg.etcd.tls.key, "-----BEGIN PRIVATE KEY----- secret\n")
        checks = [["admin socket", "connect", cfg.admin.socket], ["admin dir", "list", a["admin_dir"]],
                  ["keys", "read", cfg.signing.keys_file], ["config", "read", cfg.source],
                  ["tls key", "read", cfg.etcd.tls.key], ["tls dir", "list", os.path.dirname(cfg.etcd.tls.key)],
                  ["open", "read", os.path.join(a["pub"], "open.txt")]]
        after = probe_as_root(ex, "after", checks)
    finally:
        srv.close()
    assert after.pop("open") == "not a secret\n"   # what is not the agent's stays readable
    leaked = {k: v for k, v in after.items() if v == "ok" or "secret" in v or "rename" in v}
    assert not leaked, leaked
    # the host itself sees the new contents (the covers are in the jobs' namespace only)
    assert open(cfg.signing.keys_file).read() == "secret keys, renewed\n"


def test_a_secret_covered_alone_or_a_directory_made_again_is_covered_again(etcd_server, mosquitto_server):
    """The second line: where a secret lies in a shared directory (here /tmp) it is covered
    alone, and a rename detaches that cover; a covered directory removed and made again
    loses its cover the same way. Before every spawn (a host inode changed) and every
    second (the jobs' namespace checked) the agent covers again what lost its cover: a root
    run started after the change reads none of it."""
    ok, why = _available()
    require_kernel(ok, why)
    name = f"millwright-test-hide-{os.getpid()}"
    top = tempfile.mkdtemp(prefix="mw-hide-", dir="/tmp")
    os.chmod(top, 0o755)
    keys = f"/tmp/mw-test-hide-keys-{os.getpid()}.yaml"
    audit_key = f"/tmp/mw-test-hide-audit-{os.getpid()}.key"   # made after the start
    ex = None
    try:
        cfg = make_config(top, os.path.join(top, "admin", "admin.sock"), etcd_server.endpoint,
                          f"mqtt://127.0.0.1:{mosquitto_server.port}")
        cfg.signing.keys_file, cfg.audit.key_file = keys, audit_key
        write_file(keys, "secret keys, first\n")
        base = os.path.join(cfg.state_dir, "runs")
        iso = Isolation.from_config(cfg, name, [base])
        ns = iso.namespaces
        ns._stop.set()   # (the periodic pass off: this test makes its passes itself)
        ex = Executor(probe("rlimit", root_name=name), base, isolation=iso)
        etc = os.path.dirname(cfg.source)
        first = probe_as_root(ex, "first", [["keys", "read", keys], ["config", "read", cfg.source]])
        assert first == {"keys": "PermissionError", "config": "PermissionError"}, first

        _replace(keys, "secret keys, renewed\n")
        write_file(audit_key, "secret audit key\n")
        after = probe_as_root(ex, "after", [["keys", "read", keys], ["audit key", "read", audit_key]])
        assert after == {"keys": "PermissionError", "audit key": "PermissionError"}, after
        assert ns.recovered == 2
        assert ns.refresh(everything=True) == []   # covered already: nothing is stacked

        text = open(cfg.source).read()
        shutil.rmtree(etc)   # the config directory removed and made again (its inode number may come back)
        os.makedirs(etc)
        write_file(cfg.source, text + "# made again\n")
        assert ns.refresh(everything=True) == [etc]   # what the periodic pass does
        after = probe_as_root(ex, "again", [["config", "read", cfg.source], ["etc", "list", etc]])
        assert after == {"config": "PermissionError", "etc": "PermissionError"}, after
    finally:
        if ex is not None:
            ex.close()
        shutil.rmtree(top, ignore_errors=True)
        for p in (keys, audit_key):
            if os.path.exists(p):
                os.unlink(p)
