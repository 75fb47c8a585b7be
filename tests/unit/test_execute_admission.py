"""Admission control and limit arithmetic: pure logic."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.config import ExecuteConfig, Resources
from agent.execute import ADMITTED, REJECTED, WAITING, Admission, Budget, Demand, Limits, default_limits, effective_limits
from agent.execute.admission import AdmissionError
from agent.runtime.metrics import sample


def test_runs_that_fit_are_admitted_and_others_wait_in_due_order():
    a = Admission(Budget(max_concurrent=2, memory_mb=512, cpu=2.0))
    assert a.request("r1", 10, Demand(128, 0.5)) == ADMITTED
    assert a.request("r2", 11, Demand(128, 0.5)) == ADMITTED
    assert a.request("late", 30, Demand(64, 0.1)) == WAITING       # concurrency full
    assert a.request("early", 20, Demand(64, 0.1)) == WAITING
    assert a.waiting_keys() == ["early", "late"]
    assert sample("millwright_runs_waiting") == 2
    assert a.release("r1") == ["early"]
    assert a.release("r2") == ["late"]
    assert a.waiting_keys() == [] and set(a.running) == {"early", "late"}


def test_head_of_line_is_not_overtaken_by_smaller_runs():
    a = Admission(Budget(max_concurrent=4, memory_mb=256, cpu=4.0))
    assert a.request("a", 1, Demand(200, 1)) == ADMITTED
    assert a.request("big", 2, Demand(200, 1)) == WAITING
    assert a.request("small", 3, Demand(10, 1)) == WAITING          # would fit, but big is first
    assert a.release("a") == ["big", "small"]


def test_memory_and_cpu_are_never_overcommitted():
    a = Admission(Budget(max_concurrent=10, memory_mb=300, cpu=1.0))
    assert a.request("m1", 1, Limits(cpu=0.2, memory_mb=200)) == ADMITTED
    assert a.request("m2", 2, Limits(cpu=0.2, memory_mb=200)) == WAITING   # memory
    a.cancel("m2")
    assert a.request("c1", 3, Limits(cpu=0.8, memory_mb=10)) == ADMITTED
    assert a.request("c2", 4, Limits(cpu=0.1, memory_mb=10)) == WAITING    # cpu
    assert a.release("m1") == ["c2"]


def test_a_run_larger_than_the_node_is_rejected_not_queued_forever():
    a = Admission(Budget(max_concurrent=2, memory_mb=256, cpu=1.0))
    assert a.request("huge", 1, Demand(512, 0.1)) == REJECTED
    assert "exceeds the node budget" in a.never_fits(Demand(512, 0.1))
    assert a.request("fast", 1, Demand(1, 1.5)) == REJECTED
    assert not a.is_waiting("huge") and "huge" not in a.running


def test_cancel_of_the_head_lets_the_next_in():
    a = Admission(Budget(max_concurrent=1, memory_mb=100, cpu=1))
    a.request("x", 1, Demand(100, 1))
    a.request("y", 2, Demand(1, 0.1))
    a.release("x")
    assert set(a.running) == {"y"}
    a2 = Admission(Budget(max_concurrent=2, memory_mb=100, cpu=1))
    a2.request("x", 1, Demand(60, 0.1))
    a2.request("head", 2, Demand(60, 0.1))
    a2.request("next", 3, Demand(30, 0.1))
    assert a2.cancel("head") == ["next"]
    assert a2.cancel("unknown") == []


def test_duplicate_keys_are_an_error():
    a = Admission(Budget(1, 100, 1))
    a.request("k", 1, Demand(1, 0.1))
    with pytest.raises(AdmissionError):
        a.request("k", 2, Demand(1, 0.1))
    a.release("unknown-key")   # ignored
    with pytest.raises(AdmissionError):
        Admission(Budget(0, 100, 1))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 200), st.floats(0.05, 1.0), st.integers(0, 50)),
                min_size=1, max_size=60), st.integers(0, 2 ** 31))
def test_random_workloads_never_overcommit_and_admit_in_due_order(ops, seed):
    rnd = random.Random(seed)
    b = Budget(max_concurrent=3, memory_mb=400, cpu=1.5)
    a = Admission(b)
    admitted_order: list[tuple[float, int]] = []
    dues = {}
    n = 0
    for kind, mem, cpu, due in ops:
        if kind < 2 or not a.running:
            key = f"k{n}"
            n += 1
            dues[key] = (due, n)
            got = a.request(key, due, Demand(mem, cpu))
            if got == ADMITTED:
                admitted_order.append(dues[key])
        elif kind == 2:
            for k in a.release(rnd.choice(sorted(a.running))):
                admitted_order.append(dues[k])
        else:
            w = a.waiting_keys()
            if w:
                for k in a.cancel(rnd.choice(w)):
                    admitted_order.append(dues[k])
        assert len(a.running) <= b.max_concurrent
        assert sum(d.memory_mb for d in a.running.values()) <= b.memory_mb + 1e-6
        assert sum(d.cpu for d in a.running.values()) <= b.cpu + 1e-6
        # whoever waits has a due time no earlier than... the head cannot fit right now
        w = a.waiting_keys()
        if w:
            assert [dues[k] for k in w] == sorted(dues[k] for k in w)
            assert not a.fits(a._waiting[w[0]][2])
    while a.running:
        for k in a.release(next(iter(a.running))):
            admitted_order.append(dues[k])
    assert not a.waiting_keys()   # everything that fits the node eventually runs


def test_effective_limits_take_the_smaller_and_fill_defaults():
    tpl = Resources(cpu=1.0, memory_mb=256, pids=32)
    assert effective_limits({"cpu": 0.5, "memory_mb": 512, "pids": 64}, tpl) == Limits(0.5, 256, 32)
    assert effective_limits(None, tpl) == Limits(1.0, 256, 32)
    assert effective_limits({"memory_mb": 64}, Resources()) == Limits(None, 64, None)
    d = default_limits(ExecuteConfig(max_concurrent=4, memory_mb=512, cpu=1.0))
    assert d == Limits(0.25, 128, 512)
    assert effective_limits({}, Resources(pids=8), d) == Limits(0.25, 128, 8)
    assert Limits(memory_mb=2).memory_bytes == 2 << 20 and Limits().memory_bytes is None
    assert Budget.from_config(ExecuteConfig()) == Budget(4, 512.0, 1.0)
