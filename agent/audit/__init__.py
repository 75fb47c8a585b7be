"""Tamper-evident local audit log: hash-chained, HMAC'd JSON lines with checkpoints.

Modules (one concept each):

* :mod:`agent.audit.record`       the line format: canonical JSON, MAC, chain hash, times
* :mod:`agent.audit.keyfile`      the root-only HMAC key file
* :mod:`agent.audit.files`        directory layout and byte-level line reading
* :mod:`agent.audit.events`       typed record helpers; NullAudit and MemoryAudit sinks
* :mod:`agent.audit.writer`       AuditLog: the bounded queue and the writer thread (when to fsync, heads)
* :mod:`agent.audit.appender`     the main chain: sealing, batched appends, write-error gaps, rotation, retention
* :mod:`agent.audit.checkpoints`  the checkpoint chain (checkpoints.jsonl) and the on_checkpoint hand-off
* :mod:`agent.audit.recovery`     opening the directory: the writer lock, resuming both chains after a crash
* :mod:`agent.audit.metrics`      the writer's Prometheus collectors
* :mod:`agent.audit.verify`       verification, first problem reported precisely
* :mod:`agent.audit.show`         filtering and printing for people
* :mod:`agent.audit.cli`          ``millwright audit verify|show``

Typical use (the daemon)::

    audit = AuditLog.from_config(cfg.audit, agent_id=cfg.agent_id, on_checkpoint=cloud.post_checkpoint)
    audit.agent_start(version=__version__, agent_id=cfg.agent_id, pid=os.getpid())
    audit.config(**describe_config(cfg))
    audit.job("accepted", job_id, shard=7)
    ...
    audit.agent_stop(reason="sigterm"); audit.close()
"""

from __future__ import annotations

from typing import Any

from agent.audit.events import MemoryAudit, NullAudit, RecordHelpers, describe_config
from agent.audit.recovery import AuditError
from agent.audit.writer import AuditLog

__all__ = ["AuditLog", "AuditError", "RecordHelpers", "NullAudit", "MemoryAudit", "describe_config",
           "cli_verify", "cli_show"]


def cli_verify(args: Any) -> int:
    from agent.audit.cli import cli_verify as run

    return run(args)


def cli_show(args: Any) -> int:
    from agent.audit.cli import cli_show as run

    return run(args)
