"""Quota backends: cgroup v2, cgroup v1 and rlimits, behind one interface.

| module | what it owns |
| --- | --- |
| `interface` | `QuotaBackend` (what the executor asks per run), `Slot`, `Usage`, `BackendUnavailable` |
| `cgroupfs` | `CgroupFS` (every cgroup file access), the /proc mount and membership parsers |
| `cgroup` | `CgroupBackend`: what v1 and v2 share (run cgroups under one root per agent) |
| `cgroup1`, `cgroup2`, `rlimit` | the three backends |
| `probe` | `probe()`: the best usable backend, and why |
| `naming` | the agent's cgroup root name, a run's cgroup and directory name |
"""

from agent.execute.backends.cgroup import CgroupBackend
from agent.execute.backends.cgroup1 import Cgroup1Backend
from agent.execute.backends.cgroup2 import Cgroup2Backend
from agent.execute.backends.cgroupfs import CgroupFS, mountinfo, parse_kv, self_cgroups
from agent.execute.backends.interface import BackendUnavailable, QuotaBackend, Slot, Usage
from agent.execute.backends.naming import run_root_name, safe_name
from agent.execute.backends.probe import describe_backend, probe
from agent.execute.backends.rlimit import RlimitBackend

__all__ = ["CgroupBackend", "Cgroup1Backend", "Cgroup2Backend", "CgroupFS", "mountinfo", "parse_kv", "self_cgroups",
           "BackendUnavailable", "QuotaBackend", "Slot", "Usage", "run_root_name", "safe_name", "describe_backend",
           "probe", "RlimitBackend"]
