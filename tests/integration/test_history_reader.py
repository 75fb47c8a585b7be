"""The strict history reader (tests/support/history.py) against a real etcd: it returns
every event from revision 1, and fails instead of returning part of the history when
the history was compacted or etcd stops answering."""

from __future__ import annotations

import threading

import pytest

from agent.config import EtcdConfig
from agent.coordination.etcd import EtcdClient, EtcdUnavailable
from tests.support.history import HistoryError, read_history

P = "/millwright/h/"


@pytest.fixture
def client(etcd_server):
    c = EtcdClient(EtcdConfig(endpoints=[etcd_server.endpoint], request_timeout_s=2.0))
    yield c
    c.close()


def test_reads_every_revision_in_order(client):
    for i in range(300):
        client.put(f"{P}k{i % 7}", str(i))
    client.delete(f"{P}k0")
    evs = read_history(client, P, contiguous=True)
    assert [e.rev for e in evs] == list(range(2, 303))
    assert evs[-1].kind == "delete" and evs[-1].key == P + "k0"
    assert all(e.key != P + "test/history-end" for e in evs)


def test_a_compacted_history_fails(client):
    for i in range(20):
        rev = client.put(f"{P}k", str(i))
    c, _ = client.client()
    c.compact(rev - 5)
    with pytest.raises(HistoryError, match="compacted"):
        read_history(client, P)


def test_a_gap_fails_when_the_prefix_must_hold_every_revision(client):
    client.put(P + "a", "1")
    client.put("/elsewhere", "x")   # a revision outside the prefix
    client.put(P + "b", "2")
    assert len(read_history(client, P)) == 2
    with pytest.raises(HistoryError, match="gap in the history: revision 2 then 4"):
        read_history(client, P, contiguous=True)


def test_an_etcd_that_stops_answering_fails_instead_of_returning_a_part(client, etcd_server):
    for i in range(50):
        client.put(f"{P}k", str(i))
    threading.Timer(0.0, etcd_server.pause).start()
    try:
        # the sentinel write times out, or the stream stalls: either way no partial list
        with pytest.raises((HistoryError, EtcdUnavailable)):
            read_history(client, P, timeout=3.0)
    finally:
        etcd_server.resume()
