"""The values the Daemon builds before any part exists, which the wiring hands to the
parts one by one (a part never receives the Ground itself: it names what it uses)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Union

if TYPE_CHECKING:
    from agent.audit import AuditLog, NullAudit
    from agent.config import Config
    from agent.coordination.etcd import EtcdClient
    from agent.coordination.keys import Keys
    from agent.coordination.ownership import Ownership
    from agent.coordination.pools import Placement
    from agent.coordination.session import Session
    from agent.coordination.shards import ShardManager
    from agent.coordination.worker import EtcdWorkers
    from agent.jobs.signing import KeyRing
    from agent.runtime.loop import EventLoop

# the audit log, or a sink that records nothing when none is configured: never None
Audit = Union["AuditLog", "NullAudit"]


@dataclass(frozen=True)
class Ground:
    cfg: Config
    keys: Keys
    loop: EventLoop
    client: EtcdClient
    workers: EtcdWorkers            # the coordination writes (shard claims, members)
    session: Session
    shards: ShardManager
    placement: Placement
    ownership: Ownership
    audit: Audit                    # opened first, closed last
    keyring: KeyRing                # loaded once: the cloud and the scheduler verify with it
    stopping: Callable[[], bool]    # True once a graceful stop began: periodic work stops re-arming
    status: Callable[[], dict]      # the status document (loop thread): what the admin socket answers
