"""`millwright keygen` (issue 39): the agents' entry before the guidance about it, and
`--agent-keys FILE`, which leaves a keys file the agent accepts. Each test fails on a build
whose keygen printed its guidance first (stderr, unbuffered, ahead of the buffered stdout)
and had no --agent-keys."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import yaml

from agent.demo.services import REPO_ROOT
from agent.jobs.signing import HAVE_ED25519, KeyRing
from tests.support.commands import millwright, millwright_env

pytestmark = pytest.mark.skipif(not HAVE_ED25519, reason="ed25519 needs python3-cryptography")


def keygen_merged(*args: str) -> subprocess.CompletedProcess:
    """keygen with stdout and stderr on one pipe, as on a terminal: what a person reads, in order."""
    return subprocess.run([sys.executable, "-m", "agent", "keygen", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT, env=millwright_env(), timeout=60)


def test_the_entry_comes_before_the_guidance_about_it(tmp_path):
    r = keygen_merged("--kid", "cloud-1", "--out", str(tmp_path / "signer.yaml"))
    assert r.returncode == 0, r.stdout
    lines = r.stdout.splitlines()
    assert lines[0] == "cloud-1:" and all(line.startswith("#") for line in lines[3:]) and len(lines) > 3, lines
    assert "above" in lines[-1]


def test_agent_keys_creates_an_owner_only_keys_file_the_agent_loads(tmp_path):
    keys = tmp_path / "keys.yaml"
    r = millwright("keygen", "--kid", "cloud-1", "--out", str(tmp_path / "signer.yaml"), "--agent-keys", str(keys))
    assert r.returncode == 0, r.stderr
    st = os.stat(keys)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    ring = KeyRing.load(str(keys))   # what the agent does at start: mode, owner, content
    assert ring.kids == ["cloud-1"] and not ring.get("cloud-1").can_sign
    assert yaml.safe_load(r.stdout) == yaml.safe_load(keys.read_text())
    assert f"written to new {keys} (mode 0600)" in r.stderr


def test_agent_keys_appends_to_an_existing_file_and_refuses_a_kid_it_holds(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("lab-1: {alg: hmac-sha256, secret: " + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVphYmNkZWY=}")  # no newline
    os.chmod(keys, 0o600)
    r = millwright("keygen", "--kid", "cloud-2", "--out", str(tmp_path / "s2.yaml"), "--agent-keys", str(keys))
    assert r.returncode == 0, r.stderr
    assert sorted(KeyRing.load(str(keys)).kids) == ["cloud-2", "lab-1"]
    r = millwright("keygen", "--kid", "cloud-2", "--out", str(tmp_path / "s3.yaml"), "--agent-keys", str(keys))
    assert r.returncode == 2 and r.stderr == f"millwright: {keys}: already holds key id cloud-2; a key id names one " \
                                             f"key (choose another --kid)\n"
    assert not (tmp_path / "s3.yaml").exists()   # refused before a key pair was made


def test_agent_keys_refuses_a_file_the_agent_would_refuse(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("")
    os.chmod(keys, 0o644)
    r = millwright("keygen", "--kid", "cloud-1", "--out", str(tmp_path / "signer.yaml"), "--agent-keys", str(keys))
    assert r.returncode == 2 and "chmod 600" in r.stderr and len(r.stderr.splitlines()) == 1
    assert not (tmp_path / "signer.yaml").exists() and keys.read_text() == ""
