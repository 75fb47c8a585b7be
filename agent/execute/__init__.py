"""Spawning job processes under quotas (cgroup v2, cgroup v1, rlimits) with admission
control. See docs/execution.md for the daemon-facing API and the module map."""

from agent.execute.admission import ADMITTED, REJECTED, WAITING, Admission, Budget, Demand
from agent.execute.backends import BackendUnavailable, Usage, describe_backend, probe
from agent.execute.executor import Executor
from agent.execute.limits import Limits, default_limits, effective_limits
from agent.execute.runs import REASONS, ExitReason, RunHandle, RunResult, RunSpec

__all__ = ["ADMITTED", "REJECTED", "WAITING", "Admission", "Budget", "Demand", "BackendUnavailable",
           "Usage", "describe_backend", "probe", "REASONS", "ExitReason", "Executor", "RunHandle", "RunResult",
           "RunSpec", "Limits", "default_limits", "effective_limits"]
