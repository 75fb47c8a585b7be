"""Run slots made once and reused: a run takes a slot (its quota container) when it is
staged and gives it back when it ended, so a run costs no cgroup mkdir or rmdir, no
opening of the files the launcher joins by, and writes of limit files only where its
limits differ from the slot's last run's.

A slot goes back into the pool only after a clean end: every process of the run gone,
no quota event (OOM, pids limit) and its reset for the next run done (the backend's
``recycle``: the memory peak starts again, the cumulative counters it read become the
base the next run's usage is counted from). Any other slot is removed, and one the
kernel does not let go of (a process left in it) is never handed out again: the reaper
retries its removal. At most ``size`` free slots are kept; beyond that a given-back slot
is removed, so the pool's size, and the files it keeps open, stay bounded.
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Callable, Iterable, Optional

from agent.execute.backends.interface import QuotaBackend, Slot
from agent.execute.limits import Limits

DEFAULT_SIZE = 32
_pools = itertools.count(1)


class SlotPool:
    """Free slots of one backend by their limits. Thread-safe: runs are staged on any
    thread, slots given back on the reaper. ``on_made(dirs)`` / ``on_removed(dirs)``: a
    slot's cgroup directories came to exist / are gone (the run guard removes the ones
    left when the agent dies)."""

    def __init__(self, backend: QuotaBackend, size: int = DEFAULT_SIZE,
                 on_made: Callable[[Iterable[str]], None] = lambda dirs: None,
                 on_removed: Callable[[Iterable[str]], None] = lambda dirs: None):
        self.backend = backend
        self.size = max(0, int(size)) if backend.poolable else 0
        self.on_made = on_made
        self.on_removed = on_removed
        self._lock = threading.Lock()
        self._free: dict[Limits, list[Slot]] = {}
        self._count = 0
        # unique among the agents and executors on this host: pid, then this pool
        self._prefix = f"slot-{os.getpid()}.{next(_pools)}."
        self._seq = itertools.count(1)
        self.made = self.reused = self.removed = 0

    def free(self) -> int:
        with self._lock:
            return self._count

    def holds(self, slot: Slot) -> bool:
        """``slot`` is free in the pool (its cgroups exist, empty, for another run)."""
        with self._lock:
            return any(s is slot for s in self._free.get(slot.limits, ()))

    def take(self, limits: Limits) -> Slot:
        """A slot holding ``limits``: a free one (one that held the same limits first), else
        a new one. OSError if a new one cannot be made."""
        slot = None
        with self._lock:
            same = self._free.get(limits)
            if same:
                slot = same.pop()
            elif self._count:
                for slots in self._free.values():
                    if slots:
                        slot = slots.pop()
                        break
            if slot is not None:
                self._count -= 1
                if not self._free.get(slot.limits, True):
                    self._free.pop(slot.limits, None)
        if slot is not None:
            try:
                self.backend.reuse(slot, limits)
            except OSError:
                self.discard(slot)   # (e.g. a memory limit below what it still holds)
                slot = None
            else:
                self.reused += 1
        if slot is None:
            slot = self.backend.create(f"{self._prefix}{next(self._seq)}", limits)
            self.made += 1
            if slot.paths:
                self.on_made(slot.paths.values())
        slot.runs += 1
        slot.pid = slot.pgid = None
        slot.joined = set()
        return slot

    def give_back(self, slot: Slot, clean: bool) -> bool:
        """After its run's end (usage read): keep ``slot`` for another run if the run ended
        cleanly and there is room, else remove it. False: it could not be removed now (the
        caller retries: a slot that still holds a process is never handed out again)."""
        if clean and self.size:
            with self._lock:
                room = self._count < self.size
            if room and self.backend.recycle(slot):
                with self._lock:
                    self._free.setdefault(slot.limits, []).append(slot)
                    self._count += 1
                return True
        return self.discard(slot)

    def discard(self, slot: Slot) -> bool:
        """Remove a slot for good. False: the kernel did not let go of it yet."""
        if slot.removed:
            return True
        if not self.backend.remove(slot):
            return False
        self.removed += 1
        if slot.paths:
            self.on_removed(slot.paths.values())
        return True

    def drain(self) -> list[Slot]:
        """Every free slot, taken out of the pool (to remove them at close)."""
        with self._lock:
            out = [s for slots in self._free.values() for s in slots]
            self._free.clear()
            self._count = 0
        return out

    def close(self) -> list[Slot]:
        """Remove every free slot; the ones the kernel did not let go of yet are returned."""
        return [s for s in self.drain() if not self.discard(s)]

    def describe(self) -> Optional[str]:
        return None if not self.size else f"{self.free()} free of at most {self.size}"
