"""The demo's fault: SIGKILL the line-2 gateway with the most firings still due, then watch
etcd until its lease expired and every one of its shards (and its shards of line 2's pool)
is owned by a survivor that may hold it."""

from __future__ import annotations

import collections
import time
from datetime import datetime, timedelta
from typing import Callable, Optional

from agent.demo.feed import StatusFeed
from agent.demo.output import Live, parse_rfc
from agent.demo.plan import DemoFailed, DemoJob
from agent.demo.result import Failover
from agent.demo.stage import Stage
from agent.jobs.states import TERMINAL
from agent.runtime.timefmt import utcnow

TAKEOVER_LIMIT_S = 40.0


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2:].split()[0] not in (b"Z", b"X")


def future_firings(jobs: list[DemoJob], owner_of: Callable[[DemoJob], Optional[str]], t0: datetime,
                   kill_at: float) -> collections.Counter:
    """Firings still due after the kill, per owning agent."""
    score: collections.Counter = collections.Counter()
    kill = t0 + timedelta(seconds=kill_at)
    for j in jobs:
        owner = owner_of(j)
        sch = j.doc["schedule"]
        if j.cron_expected:
            score[owner] += sum(1 for g in j.cron_expected if g > kill)
        elif "at" in sch and (at := parse_rfc(sch["at"])) is not None and at > kill - timedelta(seconds=3):
            score[owner] += 1
        elif "delay_s" in sch and t0 + timedelta(seconds=sch["delay_s"]) > kill:
            score[owner] += 1
    return score


def kill_victim(stage: Stage, feed: StatusFeed, jobs: list[DemoJob], t0: datetime, kill_at: float,
                live: Live, notes: list[str]) -> Failover:
    """SIGKILL the victim and wait (2 s at most) for its runs to die with it."""
    from agent.coordination import placement
    from agent.coordination.keys import shard_of

    owners = stage.owners()
    pools = stage.pool_owners()

    def owner_of(j: DemoJob) -> Optional[str]:
        s = shard_of(j.id, stage.shard_count)
        if j.doc.get("target"):
            return pools.get(placement.pool_of_doc(j.doc), {}).get(s)
        return owners.get(s)
    score = future_firings(jobs, owner_of, t0, kill_at)
    # the victim serves line 2: its line's jobs must move to the other line-2 gateway only
    victim = max(sorted(a for a in stage.agents if stage.lines[a] == "2"), key=lambda a: score.get(a, 0))
    victim_pools = {p: sorted(s for s, a in o.items() if a == victim) for p, o in pools.items()}
    mine = sorted(s for s, a in owners.items() if a == victim)
    running = [k[0] for k, d in feed.runs.items() if d.get("agent") == victim
               and not any(s.get("job_id") == k[0] and s.get("fire_id") == k[1] and s.get("state") in TERMINAL
                           for s in feed.statuses)]
    kill_wall = utcnow()
    kill_mono = time.monotonic()
    stage.agents[victim].kill()
    fo = Failover(victim=victim, kill_wall=kill_wall, kill_mono=kill_mono, shards=mine,
                  future=score.get(victim, 0), running=sorted(set(running)), pools=victim_pools)
    live.line(victim, f"SIGKILL (pid {stage.agents[victim].pid}): it held {len(mine)} shards with "
                      f"{score.get(victim, 0)} firings still due" +
              (f"; running now: {', '.join(sorted(set(running)))}" if running else ""))
    runs = [(k[0], int(d["pid"])) for k, d in feed.runs.items() if d.get("agent") == victim
            and d.get("pid") and k[0] in running]
    # the agent's run guard kills its runs when it dies (agent/execute/guard.py)
    deadline = time.monotonic() + 2.0
    while any(alive(pid) for _, pid in runs) and time.monotonic() < deadline:
        time.sleep(0.005)
    gone_s = time.monotonic() - kill_mono
    for jid, pid in runs:
        if alive(pid):
            live.line(victim, f"its run of {jid} (pid {pid}) keeps running without its agent")
            notes.append(f"{victim}'s run of {jid} (pid {pid}) outlived its agent by more than 2 s: a retry "
                         "by the new owner could overlap it")
        else:
            live.line(victim, f"its run of {jid} (pid {pid}) died with it ({gone_s * 1000:.0f} ms)")
    return fo


def await_failover(stage: Stage, feed: StatusFeed, fo: Failover, live: Live) -> None:
    """Until every shard of the victim is owned by a survivor (fills ``fo``); DemoFailed
    after TAKEOVER_LIMIT_S."""
    victim = fo.victim
    mine = set(fo.shards)
    member_key = stage.keys.member(victim)
    expired_at = None
    taken: dict[int, str] = {}
    deadline = fo.kill_mono + TAKEOVER_LIMIT_S
    while True:
        feed.pump()
        now = time.monotonic()
        if expired_at is None and stage.client.get(member_key) is None:
            expired_at = now
            live.line("etcd", f"lease of {victim} expired {now - fo.kill_mono:.2f} s after the kill: its "
                              f"member key and {len(mine)} shard keys are gone")
        owners = stage.owners()
        new = {s: owners[s] for s in mine if s in owners and owners[s] != victim and s not in taken}
        if new:
            taken.update(new)
            per = collections.Counter(new.values())
            for a, n in sorted(per.items()):
                live.line(a, f"claimed {n} of {victim}'s shards (+{now - fo.kill_mono:.2f} s)")
        if len(taken) == len(mine):
            fo.done_s = now - fo.kill_mono
            fo.expired_s = (expired_at or now) - fo.kill_mono
            fo.taken = dict(collections.Counter(taken.values()))
            live.line("etcd", f"failover complete: all {len(mine)} shards of {victim} owned by " +
                      ", ".join(f"{a} ({n})" for a, n in sorted(fo.taken.items())) +
                      f", {fo.done_s:.2f} s after the kill")
            _await_pool_failover(stage, feed, fo, live, deadline)
            return
        if now > deadline:
            raise DemoFailed(f"failover did not complete: {len(mine) - len(taken)} of {victim}'s shards "
                             "still unowned 40 s after the kill")
        time.sleep(0.05)


def _await_pool_failover(stage: Stage, feed: StatusFeed, fo: Failover, live: Live, deadline: float) -> None:
    """The victim's shards of line 2's pool move to the other line-2 gateway, never to
    line 1's (it is not eligible: the pool's shards are shared by eligible agents only)."""
    victim = fo.victim
    want = {p: set(s) for p, s in fo.pools.items() if s}
    if not want:
        return
    while True:
        pools = stage.pool_owners()
        moved = {p: {s: pools.get(p, {}).get(s) for s in ss} for p, ss in want.items()}
        for p, got in moved.items():
            wrong = {a for a in got.values() if a and stage.lines.get(a) != "2"}
            if wrong:
                raise DemoFailed(f"pool {p}: shards of {victim} went to {', '.join(sorted(wrong))}, not line 2")
        if all(a and a != victim for got in moved.values() for a in got.values()):
            took = collections.Counter(str(a) for got in moved.values() for a in got.values())
            fo.pools_done_s = time.monotonic() - fo.kill_mono
            live.line("etcd", f"line 2's jobs: {sum(len(s) for s in want.values())} pool shards of {victim} "
                      f"now held by " + ", ".join(f"{a} (line {stage.lines[a]})" for a in sorted(took)) +
                      f", {fo.pools_done_s:.2f} s after the kill; line 1's gateway is "
                      "never eligible")
            return
        if time.monotonic() > deadline:
            raise DemoFailed(f"line 2's pool shards of {victim} still unowned 40 s after the kill")
        feed.pump()
        time.sleep(0.05)
