"""The fault test's etcd proxy (tests/support/etcd_proxy.py) against a real etcd: held
requests reach etcd after their writer gave up on them (the late write only a fence can
refuse), held replies reach the client late, and a healed proxy passes traffic again."""

from __future__ import annotations

import threading

import pytest

from agent.config import EtcdConfig
from agent.coordination.etcd import Create, EtcdClient, EtcdUnavailable, Put
from agent.demo.services import free_port
from tests.support.etcd_proxy import ReplyProxy
from tests.support.waiting import wait_for

P = "/millwright/proxy/"


@pytest.fixture
def proxied(etcd_server):
    proxy = ReplyProxy("127.0.0.1", free_port(), ("127.0.0.1", etcd_server.port)).start()
    via = EtcdClient(EtcdConfig(endpoints=[f"http://127.0.0.1:{proxy.port}"], request_timeout_s=1.0))
    direct = EtcdClient(EtcdConfig(endpoints=[etcd_server.endpoint], request_timeout_s=2.0))
    via.put(P + "warm", "1")   # the client's connection is up before the fault
    try:
        yield proxy, via, direct
    finally:
        proxy.set_mode("pass")
        via.close()
        direct.close()
        proxy.close()


def test_a_held_request_lands_after_its_writer_gave_up(proxied):
    proxy, via, direct = proxied
    proxy.set_mode("hold_requests")
    # a put and a transaction on the client's connection, both given up by the client
    errors: list = []

    def call(fn, *args) -> None:
        try:
            fn(*args)
        except EtcdUnavailable as exc:
            errors.append(exc)

    calls = [threading.Thread(target=call, args=(via.put, P + "late", "written while held")),
             threading.Thread(target=call, args=(via.txn, [Create(P + "late-txn") == 0], [Put(P + "late-txn", "1")]))]
    for t in calls:
        t.start()
    for t in calls:
        t.join(10)
    assert len(errors) == 2, errors
    assert direct.get(P + "late") is None and direct.get(P + "late-txn") is None
    proxy.set_mode("pass")
    # its cancel was lost with the delay: etcd runs the request the client no longer waits for
    wait_for(lambda: direct.get(P + "late") is not None and direct.get(P + "late-txn") is not None, 10,
             what="the held requests to land after the heal")
    assert direct.get(P + "late").value == b"written while held"
    via.put(P + "after", "2")   # and the client goes on through the healed proxy
    assert direct.get(P + "after").value == b"2"


def test_a_held_reply_comes_late_and_its_request_landed(proxied):
    proxy, via, direct = proxied
    proxy.set_mode("hold")
    with pytest.raises(EtcdUnavailable):
        via.put(P + "answered-late", "x")
    assert direct.get(P + "answered-late").value == b"x"
    proxy.set_mode("pass")
    via.put(P + "after", "3")
    assert direct.get(P + "after").value == b"3"
