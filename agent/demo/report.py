"""The demo's checks and summary: run records, side effects, statuses, audit logs and
metrics held against the invariants (exactly once, failover, health decisions).

Input is the :class:`~agent.demo.result.DemoResult` the scenario filled; :func:`collect`
(while the survivors still run: it scrapes their metrics) and :func:`verify_audit` (after
they stopped) produce the :class:`Checks` that :func:`summary` prints.
"""

from __future__ import annotations

import collections
import fnmatch
import os
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

from agent.demo.output import Live, fmt_ms, parse_rfc, pct
from agent.demo.result import DemoResult
from agent.demo.services import REPO_ROOT
from agent.jobs.states import TERMINAL, RecordState

LAUNCHERS = ("setpriv",)  # the executor's own user switch, exec'd before the job (agent/execute)
AUDIT_TYPES = {"exec", "policy_violation", "health", "lease", "gap", "job"}


@dataclass
class Checks:
    """What :func:`collect` found, and (``audit``) what `millwright audit verify` said."""

    records: dict[tuple[str, str], dict]
    effects: collections.Counter                 # (job, fire id, attempt) -> side-effect lines
    problems: list[str]                          # broken invariants, worst first
    firings: int
    by_state: collections.Counter
    retried: list[tuple]                         # (job, fire id, its record, resolving agent) after owner_lost
    delays: list[float]                          # start minus due of scheduled first attempts
    immediate: list[float]                       # the same for jobs without a schedule
    late: list[tuple[str, float]]                # due during the failover, started late
    metrics: dict[str, dict]                     # survivor -> scraped samples
    audit_recs: dict[str, list[dict]]            # agent -> its audit records of AUDIT_TYPES
    audit: dict[str, tuple[bool, str, list[str]]] = field(default_factory=dict)  # agent -> (ok, last line, notes)


def scrape(port: int, timeout: float = 3.0) -> dict[tuple[str, tuple], float]:
    """Samples of an agent's Prometheus endpoint: {(name, sorted label items): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def msum(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == w for k, w in labels.items()))


def by_label(samples: dict, name: str, label: str) -> dict[str, float]:
    out: collections.Counter[str] = collections.Counter()
    for (n, ls), v in samples.items():
        if n == name:
            out[dict(ls).get(label, "")] += v
    return dict(out)


def effects(path: str) -> collections.Counter:
    """(job, fire id, attempt) -> how many side-effect lines the job scripts wrote."""
    c: collections.Counter = collections.Counter()
    if os.path.exists(path):
        with open(path) as fh:
            for line in fh:
                p = line.split()
                if len(p) >= 3:
                    c[(p[0], p[1], p[2])] += 1
    return c


def audit_records(agent_dir: str, types: set) -> list[dict]:
    from agent.audit.show import Filter, records

    d = os.path.join(agent_dir, "audit")
    try:
        return [rec for _, rec in records(d, Filter(types=types))]
    except Exception:
        return []


def collect(res: DemoResult) -> Checks:
    from agent.jobs.schedule import fire_id

    recs = res.records
    fx = effects(res.effects_log)
    problems: list[str] = []
    # 1. exactly once: one record per expected firing, side effects consistent with it
    firings = 0
    by_state: collections.Counter = collections.Counter()
    for j in res.jobs:
        mine = {f: r for (jid, f), r in recs.items() if jid == j.id}
        if j.cron_expected:
            want = [fire_id(j.id, d) for d in j.cron_expected]
            for f in want:
                if f not in mine:
                    problems.append(f"lost: {j.id} firing {f} has no run record")
            extra = sorted(set(mine) - set(want))
            if extra:
                problems.append(f"{j.id}: unexpected firings {extra[:3]}")
        elif len(mine) != 1:
            problems.append(f"{j.id}: {len(mine)} run records (expected exactly 1)")
        for f, r in mine.items():
            firings += 1
            state = r.get("state")
            by_state[state] += 1
            if state not in TERMINAL:
                problems.append(f"{j.id} {f}: not finished (state {state})")
            attempt = int(r.get("attempt") or 1)
            runs = {int(a): n for (jid, ff, a), n in fx.items() if jid == j.id and ff == f and a.isdigit()}
            twice = [a for a, n in runs.items() if n > 1]
            if twice:
                problems.append(f"ran twice: {j.id} {f} attempt {twice[0]} has {runs[twice[0]]} side effects")
            if any(a > attempt for a in runs):
                problems.append(f"{j.id} {f}: side effect of attempt {max(runs)} but the record says {attempt}")
            if state == RecordState.SUCCEEDED and runs.get(attempt, 0) != 1:
                problems.append(f"{j.id} {f}: succeeded without its side effect")
            if state in (RecordState.MISFIRED, RecordState.CANCELLED) and runs:
                problems.append(f"{j.id} {f}: {state} but it ran")
    orphan_fx = [k for k in fx if (k[0], k[1]) not in recs]
    for k in orphan_fx[:3]:
        problems.append(f"ran without a run record: {k[0]} {k[1]} attempt {k[2]}")
    # 2. on time: start minus due, from the records
    delays, late, immediate = [], [], []
    now_jobs = {j.id for j in res.jobs if not j.doc["schedule"]}
    held = {j.id for j in res.jobs if j.held}   # started by a gate or a window, late by design
    kill = res.failover.kill_wall
    fo_end = kill + timedelta(seconds=res.failover.done_s or 0) if kill else None
    for (jid, _f), r in recs.items():
        due, started = parse_rfc(r.get("due")), parse_rfc(r.get("started_at"))
        if not due or not started or int(r.get("attempt") or 1) != 1:
            continue
        d = (started - due).total_seconds()
        if jid in held:
            continue
        if jid in now_jobs:
            immediate.append(d)
        elif kill and fo_end and kill - timedelta(seconds=1) <= due <= fo_end + timedelta(seconds=3) and d > 0.05:
            late.append((jid, d))
        else:
            delays.append(d)
    metrics = {}
    for aid, port in res.metrics_ports.items():
        if aid == res.victim:
            continue
        try:
            metrics[aid] = scrape(port)
        except Exception as exc:
            res.notes.append(f"metrics of {aid} unreadable: {exc}")
    audit_recs = {aid: audit_records(d, AUDIT_TYPES) for aid, d in res.agent_dirs.items()}
    # firings left `running` by the dead agent: the new owner resolves them by policy
    retried_after_loss = []
    for aid, rs in audit_recs.items():
        for e in rs:
            if e.get("type") == "job" and e.get("event") == "owner_lost":
                r = recs.get((str(e.get("job")), str(e.get("fire_id"))), {})
                retried_after_loss.append((e.get("job"), e.get("fire_id") or "", r, aid))
    return Checks(records=recs, effects=fx, problems=problems, firings=firings, by_state=by_state,
                  retried=retried_after_loss, delays=delays, immediate=immediate, late=late, metrics=metrics,
                  audit_recs=audit_recs)


def verify_audit(res: DemoResult) -> dict[str, tuple[bool, str, list[str]]]:
    env = {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = {}
    for aid, config_path in res.config_paths.items():
        procs[aid] = subprocess.Popen([sys.executable, "-m", "agent", "audit", "verify", "-c", config_path],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    out = {}
    for aid, p in procs.items():
        try:
            text, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        out[aid] = (p.returncode == 0, lines[-1] if lines else f"exit {p.returncode}", lines[:-1])
    return out


def _final(recs: dict, jid: str) -> Optional[dict]:
    mine = [r for (j, _), r in recs.items() if j == jid]
    return mine[-1] if mine else None


def _statuses(res: DemoResult, jid: str) -> list[dict]:
    return [d for d in res.statuses if d.get("job_id") == jid]


def summary(res: DemoResult, ck: Checks, live: Live) -> int:
    recs, problems = ck.records, list(ck.problems)
    live.phase("Summary")
    W = 13

    def row(label: str, text: str) -> None:
        live.raw(f"{label:<{W}}{text}")

    def cont(text: str) -> None:
        live.raw(" " * W + text)

    # jobs
    via = "MQTT" if not any(j.accepted_by == "(etcd)" for j in res.jobs) else "MQTT + JobStore fallback"
    kinds = collections.Counter(j.category for j in res.jobs)
    bad = [j.kind for j in res.jobs if j.category == "misbehaving"]
    row("jobs", f"{len(res.jobs)} signed jobs pushed over {via}: " + ", ".join(
        f"{n} {k}" for k, n in kinds.items() if k != "misbehaving") +
        (f", {len(bad)} misbehaving ({', '.join(bad)})" if bad else ""))
    # exactly once
    fx = ck.effects
    states = ", ".join(f"{n} {s}" for s, n in sorted(ck.by_state.items()))
    verdict = "OK " if not problems else "BROKEN"
    row("exactly-once", f"{verdict} {ck.firings} firings -> {len(recs)} run records ({states}); "
                        f"{sum(fx.values())} side-effect lines, none twice for one (job, firing, attempt)"
        if not problems else f"{verdict} " + problems[0])
    for p in problems[1:6]:
        cont(p)
    for jid, _f, r, aid in ck.retried:
        cont(f"{jid}: was running on {res.victim} when it died (owner_lost); {aid} resolved it by "
             f"its retry.on: attempt {r.get('attempt')} {r.get('state')} {r.get('reason') or ''} "
                 f"on {r.get('agent')}")
    # the cloud's view: a final status for every finished firing
    finals = {(d.get("job_id"), d.get("fire_id")) for d in res.statuses if d.get("state") in TERMINAL}
    missing = collections.Counter(r.get("agent") for (jid, f), r in recs.items()
                                  if r.get("state") in TERMINAL and r.get("state") != RecordState.MISFIRED
                                  and (jid, f) not in finals)
    got = sum(1 for k, r in recs.items() if k in finals)
    row("statuses", f"the cloud received a final status for {got} of {len(recs)} run records over MQTT" +
        ("" if not missing else "; missing from " + ", ".join(f"{a} {n}" for a, n in sorted(missing.items()))))
    lost_live = {a: n for a, n in missing.items() if a != res.victim}
    if missing.get(res.victim):
        cont(f"{res.victim}'s undelivered statuses: not yet published by its shards' new owners "
             "(they publish them from etcd answers/ after the takeover)")
    if lost_live:
        res.findings.append("final statuses of surviving agents never reached the broker: " +
                             ", ".join(f"{a} {n}" for a, n in sorted(lost_live.items())) +
                             " (status outbox stalled?)")
    # on time
    if ck.delays:
        d = ck.delays
        row("on time", f"start minus due over {len(d)} scheduled firings: p50 {fmt_ms(pct(d, 50))}, "
                       f"p95 {fmt_ms(pct(d, 95))}, max {fmt_ms(max(d))}")
    if ck.immediate:
        d = ck.immediate
        cont(f"{len(d)} immediate jobs started {fmt_ms(min(d))} to {fmt_ms(max(d))} after issued_at "
             "(push, signature check, durable etcd write, ack, claim, spawn)")
    for jid, dl in ck.late:
        cont(f"{jid}: due during the failover, started {fmt_ms(dl)} late on the new owner")
    # failover
    fo = res.failover
    if fo.done_s is not None:
        row("failover", f"OK  {fo.victim} SIGKILLed at +{res.kill_at:g} s holding {len(fo.shards)} shards; "
                        f"lease expired after {fo.expired_s:.2f} s; all its shards owned by " +
            ", ".join(f"{a} ({n})" for a, n in sorted(fo.taken.items())) +
            f" {fo.done_s:.2f} s after the kill (lease_ttl_s 4)")
    else:
        problems.append("failover did not complete")
        row("failover", "BROKEN did not complete")
    # the plant's rules
    _rules_summary(res, ck, row, cont, problems)
    # health decisions
    _health_summary(res, ck, row, cont, problems)
    # audit
    audit_ok = True
    first = True
    for aid, (ok, last, notes) in sorted(ck.audit.items()):
        audit_ok &= ok
        tag = " (SIGKILLed)" if aid == res.victim else ""
        row("audit verify" if first else "", f"{'OK ' if ok else 'FAILED '} {aid}{tag}: {last}")
        for n in notes[:2]:
            cont("  " + n)
        first = False
    if not audit_ok:
        problems.append("`millwright audit verify` failed for " +
                        ", ".join(a for a, (ok, _, _) in ck.audit.items() if not ok))
    for n in res.notes:
        row("note", n)
    for f in res.findings:
        row("not yet", f)
    live.raw("")
    if problems:
        live.raw(f"RESULT: FAILED - {problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
        return 1
    live.raw("RESULT: OK - no job lost, none run twice, failover in "
             f"{fo.done_s:.1f} s, audit logs verified")
    return 0


def _rules_summary(res: DemoResult, ck: Checks, row, cont, problems: list) -> None:
    """The gated job started only once its gate opened; the long run was stopped at its
    window's end (kill_grace_s before it, SIGKILL at it)."""
    jid = "spindle-check-line1"
    r = _final(ck.records, jid)
    waited = [d for d in _statuses(res, jid) if d.get("state") == "waiting" and d.get("reason") == "gate:line"]
    started = parse_rfc((r or {}).get("started_at"))
    ok = bool(r and r.get("state") == RecordState.SUCCEEDED and started and res.gate_opened and waited
              and started >= res.gate_opened)
    after = f"{fmt_ms((started - res.gate_opened).total_seconds())} after" if ok and started and res.gate_opened else "-"
    row("gate", f"{'OK ' if ok else 'BROKEN'} {jid} waited (status waiting, reason gate:line: line 1 running) "
                f"and started {after} line 1 reported stopped: {(r or {}).get('state')}")
    if not ok:
        problems.append(f"{jid} did not wait for its gate and run once it opened")
    jid = "press-calibration-3"
    r = _final(ck.records, jid) or {}
    job = next(j for j in res.jobs if j.id == jid)
    close = parse_rfc(job.doc["window"]["ranges"][0]["end"])
    ended = parse_rfc(r.get("ended_at"))
    if r.get("reason") == "owner_lost":
        row("window", f"NOTE {jid} was running on {res.victim} when it was killed (owner_lost): not stopped by "
                      "its window this time")
        return
    ok = bool(r.get("reason") == "window_closed" and ended and close and abs((ended - close).total_seconds()) <= 2.5)
    row("window", f"{'OK ' if ok else 'BROKEN'} {jid} (a 40 s run, window end: stop): {r.get('state')}, "
                  f"reason {r.get('reason')}, ended "
                  + (f"{(ended - close).total_seconds():+.2f} s from its window's end (SIGTERM kill_grace_s before)"
                     if ended and close else "-"))
    if not ok:
        problems.append(f"{jid} was not stopped at its window's end")


def _health_summary(res: DemoResult, ck: Checks, row, cont, problems: list) -> None:
    recs, metrics = ck.records, ck.metrics
    audit = ck.audit_recs

    def rec_line(jid: str) -> tuple[Optional[dict], str]:
        r = _final(recs, jid)
        if r is None:
            return None, "no run record"
        bits = [str(r.get("state"))]
        if r.get("reason") and r.get("reason") != r.get("state"):
            bits.append(f"reason {r['reason']}")
        if r.get("exit_code") is not None:
            bits.append(f"exit {r['exit_code']}")
        bits.append(f"health {r.get('health') or '-'}")
        bits.append(f"on {r.get('agent')}")
        return r, ", ".join(bits)

    total = lambda name, **lb: sum(msum(s, name, **lb) for s in metrics.values())
    # memory
    r, text = rec_line("vision-warmup-cam1")
    qk = total("millwright_quota_kills_total")
    ok = r is not None and r.get("state") != RecordState.SUCCEEDED
    row("memory", f"{'OK ' if ok else 'BROKEN'} vision-warmup-cam1 (256 MiB model, 48 MiB limit): {text}; "
                  f"millwright_quota_kills_total {qk:g} (survivors)")
    if not ok:
        problems.append("the job over its memory limit was not stopped")
    # exec policy
    jid = "line-diagnostics-line2"
    r, text = rec_line(jid)
    allow = res.templates.get("line-diagnostics", {}).get("allow_exec", [])
    execs = [e for recs_ in audit.values() for e in recs_ if e.get("type") == "exec" and e.get("job") == jid]
    outside = [e for e in execs if not any(fnmatch.fnmatch(e.get("filename") or "", p) for p in allow)
               and os.path.basename(e.get("filename") or "") not in LAUNCHERS]
    viol = [e for recs_ in audit.values() for e in recs_ if e.get("type") == "policy_violation" and e.get("job") == jid]
    enforced = bool(viol) or any(e.get("verdict") in ("denied", "killed", "violation") for e in outside) or (
        r is not None and r.get("state") == RecordState.KILLED)
    seen = ", ".join(sorted({f"{e.get('filename')} (verdict {e.get('verdict')})" for e in outside})) or "none"
    row("exec policy", f"{'OK ' if enforced else 'NOT SHOWN'} {jid} execs uname outside allow_exec: {text}")
    cont(f"audit exec records outside allow_exec: {seen}; policy_violation records: {len(viol)}")
    if not execs:
        cont("the audit log has no exec record of this run (BPF sensor degraded or not attributing execs?)")
    if not enforced:
        res.findings.append("exec policy (bpf.mode enforce): an exec outside allow_exec is recorded "
                             "but the run is not stopped and no policy_violation is recorded")
    # network stall
    jid = "firmware-fetch-press4"
    r, text = rec_line(jid)
    health_seen = sorted({str(d["health"]) for d in _statuses(res, jid) if d.get("health")} |
                         ({str(r["health"])} if r and r.get("health") else set()))
    detected = any(h not in ("healthy", None) for h in health_seen) or (
        r is not None and "network_stall" in str(r.get("reason")))
    row("net stall", f"{'OK ' if detected else 'NOT SHOWN'} {jid} (update server blackholed): {text}")
    bpf: dict[str, float] = {}
    for s in metrics.values():
        for k, v in by_label(s, "millwright_bpf_events_total", "kind").items():
            bpf[k] = bpf.get(k, 0) + v
    lost = total("millwright_bpf_lost_events_total")
    mode = res.sensor_mode
    cont(f"health values published for it: {', '.join(h for h in health_seen if h) or 'none'}; BPF sensor mode "
         f"{mode or '?'}, events (survivors) " + (", ".join(f"{k} {v:g}" for k, v in sorted(bpf.items())) or "none")
         + f", lost {lost:g}")
    if not detected:
        res.findings.append("health decisions: the stalled run's health stays 'healthy' (no run health "
                             "from kernel signals in statuses or run records)")
    # lease decisions
    fences: dict[str, float] = {}
    for s in metrics.values():
        for k, v in by_label(s, "millwright_self_fences_total", "reason").items():
            fences[k] = fences.get(k, 0) + v
    lease_events = collections.Counter(f"{e.get('event')}" for recs_ in audit.values() for e in recs_
                                       if e.get("type") == "lease")
    row("lease", "survivors' self-fences: " + (", ".join(f"{k} {v:g}" for k, v in fences.items()) or "0") +
        "; audit lease records: " + ", ".join(f"{k} {n}" for k, n in sorted(lease_events.items())) +
        " (this scenario stalls a job's network, not an agent's etcd path)")
    hm: dict[str, float] = {}
    for name, label in (("millwright_run_health_changes_total", "state"),
                        ("millwright_exec_policy_violations_total", "mode")):
        for s in metrics.values():
            for k, v in by_label(s, name, label).items():
                hm[f"{name[11:]}{{{k}}}"] = hm.get(f"{name[11:]}{{{k}}}", 0) + v
    if hm:
        cont("health metrics (survivors): " + ", ".join(f"{k} {v:g}" for k, v in sorted(hm.items())))
    else:
        res.findings.append("health metrics (run health changes, exec-policy violations) are not exported")
