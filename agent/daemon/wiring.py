"""The parts the daemon runs, in start order, and how they are wired to each other.

``build(ground)`` builds each part from the single values of the Ground it uses and
registers the part's public methods in the Hooks the Daemon calls; where two parts talk to
each other (the scheduler and supervision, the executor and sensing) this module passes
one to the other: it is the only place that knows all parts. Start order, and so the order
of every hook list, is the order below: cloud, admin, jobs with supervision, compaction,
the state disk (the audit log is the Daemon's own: opened first, closed last).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Optional

from agent.daemon.hooks import Hooks, Wired

if TYPE_CHECKING:
    from agent.cloud.component import CloudComponent
    from agent.coordination.compaction import Compactor
    from agent.daemon.admin import AdminServer
    from agent.daemon.ground import Ground
    from agent.daemon.reload import BrokerLink, Reloader, StoredJobs, TemplateHolder
    from agent.execute.statedisk import StateDisk
    from agent.jobs.firing import RunListener
    from agent.jobs.gatesources import TopicValues
    from agent.jobs.seams import AuditSink
    from agent.jobs.startpolicy import StartPolicy
    from agent.runtime.seams import Component

log = logging.getLogger(__name__)

RECORD_WORKERS = 6   # threads writing run records (claims, final states) to etcd


def build(g: Ground) -> Wired:
    """The daemon's parts (``millwright run``): cloud, admin, jobs with supervision, compaction,
    the state disk."""
    hooks = Hooks()
    cloud_part = cloud(g, hooks)
    # the production gates read their MQTT topics through the cloud component's link; with
    # the cloud component, final run statuses are also written as durable answers (answers/
    # in etcd) in the run record's transaction, so a peer can publish them
    jobs = SupervisedJobs(g, hooks, gate_topics=cloud_part.gate_topics, answer_markers=True)
    reloader = reload(g, hooks, jobs.jobs.catalog, cloud_part, [jobs.supervision])
    parts: list[Component] = [cloud_part, admin(g, reloader), jobs, reloader]
    parts.append(compaction(g, hooks))
    parts.append(state_disk(g, hooks))
    return Wired(hooks, parts)


def cloud(g: Ground, hooks: Hooks) -> CloudComponent:
    """The cloud channel (agent/cloud, docs/cloud.md)."""
    from agent.cloud.component import CloudComponent

    c = CloudComponent(g.cfg, g.loop, g.client, g.keys, ownership=g.ownership,
                       members=lambda: g.shards.members.values(), audit=g.audit, keyring=g.keyring,
                       job_listeners=hooks.job_listeners)
    hooks.status_sinks.append(c.status_sink)
    hooks.checkpoint_sinks.append(c.checkpoint_sink)
    hooks.drain_hooks.append(c.drain)
    hooks.status_providers["cloud"] = c.status
    return c


def admin(g: Ground, reloader: Optional[Reloader] = None) -> AdminServer:
    from agent.daemon.admin import AdminServer

    return AdminServer(g.cfg.admin.socket, g.loop, g.status,
                       reload=reloader.request if reloader is not None else None)


def reload(g: Ground, hooks: Hooks, catalog: StoredJobs, cloud_part: Optional[BrokerLink],
           template_holders: list[TemplateHolder]) -> Reloader:
    """The reload coordinator (SIGHUP, the admin socket's reload op): it changes the keys,
    the catalog's trust, the member record and the connections through their own methods."""
    from agent.daemon.reload import Reloader

    r = Reloader(g.cfg, g.loop, g.audit, g.keyring, catalog=catalog, member=g.shards, broker=cloud_part,
                 channel=g.client, template_holders=template_holders)
    hooks.reload_requests.append(r.request)
    hooks.status_providers["config"] = r.status
    return r


def state_disk(g: Ground, hooks: Hooks) -> StateDisk:
    """The state disk's free space: gauges, an audit record per crossing of the low line."""
    from agent.execute.statedisk import StateDisk

    d = StateDisk(g.cfg.state_dir, g.loop, g.audit)
    hooks.status_providers["state_disk"] = d.status
    return d


def compaction(g: Ground, hooks: Hooks) -> Compactor:
    from agent.coordination.compaction import Compactor

    c = Compactor(g.cfg, g.loop, g.client, g.ownership)
    hooks.status_providers["compaction"] = c.status
    return c


class JobsParts:
    """Executor (quotas), admission control, the job catalog and the scheduler that owns
    due firings with its start policies (four-eyes approval, staged rollouts), and retention."""

    def __init__(self, g: Ground, hooks: Hooks, run_listeners: Optional[list[RunListener]] = None,
                 gate_topics: Optional[TopicValues] = None, answer_markers: bool = False):
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

        cfg, audit = g.cfg, g.audit
        root = run_root_name(cfg.agent_id, cfg.state_dir)
        # the cleaner's outcomes come to the loop, which owns the audit log
        cleanup = {"on_report": lambda r: g.loop.post(cleanup_report, audit, r)}
        self.executor = Executor.from_config(cfg.execute, os.path.join(cfg.state_dir, "runs"),
                                             root_name=root, reclaim=True, agent_config=cfg, cleanup=cleanup)
        self.admission = Admission(Budget.from_config(cfg.execute))
        guard = self.executor.guard
        if guard is not None:
            # deadman: runs claimed under the lease die by validity + kill_grace_s even if this
            # process is frozen (the self-fence would have SIGKILLed them by then)
            grace = cfg.execute.kill_grace_s
            g.session.validity_listeners.append(lambda until: guard.set_deadline(until + grace))
        # run records are most of the etcd writes, and a firing's claim must not queue behind
        # shard hand-overs (or they behind a burst of claims); several threads let etcd batch
        # concurrent writes into one fsync
        self.workers = EtcdWorkers(g.loop.post, threads=RECORD_WORKERS, name="runs")
        self.catalog = JobCatalog(cfg, g.client, g.keys, g.ownership, g.placement, g.loop, self.workers,
                                  g.keyring, audit=audit, statuses=hooks)
        # approval first (a firing waiting for approvals holds nothing), then the plant's
        # window and gates, the rollout last (its slot is taken in etcd once all else says go)
        self.approvals = ApprovalGate(cfg, g.loop, audit=audit)
        self.rollouts = RolloutGate(cfg, g.client, g.keys, g.loop, self.workers, fencing=g.ownership,
                                    lease=g.session, audit=audit, sink=hooks, is_current=self.catalog.current,
                                    adopt=lambda f: self.scheduler.adopt(f))   # built below
        # a job's own misbehaviour holds that job here (never the agent's shards): first, so a
        # quarantined job's firing asks nothing else
        self.quarantine = QuarantinePolicy(cfg.quarantine, g.loop, audit=audit)
        plant = self._start_policies(g, hooks, audit, gate_topics)
        run_listeners = run_listeners if run_listeners is not None else []
        run_listeners.extend(plant)   # windows and gates stop runs too (end: stop, while_running: stop)
        run_listeners.append(self.rollouts)
        run_listeners.append(self.quarantine)   # counts strikes at each run's end
        self.scheduler = Scheduler(cfg, self.catalog, fencing=g.ownership, lease=g.session, loop=g.loop,
                                   client=g.client, keys=g.keys, workers=self.workers,
                                   executor=self.executor, admission=self.admission, sink=hooks, audit=audit,
                                   run_listeners=run_listeners,
                                   start_policies=[self.quarantine, self.approvals, *plant, self.rollouts],
                                   answer_markers=answer_markers,
                                   marks=EtcdWaitMarks(g.client, g.keys, g.session, self.workers,
                                                       cfg.agent_id, cfg.shards))
        self.catalog.changed_listeners.append(self.approvals.job_changed)
        self.catalog.listener = self.scheduler
        hooks.shard_listeners.append(self.catalog)
        hooks.job_listeners.append(self.catalog)
        hooks.watch_sources.append(self.catalog.start_watches)
        hooks.busy_checks.append(self.scheduler.busy)
        hooks.drain_hooks.append(self.scheduler.drain_started)
        hooks.run_stoppers.append(self.scheduler.stop_runs)
        hooks.status_providers["jobs"] = self.scheduler.status
        hooks.status_providers["quarantine"] = self.quarantine.status
        self.retention = Retention(cfg, g.loop, g.client, g.keys, g.ownership, audit, self.catalog, self.executor)
        hooks.status_providers["retention"] = self.retention.status
        hooks.status_providers["quota"] = lambda: {"backend": self.executor.backend.name,
                                                   "why": self.executor.backend.why}

    def _start_policies(self, g: Ground, hooks: Hooks, audit: AuditSink,
                        gate_topics: Optional[TopicValues]) -> list:
        """The plant's rules a firing passes before its claim: its window (the signed
        document's), then its template's gates (local config; only when some template has
        gates)."""
        from agent.jobs.gates import GatePolicy, gated
        from agent.jobs.windows import WindowPolicy

        cfg = g.cfg
        policies: list[StartPolicy] = [WindowPolicy(g.loop, cfg.execute.kill_grace_s, audit,
                                                    cancel_job=lambda e, reason: self.catalog.cancel_here(e, reason))]
        if gated(cfg.templates):
            gates = GatePolicy(cfg.templates, g.loop, audit, topics=gate_topics, client=g.client, keys=g.keys)
            hooks.watch_sources.append(gates.start_watches)
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


def cleanup_report(audit: AuditSink, report: Any) -> None:
    """A tree the cleaner gave up on (a run's work dir or an old run dir): an audit
    record on the loop thread. Removals are counted only (millwright_cleanup_*)."""
    if report.event != "removed":
        audit.record("cleanup", event=report.event, tree=report.name, entries=report.entries,
                     reason=report.reason, where=report.where)


class SupervisedJobs:
    """Jobs with kernel sensing and the health and lease policies around them.

    The scheduler tells sensing, then supervision, of each run (sensing first: it gives the
    run its sensor slot, which supervision's health policy reads); the executor's poststart
    hook lets sensing track a run's process before it execs; sensing asks supervision for
    exec verdicts and tells it of new signals; supervision pauses and resumes the scheduler.
    """

    def __init__(self, g: Ground, hooks: Hooks, gate_topics: Optional[TopicValues] = None,
                 answer_markers: bool = False):
        from agent.supervision.component import Supervision
        from agent.supervision.sensing import RunSensing

        run_listeners: list[RunListener] = []
        self.jobs = JobsParts(g, hooks, run_listeners, gate_topics, answer_markers)
        self.sensing = RunSensing(g.cfg, g.loop, g.audit)
        hooks.status_providers["sensor"] = self.sensing.status
        self.jobs.executor.poststart.append(self.sensing.poststart)
        self.supervision = Supervision(g.cfg, g.loop, g.audit, renewal=g.session, availability=g.shards,
                                       gate=self.jobs.scheduler, sensing=self.sensing, offences=self.jobs.quarantine,
                                       stopping=g.stopping)
        hooks.status_providers["health"] = self.supervision.status
        hooks.session_listeners.append(self.supervision)
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

