"""Typed agent configuration loaded from YAML.

Every section is a dataclass whose fields carry a ``doc`` string, so that the configuration
reference (docs/configuration.md, `make reference`) is generated from this file and never
drifts. Loading collects *every* problem (key path and file) instead of stopping at the
first, because an operator fixing a gateway's config over a slow link wants the whole list
at once.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import stat
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, cast

import yaml

ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
BROKER_USERNAME_RE = re.compile(r"^[A-Za-z0-9._@-]+$")   # a broker user in an ACL line and a config


def doc(text: str, live: bool = False, **kw: Any) -> Any:
    """A dataclass field with documentation for the generated reference; ``live``: a reload
    applies it to the running agent (the whitelist of :func:`diff`; anything else is
    restart-only, so a field added without thought is refused, never half-applied)."""
    return field(metadata={"doc": text, "live": live}, **kw)


# The state directory packaging creates (0711); the agent creates any other one 0700.
PACKAGED_STATE_DIR = "/var/lib/millwright"

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
    tls: Optional[TLSConfig] = doc("TLS settings; use https:// endpoints with it (tls.ca is required for "
                                   "https://; tls.cert and tls.key authenticate the agent by certificate).",
                                   default=None, live=True)
    username: Optional[str] = doc("etcd user (with password): this agent's own user, see "
                                  "packaging/debian/examples/etcd-rbac.sh.", default=None)
    password: Optional[str] = doc("etcd password (with username); agent.yaml must then be 0600.", default=None, live=True)
    insecure: bool = doc("Allow plaintext http:// endpoints and an etcd without credentials (tests and labs "
                         "only; otherwise each is a config error).", default=False)


@dataclass
class MqttConfig:
    url: str = doc("Broker URL, mqtt://host:port or mqtts://host:port.", default="mqtt://127.0.0.1:1883")
    client_id: Optional[str] = doc("Stable client id for the persistent session (default: millwright-<cluster>-<agent_id>).", default=None)
    protocol: str = doc('MQTT version of the broker connection: "3.1.1" or "5" (quoted in YAML). On 5 the agent '
                        "requests its session expiry (mqtt.session_expiry_s) and reads PUBACK reason codes.",
                        default="3.1.1")
    session_expiry_s: int = doc("MQTT 5: how long the broker keeps the agent's session (and the pushes queued in "
                                "it) after a disconnect; a broker may grant less (AWS IoT Core: 1 hour by default).",
                                default=3600)
    username: Optional[str] = doc("Broker user.", default=None)
    password: Optional[str] = doc("Broker password.", default=None, live=True)
    tls: Optional[TLSConfig] = doc("TLS settings for mqtts://.", default=None, live=True)
    peers_username: Optional[str] = doc(
        "Ignored (a warning): agents no longer read each other's statuses, so there is no second connection. "
        "Kept so that a config that sets it still loads.", default=None)
    peers_password: Optional[str] = doc("Ignored (a warning), as mqtt.peers_username.", default=None)
    keepalive_s: int = doc("MQTT keepalive.", default=30)
    max_payload_bytes: int = doc("Pushes larger than this are rejected with reason too_large; the broker's "
                                 "message_size_limit should equal it.", default=65536)
    ingest_grace_s: float = doc("Non-owners ingest a push only if it is not in etcd after this delay.", default=1.5)
    max_skew_s: float = doc("Largest accepted distance of issued_at ahead of the agent clock.", default=300.0)
    max_age_s: float = doc("Pushes and cancels whose issued_at is older than this are refused (too_old).",
                           default=86400.0)
    insecure: bool = doc("Allow plain mqtt:// without TLS and a broker connection without credentials "
                         "(labs and tests only; otherwise a config error).", default=False)
    outbox_max: int = doc("Most status documents held while the broker is unreachable.", default=100000)
    outbox_full_policy: str = doc(
        "When the outbox is full: drop_oldest_terminal keeps final states and drops the oldest intermediate ones.",
        default="drop_oldest_terminal",
    )
    get_max_age_s: float = doc("jobs/get requests whose issued_at is older than this are refused (too_old).",
                               default=300.0)
    get_page_bytes: int = doc("Largest jobs/get answer (one page of a filter); at most max_payload_bytes, which "
                              "the broker's message_size_limit equals.", default=32768)
    profile: str = doc("The broker's limits by name: mosquitto, aws-iot-core, nats-2.9 or rabbitmq-3.10 "
                       "(docs/cloud.md, Broker profiles); `config check` refuses ids, payloads and subscriptions "
                       "it cannot carry.", default="mosquitto")
    limits: dict[str, Any] = doc("Single limits of mqtt.profile overridden by name (protocols, max_qos, "
                                 "max_payload_bytes, publish_rate, max_inflight, max_topic_levels, max_topic_bytes, "
                                 "session_expiry_max_s, retained_wildcard, subs_per_connection, subs_per_subscribe, "
                                 "client_id_max_bytes; null: no limit), e.g. {max_payload_bytes: 262144}.",
                                 default_factory=dict)
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
class ApprovalRule:
    required: int = doc("Signatures a job of the template needs (its sig plus approvals), each by a key of "
                        "a different role listed in roles.", default=2)
    roles: list[str] = doc("Key roles (keys-file role) whose signatures count; at most one per role.",
                           default_factory=list)


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
    approvals: Optional[ApprovalRule] = doc("Four-eyes approval: a job of this template runs only once its "
                                            "document carries this many signatures from keys of distinct "
                                            "listed roles (docs/security.md).", default=None)
    rollback: Optional[str] = doc("A template with the same params that an aborted rollout runs, once, on "
                                  "each agent whose run of the job ended (docs/jobs.md).", default=None)
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
    runtime_dir: str = doc("A directory on a tmpfs for each run's progress FIFO and result file (nothing "
                           "there needs to outlive its run; a state disk would journal two files per "
                           "run). Empty: they are made in the run directories.", default="/run/millwright/runs")
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
class QuarantineConfig:
    strikes: int = doc("Runs of one job ended by its own misbehaviour (killed for an exec outside its template's "
                       "allow_exec, ended network_stall, killed by its quota: oom, pids_limit) within window_s that "
                       "quarantine the job on this agent: its later firings wait (reason quarantined). After a "
                       "quarantine one more such run within window_s is enough, until a run succeeds cleanly.",
                       default=3)
    window_s: float = doc("How far back strikes count.", default=300.0)
    hold_s: float = doc("How long a first quarantine holds the job; each repeat doubles it, up to max_hold_s. "
                        "A new signed version of the job ends it at once.", default=300.0)
    max_hold_s: float = doc("Longest quarantine.", default=3600.0)
    max_jobs: int = doc("Most jobs whose strikes and quarantine this agent keeps (memory only); past it the "
                        "oldest strike-only entry goes first, then the quarantine that ends soonest.",
                        default=4096)


@dataclass
class Config:
    cluster: str = doc("Cluster name: etcd prefix and MQTT topic segment.", default="plant-a")
    agent_id: str = doc("Agent id (default: the host name).", default_factory=socket.gethostname)
    capacity: float = doc("Weight in shard assignment.", default=1.0, live=True)
    labels: dict[str, str] = doc("Labels jobs can target (e.g. line: \"2\", cell: press); string values, "
                                 "keys [A-Za-z0-9][A-Za-z0-9._/-]{0,62}, values [A-Za-z0-9._-]{1,63}, at most 32.",
                                 default_factory=dict, live=True)
    shards: int = doc("Shard count, fixed per cluster.", default=64)
    state_dir: str = doc("Local state (outbox, run output); created 0700 when missing (the packaged "
                         f"{PACKAGED_STATE_DIR} gets 0711 from packaging).", default=PACKAGED_STATE_DIR)
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
                                     default_factory=RetentionConfig, live=True)
    quotas: QuotaConfig = doc("What the signers of one cluster may store in etcd.", default_factory=QuotaConfig)
    quarantine: QuarantineConfig = doc("A job that misbehaves (exec policy, network stalls, quota kills) is held "
                                       "on this agent; the agent keeps its shards (docs/health.md).",
                                       default_factory=QuarantineConfig, live=True)
    templates: dict[str, Template] = doc("Job templates the cloud may name.", default_factory=dict, live=True)
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


# checks of the broker connection that live above the config (agent/cloud/profile.py)
BrokerChecks = Sequence[Callable[["Config"], list[str]]]


def load_config(path: Optional[str], broker: bool = False, broker_checks: BrokerChecks = ()) -> Config:
    """Load and validate a config file (None: the built-in defaults), its file mode
    included (see agent/configcheck.py file_mode_problems); ``broker``: the broker
    connection's checks too (configcheck.mqtt_insecurities, and each of ``broker_checks``:
    the cloud package's, e.g. what the broker profile cannot carry), reported with the others."""
    from agent.configcheck import mqtt_insecurities, validate

    if path is None:
        cfg = Config()
        problems: list[str] = []
        validate(cfg, problems)
        if broker:
            problems.extend(mqtt_insecurities(cfg) + [p for check in broker_checks for p in check(cfg)])
        if problems:
            raise ConfigError(problems)
        return cfg
    try:
        with open(path, encoding="utf-8") as fh:
            mode = stat.S_IMODE(os.fstat(fh.fileno()).st_mode)
            text = fh.read()
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError:
        raise ConfigError([f"{path}: is not UTF-8"]) from None
    return parse_config(text, path, file_mode=mode, broker=broker, broker_checks=broker_checks)


def parse_config(text: str, source: str = "<string>", file_mode: Optional[int] = None,
                 broker: bool = False, broker_checks: BrokerChecks = ()) -> Config:
    """Parse and validate config text; ``file_mode``: the permission bits of the file it
    was read from, checked against what it holds (None: not from a file); ``broker``: as
    for :func:`load_config`."""
    from agent.configcheck import file_mode_problems, mqtt_insecurities, validate

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
    validate(cfg, problems)
    if file_mode is not None:
        problems.extend(file_mode_problems(cfg, file_mode))
    if broker:
        problems.extend(mqtt_insecurities(cfg) + [p for check in broker_checks for p in check(cfg)])
    if problems:
        raise ConfigError(problems)
    return cfg


DEFAULT_CONFIG = "/etc/millwright/agent.yaml"
CONFIG_ENV = "MILLWRIGHT_CONFIG"


def config_path(given: Optional[str]) -> str:
    """The config file a command reads: ``given`` (its ``-c FILE``), else
    ``$MILLWRIGHT_CONFIG``, else the packaged default. A file named by -c or the variable
    that is missing is an error naming it (loading names a -c FILE); with none named and no
    packaged default, a ConfigError names all three places: a command never falls back to
    the built-in defaults (the package's system paths) in silence."""
    if given:
        return given   # load_config names it when it cannot be read
    env = os.environ.get(CONFIG_ENV)
    if env:
        if not os.path.exists(env):
            raise ConfigError([f"{CONFIG_ENV}={env}: config file not found"])
        return env
    if os.path.exists(DEFAULT_CONFIG):
        return DEFAULT_CONFIG
    raise ConfigError([f"no config file: no -c FILE, {CONFIG_ENV} is not set and {DEFAULT_CONFIG} does not "
                       f"exist (give -c FILE or export {CONFIG_ENV}=FILE)"])


def make_state_dir(path: str) -> None:
    """Create the state directory if it is missing: owner-only (0700), except the packaged
    one, which gets the mode packaging gives it (0711: job users reach their working
    directories below it by path, and list nothing). An existing directory is left as
    the operator made it. Raises ConfigError when it cannot be created."""
    path = os.path.abspath(path)
    mode = 0o711 if path == PACKAGED_STATE_DIR else 0o700
    if os.path.isdir(path):
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)   # its parents as any other directory
        os.mkdir(path, mode)
    except OSError as exc:
        if isinstance(exc, FileExistsError) and os.path.isdir(path):
            return   # made meanwhile
        raise ConfigError([f"state_dir: cannot create {path}: {exc.strerror or exc}"]) from None
    os.chmod(path, mode)   # the mode asked for, whatever the umask


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
            meaning = f.metadata.get('doc', '') + (" Reload: live." if f.metadata.get("live") else "")
            lines.append(f"| `{key}` | {_type_name(tp).replace('a ', '').replace('an ', '')} | {default} | {meaning} |")
            if dataclasses.is_dataclass(inner):
                walk(inner, key + ".")
            elif typing.get_origin(inner) is dict and dataclasses.is_dataclass(typing.get_args(inner)[1]):
                walk(typing.get_args(inner)[1], key + ".<name>.")

    walk(Config, "")
    return "\n".join(lines) + "\n\nReload: live keys are applied by `millwright reload` (SIGHUP); a change to any other " \
        "key is refused, naming it (docs/operations.md).\n"


# --------------------------------------------------------------------------- reload


def classify(cls: Any = None, prefix: str = "") -> dict[str, bool]:
    """Every key path -> live or not: a live field covers its whole subtree (a TLS section,
    a template); a section that is not live is classified field by field."""
    out: dict[str, bool] = {}
    for f in dataclasses.fields(cls or Config):
        if f.metadata.get("internal"):
            continue
        key = f"{prefix}{f.name}"
        live = bool(f.metadata.get("live"))
        out[key] = live
        inner = typing.get_type_hints(cls or Config)[f.name]
        if not live and dataclasses.is_dataclass(inner):
            out.update(classify(inner, key + "."))
    return out


def diff(old: Config, new: Config) -> tuple[list[str], list[str]]:
    """(live keys changed, restart-only keys changed) between two loaded configs."""
    live: list[str] = []
    restart: list[str] = []

    def walk(a: Any, b: Any, cls: Any, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("internal"):
                continue
            va, vb = getattr(a, f.name), getattr(b, f.name)
            if va == vb:
                continue
            key = f"{prefix}{f.name}"
            if f.metadata.get("live"):
                live.append(key)
            elif dataclasses.is_dataclass(hints[f.name]):
                walk(va, vb, hints[f.name], key + ".")
            else:
                restart.append(key)

    walk(old, new, Config, "")
    return live, restart


def apply_live(running: Config, new: Config) -> None:
    """Copy the live keys of ``new`` into the running config, in place: the parts hold the
    running Config and its sections (and the one templates dict), so they see the new
    values at their next use; a run already started keeps the spec it was staged with."""
    running.capacity = new.capacity
    running.labels.clear()
    running.labels.update(new.labels)
    running.templates.clear()
    running.templates.update(new.templates)
    running.etcd.tls, running.etcd.password = new.etcd.tls, new.etcd.password
    running.mqtt.tls, running.mqtt.password = new.mqtt.tls, new.mqtt.password
    sections: list[tuple[Any, Any]] = [(running.retention, new.retention), (running.quarantine, new.quarantine)]
    for old_s, new_s in sections:
        for f in dataclasses.fields(old_s):
            setattr(old_s, f.name, getattr(new_s, f.name))
