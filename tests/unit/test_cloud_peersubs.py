"""Which peers' statuses an agent subscribes to (agent/cloud/peersubs.py): one subscription
per member, a departed member kept for a grace period, a flooding one dropped for a
cool-off that grows while it keeps flooding, and Answers told what is (not) read."""

from __future__ import annotations

import json

from agent.cloud.peers import PeerStatuses
from agent.cloud.peersubs import PeerSubscriptions
from agent.cloud.topics import Topics
from tests.support.fakes import ManualClock, ManualLoop
from tests.support.link import FakeLink, message

T = Topics("t", "me")


class World:
    def __init__(self, **kw):
        self.link = FakeLink()
        self.loop = ManualLoop()
        self.clock = ManualClock()
        self.events: list[tuple[str, str]] = []
        self.records: list = []
        self.subs = PeerSubscriptions(T, self.link, "me", reading=lambda a: self.events.append(("reading", a)),
                                      not_reading=lambda a: self.events.append(("not_reading", a)),
                                      call_later=self.loop.call_later, record=lambda *a, **k: self.records.append(k),
                                      clock=self.clock, **kw)

    def later(self, s: float) -> None:
        """``s`` seconds pass: the timers due by then run."""
        self.clock.t += s
        due = [c for c in self.loop.calls if c[0] <= s]
        self.loop.calls = [[c[0] - s, *c[1:]] for c in self.loop.calls if c[0] > s]
        for _, fn, args, cancelled in due:
            if not cancelled:
                fn(*args)

    def peers(self) -> set[str]:
        return {T.agent_of(t) for t in self.link.subscriptions}


def test_one_subscription_per_member_and_never_the_wildcard():
    w = World()
    w.subs.start()
    assert w.link.subscriptions == {T.agent_prefix("me") + "status/+": 1} and w.events == [("reading", "me")]
    w.subs.members_changed(["me", "a1", "a2", "bad id"])
    assert w.peers() == {"me", "a1", "a2"} and T.status_filter() not in w.link.subscriptions
    assert w.events[1:] == [("reading", "a1"), ("reading", "a2")]  # told before each SUBSCRIBE


def test_a_departed_member_is_read_for_the_grace_period_then_dropped():
    w = World(grace_s=60.0)
    w.subs.members_changed(["me", "a1", "a2"])
    w.subs.members_changed(["me", "a2"])
    assert w.peers() == {"me", "a1", "a2"}          # a1's last answers are still seen
    w.later(59.0)
    assert "a1" in w.peers()
    w.later(1.0)
    assert w.peers() == {"me", "a2"} and ("not_reading", "a1") in w.events
    assert w.link.unsubscribed == [T.agent_prefix("a1") + "status/+"]


def test_a_member_back_within_its_grace_is_never_dropped():
    w = World(grace_s=60.0)
    w.subs.members_changed(["me", "a1"])
    w.subs.members_changed(["me"])
    w.later(30.0)
    w.subs.members_changed(["me", "a1"])
    w.later(60.0)
    assert "a1" in w.peers() and w.link.unsubscribed == []


def test_a_flooding_member_is_unsubscribed_for_a_cool_off_that_grows_while_it_floods():
    w = World(cool_off_s=10.0, cool_off_max_s=40.0)
    w.subs.members_changed(["me", "a1", "gw"])
    w.subs.flooding("gw")
    assert w.peers() == {"me", "a1"} and w.events[-1] == ("not_reading", "gw")
    assert w.records[-1] == {"event": "peer_statuses_unsubscribed", "agent": "gw", "cool_off_s": 10.0}
    w.subs.flooding("gw")                        # what the broker had already sent: no second cool-off
    assert len(w.records) == 1
    w.later(10.0)
    assert "gw" in w.peers() and w.events[-1] == ("reading", "gw")
    w.subs.flooding("gw")                        # still flooding: twice as long
    w.later(10.0)
    assert "gw" not in w.peers()
    w.later(10.0)
    assert "gw" in w.peers()
    w.subs.flooding("gw")
    assert w.records[-1]["cool_off_s"] == 40.0
    w.later(40.0)
    w.subs.flooding("gw")
    assert w.records[-1]["cool_off_s"] == 40.0  # at most cool_off_max_s
    w.later(40.0 + 40.0)                         # quiet for cool_off_max_s after its resubscription
    w.subs.flooding("gw")
    assert w.records[-1]["cool_off_s"] == 10.0


def test_a_flooder_that_leaves_while_cooling_off_is_not_subscribed_again():
    w = World(grace_s=5.0, cool_off_s=10.0)
    w.subs.members_changed(["me", "gw"])
    w.subs.flooding("gw")
    w.subs.members_changed(["me"])
    w.later(10.0)
    assert w.peers() == {"me"} and not w.subs.cooling and not w.subs.departed


def test_forged_members_cost_at_most_max_peers_subscriptions():
    w = World(max_peers=3)
    w.subs.members_changed(["me"] + [f"x{i}" for i in range(100)])
    assert len(w.link.subscriptions) == 3 and "me" in w.peers()


def test_peers_tell_a_flooding_agent_once_a_second_and_a_quiet_one_never():
    told: list[str] = []
    clock = ManualClock()
    peers = PeerStatuses(T, FakeLink(), saw=lambda a, d: None, missed=lambda a: None, flooding=told.append,
                         rate=10 * 1024, burst=5 * 1024, max_bytes=4000, clock=clock)
    small = json.dumps({"job_id": "j", "state": "accepted"}).encode()
    for i in range(50):
        peers.on_message(message(T.status("j", "gw"), small, mid=i))
        peers.on_message(message(T.status("j", "a1"), small, mid=i)) if i < 5 else None
    assert told == ["gw"]
    clock.t += 1.0
    big = json.dumps({"job_id": "j", "pad": "x" * 5000}).encode()   # too large: still read by the link
    for i in range(3):
        peers.on_message(message(T.status("j", "gw"), big, mid=i))
    assert told == ["gw", "gw"]


def test_a_status_of_a_peer_not_subscribed_to_is_dropped_and_unsubscribed_again():
    w = World()
    w.subs.members_changed(["me", "a1"])
    read: list = []
    peers = PeerStatuses(T, FakeLink(), saw=lambda a, d: read.append(a), missed=lambda a: None,
                         flooding=w.subs.flooding, stray=w.subs.stray, wanted=lambda: w.subs.snapshot,
                         clock=w.clock)
    doc = json.dumps({"job_id": "j", "state": "accepted"}).encode()
    for agent in ("a1", "old"):       # "old": left in the persistent session by a previous run
        peers.on_message(message(T.status("j", agent), doc))
    while peers._q:
        peers.handle(*peers._q.popleft())
    assert read == ["a1"] and w.link.unsubscribed == [T.agent_prefix("old") + "status/+"]
    assert "old" not in w.peers()


def test_a_stray_report_about_a_peer_the_set_took_in_meanwhile_changes_nothing():
    w = World()
    w.subs.members_changed(["me", "a1"])
    w.subs.stray("a1")        # read from the snapshot before a1 joined the set
    assert "a1" in w.peers() and w.link.unsubscribed == [] and not w.subs.cooling
