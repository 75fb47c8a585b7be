"""The parts the daemon runs, in start order, and how they are wired to each other.

Each factory takes the Agent and returns a Component (start()/stop()). Parts register
on the Agent's typed hook lists; where two parts talk to each other (the scheduler and
supervision, the executor and sensing) this module passes one to the other: it is the
only place besides the daemon that knows all parts.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional

from agent.config import Config

log = logging.getLogger(__name__)

RECORD_WORKERS = 6   # threads writing run records (claims, final states) to etcd

if TYPE_CHECKING:
    from agent.cloud.component import CloudComponent
    from agent.jobs.firing import RunListener
    from agent.jobs.gatesources import TopicValues
    from agent.jobs.signing import KeyRing
    from agent.jobs.startpolicy import StartPolicy
    from agent.runtime.daemon import Agent, Component, ComponentFactory


def _admin(agent: Agent) -> Component:
    from agent.runtime.admin import AdminServer

    return AdminServer(agent, agent.cfg.admin.socket)


class _AuditComponent:
    """Opens the audit log first and closes it last, so every part's records land in it."""

    def __init__(self, agent: Agent):
        from agent.audit import AuditLog
        from agent.audit.events import describe_config

        self.agent = agent
        self.audit = AuditLog.from_config(agent.cfg.audit, agent_id=agent.cfg.agent_id,
                                          on_checkpoint=self._checkpoint)
        agent.audit = self.audit
        self.audit.config(**describe_config(agent.cfg))

    def _checkpoint(self, doc: dict) -> None:  # writer thread: hand over, never block
        for sink in self.agent.checkpoint_sinks:
            try:
                sink(doc)
            except Exception:
                pass

    def start(self) -> None:
        pass  # opened in __init__, before the other parts are built

    def stop(self) -> None:
        self.audit.close()


class _JobsComponent:
    """Executor (quotas), admission control, the job catalog and the scheduler that owns
    due firings with its start policies (four-eyes approval, staged rollouts), and retention."""

    def __init__(self, agent: Agent, run_listeners: Optional[list[RunListener]] = None,
                 gate_topics: Optional[TopicValues] = None):
        import os

        from agent.coordination.worker import EtcdWorkers
        from agent.execute.admission import Admission, Budget
        from agent.execute.backends import run_root_name
        from agent.execute.executor import Executor
        from agent.jobs.approvalgate import ApprovalGate
        from agent.jobs.catalog import JobCatalog
        from agent.jobs.quarantine import QuarantinePolicy
        from agent.jobs.retention import Retention
        from agent.jobs.rollouts import RolloutGate
        from agent.jobs.scheduler import Scheduler
        from agent.jobs.waitmarks import EtcdWaitMarks

        cfg = agent.cfg
        root = run_root_name(cfg.agent_id, cfg.state_dir)
        # the cleaner's outcomes come to the loop, which owns the audit log
        cleanup = {"on_report": lambda r: agent.loop.post(cleanup_report, agent, r)}
        self.executor = Executor.from_config(cfg.execute, os.path.join(cfg.state_dir, "runs"),
                                             root_name=root, reclaim=True, agent_config=cfg, cleanup=cleanup)
        self.admission = Admission(Budget.from_config(cfg.execute))
        guard = self.executor.guard
        if guard is not None:
            # deadman: runs claimed under the lease die by validity + kill_grace_s even if this
            # process is frozen (the self-fence would have SIGKILLed them by then)
            grace = cfg.execute.kill_grace_s
            agent.session.validity_listeners.append(lambda until: guard.set_deadline(until + grace))
        if agent.keyring is None:  # no cloud component: read the keys file here
            agent.keyring = _load_keyring(cfg.signing.keys_file)
        # run records are most of the etcd writes, and a firing's claim must not queue behind
        # shard hand-overs (or they behind a burst of claims); several threads let etcd batch
        # concurrent writes into one fsync
        self.workers = EtcdWorkers(agent.loop.post, threads=RECORD_WORKERS, name="runs")
        self.catalog = JobCatalog(cfg, agent.client, agent.keys, agent, agent.placement, agent.loop, self.workers,
                                  agent.keyring, audit=agent, statuses=agent)
        # approval first (a firing waiting for approvals holds nothing), then the plant's
        # window and gates, the rollout last (its slot is taken in etcd once all else says go)
        self.approvals = ApprovalGate(cfg, agent.loop, audit=agent)
        self.rollouts = RolloutGate(cfg, agent.client, agent.keys, agent.loop, self.workers, fencing=agent,
                                    lease=agent.session, audit=agent, sink=agent, is_current=self.catalog.current)
        # a job's own misbehaviour holds that job here (never the agent's shards): first, so a
        # quarantined job's firing asks nothing else
        self.quarantine = QuarantinePolicy(cfg.quarantine, agent.loop, audit=agent)
        plant = self._start_policies(agent, gate_topics)
        run_listeners = run_listeners if run_listeners is not None else []
        run_listeners.extend(plant)   # windows and gates stop runs too (end: stop, while_running: stop)
        run_listeners.append(self.rollouts)
        run_listeners.append(self.quarantine)   # counts strikes at each run's end
        self.scheduler = Scheduler(cfg, self.catalog, fencing=agent, lease=agent.session, loop=agent.loop,
                                   client=agent.client, keys=agent.keys, workers=self.workers,
                                   executor=self.executor, admission=self.admission, sink=agent, audit=agent,
                                   run_listeners=run_listeners,
                                   start_policies=[self.quarantine, self.approvals, *plant, self.rollouts])
        self.rollouts.adopt = self.scheduler.adopt
        self.catalog.changed_listeners.append(self.approvals.job_changed)
        self.scheduler.statuses.answer_markers = agent.answer_markers
        self.scheduler.starts.marks = EtcdWaitMarks(agent.client, agent.keys, agent.session, self.workers,
                                                    cfg.agent_id, cfg.shards)
        self.catalog.listener = self.scheduler
        agent.shard_listeners.append(self.catalog)
        agent.job_listeners.append(self.catalog)
        agent.watch_sources.append(self.catalog.start_watches)
        agent.busy_checks.append(self.scheduler.busy)
        agent.drain_hooks.append(self.scheduler.drain_started)
        agent.run_stoppers.append(self.scheduler.stop_runs)
        agent.status_providers["jobs"] = self.scheduler.status
        agent.status_providers["quarantine"] = self.quarantine.status
        self.retention = Retention(cfg, agent.loop, agent.client, agent.keys, agent.ownership, agent, self.catalog,
                                   self.executor)
        agent.status_providers["retention"] = self.retention.status
        agent.status_providers["quota"] = lambda: {"backend": self.executor.backend.name,
                                                   "why": self.executor.backend.why}

    def _start_policies(self, agent: Agent, gate_topics: Optional[TopicValues]) -> list:
        """The plant's rules a firing passes before its claim: its window (the signed
        document's), then its template's gates (local config; only when some template has
        gates)."""
        from agent.jobs.gates import GatePolicy, gated
        from agent.jobs.windows import WindowPolicy

        cfg = agent.cfg
        policies: list[StartPolicy] = [WindowPolicy(agent.loop, cfg.execute.kill_grace_s, agent,
                                                    cancel_job=lambda e, reason: self.catalog.cancel_here(e, reason))]
        if gated(cfg.templates):
            gates = GatePolicy(cfg.templates, agent.loop, agent, topics=gate_topics, client=agent.client,
                               keys=agent.keys)
            agent.watch_sources.append(gates.start_watches)
            policies.append(gates)
        return policies

    def start(self) -> None:
        self.workers.start()
        self.retention.start()

    def stop(self) -> None:
        self.retention.stop()
        self.scheduler.stop()
        self.rollouts.stop()
        self.executor.close()
        self.workers.stop()


def cleanup_report(agent: Agent, report: Any) -> None:
    """A tree the cleaner gave up on (a run's work dir or an old run dir): an audit
    record on the loop thread. Removals are counted only (millwright_cleanup_*)."""
    if report.event != "removed":
        agent.record("cleanup", event=report.event, tree=report.name, entries=report.entries,
                     reason=report.reason, where=report.where)


def _load_keyring(path: str) -> KeyRing:
    from agent.jobs.signing import KeyFileError, KeyRing

    try:
        return KeyRing.load(path)
    except KeyFileError as exc:
        for line in exc.problems:
            log.error("signing keys unusable: no stored job will run", extra={"fields": {"problem": line}})
        return KeyRing({}, source=path)


def _compaction(agent: Agent) -> Component:
    from agent.coordination.compaction import Compactor

    compactor = Compactor(agent.cfg, agent.loop, agent.client, agent.ownership)
    agent.status_providers["compaction"] = compactor.status
    return compactor


class _SensingAudit:
    """Interim, until the hall hands sensing the audit log itself (which then has
    ``record``): the Agent's record, and its audit log's exec and gap helpers; nothing
    while the Agent has no audit log, as before."""

    def __init__(self, agent: Agent):
        self.agent = agent

    def record(self, type_: str, **fields: Any) -> None:
        self.agent.record(type_, **fields)

    def exec(self, **fields: Any) -> bool:
        audit = self.agent.audit
        return audit.exec(**fields) if audit is not None else False

    def gap(self, **fields: Any) -> bool:
        audit = self.agent.audit
        return audit.gap(**fields) if audit is not None else False


class _SupervisedJobs:
    """Jobs with kernel sensing and the health and lease policies around them.

    The scheduler tells sensing, then supervision, of each run (sensing first: it gives the
    run its sensor slot, which supervision's health policy reads); the executor's poststart
    hook lets sensing track a run's process before it execs; sensing asks supervision for
    exec verdicts and tells it of new signals; supervision pauses and resumes the scheduler.
    """

    def __init__(self, agent: Agent, gate_topics: Optional[TopicValues] = None):
        from agent.supervision.component import Supervision
        from agent.supervision.sensing import RunSensing

        run_listeners: list[RunListener] = []
        self.jobs = _JobsComponent(agent, run_listeners, gate_topics)
        self.sensing = RunSensing(agent.cfg, agent.loop, _SensingAudit(agent))
        agent.status_providers["sensor"] = self.sensing.status
        self.jobs.executor.poststart.append(self.sensing.poststart)
        self.supervision = Supervision(agent.cfg, agent.loop, agent, renewal=agent.session, availability=agent.shards,
                                       gate=self.jobs.scheduler, sensing=self.sensing, offences=self.jobs.quarantine,
                                       stopping=lambda: agent.stopping)
        agent.status_providers["health"] = self.supervision.status
        agent.session_listeners.append(self.supervision)
        self.sensing.exec_listeners.append(self.supervision)
        self.sensing.signal_listeners.append(self.supervision)
        run_listeners += [self.sensing, self.supervision]
        self.parts: list[Component] = [self.jobs, self.sensing, self.supervision]

    def start(self) -> None:
        for p in self.parts:
            p.start()

    def stop(self) -> None:
        for p in reversed(self.parts):
            try:
                p.stop()
            except Exception:
                log.exception("component stop failed", extra={"fields": {"part": type(p).__name__}})


def _cloud(agent: Agent) -> CloudComponent:
    """The cloud channel, built from the Agent's values and registered on its hooks (in the
    order it registered itself before)."""
    from agent.cloud.component import CloudComponent, load_keyring

    # the one key ring: the cloud component reports its problems, the scheduler verifies with it too
    agent.keyring = load_keyring(agent.cfg.signing.keys_file, agent.record)
    cloud = CloudComponent(agent.cfg, agent.loop, agent.client, agent.keys, ownership=agent.ownership,
                           members=lambda: agent.shards.members.values(), audit=agent, keyring=agent.keyring,
                           job_listeners=agent.job_listeners)
    agent.answer_markers = True  # the scheduler writes final run statuses as markers too
    agent.status_sinks.append(cloud.status_sink)
    agent.checkpoint_sinks.append(cloud.checkpoint_sink)
    agent.drain_hooks.append(cloud.drain)
    agent.status_providers["cloud"] = cloud.status
    return cloud


def default_components(cfg: Config) -> list[ComponentFactory]:
    built: dict[str, CloudComponent] = {}

    def cloud(agent: Agent) -> Component:  # cloud channel (agent/cloud, docs/cloud.md)
        built["cloud"] = c = _cloud(agent)
        return c

    def jobs(agent: Agent) -> Component:
        # the production gates read their MQTT topics through the cloud component's link
        cloud_part = built.get("cloud")
        return _SupervisedJobs(agent, cloud_part.gate_topics if cloud_part is not None else None)

    factories: list[Callable[[Agent], Component]] = [_AuditComponent, cloud, _admin, jobs, _compaction]
    return factories
