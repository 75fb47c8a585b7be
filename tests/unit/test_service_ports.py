"""Test services listen on ports below the kernel's ephemeral range, so one stopped and
started again on its port (a broker outage) never finds it taken by an outgoing
connection's local port."""

from __future__ import annotations

import socket

from agent.demo import services


def test_free_ports_are_below_the_ephemeral_range_and_bindable():
    low = services._ephemeral_low()
    ports = {services.free_port() for _ in range(20)}
    assert all(services.LISTEN_PORTS_FROM <= p < low for p in ports)
    assert len(ports) > 1   # picked at random, not one fixed port
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_taken_port_is_not_handed_out(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", services.free_port()))
    taken.listen()
    first, free = taken.getsockname()[1], services.free_port()
    try:
        picks = iter([first, free])

        class Fixed:
            def randrange(self, a, b):
                return next(picks)

        monkeypatch.setattr(services.random, "SystemRandom", Fixed)
        assert services.free_port() == free
    finally:
        taken.close()
