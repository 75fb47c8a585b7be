"""Issue 34, what agent.yaml lets through: etcd only over TLS and as an authenticated user
unless `etcd.insecure: true` says otherwise; a file holding a password refused when group
or others can read it (and any file they can write); the state directory created
owner-only."""

from __future__ import annotations

import os
import stat

import pytest

from agent.cli import main
from agent.config import ConfigError, load_config, make_state_dir, parse_config

HTTPS = "endpoints: ['https://etcd.plant:2379'], tls: {ca: /etc/millwright/etcd-ca.pem}"


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        parse_config(text, "agent.yaml")
    return ei.value.problems


def test_the_default_etcd_is_refused_naming_etcd_insecure():
    p = problems("{}")
    assert p == [
        "agent.yaml: etcd.endpoints[0]: 'http://127.0.0.1:2379' is plaintext: use https:// with etcd.tls, "
        "or set etcd.insecure: true (tests and labs only)",
        "agent.yaml: etcd.username: etcd without credentials is refused: set etcd.username and etcd.password "
        "(or a client certificate in etcd.tls.cert and etcd.tls.key), or set etcd.insecure: true (tests and "
        "labs only)",
    ]


def test_tls_without_credentials_is_refused():
    p = problems(f"etcd: {{{HTTPS}}}")
    assert len(p) == 1 and p[0].startswith("agent.yaml: etcd.username: etcd without credentials"), p


def test_credentials_in_plaintext_are_refused():
    p = problems("etcd: {endpoints: ['http://e:2379', 'https://f:2379'], tls: {ca: /ca.pem}, username: u, "
                 "password: p}")
    assert len(p) == 1 and p[0].startswith("agent.yaml: etcd.endpoints[0]: 'http://e:2379' is plaintext"), p


@pytest.mark.parametrize("etcd", [
    f"{{{HTTPS}, username: agent.plant-a.gw-01, password: s3cret}}",
    "{endpoints: ['https://e:2379'], tls: {ca: /ca.pem, cert: /gw.pem, key: /gw.key}}",   # by certificate
    "{insecure: true}",                                                                  # a lab, said so
    "{endpoints: ['http://e:2379'], username: u, password: p, insecure: true}",
])
def test_secured_or_explicitly_insecure_etcd_is_accepted(etcd):
    assert parse_config(f"etcd: {etcd}\n", "agent.yaml").etcd


@pytest.mark.parametrize("etcd,key,words", [
    ("{endpoints: ['https://e:2379'], username: u, password: p}", "etcd.endpoints[0]", "needs etcd.tls.ca"),
    ("{endpoints: ['https://e:2379'], tls: {ca: /ca.pem, cert: /gw.pem}}", "etcd.tls.key", "cert and key go together"),
    ("{insecure: true, username: u}", "etcd.password", "username and password go together"),
])
def test_incomplete_access_settings_name_their_key(etcd, key, words):
    p = problems(f"etcd: {etcd}\n")
    assert any(x.startswith(f"agent.yaml: {key}: ") and words in x for x in p), p


def test_config_check_and_run_refuse_plaintext_etcd_with_one_line_each(tmp_path, capsys):
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("cluster: t\nmqtt: {insecure: true}\n")   # the etcd lines alone
    for argv in (["config", "check", str(cfg)], ["run", "-c", str(cfg)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 2 and all("etcd.insecure: true" in line for line in err), err
        assert "Traceback" not in "".join(err)


def write(path, text: str, mode: int) -> str:
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


SECURE = f"etcd: {{{HTTPS}, username: agent.t.gw-1, password: s3cret}}\n"


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_a_file_holding_a_password_is_refused_when_others_can_read_it(tmp_path, mode):
    path = write(tmp_path / "agent.yaml", SECURE, mode)
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    (line,) = ei.value.problems
    assert line == (f"{path}: mode {mode:04o} lets group or others read it, and it holds credentials "
                    f"(etcd.password); it must be owner-only (run: chmod 600 {path})")


def test_an_owner_only_file_with_a_password_and_a_readable_one_without_are_accepted(tmp_path):
    assert load_config(write(tmp_path / "a.yaml", SECURE, 0o600)).etcd.password == "s3cret"
    assert load_config(write(tmp_path / "b.yaml", "etcd: {insecure: true}\n", 0o644)).etcd.insecure


def test_every_password_is_named_and_a_writable_file_is_refused_whatever_it_holds(tmp_path):
    both = SECURE + "mqtt: {url: 'mqtts://b:8883', username: gw-1, password: m}\n"
    path = write(tmp_path / "c.yaml", both, 0o660)
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    assert ei.value.problems == [f"{path}: mode 0660 lets group or others write it, and it decides what jobs "
                                 f"run (run: chmod 600 {path})"]
    path = write(tmp_path / "d.yaml", both, 0o640)
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    assert "(etcd.password, mqtt.password)" in ei.value.problems[0]
    path = write(tmp_path / "e.yaml", "etcd: {insecure: true}\n", 0o646)
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    assert "lets group or others write it" in ei.value.problems[0]


def test_the_file_mode_is_reported_with_the_other_problems(tmp_path):
    path = write(tmp_path / "f.yaml", SECURE + "shards: 0\n", 0o644)
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    assert len(ei.value.problems) == 2 and "shards" in ei.value.problems[0] and "chmod 600" in ei.value.problems[1]


def test_a_missing_state_dir_is_created_owner_only_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        make_state_dir(str(tmp_path / "deep" / "state"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "deep" / "state").st_mode) == 0o700
    # an existing one is the operator's: left as it is
    os.chmod(tmp_path / "deep" / "state", 0o711)
    make_state_dir(str(tmp_path / "deep" / "state"))
    assert stat.S_IMODE(os.stat(tmp_path / "deep" / "state").st_mode) == 0o711


def test_a_state_dir_that_cannot_be_made_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError) as ei:
        make_state_dir(str(tmp_path / "file" / "state"))
    assert ei.value.problems[0].startswith("state_dir: cannot create ")
