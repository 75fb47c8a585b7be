"""What the Daemon calls parts through (Hooks), and what the wiring hands back (Wired).

The wiring fills the lists, in the order the parts are built; the Daemon only iterates
them. A part never appends itself: it offers public methods the wiring registers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from agent.cloud.component import JobListener
    from agent.coordination.watch import PrefixWatch
    from agent.runtime.seams import Component, SessionListener, ShardListener


@dataclass(frozen=True)
class Hooks:
    """All called on the loop thread, except checkpoint_sinks (the audit writer's thread)."""
    shard_listeners: list[ShardListener] = field(default_factory=list)
    busy_checks: list[Callable[[int], bool]] = field(default_factory=list)     # a unit has live runs
    status_providers: dict[str, Callable[[], Any]] = field(default_factory=dict)   # sections of `status`
    status_sinks: list[Callable[[dict], None]] = field(default_factory=list)   # job status documents (cloud)
    checkpoint_sinks: list[Callable[[dict], None]] = field(default_factory=list)   # audit file checkpoints
    session_listeners: list[SessionListener] = field(default_factory=list)    # the lease policy
    job_listeners: list[JobListener] = field(default_factory=list)   # pushes stored / cancels applied (cloud)
    watch_sources: list[Callable[[], list[PrefixWatch]]] = field(default_factory=list)   # more watches per session
    drain_hooks: list[Callable[[Callable[[], None]], None]] = field(default_factory=list)
    # end every live run with a reason, return how many (graceful stop, after drain_timeout_s)
    run_stoppers: list[Callable[[str], int]] = field(default_factory=list)
    reload_requests: list[Callable[[], None]] = field(default_factory=list)   # SIGHUP: read the config again

    def publish_status(self, doc: dict) -> None:
        """Hand a job status document to every sink (the MQTT outbox): jobs.seams.StatusSink."""
        for sink in self.status_sinks:
            sink(doc)


@dataclass(frozen=True)
class Wired:
    hooks: Hooks
    components: list[Component]     # started in this order, stopped in reverse
