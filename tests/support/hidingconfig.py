"""The agent config of the hiding tests (tests/kernel/test_hiding.py, the plan's unit
tests): every secret in a directory of its own under ``top``, the admin socket where given."""

from __future__ import annotations

import os

from agent.config import TLSConfig, parse_config


def write_file(path: str, text: str, mode: int = 0o644) -> None:
    with open(path, "w") as fh:
        fh.write(text)
    os.chmod(path, mode)   # readable by everyone on the host: only the namespace hides it


def make_config(top: str, admin: str, etcd_endpoint: str, mqtt_url: str):
    etc = os.path.join(top, "etc")
    os.makedirs(etc)
    source = os.path.join(etc, "agent.yaml")
    text = (f"cluster: c\nagent_id: gw-hide\n"
            f"etcd: {{insecure: true, endpoints: ['{etcd_endpoint}']}}\n"
            f"mqtt: {{url: '{mqtt_url}', insecure: true}}\n"
            f"state_dir: {top}/state\n"
            f"signing: {{keys_file: {etc}/keys.yaml}}\n"
            f"audit: {{dir: {top}/state/audit, key_file: {etc}/audit.key}}\n"
            f"admin: {{socket: {admin}}}\n")
    write_file(source, text)
    write_file(os.path.join(etc, "keys.yaml"), "secret keys, first\n")
    cfg = parse_config(text, source)
    # a client key provisioned later, in a directory that does not exist yet
    cfg.etcd.tls = TLSConfig(key=os.path.join(top, "tls", "agent.key"))
    return cfg
