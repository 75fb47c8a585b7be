"""Job isolation as the executor uses it: set up once (namespaces, the nftables table, the
id allocator), then per run a Confinement decided at staging and a spawn inside the
jobs' namespaces (docs/security.md, "Job isolation").

The threat model: the holders of the signing keys are trusted; a job process is not.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional

from agent.execute import hiding
from agent.execute.confine import NETWORK_POLICIES, RUN_FILES_ID, Confinement, RunIds
from agent.execute.namespaces import JobNamespaces
from agent.execute.netfilter import NetRules, resolve_endpoints
from agent.runtime.kernel import capability_number

log = logging.getLogger(__name__)


class IsolationError(Exception):
    """A run this node cannot confine as its template says (its spawn_error)."""


class Isolation:
    """What confines every run of one executor. ``hide``: files and directories no run may
    read (the agent's config, keys, audit key and directories, state directory);
    ``expose``: directories inside those that runs must reach (the runs' directories);
    ``endpoints``: etcd and broker URLs no run may connect to; ``name``: the nftables table
    (the agent's cgroup root name)."""

    def __init__(self, name: str, hide: Iterable[str], expose: Iterable[str], endpoints: Iterable[str]):
        self.name = name
        self.ids = RunIds()
        self.namespaces = JobNamespaces(hide, expose)
        try:
            self.net = NetRules(name, resolve_endpoints(endpoints))
        except BaseException:
            self.namespaces.close()
            raise
        log.info("job isolation", extra={"fields": {
            "hidden": self.namespaces.hidden, "table": self.net.name,
            "endpoints": [f"{e.host}:{e.port}" for e in self.net.endpoints],
            "root_runs": "landlock" if self.namespaces.landlock else "pid namespace"}})

    @classmethod
    def from_config(cls, cfg: Any, name: str, exposed: list[str]) -> "Isolation":
        """From the agent's whole configuration (agent/config.py); ``exposed``: the
        directories runs reach (the runs' directory, the executor's scratch directory)."""
        # every secret's directory covered whole, made first when missing (agent/execute/hiding.py)
        p = hiding.plan(cfg)
        if p.refused:
            raise IsolationError("; ".join(p.refused))
        for line in p.problems:
            log.warning("job isolation cannot cover this secret's directory whole", extra={"fields": {"problem": line}})
        hiding.make_dirs(p.dirs)
        hide = p.hide
        return cls(name, hide, exposed, list(cfg.etcd.endpoints) + [cfg.mqtt.url])

    def confine(self, uid: int, groups: Iterable[int], network: str, allow_root: bool,
                capabilities: Iterable[str]) -> Confinement:
        """A run's confinement (its id is held until release()). IsolationError for a
        run its template does not allow."""
        if network not in NETWORK_POLICIES:
            raise IsolationError(f"network policy {network!r} is not one of {', '.join(NETWORK_POLICIES)}")
        caps = []
        for name in capabilities:
            n = capability_number(name)
            if n is None:
                raise IsolationError(f"unknown capability {name!r}")
            caps.append(n)
        if uid == 0 and not allow_root:
            raise IsolationError("the user is uid 0 (root): its template must set allow_root: true")
        if caps and uid != 0:
            raise IsolationError("capabilities are given to root runs only (allow_root)")
        try:
            run_id = self.ids.take(network)
        except OSError as exc:
            raise IsolationError(str(exc)) from None
        if uid == 0:
            return Confinement(run_id, 0, run_id, [], network, True, caps)
        return Confinement(run_id, run_id, run_id, sorted(set(groups)), network, False)

    def release(self, conf: Optional[Confinement]) -> None:
        if conf is not None:
            self.ids.give_back(conf.run_id)

    def work_dir_owner(self, conf: Confinement) -> tuple[int, int, int]:
        """(uid, gid, mode) of a run's work directory: a non-root run's own; a root run's
        reaches it through its group (another root run, uid 0 too, is not its owner)."""
        if conf.root:
            return RUN_FILES_ID, conf.gid, 0o070
        return conf.uid, conf.gid, 0o700

    def start_thread(self, conf: Confinement, start: Callable[[bool], Any], own: bool = False) -> Any:
        """start(own_thread) on the thread a run's launcher must come from: a root run's own
        (its Landlock domain), one of its own for any run with ``own`` (it takes the run's
        ids: agent/execute/threadcreds.py), else the caller's; own_thread: True when the
        thread ends after the spawn."""
        # a secret replaced on the host since the last look is covered again first (before
        # the thread a root run starts from enters its Landlock domain: no mount after that)
        self.namespaces.refresh()
        if conf.root:
            return self.namespaces.on_root_thread(lambda: start(True))
        if own:
            return self.namespaces.on_own_thread(lambda: start(True))
        return start(False)

    def inside(self, conf: Confinement, spawn: Callable[[], Any], stay: bool = False) -> Any:
        """spawn() with the calling thread in the run's namespaces (``stay``: it is not
        taken back to the agent's, a thread that ends after the spawn)."""
        return self.namespaces.inside(conf.network, spawn, stay=stay)

    def close(self) -> None:
        self.net.close()
        self.namespaces.close()

