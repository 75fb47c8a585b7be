"""The agent's "seen already" memories stop at their bound (they live for months)."""

import types

import pytest

from agent.runtime.recent import RecentMemory


def test_recent_memory_keeps_its_bound_and_forgets_the_oldest():
    m: RecentMemory[int, str] = RecentMemory(100)
    for i in range(10_000):
        m.remember(i, str(i))
        assert len(m) <= 100
    assert len(m) == 100 and m.forgotten == 9_900
    assert 9_899 not in m and 9_900 in m and m[9_999] == "9999"
    m.remember(9_900, "again")  # remembered again: now the newest, so it outlives 9_901
    m.remember(10_000, "x")
    assert 9_900 in m and 9_901 not in m and m.get(9_900) == "again" and m.get(9_901) is None


def test_recent_memory_refuses_a_bound_below_one():
    with pytest.raises(ValueError, match="at least 1"):
        RecentMemory(0)


def test_the_ingest_watch_memories_are_bounded(tmp_path):
    from agent.cloud.dispatch import Dispatcher
    from agent.cloud.topics import Topics
    from tests.support.link import FakeLink

    d = Dispatcher(types.SimpleNamespace(), FakeLink(), Topics("t", "a1"), owned=frozenset, grace_s=1.0, recent_max=20)
    kv = lambda key: types.SimpleNamespace(key=key, value=b"{}")  # noqa: E731
    ev = lambda key: types.SimpleNamespace(kind="put", kv=kv(key))  # noqa: E731
    d.on_job_events([ev(f"/mw/jobs/0001/j{i}") for i in range(300)], 1)
    d.on_answer_events([ev(f"/mw/answers/0001/j{i}/rejected.d{i}") for i in range(300)], 2)
    assert len(d._recent) == 20 and "j299" in d._recent and "j0" not in d._recent
    assert len(d._answered) == 20 and "j299/d299" in d._answered
