"""Broker profiles (issue 50, section 2): the limits of the plant's broker as configuration,
and `config check` refusing what the profile cannot carry, each line naming the key, the
value, the profile and the limit. Each refusal here would pass on a build that connected
first and let the broker drop what it cannot carry."""

from __future__ import annotations

import pytest

from agent.cli import main
from agent.brokerlimits import PROFILES, effective_profile
from agent.cloud.profile import check_profile, subscriptions
from agent.config import ConfigError, MqttConfig, parse_config

LAB = "etcd: {insecure: true}\n"


def cfg(text: str = "", profile: str = "aws-iot-core", mqtt: str = ""):
    return parse_config(f"{LAB}mqtt: {{insecure: true, profile: {profile}{', ' + mqtt if mqtt else ''}}}\n{text}",
                        "agent.yaml")


def refused(text: str = "", profile: str = "aws-iot-core", mqtt: str = "") -> list[str]:
    """What `config check` (load with the broker's checks) refuses."""
    try:
        parse_config(f"{LAB}mqtt: {{insecure: true, profile: {profile}{', ' + mqtt if mqtt else ''}}}\n{text}",
                     "agent.yaml", broker=True, broker_checks=(check_profile,))
    except ConfigError as exc:
        return exc.problems
    return []


def gates(n: int) -> str:
    lines = "".join(f"      g{i}: {{mqtt: plant/line/{i}, equals: open}}\n" for i in range(n))
    return f"templates:\n  t:\n    argv: [/bin/true]\n    gates:\n{lines}"


def test_aws_iot_core_is_its_published_quotas():
    p = PROFILES["aws-iot-core"]
    assert (p.protocols, p.max_qos, p.max_payload_bytes, p.publish_rate, p.max_inflight) == (("3.1.1", "5"), 1,
                                                                                             131072, 100.0, 100)
    assert (p.max_topic_levels, p.max_topic_bytes, p.session_expiry_max_s) == (8, 256, 604800)
    assert (p.subs_per_connection, p.subs_per_subscribe, p.client_id_max_bytes) == (50, 8, 128)
    assert set(PROFILES) == {"mosquitto", "aws-iot-core", "nats-2.9", "rabbitmq-3.10"}
    assert not PROFILES["rabbitmq-3.10"].retained_wildcard
    assert cfg(profile="mosquitto").mqtt.profile == parse_config(LAB).mqtt.profile == "mosquitto"


def test_aws_iot_core_accepts_a_normal_config():
    assert refused("cluster: plant-7\nagent_id: gw-0042.line3\n" + gates(3)) == []


def test_aws_iot_core_refuses_a_cluster_and_agent_id_too_long_for_a_128_character_job_id():
    # millwright/<c>/agents/<a>/status/<128 chars>: 155 bytes besides the ids, 256 at most
    assert refused(f"cluster: {'c' * 50}\nagent_id: {'a' * 51}\n") == []
    (line,) = refused(f"cluster: {'c' * 50}\nagent_id: {'a' * 52}\n")
    assert line.startswith(f"agent.yaml: agent_id: '{'a' * 52}' with cluster '{'c' * 50}' makes the topic "
                           "millwright/<c>/agents/<agent_id>/status/<job_id> 257 bytes"), line
    assert "aws-iot-core" in line and "256" in line and "101 bytes together" in line


def test_a_protocol_the_profile_lacks_is_refused():
    c = cfg(profile="nats-2.9")
    assert check_profile(c) == []
    (line,) = check_profile(c, protocol="5")
    assert line == ("agent.yaml: mqtt.protocol: '5' is not spoken by broker profile nats-2.9 (mqtt.limits.protocols): "
                    "it speaks MQTT 3.1.1")
    assert check_profile(cfg(profile="nats-2.9", mqtt="limits: {protocols: ['3.1.1', '5']}"), protocol="5") == []


def test_payloads_over_the_profile_limit_are_refused():
    (line,) = refused(profile="rabbitmq-3.10", mqtt="max_payload_bytes: 100000")
    assert line == ("agent.yaml: mqtt.max_payload_bytes: 100000 (the largest push accepted) is over the payload limit "
                    "of 65536 bytes of broker profile rabbitmq-3.10 (mqtt.limits.max_payload_bytes)")
    lines = refused(profile="mosquitto", mqtt="get_page_bytes: 20000, limits: {max_payload_bytes: 16384}")
    assert [x.split(": ")[1] for x in lines] == ["mqtt.max_payload_bytes", "mqtt.get_page_bytes", "mqtt.profile"]
    assert "20000 (the largest jobs/get answer)" in lines[1] and "mqtt.limits.max_payload_bytes of broker " \
        "profile mosquitto" in lines[1]
    assert "a status document may take 32768 bytes" in lines[2]


def test_a_client_id_over_the_limit_is_refused():
    (line,) = refused(mqtt=f"client_id: {'x' * 129}")
    assert line.startswith(f"agent.yaml: mqtt.client_id: the client id '{'x' * 129}' is 129 bytes, over the 128 of "
                           "broker profile aws-iot-core (mqtt.limits.client_id_max_bytes)"), line
    assert refused(mqtt=f"client_id: {'x' * 128}") == []


def test_more_subscriptions_than_the_profile_allows_are_refused():
    # push, cancel, jobs/get and the gate topics (no agent's statuses): 50 at most
    assert subscriptions(cfg(gates(47))) == 50 and refused(gates(47)) == []
    (line,) = refused(gates(48))
    assert line.startswith("agent.yaml: templates: the connection subscribes to 51 filters"), line
    assert "over the 50 of broker profile aws-iot-core (mqtt.limits.subs_per_connection)" in line
    # the ignored peers user changes nothing
    assert refused(gates(47), mqtt="peers_username: peers") == []


def test_gate_topics_too_long_or_too_deep_are_refused():
    deep = "/".join("l" * 9)
    text = f"templates:\n  t:\n    argv: [/bin/true]\n    gates:\n      g: {{mqtt: '{deep}', equals: open}}\n"
    (line,) = refused(text)
    assert line.startswith("agent.yaml: templates.t.gates.g.mqtt: the topic l/l/l/l/l/l/l/l/l has 9 levels, "
                           "over the 8 of broker profile aws-iot-core"), line
    text = f"templates:\n  t:\n    argv: [/bin/true]\n    gates:\n      g: {{mqtt: '{'p' * 257}', equals: open}}\n"
    assert refused(text)[0].startswith("agent.yaml: templates.t.gates.g.mqtt: the topic 'ppp")


def test_mqtt_limits_overrides_single_limits():
    long_ids = f"cluster: {'c' * 64}\nagent_id: {'a' * 128}\n"
    assert refused(long_ids, mqtt="client_id: gw, limits: {max_topic_bytes: null}") == []
    assert refused(long_ids, profile="mosquitto") == []
    (line,) = refused(long_ids, profile="mosquitto", mqtt="limits: {max_topic_bytes: 300}")
    assert "over the 300 of mqtt.limits.max_topic_bytes of broker profile mosquitto" in line
    (line,) = refused(profile="mosquitto", mqtt="limits: {max_topic_levels: 5}")
    assert line.startswith("agent.yaml: mqtt.limits.max_topic_levels: the topic "
                           "millwright/<c>/agents/<agent_id>/status/<job_id> has 6 levels, over the 5"), line
    p = effective_profile(cfg(mqtt="limits: {publish_rate: 20, max_inflight: 10, retained_wildcard: false}").mqtt)
    assert (p.name, p.publish_rate, p.max_inflight, p.retained_wildcard, p.max_topic_bytes) == (
        "aws-iot-core", 20.0, 10, False, 256)
    assert PROFILES["aws-iot-core"].publish_rate == 100.0   # the table is left as it was


@pytest.mark.parametrize("limits, problem", [
    ("{foo: 1}", "mqtt.limits.foo: unknown limit (known: protocols, max_qos, "),
    ("{max_qos: one}", "mqtt.limits.max_qos: 'one': expected 0, 1 or 2"),
    ("{max_qos: 3}", "mqtt.limits.max_qos: 3: expected 0, 1 or 2"),
    ("{protocols: ['4']}", "mqtt.limits.protocols: ['4']: expected a non-empty list of '3.1.1' and '5'"),
    ("{retained_wildcard: 1}", "mqtt.limits.retained_wildcard: 1: expected true or false"),
    ("{max_inflight: null}", "mqtt.limits.max_inflight: may not be null"),
    ("{max_topic_bytes: true}", "mqtt.limits.max_topic_bytes: True: expected an integer of at least 1, or null"),
    ("{publish_rate: 0}", "mqtt.limits.publish_rate: 0: expected a number of publishes per second greater than 0"),
])
def test_an_unknown_limit_or_a_wrong_type_is_a_config_error(limits, problem):
    with pytest.raises(ConfigError) as err:
        cfg(mqtt=f"limits: {limits}")   # without the broker's checks too: the config is wrong anywhere
    (line,) = err.value.problems
    assert line.startswith("agent.yaml: " + problem), line


def test_an_unknown_profile_is_a_config_error_once():
    (line,) = refused(profile="hivemq")
    assert line == ("agent.yaml: mqtt.profile: 'hivemq' is not a broker profile (known: mosquitto, aws-iot-core, "
                    "nats-2.9, rabbitmq-3.10)")
    with pytest.raises(ConfigError):
        effective_profile(MqttConfig(profile="hivemq"))


def test_a_session_expiry_over_the_maximum_is_refused():
    c = cfg()
    assert check_profile(c, session_expiry_s=604800) == []
    (line,) = check_profile(c, session_expiry_s=604801)
    assert line == ("agent.yaml: mqtt.session_expiry_s: 604801 is over the 604800 s of broker profile aws-iot-core "
                    "(mqtt.limits.session_expiry_max_s)")


def test_config_check_refuses_what_the_profile_cannot_carry(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("MILLWRIGHT_CONFIG", raising=False)
    path = tmp_path / "agent.yaml"
    path.write_text(f"{LAB}mqtt: {{insecure: true, profile: aws-iot-core, max_payload_bytes: 200000, "
                    f"get_page_bytes: 8192}}\ncluster: plant\nagent_id: {'a' * 100}\n")
    path.chmod(0o600)
    code = main(["config", "check", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", out
    lines = err.splitlines()
    assert [x.split(": ")[3] for x in lines] == ["mqtt.max_payload_bytes", "agent_id"], err
    assert all(x.startswith(f"millwright: config: {path}: ") and "aws-iot-core" in x for x in lines), err
    assert "200000" in lines[0] and "131072" in lines[0] and "256" in lines[1]
    assert "Traceback" not in err
    path.write_text(f"{LAB}mqtt: {{insecure: true, profile: aws-iot-core}}\ncluster: plant\nagent_id: gw-1\n")
    assert main(["config", "check", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"{path}: ok (cluster plant, agent gw-1,")


def test_an_agent_and_push_do_not_start_on_a_config_the_profile_refuses():
    """The start-up check the cloud component and `millwright push` make (require_fit)
    refuses what `config check` refuses; the default profile (mosquitto) has no limits."""
    from agent.cloud.profile import require_fit

    require_fit(cfg("cluster: plant-7\nagent_id: gw-1\n"))
    require_fit(cfg(f"cluster: {'c' * 50}\nagent_id: {'a' * 52}\n", profile="mosquitto"))
    with pytest.raises(ConfigError) as exc:
        require_fit(cfg(f"cluster: {'c' * 50}\nagent_id: {'a' * 52}\n"))
    assert any("257 bytes" in line and "aws-iot-core" in line for line in exc.value.problems)


def test_the_config_s_protocol_and_session_expiry_are_what_is_checked():
    """By default the check reads what the link will request: mqtt.protocol, and on MQTT 5
    mqtt.session_expiry_s (3.1.1 requests no expiry)."""
    (line,) = check_profile(cfg(profile="nats-2.9", mqtt="protocol: '5'"))
    assert "mqtt.protocol: '5' is not spoken by broker profile nats-2.9" in line
    assert check_profile(cfg(mqtt="protocol: '3.1.1', session_expiry_s: 999999")) == []
    (line,) = check_profile(cfg(mqtt="protocol: '5', session_expiry_s: 999999"))
    assert line.startswith("agent.yaml: mqtt.session_expiry_s: 999999 is over the 604800 s")
    assert refused(profile="aws-iot-core", mqtt="protocol: '5', session_expiry_s: 999999") == [line]
