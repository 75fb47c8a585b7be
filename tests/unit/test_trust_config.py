"""Issue 16, files and settings: root templates need allow_root, passwords over plaintext
need insecure, param regexes that can backtrack catastrophically are refused, the audit's
config digest never covers a secret, keys can be retired, `millwright keygen`."""

from __future__ import annotations

import os
import stat

import pytest
import yaml

from agent.audit.events import config_digest, describe_config
from agent.config import ConfigError, parse_config
from agent.configcheck import mqtt_insecurities
from agent.jobs.paramregex import regex_risk
from agent.jobs.signing import KeyFileError, KeyRing, generate_hmac_secret, sign
from tests.support.commands import millwright


# the tree the tests come from (a checkout, or tests/unit's copy beside an installed .deb)
TREE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAB = "etcd: {insecure: true}\n"   # the loopback etcd of a lab: plaintext, no users


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        parse_config(text, "agent.yaml")
    return ei.value.problems


def test_root_template_needs_allow_root():
    p = problems("templates: {t: {argv: [/bin/true], user: root}}")
    assert any("templates.t.user" in x and "allow_root" in x for x in p), p
    assert parse_config(LAB + "templates: {t: {argv: [/bin/true], user: root, allow_root: true}}").templates["t"].allow_root
    assert parse_config(LAB + "templates: {t: {argv: [/bin/true], user: nobody}}")


def test_password_over_plaintext_is_an_error_unless_insecure():
    p = problems("etcd: {username: u, password: p}")
    assert any("etcd.endpoints[0]" in x and "insecure" in x for x in p), p
    # MQTT: refused where the broker is used (the agent, the MQTT commands, config check)
    p = mqtt_insecurities(parse_config(LAB + "mqtt: {url: 'mqtt://b:1883', username: u, password: p}", "agent.yaml"))
    assert any(x.startswith("agent.yaml: mqtt.url") and "insecure" in x for x in p), p
    assert parse_config("etcd: {username: u, password: p, insecure: true}")
    assert not mqtt_insecurities(parse_config(LAB + "mqtt: {url: 'mqtt://b:1883', username: u, password: p, insecure: true}"))
    assert parse_config("etcd: {endpoints: ['https://e:2379'], username: u, password: p, tls: {ca: /ca.pem}}")
    assert not mqtt_insecurities(parse_config(LAB + "mqtt: {url: 'mqtts://b:8883', username: u, password: p}"))


def test_config_check_names_every_problem_of_the_shipped_file_etcd_and_broker_alike():
    r = millwright("config", "check", "configs/agent.yaml", cwd=TREE)
    assert r.returncode == 2, r
    assert "Traceback" not in r.stderr
    for key in ("etcd.endpoints[0]", "etcd.username", "mqtt.url", "mqtt.username"):
        assert f"configs/agent.yaml: {key}:" in r.stderr, (key, r.stderr)


@pytest.mark.parametrize("rx", [r"(a+)+$", r"^(\w*x?)*$", r"(a|b+)*c", r"((ab)*)+", r"(.*,)*z"])
def test_nested_quantifiers_are_refused(rx):
    assert regex_risk(rx)
    p = problems(yaml.safe_dump({"templates": {"t": {"argv": ["/bin/echo", "{a}"], "params": {"a": rx}}}}))
    assert any("templates.t.params.a" in x and "backtrack" in x for x in p), p


@pytest.mark.parametrize("rx", [r"^[0-9]{1,2}$", r"fast|slow", r"^/[A-Za-z0-9/._-]+$", r"(?:ab){3}", r"^(a|b)c+$",
                                r"^[a-z]+(-[a-z]{2})?$"])
def test_plain_patterns_pass(rx):
    assert regex_risk(rx) is None


def test_config_digest_never_covers_secrets():
    a = parse_config("etcd: {endpoints: ['https://e:2379'], username: u, password: one, tls: {ca: /ca}}\n"
                     "mqtt: {url: 'mqtts://b:8883', username: m, password: alpha}\n")
    b = parse_config("etcd: {endpoints: ['https://e:2379'], username: u, password: two, tls: {ca: /ca}}\n"
                     "mqtt: {url: 'mqtts://b:8883', username: m, password: beta}\n")
    assert config_digest(a) == config_digest(b)   # a password change cannot be tested against the record
    c = parse_config("cluster: other\netcd: {endpoints: ['https://e:2379'], username: u, password: one, "
                     "tls: {ca: /ca}}\nmqtt: {url: 'mqtts://b:8883', username: m, password: alpha}\n")
    assert config_digest(a) != config_digest(c)   # a setting change still shows
    rec = repr(describe_config(a))
    assert "one" not in rec.replace("done", "") and "alpha" not in rec


def test_retired_after_in_the_keys_file():
    secret = generate_hmac_secret()
    ring = KeyRing.from_mapping({"k": {"alg": "hmac-sha256", "secret": secret,
                                       "retired_after": "2027-03-01T00:00:00Z"}})
    assert ring.get("k").retired_after.year == 2027
    with pytest.raises(KeyFileError) as ei:
        KeyRing.from_mapping({"k": {"alg": "hmac-sha256", "secret": secret, "retired_after": "next week"}})
    assert "retired_after" in ei.value.problems[0]


def test_keygen_writes_a_private_pair_and_prints_the_public_entry(tmp_path):
    out = tmp_path / "signer.yaml"
    r = millwright("keygen", "--kid", "cloud-7", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    entry = yaml.safe_load(r.stdout)
    assert set(entry["cloud-7"]) == {"alg", "public_key"} and entry["cloud-7"]["alg"] == "ed25519"
    signer = KeyRing.load(str(out), require_private=True)
    gateway = KeyRing.from_mapping(entry)           # gateways hold only the public key
    doc = sign({"v": 1, "id": "x"}, signer, "cloud-7")
    assert gateway.verify(doc).kid == "cloud-7"
    assert not gateway.get("cloud-7").can_sign
    again = millwright("keygen", "--kid", "cloud-7", "--out", str(out))
    assert again.returncode == 2 and "never overwrites" in again.stderr and "Traceback" not in again.stderr
