"""The seeded fault test (issue 20), a short run for CI: 3-member etcd, 4 agents,
mosquitto, a nemesis, and the strict history check (tests/support/chaos.py, history.py).
The seed comes from the commit (printed first, and in every failure);
MILLWRIGHT_CHAOS_SEED and MILLWRIGHT_CHAOS_MINUTES override the seed and the length; the
release tier runs ten seeds of five minutes (`make test-release`, README testing)."""

from __future__ import annotations

import os
import random
import shutil
from datetime import datetime, timezone

from agent.coordination.keys import shard_of
from tests.support import chaos, history
from tests.support.faults import BlkioThrottle
from tests.support.kernel import require_kernel

# CI runs one seed per run, taken from the commit under test (another schedule on every
# commit, the same one again on a re-run of that commit); MILLWRIGHT_CHAOS_SEED repeats one
if os.environ.get("MILLWRIGHT_CHAOS_SEED"):
    SEED, SEED_FROM = int(os.environ["MILLWRIGHT_CHAOS_SEED"]), "MILLWRIGHT_CHAOS_SEED"
else:
    SEED, SEED_FROM = chaos.seed_from_commit()
MINUTES = float(os.environ.get("MILLWRIGHT_CHAOS_MINUTES", "2"))
# a commit's seed whose plan holds too few faults for the run to be a fault test (a 30 s
# clock jump can take most of a 2-minute horizon) gives way to the next seed that has enough
PLANNED_FAULTS_MIN = 4


def replay(seed: int, minutes: float = 2.0):
    """The seed's workload and fault plan, each fault healed on plan: what the budgets
    and quiet windows of a run of that seed look like, without running it."""
    run = chaos.ChaosRun(seed, minutes, workdir="/nonexistent-replay")
    horizon = max(20.0, minutes * 60 - 40)
    t0 = datetime.fromtimestamp(1_800_000_000, timezone.utc)
    run.plan_workload(t0, horizon)
    faults, last_heal = [], 0.0
    for n, pg in enumerate(chaos.plan_faults(run.rng, horizon, run.kinds)):
        start = max(t0.timestamp() + pg.at, last_heal + chaos.QUIET_MIN_S)
        for pf in pg.faults:
            f = chaos.Fault(pf.kind, "a0", start + pf.offset, start + pf.offset + pf.duration, group=n,
                            loses_runs=pf.kind not in chaos.HARMLESS_TO_RUNS)
            if pf.kind in chaos.AGENT_FAULTS:   # one agent of four: a quarter of the shards
                f.shards = frozenset(range(pf.pick % 4, chaos.SHARDS, 4))
            if pf.kind in chaos.CLOCK_FAULTS:
                f.reach_s = chaos.CLOCK_FAULTS[pf.kind] if pf.kind == "clock_jump" or pf.pick % 2 else 0
            faults.append(f)
        last_heal = max(f.end + f.reach_s for f in faults)
    run.faults = faults
    budget, _ = chaos.budgets(faults, run.firings, run.sleep_of, lambda j: shard_of(j, chaos.SHARDS))
    quiet = [f for f in run.firings if f.due >= t0.timestamp() and run.quiet(f)]
    share = chaos.affected_share(faults, t0.timestamp(), t0.timestamp() + horizon)
    return run, faults, budget, quiet, share


if SEED_FROM.startswith("commit"):
    _first = SEED
    while len(replay(SEED, MINUTES)[1]) < PLANNED_FAULTS_MIN:
        SEED = (SEED + 1) % 10 ** 6
    if SEED != _first:
        SEED_FROM += f"; {_first} planned fewer than {PLANNED_FAULTS_MIN} faults"
print(f"chaos: seed {SEED} ({SEED_FROM}); reproduce with `make chaos SEED={SEED} MINUTES={MINUTES:g}`")


def test_the_seeded_plans_leave_quiet_windows_and_budgets_that_can_be_exceeded():
    """The budgets of the earlier fault test covered every firing (98-100 % of the horizon
    affected, misfire budgets above the number of cron firings). Replayed on plan, every
    seed CI or a release runs leaves quiet windows of at least TTL + 3 s, whose firings
    are judged strictly, and budgets far below the firings they count from."""
    rng = random.Random(SEED)
    for seed in sorted({*range(SEED, SEED + 10), *range(1, 11), 20, rng.randrange(10 ** 6)}):
        run, faults, budget, quiet, share = replay(seed)
        spans = {}
        for f in faults:
            s0, s1 = spans.get(f.group, (f.start, f.end + f.reach_s))
            spans[f.group] = (min(s0, f.start), max(s1, f.end + f.reach_s))
        groups = [spans[g] for g in sorted(spans)]
        gaps = [b[0] - a[1] for a, b in zip(groups, groups[1:])]
        assert faults and all(g >= chaos.QUIET_MIN_S for g in gaps), (seed, gaps)   # one group: no gap
        crons = sum(1 for f in run.firings if f.kind == "cron")
        assert share < 0.85, (seed, share)   # a 30 s clock jump reaches 30 s past its heal
        assert len(quiet) >= 20, (seed, len(quiet), len(run.firings))
        # the earlier budgets exceeded every firing they counted from (misfired 184-304 for 164
        # cron firings, owner_lost 39-84 for 63 one-shots); now each stays below it with room
        # (over 600 random seeds: misfired at most 54 % of the cron firings, owner_lost 76 %)
        assert budget.misfired < crons * 0.65, (seed, budget, crons)
        assert budget.owner_lost < len(run.firings) * 0.85, (seed, budget, len(run.firings))
        print(f"seed {seed}: {len(faults)} faults in {len(groups)} groups, {share:.0%} affected, {len(quiet)}/{len(run.firings)} firings "
              f"quiet, budgets owner_lost {budget.owner_lost} misfired {budget.misfired} ({crons} cron firings)")


def test_an_agent_fault_can_cost_the_shards_its_agent_held_at_any_time_in_its_window():
    """Fault seed 9: a clock fault on a2 made it give up shard 8 to a0 while a0's state
    disk was full, and a0 took it back to a peer before the post-heal poll; the owners
    polled at the fault's start and after its heal did not show it, so the spawn error
    was judged as one with no fault in flight. The shard keys' history shows it."""
    P = "/millwright/c/shards/"

    def put(rev, shard, agent):
        return history.Event(rev, f"{P}{shard:04d}", "put", agent.encode())

    events = [put(2, 8, "a2"), put(3, 4, "a0"), put(4, 5, "a0"), history.Event(5, f"{P}0005", "delete"),
              put(10, 8, "a0"), put(12, 8, "a1"), put(20, 9, "a0")]
    assert chaos.held_during(events, P, "a0", 6, 15) == {4, 8}     # 8 held only in between
    assert chaos.held_during(events, P, "a0", 4, 15) == {4, 5, 8}  # 5 still held at revision 4
    assert chaos.held_during(events, P, "a2", 11, 30) == set()     # 8 left a2 in the window's past
    assert chaos.held_during(events, P, "a0", 0, 1 << 62) == {4, 5, 8, 9}


def test_seeded_faults_keep_exactly_once_fencing_and_lateness(tmp_path):
    require_kernel(os.geteuid() == 0 and shutil.which("nft") is not None,
                   "the fault test needs root and nftables for its link cuts")
    missing = [t for t in ("gcc", "losetup", "mkfs.ext4", "fallocate", "mount") if shutil.which(t) is None]
    require_kernel(not missing and BlkioThrottle.available(),
                   f"the fault test's clock and disk faults need gcc, loop devices, ext4 and cgroup v1 blkio "
                   f"(missing: {missing or 'blkio throttling'})")
    print(f"\nchaos: seed {SEED} ({SEED_FROM})")
    res = chaos.run_and_check(SEED, MINUTES, str(tmp_path / "chaos"))
    fig = res.figures
    print(f"\nchaos figures: {fig}")
    # the run did what it claims: faults were injected, quiet firings were judged strictly,
    # every push was stored
    assert fig["faults"] >= 3, fig
    assert fig["quiet_firings"] >= 10, fig
    assert res.stored == res.pushed
