"""Reload (SIGHUP, `millwright reload`): the config and the keys file read again, what may
change live applied to the running agent, anything else refused whole.

The files are read off the loop (a thread posts the result), so a slow disk never stalls
leases; the diff and the changes run on the loop, which owns the state. A config that
`config check` refuses, or one that changes a restart-only key, leaves the running config
untouched: an operator gets one line per problem and the agent goes on as it was.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence

from agent.audit.events import config_digest
from agent.config import Config, ConfigError, MqttConfig, TLSConfig, apply_live, diff, load_config
from agent.jobs.signing import KeyFileError, KeyRing
from agent.runtime.metrics import counter, gauge

if TYPE_CHECKING:
    from agent.jobs.seams import AuditSink
    from agent.runtime.loop import EventLoop

log = logging.getLogger(__name__)

RELOADS = counter("millwright_config_reloads_total", "Config reloads by result (applied, unchanged, refused)",
                  ("result",))
LOADED_AT = gauge("millwright_config_loaded_timestamp_seconds", "Unix time the running config was loaded")

Answer = Callable[[dict], None]


class StoredJobs(Protocol):
    """The job catalog: held jobs checked again against the new keys and templates."""
    def keys_changed(self) -> None: ...
    def templates_changed(self, templates: dict) -> None: ...


class TemplateHolder(Protocol):
    """A part that derives state from the templates at start (supervision's exec policies)."""
    def templates_changed(self, templates: dict) -> None: ...


class MemberRecord(Protocol):
    """The shard manager: our member record put again (same lease)."""
    def member_changed(self, capacity: float, fields: dict) -> None: ...


class BrokerLink(Protocol):
    """The cloud component: a new MQTT client with the new TLS files or password."""
    def reconnect(self, mqtt: MqttConfig) -> None: ...


class EtcdChannel(Protocol):
    """The etcd client: its channel made again with the new TLS files or password."""
    def reconfigure(self, tls: Optional[TLSConfig], password: Optional[str]) -> None: ...


def _tls_fingerprint(tls: Optional[TLSConfig]) -> str:
    """SHA-256 over the TLS files' bytes: a certificate renewed at the same path differs."""
    if tls is None:
        return ""
    h = hashlib.sha256()
    for path in (tls.ca, tls.cert, tls.key):
        if path:
            try:
                with open(path, "rb") as fh:
                    h.update(hashlib.sha256(fh.read()).digest())
            except OSError as exc:
                h.update(f"unreadable:{exc.errno}".encode())
    return h.hexdigest()


class Loaded:
    """A config as read from disk, with what a digest of it cannot see: the keys file's
    content and the TLS files' fingerprints."""

    def __init__(self, cfg: Config, ring: KeyRing):
        from agent.execute.hiding import plan

        self.cfg = cfg
        self.ring = ring
        hide = plan(cfg)   # what job isolation covers: set up once, at start
        self.hidden = (hide.dirs, hide.files)
        self.etcd_tls = _tls_fingerprint(cfg.etcd.tls)
        self.mqtt_tls = _tls_fingerprint(cfg.mqtt.tls)
        self.keys = ring.digest()
        body = "|".join((config_digest(cfg), self.keys, self.etcd_tls, self.mqtt_tls))
        self.digest = hashlib.sha256(body.encode()).hexdigest()


def gates_changed(old: Config, new: Config) -> list[str]:
    """Templates whose production gates differ: the gates' MQTT topics and etcd watches are
    set up at start (agent/jobs/gates.py), so a gate added, changed or removed waits for a
    restart rather than being half applied."""
    names = sorted(set(old.templates) | set(new.templates))

    def gates(cfg: Config, name: str) -> dict:
        t = cfg.templates.get(name)
        return dict(t.gates) if t is not None else {}

    return [f"templates.{n}.gates" for n in names if gates(old, n) != gates(new, n)]


def read(path: str) -> tuple[Optional[Loaded], list[str]]:
    """Load the config as `config check` does (every problem) and its keys file."""
    from agent.cloud.profile import check_profile

    try:
        cfg = load_config(path, broker=True, broker_checks=(check_profile,))
    except ConfigError as exc:
        return None, list(exc.problems)
    if os.geteuid() == 0:   # what a root agent refuses to start with, it refuses to reload to
        from agent.execute.hiding import plan

        refused = plan(cfg).refused
        if refused:
            return None, list(refused)
    try:
        ring = KeyRing.load(cfg.signing.keys_file)
    except KeyFileError as exc:
        return None, list(exc.problems)
    return Loaded(cfg, ring), []


class Reloader:
    """The reload coordinator (a part): one reload at a time; requests that come meanwhile
    are answered by the next one."""

    def __init__(self, cfg: Config, loop: EventLoop, audit: AuditSink, keyring: KeyRing, catalog: StoredJobs,
                 member: MemberRecord, broker: Optional[BrokerLink], channel: EtcdChannel,
                 template_holders: Sequence[TemplateHolder] = ()):
        self.cfg = cfg   # the running config, changed in place by apply_live
        self.loop = loop
        self.audit = audit
        self.keyring = keyring
        self.catalog = catalog
        self.member = member
        self.broker = broker
        self.channel = channel
        self.template_holders = list(template_holders)
        self.running = Loaded(cfg, keyring)
        self.loaded_at = time.time()
        self.last_refusal: Optional[dict] = None
        self._waiting: list[Answer] = []   # answered by the reload under way
        self._next: list[Answer] = []      # came during it: answered by the next one
        self._busy = False
        self._again = False
        LOADED_AT.set(self.loaded_at)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def status(self) -> dict:
        return {"digest": self.running.digest[:12], "loaded_at": self.loaded_at, "source": self.cfg.source,
                "last_refusal": self.last_refusal}

    def request(self, answer: Optional[Answer] = None) -> None:
        """Reload now (loop thread); ``answer`` gets the outcome (the admin socket's op)."""
        if self._busy:   # it may have read the files already: the next reload answers
            if answer is not None:
                self._next.append(answer)
            self._again = True
            return
        if answer is not None:
            self._waiting.append(answer)
        self._busy = True
        log.info("reloading the configuration", extra={"fields": {"config": self.cfg.source}})
        threading.Thread(target=self._read, name="reload", daemon=True).start()

    def _read(self) -> None:   # its own thread: the files, parsed off the loop
        try:
            loaded, problems = read(self.cfg.source)
        except Exception as exc:   # a reload must always answer
            loaded, problems = None, [f"{self.cfg.source}: {exc}"]
        self.loop.post(self._decide, loaded, problems)

    def _decide(self, loaded: Optional[Loaded], problems: list[str]) -> None:
        changed: list[str] = []
        if loaded is not None:
            live, restart = diff(self.cfg, loaded.cfg)
            restart += gates_changed(self.cfg, loaded.cfg)
            problems = [f"reload refused: {key} is restart-only" for key in restart]
            if loaded.hidden != self.running.hidden:
                problems.append("reload refused: the directories and files hidden from runs would change (a TLS "
                                "key, a secret's directory, a root template's paths); they are set up at start: "
                                "restart the agent")
            changed = live + self._files_changed(loaded)
        if problems:
            result = "refused"
            self.last_refusal = {"at": time.time(), "problems": problems}
            for line in problems:
                log.error("reload refused: the running config is kept", extra={"fields": {"problem": line}})
        elif not changed:
            result = "unchanged"
        else:
            assert loaded is not None
            self._apply(loaded, changed)
            result = "applied"
        new = loaded.digest if loaded is not None else None
        old = self.running.digest
        if result == "applied" and loaded is not None:
            self.running, self.loaded_at = loaded, time.time()
            LOADED_AT.set(self.loaded_at)
        RELOADS.labels(result).inc()
        self.audit.record("config_reload", old=old, new=new, changed=changed, result=result, problems=problems)
        log.info("reload done", extra={"fields": {"result": result, "changed": ",".join(changed)}})
        doc = {"result": result, "changed": changed, "problems": problems, "digest": self.running.digest[:12]}
        waiting, self._waiting = self._waiting, []
        self._busy = False
        for answer in waiting:
            answer(doc)
        if self._again:
            self._again = False
            self._waiting, self._next = self._next, []
            self.request()

    def _files_changed(self, loaded: Loaded) -> list[str]:
        """Live keys whose files changed at the same path (the config text did not)."""
        out = []
        if loaded.keys != self.running.keys:
            out.append("signing.keys")
        if loaded.etcd_tls != self.running.etcd_tls and loaded.cfg.etcd.tls == self.cfg.etcd.tls:
            out.append("etcd.tls")
        if loaded.mqtt_tls != self.running.mqtt_tls and loaded.cfg.mqtt.tls == self.cfg.mqtt.tls:
            out.append("mqtt.tls")
        return out

    def _apply(self, loaded: Loaded, changed: list[str]) -> None:
        """The live changes, in an order that never lets a job run on trust it lost: keys
        first (held jobs checked again), then templates, then the member record and the
        connections."""
        new = loaded.cfg
        apply_live(self.cfg, new)
        if "signing.keys" in changed:
            self.keyring.replace(loaded.ring)
            self.catalog.keys_changed()
        if "templates" in changed:
            for holder in self.template_holders:
                holder.templates_changed(self.cfg.templates)
            self.catalog.templates_changed(self.cfg.templates)
        if {"templates", "labels", "capacity"} & set(changed):
            from agent.coordination import placement

            self.member.member_changed(self.cfg.capacity, {
                "labels": dict(self.cfg.labels), "templates": sorted(self.cfg.templates),
                "templates_hash": placement.templates_digest(self.cfg.templates)})
        if {"etcd.tls", "etcd.password"} & set(changed):
            self.channel.reconfigure(self.cfg.etcd.tls, self.cfg.etcd.password)
        if self.broker is not None and {"mqtt.tls", "mqtt.password"} & set(changed):
            self.broker.reconnect(self.cfg.mqtt)
