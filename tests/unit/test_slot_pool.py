"""The run slot pool's own logic (agent/execute/backends/pool.py) on a backend of our own
whose slots are bookkeeping: what is reused, what is removed, and that the pool never
keeps more than its size. The kernel side (real cgroups reused) is in
tests/kernel/test_quota_cgroup1.py."""

from __future__ import annotations

from agent.execute.backends import QuotaBackend, Slot
from agent.execute.backends.pool import SlotPool
from agent.execute.limits import Limits

A = Limits(cpu=0.5, memory_mb=64, pids=16)
B = Limits(cpu=0.25, memory_mb=32, pids=8)


class Book(QuotaBackend):
    """Slots with one directory each; remove/reuse/recycle can be made to fail."""

    poolable = True

    def __init__(self) -> None:
        self.live: set[str] = set()
        self.limit_writes = 0
        self.stuck: set[str] = set()        # remove() fails (a process is left in it)
        self.refuse_reuse = False
        self.refuse_recycle = False

    def create(self, name: str, limits: Limits) -> Slot:
        self.live.add(name)
        self.limit_writes += 1
        return Slot(name, limits, {"memory": f"/m/{name}"})

    def reuse(self, slot: Slot, limits: Limits) -> None:
        if self.refuse_reuse:
            raise OSError(16, "busy")
        self.limit_writes += slot.limits != limits
        slot.limits = limits

    def recycle(self, slot: Slot) -> bool:
        return not self.refuse_recycle

    def remove(self, slot: Slot) -> bool:
        if slot.name in self.stuck:
            return False
        self.live.discard(slot.name)
        slot.removed = True
        return True


def pool(size: int = 2) -> tuple[SlotPool, Book, list, list]:
    b = Book()
    made: list = []
    gone: list = []
    return SlotPool(b, size, on_made=lambda d: made.append(list(d)), on_removed=lambda d: gone.append(list(d))), b, made, gone


def test_a_slot_given_back_clean_serves_the_next_run_and_one_with_the_same_limits_first():
    p, b, made, _ = pool()
    s1, s2 = p.take(A), p.take(B)
    assert p.give_back(s1, clean=True) and p.give_back(s2, clean=True)
    assert p.free() == 2 and b.limit_writes == 2
    assert p.take(B) is s2 and b.limit_writes == 2          # its limits already: nothing written
    assert p.take(B) is s1 and b.limit_writes == 3          # another's, rewritten
    assert (p.made, p.reused) == (2, 2) and len(made) == 2 and s1.runs == 2


def test_the_pool_keeps_at_most_its_size_and_removes_the_rest():
    p, b, _, gone = pool(size=3)
    slots = [p.take(A) for _ in range(10)]
    for s in slots:
        assert p.give_back(s, clean=True)
    assert p.free() == 3 and len(b.live) == 3 and len(gone) == 7
    again = [p.take(A) for _ in range(10)]   # three reused, seven new
    assert len({id(s) for s in again} & {id(s) for s in slots}) == 3 and p.made == 17
    assert p.close() == [] and b.live == {s.name for s in again}   # only the free ones go at close


def test_a_slot_that_ended_unclean_or_cannot_be_reset_is_removed_never_reused():
    p, b, _, gone = pool()
    s = p.take(A)
    assert p.give_back(s, clean=False) and s.removed and p.free() == 0
    b.refuse_recycle = True
    s2 = p.take(A)
    assert p.give_back(s2, clean=True) and s2.removed and p.free() == 0
    assert p.take(A) not in (s, s2) and len(gone) == 2


def test_a_slot_the_kernel_does_not_let_go_of_is_reported_and_never_handed_out():
    p, b, _, gone = pool()
    s = p.take(A)
    b.stuck.add(s.name)
    assert not p.give_back(s, clean=False)      # the caller keeps retrying its removal
    assert p.free() == 0 and p.take(A) is not s and gone == []
    b.stuck.clear()
    assert p.discard(s) and gone == [["/m/" + s.name]]


def test_a_pooled_slot_that_cannot_take_new_limits_is_replaced():
    p, b, _, gone = pool()
    s = p.take(A)
    p.give_back(s, clean=True)
    b.refuse_reuse = True
    t = p.take(B)
    assert t is not s and s.removed and t.limits == B and len(gone) == 1


def test_backends_without_containers_are_not_pooled():
    p = SlotPool(QuotaBackend(), 8)
    s = p.take(A)
    assert p.give_back(s, clean=True) and p.free() == 0 and p.take(A) is not s
