"""`millwright jobs list|show`, `millwright runs ID`, `millwright logs RUN [-f]`: an operator
on any gateway asks etcd what jobs there are and what they did, without etcdctl or the
shard formula. Read-only; the views are agent/jobs/view.py's (the same as jobs/get over MQTT).

Human tables by default, ``--json`` for machines. Exit codes: 0 ok, 1 not found (or the
run's output is on another agent's disk: the message names the agent and where), 2 usage,
4 etcd unreachable.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

from agent.errors import UserError

EXIT_NOT_FOUND, EXIT_UNREACHABLE = 1, 4
FOLLOW_POLL_S = 0.2
# `jobs show` prints at most this much of a job's view, whatever etcd holds (a signed
# document is at most mqtt.max_payload_bytes, 5 runs' stderr tails 4 KiB each: a real view
# fits); more is cut as jobs/get cuts it (agent/jobs/bounded.py)
SHOW_MAX_BYTES = 256 * 1024


def _obj(v) -> dict:
    """``v`` when it is an object, else an empty one: a view's parts come from etcd."""
    return v if isinstance(v, dict) else {}


def _cut_note(v) -> Optional[str]:
    """How a part cut whole is shown (agent/jobs/bounded.py's marker), or None."""
    return f"(truncated: {v.get('bytes')} bytes)" if isinstance(v, dict) and v.get("truncated") is True else None


def _open(args):
    from agent.cli import load_cli_config
    from agent.coordination.etcd import EtcdClient
    from agent.coordination.keys import Keys

    cfg = load_cli_config(args)
    return cfg, EtcdClient(cfg.etcd), Keys(cfg.cluster)


def _etcd(fn, cfg):
    from agent.coordination.etcd import EtcdError, EtcdUnavailable

    try:
        return fn()
    except (EtcdUnavailable, EtcdError) as exc:
        raise UserError(f"cannot read etcd at {', '.join(cfg.etcd.endpoints)}: {str(exc)[:200]}",
                        EXIT_UNREACHABLE) from None


def _table(rows: list[list], header: list[str]) -> str:
    cells = [[("-" if v is None else str(v)) for v in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header).rstrip()] + [fmt.format(*r).rstrip() for r in cells])


def _print_json(doc) -> None:
    print(json.dumps(doc, indent=2, sort_keys=True, default=str))


def _run_rows(runs: list[dict]) -> list[list]:
    return [[r.get("fire_id"), r.get("attempt"), r.get("state"), r.get("agent"), r.get("started_at"),
             r.get("ended_at"), r.get("exit_code"), str(r.get("reason") or "")[:60]] for r in map(_obj, runs)]


RUN_HEADER = ["FIRE_ID", "ATTEMPT", "STATE", "AGENT", "STARTED", "ENDED", "EXIT", "REASON"]


def _valid_id(job_id: str) -> str:
    from agent.jobs.document import ID_RE

    if not ID_RE.fullmatch(job_id) or job_id.startswith("."):
        raise UserError(f"{job_id!r} is not a job id ([A-Za-z0-9._-]{{1,128}}, not starting with '.')")
    return job_id


# --------------------------------------------------------------------------- jobs list / show

def cli_jobs_list(args) -> int:
    from agent.jobs import view

    cfg, client, keys = _open(args)
    from agent.jobs import bounded

    jobs = _etcd(lambda: view.list_jobs(client, keys, cfg.shards, state=args.state, template=args.template,
                                        last_runs=1), cfg)
    # each job's view within the bound of a jobs/get answer, whatever etcd holds
    jobs = [bounded.fitted(j, cfg.mqtt.get_page_bytes) for j in jobs]
    if args.json:
        _print_json(jobs)
        return 0
    rows = []
    for j in jobs:
        runs = j.get("runs")
        last = _obj(runs[-1]) if isinstance(runs, list) and runs else {}
        rows.append([j["id"], j["shard"], j.get("template"), j.get("state", "(cut whole)"), j.get("next_due"),
                     f"{last.get('fire_id')} {last.get('state')}" if last else None])
    print(_table(rows, ["ID", "SHARD", "TEMPLATE", "STATE", "NEXT_DUE", "LAST_RUN"]))
    print(f"{len(jobs)} job(s)")
    return 0


def cli_jobs_show(args) -> int:
    from agent.jobs import view

    job_id = _valid_id(args.id)
    cfg, client, keys = _open(args)
    ring = _keyring(cfg)
    from agent.jobs import bounded

    job = _etcd(lambda: view.get_job(client, keys, cfg.shards, job_id, templates=cfg.templates, keyring=ring), cfg)
    if job is None:
        raise UserError(f"no job {job_id} in cluster {cfg.cluster}", EXIT_NOT_FOUND)
    job = bounded.fitted(job, SHOW_MAX_BYTES, job_id, job.get("shard"))
    if args.json:
        _print_json(job)
        return 0
    if bounded.was_cut(job) == "stub":
        print(f"job       {job_id}  (shard {job['shard']})\n"
              f"          its view is {job['bytes']} bytes, over {SHOW_MAX_BYTES}: cut whole (etcd holds more "
              "than an agent writes)")
        return 0
    acc, doc = _obj(job.get("accepted")), _obj(job.get("doc"))
    lines = [f"job       {job['id']}  (shard {job['shard']})",
             f"template  {job.get('template')}  params {json.dumps(doc.get('params', {}), sort_keys=True)}",
             f"schedule  {json.dumps(doc.get('schedule', {}), sort_keys=True)}",
             f"state     {job['state']}" + (f" ({job['reason']})" if job.get("reason") else ""),
             f"next due  {job.get('next_due') or '-'}",
             f"accepted  {acc.get('at', '-')} by {acc.get('by', '-')}"]
    where = _obj(job.get("placement"))
    if where:
        lines.append(f"target    {json.dumps(where.get('target'), sort_keys=True)}  pool {where.get('pool', '-')}  "
                     f"eligible {', '.join(where.get('eligible') or []) or '-'}"
                     + (f"  ({where['detail']})" if where.get("detail") else ""))
    lines += _maintenance_lines(job, cfg)
    if job.get("cancelled"):
        c = _obj(job["cancelled"])
        lines.append(f"cancelled {c.get('at')} by {c.get('by')} ({c.get('reason')})")
    if job.get("approval"):
        lines.append(f"approvals {_obj(job['approval']).get('detail')}")
    lines += _rollout_lines(_obj(job.get("rollout")))
    if job.get("cut"):
        lines.append(f"cut       {', '.join(map(str, job['cut']))}: over {SHOW_MAX_BYTES} bytes (etcd holds more "
                     "than an agent writes?)")
    print("\n".join(lines))
    runs = job.get("runs")
    if _cut_note(runs):
        print(f"last runs: {_cut_note(runs)}")
    elif runs:
        print("last runs:")
        print(_table(_run_rows(runs), RUN_HEADER))
    return 0


def _keyring(cfg):
    """The keys file's ring, for the roles of the keys that signed (None if unreadable here)."""
    from agent.jobs.signing import KeyFileError, KeyRing

    try:
        return KeyRing.load(cfg.signing.keys_file)
    except (KeyFileError, OSError):
        return None


def _rollout_lines(r: Optional[dict]) -> list[str]:
    """A staged rollout's progress: counts, limits, the abort, and each agent's state."""
    if not r:
        return []
    c, spec = _obj(r.get("counts")), _obj(r.get("spec"))
    limits = ", ".join(f"{k} {json.dumps(v, sort_keys=True)}" for k, v in spec.items())
    lines = [f"rollout   {r.get('state')}  firing {r.get('firing') or '-'}: " + ", ".join(
        f"{c.get(k, 0)} {k}" for k in ("started", "running", "succeeded", "failed", "waiting", "aborted")),
        f"          {limits}" + (f"; now {r['rate_per_minute']:g}/min" if r.get("rate_per_minute") else "")]
    mark = r.get("aborted")
    if mark:
        mark = _obj(mark)
        lines.append(f"aborted   {mark.get('at', '-')} by {mark.get('by', '-')}: {mark.get('detail', '')}")
    agents = r.get("agents")
    if _cut_note(agents):
        lines.append(f"  agents {_cut_note(agents)}")
        return lines
    for agent, a in _obj(agents).items():
        a = _obj(a)
        rb = f"  rollback {a['rollback']}" if a.get("rollback") else ""
        lines.append(f"  {agent:<20} {a.get('state')}{rb}")
    return lines


def _maintenance_lines(job: dict, cfg) -> list[str]:
    """Its window (open until / opens at) and gates (the template's on this agent's config,
    and what the agents holding a waiting firing say of them)."""
    out = []
    w = _obj(job.get("window"))
    if w:
        if w.get("error"):
            out.append(f"window    invalid: {w['error']}")
        elif w.get("open"):
            out.append(f"window    open until {w.get('closes_at') or '-'} (end: {w.get('end')})")
        else:
            out.append(f"window    closed; next opens {w.get('opens_at') or 'never'} until "
                       f"{w.get('then_closes_at') or '-'} (end: {w.get('end')})")
    tpl = cfg.templates.get(job.get("template") or "")
    for name, g in sorted((tpl.gates if tpl is not None else {}).items()):
        what = f"mqtt {g.mqtt} = {g.equals!r}" if g.mqtt else f"etcd {g.etcd} = {g.equals!r}" if g.etcd else \
            f"probe {' '.join(g.command)}"
        out.append(f"gate      {name}: {what}")
    marks = job.get("waiting")
    if _cut_note(marks):
        out.append(f"waiting   {_cut_note(marks)}")
    for m in marks if isinstance(marks, list) else ():
        m = _obj(m)
        out.append(f"waiting   {m.get('fire_id')} on {m.get('agent')} since {m.get('since')}: {m.get('reason')}"
                   + (f" ({m['detail']})" if m.get("detail") else ""))
    return out


# --------------------------------------------------------------------------- runs

def cli_runs(args) -> int:
    from agent.jobs import view

    job_id = _valid_id(args.id)
    cfg, client, keys = _open(args)

    def read():
        from agent.coordination.keys import shard_of

        if client.get(keys.job(shard_of(job_id, cfg.shards), job_id)) is None:
            return None
        return view.job_runs(client, keys, cfg.shards, job_id)

    runs = _etcd(read, cfg)
    if runs is None:
        raise UserError(f"no job {job_id} in cluster {cfg.cluster}", EXIT_NOT_FOUND)
    if args.json:
        _print_json(runs)
        return 0
    print(_table(_run_rows(runs), RUN_HEADER))
    print(f"{len(runs)} run(s)")
    return 0


# --------------------------------------------------------------------------- logs

def run_dir_for(state_dir: str, job_id: str, fire_id: str, attempt: int) -> Optional[str]:
    """The directory the executor wrote a run's output to (<state_dir>/runs/<safe_name(run key)>,
    run key ``<job>/<fire_id>#<n>.<attempt>``); the newest when several match."""
    import glob
    import re

    from agent.execute.backends import safe_name

    stem = f"{job_id}/{fire_id}#"
    prefix = safe_name(stem).rsplit("-", 1)[0]
    base = os.path.join(state_dir, "runs")
    exact = len(prefix) == len(stem)   # not truncated: the attempt can be checked
    pat = re.compile(re.escape(prefix) + r"\d+\." + str(int(attempt)) + r"-[0-9a-f]{10}$")
    found = [p for p in glob.glob(os.path.join(glob.escape(base), glob.escape(prefix) + "*"))
             if os.path.isdir(p) and (not exact or pat.fullmatch(os.path.basename(p)))]
    if not found:
        return None
    return max(found, key=lambda p: os.stat(p).st_mtime)


def _find_run(client, keys, shards: int, ref: str) -> Optional[dict]:
    from agent.coordination.keys import shard_of
    from agent.jobs import view

    job_id, _, fire_id = ref.partition("/")
    _valid_id(job_id)
    if fire_id:
        kv = client.get(keys.run(shard_of(job_id, shards), job_id, fire_id))
        return json.loads(kv.value) if kv else None
    runs = view.job_runs(client, keys, shards, job_id, limit=1)
    return runs[-1] if runs else None


def cli_logs(args) -> int:
    from agent.jobs.render import run_id

    cfg, client, keys = _open(args)
    rec = _etcd(lambda: _find_run(client, keys, cfg.shards, args.run), cfg)
    if rec is None:
        raise UserError(f"no run {args.run} in cluster {cfg.cluster} (RUN is JOB_ID/FIRE_ID, or JOB_ID for its "
                        "latest run; `millwright runs JOB_ID` lists them)", EXIT_NOT_FOUND)
    ref = f"{rec['job_id']}/{rec['fire_id']}"
    agent = rec.get("agent")
    if agent != cfg.agent_id:
        kv = _etcd(lambda: client.get(keys.member(agent)), cfg) if agent else None
        host = None
        if kv is not None:
            try:
                host = json.loads(kv.value).get("host")
            except ValueError:
                pass
        where = f"agent {agent}" + (f" (host {host})" if host else " (not a live member now)")
        raise UserError(f"the output of run {ref} is on {where}, under its state_dir/runs/; "
                        f"run `millwright logs {ref}` there", EXIT_NOT_FOUND)
    run_dir = None
    deadline = time.monotonic() + (10.0 if args.follow else 0.0)
    while True:
        run_dir = run_dir_for(cfg.state_dir, rec["job_id"], rec["fire_id"], int(rec.get("attempt") or 1))
        if run_dir or time.monotonic() >= deadline:
            break
        time.sleep(FOLLOW_POLL_S)  # claimed ahead of its due time: the process is not prepared yet
    if run_dir is None:
        raise UserError(f"run {ref} ran on this agent ({agent}) but its output is not in "
                        f"{os.path.join(cfg.state_dir, 'runs')} (removed, or the run never started)", EXIT_NOT_FOUND)
    paths = {s: os.path.join(run_dir, f"{s}.log") for s in ("stdout", "stderr")}
    attempt = int(rec.get("attempt") or 1)
    rid = run_id(rec["fire_id"], attempt)
    if not args.json:   # which run this is, on stderr: stdout stays the job's own output
        print(f"# {ref} attempt {attempt} (run_id {rid}): {rec.get('state')} on {agent}"
              + ("" if "/" in args.run else f"; the latest run of {rec['job_id']}"), file=sys.stderr, flush=True)
    if not args.follow:
        out = {}
        for s, p in paths.items():
            try:
                with open(p, "rb") as fh:
                    out[s] = fh.read().decode("utf-8", errors="replace")
            except OSError:
                out[s] = ""
        if args.json:
            _print_json({"run": ref, "run_id": rid, "fire_id": rec["fire_id"], "attempt": attempt, "agent": agent,
                         "state": rec.get("state"), "dir": run_dir, **out})
        else:
            sys.stdout.write(out["stdout"])
            sys.stdout.flush()
            sys.stderr.write(out["stderr"])
        return 0
    return _follow(client, keys, cfg, rec, paths, args.json)


def _follow(client, keys, cfg, rec: dict, paths: dict, as_json: bool) -> int:
    """Print what the run writes until its attempt ended (the record leaves ``running``, or
    a later attempt replaced it) and nothing more comes."""
    from agent.coordination.keys import shard_of
    from agent.jobs.states import RecordState

    key = keys.run(shard_of(rec["job_id"], cfg.shards), rec["job_id"], rec["fire_id"])
    offsets = {s: 0 for s in paths}
    sinks = {"stdout": sys.stdout, "stderr": sys.stderr}
    state = rec.get("state")
    next_check = 0.0
    while True:
        got = False
        for s, p in paths.items():
            try:
                with open(p, "rb") as fh:
                    fh.seek(offsets[s])
                    data = fh.read(65536)
            except OSError:
                continue
            if data:
                got = True
                offsets[s] += len(data)
                text = data.decode("utf-8", errors="replace")
                if as_json:
                    print(json.dumps({"stream": s, "data": text}), flush=True)
                else:
                    sinks[s].write(text)
                    sinks[s].flush()
        if got:
            continue
        if state is not None and state != RecordState.RUNNING:  # this attempt's process is gone
            if as_json:
                print(json.dumps({"end": True, "state": state}), flush=True)
            return 0
        now = time.monotonic()
        if now >= next_check:
            next_check = now + 0.5
            kv = _etcd(lambda: client.get(key), cfg)
            cur = json.loads(kv.value) if kv else {}
            if cur.get("attempt") == rec.get("attempt"):
                state = cur.get("state")
            else:
                state = "retried"
            continue  # read once more after the state changed
        time.sleep(FOLLOW_POLL_S)
