"""The hiding plan (agent/execute/hiding.py): which of the agent's directories job
isolation covers whole, which secrets only as files (reported), and what it refuses."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from agent.execute.hiding import plan
from agent.execute.isolation import Isolation, IsolationError
from tests.support.hidingconfig import make_config


def test_a_secret_in_a_shared_directory_is_reported_and_an_admin_socket_there_refused():
    """Where a secret lies directly in a directory runs share (/tmp, /etc, /run), its
    directory is not covered: a file is covered alone and the config check says a
    replacement by rename is not hidden; an admin socket there (made after the namespace)
    could not be hidden at all: a root agent refuses to start."""
    top = tempfile.mkdtemp(prefix="mw-hide-", dir="/tmp")
    try:
        cfg = make_config(top, "/run/mw-test-admin.sock", "http://127.0.0.1:1", "mqtt://127.0.0.1:1")
        cfg.signing.keys_file = "/tmp/mw-test-keys.yaml"
        p = plan(cfg)
        assert p.refused and "admin.socket" in p.refused[0] and "/run is a system directory" in p.refused[0]
        assert "/tmp/mw-test-keys.yaml" in p.files and "/tmp" not in p.dirs
        assert any(line.startswith("signing.keys_file: /tmp/mw-test-keys.yaml is hidden from runs as a file only")
                   for line in p.problems)
        assert os.path.join(top, "etc") in p.dirs   # the config's own directory is covered whole
        with pytest.raises(IsolationError, match="admin.socket"):
            Isolation.from_config(cfg, f"millwright-test-hide-{os.getpid()}", [os.path.join(top, "state", "runs")])
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_templates_keep_what_they_name_and_certificates_their_directory():
    """A directory a template's command line names is not covered whole (its scripts
    would vanish for the runs); a TLS certificate is public: covered alone, its
    directory (with the CAs runs need) never whole."""
    top = tempfile.mkdtemp(prefix="mw-hide-", dir="/tmp")
    try:
        cfg = make_config(top, os.path.join(top, "adm", "admin.sock"), "http://127.0.0.1:1", "mqtt://127.0.0.1:1")
        cfg.etcd.tls.cert = os.path.join(top, "certs", "agent.crt")
        etc = os.path.join(top, "etc")
        from agent.config import Template
        cfg.templates["t"] = Template(argv=["/bin/sh", os.path.join(etc, "job.sh")])
        p = plan(cfg)
        assert etc not in p.dirs and cfg.source in p.files and cfg.signing.keys_file in p.files
        assert any(f"{etc} holds what a template runs" in line for line in p.problems)
        assert cfg.etcd.tls.cert in p.files and os.path.join(top, "certs") not in p.dirs
        assert {os.path.join(top, "adm"), os.path.join(top, "tls"), os.path.join(top, "state")} <= set(p.dirs)
        assert not p.refused
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_with_a_root_template_a_secret_it_could_read_after_a_rename_stops_the_start():
    """No file mode keeps a root run out: a secret its directory cannot cover whole (a
    system directory, or one a template's command line names) is refused, not reported,
    once some template runs as root; a secret in a directory of its own is still fine."""
    from agent.config import Template

    top = tempfile.mkdtemp(prefix="mw-hide-", dir="/tmp")
    try:
        cfg = make_config(top, os.path.join(top, "adm", "admin.sock"), "http://127.0.0.1:1", "mqtt://127.0.0.1:1")
        cfg.templates["fw"] = Template(argv=["/bin/true"], user="root", allow_root=True)
        assert plan(cfg).refused == []   # every secret in a directory of its own
        cfg.signing.keys_file = "/etc/mw-test-keys.yaml"
        etc = os.path.join(top, "etc")
        cfg.templates["t"] = Template(argv=["/bin/sh", os.path.join(etc, "job.sh")])
        p = plan(cfg)
        keys = [r for r in p.refused if r.startswith("signing.keys_file: /etc/mw-test-keys.yaml cannot be hidden")]
        assert keys and "templates fw" in keys[0] and "/etc is a system directory" in keys[0]
        assert any(r.startswith(f"config: {cfg.source} cannot be hidden") and f"{etc} holds what a template runs" in r
                   for r in p.refused)
        assert "/etc/mw-test-keys.yaml" not in p.files and not any("keys_file" in line for line in p.problems)
        with pytest.raises(IsolationError, match="signing.keys_file"):
            Isolation.from_config(cfg, f"millwright-test-hide-{os.getpid()}", [os.path.join(top, "state", "runs")])
        cfg.templates["fw"].allow_root = False   # no root run: reported as before
        assert plan(cfg).refused == [] and any("keys_file" in line for line in plan(cfg).problems)
    finally:
        shutil.rmtree(top, ignore_errors=True)
