"""The test clusters' etcd survives a port taken between free_port() and its bind (a
concurrent run on the same host): it is made again on new ports, not left unhealthy."""

from __future__ import annotations

import socket

import agent.demo.services as services
from agent.demo.services import EtcdCluster


def test_a_member_whose_port_was_taken_gets_new_ports(monkeypatch, tmp_path):
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.2", 0))   # free on 127.0.0.1, taken on the member's other address
    taken.listen()
    port = taken.getsockname()[1]
    real = services.free_port
    handed: list[int] = []

    def free_port(host: str = "127.0.0.1") -> int:
        handed.append(port if not handed else real(host))
        return handed[-1]

    monkeypatch.setattr(services, "free_port", free_port)
    cluster = EtcdCluster(1, str(tmp_path / "etcd"), extra_hosts=("127.0.0.2",))
    try:
        assert cluster.members[0].port == port
        cluster.start(timeout=30)
        assert cluster.members[0].port != port
        assert cluster.leader().index == 0
    finally:
        cluster.close()
        taken.close()
