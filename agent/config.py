"""Typed agent configuration loaded from YAML.

Every section is a dataclass whose fields carry a ``doc`` string, so that the configuration
reference (docs/configuration.md, `make reference`) is generated from this file and never
drifts. Loading collects *every* problem (key path and file) instead of stopping at the
first, because an operator fixing a gateway's config over a slow link wants the whole list
at once.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
import typing
from dataclasses import dataclass, field
from typing import Any, Optional, cast

import yaml

ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def doc(text: str, **kw: Any) -> Any:
    """A dataclass field with documentation for the generated reference."""
    return field(metadata={"doc": text}, **kw)


# Placeholders every template's argv may use besides its params: the run's identity, so a
# job can dedupe its own side effects (its environment carries the same values).
RUN_PLACEHOLDERS = ("job_id", "fire_id", "attempt", "run_id")


# A self-fenced agent's runs get SIGTERM when the session's renew deadline passes (the
# executor's reaper checks every 0.2 s) and SIGKILL kill_grace_s later; the margin covers
# that check, the kill and the reap, so they are dead before the lease can expire.
FENCE_KILL_MARGIN_S = 0.5


class ConfigError(Exception):
    """Raised with one line per problem; each names the key and the file."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass
class TLSConfig:
    ca: Optional[str] = doc("CA bundle (PEM) used to verify the server.", default=None)
    cert: Optional[str] = doc("Client certificate (PEM) for mutual TLS.", default=None)
    key: Optional[str] = doc("Client private key (PEM) for mutual TLS.", default=None)


@dataclass
class EtcdConfig:
    endpoints: list[str] = doc(
        "etcd client URLs; the agent fails over between them in order.",
        default_factory=lambda: ["http://127.0.0.1:2379"],
    )
    lease_ttl_s: int = doc("Session lease TTL: shards are lost this long after the agent dies.", default=10)
    renew_deadline_s: float = doc(
        "Self-fence when no renewal succeeded for this long (must be < lease_ttl_s).", default=6.0
    )
    retry_period_s: float = doc("Keepalive period (must be < renew_deadline_s).", default=1.0)
    request_timeout_s: float = doc("Timeout of a single etcd request.", default=2.0)
    tls: Optional[TLSConfig] = doc("TLS settings; use https:// endpoints with it.", default=None)
    username: Optional[str] = doc("etcd user (with password).", default=None)
    password: Optional[str] = doc("etcd password (with username).", default=None)
    insecure: bool = doc("Allow a password over plain http:// endpoints (labs only; otherwise a config error).",
                         default=False)


@dataclass
class MqttConfig:
    url: str = doc("Broker URL, mqtt://host:port or mqtts://host:port.", default="mqtt://127.0.0.1:1883")
    client_id: Optional[str] = doc("Stable client id for the persistent session (default: millwright-<cluster>-<agent_id>).", default=None)
    username: Optional[str] = doc("Broker user.", default=None)
    password: Optional[str] = doc("Broker password.", default=None)
    tls: Optional[TLSConfig] = doc("TLS settings for mqtts://.", default=None)
    keepalive_s: int = doc("MQTT keepalive.", default=30)
    max_payload_bytes: int = doc("Pushes larger than this are rejected with reason too_large.", default=65536)
    ingest_grace_s: float = doc("Non-owners ingest a push only if it is not in etcd after this delay.", default=1.5)
    max_skew_s: float = doc("Largest accepted distance of issued_at ahead of the agent clock.", default=300.0)
    max_age_s: float = doc("Pushes and cancels whose issued_at is older than this are refused (too_old).",
                           default=86400.0)
    insecure: bool = doc("Allow a password over plain mqtt:// (labs only; otherwise a config error).",
                         default=False)
    outbox_max: int = doc("Most status documents held while the broker is unreachable.", default=100000)
    outbox_full_policy: str = doc(
        "When the outbox is full: drop_oldest_terminal keeps final states and drops the oldest intermediate ones.",
        default="drop_oldest_terminal",
    )
    reconnect_min_s: float = doc("First delay before reconnecting to the broker; doubles per attempt.", default=0.5)
    reconnect_max_s: float = doc("Longest delay between reconnect attempts.", default=30.0)


@dataclass
class SigningConfig:
    keys_file: str = doc("Root-only YAML file mapping key id to key.", default="/etc/millwright/keys.yaml")


@dataclass
class AuditConfig:
    dir: str = doc("Directory of the hash-chained audit files.", default="/var/log/millwright/audit")
    key_file: str = doc("Root-only file with the audit HMAC key (created on first start).", default="/etc/millwright/audit.key")
    fsync_interval_s: float = doc("Batch writes and fsync at most this often (0 = every record).", default=1.0)
    queue_max: int = doc("Records buffered before drops are counted as a gap.", default=10000)
    rotate_bytes: int = doc("Rotate the current file at this size.", default=16 * 1024 * 1024)
    keep_files: int = doc("Closed files kept (oldest removed first; their checkpoints remain).", default=64)
    checkpoint_interval_s: float = doc(
        "Record the current file's position in checkpoints.jsonl this often (0 = only at stop); "
        "bounds how much of a truncated tail can go unnoticed.", default=60.0)
    node_exec: bool = doc("Record exec events from outside any job (node activity).", default=True)


@dataclass
class MetricsConfig:
    listen: str = doc("host:port of the Prometheus exporter; empty disables it.", default="127.0.0.1:9810")


@dataclass
class AdminConfig:
    socket: str = doc("Root-only Unix socket for `millwright status`.", default="/run/millwright/admin.sock")


@dataclass
class BpfConfig:
    enabled: bool = doc("Load the BCC program; the agent runs degraded without it.", default=True)
    mode: str = doc("Exec policy: enforce (kill the run) or monitor (record only).", default="enforce")
    node_activity: bool = doc("Report execs outside any job as node activity.", default=True)
    perf_pages: int = doc("Perf buffer pages per CPU for exec and state events.", default=64)
    window_s: float = doc("Window of the per-run and per-endpoint retransmit rates.", default=5.0)
    sample_interval_s: float = doc("How often the kernel's per-run counters are sampled.", default=0.25)


@dataclass
class Resources:
    cpu: Optional[float] = doc("CPU cores (0.5 = half a core).", default=None)
    memory_mb: Optional[int] = doc("Memory limit in MiB.", default=None)
    pids: Optional[int] = doc("Most processes and threads.", default=None)


@dataclass
class HealthThresholds:
    retrans_per_s_degraded: float = doc("Retransmits per second that make a run degraded.", default=1.0)
    retrans_per_s_stalled: float = doc("Retransmits per second that make a run stalled.", default=3.0)
    stall_age_s: float = doc("A connection stuck this long makes the run stalled.", default=5.0)
    failed_connects: int = doc("Failed connects in a window that make a run degraded.", default=3)


@dataclass
class Gate:
    mqtt: Optional[str] = doc("Topic on the agent's broker whose last (retained) value must equal `equals` "
                              "(unknown, so closed, while the broker is unreachable).", default=None)
    etcd: Optional[str] = doc("Key below gates/ under the cluster prefix whose value must equal `equals`.", default=None)
    equals: Optional[str] = doc("The value (UTF-8, compared exactly) that opens an mqtt or etcd gate.", default=None)
    command: list[str] = doc("A probe run as the agent, clean environment: exit 0 = open.", default_factory=list)
    timeout_s: float = doc("A probe still running after this is killed; the gate counts as closed.", default=2.0)


@dataclass
class Template:
    argv: list[str] = doc("Command line with {param} placeholders; never run through a shell.")
    params: dict[str, str] = doc("Regex each param must match in full.", default_factory=dict)
    user: str = doc("User whose groups and name a run gets; each run executes under a uid of its own from "
                    "the reserved range 70000-79999 (a root user's runs stay uid 0, confined: see docs/security.md).",
                    default="millwright-jobs")
    allow_root: bool = doc("Must be true for a template whose user is root (any name that resolves to uid 0).",
                           default=False)
    network: str = doc("What a run may reach: none (no network at all), internet (everything but this host "
                       "and the agent's etcd and broker endpoints; DNS to a local resolver is allowed) or any "
                       "(this host too, still not the etcd and broker endpoints).", default="internet")
    capabilities: list[str] = doc("Capabilities a root run keeps (e.g. net_raw, sys_rawio); every other one "
                                  "is dropped, bounding set included. Root templates only.", default_factory=list)
    resources: Resources = doc("Ceilings; a job's own resources are capped by these.", default_factory=Resources)
    allow_exec: list[str] = doc("Paths and globs a job process may exec.", default_factory=list)
    health: HealthThresholds = doc("Network health thresholds.", default_factory=HealthThresholds)
    gates: dict[str, Gate] = doc("Production gates: conditions (name -> gate) that must all hold when a run "
                                 "starts; a firing waits while one is closed (docs/jobs.md).", default_factory=dict)
    gate_timeout_s: Optional[float] = doc("A firing that waited this long for its gates ends failed, reason "
                                          "gate_timeout (none: it waits until they open).", default=None)
    while_running: str = doc("finish: a gate that closes leaves started runs alone; stop: it stops them "
                             "(outcome gate_closed).", default="finish")


@dataclass
class ExecuteConfig:
    max_concurrent: int = doc("Most runs at once on this node. On cgroup v2 also the CPU weight of the "
                              "runs' cgroup against the agent's own: it weighs this many processes, so "
                              "that with every run busy each weighs what the agent does (quotas still "
                              "cap each run).", default=4)
    memory_mb: int = doc("Memory budget for all runs together.", default=512)
    cpu: float = doc("CPU budget for all runs together (cores).", default=1.0)
    quota_backend: str = doc("auto, cgroup2, cgroup1 or rlimit.", default="auto")
    output_max_bytes: int = doc("stdout/stderr kept per run (each).", default=1024 * 1024)
    kill_grace_s: float = doc("Between SIGTERM and SIGKILL on timeout, cancel, stop or self-fence; with a "
                              "0.5 s margin it must fit in etcd.lease_ttl_s - etcd.renew_deadline_s.", default=3.0)
    claim_lead_s: float = doc("At most this long before its due time a firing's run record is claimed "
                              "and its process prepared (quota container, launcher waiting on its go "
                              "pipe, released at the due time by its own timer), so only the job's exec "
                              "is left at the due time. The agent uses three times "
                              "its recent claim latency, within [0.05 s, this]. 0: claim and spawn at "
                              "the due time.", default=0.25)


@dataclass
class RetentionConfig:
    keep_runs: int = doc("Run records kept per job in etcd, newest first (the newest and any record "
                         "still running or retrying are always kept); also run directories kept per job.",
                         default=100)
    finished_job_s: float = doc("How long a job that can never fire again (one-shot done, cancelled, "
                                "expired) stays in etcd before it becomes a tombstone.", default=7 * 86400.0)
    tombstone_s: float = doc("How long the tombstone of a finished or cancelled job answers redelivered "
                             "pushes; keep it longer than the broker keeps undelivered messages.",
                             default=7 * 86400.0)
    run_output_s: float = doc("Run directories (stdout, stderr) older than this are removed.",
                              default=7 * 86400.0)
    run_output_max_mb: int = doc("Disk budget for all run directories; the oldest go first.", default=1024)
    max_deletes_per_s: float = doc("Most deletions per second (etcd keys and run directories).", default=200.0)
    interval_s: float = doc("One owned shard is trimmed per tick of this period (0 disables retention).",
                            default=10.0)
    disk_interval_s: float = doc("How often run directories are checked.", default=60.0)
    pools_interval_s: float = doc("The owner of shard 0 removes placement pools that no longer have jobs "
                                  "this often (their agents then hand the pool's shards back).", default=300.0)
    compact_interval_s: float = doc("The owner of shard 0 compacts etcd's history this often, to the "
                                    "revision seen one interval earlier (0: the operator runs compaction, "
                                    "e.g. etcd --auto-compaction-mode=revision).", default=300.0)


@dataclass
class QuotaConfig:
    jobs: int = doc("Most job documents the cluster stores (tombstones included); a push past it is "
                    "rejected quota_exceeded. Cluster-wide: give every agent the same value.", default=100000)
    stored_mb: int = doc("Most megabytes of job documents the cluster stores (tombstones included); a push "
                         "past it is rejected quota_exceeded. Cluster-wide, like jobs.", default=512)


@dataclass
class Config:
    cluster: str = doc("Cluster name: etcd prefix and MQTT topic segment.", default="plant-a")
    agent_id: str = doc("Agent id (default: the host name).", default_factory=socket.gethostname)
    capacity: float = doc("Weight in shard assignment.", default=1.0)
    labels: dict[str, str] = doc("Labels jobs can target (e.g. line: \"2\", cell: press); string values, "
                                 "keys [A-Za-z0-9][A-Za-z0-9._/-]{0,62}, values [A-Za-z0-9._-]{1,63}, at most 32.",
                                 default_factory=dict)
    shards: int = doc("Shard count, fixed per cluster.", default=64)
    state_dir: str = doc("Local state (outbox, run output).", default="/var/lib/millwright")
    drain_timeout_s: float = doc("On SIGTERM, wait this long for runs before handing shards over.", default=30.0)
    etcd: EtcdConfig = doc("Coordination store.", default_factory=EtcdConfig)
    mqtt: MqttConfig = doc("Cloud channel.", default_factory=MqttConfig)
    signing: SigningConfig = doc("Job signature keys.", default_factory=SigningConfig)
    audit: AuditConfig = doc("Tamper-evident audit log.", default_factory=AuditConfig)
    metrics: MetricsConfig = doc("Prometheus exporter.", default_factory=MetricsConfig)
    admin: AdminConfig = doc("Local admin endpoint.", default_factory=AdminConfig)
    bpf: BpfConfig = doc("Kernel sensor.", default_factory=BpfConfig)
    execute: ExecuteConfig = doc("Run execution and node budget.", default_factory=ExecuteConfig)
    retention: RetentionConfig = doc("What is deleted, and when (etcd records, run output).",
                                     default_factory=RetentionConfig)
    quotas: QuotaConfig = doc("What the signers of one cluster may store in etcd.", default_factory=QuotaConfig)
    templates: dict[str, Template] = doc("Job templates the cloud may name.", default_factory=dict)
    source: str = field(default="<defaults>", metadata={"internal": True})


# --------------------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _type_name(args[0])
    if origin is list:
        return "a list"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(tp, str(tp))


def _convert(value: Any, tp: Any, path: str, problems: list[str], src: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(value, args[0], path, problems, src)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(f"{src}: {path}: expected {_type_name(tp)}, got {type(value).__name__}")
            return cast(Any, tp)() if _all_defaulted(tp) else None
        return _build(tp, value, path, problems, src)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            problems.append(f"{src}: {path}: expected a list, got {type(value).__name__}")
            return []
        return [_convert(v, item_tp, f"{path}[{i}]", problems, src) for i, v in enumerate(value)]
    if origin is dict:
        _, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            problems.append(f"{src}: {path}: expected a mapping, got {type(value).__name__}")
            return {}
        return {str(k): _convert(v, val_tp, f"{path}.{k}", problems, src) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(f"{src}: {path}: expected true or false, got {value!r}")
        return bool(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{src}: {path}: expected an integer, got {value!r}")
            return 0
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{src}: {path}: expected a number, got {value!r}")
            return 0.0
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            problems.append(f"{src}: {path}: expected a string, got {value!r}")
            return str(value)
        return value
    return value


def _all_defaulted(cls: Any) -> bool:
    return all(
        f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        for f in dataclasses.fields(cls)
    )


def _build(cls: Any, data: dict, path: str, problems: list[str], src: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in known:
            problems.append(f"{src}: {where}: unknown key (known: {', '.join(sorted(known))})")
            continue
        kwargs[key] = _convert(value, hints[key], where, problems, src)
    for name, f in known.items():
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            where = f"{path}.{name}" if path else name
            problems.append(f"{src}: {where}: required key is missing")
            kwargs[name] = _convert([] if typing.get_origin(hints[name]) is list else "", hints[name], where, [], src)
    return cls(**kwargs)


def _endpoint_ok(url: str) -> bool:
    m = re.match(r"^(https?)://([^/:]+|\[[0-9a-fA-F:]+\]):(\d{1,5})/?$", url)
    return m is not None and 0 < int(m.group(3)) < 65536


def _validate_labels(labels: Any, bad: Any) -> None:
    from agent.coordination.placement import TargetError, check_labels

    if not isinstance(labels, dict):
        return  # already reported by the type check
    if len(labels) > 32:
        bad("labels", f"has {len(labels)} labels; at most 32 are allowed")
    for k, v in labels.items():  # one line per bad label
        if isinstance(v, str):
            try:
                check_labels({k: v}, "labels")
            except TargetError as exc:
                bad(exc.field, exc.message)


def _validate(cfg: Config, problems: list[str]) -> None:
    src = cfg.source

    def bad(key: str, msg: str) -> None:
        problems.append(f"{src}: {key}: {msg}")

    if not NAME_RE.match(cfg.cluster or ""):
        bad("cluster", "must match [A-Za-z0-9_-]{1,64} (it becomes an etcd prefix and an MQTT topic segment)")
    if not ID_RE.match(cfg.agent_id or ""):
        bad("agent_id", "must match [A-Za-z0-9._-]{1,128}")
    if not cfg.capacity > 0:
        bad("capacity", "must be greater than 0")
    _validate_labels(cfg.labels, bad)
    if not 1 <= cfg.shards <= 4096:
        bad("shards", "must be between 1 and 4096")
    if not cfg.state_dir:
        bad("state_dir", "must not be empty")
    e = cfg.etcd
    if not e.endpoints:
        bad("etcd.endpoints", "needs at least one endpoint")
    for i, url in enumerate(e.endpoints):
        if isinstance(url, str) and not _endpoint_ok(url):
            bad(f"etcd.endpoints[{i}]", f"{url!r} is not http(s)://host:port")
    if e.lease_ttl_s < 2:
        bad("etcd.lease_ttl_s", "must be at least 2 seconds")
    if not e.renew_deadline_s < e.lease_ttl_s:
        bad("etcd.renew_deadline_s", f"must be less than etcd.lease_ttl_s ({e.lease_ttl_s}) so the agent fences itself before its lease can expire")
    if not 0 < e.retry_period_s < e.renew_deadline_s:
        bad("etcd.retry_period_s", f"must be greater than 0 and less than etcd.renew_deadline_s ({e.renew_deadline_s})")
    if e.request_timeout_s <= 0:
        bad("etcd.request_timeout_s", "must be greater than 0")
    if (e.username is None) != (e.password is None):
        bad("etcd.username" if e.username is None else "etcd.password", "username and password go together")
    if e.password is not None and not e.insecure:
        for i, url in enumerate(e.endpoints):
            if isinstance(url, str) and url.startswith("http://"):
                bad(f"etcd.endpoints[{i}]", f"{url!r} is plain http but etcd.password is set: use https:// with "
                                            "etcd.tls, or set etcd.insecure: true (labs only)")
    m = cfg.mqtt
    if not re.match(r"^mqtts?://[^/:]+(:\d{1,5})?/?$", m.url or ""):
        bad("mqtt.url", f"{m.url!r} is not mqtt://host:port or mqtts://host:port")
    if m.password is not None and (m.url or "").startswith("mqtt://") and not m.insecure:
        bad("mqtt.url", f"{m.url!r} is plain mqtt:// but mqtt.password is set: use mqtts:// with mqtt.tls, "
                        "or set mqtt.insecure: true (labs only)")
    if m.max_age_s <= 0:
        bad("mqtt.max_age_s", "must be greater than 0")
    if m.max_skew_s < 0:
        bad("mqtt.max_skew_s", "must not be negative")
    if m.max_payload_bytes < 1024:
        bad("mqtt.max_payload_bytes", "must be at least 1024")
    if m.outbox_max < 1:
        bad("mqtt.outbox_max", "must be at least 1")
    if m.outbox_full_policy not in ("drop_oldest_terminal", "drop_oldest", "reject_new"):
        bad("mqtt.outbox_full_policy", "must be drop_oldest_terminal, drop_oldest or reject_new")
    if m.ingest_grace_s < 0:
        bad("mqtt.ingest_grace_s", "must not be negative")
    a = cfg.audit
    if a.fsync_interval_s < 0:
        bad("audit.fsync_interval_s", "must not be negative")
    if a.queue_max < 10:
        bad("audit.queue_max", "must be at least 10")
    if a.rotate_bytes < 4096:
        bad("audit.rotate_bytes", "must be at least 4096")
    if a.keep_files < 1:
        bad("audit.keep_files", "must be at least 1")
    if a.checkpoint_interval_s < 0:
        bad("audit.checkpoint_interval_s", "must not be negative")
    if cfg.metrics.listen:
        host, _, port = cfg.metrics.listen.rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) < 65536:
            bad("metrics.listen", f"{cfg.metrics.listen!r} is not host:port")
        else:
            try:
                ipaddress.ip_address(host.strip("[]"))
            except ValueError:
                if not re.match(r"^[A-Za-z0-9.-]+$", host):
                    bad("metrics.listen", f"{host!r} is not a host name or address")
    for name in ("jobs", "stored_mb"):
        if getattr(cfg.quotas, name) < 1:
            bad(f"quotas.{name}", "must be at least 1")
    ret = cfg.retention
    if ret.keep_runs < 1:
        bad("retention.keep_runs", "must be at least 1 (the newest record is needed for misfire recovery)")
    for name in ("finished_job_s", "tombstone_s", "run_output_s", "interval_s", "disk_interval_s",
                 "compact_interval_s"):
        if getattr(ret, name) < 0:
            bad(f"retention.{name}", "must not be negative")
    if ret.max_deletes_per_s <= 0:
        bad("retention.max_deletes_per_s", "must be positive")
    if ret.run_output_max_mb < 1:
        bad("retention.run_output_max_mb", "must be at least 1")
    if cfg.bpf.mode not in ("enforce", "monitor"):
        bad("bpf.mode", "must be enforce or monitor")
    if cfg.bpf.perf_pages < 1 or cfg.bpf.perf_pages & (cfg.bpf.perf_pages - 1):
        bad("bpf.perf_pages", "must be a power of two")
    x = cfg.execute
    if x.max_concurrent < 1:
        bad("execute.max_concurrent", "must be at least 1")
    if x.memory_mb < 1:
        bad("execute.memory_mb", "must be at least 1")
    if x.cpu <= 0:
        bad("execute.cpu", "must be greater than 0")
    if not 0 <= x.claim_lead_s <= 5:
        bad("execute.claim_lead_s", "must be between 0 and 5 seconds")
    budget = e.lease_ttl_s - e.renew_deadline_s
    if x.kill_grace_s < 0:
        bad("execute.kill_grace_s", "must not be negative")
    elif budget > 0 and x.kill_grace_s + FENCE_KILL_MARGIN_S > budget:
        bad("execute.kill_grace_s", f"{x.kill_grace_s:g} s plus a {FENCE_KILL_MARGIN_S:g} s margin must fit in "
            f"etcd.lease_ttl_s - etcd.renew_deadline_s ({budget:g} s): a self-fenced agent's runs must be dead "
            "before its lease can expire and another agent may retry them")
    if x.quota_backend not in ("auto", "cgroup2", "cgroup1", "rlimit"):
        bad("execute.quota_backend", "must be auto, cgroup2, cgroup1 or rlimit")
    for name, t in cfg.templates.items():
        where = f"templates.{name}"
        if not ID_RE.match(name):
            bad(where, "template names must match [A-Za-z0-9._-]{1,128}")
        if t is None:
            continue
        if not t.argv or not isinstance(t.argv[0], str) or not t.argv[0].startswith("/"):
            bad(f"{where}.argv", "must be a non-empty list whose first item is an absolute path")
        placeholders: set[str] = set()
        for i, arg in enumerate(t.argv or []):
            if isinstance(arg, str):
                for ph in re.findall(r"\{([^{}]*)\}", arg):
                    placeholders.add(ph)
                    if ph not in t.params and ph not in RUN_PLACEHOLDERS:
                        bad(f"{where}.argv[{i}]", f"placeholder {{{ph}}} has no regex in {where}.params")
        for pname, rx in t.params.items():
            if pname in RUN_PLACEHOLDERS:
                bad(f"{where}.params.{pname}", f"{{{pname}}} is reserved for the run's identity "
                    f"({', '.join(RUN_PLACEHOLDERS)})")
                continue
            if not isinstance(rx, str):
                continue
            try:
                re.compile(rx, re.ASCII)
            except re.error as exc:
                bad(f"{where}.params.{pname}", f"invalid regex: {exc}")
                continue
            why = regex_risk(rx)
            if why:
                bad(f"{where}.params.{pname}", why)
        if not t.user:
            bad(f"{where}.user", "must not be empty")
        elif _is_root_user(t.user) and not t.allow_root:
            bad(f"{where}.user", "runs jobs as root (uid 0): set allow_root: true in this template if that is intended")
        if t.network not in ("none", "internet", "any"):
            bad(f"{where}.network", "must be none, internet or any")
        for i, cap in enumerate(t.capabilities):
            from agent.runtime.kernel import capability_number

            if not isinstance(cap, str) or capability_number(cap) is None:
                bad(f"{where}.capabilities[{i}]", f"{cap!r} is not a capability name (capabilities(7), e.g. net_raw)")
        if t.capabilities and not t.allow_root:
            bad(f"{where}.capabilities", "only root templates (allow_root: true) keep capabilities")
        r = t.resources
        if r.cpu is not None and r.cpu <= 0:
            bad(f"{where}.resources.cpu", "must be greater than 0")
        if r.memory_mb is not None and r.memory_mb < 4:
            bad(f"{where}.resources.memory_mb", "must be at least 4")
        if r.pids is not None and r.pids < 1:
            bad(f"{where}.resources.pids", "must be at least 1")
        for i, pat in enumerate(t.allow_exec):
            if not isinstance(pat, str) or not pat.startswith("/"):
                bad(f"{where}.allow_exec[{i}]", "must be an absolute path or glob")
        _validate_gates(t, where, bad)


def _validate_gates(t: Template, where: str, bad: Any) -> None:
    """A template's production gates: each exactly one of mqtt, etcd or command."""
    if t.gate_timeout_s is not None and not 0 < t.gate_timeout_s <= 7 * 86400:
        bad(f"{where}.gate_timeout_s", "must be greater than 0 and at most 604800 (7 days)")
    if t.while_running not in ("finish", "stop"):
        bad(f"{where}.while_running", "must be finish or stop")
    for name, g in t.gates.items():
        at, kinds = f"{where}.gates.{name}", [k for k in ("mqtt", "etcd", "command") if g and getattr(g, k)]
        if not NAME_RE.match(name) or len(kinds) != 1:
            bad(at, "needs a name of [A-Za-z0-9_-]{1,64} and exactly one of mqtt, etcd or command")
        elif (kinds[0] == "command") == isinstance(g.equals, str):
            bad(f"{at}.equals", "is the value that opens an mqtt or etcd gate (a command's is exit 0)")
        if g and g.mqtt and (re.search(r"[+#\x00]", g.mqtt) or g.mqtt.startswith(("millwright/", "$"))):
            bad(f"{at}.mqtt", "must be one topic (no + or # wildcards) outside millwright/ and $")
        if g and g.etcd and not re.fullmatch(r"gates/[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*", g.etcd):
            bad(f"{at}.etcd", "must be a key below gates/ (gates/line2), segments of [A-Za-z0-9._-]")
        if g and g.command and not (isinstance(g.command[0], str) and g.command[0].startswith("/")):
            bad(f"{at}.command", "must be a list whose first item is an absolute path")
        if g and not 0 < g.timeout_s <= 60:
            bad(f"{at}.timeout_s", "must be greater than 0 and at most 60")


def _is_root_user(name: str) -> bool:
    """The user resolves to uid 0 here (a name that does not exist on this host is checked
    again when a run starts)."""
    if name in ("root", "0"):
        return True
    import pwd

    try:
        return pwd.getpwnam(name).pw_uid == 0
    except KeyError:
        return False


def _regex_parser():
    try:
        import re._parser as parser  # Python 3.11+
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_parse as parser  # type: ignore[no-redef, unused-ignore]
    return parser


def regex_risk(rx: str) -> Optional[str]:
    """Why a param regex could backtrack catastrophically, or None. Refused: a repeat that
    can repeat more than once nested inside another such repeat (``(a+)+``, ``(\\w*x?)*``).
    Python's ``re`` backtracks and no linear-time engine is packaged for Debian's Python,
    so the shape is checked instead; values are also length-limited before matching."""
    parser = _regex_parser()
    try:
        tree = parser.parse(rx, re.ASCII)
    except Exception:
        return None  # compile errors are reported separately
    repeats = {getattr(parser, n) for n in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") if hasattr(parser, n)}
    possessive = getattr(parser, "POSSESSIVE_REPEAT", None)

    def items(sub):
        return sub.data if hasattr(sub, "data") else sub

    def walk(seq, inside: bool) -> bool:
        for op, av in items(seq):
            if op in repeats:
                lo, hi, sub = av
                unbounded = hi is parser.MAXREPEAT or (hi > 1 and hi != lo)  # a{3} is not a choice
                if unbounded and inside and op is not possessive:
                    return True
                if walk(sub, inside or (unbounded and op is not possessive)):
                    return True
            elif op is parser.SUBPATTERN:
                if walk(av[-1], inside):
                    return True
            elif op is parser.BRANCH:
                if any(walk(b, inside) for b in av[1]):
                    return True
            elif hasattr(parser, "ATOMIC_GROUP") and op is parser.ATOMIC_GROUP:
                if walk(av, inside):
                    return True
        return False

    if walk(tree, False):
        return ("regex has a repeat nested inside another repeat (like (a+)+), which can backtrack "
                "for exponential time on a hostile value: rewrite it without the nested quantifier")
    return None


def load_config(path: Optional[str]) -> Config:
    """Load and validate a config file (None: the built-in defaults)."""
    if path is None:
        cfg = Config()
        problems: list[str] = []
        _validate(cfg, problems)
        if problems:
            raise ConfigError(problems)
        return cfg
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror or exc}"]) from None
    return parse_config(text, path)


def parse_config(text: str, source: str = "<string>") -> Config:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError([f"{source}:{where}: invalid YAML: {problem}"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: the top level must be a mapping"])
    problems: list[str] = []
    cfg = _build(Config, data, "", problems, source)
    cfg.source = source
    _validate(cfg, problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def state_path(cfg: Config, *parts: str) -> str:
    return os.path.join(cfg.state_dir, *parts)


def reference_markdown() -> str:
    """The configuration reference, generated from the dataclasses (docs/configuration.md)."""
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]

    def walk(cls: Any, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("internal"):
                continue
            key = f"{prefix}{f.name}"
            tp = hints[f.name]
            inner = tp
            if typing.get_origin(tp) is typing.Union:
                inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
            if f.default is not dataclasses.MISSING:
                default = repr(f.default) if f.default is not None else "—"
            elif f.default_factory is not dataclasses.MISSING and not dataclasses.is_dataclass(inner):
                default = "host name" if f.name == "agent_id" else repr(f.default_factory())
            else:
                default = "required" if f.default_factory is dataclasses.MISSING else ""
            lines.append(f"| `{key}` | {_type_name(tp).replace('a ', '').replace('an ', '')} | {default} | {f.metadata.get('doc', '')} |")
            if dataclasses.is_dataclass(inner):
                walk(inner, key + ".")
            elif typing.get_origin(inner) is dict and dataclasses.is_dataclass(typing.get_args(inner)[1]):
                walk(typing.get_args(inner)[1], key + ".<name>.")

    walk(Config, "")
    return "\n".join(lines) + "\n"
