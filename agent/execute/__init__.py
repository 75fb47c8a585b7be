"""Spawning job processes under quotas (cgroup v2, cgroup v1, rlimits) with admission
control. See docs/execution.md for the daemon-facing API."""

from agent.execute.admission import ADMITTED, REJECTED, WAITING, Admission, Budget, Demand
from agent.execute.backends import BackendUnavailable, Usage, describe_backend, probe
from agent.execute.executor import REASONS, Executor, RunHandle, RunResult, RunSpec
from agent.execute.limits import Limits, default_limits, effective_limits

__all__ = ["ADMITTED", "REJECTED", "WAITING", "Admission", "Budget", "Demand", "BackendUnavailable",
           "Usage", "describe_backend", "probe", "REASONS", "Executor", "RunHandle", "RunResult",
           "RunSpec", "Limits", "default_limits", "effective_limits"]
