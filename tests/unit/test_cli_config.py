"""Which config a command reads (issue 39): ``-c FILE``, else ``$MILLWRIGHT_CONFIG``, else
the packaged ``/etc/millwright/agent.yaml``; with none of them, one line naming all three,
never the built-in defaults (system paths) in silence. Each test here fails on a build
where the commands took only ``-c`` and `audit verify` fell back to the defaults."""

from __future__ import annotations

import pytest

import agent.config
from agent.audit import AuditLog
from agent.cli import main

# every command that reads the agent config, with the arguments it needs besides it
COMMANDS = [
    ["run"], ["status"], ["jobs", "list"], ["jobs", "show", "j1"], ["runs", "j1"], ["logs", "j1"],
    ["push", "job.json", "--key-file", "k.yaml", "--kid", "k"], ["cancel", "j1", "--key-file", "k.yaml", "--kid", "k"],
    ["get", "j1", "--key-file", "k.yaml", "--kid", "k"], ["audit", "verify"], ["audit", "show"],
    ["config", "check"], ["broker", "settings"],
]


@pytest.fixture
def no_default(monkeypatch, tmp_path):
    """No packaged config on this host, and no MILLWRIGHT_CONFIG from the caller."""
    monkeypatch.setattr(agent.config, "DEFAULT_CONFIG", str(tmp_path / "etc-millwright-agent.yaml"))
    monkeypatch.delenv("MILLWRIGHT_CONFIG", raising=False)
    return str(tmp_path / "etc-millwright-agent.yaml")


def run(capsys, argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_each_command_reads_the_file_millwright_config_names(argv, capsys, monkeypatch, tmp_path, no_default):
    bad = tmp_path / "from-env.yaml"
    bad.write_text("etcd: {insecure: true}\nno_such_key: 1\n")
    monkeypatch.setenv("MILLWRIGHT_CONFIG", str(bad))
    code, _, err = run(capsys, argv)
    assert code == 2 and err.startswith(f"millwright: config: {bad}: ") and "no_such_key" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_without_any_config_each_command_says_what_it_looked_for(argv, capsys, no_default):
    code, out, err = run(capsys, argv)
    assert code == 2 and out == ""
    assert err == (f"millwright: config: no config file: no -c FILE, MILLWRIGHT_CONFIG is not set and {no_default} "
                   f"does not exist (give -c FILE or export MILLWRIGHT_CONFIG=FILE)\n")


def test_a_missing_file_named_by_the_variable_is_named(capsys, monkeypatch, tmp_path, no_default):
    monkeypatch.setenv("MILLWRIGHT_CONFIG", str(tmp_path / "typo.yaml"))
    code, _, err = run(capsys, ["jobs", "list"])
    assert code == 2 and err == f"millwright: config: MILLWRIGHT_CONFIG={tmp_path / 'typo.yaml'}: config file not found\n"


def test_dash_c_wins_over_the_variable_and_the_variable_over_the_default(capsys, monkeypatch, tmp_path, no_default):
    for name in ("c.yaml", "env.yaml", "default.yaml"):
        (tmp_path / name).write_text(f"cluster: {name.split('.')[0]}\netcd: {{insecure: true}}\n"
                                     "mqtt: {insecure: true}\n")
    monkeypatch.setattr(agent.config, "DEFAULT_CONFIG", str(tmp_path / "default.yaml"))
    assert "(cluster default," in run(capsys, ["config", "check"])[1]
    monkeypatch.setenv("MILLWRIGHT_CONFIG", str(tmp_path / "env.yaml"))
    assert "(cluster env," in run(capsys, ["config", "check"])[1]
    assert "(cluster c," in run(capsys, ["config", "check", str(tmp_path / "c.yaml")])[1]


def test_audit_verify_uses_the_config_of_the_variable(capsys, monkeypatch, tmp_path, no_default):
    log = AuditLog(str(tmp_path / "audit"), str(tmp_path / "audit.key"), agent_id="gw-1")
    log.job("accepted", "j1", shard=1)
    log.close()
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"etcd: {{insecure: true}}\naudit: {{dir: {tmp_path / 'audit'}, key_file: {tmp_path / 'audit.key'}}}\n")
    monkeypatch.setenv("MILLWRIGHT_CONFIG", str(cfg))
    code, out, _ = run(capsys, ["audit", "verify"])
    assert code == 0 and out.startswith("ok: "), out
    code, out, _ = run(capsys, ["audit", "show", "--job", "j1"])
    assert code == 0 and "event=accepted" in out


def test_a_copied_audit_directory_needs_no_config(capsys, tmp_path, no_default):
    log = AuditLog(str(tmp_path / "copy"), str(tmp_path / "copy.key"), agent_id="gw-1")
    log.job("accepted", "j1", shard=1)
    log.close()
    code, out, err = run(capsys, ["audit", "verify", str(tmp_path / "copy"), "--key-file", str(tmp_path / "copy.key")])
    assert code == 0 and out.startswith("ok: "), err
    code, _, err = run(capsys, ["audit", "show", str(tmp_path / "copy")])
    assert code == 0, err
    code, _, err = run(capsys, ["audit", "verify", str(tmp_path / "copy")])   # the key comes from a config
    assert code == 2 and "no config file" in err


def test_config_check_warns_about_a_template_user_that_does_not_exist(capsys, tmp_path, no_default):
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("etcd: {insecure: true}\nmqtt: {insecure: true}\ntemplates:\n"
                   "  ok: {argv: [/bin/true], user: nobody}\n  missing: {argv: [/bin/true], user: no-such-user-39}\n")
    code, out, _ = run(capsys, ["config", "check", str(cfg)])
    warnings = [line for line in out.splitlines() if line.startswith("warning: ") and "rollout" not in line]
    assert code == 0 and len(warnings) == 1, out
    assert warnings[0].startswith("warning: templates.missing.user: no user 'no-such-user-39' on this host: its runs "
                                  "would fail here (spawn_error)")


def test_config_check_warns_that_the_peers_keys_are_ignored(capsys, tmp_path, no_default):
    """A config written for an older agent (a peers user) still loads: each peers key is
    said to be ignored, a warning, not an error."""
    cfg = tmp_path / "agent.yaml"
    secure = "etcd: {insecure: true}\nmqtt: {url: 'mqtts://b:8883', username: gw-1, password: p, tls: {ca: /ca}"
    for extra, expected in (("}", []), (", peers_username: gw-1-peers}", ["mqtt.peers_username"]),
                            (", peers_username: gw-1, peers_password: q}", ["mqtt.peers_username",
                                                                             "mqtt.peers_password"])):
        cfg.write_text(secure + extra + "\n")
        cfg.chmod(0o600)   # it holds a password
        code, out, err = run(capsys, ["config", "check", str(cfg)])
        warnings = [line for line in out.splitlines() if line.startswith("warning: ") and ": ignored:" in line]
        assert code == 0 and [w.split(": ")[2] for w in warnings] == expected, (out, err)


def test_config_check_says_where_rollout_limits_are_advisory(capsys, tmp_path, no_default):
    """Staged rollouts hold against a gateway's credentials only with the agent's own etcd
    user that etcd-rbac.sh confines to its rollout keys: etcd.insecure, or another user
    name, is said (a warning, not an error)."""
    cfg = tmp_path / "agent.yaml"
    https = "endpoints: ['https://e:2379'], tls: {ca: /ca}"
    for etcd, expected in (("{insecure: true}", "etcd.insecure"),
                           (f"{{{https}, username: cloud, password: p}}", "etcd.username: 'cloud'"),
                           (f"{{{https}, username: agent.c.gw-1, password: p}}", None)):
        cfg.write_text(f"cluster: c\nagent_id: gw-1\netcd: {etcd}\nmqtt: {{insecure: true}}\n")
        cfg.chmod(0o600)
        code, out, err = run(capsys, ["config", "check", str(cfg)])
        warnings = [line for line in out.splitlines() if line.startswith("warning: ") and "advisory" in line]
        assert code == 0, (out, err)
        if expected is None:
            assert warnings == [], out
        else:
            assert len(warnings) == 1 and expected in warnings[0], out


def test_config_check_says_what_job_isolation_cannot_hide_whole(capsys, tmp_path, no_default):
    """Issue 54: a secret directly in a directory runs share is covered alone (a rename
    would uncover it) and an admin socket there cannot be hidden (a root agent refuses)."""
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("etcd: {insecure: true}\nmqtt: {insecure: true}\nsigning: {keys_file: /etc/mw-keys.yaml}\n"
                   "admin: {socket: /run/mw-admin.sock}\n")
    code, out, _ = run(capsys, ["config", "check", str(cfg)])
    lines = [line for line in out.splitlines() if "isolation" in line or "hidden" in line]
    assert code == 0 and len(lines) == 2, out
    assert lines[0].startswith("error (a root agent will not start): admin.socket: /run/mw-admin.sock cannot be hidden")
    assert lines[1].startswith("warning: signing.keys_file: /etc/mw-keys.yaml is hidden from runs as a file only "
                               "(/etc is a system directory runs share)")


def test_push_issued_at_fills_a_file_without_one_and_must_agree_with_one_that_has_it():
    from agent.cli import UserError
    from agent.cloud.cli import with_issued_at

    assert with_issued_at({"id": "j"}, None) == {"id": "j"}
    assert with_issued_at({"id": "j"}, "2026-12-02T12:00:00Z") == {"id": "j", "issued_at": "2026-12-02T12:00:00Z"}
    same = {"id": "j", "issued_at": "2026-12-02T12:00:00Z"}
    assert with_issued_at(same, "2026-12-02T12:00:00Z") == same
    with pytest.raises(UserError, match="the document says issued_at"):
        with_issued_at(same, "2026-12-02T12:00:01Z")
    with pytest.raises(UserError, match="not an RFC 3339 time"):
        with_issued_at({"id": "j"}, "yesterday")


def test_a_root_agent_refuses_to_start_with_an_admin_socket_runs_could_reach(capsys, tmp_path, no_default):
    import os

    if os.geteuid() != 0:
        pytest.skip("the refusal is a root agent's (runs are isolated only then)")
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("etcd: {insecure: true}\nmqtt: {insecure: true}\nadmin: {socket: /run/mw-admin.sock}\n")
    code, out, err = run(capsys, ["run", "-c", str(cfg)])
    assert code == 2 and "admin.socket: /run/mw-admin.sock cannot be hidden from root runs" in err, (out, err)
