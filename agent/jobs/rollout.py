"""Staged fleet rollouts, as pure logic: the ``rollout`` of a fan-out job, the state of one
firing's rollout as etcd holds it, and what an agent may do with its own firing of it.

A fan-out job runs each firing once on every eligible agent (fire id ``<due>@<agent>``).
``rollout`` stages those runs: at most ``max_concurrent`` agents run the firing at once,
consecutive starts are at least 60/R s apart (R = ``per_minute``, multiplied by
``growth.factor`` after every ``growth.after_succeeded`` successes), and once at least
``abort.min_finished`` agents have finished and ``abort.failed_pct`` % of them failed (an
outcome listed in ``abort.on``), the job is aborted: no agent starts it again. Clocks,
etcd and the loop are the caller's (agent/jobs/rollouts.py): these functions read what
they are given.

What etcd holds (keys: agent/coordination/keys.py): every agent writes only under its own
``rollouts/<agent>/<shard>/<job>/`` (etcd RBAC per agent: packaging/debian/examples/etcd-rbac.sh),
so everything a rollout allows is derived from per-agent keys, and an agent's credentials
can add or remove only its own: ``<base>/claim`` (the agent's place in the firing's queue,
bound to its session lease: etcd's create revision orders the claims), ``<base>/start``
(written once when it starts, with its time), ``<base>/outcome`` (written once, with the
agent's final run record) and ``aborted`` (its abort mark of the job).

Why a forger holding one agent's credentials cannot run more: claims are ordered by create
revision, which etcd assigns and only grows, so a claim's place only ever moves up (a claim
behind it never overtakes it), and an agent starts only while fewer than ``max_concurrent``
live claims are ahead of its own. The honest agents that run are each within the first
``max_concurrent`` claims of the revision they judged at, so at any revision at most
``max_concurrent`` honest runs overlap; the forger's keys are its own place only (a claim
naming another agent counts as the forger's), and removing them frees only its own place.
With a rate, an agent starts only when every claim ahead of it started (one next starter
at a time) and no earlier than the spacing after the starts before it. The abort is any
agent's mark, which no other agent can delete; a start is judged on the state at a revision
at or after its claim, so no honest agent starts on a state that already crossed the
threshold.

Trust (docs/security.md): these keys are not signed. What is read from them only ever holds
agents back: a claim counts as taken whoever wrote it; start times are clamped so that
consecutive starts are never closer than the signed spacing allows, whatever the keys say;
an outcome modified after its creation counts as a failure; a forged abort mark aborts.
Without RBAC (``etcd.insecure``, or agents sharing a user) any writer can delete the keys
of others, and the limits are advisory.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Optional

from agent.jobs.envelope import bad, field_name, type_name
from agent.jobs.schedule import parse_fire_id
from agent.runtime.text import short

RUN_STATES = ("succeeded", "failed", "timed_out", "killed")   # the final states of a firing that ran
ABORT_ON = ("failed", "timed_out", "killed")
DEFAULT_ABORT_ON = ("failed", "timed_out")
ABORT_ACTIONS = ("finish", "stop")
ROLLOUT_KEYS = ("max_concurrent", "per_minute", "growth", "abort")
MAX_CONCURRENT = 1000
MAX_PER_MINUTE = 6000.0   # also the most the growth can reach


@dataclass(frozen=True)
class RolloutSpec:
    max_concurrent: Optional[int] = None
    per_minute: Optional[float] = None
    growth_factor: float = 1.0
    growth_after: int = 0            # 0: no growth
    failed_pct: Optional[float] = None
    min_finished: int = 1
    abort_on: tuple = DEFAULT_ABORT_ON
    abort_action: str = "finish"


# --------------------------------------------------------------------------- the document


def _num(obj: dict, key: str, path: str, lo: float, hi: float, *, integer: bool = False,
         lo_open: bool = False) -> Any:
    v = obj[key]
    kind = "an integer" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise bad(path, f"must be {kind}, got {type_name(v)} {short(v)}")
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v <= lo):
        rng = f"greater than {lo:g} and at most {hi:g}" if lo_open else f"between {lo:g} and {hi:g}"
        raise bad(path, f"must be {kind} {rng}, got {short(v)}")
    return v


def _obj(v: Any, path: str, allowed: tuple) -> dict:
    if not isinstance(v, dict):
        raise bad(path, f"must be an object, got {type_name(v)}")
    extra = [k for k in v if k not in allowed]
    if extra:
        raise bad(f"{path}.{field_name(extra[0])}", f"unknown key (allowed: {', '.join(allowed)})")
    return v


def parse_rollout(doc: dict, target: Optional[dict]) -> Optional[RolloutSpec]:
    """The document's ``rollout`` and ``abort_action`` (None without a rollout). Raises
    JobRejected (bad_field) naming the field."""
    if "rollout" not in doc:
        if "abort_action" in doc:
            raise bad("abort_action", "is only allowed with rollout")
        return None
    r = _obj(doc["rollout"], "rollout", ROLLOUT_KEYS)
    if not (target or {}).get("fanout"):
        raise bad("rollout", "needs a fan-out target (target.labels with fanout: true): a rollout stages one "
                             "firing across the agents that each run it")
    if not any(k in r for k in ("max_concurrent", "per_minute", "abort")):
        raise bad("rollout", "names none of max_concurrent, per_minute, abort")
    kw: dict = {}
    if "max_concurrent" in r:
        kw["max_concurrent"] = _num(r, "max_concurrent", "rollout.max_concurrent", 1, MAX_CONCURRENT, integer=True)
    if "per_minute" in r:
        kw["per_minute"] = float(_num(r, "per_minute", "rollout.per_minute", 0, MAX_PER_MINUTE, lo_open=True))
    if "growth" in r:
        if "per_minute" not in r:
            raise bad("rollout.growth", "grows per_minute: name per_minute too")
        g = _obj(r["growth"], "rollout.growth", ("factor", "after_succeeded"))
        for k in ("factor", "after_succeeded"):
            if k not in g:
                raise bad(f"rollout.growth.{k}", "is required")
        kw["growth_factor"] = float(_num(g, "factor", "rollout.growth.factor", 1.1, 5))
        kw["growth_after"] = _num(g, "after_succeeded", "rollout.growth.after_succeeded", 1, 100000, integer=True)
    if "abort" in r:
        a = _obj(r["abort"], "rollout.abort", ("failed_pct", "min_finished", "on"))
        if "failed_pct" not in a:
            raise bad("rollout.abort.failed_pct", "is required")
        kw["failed_pct"] = float(_num(a, "failed_pct", "rollout.abort.failed_pct", 0, 100, lo_open=True))
        if "min_finished" in a:
            kw["min_finished"] = _num(a, "min_finished", "rollout.abort.min_finished", 1, 100000, integer=True)
        if "on" in a:
            on = a["on"]
            if not isinstance(on, list) or not on:
                raise bad("rollout.abort.on", f"must be a non-empty list of {', '.join(ABORT_ON)}, got {short(on)}")
            for i, v in enumerate(on):
                if not isinstance(v, str) or v not in ABORT_ON:
                    raise bad(f"rollout.abort.on[{i}]", f"must be one of {', '.join(ABORT_ON)}, got {short(v)}")
            if len(set(on)) != len(on):
                raise bad("rollout.abort.on", f"lists an outcome twice: {short(on)}")
            kw["abort_on"] = tuple(v for v in ABORT_ON if v in on)
    action = doc.get("abort_action", "finish")
    if action not in ABORT_ACTIONS:
        raise bad("abort_action", f"must be one of {', '.join(ABORT_ACTIONS)}, got {short(action)}")
    return RolloutSpec(abort_action=action, **kw)


def describe(spec: RolloutSpec) -> dict:
    """The rollout as a document (views, statuses)."""
    out: dict = {}
    if spec.max_concurrent is not None:
        out["max_concurrent"] = spec.max_concurrent
    if spec.per_minute is not None:
        out["per_minute"] = spec.per_minute
        if spec.growth_after:
            out["growth"] = {"factor": spec.growth_factor, "after_succeeded": spec.growth_after}
    if spec.failed_pct is not None:
        out["abort"] = {"failed_pct": spec.failed_pct, "min_finished": spec.min_finished, "on": list(spec.abort_on)}
    out["abort_action"] = spec.abort_action
    return out


# --------------------------------------------------------------------------- what etcd holds


def base_of(fire_id: str) -> str:
    """A fan-out firing's id without its agent (``<due>@<agent>`` -> ``<due>``)."""
    return fire_id.split("@", 1)[0]


@dataclass(frozen=True)
class Claim:
    agent: str
    lease: int                # the etcd lease it is bound to (0: none)
    create_revision: int


@dataclass(frozen=True)
class StartKey:
    agent: str
    believed: bool            # names its own agent's firing
    at: Optional[float]       # when it started, by its agent's clock (epoch s)
    create_revision: int


@dataclass(frozen=True)
class OutcomeKey:
    agent: str
    state: str
    believed: bool            # created once and never changed, naming its own firing


@dataclass
class FiringRollout:
    """One firing's rollout across the fleet, per agent (the agent of a key is the one
    whose prefix holds it, never what its value says)."""

    base: str
    claims: dict[str, Claim] = field(default_factory=dict)
    starts: dict[str, StartKey] = field(default_factory=dict)
    outcomes: dict[str, OutcomeKey] = field(default_factory=dict)

    @property
    def due(self) -> Optional[datetime]:
        try:
            return parse_fire_id(self.base)
        except ValueError:
            return None

    def ahead(self, rev: int) -> list[Claim]:
        """The claims before the one created at ``rev`` (in etcd's order)."""
        return [c for c in self.claims.values() if c.create_revision < rev]

    def ordered_starts(self) -> list[StartKey]:
        return sorted(self.starts.values(), key=lambda s: (s.create_revision, s.agent))


@dataclass
class JobRollout:
    """A job's rollouts as read from every agent's ``rollouts/<agent>/<shard>/<job>/``."""

    marks: dict[str, dict] = field(default_factory=dict)    # agent -> its abort mark
    firings: dict[str, FiringRollout] = field(default_factory=dict)

    @property
    def aborted(self) -> Optional[dict]:
        """An abort mark (any agent's: the first by name), or None; ``by`` is the agent
        whose prefix holds it, whatever the mark says."""
        if not self.marks:
            return None
        by = min(self.marks)
        return {**self.marks[by], "by": by}

    def firing(self, base: str) -> FiringRollout:
        fr = self.firings.get(base)
        if fr is None:
            fr = self.firings[base] = FiringRollout(base)
        return fr

    def put(self, agent: str, rel: str, kv: Any) -> None:
        """A key of ``agent`` under the job (``rel``: the rest of its name) as read or
        watched (``kv``: value, lease, revisions, version)."""
        if rel == "aborted":
            doc = _json(kv.value)
            self.marks[agent] = doc if isinstance(doc, dict) else {"by": agent, "detail": "unreadable abort mark"}
            return
        base, _, kind = rel.partition("/")
        if not base or kind not in ("claim", "start", "outcome"):
            return
        fr = self.firing(base)
        doc = _json(kv.value)
        doc = doc if isinstance(doc, dict) else {}
        own = doc.get("fire_id") == f"{base}@{agent}"
        if kind == "claim":
            fr.claims[agent] = Claim(agent, kv.lease, kv.create_revision)
        elif kind == "start":
            at = doc.get("at")
            ok = isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at)
            fr.starts[agent] = StartKey(agent, own, float(at) if ok and at is not None else None, kv.create_revision)
        else:
            state = str(doc["state"]) if isinstance(doc.get("state"), str) else ""
            fr.outcomes[agent] = OutcomeKey(agent, state, kv.version == 1 and own)

    def delete(self, agent: str, rel: str) -> None:
        if rel == "aborted":
            self.marks.pop(agent, None)
            return
        base, _, kind = rel.partition("/")
        fr = self.firings.get(base)
        if fr is None:
            return
        if kind == "claim":
            fr.claims.pop(agent, None)
        elif kind == "start":
            fr.starts.pop(agent, None)
        elif kind == "outcome":
            fr.outcomes.pop(agent, None)


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, TypeError):
        return None


# --------------------------------------------------------------------------- judging


@dataclass(frozen=True)
class Tally:
    started: int
    finished: int     # outcomes of runs (RUN_STATES), and outcomes not believed
    failed: int       # of those, the ones abort.on lists (an outcome not believed counts)
    succeeded: int    # believed successes of agents that started: what growth counts

    def to_dict(self) -> dict:
        return {"started": self.started, "finished": self.finished, "failed": self.failed,
                "succeeded": self.succeeded}


def tally(spec: RolloutSpec, fr: FiringRollout) -> Tally:
    started = {s.agent for s in fr.starts.values() if s.believed}
    finished = failed = succeeded = 0
    for o in fr.outcomes.values():
        if not o.believed:
            finished += 1
            failed += 1
        elif o.state in RUN_STATES:
            finished += 1
            failed += o.state in spec.abort_on
            succeeded += o.state == "succeeded" and o.agent in started
    return Tally(len(fr.starts), finished, failed, succeeded)


def crossed(spec: RolloutSpec, t: Tally) -> bool:
    """Has the abort threshold been reached?"""
    return (spec.failed_pct is not None and t.finished >= spec.min_finished and t.failed > 0
            and t.failed * 100.0 >= spec.failed_pct * t.finished)


def rate(spec: RolloutSpec, succeeded: int) -> Optional[float]:
    """Starts per minute allowed now (None: no limit)."""
    if spec.per_minute is None:
        return None
    steps = succeeded // spec.growth_after if spec.growth_after else 0
    return min(MAX_PER_MINUTE, spec.per_minute * spec.growth_factor ** min(steps, 1000))


def next_start_at(spec: RolloutSpec, fr: FiringRollout, succeeded: int) -> Optional[float]:
    """The earliest time (epoch s) the next start may be made, or None without a rate.
    Starts are taken at least 60/rate apart, from the firing's due time on; each start key
    (in etcd's order) counts at its recorded time, but never earlier than the spacing after
    the one before it allows (a key naming an early time moves nothing forward)."""
    r = rate(spec, succeeded)
    due = fr.due
    if r is None or due is None:
        return None
    spacing = 60.0 / r
    t = due.timestamp() - spacing
    for s in fr.ordered_starts():
        t = max(s.at if s.at is not None else -math.inf, t + spacing)
    return t + spacing


def needs_claim(spec: RolloutSpec) -> bool:
    return spec.max_concurrent is not None or spec.per_minute is not None


@dataclass(frozen=True)
class Decision:
    kind: str                    # aborted | abort | claim | wait | go
    detail: str = ""
    until: Optional[float] = None   # wait: look again at this time (epoch s)
    start: bool = False             # go: write this agent's start key first


def decide(spec: RolloutSpec, jr: JobRollout, fr: FiringRollout, me: str, claim_rev: int, now: float) -> Decision:
    """What agent ``me`` may do with its firing of ``fr`` now, on the state read at a
    revision at or after its claim (``claim_rev``: the create revision of its claim bound
    to its current session lease, 0: none)."""
    if jr.aborted is not None:
        return Decision("aborted", _abort_detail(jr.aborted))
    t = tally(spec, fr)
    if crossed(spec, t):
        return Decision("abort", f"{t.failed} of {t.finished} finished runs failed "
                                 f"(abort at {spec.failed_pct:g} % after {spec.min_finished})")
    if not needs_claim(spec):
        return Decision("go")
    if not claim_rev:
        return Decision("claim")
    ahead = fr.ahead(claim_rev)
    if spec.max_concurrent is not None and len(ahead) >= spec.max_concurrent:
        return Decision("wait", f"max_concurrent: {spec.max_concurrent} agent(s) run it or are ahead "
                                f"({len(ahead)} claim(s) before this agent's)")
    if me in fr.starts:
        return Decision("go")
    if spec.per_minute is not None:
        if any(c.agent not in fr.starts for c in ahead):
            return Decision("wait", "per_minute: an agent ahead starts first")
        earliest = next_start_at(spec, fr, t.succeeded)
        if earliest is not None and now < earliest:
            return Decision("wait", f"per_minute: the next start is due at {earliest:.3f} "
                                    f"({rate(spec, t.succeeded):g}/min)", until=earliest)
    return Decision("go", start=True)


ABORT_TEXT_MAX = 256   # characters of each of an abort mark's by, at and detail carried on


def _abort_detail(mark: dict) -> str:
    """Why a firing did not start, for its record and status: the mark comes from etcd,
    where any writer could make it 1 MB, so each part is cut to ABORT_TEXT_MAX."""
    def cut(v: Any) -> str:
        text = str(v)
        return text if len(text) <= ABORT_TEXT_MAX else text[:ABORT_TEXT_MAX - 1] + "…"

    by, at = mark.get("by"), mark.get("at")
    return f"the rollout was aborted{f' by {cut(by)}' if by else ''}{f' at {cut(at)}' if at else ''}" + (
        f": {cut(mark['detail'])}" if isinstance(mark.get("detail"), str) else "")


ROLLBACK_SUFFIX = "+rollback"


def rollback_fire_id(base: str, agent: str) -> str:
    """The rollback's own firing on ``agent`` (it sorts before the firing it undoes, so the
    job's newest record stays a run of the job)."""
    return f"{base}{ROLLBACK_SUFFIX}@{agent}"


def rolled_back(fire_id: str) -> Optional[str]:
    """The base fire id a rollback firing undoes, or None for any other fire id."""
    head = fire_id.split("@", 1)[0]
    return head[:-len(ROLLBACK_SUFFIX)] if head.endswith(ROLLBACK_SUFFIX) else None


CLAIM, START, OUTCOME, ABORTED = "claim", "start", "outcome", "aborted"   # key names (keys.rollout_firing)
