"""A strict checker over a complete etcd history and the jobs' side-effect log.

Two halves:

- :func:`read_history` reads every event under a prefix from revision 1 to a sentinel it
  writes last, in one watch stream. Any error, a compaction, a cancelled watch, a
  revision out of order or (``contiguous=True``, when the test owns the whole etcd) a
  missing revision raises :class:`HistoryError`: a partial history is never checked.
- :func:`check` replays those events with the side effects the jobs recorded and the
  firings the workload expects, and returns a :class:`Report` whose problems each name
  the (job, firing). It is pure (events in, report out), so the unit tests feed it bad
  histories directly.

Run records are read as the contract defines them (README, etcd layout): ``job_id``,
``fire_id``, ``state``, ``attempt``, ``agent``, ``shard``, ``pool``, ``fanout``,
``started_at``, ``ended_at``, ``exit_code``, ``reason``, and ``fence`` (the create revision
of the shard key the write was fenced by); any other field is ignored.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Iterable, Optional

SENTINEL = "test/history-end"
TERMINAL = {"succeeded", "failed", "misfired", "timed_out", "killed", "cancelled", "aborted"}
MISFIRE_REASONS = ("misfire_", "overlap", "expired")


class HistoryError(AssertionError):
    """The history could not be read completely: the check must not run on it."""


@dataclass(frozen=True)
class Event:
    rev: int
    key: str
    kind: str              # put | delete
    value: bytes = b""
    create_rev: int = 0
    version: int = 0


# --------------------------------------------------------------------------- reading


def read_history(client, prefix: str, *, contiguous: bool = False, timeout: float = 60.0) -> list[Event]:
    """Every event under ``prefix`` since revision 1, complete or not at all.

    A sentinel key (``<prefix>test/history-end``... under the prefix) is written first; the
    watch must deliver everything up to its revision. ``contiguous``: every revision from 2
    to the sentinel's must carry an event under the prefix (true when the test's etcd
    holds nothing else), so a lost batch is detected even inside the stream."""
    import etcd3.etcdrpc as rpc
    import grpc
    from etcd3 import utils

    sentinel = prefix + SENTINEL
    end_rev = client.put(sentinel, str(time.time()))
    c, _ = client.client()
    key = prefix.encode()
    req = rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
        key=key, range_end=utils.increment_last_byte(key), start_revision=1))
    stop = threading.Event()

    def reqs():
        yield req
        stop.wait(timeout + 5)

    # its own channel: from revision 1 one response carries up to 1,000 revisions, past
    # gRPC's default 4 MiB receive limit once values are large (the 2,000-job test's)
    channel = c.channel
    if not client.endpoint.startswith("https"):
        host, port = client.endpoint_hostport()
        channel = grpc.insecure_channel(f"{host}:{port}", options=[("grpc.max_receive_message_length", 1 << 30)])
    stream = rpc.WatchStub(channel).Watch(reqs(), **client._md(c))
    q: queue.Queue = queue.Queue()

    def pump():
        try:
            for resp in stream:
                q.put(("resp", resp))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which fails
            q.put(("error", exc))
        q.put(("end", None))

    threading.Thread(target=pump, daemon=True, name="history-reader").start()
    out: list[Event] = []
    deadline = time.monotonic() + timeout
    last = 0
    try:
        while not out or out[-1].rev < end_rev:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HistoryError(f"history incomplete after {timeout}s: last revision {last}, want {end_rev}")
            try:
                kind, resp = q.get(timeout=left)
            except queue.Empty:
                continue
            if kind == "error":
                raise HistoryError(f"history watch failed after revision {last}: {resp!r}")
            if kind == "end":
                raise HistoryError(f"history watch ended after revision {last}, want {end_rev}")
            if resp.compact_revision:
                raise HistoryError(f"history compacted at revision {resp.compact_revision}")
            if resp.canceled:
                raise HistoryError(f"history watch cancelled: {resp.cancel_reason!r}")
            for ev in resp.events:
                kv = ev.kv
                rev = kv.mod_revision
                if rev < last:
                    raise HistoryError(f"revision {rev} after {last}: out of order")
                if contiguous and rev not in (last, last + 1) and not (last == 0 and rev == 2):
                    raise HistoryError(f"gap in the history: revision {last} then {rev}")
                last = rev
                out.append(Event(rev, kv.key.decode(), "delete" if ev.type == 1 else "put", kv.value,
                                 kv.create_revision, kv.version))
    finally:
        stop.set()
        stream.cancel()
        if channel is not c.channel:
            channel.close()
    return [e for e in out if e.key != sentinel]


# --------------------------------------------------------------------------- the workload


@dataclass
class Firing:
    """One firing the workload expects: ``due`` (epoch seconds), its job's policy."""

    job: str
    fire_id: str
    due: float
    kind: str = "at"              # at | cron
    max_attempts: int = 1
    may_skip: bool = False        # cron run_once/skip: may be skipped (no record) by the misfire policy
    missed_at_store: bool = False  # due before the job was stored: its misfire policy decides
    stored_at: float = 0.0        # when its job was stored (epoch s): it cannot start before
    expect: str = "succeeded"     # how it ends when nothing goes wrong: succeeded, failed (every
                                  # attempt fails: after max_attempts), misfired (it never runs)
    not_after: Optional[float] = None   # its job's not_after (epoch s): no attempt starts from then on


@dataclass
class SideEffect:
    """One line a job wrote: which attempt ran where and when (epoch seconds)."""

    job: str
    fire_id: str
    attempt: int
    agent: str
    start: float
    end: Optional[float] = None   # None: killed before it could write its end line


@dataclass
class Budget:
    """How many firings may end ``failed/owner_lost`` and how many may be ``misfired``
    (records plus cron firings skipped without a record), stated by the test."""

    owner_lost: int
    misfired: int


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    def fail(self, msg: str) -> None:
        self.problems.append(msg)


def name(job: str, fire_id: str) -> str:
    return f"({job}, {fire_id})"


def _ts(text: Optional[str]) -> Optional[float]:
    if not text:
        return None
    from agent.jobs.schedule import parse_rfc3339

    try:
        return parse_rfc3339(text).timestamp()
    except Exception:  # noqa: BLE001 - an unreadable time is reported by the caller
        return None


def _due_of(fire_id: str) -> Optional[float]:
    from agent.jobs.schedule import parse_fire_id

    try:
        return parse_fire_id(fire_id).timestamp()
    except ValueError:
        return None


def percentile(xs: list[float], p: float) -> Optional[float]:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


# --------------------------------------------------------------------------- checking

# the states that may follow each state of one firing's record (attempt n): running(n) ->
# retrying(n) -> running(n+1), or -> one final state; nothing after a final state
RAN = {"succeeded", "timed_out", "killed"}          # final states only a run can reach
FIRST_FINAL = TERMINAL - RAN                        # final states a firing may reach without a run


def _transition(prev: Optional[tuple[str, int]], state: str, attempt: int) -> Optional[str]:
    """Why ``state`` at ``attempt`` may not follow ``prev`` (None: allowed)."""
    if state not in TERMINAL and state not in ("running", "retrying"):
        return f"unknown state {state!r}"
    if prev is None:
        if attempt != 1:
            return f"first record {state!r} has attempt {attempt}"
        if state == "retrying" or state in RAN:
            return f"first record {state!r} without a 'running' record"
        return None
    pstate, pattempt = prev
    if pstate in TERMINAL:
        return f"{state!r} attempt {attempt} written after the final state {pstate!r}"
    if pstate == "running" and (state == "retrying" or state in TERMINAL) and attempt == pattempt:
        return None
    if pstate == "retrying" and ((state == "running" and attempt == pattempt + 1)
                                 or (state in FIRST_FINAL and attempt == pattempt)):
        return None
    return f"{state!r} attempt {attempt} after {pstate!r} attempt {pattempt}"


def _fence_key(prefix: str, rec: dict, shard: str, agent: str) -> str:
    """The shard key a run record is fenced by: ``shards/NNNN``, or for a targeted job its
    pool's (fan-out: the agent's own shard space in the pool), named by ``pool``/``fanout``."""
    pool = rec.get("pool")
    if not pool:
        return f"{prefix}shards/{shard}"
    if rec.get("fanout"):
        return f"{prefix}pools/{pool}/agents/{agent}/shards/{shard}"
    return f"{prefix}pools/{pool}/shards/{shard}"


def check(events: Iterable[Event], prefix: str, *, firings: Optional[Iterable[Firing]] = None,
          effects: Optional[Iterable[SideEffect]] = None, budget: Optional[Budget] = None,
          lateness_bound_s: Optional[float] = None, effective_due: Callable[[float], float] = lambda d: d,
          affected: Optional[Callable[[float], bool]] = None, max_run_s: float = 0.0,
          complete: bool = True, quiet: Optional[Callable[[Firing], bool]] = None,
          quiet_lateness_s: Optional[float] = None,
          early_ok_s: Optional[Callable[[SideEffect], float]] = None,
          late_ok_s: Optional[Callable[[SideEffect], float]] = None,
          rev_time: Optional[Callable[[int], Optional[float]]] = None) -> Report:
    """Replay the history and judge it.

    - a shard key changes owner only through a delete;
    - every write under ``runs/`` is fenced: it carries ``fence`` and at its revision the
      shard key it names exists, is held by the record's ``agent`` and has that create
      revision (so a write under an old fence by the same agent fails); every probe write
      carries the holder's token;
    - every record of a firing follows the one before it: running(n) -> retrying(n) ->
      running(n+1), or -> one final state, nothing after a final state, and
      ``1 <= attempt <= max_attempts`` on every record (``max_attempts`` from ``firings``);
    - per (job, firing, attempt) exactly one agent created its ``running`` record, once;
    - with ``effects`` (the side-effect log; None: the test keeps none): every side effect
      has that record, from the same agent, never before the due time (50 ms, or what
      ``early_ok_s(effect)`` allows for a clock the test set ahead), never at or after its
      job's ``not_after`` (50 ms, or what ``late_ok_s(effect)`` allows for a clock the test
      set behind); an attempt ran at
      most once, and exactly once when its record says its script ran to an exit
      (``succeeded``, or an exit code); runs of one firing never overlap (an attempt
      without an end line ended when its record says it did, else lasts ``max_run_s``);
    - with ``firings``: every one is resolved (terminal state; ``failed`` with a reason,
      ``misfired`` with a policy reason; a cron firing may be skipped by its misfire policy
      only when ``affected(due)``: a fault, or the recovery after one, was going on;
      default: ``effective_due(due) > due``), nothing else ran,
      within ``lateness_bound_s`` of ``effective_due(due)``: measured on the side effect's
      own clock when there is a log (a firing that never ran: when its final record was
      written, by ``rev_time(revision)`` (the test's clock) when given, else by the
      record's ``ended_at`` (its agent's clock); without a log: the records'
      ``started_at``); ``owner_lost`` only for a
      run a fault caught in flight (``affected`` at some time within ``max_run_s`` of its
      due time); ``owner_lost`` and ``misfired`` within ``budget``;
    - ``quiet(firing)``: the firing was due, and could run to its end, with no fault nor
      its recovery going on. It must end as the workload expects (``Firing.expect``):
      ``succeeded``, or ``failed`` after exactly ``max_attempts`` (a job that fails every
      attempt), one side effect per attempt, its first within ``quiet_lateness_s`` of its
      due time on the side effect's own clock, never skipped, ``owner_lost`` or misfired;
      or ``misfired`` without any side effect (a job that expires before it may start). A
      misfire the workload expects is not counted against the budget. A quiet firing
      skipped as ``misfired``/``overlap`` passes only when the side effects show an earlier
      firing of its job still waiting or running at its due time (a fault's late run
      reaching past its window), listed in ``stats["quiet_overlapped"]``.
    """
    rep = Report()
    shards_p, runs_p, probe_p = prefix + "shards/", prefix + "runs/", prefix + "test/probe/"
    pools_p = prefix + "pools/"
    firings = None if firings is None else {(f.job, f.fire_id): f for f in firings}
    holder: dict[str, tuple[str, int]] = {}
    running_by: dict[tuple[str, str, int], list[tuple[str, int]]] = {}
    outcome: dict[tuple[str, str, int], dict] = {}     # the record that ended each attempt
    last_of: dict[tuple[str, str], tuple[str, int]] = {}
    history: dict[tuple[str, str], list[tuple[int, dict]]] = {}
    counts = {"events": 0, "claims": 0, "releases": 0, "fenced_writes": 0, "run_writes": 0}
    for ev in events:
        counts["events"] += 1
        k = ev.key
        if k.startswith(shards_p) or (k.startswith(pools_p) and "/shards/" in k):
            if ev.kind == "delete":
                holder.pop(k, None)
                counts["releases"] += 1
                continue
            owner = ev.value.decode(errors="replace")
            if k in holder and holder[k][0] != owner:
                rep.fail(f"rev {ev.rev}: {k} changed owner {holder[k][0]} -> {owner} without a delete")
            if ev.version == 1:
                counts["claims"] += 1
            holder[k] = (owner, ev.create_rev)
        elif k.startswith(probe_p) and ev.kind == "put":
            counts["fenced_writes"] += 1
            try:
                doc = json.loads(ev.value)
                who = (doc["agent"], doc["token"])
            except (ValueError, KeyError, TypeError):
                rep.fail(f"rev {ev.rev}: unreadable probe write {k}")
                continue
            sk = shards_p + k[len(probe_p):]
            if holder.get(sk) != who:
                rep.fail(f"rev {ev.rev}: write by {who[0]} with token {who[1]} for {sk} held by {holder.get(sk)}")
        elif k.startswith(runs_p):
            parts = k[len(runs_p):].split("/")
            if len(parts) != 3:
                rep.fail(f"rev {ev.rev}: run key {k} is not runs/<shard>/<job>/<fire>")
                continue
            shard, job, fid = parts
            if ev.kind == "delete":
                continue  # retention, after the final state; not a fenced write we can attribute
            counts["run_writes"] += 1
            counts["fenced_writes"] += 1
            try:
                rec = json.loads(ev.value)
                agent, state, attempt = rec["agent"], rec["state"], int(rec["attempt"])
            except (ValueError, KeyError, TypeError):
                rep.fail(f"rev {ev.rev}: {name(job, fid)} unreadable run record")
                continue
            if rec.get("job_id", job) != job or rec.get("fire_id", fid) != fid:
                rep.fail(f"rev {ev.rev}: {name(job, fid)} record names {rec.get('job_id')}/{rec.get('fire_id')}")
            sk = _fence_key(prefix, rec, shard, agent)
            h = holder.get(sk)
            fence = rec.get("fence")
            if h is None or h[0] != agent:
                rep.fail(f"rev {ev.rev}: {name(job, fid)} attempt {attempt} written as {state!r} by {agent} "
                         f"while shard {shard} was held by {h[0] if h else 'nobody'}: an unfenced write")
            elif not isinstance(fence, int) or isinstance(fence, bool):
                rep.fail(f"rev {ev.rev}: {name(job, fid)} attempt {attempt} {state!r} record without a fence token "
                         f"({fence!r})")
            elif fence != h[1]:
                rep.fail(f"rev {ev.rev}: {name(job, fid)} attempt {attempt} written as {state!r} by {agent} under fence "
                         f"{fence}, but shard {shard} was held by {h[0]} under fence {h[1]}: a write under an old fence")
            f = firings.get((job, fid)) if firings is not None else None
            top = f.max_attempts if f is not None else None
            if attempt < 1 or (top is not None and attempt > top):
                rep.fail(f"rev {ev.rev}: {name(job, fid)}: {state!r} attempt {attempt} outside 1..{top or ''}"
                         + (f" (max_attempts {top})" if top else ""))
            prev = last_of.get((job, fid))
            why = _transition(prev, state, attempt)
            if why:
                rep.fail(f"rev {ev.rev}: {name(job, fid)}: {why}")
            last_of[(job, fid)] = (state, attempt)
            if state == "running":
                running_by.setdefault((job, fid, attempt), []).append((agent, ev.rev))
                if attempt == 1 and ev.version != 1:
                    rep.fail(f"rev {ev.rev}: {name(job, fid)} attempt 1 running record overwrote an existing record")
            elif prev is not None and prev[0] == "running" and (job, fid, attempt) not in outcome:
                outcome[(job, fid, attempt)] = rec
            history.setdefault((job, fid), []).append((ev.rev, rec))
    rep.stats.update(counts)

    for (job, fid, attempt), who in sorted(running_by.items()):
        if len(who) > 1:
            rep.fail(f"{name(job, fid)} attempt {attempt}: running record created {len(who)} times, by "
                     + ", ".join(f"{a} at rev {r}" for a, r in who))

    # --- side effects
    first_start: dict[tuple[str, str], float] = {}
    per_attempt: dict[tuple[str, str, int], list[SideEffect]] = {}
    per_firing: dict[tuple[str, str], list[SideEffect]] = {}
    if effects is not None:
        effects = list(effects)
        for se in effects:
            per_attempt.setdefault((se.job, se.fire_id, se.attempt), []).append(se)
            per_firing.setdefault((se.job, se.fire_id), []).append(se)
            k2 = (se.job, se.fire_id)
            first_start[k2] = min(first_start.get(k2, se.start), se.start)
            who = running_by.get((se.job, se.fire_id, se.attempt))
            if not who:
                rep.fail(f"{name(se.job, se.fire_id)} attempt {se.attempt}: side effect by {se.agent} at {se.start:.3f} "
                         f"without a fenced running record")
            elif who[0][0] != se.agent:
                rep.fail(f"{name(se.job, se.fire_id)} attempt {se.attempt}: side effect by {se.agent} but the running "
                         f"record was created by {who[0][0]}")
            due = _due_of(se.fire_id)
            # a run starts at its due time on its agent's clock: one set ahead (a clock fault
            # the test made, ``early_ok_s``) starts it that much early on the effect's clock
            early = early_ok_s(se) if early_ok_s is not None else 0.05
            if due is not None and se.start < due - early:
                rep.fail(f"{name(se.job, se.fire_id)} attempt {se.attempt}: ran at {se.start:.3f}, before its due time {due:.3f}")
            # and never once its job expired, by its agent's clock (one set behind starts it late)
            f = firings.get((se.job, se.fire_id)) if firings is not None else None
            late = late_ok_s(se) if late_ok_s is not None else 0.05
            if f is not None and f.not_after is not None and se.start >= f.not_after + late:
                rep.fail(f"{name(se.job, se.fire_id)} attempt {se.attempt}: ran at {se.start:.3f}, after its job's "
                         f"not_after {f.not_after:.3f}")
        for (job, fid, attempt), ses in sorted(per_attempt.items()):
            if len(ses) > 1:
                rep.fail(f"{name(job, fid)} attempt {attempt} ran {len(ses)} times")
        # an attempt whose record says its script ran to an exit has exactly one effect line
        for (job, fid, attempt), rec in sorted(outcome.items()):
            state, code = rec.get("state"), rec.get("exit_code")
            if state != "succeeded" and not (isinstance(code, int) and not isinstance(code, bool)):
                continue
            ses = per_attempt.get((job, fid, attempt), [])
            what = f"{state!r}" + (f" with exit code {code}" if state != "succeeded" else "")
            if not ses:
                rep.fail(f"{name(job, fid)} attempt {attempt}: {what} but no side effect")
            elif all(se.end is None for se in ses):
                rep.fail(f"{name(job, fid)} attempt {attempt}: {what} but its side effect has no end line")
        for (job, fid), ses in per_firing.items():
            ses = sorted(ses, key=lambda s: s.start)
            for a, b in zip(ses, ses[1:]):
                # no end line (killed): the end its agent recorded after reaping it, else the longest run
                rec_end = _ts((outcome.get((job, fid, a.attempt)) or {}).get("ended_at"))
                end = a.end if a.end is not None else (rec_end or a.start + max_run_s)
                if b.start < end:
                    rep.fail(f"{name(job, fid)}: attempt {b.attempt} started at {b.start:.3f} while attempt {a.attempt} "
                             f"(started {a.start:.3f}) could still run until {end:.3f}: overlapping runs")
        rep.stats["side_effects"] = len(effects)

    if firings is None:
        return rep

    # --- resolution, lateness, budget
    if affected is None:
        affected = lambda d: effective_due(d) > d  # noqa: E731
    late: list[float] = []
    quiet_late: list[float] = []
    quiet_n = 0
    overlapped: list[str] = []    # quiet firings misfired behind a late run of the same job
    jobs_firings: dict[str, list[Firing]] = {}
    for f in firings.values():
        jobs_firings.setdefault(f.job, []).append(f)
    owner_lost = misfired = skipped = 0
    failed_reasons: dict[str, int] = {}
    states: dict[str, int] = {}
    for (job, fid), recs in history.items():
        if (job, fid) not in firings:
            rep.fail(f"{name(job, fid)}: a record for a firing the workload never scheduled "
                     f"(states {[r['state'] for _, r in recs]})")
    for (job, fid), f in sorted(firings.items()):
        recs = history.get((job, fid))
        is_quiet = quiet is not None and quiet(f)
        if is_quiet:
            quiet_n += 1
            behind = _overlapped_by(f, jobs_firings.get(job, []), per_firing, max_run_s) if recs and \
                recs[-1][1].get("state") == "misfired" and recs[-1][1].get("reason") == "overlap" else None
            if behind is not None:
                overlapped.append(f"{name(job, fid)} behind {behind}")
            else:
                _check_quiet(rep, f, recs, per_attempt if effects is not None else None, quiet_lateness_s,
                             quiet_late, per_firing.get((job, fid), []))
        if not recs:
            if f.may_skip and (f.missed_at_store or affected(f.due)) and not is_quiet:
                skipped += 1
                continue
            if complete:
                rep.fail(f"{name(job, fid)}: due at {f.due:.3f}, never resolved (no run record)"
                         + (" outside any fault" if f.may_skip else ""))
            continue
        last = recs[-1][1]
        state, reason = last.get("state"), last.get("reason")
        states[state] = states.get(state, 0) + 1
        if state not in TERMINAL:
            if complete:
                rep.fail(f"{name(job, fid)}: left {state!r} (attempt {last.get('attempt')}, agent {last.get('agent')})")
            continue
        if state == "failed" and not reason:
            rep.fail(f"{name(job, fid)}: failed without a reason")
        if state == "misfired" and f.expect != "misfired":
            misfired += 1
            if not (reason or "").startswith(MISFIRE_REASONS):
                rep.fail(f"{name(job, fid)}: misfired with reason {reason!r}, not a misfire policy")
            if f.kind == "at" and (reason or "") != "expired":
                rep.fail(f"{name(job, fid)}: a one-shot firing misfired ({reason!r}); its policy runs it once")
        if state == "failed" and reason == "owner_lost":
            owner_lost += 1
            # a run is lost only to a fault that caught it in flight (due .. due + max_run_s)
            steps = int(max_run_s / 0.5) + 1
            if not any(affected(f.due + k * 0.5) for k in range(steps)):
                rep.fail(f"{name(job, fid)}: failed/owner_lost with no fault in flight "
                         f"(due {f.due:.3f}, runs last at most {max_run_s:.1f} s)")
        if state == "failed":
            key = (reason or "").split(":")[0]
            failed_reasons[key] = failed_reasons.get(key, 0) + 1
        due_from = effective_due(max(f.due, f.stored_at))   # a job stored late is due when stored
        if effects is not None:
            # the side effect's own clock; a firing that never ran: its final record's end
            t = first_start.get((job, fid))
            if t is not None:
                late.append(max(0.0, t - f.due))
                if lateness_bound_s is not None and t - due_from > lateness_bound_s:
                    rep.fail(f"{name(job, fid)}: started {t - f.due:.2f} s after its due time, {t - due_from:.2f} s "
                             f"after the faults healed (side effect's clock); the bound is {lateness_bound_s:.1f} s")
                continue
            t = rev_time(recs[-1][0]) if rev_time is not None else None
            if t is None:
                t = _ts(last.get("ended_at"))
        else:
            # no side-effect log: the records' own times, the first real start, else the end
            t = None
            for _, r in recs:
                if r.get("state") != "running" and r.get("started_at"):
                    t = _ts(r["started_at"])
                    break
            if t is None:
                t = min((_ts(r.get("ended_at")) for _, r in recs if r.get("ended_at")), default=None)
            if t is not None:
                late.append(max(0.0, t - f.due))
        if t is None:
            rep.fail(f"{name(job, fid)}: {state} without started_at or ended_at")
            continue
        if lateness_bound_s is not None and t - due_from > lateness_bound_s:
            rep.fail(f"{name(job, fid)}: resolved {t - f.due:.2f} s after its due time, {t - due_from:.2f} s after the "
                     f"faults healed; the bound is {lateness_bound_s:.1f} s")
    rep.stats.update({"firings": len(firings), "resolved": sum(states.values()), "states": states,
                      "failed_reasons": failed_reasons,
                      "owner_lost": owner_lost, "misfired": misfired + skipped, "skipped_by_policy": skipped,
                      "lateness_clock": "side effects" if effects is not None else "records",
                      "lateness_p50_s": percentile(late, 50), "lateness_p99_s": percentile(late, 99),
                      "lateness_max_s": max(late) if late else None})
    if quiet is not None:
        rep.stats.update({"quiet_firings": quiet_n, "quiet_overlapped": overlapped, "quiet_lateness_p50_s": percentile(quiet_late, 50),
                          "quiet_lateness_p99_s": percentile(quiet_late, 99),
                          "quiet_lateness_max_s": max(quiet_late) if quiet_late else None})
    if budget is not None:
        rep.stats["budget"] = {"owner_lost": budget.owner_lost, "misfired": budget.misfired}
        if owner_lost > budget.owner_lost:
            rep.fail(f"owner_lost {owner_lost} over its budget {budget.owner_lost}")
        if misfired + skipped > budget.misfired:
            rep.fail(f"misfired {misfired + skipped} ({skipped} skipped by policy) over its budget {budget.misfired}")
    return rep


# how long after its script's end line the agent may still count a run as running (it
# reaps the process and ends the run on its loop)
REAPED_WITHIN_S = 1.0


def _overlapped_by(f: Firing, same_job: list[Firing], per_firing: dict[tuple[str, str], list[SideEffect]],
                   max_run_s: float) -> Optional[str]:
    """The earlier firing of ``f``'s job that was still waiting or running at ``f``'s due
    time, by the side effects (its first run started after that time, or its run spans
    it), or None. A firing whose job forbids overlap is then skipped (``misfired``/
    ``overlap``) even in a quiet window: a run of an earlier firing, late because of a
    fault, can reach past the fault's window into the next due time."""
    for g in same_job:
        ses = per_firing.get((g.job, g.fire_id), [])
        if g.due >= f.due or not ses:
            continue
        start = min(se.start for se in ses)
        end = max(se.end if se.end is not None else se.start + max_run_s for se in ses)
        if start > f.due or end + REAPED_WITHIN_S >= f.due:
            return g.fire_id
    return None


def _check_quiet(rep: Report, f: Firing, recs: Optional[list[tuple[int, dict]]],
                 per_attempt: Optional[dict[tuple[str, str, int], list[SideEffect]]],
                 bound: Optional[float], late: list[float], ran: list[SideEffect]) -> None:
    """A firing due in a quiet window ended as the workload expects: it ran, once per
    attempt, on time, and succeeded (or failed after its last attempt); or it never ran
    and misfired."""
    n = name(f.job, f.fire_id)
    if not recs:
        rep.fail(f"{n}: due in a quiet window at {f.due:.3f}, never "
                 + ("resolved (no run record)" if f.expect == "misfired" else "ran (no run record)"))
        return
    last = recs[-1][1]
    state, reason, attempts = last.get("state"), last.get("reason"), int(last.get("attempt") or 1)
    if state != f.expect or (f.expect == "failed" and (attempts != f.max_attempts or reason == "owner_lost")):
        rep.fail(f"{n}: due in a quiet window, ended {state}" + (f"/{reason}" if reason else "")
                 + f" at attempt {attempts}, not {f.expect}"
                 + (f" after attempt {f.max_attempts}" if f.expect == "failed" else ""))
    if per_attempt is None:
        return
    if f.expect == "misfired":
        if ran:
            rep.fail(f"{n}: due in a quiet window, expected never to run, ran {len(ran)} time(s), first by "
                     f"{ran[0].agent} at {min(se.start for se in ran):.3f}")
        return
    for a in range(1, attempts + 1):
        got = per_attempt.get((f.job, f.fire_id, a), [])
        if len(got) != 1:
            rep.fail(f"{n}: due in a quiet window, attempt {a} has {len(got)} side effects, not exactly one")
    first = per_attempt.get((f.job, f.fire_id, 1))
    if first:
        t = min(se.start for se in first) - f.due
        late.append(max(0.0, t))
        if bound is not None and t > bound:
            rep.fail(f"{n}: due in a quiet window, started {t:.2f} s after its due time (side effect's clock); "
                     f"the quiet bound is {bound:.1f} s")


def final_records(events: Iterable[Event], prefix: str) -> dict[tuple[str, str], dict]:
    """The last record written for each (job, firing) in the history (deletes ignored)."""
    runs_p = prefix + "runs/"
    out: dict[tuple[str, str], dict] = {}
    for ev in events:
        if ev.kind == "put" and ev.key.startswith(runs_p):
            parts = ev.key[len(runs_p):].split("/")
            if len(parts) == 3:
                try:
                    out[(parts[1], parts[2])] = json.loads(ev.value)
                except ValueError:
                    continue
    return out


def assert_clean(rep: Report, limit: int = 15) -> None:
    if rep.problems:
        # the budget lines sum up many firings: shown first, then the first firings named
        ps = sorted(rep.problems, key=lambda p: "over its budget" not in p)
        raise AssertionError(f"{len(rep.problems)} history problem(s):\n  " + "\n  ".join(ps[:limit])
                             + f"\nstats: {rep.stats}")


def parse_effects(path: str) -> list[SideEffect]:
    """The side-effect log written by tests/jobs/effect.sh: ``start``/``end`` lines of
    ``what job fire_id attempt agent pid epoch``. A log that is missing or has a line that
    is not one of those fails: a side effect dropped here would hide a run."""
    out: dict[tuple, SideEffect] = {}
    try:
        fh = open(path)
    except FileNotFoundError:
        raise HistoryError(f"no side-effect log at {path}: no job ran, or the log went elsewhere") from None
    with fh:
        for n, line in enumerate(fh, 1):
            p = line.split()
            try:
                what, job, fid, attempt, agent, pid, t = p
                key = (job, fid, int(attempt), agent, int(pid))
                when = float(t)
            except ValueError:
                raise HistoryError(f"{path} line {n}: not 'start|end job fire attempt agent pid time': {line!r}") from None
            if what == "start":
                if key in out:
                    raise HistoryError(f"{path} line {n}: a second start of {key}")
                out[key] = SideEffect(job, fid, int(attempt), agent, when)
            elif what == "end":
                if key not in out:
                    raise HistoryError(f"{path} line {n}: an end without its start: {line!r}")
                if out[key].end is not None:
                    raise HistoryError(f"{path} line {n}: a second end of {key}")
                out[key].end = when
            else:
                raise HistoryError(f"{path} line {n}: unknown line kind {what!r}")
    return list(out.values())


def utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, timezone.utc)
