"""What a loaded configuration may not be: every rule a value must keep (named with its key
and file, all at once), the trust rules (plaintext or unauthenticated etcd and MQTT refused
unless ``insecure``; who may read or write the file), and template checks (users, params'
regexes, capabilities). agent/config.py defines the sections and calls ``validate``."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from agent.brokerlimits import PROTOCOLS, resolve
from agent.config import (
    FENCE_KILL_MARGIN_S,
    ID_RE,
    NAME_RE,
    RUN_PLACEHOLDERS,
    Config,
    ConfigError,
    EtcdConfig,
    Template,
)
from agent.jobs.paramregex import regex_risk


def mqtt_insecurities(cfg: "Config") -> list[str]:
    """What would let others on the network read or forge this agent's broker traffic: a
    config problem (file, key, what, the fix) for plain MQTT without TLS and for a
    connection without credentials, unless ``mqtt.insecure: true``. Checked where the
    broker is used (the agent's cloud channel, the MQTT commands, ``config check``), not by
    every reader of a config."""
    m = cfg.mqtt
    if m.insecure:
        return []
    fix = ": set that up, or set mqtt.insecure: true to allow it (labs and tests only)"
    out = []
    if (m.url or "").startswith("mqtt://") and m.tls is None:
        out.append(f"{cfg.source}: mqtt.url: {m.url!r} is plain MQTT without TLS (use mqtts:// with mqtt.tls)"
                   + fix)
    if m.username is None and (m.tls is None or m.tls.cert is None):
        out.append(f"{cfg.source}: mqtt.username: no broker credentials (mqtt.username and mqtt.password, or a "
                   "client certificate in mqtt.tls.cert and mqtt.tls.key)" + fix)
    return out


def require_secure_mqtt(cfg: "Config") -> None:
    """Raise ConfigError naming each problem of :func:`mqtt_insecurities`."""
    problems = mqtt_insecurities(cfg)
    if problems:
        raise ConfigError(problems)


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


INSECURE_HINT = "set {section}.insecure: true (tests and labs only)"


def _validate_etcd_access(e: EtcdConfig, bad: Any) -> None:
    """etcd decides what every agent of the cluster runs: it is reached over TLS and as an
    authenticated user (password or client certificate) unless ``etcd.insecure`` says
    otherwise, explicitly."""
    if (e.username is None) != (e.password is None):
        bad("etcd.username" if e.username is None else "etcd.password", "username and password go together")
    tls = e.tls
    if tls is not None and (tls.cert is None) != (tls.key is None):
        bad("etcd.tls.cert" if tls.cert is None else "etcd.tls.key", "cert and key go together")
    hint = INSECURE_HINT.format(section="etcd")
    for i, url in enumerate(e.endpoints):
        if not isinstance(url, str):
            continue
        if url.startswith("https://") and (tls is None or not tls.ca):
            bad(f"etcd.endpoints[{i}]", f"{url!r} needs etcd.tls.ca (the CA that signed the etcd server's "
                                        "certificate)")
        elif url.startswith("http://") and not e.insecure:
            bad(f"etcd.endpoints[{i}]", f"{url!r} is plaintext: use https:// with etcd.tls, or {hint}")
    has_cert = tls is not None and tls.cert is not None and tls.key is not None
    if e.username is None and not has_cert and not e.insecure:
        bad("etcd.username", "etcd without credentials is refused: set etcd.username and etcd.password (or a "
                             f"client certificate in etcd.tls.cert and etcd.tls.key), or {hint}")


def validate(cfg: Config, problems: list[str]) -> None:
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
    _validate_etcd_access(e, bad)
    m = cfg.mqtt
    if not re.match(r"^mqtts?://[^/:]+(:\d{1,5})?/?$", m.url or ""):
        bad("mqtt.url", f"{m.url!r} is not mqtt://host:port or mqtts://host:port")
    if m.protocol not in PROTOCOLS:
        bad("mqtt.protocol", f"{m.protocol!r} must be " + " or ".join(f'"{p}"' for p in PROTOCOLS))
    if not 1 <= m.session_expiry_s <= 0xFFFFFFFE:
        bad("mqtt.session_expiry_s", "must be between 1 and 4294967294 seconds (MQTT 5's largest finite expiry)")
    for line in resolve(m)[1]:   # an unknown profile or limit, a limit of the wrong type
        problems.append(f"{src}: {line}")
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
    if m.get_max_age_s <= 0:
        bad("mqtt.get_max_age_s", "must be greater than 0")
    if not 4096 <= m.get_page_bytes <= max(4096, m.max_payload_bytes):
        bad("mqtt.get_page_bytes", f"must be between 4096 and mqtt.max_payload_bytes ({m.max_payload_bytes}): the "
                                   "broker's message_size_limit refuses larger messages")
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
    for name, count in (("jobs", cfg.quotas.jobs), ("stored_mb", cfg.quotas.stored_mb)):
        if count < 1:
            bad(f"quotas.{name}", "must be at least 1")
    ret = cfg.retention
    if ret.keep_runs < 1:
        bad("retention.keep_runs", "must be at least 1 (the newest record is needed for misfire recovery)")
    for name, seconds in (("finished_job_s", ret.finished_job_s), ("tombstone_s", ret.tombstone_s),
                          ("run_output_s", ret.run_output_s), ("interval_s", ret.interval_s),
                          ("disk_interval_s", ret.disk_interval_s), ("compact_interval_s", ret.compact_interval_s)):
        if seconds < 0:
            bad(f"retention.{name}", "must not be negative")
    if ret.max_deletes_per_s <= 0:
        bad("retention.max_deletes_per_s", "must be positive")
    if ret.run_output_max_mb < 1:
        bad("retention.run_output_max_mb", "must be at least 1")
    qc = cfg.quarantine
    if qc.strikes < 1:
        bad("quarantine.strikes", "must be at least 1")
    if qc.max_jobs < 1:
        bad("quarantine.max_jobs", "must be at least 1")
    for name, seconds in (("window_s", qc.window_s), ("hold_s", qc.hold_s), ("max_hold_s", qc.max_hold_s)):
        if seconds <= 0:
            bad(f"quarantine.{name}", "must be positive")
    if qc.max_hold_s < qc.hold_s:
        bad("quarantine.max_hold_s", "must be at least quarantine.hold_s")
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
        elif is_root_user(t.user) and not t.allow_root:
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
        _validate_approvals_and_rollback(cfg, name, t, bad)
        _validate_gates(t, where, bad)


def _validate_gates(t: Template, where: str, bad: Any) -> None:
    """A template's production gates: each exactly one of mqtt, etcd or command."""
    if t.gate_timeout_s is not None and not 0 < t.gate_timeout_s <= 7 * 86400:
        bad(f"{where}.gate_timeout_s", "must be greater than 0 and at most 604800 (7 days)")
    if t.while_running not in ("finish", "stop"):
        bad(f"{where}.while_running", "must be finish or stop")
    for name, g in t.gates.items():
        given = (("mqtt", g.mqtt), ("etcd", g.etcd), ("command", g.command)) if g else ()
        at, kinds = f"{where}.gates.{name}", [k for k, v in given if v]
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


def _validate_approvals_and_rollback(cfg: Config, name: str, t: Template, bad: Any) -> None:
    """A template's four-eyes rule (1..16 distinct roles) and its rollback template."""
    where, rule, rb = f"templates.{name}", t.approvals, t.rollback
    if rule is not None:
        roles = [r for r in rule.roles if isinstance(r, str) and re.match(r"^[A-Za-z0-9._-]{1,64}$", r)]
        if len(roles) != len(rule.roles) or len(set(roles)) != len(roles) or len(roles) > 16:
            bad(f"{where}.approvals.roles", "must be at most 16 distinct role names ([A-Za-z0-9._-]{1,64})")
        if not 1 <= rule.required <= max(1, len(set(roles))):
            bad(f"{where}.approvals.required", f"must be between 1 and the number of roles ({len(set(roles))}): "
                "each counted signature is by a key of another role")
    other = cfg.templates.get(rb) if rb is not None else None
    if rb is not None and (rb == name or other is None):
        bad(f"{where}.rollback", f"{rb!r} is not another template here")
    elif other is not None and sorted(other.params) != sorted(t.params):
        bad(f"{where}.rollback", f"template {rb} takes params {sorted(other.params)}, this one {sorted(t.params)}: "
            "a rollback runs with the job's own params")


def is_root_user(name: str) -> bool:
    """The user resolves to uid 0 here (a name that does not exist on this host is checked
    again when a run starts)."""
    if name in ("root", "0"):
        return True
    import pwd

    try:
        return pwd.getpwnam(name).pw_uid == 0
    except KeyError:
        return False


def ignored_peers_keys(cfg: Config) -> list[str]:
    """``mqtt.peers_username``/``mqtt.peers_password``, set by a config written for an older
    agent: ignored (one connection per agent, which reads no other agent's statuses), not an
    error, so that config still loads; said by ``config check`` and the agent's log."""
    return [f"{cfg.source}: {key}: ignored: agents no longer read each other's statuses, so there is no peers "
            "connection (one connection per agent; docs/cloud.md); remove it, and the peers user from the broker"
            for key, value in (("mqtt.peers_username", cfg.mqtt.peers_username),
                               ("mqtt.peers_password", cfg.mqtt.peers_password)) if value is not None]


def advisory_rollouts(cfg: Config) -> list[str]:
    """Where staged rollouts' limits (max_concurrent, per_minute, the abort) are advisory:
    they hold against another gateway's credentials only when etcd gives each agent its own
    user that may write no other agent's rollout keys (etcd-rbac.sh). Not an error: a lab
    runs without that. ``etcd.insecure``: no such users; a password user named otherwise
    than ``agent.<cluster>.<agent_id>``: not the user etcd-rbac.sh confines to this agent's
    ``rollouts/<agent_id>/``, so the operator's own roles must do that."""
    e = cfg.etcd
    why = None
    if e.insecure and e.username is None:
        why = "etcd.insecure: without an etcd user per agent"
    elif e.username is not None and e.username != f"agent.{cfg.cluster}.{cfg.agent_id}":
        why = (f"etcd.username: {e.username!r} is not agent.{cfg.cluster}.{cfg.agent_id}, the user etcd-rbac.sh "
               f"confines to this agent's rollout keys; unless your etcd roles let it write only "
               f"/millwright/{cfg.cluster}/rollouts/{cfg.agent_id}/ there,")
    if why is None:
        return []
    return [f"{cfg.source}: {why} any gateway's etcd credentials can delete or forge other agents' rollout keys: "
            "staged rollouts' max_concurrent, per_minute and abort are advisory (docs/security.md#rollouts-and-approvals)"]


def unknown_users(cfg: Config) -> list[str]:
    """Templates whose ``user`` does not exist on this host: not a config error (a config
    may be checked where it does not run), but every run of such a template would fail
    with spawn_error here. A run takes the user's name and groups; its uid is its own."""
    import pwd

    out = []
    for name, t in sorted(cfg.templates.items()):
        try:
            pwd.getpwnam(t.user)
        except KeyError:
            out.append(f"templates.{name}.user: no user {t.user!r} on this host: its runs would fail here "
                       f"(spawn_error); the package creates millwright-jobs, the default; elsewhere name an "
                       f"existing user (e.g. nobody) or create it")
    return out


def credential_keys(cfg: Config) -> list[str]:
    """The keys of ``cfg`` that hold a secret (passwords; TLS key paths are not secrets)."""
    return [k for k, v in (("etcd.password", cfg.etcd.password), ("mqtt.password", cfg.mqtt.password),
                           ("mqtt.peers_password", cfg.mqtt.peers_password))
            if v is not None]


def file_mode_problems(cfg: Config, mode: int) -> list[str]:
    """What the permission bits of the file ``cfg`` came from allow that they must not.
    Whoever can write the file chooses the templates, so what the agent runs: never
    writable by group or others. Whoever can read it holding a password can act as this
    agent in etcd or on the broker: owner-only then, like the keys file."""
    src = cfg.source
    out = []
    if mode & 0o022:
        out.append(f"{src}: mode {mode:04o} lets group or others write it, and it decides what jobs run "
                   f"(run: chmod 600 {src})")
    secrets = credential_keys(cfg)
    if secrets and mode & 0o077 and not mode & 0o022:
        out.append(f"{src}: mode {mode:04o} lets group or others read it, and it holds credentials "
                   f"({', '.join(secrets)}); it must be owner-only (run: chmod 600 {src})")
    return out
