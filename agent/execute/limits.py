"""Per-run resource limits: the smaller of the job's request and the template's ceiling.

A run with no memory or cpu figure at all would make the node budget meaningless, so
:func:`default_limits` gives every run a share of the node budget when neither the job
nor the template names one (admission charges what the run is actually held to).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Optional

DEFAULT_PIDS = 512


@dataclass(frozen=True)
class Limits:
    cpu: Optional[float] = None        # cores (0.5 = half a core)
    memory_mb: Optional[int] = None    # MiB
    pids: Optional[int] = None         # processes + threads

    @property
    def memory_bytes(self) -> Optional[int]:
        return None if self.memory_mb is None else int(self.memory_mb) * 1024 * 1024

    def to_dict(self) -> dict:
        return asdict(self)


def _get(res: Any, key: str) -> Any:
    if res is None:
        return None
    if type(res) is dict or isinstance(res, Mapping):   # (a job's own: a dict, no ABC check)
        return res.get(key)
    return getattr(res, key, None)


def _smaller(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def effective_limits(job_resources: Any, template_resources: Any, defaults: Optional[Limits] = None) -> Limits:
    """min(job, template) per field; a field neither names comes from `defaults`.

    Both arguments may be `agent.config.Resources`, a mapping (the job document's
    "resources" object) or None.
    """
    d = (defaults or Limits()).to_dict()
    out = {}
    for key in ("cpu", "memory_mb", "pids"):
        v = _smaller(_get(job_resources, key), _get(template_resources, key))
        out[key] = d[key] if v is None else v
    cpu = None if out["cpu"] is None else float(out["cpu"])
    mem = None if out["memory_mb"] is None else int(out["memory_mb"])
    pids = None if out["pids"] is None else int(out["pids"])
    return Limits(cpu=cpu, memory_mb=mem, pids=pids)


def default_limits(execute_config: Any) -> Limits:
    """An equal share of the node budget (ExecuteConfig) for runs that name no limits."""
    n = max(1, int(execute_config.max_concurrent))
    return Limits(cpu=round(float(execute_config.cpu) / n, 3),
                  memory_mb=max(4, int(execute_config.memory_mb) // n),
                  pids=DEFAULT_PIDS)
