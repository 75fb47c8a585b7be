"""What a job is doing, read from etcd alone: the read model behind `jobs/get` over MQTT
and the `millwright jobs|runs|logs` commands.

Everything here is derived from durable state (the stored job, its run records), so any
agent, or an operator's shell on any gateway, computes the same answer. The next due
time is recomputed with the scheduler's own deterministic functions (agent/jobs/schedule.py)
from the stored ``_accepted.at`` and the latest run record, which is what the shard's owner
arms its timer with.

Listings read etcd in pages (``EtcdClient.range_pages``), each prefix at one revision;
:func:`list_page` is one bounded page of a listing (jobs/get answers a filter with it).
"""

from __future__ import annotations

import collections
import json
from datetime import datetime, timezone
from typing import Iterable, Iterator, Optional

from agent.coordination import placement
from agent.coordination.etcd import KV, EtcdClient
from agent.coordination.keys import Keys, shard_of
from agent.jobs import bounded
from agent.jobs import schedule as sch
from agent.jobs.states import IN_PROGRESS, JobState, RecordState

LAST_RUNS = 5
# waiting marks read per job: one per agent holding a waiting firing; more than an answer
# could show are left unread (agent/jobs/bounded.py cuts an array of more parts whole)
WAITING_MAX = bounded.MAX_PARTS


def read_prefix(client: EtcdClient, prefix: str, keys_only: bool = False) -> Iterator[KV]:
    """Every key under ``prefix`` in key order, read in pages at one revision."""
    for kvs, _ in client.range_pages(prefix, keys_only=keys_only):
        yield from kvs


def parse_time(text) -> Optional[datetime]:
    """An RFC 3339 time from a document; None when absent or not one."""
    try:
        return sch.parse_rfc3339(text) if text else None
    except (ValueError, TypeError):
        return None


def next_due(doc: dict, runs: list[dict], now: Optional[datetime] = None) -> Optional[str]:
    """The next firing the owner will run: a missed one still to run (now), else the next."""
    from agent.coordination.jobstore import public_doc
    from agent.jobs.document import Job
    from agent.jobs.envelope import JobRejected

    if "_cancelled" in doc or doc.get("_tombstone"):
        return None
    try:
        job = Job.for_display(public_doc(doc))
    except (JobRejected, Exception):
        return None
    now = now or datetime.now(timezone.utc)
    accepted = parse_time((doc.get("_accepted") or {}).get("at")) or now
    last = None
    for r in runs:
        try:
            d = sch.parse_fire_id(r.get("fire_id", ""))
        except Exception:
            continue
        if last is None or d > last:
            last = d
    try:
        rec = sch.recover_job(job, accepted, last, now)
    except Exception:
        return None
    due = rec.run[0] if rec.run else rec.next_due
    return sch.format_rfc3339(due) if due is not None else None


def job_state(doc: dict, runs: list[dict], due: Optional[str]) -> str:
    """cancelled; else the latest run's state while its firing is in progress (running,
    retrying); else scheduled when a firing is ahead; else the latest run's final state;
    else accepted."""
    if "_cancelled" in doc or doc.get("_tombstone"):
        return RecordState.CANCELLED
    latest = runs[-1] if runs else None
    if latest and latest.get("state") in IN_PROGRESS:
        return latest["state"]
    if due is not None:
        return JobState.SCHEDULED
    if latest:
        return latest.get("state") or "unknown"
    return JobState.ACCEPTED


def updated_at(doc: dict, runs: list[dict]) -> Optional[str]:
    """The newest time the job or its runs changed (RFC 3339), for ``updated_since``."""
    times = [(doc.get("_accepted") or {}).get("at"), (doc.get("_cancelled") or {}).get("at")]
    for r in runs[-1:]:
        times += [r.get("started_at"), r.get("ended_at")]
    parsed = [t for t in (parse_time(x) for x in times) if t is not None]
    return sch.format_rfc3339(max(parsed)) if parsed else None


def read_members(client, keys: Keys) -> dict[str, dict]:
    """Live members' records (labels, templates, availability), for placement views."""
    out = {}
    for kv in read_prefix(client, keys.members_prefix()):
        try:
            out[kv.key[len(keys.members_prefix()):]] = json.loads(kv.value)
        except ValueError:
            continue
    return out


def placement_view(doc: dict, members: Optional[dict[str, dict]]) -> Optional[dict]:
    """A targeted job's pool and its eligible live agents; with none, the reason it waits
    (and which selector keys no live member publishes). None for untargeted jobs."""
    if not doc.get("target") or members is None:
        return None
    try:
        target = placement.check_target(doc["target"])
    except placement.TargetError as exc:
        return {"target": doc.get("target"), "eligible": [], "reason": "bad_target", "detail": str(exc)}
    spec = placement.pool_spec(target, str(doc.get("template", "")))
    assert spec is not None
    eligible = sorted(a for a, m in members.items() if isinstance(m, dict) and m.get("available", True)
                      and placement.eligible(a, m.get("labels") or {}, m.get("templates") or [], spec))
    out: dict = {"pool": placement.pool_id(spec), "target": target, "eligible": eligible}
    if not eligible:
        out["reason"] = "no_eligible_agent"
        known = {k for m in members.values() if isinstance(m, dict) for k in (m.get("labels") or {})}
        unknown = placement.unknown_keys(spec, known)
        if unknown:
            out["detail"] = f"no live agent publishes label key(s) {', '.join(unknown)}"
    return out


def window_view(doc: dict, now: datetime) -> Optional[dict]:
    """The job's maintenance window at ``now``: open until, or when it next opens."""
    from agent.jobs.window import Window, WindowError

    if "window" not in doc:
        return None
    try:
        return Window.parse(doc["window"]).describe(now)
    except WindowError as exc:
        return {"error": str(exc)}


def waiting_marks(client: EtcdClient, keys: Keys, shard: int, job_id: Optional[str] = None) -> dict[str, list[dict]]:
    """The waiting marks of a shard's jobs (or one job's): job id -> the agents' marks
    (agent/jobs/waitmarks.py: shown, never believed), at most WAITING_MAX per job, whatever
    an etcd writer put there."""
    prefix = keys.waiting_prefix(shard, job_id)
    out: dict[str, list[dict]] = {}
    for kv in read_prefix(client, prefix):
        jid = job_id or kv.key[len(prefix):].split("/", 1)[0]
        marks = out.setdefault(jid, [])
        if len(marks) >= WAITING_MAX:
            if job_id is not None:
                break   # one job's: nothing more to read
            continue
        try:
            mark = json.loads(kv.value)
        except ValueError:
            continue
        if isinstance(mark, dict):
            marks.append(mark)
    return {j: m for j, m in out.items() if m}


def view(doc: dict, shard: int, runs: list[dict], last_runs: int = LAST_RUNS,
         now: Optional[datetime] = None, members: Optional[dict[str, dict]] = None,
         rollout: Optional[dict] = None, approval: Optional[dict] = None,
         waiting: Optional[list[dict]] = None) -> dict:
    """A job's public view: its document (reserved keys and signature left out), state,
    the last ``last_runs`` run records (oldest first) and the next due time. With
    ``members``, a targeted job that could fire but has no eligible agent is ``waiting``
    with reason ``no_eligible_agent``. ``rollout`` (rollout_view) and ``approval``
    (approval_view) are shown, and make the state ``aborted`` / ``waiting_approval``; with
    ``waiting`` marks, a job one of whose firings waits on its window or a gate is
    ``waiting`` with that reason."""
    from agent.coordination.jobstore import public_doc

    due = next_due(doc, runs, now)
    pub = public_doc(doc)
    pub.pop("sig", None)
    pub.pop("approvals", None)
    state = job_state(doc, runs, due)
    if rollout is not None and rollout.get("aborted") and state != RecordState.CANCELLED:
        state = RecordState.ABORTED
    elif approval is not None and not approval["ok"] and not runs and state in (JobState.SCHEDULED,
                                                                                 JobState.ACCEPTED):
        state = JobState.WAITING_APPROVAL
    out = {"id": doc.get("id"), "shard": shard, "template": doc.get("template"), "state": state,
           "next_due": due, "accepted": doc.get("_accepted"), "cancelled": doc.get("_cancelled"),
           "updated_at": updated_at(doc, runs), "runs": runs[-last_runs:] if last_runs else [], "doc": pub}
    for name, extra in (("rollout", rollout), ("approval", approval)):
        if extra is not None:
            out[name] = extra
    where = placement_view(doc, members)
    if where is not None:
        out["placement"] = where
        if not where["eligible"] and state in (JobState.SCHEDULED, JobState.ACCEPTED):
            out["state"] = JobState.WAITING
            out["reason"] = where["reason"]
    window = window_view(doc, now or datetime.now(timezone.utc))
    if window is not None:
        out["window"] = window
    marks = [m for m in waiting or () if isinstance(m.get("reason"), str)]
    if marks:
        out["waiting"] = marks
        if out["state"] in (JobState.SCHEDULED, JobState.ACCEPTED, RecordState.RETRYING):
            out["state"], out["reason"] = JobState.WAITING, marks[0]["reason"]
    return out


def _runs_by_job(kvs: Iterable[KV], prefix: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for kv in kvs:
        rest = kv.key[len(prefix):]
        job_id, _, fire = rest.partition("/")
        if not fire:
            continue
        try:
            out.setdefault(job_id, []).append(json.loads(kv.value))
        except ValueError:
            continue
    return out


def job_runs(client: EtcdClient, keys: Keys, shards: int, job_id: str, limit: Optional[int] = None) -> list[dict]:
    """The job's run records, oldest first (fire ids sort by due time); the newest ``limit``
    (retention bounds a job's records to ``retention.keep_runs``, so all are read)."""
    prefix = keys.runs_prefix(shard_of(job_id, shards), job_id)
    kvs: Iterable[KV] = read_prefix(client, prefix)
    if limit is not None:
        kvs = collections.deque(kvs, maxlen=limit)
    out = []
    for kv in kvs:
        try:
            out.append(json.loads(kv.value))
        except ValueError:
            continue
    return out


def get_job(client, keys: Keys, shards: int, job_id: str, last_runs: int = LAST_RUNS,
            templates: Optional[dict] = None, keyring=None) -> Optional[dict]:
    """A job's view (None: no such job). With ``templates`` (and the ``keyring`` for key
    roles), a job of a template that asks for approvals shows where it stands."""
    shard = shard_of(job_id, shards)
    kv = client.get(keys.job(shard, job_id))
    if kv is None:
        return None
    try:
        doc = json.loads(kv.value)
    except ValueError:
        return None
    # the state needs the latest record; next_due needs the latest fire id: both are the newest
    runs = job_runs(client, keys, shards, job_id, limit=max(1, last_runs))
    members = read_members(client, keys) if doc.get("target") else None
    return view(doc, shard, runs, last_runs, members=members,
                rollout=rollout_view(client, keys, shards, doc, members), approval=approval_view(doc, templates, keyring),
                waiting=waiting_marks(client, keys, shard, job_id).get(job_id))


def approval_view(doc: dict, templates: Optional[dict], keyring) -> Optional[dict]:
    """Where a job of a four-eyes template stands (its signatures' key ids and roles, not
    verified here: the agents that run it verify them), or None without a rule."""
    from agent.jobs import approvals

    rule = approvals.rule_of(templates, str(doc.get("template", "")))
    if rule is None:
        return None
    try:
        st = approvals.standing(approvals.signers(doc, keyring, None, None, verify=False), rule)
    except Exception:
        return {"ok": False, "detail": "approvals: not readable"}
    return {"ok": st.ok, "detail": st.describe(), **st.to_dict()}


RUN_OUTCOMES = ("succeeded", "failed", "timed_out", "killed")


def rollout_view(client, keys: Keys, shards: int, doc: dict, members: Optional[dict[str, dict]]) -> Optional[dict]:
    """A fan-out job's rollout: its newest firing, each eligible agent's state there
    (waiting, running, succeeded, failed, ..., aborted; and its rollback's), the counts, the
    claims in etcd's order, the abort mark and the start rate now. None for a job without rollout."""
    from agent.jobs import rollout as ro

    if "rollout" not in doc or not isinstance(doc.get("id"), str):
        return None
    job_id = doc["id"]
    shard = shard_of(job_id, shards)
    jr = ro.JobRollout()
    for kv in read_prefix(client, keys.rollouts_prefix()):   # every agent's keys, the job's picked out
        where = keys.split_rollout_key(kv.key)
        if where is not None and where[1] == shard and where[2] == job_id:
            jr.put(where[0], where[3], kv)
    try:
        spec = ro.parse_rollout(doc, placement.check_target(doc.get("target")))
    except Exception:
        spec = None
    records = job_runs(client, keys, shards, job_id)
    firing_of = lambda fid: ro.rolled_back(fid) or ro.base_of(fid)   # noqa: E731
    bases = set(jr.firings) | {firing_of(r["fire_id"]) for r in records if isinstance(r.get("fire_id"), str)}
    base = max(bases) if bases else None
    agents: dict[str, dict] = {a: {"state": "waiting"} for a in (placement_view(doc, members) or {}).get("eligible", [])}
    for r in records:
        fid, agent = r.get("fire_id"), r.get("agent")
        if not isinstance(fid, str) or not isinstance(agent, str) or firing_of(fid) != base:
            continue
        slot = agents.setdefault(agent, {"state": "waiting"})
        if ro.rolled_back(fid) is not None:
            slot["rollback"] = r.get("state")
        else:
            slot["state"] = r.get("state")
    states = [a["state"] for a in agents.values()]
    counts = {"started": sum(s in RUN_OUTCOMES or s in ("running", "retrying") for s in states),
              "running": sum(s in ("running", "retrying") for s in states),
              "succeeded": states.count("succeeded"),
              "failed": sum(s in ("failed", "timed_out", "killed") for s in states),
              "waiting": states.count("waiting"), "aborted": states.count("aborted")}
    fr = jr.firings.get(base) if base else None
    out: dict = {"firing": base, "counts": counts, "agents": dict(sorted(agents.items())), "aborted": jr.aborted,
                 "state": "aborted" if jr.aborted else "running" if counts["waiting"] or counts["running"] else "done"}
    if spec is not None:
        out["spec"] = ro.describe(spec)
        if fr is not None:
            t = ro.tally(spec, fr)
            out["tally"] = t.to_dict()
            out["rate_per_minute"] = ro.rate(spec, t.succeeded)
    if fr is not None:
        out["claims"] = [c.agent for c in sorted(fr.claims.values(), key=lambda c: c.create_revision)]
    return out


def abort_marks(client, keys: Keys) -> set[tuple[int, str]]:
    """(shard, job) of every job some agent marked aborted (one keys-only read of rollouts/)."""
    out = set()
    for kv in read_prefix(client, keys.rollouts_prefix(), keys_only=True):
        where = keys.split_rollout_key(kv.key)
        if where is not None and where[3] == "aborted":
            out.add((where[1], where[2]))
    return out


def list_jobs(client, keys: Keys, shards: int, in_shards: Optional[Iterable[int]] = None,
              state: Optional[str] = None, template: Optional[str] = None, updated_since: Optional[str] = None,
              last_runs: int = 1, limit: Optional[int] = None) -> list[dict]:
    """Views of the jobs in ``in_shards`` (all shards by default) that match every filter."""
    since = parse_time(updated_since) if updated_since else None
    now = datetime.now(timezone.utc)
    out: list[dict] = []
    members = read_members(client, keys)
    aborts: Optional[set] = None
    for shard in sorted(in_shards) if in_shards is not None else range(shards):
        jobs_prefix = keys.jobs_prefix(shard)
        docs = []
        for kv in read_prefix(client, jobs_prefix):
            try:
                docs.append(json.loads(kv.value))
            except ValueError:
                continue
        if not docs:
            continue
        if template is not None:
            docs = [d for d in docs if d.get("template") == template]
            if not docs:
                continue
        runs_prefix = keys.runs_prefix(shard)
        runs = _runs_by_job(read_prefix(client, runs_prefix), runs_prefix)
        marks = waiting_marks(client, keys, shard)
        for d in docs:
            aborted = None
            if "rollout" in d and isinstance(d.get("id"), str):   # any agent's abort mark
                if aborts is None:
                    aborts = abort_marks(client, keys)
                aborted = {"aborted": (shard, d["id"]) in aborts}
            v = view(d, shard, runs.get(d.get("id"), []), last_runs, now, members, rollout=aborted,
                     waiting=marks.get(d.get("id")))
            if state is not None and v["state"] != state:
                continue
            if since is not None and (parse_time(v["updated_at"]) or now) < since:
                continue
            out.append(v)
            if limit is not None and len(out) >= limit:
                return out
    return out


def _latest_between(client, keys: Keys, shard: int, first: str, last: str) -> dict[str, dict]:
    """The latest run record (latest/<shard>/<job>) of every job whose id is in [first, last]."""
    prefix = keys.latest_prefix(shard)
    stop = keys.latest(shard, last)
    out: dict[str, dict] = {}
    for kvs, _ in client.range_pages(prefix, start=keys.latest(shard, first), page=64):
        for kv in kvs:
            if kv.key > stop:
                return out
            try:
                out[kv.key[len(prefix):]] = json.loads(kv.value)
            except ValueError:
                continue
    return out


def list_page(client, keys: Keys, shards: int, in_shards: Iterable[int], *, state: Optional[str] = None,
              template: Optional[str] = None, updated_since: Optional[str] = None,
              after: Optional[tuple[int, str]] = None, limit: int = 1000, max_bytes: Optional[int] = None,
              scan_max: Optional[int] = None, shape=lambda v, shard, job_id: v,
              batch: int = 64) -> tuple[list[dict], Optional[tuple[int, str]]]:
    """One page of :func:`list_jobs` for a reader that must bound its work and its answer:
    the matching views of the jobs in ``in_shards``, in (shard, id) order, strictly after
    ``after`` (shard, job id); at most ``limit`` views, at most ``max_bytes`` of their
    JSON (after ``shape(view, shard, job_id)``, the id of the etcd key), and at most
    ``scan_max`` jobs read. Returns the views and where the next page starts (the last job
    read or included), or None when the shards are done. The first view is held to
    ``max_bytes`` too: one that does not fit is a stub (agent/jobs/bounded.py) with its
    key's id, so a page always moves on and never exceeds its bound.

    Reads each job's state from its ``latest/`` copy (one key per job, in the same order as
    ``jobs/``), so a page costs the jobs it reads, never the whole shard's run records."""
    since = parse_time(updated_since) if updated_since else None
    now = datetime.now(timezone.utc)
    members = read_members(client, keys)
    out: list[dict] = []
    used = 2
    scanned = 0
    last: Optional[tuple[int, str]] = None
    for shard in sorted(s for s in in_shards if after is None or s >= after[0]):
        prefix = keys.jobs_prefix(shard)
        start = keys.job(shard, after[1]) + "\0" if after is not None and shard == after[0] else None
        for kvs, _ in client.range_pages(prefix, start=start, page=batch):
            docs = []
            for kv in kvs:
                try:
                    docs.append((kv.key[len(prefix):], json.loads(kv.value)))
                except ValueError:
                    docs.append((kv.key[len(prefix):], None))
            if not docs:
                continue
            latest = _latest_between(client, keys, shard, docs[0][0], docs[-1][0])
            for job_id, d in docs:
                if scan_max is not None and scanned >= scan_max:
                    return out, last
                scanned += 1
                if not isinstance(d, dict) or (template is not None and d.get("template") != template):
                    last = (shard, job_id)
                    continue
                rec = latest.get(job_id)
                v = view(d, shard, [rec] if rec else [], 1, now, members)
                if (state is not None and v["state"] != state) or \
                        (since is not None and (parse_time(v["updated_at"]) or now) < since):
                    last = (shard, job_id)
                    continue
                v = shape(v, shard, job_id)
                size = bounded.size(v) + 1
                if not out and max_bytes is not None and used + size > max_bytes:
                    v = bounded.stub(job_id, shard, size - 1)   # the first view is bounded too
                    size = bounded.size(v) + 1
                if out and (len(out) >= limit or (max_bytes is not None and used + size > max_bytes)):
                    return out, last
                out.append(v)
                used += size
                last = (shard, job_id)
    return out, None
