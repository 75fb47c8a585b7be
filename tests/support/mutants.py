"""The mutation harness: deliberate product bugs that the fault test must catch.

Each mutant below is one bug a change to agent/ could plausibly bring, written as an exact
piece of product code and what replaces it. `make chaos-mutants` (``python3 -m
tests.support.mutants``) copies the tree (tracked and untracked files, as they are in the
working tree) to a directory under /tmp, and for each mutant in turn: patches the copy,
checks that the patched module still imports, runs the seeded fault test
(tests/support/chaos.py) there with the mutant's fault kinds, reads its verdict, and puts
the file back. The copy is removed at the end; the working tree is never touched.

A mutant is *killed* when the fault test's checker (tests/support/history.py, and the
judging in chaos.py) reports problems; which oracle each problem comes from is read from
its message (:data:`ORACLES`). It *survived* when the run passes: the oracles are then too
weak for that bug, and the checker or the test must be strengthened, never the mutant
weakened. A run that could not be judged (setup failed, a timeout) is an *error*. Before
the mutants, the unpatched copy runs each scenario once (the baseline): a baseline that
fails makes every verdict on that scenario meaningless, so the harness stops there.

The anchors are code text, not line numbers: when other work changes that code, the
anchor is not found and the harness fails loudly, naming the mutant to update.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = os.environ.get("PY", sys.executable)

# the fault test each mutant runs: a seed, a length, and the fault kinds that reach its bug
SEED = 1
MINUTES = 1.5
LATE_REQUESTS = ("etcd_requests_delay",)
KILLS = ("agent_kill9",)


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str          # the product file, relative to the tree
    original: str      # exact text that must occur once in it
    replacement: str
    breaks: str        # what the bug does
    promise: str       # which promise it breaks: no job lost, none twice, none late
    kinds: tuple[str, ...] = KILLS   # the fault test's fault kinds for it


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "fence-skipped", "agent/coordination/fencing.py",
        "    guard = Create(fence.key) == fence.token\n",
        "    guard = Create(fence.key) != -1   # MUTANT: any token passes\n",
        "a write of an agent that lost its shard lands (no fence)",
        "none twice", LATE_REQUESTS),
    Mutant(
        "retry-past-max", "agent/jobs/schedule.py",
        "    if attempt >= pol.max_attempts:\n        return None\n",
        "    if attempt > pol.max_attempts:   # MUTANT: one attempt too many\n        return None\n",
        "a failed last attempt is retried once more",
        "none twice"),
    Mutant(
        "run-unknown-claim", "agent/jobs/claims.py",
        "            elif error is not None:\n"
        "                # unknown outcome (timeout): the record may exist\n"
        "                self._read_back(f, key, rec, fence, done)\n",
        "            elif error is not None:\n"
        "                # MUTANT: a claim etcd did not answer is taken for one that landed\n"
        "                done(f, Claim(ClaimKind.CLAIMED, staged=staged))\n",
        "a run starts on a claim etcd did not answer",
        "none twice", LATE_REQUESTS),
    Mutant(
        "not-after-ignored", "agent/jobs/schedule.py",
        '    return na is not None and _utc(now, "now") >= na\n',
        "    return False   # MUTANT: never expired\n",
        "a firing that waited past not_after still starts",
        "none late"),
    Mutant(
        "final-record-dropped", "agent/jobs/scheduler.py",
        "        self.records.write(f, state, answer=(key, doc), **fields)\n",
        "        pass   # MUTANT: the final record is not written\n",
        "a run's final record is not written (stays running)",
        "no job lost"),
    Mutant(
        "released-early", "agent/jobs/launching.py",
        "release_at=time.monotonic() + ahead,",
        "release_at=time.monotonic(),   # MUTANT: released when prepared",
        "a firing claimed ahead starts when prepared (early)",
        "none late (never early)"),
    Mutant(
        "orphan-rerun", "agent/jobs/scheduler.py",
        "        if nxt is not None:\n"
        "            self._retry_later(f, nxt, now, fields, {\"reason\": EndReason.OWNER_LOST, \"previous_agent\": prev_agent})\n"
        "        else:\n"
        "            self._finish(f, RecordState.FAILED, fields, dict(fields, previous_agent=prev_agent))\n",
        "        self._claim(f, takeover=True)   # MUTANT: run it again, as the same attempt\n",
        "a dead owner's `running` run is run again, same attempt",
        "none twice"),
)

# Which oracle a problem of the checker comes from, by its message (first match).
ORACLES: tuple[tuple[str, str], ...] = (
    ("quiet window", r"quiet window"),
    ("fence", r"unfenced write|under an old fence|without a fence token|with token \S+ for \S+ held by"
              r"|changed owner .* without a delete"),
    ("effect has its claim", r"without a fenced running record|but the running record was created by"),
    ("at most once", r"running record created \d+ times|ran \d+ times|overwrote an existing record|overlapping runs"),
    ("attempts and transitions", r"outside 1\.\.|after the final state|first record|attempt \d+ after '"),
    ("never before due", r"before its due time"),
    ("never after not_after", r"not_after"),
    ("resolved", r"never resolved|left '|but no side effect|has no end line|never stored in etcd"),
    ("lateness bound", r"the bound is"),
    ("budgets", r"over its budget|with no fault"),
    ("scheduled firings only", r"never scheduled"),
    ("misfire reasons", r"misfire"),
)


def oracle_of(problem: str) -> str:
    for name, pattern in ORACLES:
        if re.search(pattern, problem):
            return name
    return "other"


class AnchorMissing(Exception):
    pass


def apply(tree: str, m: Mutant) -> str:
    """Patch the copy; returns the file's original text (to put back)."""
    path = os.path.join(tree, m.path)
    with open(path) as fh:
        text = fh.read()
    n = text.count(m.original)
    if n != 1:
        raise AnchorMissing(f"mutant {m.name}: its anchor occurs {n} times in {m.path} (want once); the code "
                            f"changed: update the mutant in tests/support/mutants.py\n--- anchor:\n{m.original}")
    patched = text.replace(m.original, m.replacement)
    compile(patched, path, "exec")   # a mutant must be a bug, not a syntax error
    with open(path, "w") as fh:
        fh.write(patched)
    return text


def copy_tree(dst: str) -> None:
    """The working tree as it is (tracked and untracked files, not ignored ones)."""
    out = subprocess.run(["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         check=True, capture_output=True).stdout
    for rel in sorted({p for p in out.decode().split("\0") if p}):
        src = os.path.join(ROOT, rel)
        if not os.path.isfile(src) or os.path.islink(src):
            continue   # deleted in the working tree, or a link into the host's caches
        os.makedirs(os.path.join(dst, os.path.dirname(rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dst, rel))


@dataclass
class Verdict:
    name: str
    verdict: str            # killed | SURVIVED | ERROR | pass (baseline)
    oracles: dict
    evidence: str
    seconds: float
    log: str


def run_fault_test(tree: str, kinds: tuple[str, ...], seed: int, minutes: float, log: str,
                   name: str) -> Verdict:
    """The fault test in the copy; its verdict from the JSON line it reports."""
    report = log + ".json"
    # the copy's own code only; a killed run's directory is not kept (its output and verdict are)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["MILLWRIGHT_CHAOS_KEEP"] = "0"
    argv = [PY, "-m", "tests.support.chaos", "--seed", str(seed), "--minutes", f"{minutes:g}",
            "--kinds", ",".join(kinds), "--report", report]
    t0 = time.monotonic()
    with open(log, "w") as fh:
        try:
            rc = subprocess.run(argv, cwd=tree, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                timeout=minutes * 60 + 300).returncode
        except subprocess.TimeoutExpired:
            rc = None
    took = time.monotonic() - t0
    doc: dict = {}
    try:
        with open(report) as fh:
            lines = [json.loads(x) for x in fh if x.strip()]
        doc = lines[-1] if lines else {}
    except (OSError, ValueError):
        pass
    problems = doc.get("problems") or []
    if rc is None or "error" in doc or (rc != 0 and not problems):
        why = doc.get("error") or ("timed out" if rc is None else f"exit {rc} without a report")
        return Verdict(name, "ERROR", {}, why, took, log)
    oracles: dict[str, int] = {}
    for p in problems:
        o = oracle_of(p)
        oracles[o] = oracles.get(o, 0) + 1
    if rc == 0 and not problems:
        return Verdict(name, "pass", {}, "", took, log)
    return Verdict(name, "killed", oracles, problems[0], took, log)


def table(rows: list[tuple[Optional[Mutant], Verdict]]) -> str:
    head = ("mutant", "what it breaks", "promise", "verdict", "by which oracle", "time")
    body = []
    for m, v in rows:
        oracles = ", ".join(f"{k} x{n}" for k, n in sorted(v.oracles.items(), key=lambda kv: -kv[1]))
        body.append((v.name, m.breaks if m else "nothing (the unpatched tree)", m.promise if m else "-",
                     v.verdict, oracles or ("-" if v.verdict != "ERROR" else v.evidence[:60]), f"{v.seconds:.0f} s"))
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    widths[1] = min(widths[1], 60)
    lines = []
    for r in [head, tuple("-" * w for w in widths), *body]:
        cells = [r[i][:widths[i]].ljust(widths[i]) for i in range(len(r))]
        lines.append(" | ".join(cells).rstrip())
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="mutants", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="these mutants only (comma-separated names)")
    ap.add_argument("--seed", type=int, default=SEED, help=f"the fault test's seed (default {SEED})")
    ap.add_argument("--minutes", type=float, default=MINUTES)
    ap.add_argument("--no-baseline", action="store_true", help="skip the unpatched runs")
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    a = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not a.only or m.name in a.only.split(",")]
    unknown = set(x for x in a.only.split(",") if x) - {m.name for m in MUTANTS}
    if unknown:
        ap.error(f"unknown mutants {sorted(unknown)}; known: {', '.join(m.name for m in MUTANTS)}")
    if a.list:
        for m in MUTANTS:
            print(f"{m.name}: {m.breaks} [{m.promise}; {m.path}; fault kinds {','.join(m.kinds)}]")
        return 0
    work = tempfile.mkdtemp(prefix="mw-mutants-")
    tree, logs = os.path.join(work, "tree"), os.path.join(work, "logs")
    os.makedirs(logs)
    print(f"mutants: {len(chosen)} of {len(MUTANTS)}; fault test seed {a.seed}, {a.minutes:g} minutes each; "
          f"copy of the tree in {tree}", flush=True)
    rows: list[tuple[Optional[Mutant], Verdict]] = []
    ok = True
    try:
        copy_tree(tree)
        for m in chosen:   # every anchor first: a stale one fails before any run
            original = apply(tree, m)
            with open(os.path.join(tree, m.path), "w") as fh:
                fh.write(original)
        if not a.no_baseline:
            for kinds in sorted({m.kinds for m in chosen}):
                name = f"baseline[{','.join(kinds)}]"
                print(f"== {name}", flush=True)
                v = run_fault_test(tree, kinds, a.seed, a.minutes, os.path.join(logs, name + ".log"), name)
                rows.append((None, v))
                print(f"   {v.verdict} in {v.seconds:.0f} s {v.evidence[:200]}", flush=True)
                if v.verdict != "pass":
                    ok = False
            if not ok:
                print("mutants: a baseline did not pass: the unpatched tree fails this fault test, so no mutant "
                      "can be judged on it", file=sys.stderr)
                return 2
        for m in chosen:
            print(f"== {m.name}: {m.breaks} ({m.path})", flush=True)
            original = apply(tree, m)
            try:
                mod = m.path[:-3].replace("/", ".")
                imp = subprocess.run([PY, "-c", f"import {mod}"], cwd=tree, capture_output=True, text=True)
                if imp.returncode != 0:
                    v = Verdict(m.name, "ERROR", {}, f"the patched {mod} does not import: {imp.stderr[-300:]}", 0.0, "")
                else:
                    v = run_fault_test(tree, m.kinds, a.seed, a.minutes, os.path.join(logs, m.name + ".log"), m.name)
            finally:
                with open(os.path.join(tree, m.path), "w") as fh:
                    fh.write(original)
            if v.verdict == "pass":
                v.verdict = "SURVIVED"
            rows.append((m, v))
            print(f"   {v.verdict} in {v.seconds:.0f} s: {v.evidence[:300]}", flush=True)
            if v.verdict != "killed":
                ok = False
    except AnchorMissing as exc:
        print(f"mutants: {exc}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(tree, ignore_errors=True)
        print("\n" + table(rows) if rows else "", flush=True)
        print(f"\nlogs (each run's output and JSON verdict): {logs}")
    survived = [v.name for m, v in rows if m is not None and v.verdict == "SURVIVED"]
    if survived:
        print(f"mutants: SURVIVED {survived}: the fault test cannot see these bugs; strengthen its oracles "
              f"(tests/support/history.py, chaos.py), never the mutant", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
