"""The mutation harness's table (tests/support/mutants.py) against the tree: every mutant's
anchor is still there, once, and its patch compiles, so a change to agent/ that moves one
fails here, in `make test`, rather than in `make chaos-mutants`; and a problem of the
checker is attributed to the oracle that reported it."""

from __future__ import annotations

import os

import pytest

from agent.demo.services import REPO_ROOT
from tests.support.mutants import MUTANTS, AnchorMissing, Mutant, apply, oracle_of


@pytest.mark.parametrize("m", MUTANTS, ids=[m.name for m in MUTANTS])
def test_every_mutant_applies_to_the_tree_once_and_compiles(m, tmp_path):
    src = os.path.join(REPO_ROOT, m.path)   # the agent under test: a checkout's, or the installed package's
    dst = tmp_path / m.path
    dst.parent.mkdir(parents=True)
    dst.write_text(open(src).read())
    original = apply(str(tmp_path), m)
    assert original == open(src).read()
    patched = dst.read_text()
    assert m.original not in patched and m.replacement in patched and "MUTANT" in m.replacement


def test_a_mutant_whose_anchor_is_gone_fails_loudly(tmp_path):
    (tmp_path / "agent").mkdir()
    (tmp_path / "agent" / "x.py").write_text("x = 1\n")
    m = Mutant("gone", "agent/x.py", "x = 2\n", "x = 3  # MUTANT\n", "nothing", "none")
    with pytest.raises(AnchorMissing, match="mutant gone: its anchor occurs 0 times in agent/x.py"):
        apply(str(tmp_path), m)


def test_the_names_are_unique_and_each_promise_is_covered():
    assert len({m.name for m in MUTANTS}) == len(MUTANTS) >= 6
    promises = " ".join(m.promise for m in MUTANTS)
    assert all(p in promises for p in ("no job lost", "none twice", "none late"))


@pytest.mark.parametrize("problem, oracle", [
    ("rev 718: write by a2 with token 713 for /m/shards/0006 held by None", "fence"),
    ("rev 9: (j, F): attempt 1 'running' written by a0 while shard 1 was held by a1: an unfenced write", "fence"),
    ("rev 451: (x002-1, F): 'running' attempt 3 outside 1..2 (max_attempts 2)", "attempts and transitions"),
    ("(c0-1, F) attempt 1: side effect by a3 at 1.0 without a fenced running record", "effect has its claim"),
    ("rev 633: (o013-1, F): 'running' attempt 1 after 'running' attempt 1", "attempts and transitions"),
    ("(o013-1, F) attempt 1: running record created 2 times, by a0 at rev 1, a1 at rev 2", "at most once"),
    ("(w001-1, F) attempt 1: ran at 5.0, after its job's not_after 3.0", "never after not_after"),
    ("(c0-1, F) attempt 1: ran at 1.84, before its due time 2.0", "never before due"),
    ("(c0-1, F): left 'running' (attempt 1, agent a3)", "resolved"),
    ("(c0-1, F): due in a quiet window at 2.0, never ran (no run record)", "quiet window"),
    ("owner_lost 9 over its budget 3", "budgets"),
])
def test_a_problem_is_attributed_to_its_oracle(problem, oracle):
    assert oracle_of(problem) == oracle
