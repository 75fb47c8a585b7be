"""Shared fixtures: a real etcd and a real mosquitto on loopback (helpers: tests/support/)."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from agent.demo.services import EtcdCluster, EtcdServer, MosquittoServer  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests check behaviour, not speed: hypothesis's per-example deadline (200 ms) is a
# timing threshold, and a loaded 2-core gateway or CI host misses it for no fault of the code.
settings.register_profile("millwright", deadline=None)
settings.load_profile("millwright")


@pytest.fixture
def etcd_server(tmp_path):
    """A fresh etcd per test; supports stop(), start(), restart(), pause(), resume()."""
    with EtcdServer(str(tmp_path / "etcd")) as srv:
        yield srv


@pytest.fixture
def etcd_cluster(tmp_path):
    """A real 3-member etcd cluster on loopback; members can be killed, paused and restarted
    (``cluster.leader()``, ``member.kill()``, ``member.start()``, ``cluster.wait_healthy()``)."""
    with EtcdCluster(3, str(tmp_path / "etcd-cluster")) as cluster:
        yield cluster


@pytest.fixture
def mosquitto_server(tmp_path):
    """A fresh mosquitto per test, with persistence: persistent sessions survive restart()."""
    with MosquittoServer(str(tmp_path / "mosquitto")) as srv:
        yield srv


def pytest_collection_finish(session):
    """The arm64 tier runs beside the rest of the session when it is selected
    (tests/support/arm64.py): started here, waited for by its test."""
    from tests.support import arm64
    if (not session.config.option.collectonly and arm64.selected([item.nodeid for item in session.items])
            and arm64.can_run()):
        arm64.start()


def pytest_sessionfinish(session, exitstatus):
    from tests.support import arm64
    arm64.finish()
