"""The cloud channel as a daemon component: MQTT, ingest, outbox and presence.

It takes the values it uses (config, loop, etcd client and keys, the agent's Ownership, its
members, the audit sink, the signing key ring the daemon loaded, the job listeners) and
never the daemon. It registers nothing itself: the wiring (agent/daemon/wiring.py)
registers its public methods on the daemon's hooks:
- ``status_sink(doc)``: every status document -> the durable outbox (loop thread; one
  SQLite transaction per loop burst, no network; held in memory and retried while the
  state disk refuses it: outboxwriter.py)
- ``checkpoint_sink(doc)``: audit checkpoints -> outbox, topic agents/<id>/audit/checkpoint
- ``drain(done)``: publishes presence ``draining``, then calls done()
- ``status()``: connection, outbox depth, pending pushes, paho version
- ``gate_topics``: the production gates' retained MQTT topics, read by the gates
- ``job_listeners`` (:class:`JobListener`, the scheduler): ``job_stored(StoredJob)`` and
  ``job_cancelled(job_id)`` are posted to the loop after a push is stored / a cancel applied
- start(): opens the outbox, starts the publisher, the ingest workers, the jobs/ watch and
  the MQTT link; stop(): presence ``offline``, flushes the outbox briefly, disconnects.

One broker connection per agent, which reads no other agent's statuses: whether an answer
was delivered is known from etcd alone (answers.py).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from typing import Any, Callable, Iterable, Optional, Protocol

from agent.brokerlimits import effective_profile
from agent.config import Config, MqttConfig
from agent.coordination.etcd import EtcdClient
from agent.coordination.fencing import Fence
from agent.coordination.jobstore import JobStore, StoredJob
from agent.coordination.keys import Keys
from agent.coordination.ownership import Ownership
from agent.coordination.quota import ClusterQuota
from agent.coordination.shards import Member
from agent.coordination.watch import PrefixWatch
from agent.errors import UserError
from agent.jobs.seams import AuditSink
from agent.jobs.signing import KeyRing
from agent.runtime.loop import EventLoop
from agent.runtime.recent import RecentMemory

from .answers import Answers, answer_name
from .dispatch import Dispatcher
from .gatetopics import RetainedTopics
from .ingest import Ingest
from .link import Link, Message
from .mqtt import PAHO_VERSION, MqttLink
from .outbox import Outbox, OutboxPublisher, window_for
from .outboxwriter import OutboxWriter
from .pacing import paced
from .presence import presence_doc, will_doc
from .queries import JobQueries
from .topics import ID_RE, Topics

log = logging.getLogger(__name__)

# agents whose status subscriptions (an older agent's, left in the persistent session) are
# unsubscribed once per run: a bound on that memory
STRAY_AGENTS_MAX = 1024

OUTBOX_FILE = "mqtt-outbox.sqlite"
# test knob: "1" keeps every status in the outbox (nothing is published), so a test can
# kill the agent after a run ended but before its outbox drained (docs/cloud.md)
HOLD_OUTBOX_ENV = "MILLWRIGHT_TEST_HOLD_OUTBOX"


class JobListener(Protocol):
    """Told on the loop thread when a push was stored or a cancel applied, so the owner
    acts before its jobs/ watch reports the same change (the ingest shortcut)."""

    def job_stored(self, stored: StoredJob) -> None: ...

    def job_cancelled(self, job_id: str) -> None: ...


def client_id_for(cfg) -> str:
    return cfg.mqtt.client_id or f"millwright-{cfg.cluster}-{cfg.agent_id}"


class CloudComponent:
    """The cloud channel: built from the values it uses, registered by the wiring."""

    def __init__(self, cfg: Config, loop: EventLoop, client: EtcdClient, keys: Keys, ownership: Ownership,
                 members: Callable[[], Iterable[Member]], audit: AuditSink, keyring: KeyRing,
                 job_listeners: list[JobListener], workers: int = 2):
        from agent.cloud.profile import require_fit
        from agent.configcheck import ignored_peers_keys, require_secure_mqtt

        require_secure_mqtt(cfg)  # plain or anonymous MQTT only with mqtt.insecure: true
        require_fit(cfg)   # what the broker profile cannot carry, as config check refuses it
        self.cfg = cfg
        self.loop = loop
        self.client = client
        self.keys = keys
        self.ownership = ownership
        # the live members (loop thread's table): read by ingest threads, so read with care (_members)
        self.live_members = members
        self.audit = audit
        # the daemon's one ring: the scheduler verifies stored jobs with the same
        self.keyring = keyring
        # the list itself, not a copy: listeners registered after this part was built are told too
        self.job_listeners = job_listeners
        m = cfg.mqtt
        self.topics = Topics(cfg.cluster, cfg.agent_id)
        self.agent_id = cfg.agent_id
        self.store = JobStore(client, keys, cfg.shards, cfg.agent_id)
        path = os.path.join(cfg.state_dir, OUTBOX_FILE)
        profile = effective_profile(m)
        rate = profile.publish_rate   # None: the broker sets no rate, nothing is paced
        try:
            self.outbox = Outbox(path, m.outbox_max, m.outbox_full_policy,
                                 coalesce_above=None if rate is None else int(2 * rate))
        except (OSError, sqlite3.Error) as exc:
            raise UserError(f"state_dir: cannot open the status outbox {path}: {exc}") from None
        # statuses, republished answers and audit checkpoints go in through the writer, which
        # never raises: it holds them while the state disk refuses writes (ingest writes its own)
        self.writer = OutboxWriter(self.outbox, schedule=lambda delay, fn: loop.post(loop.call_later, delay, fn),
                                   record=self._record_later)
        self.outbox.on_drop = self.writer.dropped
        self.outbox.on_coalesce = self.writer.coalesced
        self._statuses: list = []  # (topic, doc, marker) for the outbox, loop thread only
        # production gates on the plant broker (agent/jobs/gates.py): their topics' last values
        self.gate_topics: RetainedTopics = RetainedTopics(g.mqtt for t in cfg.templates.values() if t is not None
                                                          for g in t.gates.values() if g is not None and g.mqtt)
        self.mqtt = MqttLink(m, client_id_for(cfg), clean_session=False,
                             will=(self.topics.presence(self.agent_id), will_doc(self.agent_id), 1, True),
                             on_connect=self._connected, on_message=self._message,
                             on_publish=self._published, on_disconnect=lambda rc: self.gate_topics.link_down(),
                             subscriptions=((self.topics.push, 1), (self.topics.cancel, 1),
                                            (self.topics.jobs_get, 0))
                             + tuple((t, 1) for t in sorted(self.gate_topics.topics)),
                             topic_kind=self.topics.kind,
                             reconnect_min_s=m.reconnect_min_s,
                             reconnect_max_s=m.reconnect_max_s)
        self.link: Link = self.mqtt
        # every PUBLISH of the connection paced to the profile's publish_rate (pacing.py)
        self.link, self.pacer = paced(self.link, rate, self.topics.kind)
        owned = lambda: ownership.owned  # noqa: E731 - a snapshot readable from any thread
        self.answers = Answers(client, keys, self.agent_id, enqueue=self._republish,
                               in_outbox=self.writer.has_marker, owned=owned, fence_for=self._fence_for,
                               republish_after_s=max(30.0, 3 * cfg.etcd.lease_ttl_s),
                               record=self._record_later,
                               connected=lambda: self.link.connected)
        self.publisher = OutboxPublisher(self.outbox, self.link, on_tick=self.writer.flush_gap,
                                         on_delivered=self.answers.delivered, on_handing=self.answers.handing,
                                         hold=os.environ.get(HOLD_OUTBOX_ENV) == "1",
                                         window=window_for(profile.max_inflight), pacer=self.pacer)
        self.ingest = Ingest(store=self.store, keyring=self.keyring, templates=cfg.templates, topics=self.topics,
                             agent_id=self.agent_id, max_bytes=m.max_payload_bytes, max_skew_s=m.max_skew_s,
                             cluster=cfg.cluster, max_age_s=m.max_age_s, outbox=self.outbox, record=audit.record,
                             notify=self._notify, answers=self.answers, members=self._members,
                             quota=ClusterQuota(client, keys, cfg.quotas.jobs, cfg.quotas.stored_mb))
        self.queries = JobQueries(client, keys, cfg.shards, self.agent_id, self.topics, self.link,
                                  owned, hold_s=cfg.etcd.lease_ttl_s + 5.0, keyring=self.keyring,
                                  cluster=cfg.cluster, max_age_s=m.get_max_age_s, max_skew_s=m.max_skew_s,
                                  page_bytes=m.get_page_bytes,
                                  report_unauthenticated=self.ingest.report_unauthenticated,
                                  record=self._record_later)
        # no agent reads another's statuses: the wildcard an older agent's persistent session
        # may still hold is unsubscribed (its per-member ones: _stray_status)
        self.link.unsubscribe(self.topics.status_filter())
        for line in ignored_peers_keys(cfg):
            log.warning(line)
        self._stray_agents: RecentMemory[str, bool] = RecentMemory(STRAY_AGENTS_MAX)   # the link's thread
        self.statuses_received = 0   # any agent's statuses delivered to this agent (none expected)
        self.dispatcher = Dispatcher(self.ingest, self.link, self.topics, owned, m.ingest_grace_s, workers=workers)
        self.watch: Optional[PrefixWatch] = None
        self.answers_watch: Optional[PrefixWatch] = None
        self._stopping = threading.Event()
        self._state = "online"

    def _record_later(self, type_: str, **fields: Any) -> None:
        """Any thread: an audit record, written on the loop thread (which owns the audit log)."""
        self.loop.post(lambda: self.audit.record(type_, **fields))

    def _members(self) -> Optional[dict]:
        """Live members as published (labels, templates), read from the ingest thread."""
        for _ in range(3):
            try:
                return {m.agent: {"labels": m.labels, "templates": sorted(m.templates), "available": m.available}
                        for m in list(self.live_members())}
            except RuntimeError:  # changed size while the loop thread updated it: read again
                continue
        return None

    # --- sinks ------------------------------------------------------------------------
    def status_sink(self, doc: dict) -> None:
        """Loop thread: queued, and written to the outbox by :meth:`_write_statuses`, posted
        behind the events already waiting, so a burst of statuses (the ``scheduled`` of each
        push of a batch) is one SQLite transaction; the publisher thread does the network.
        ``_answer``: the etcd key of the document's durable answer marker, deleted once
        delivered."""
        marker = doc.get("_answer")
        if marker is not None:
            doc = {k: v for k, v in doc.items() if k != "_answer"}
        name = answer_name(doc)
        if name is not None and doc.get("answer") != name:
            doc = {**doc, "answer": name}   # what the cloud dedupes answers on (with job_id)
        self._statuses.append((self.topics.status(doc.get("job_id")), doc, marker))
        if len(self._statuses) == 1:
            self.loop.post(self._write_statuses)

    def _write_statuses(self) -> None:
        """Loop thread: the queued statuses, in order, in one outbox transaction."""
        items, self._statuses = self._statuses, []
        self.writer.write(items)

    def _republish(self, job_id, doc: dict, marker: str) -> None:
        """Answers' sweep thread: an answer whose writer is gone, published by this owner."""
        self.writer.write([(self.topics.status(job_id), doc, marker)])

    def _fence_for(self, shard: int) -> Optional[Fence]:
        """Ingest threads: the shard's fence if this agent holds it (a snapshot read)."""
        return self.ownership.fence_snapshot(shard)

    def checkpoint_sink(self, doc: dict) -> None:
        """Audit writer thread: an anchor for the cloud, sent in order via the outbox."""
        self.writer.write([(self.topics.checkpoint(self.agent_id), {"v": 1, "agent": self.agent_id, **doc}, None)])

    def _notify(self, kind: str, obj: Any) -> None:
        for listener in list(self.job_listeners):
            self.loop.post(listener.job_stored if kind == "stored" else listener.job_cancelled, obj)

    # --- link callbacks (the link's thread) ---------------------------------------------
    def _connected(self, generation: int, session_present: bool) -> None:
        self.link.publish(self.topics.presence(self.agent_id), presence_doc(self.agent_id, self._state), 1, True)
        self.outbox.wake.set()

    def _message(self, msg: Message) -> None:
        if msg.topic in self.gate_topics:
            self.link.ack(msg)
            self.gate_topics.saw(msg.topic, msg.payload)
        elif msg.topic == self.topics.jobs_get:
            self.queries.on_message(msg)
        elif self.topics.kind(msg.topic) == "status":
            self._stray_status(msg)
        else:
            self.dispatcher.on_message(msg)

    def _stray_status(self, msg: Message) -> None:
        """A status of some agent: a subscription an older agent left in the persistent
        session (agents no longer read each other's statuses; the broker's ACL refuses them
        too). Not read; its subscription is dropped once per agent and run."""
        self.link.ack(msg)
        self.statuses_received += 1
        agent = self.topics.agent_of(msg.topic)
        if agent is not None and ID_RE.fullmatch(agent) and self._stray_agents.get(agent) is None:
            self._stray_agents.remember(agent, True)
            self.link.unsubscribe(self.topics.agent_prefix(agent) + "status/+")

    def _published(self, mid: int) -> None:
        self.publisher.on_publish(mid)

    # --- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self.publisher.start()
        self.dispatcher.start()
        self.answers.start()
        self.queries.start()
        threading.Thread(target=self._start_watch, name="mqtt-jobs-watch-start", daemon=True).start()
        self.link.start()

    def _start_watch(self) -> None:
        """Watch jobs/ from now on (no snapshot): lets non-owners release pushes at once."""
        backoff = 0.1
        while not self._stopping.is_set():
            try:
                _, rev = self.client.get_prefix(self.keys.prefix + "cloud-probe/", keys_only=True)
                break
            except Exception:
                self._stopping.wait(backoff)
                backoff = min(2.0, backoff * 2)
        else:
            return
        # both only look at puts (a job stored or cancelled, a rejection's marker): deletes
        # (e.g. every delivered answer's marker) and previous values are not sent
        self.watch = PrefixWatch(self.client, self.keys.jobs_prefix(), "cloud-jobs",
                                 on_snapshot=lambda kvs, rev: None, on_events=self.dispatcher.on_job_events,
                                 start_revision=rev + 1, puts_only=True).start()
        self.answers_watch = PrefixWatch(self.client, self.keys.answers_prefix(), "cloud-answers",
                                         on_snapshot=lambda kvs, rev: None, on_events=self.dispatcher.on_answer_events,
                                         start_revision=rev + 1, puts_only=True).start()

    def reconnect(self, mqtt: MqttConfig) -> None:
        """A reload changed mqtt.tls (or a renewed file at the same path) or the password:
        the link gets a new client with them, the same client id and session (on a thread
        of its own: the old client's DISCONNECT and network thread are waited for)."""
        threading.Thread(target=self.mqtt.replace_client, args=(mqtt, self.publisher.link_replaced),
                         name="mqtt-replace", daemon=True).start()

    def drain(self, done: Callable[[], None]) -> None:
        self._state = "draining"
        try:
            self.link.publish(self.topics.presence(self.agent_id),
                              presence_doc(self.agent_id, "draining", "sigterm"), 1, True)
        finally:
            done()

    def stop(self) -> None:
        self._stopping.set()
        self._write_statuses()  # what the loop queued and had no turn left to write
        if self.link.connected:
            self.publisher.flush(1.0)  # best effort: the rest stays in the outbox for the next start
        if self.link.connected:
            self.link.publish_wait(self.topics.presence(self.agent_id),
                                   presence_doc(self.agent_id, "offline", "stopped"), 1, True, timeout=2.0)
        self.dispatcher.stop()
        self.queries.stop()
        self.answers.stop()
        for w in (self.watch, self.answers_watch):
            if w is not None:
                w.stop(timeout=1.0)
        self.link.stop()
        self.publisher.stop()
        self._write_statuses()
        self.writer.close()   # tries what is held once more, logs what is lost
        self.writer.flush_gap()
        self.outbox.close()

    def status(self) -> dict:
        return {"connected": self.link.connected, "broker": f"{self.link.host}:{self.link.port}",
                "client_id": self.link.client_id, "outbox_depth": self.outbox.depth,
                "outbox_held": self.writer.held, "outbox_writable": not self.writer.failing,
                "pending_pushes": self.dispatcher.pending, "paho": PAHO_VERSION,
                "held_get_requests": self.queries.held, "queued_get_requests": self.queries.queued,
                "statuses_received": self.statuses_received,
                "keys": self.keyring.kids}
