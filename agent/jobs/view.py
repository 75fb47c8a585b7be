"""What a job is doing, read from etcd alone: the read model behind `jobs/get` over MQTT
and the `millwright jobs|runs|logs` commands.

Everything here is derived from durable state (the stored job, its run records), so any
agent, or an operator's shell on any gateway, computes the same answer. The next due
time is recomputed with the scheduler's own deterministic functions (agent/jobs/schedule.py)
from the stored ``_accepted.at`` and the latest run record, which is what the shard's owner
arms its timer with.

Listings read etcd in pages (``EtcdClient.range_pages``), each prefix at one revision.
"""

from __future__ import annotations

import collections
import json
from datetime import datetime, timezone
from typing import Iterable, Iterator, Optional

from agent.coordination import placement
from agent.coordination.etcd import KV, EtcdClient
from agent.coordination.keys import Keys, shard_of
from agent.jobs import schedule as sch
from agent.jobs.states import IN_PROGRESS, JobState, RecordState

LAST_RUNS = 5


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
    (agent/jobs/waitmarks.py: shown, never believed)."""
    prefix = keys.waiting_prefix(shard, job_id)
    out: dict[str, list[dict]] = {}
    for kv in read_prefix(client, prefix):
        try:
            mark = json.loads(kv.value)
        except ValueError:
            continue
        if isinstance(mark, dict):
            jid = job_id or kv.key[len(prefix):].split("/", 1)[0]
            out.setdefault(jid, []).append(mark)
    return out


def view(doc: dict, shard: int, runs: list[dict], last_runs: int = LAST_RUNS,
         now: Optional[datetime] = None, members: Optional[dict[str, dict]] = None,
         waiting: Optional[list[dict]] = None) -> dict:
    """A job's public view: its document (reserved keys and signature left out), state,
    the last ``last_runs`` run records (oldest first) and the next due time. With
    ``members``, a targeted job that could fire but has no eligible agent is ``waiting``
    with reason ``no_eligible_agent``; with ``waiting`` marks, a job one of whose firings
    waits on its window or a gate is ``waiting`` with that reason."""
    from agent.coordination.jobstore import public_doc

    due = next_due(doc, runs, now)
    pub = public_doc(doc)
    pub.pop("sig", None)
    state = job_state(doc, runs, due)
    out = {"id": doc.get("id"), "shard": shard, "template": doc.get("template"), "state": state,
           "next_due": due, "accepted": doc.get("_accepted"), "cancelled": doc.get("_cancelled"),
           "updated_at": updated_at(doc, runs), "runs": runs[-last_runs:] if last_runs else [], "doc": pub}
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


def get_job(client, keys: Keys, shards: int, job_id: str, last_runs: int = LAST_RUNS) -> Optional[dict]:
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
    return view(doc, shard, runs, last_runs, members=read_members(client, keys) if doc.get("target") else None,
                waiting=waiting_marks(client, keys, shard, job_id).get(job_id))


def list_jobs(client, keys: Keys, shards: int, in_shards: Optional[Iterable[int]] = None,
              state: Optional[str] = None, template: Optional[str] = None, updated_since: Optional[str] = None,
              last_runs: int = 1, limit: Optional[int] = None) -> list[dict]:
    """Views of the jobs in ``in_shards`` (all shards by default) that match every filter."""
    since = parse_time(updated_since) if updated_since else None
    now = datetime.now(timezone.utc)
    out: list[dict] = []
    members = read_members(client, keys)
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
            v = view(d, shard, runs.get(d.get("id"), []), last_runs, now, members, marks.get(d.get("id")))
            if state is not None and v["state"] != state:
                continue
            if since is not None and (parse_time(v["updated_at"]) or now) < since:
                continue
            out.append(v)
            if limit is not None and len(out) >= limit:
                return out
    return out
