"""The status documents a job's firings produce (docs/contract.md: MQTT status), and the
durable answer marker a final one is written with (agent/cloud/answers.py).

A status about a run names it as the run's environment does: ``run_id`` is
``<fire_id>.<attempt>`` (MILLWRIGHT_RUN_ID, ``{run_id}``) and ``fire_id`` the firing (the
run record's key, MILLWRIGHT_FIRE_ID); a status about the job alone has both null."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from agent.coordination.keys import Keys
from agent.jobs.render import run_id
from agent.runtime.timefmt import format_optional as rfc
from agent.runtime.timefmt import utcnow

if TYPE_CHECKING:
    from agent.jobs.catalog import JobEntry
    from agent.jobs.firing import Firing
    from agent.jobs.seams import StatusSink


class Statuses:
    """Builds status documents and hands them to the sink (loop thread)."""

    def __init__(self, sink: StatusSink, keys: Keys, agent_id: str, shards: int, answer_markers: bool = False):
        self.sink = sink
        self.keys = keys
        self.agent_id = agent_id
        self.shards = shards
        # True with a cloud component: a final run status is then also written as a durable
        # answer marker in the run record's transaction, so a peer can publish it
        self.answer_markers = answer_markers

    def doc(self, e: JobEntry, f: Optional[Firing], state: str, **fields: Any) -> dict:
        doc = {"v": 1, "job_id": e.job.id, "run_id": run_id(f.fire_id, f.attempt) if f else None,
               "fire_id": f.fire_id if f else None, "state": state, "attempt": f.attempt if f else None, "agent": self.agent_id, "shard": e.shard % self.shards,
               "ts": rfc(utcnow()), "exit_code": None, "reason": None, "usage": None}
        if f is not None:
            doc["due"] = rfc(f.due)
            doc["health"] = f.health
        doc.update(fields)
        return doc

    def send(self, e: JobEntry, f: Optional[Firing], state: str, **fields: Any) -> None:
        self.sink.publish_status(self.doc(e, f, state, **fields))

    def final(self, f: Firing, state: str, **fields: Any) -> tuple[dict, Optional[str]]:
        """A firing's final status document and the key of its answer marker (None when no
        cloud component asked for markers)."""
        doc = self.doc(f.entry, f, state, **fields)
        key = None
        if self.answer_markers:
            key = self.keys.answer(f.entry.shard % self.shards, f.entry.job.id, "run." + f.fire_id)
        return doc, key

    def publish(self, doc: dict, answer_key: Optional[str] = None) -> None:
        """Hand over a document; a final one names its marker, which the outbox deletes once
        the broker has the status."""
        if answer_key:
            doc = dict(doc, _answer=answer_key)
        self.sink.publish_status(doc)
