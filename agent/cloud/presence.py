"""Presence: millwright/<c>/agents/<agent_id>/presence, retained, QoS 1.

``online`` on every (re)connect, ``draining`` when the agent drains (SIGTERM), ``offline``
on a clean stop, and the same ``offline`` document (reason ``connection_lost``) as the last
will, which the broker publishes when the agent vanishes without a clean disconnect.
Presence is state, not history: it is published directly (latest wins), not via the outbox.
"""

from __future__ import annotations

import json
import os
import time

from agent import __version__
from agent.runtime.timefmt import now_rfc3339


def presence_doc(agent_id: str, state: str, reason: str | None = None, **extra) -> bytes:
    doc = {"v": 1, "state": state, "agent": agent_id, "ts": now_rfc3339(), "version": __version__, "pid": os.getpid()}
    if reason:
        doc["reason"] = reason
    doc.update(extra)
    return json.dumps(doc, separators=(",", ":")).encode()


def will_doc(agent_id: str) -> bytes:
    return presence_doc(agent_id, "offline", "connection_lost", since=time.time())
