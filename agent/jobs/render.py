"""A verified job at run time: the identity of one run, the argv its template renders to,
and the resources it runs under.

The template is read at run time, not at ingest: an operator may have changed it since
the job was stored, so :func:`render_argv` checks the job's params against it again.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from agent.config import RUN_PLACEHOLDERS, Resources, Template
from agent.jobs.document import Job, check_params
from agent.jobs.envelope import BAD_PARAM, bad

PLACEHOLDER_RE = re.compile(r"\{([^{}]*)\}")


def run_id(fire_id_: str, attempt: int) -> str:
    """Identity of one run (one attempt of one firing): ``<fire_id>.<attempt>``."""
    return f"{fire_id_}.{int(attempt)}"


def render_argv(job: Job, template: Template, run: Optional[dict] = None) -> list[str]:
    """The template's argv with each {param} replaced by the job's value, verbatim (one
    pass: braces inside values are not expanded again; no shell is involved). Re-checks
    the params against the template, which may have changed since ingest; raises
    JobRejected(bad_param) when they no longer fit. ``run`` supplies the RUN_PLACEHOLDERS
    ({job_id}, {fire_id}, {attempt}, {run_id}); {job_id} is always known."""
    check_params(job.params, template, job.template)
    builtin = {"job_id": job.id, **{k: str(v) for k, v in (run or {}).items() if k in RUN_PLACEHOLDERS}}

    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name in builtin:
            return builtin[name]
        if name not in job.params:
            raise bad(f"params.{name}", f"template {job.template} uses {{{name}}} but has no such param", BAD_PARAM)
        return job.params[name]

    return [PLACEHOLDER_RE.sub(sub, arg) for arg in template.argv]


def effective_resources(job: Job, template: Template) -> Resources:
    """The job's resources capped by the template's ceilings; unset values take the
    template's (None: no limit from either)."""
    def cap(j: Any, t: Any) -> Any:
        if j is None:
            return t
        return j if t is None else min(j, t)

    t = template.resources or Resources()
    return Resources(cpu=cap(job.resources.cpu, t.cpu), memory_mb=cap(job.resources.memory_mb, t.memory_mb),
                     pids=cap(job.resources.pids, t.pids))
