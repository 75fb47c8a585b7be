"""Choosing the quota backend: the preferred one if it is usable, else the next one in
the order cgroup2 -> cgroup1 -> rlimit; `.why` says what was chosen and why the better
ones were not. A cgroup backend is usable when its controllers (memory, cpu, pids) are
present and writable here; rlimit always is (and is the weakest: see docs/execution.md)."""

from __future__ import annotations

from agent.execute.backends.cgroup import DEFAULT_ROOT, CgroupBackend
from agent.execute.backends.cgroup1 import Cgroup1Backend
from agent.execute.backends.cgroup2 import Cgroup2Backend
from agent.execute.backends.interface import BackendUnavailable, QuotaBackend
from agent.execute.backends.rlimit import RlimitBackend

ORDER = ("cgroup2", "cgroup1", "rlimit")


def _make(name: str, root_name: str, runs_weight: int) -> QuotaBackend:
    if name == "cgroup2":
        return Cgroup2Backend(root_name=root_name, runs_weight=runs_weight)
    if name == "cgroup1":
        return Cgroup1Backend(root_name=root_name)
    if name == "rlimit":
        return RlimitBackend()
    raise ValueError(f"unknown quota backend {name!r} (auto, cgroup2, cgroup1 or rlimit)")


def probe(preferred: str = "auto", root_name: str = DEFAULT_ROOT, setup: bool = True,
          reclaim: bool = False, runs_weight: int = 1) -> QuotaBackend:
    """The best usable backend, starting at `preferred` ('auto' = cgroup2).

    setup=False only checks (nothing is created: for `config check`). reclaim=True kills
    and removes run cgroups a previous agent left under root_name (the daemon at start).
    runs_weight: on cgroup v2, how many ordinary processes the runs' root cgroup weighs
    against the agent's own leaf (the daemon passes execute.max_concurrent).
    The returned backend has `.name` and `.why`.
    """
    if preferred not in ("auto",) + ORDER:
        raise ValueError(f"unknown quota backend {preferred!r} (auto, cgroup2, cgroup1 or rlimit)")
    order = ORDER if preferred == "auto" else ORDER[ORDER.index(preferred):]
    skipped: list[str] = []
    for name in order:
        b = _make(name, root_name, runs_weight)
        try:
            if isinstance(b, CgroupBackend):
                b.check_available()
                if setup:
                    b.setup()
                    if reclaim:
                        b.reclaim()
                else:
                    b.why = b.location()
            elif not skipped:
                b.why = "requested" if preferred == "rlimit" else "chosen"
        except (BackendUnavailable, OSError) as exc:
            skipped.append(f"{name} unusable: {exc}" if preferred in ("auto", name) else f"{name}: {exc}")
            continue
        notes = [f"requested {n}" if n.startswith(preferred + " ") else n for n in skipped]
        if name == "rlimit":
            b.why = "last resort: no cpu rate limit, pids counted per user" + (f"; {'; '.join(notes)}" if notes else "")
        elif notes:
            b.why = f"{b.why}; {'; '.join(notes)}"
        m = _backend_metric()
        if m is not None and setup:
            m.labels(b.name).set(1)
        return b
    raise BackendUnavailable("; ".join(skipped))  # unreachable: rlimit always works


def _backend_metric():
    try:
        from agent.execute.metrics import BACKEND_INFO

        return BACKEND_INFO
    except Exception:  # pragma: no cover
        return None


def describe_backend(preferred: str = "auto") -> str:
    """One line: which backend the agent would use here and why (creates nothing)."""
    b = probe(preferred, setup=False)
    return f"{b.name} ({b.why})"
