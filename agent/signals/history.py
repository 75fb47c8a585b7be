"""The sampled counters as the loop thread keeps them, and the signals made from them.

Per job slot and per watched endpoint: the latest kernel counters, a short history of
them for rates over ``window_s``, and the stall figures; for the node, the /proc TCP
counters. The poll thread samples, the loop thread applies the samples here and
answers the agent's queries; nothing here is touched by another thread.
"""

from __future__ import annotations

import collections
import time
from typing import Mapping, Optional

from agent.signals.model import EndpointSignals, NodeSignals, SlotSignals


class SignalHistory:
    """Counters, histories and stalls of the tracked slots and watched endpoints.

    A slot or endpoint exists here from ``add_*`` to ``drop_*``; samples for others are
    ignored. ``apply_*`` return what changed so that the sensor can tell its listener.
    """

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._slot_hist: dict[int, collections.deque] = {}
        self._slot_latest: dict[int, tuple] = {}
        self._slot_stall: dict[int, tuple[int, int]] = {}
        self._slot_start: dict[int, float] = {}
        self._proc_stall: dict[int, tuple[int, float]] = {}   # degraded mode: slot -> (stalled, since)
        self._ep_hist: dict[int, collections.deque] = {}
        self._ep_latest: dict[int, tuple] = {}
        self._ep_stalled: dict[int, int] = {}
        self._ep_start: dict[int, float] = {}
        self._node_prev: Optional[tuple[float, int]] = None
        self.node = NodeSignals()

    # ------------------------------------------------------------ slots and endpoints
    def add_slot(self, slot: int, now: float) -> None:
        """Start a slot's series from zero (its kernel counters were just reset)."""
        self._slot_hist[slot] = collections.deque([(now, 0, 0)])
        self._slot_latest[slot] = (0, 0, 0, 0, 0, 0)
        self._slot_stall[slot] = (0, 0)
        self._slot_start[slot] = now

    def drop_slot(self, slot: int) -> None:
        for d in (self._slot_hist, self._slot_latest, self._slot_stall, self._slot_start, self._proc_stall):
            d.pop(slot, None)

    def add_endpoint(self, epid: int, now: float) -> None:
        self._ep_hist[epid] = collections.deque([(now, 0, 0)])
        self._ep_latest[epid] = (0, 0, 0, 0)
        self._ep_start[epid] = now

    def drop_endpoint(self, epid: int) -> None:
        for d in (self._ep_hist, self._ep_latest, self._ep_start, self._ep_stalled):
            d.pop(epid, None)

    # ------------------------------------------------------------------- samples
    def apply_kernel_sample(self, now: float, slots: dict, stalls: dict, eps: dict,
                            gens: Mapping[int, int]) -> tuple[set[int], set[int]]:
        """A sample of the kernel maps; a slot counts only while ``gens`` still holds the
        generation it was sampled under. Returns the slots and endpoint ids that changed."""
        changed_slots, changed_eps = set(), set()
        for slot, (gen, counts) in slots.items():
            if gens.get(slot) != gen:
                continue  # sampled before an untrack/re-track of this slot
            stall = stalls.get(slot, (0, 0))
            if counts != self._slot_latest.get(slot) or stall != self._slot_stall.get(slot):
                changed_slots.add(slot)
            if counts != self._slot_latest.get(slot):
                self._slot_hist[slot].append((now, counts[0], counts[4]))
                _trim(self._slot_hist[slot], now, self.window_s)
            self._slot_latest[slot] = counts
            self._slot_stall[slot] = stall
        for epid, counts in eps.items():
            if epid not in self._ep_latest:
                continue
            if counts != self._ep_latest[epid]:
                changed_eps.add(epid)
                self._ep_hist[epid].append((now, counts[0], counts[2]))
                _trim(self._ep_hist[epid], now, self.window_s)
                self._ep_latest[epid] = counts
        return changed_slots, changed_eps

    def apply_node_counters(self, now: float, counters: dict) -> None:
        retrans = counters.get("RetransSegs", 0)
        rate = 0.0
        if self._node_prev is not None and now > self._node_prev[0]:
            rate = max(0, retrans - self._node_prev[1]) / (now - self._node_prev[0])
        self._node_prev = (now, retrans)
        self.node = NodeSignals(retrans_segs=retrans, retrans_per_s=rate, syn_retrans=counters.get("TCPSynRetrans", 0),
                                active_opens=counters.get("ActiveOpens", 0),
                                attempt_fails=counters.get("AttemptFails", 0),
                                estab_resets=counters.get("EstabResets", 0), out_rsts=counters.get("OutRsts", 0),
                                ts=time.time())

    def apply_proc_stalls(self, slot_stalls: dict, slots: Mapping[int, int]) -> set[int]:
        """Degraded mode: (stalled sockets, since) per slot; the ``slots`` it lacks have none."""
        changed = set()
        for slot in slots:
            val = slot_stalls.get(slot, (0, 0.0))
            if self._proc_stall.get(slot) != val:
                self._proc_stall[slot] = val
                changed.add(slot)
        return changed

    def apply_endpoint_stalls(self, stalled: dict) -> set[int]:
        """Degraded mode: stalled sockets per endpoint id, from /proc/net/tcp."""
        changed = set()
        for epid, n in stalled.items():
            if epid in self._ep_latest and self._ep_stalled.get(epid) != n:
                self._ep_stalled[epid] = n
                changed.add(epid)
        return changed

    # ------------------------------------------------------------------- queries
    def slot_signals(self, slot: int, kernel: bool) -> SlotSignals:
        """``kernel`` false: the sensor runs degraded, only /proc stall figures exist."""
        if not kernel:
            n, since = self._proc_stall.get(slot, (0, 0.0))
            return SlotSignals(slot=slot, available=False, stalled_connections=n,
                               oldest_stall_age_s=max(0.0, time.monotonic() - since) if n else 0.0)
        latest = self._slot_latest.get(slot)
        if latest is None:
            return SlotSignals(slot=slot, available=True)
        now = time.monotonic()
        hist = self._slot_hist[slot]
        rate, fails_w = window_rate(hist, now, self.window_s, self._slot_start[slot])
        retrans, rrx, rtx, connects, fails, execs = latest
        n, oldest_ns = self._slot_stall.get(slot, (0, 0))
        age = max(0.0, time.monotonic_ns() / 1e9 - oldest_ns / 1e9) if oldest_ns else 0.0
        return SlotSignals(slot=slot, available=True, retransmits=retrans, retrans_per_s=rate,
                           resets=rrx + rtx, resets_rx=rrx, resets_tx=rtx, connects=connects,
                           failed_connects=fails, failed_connects_in_window=fails_w, execs=execs,
                           stalled_connections=n, oldest_stall_age_s=age)

    def endpoint_signals(self, host: str, port: int, epid: int, addrs: tuple[str, ...],
                         kernel: bool) -> EndpointSignals:
        if not kernel:
            return EndpointSignals(host=host, port=int(port), available=False, addresses=addrs,
                                   stalled_sockets=self._ep_stalled.get(epid, 0))
        now = time.monotonic()
        rate, fails_w = window_rate(self._ep_hist[epid], now, self.window_s, self._ep_start[epid])
        retrans, resets, fails, last_ns = self._ep_latest[epid]
        age = max(0.0, time.monotonic_ns() / 1e9 - last_ns / 1e9) if last_ns else None
        return EndpointSignals(host=host, port=int(port), available=True, addresses=addrs, retransmits=retrans,
                               retrans_per_s=rate, resets=resets, failed_connects=fails,
                               last_retransmit_age_s=age, stalled_sockets=self._ep_stalled.get(epid))


def _trim(hist: collections.deque, now: float, window: float) -> None:
    """Keep the samples inside the window plus the newest one before it (the baseline)."""
    cutoff = now - window
    while len(hist) >= 2 and hist[1][0] <= cutoff:
        hist.popleft()


def window_rate(hist: collections.deque, now: float, window: float, start: float) -> tuple[float, int]:
    """(events per second, second counter's increase) over the window; a young series is
    divided by its age (at least 1 s) so a fresh stall shows without waiting a window."""
    cutoff = now - window
    base = hist[0]
    for h in hist:
        if h[0] <= cutoff:
            base = h
        else:
            break
    last = hist[-1]
    dt = max(1.0, min(window, now - start))
    return (last[1] - base[1]) / dt, last[2] - base[2]
