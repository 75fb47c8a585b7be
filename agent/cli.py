"""The `millwright` command line.

Every subcommand's work lives in the module that owns the concept; this file only
declares the arguments and maps user errors to one clear line on stderr and a non-zero
exit code. Target modules are imported lazily so that `millwright --version` or
`config check` never pay for BCC or gRPC.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import TYPE_CHECKING, Callable, Optional

from agent import __version__
from agent.config import CONFIG_ENV, DEFAULT_CONFIG, config_path  # config_path: agent.cli re-exports it
from agent.errors import UserError  # noqa: F401 - re-exported: every command raises it

if TYPE_CHECKING:
    from agent.config import Config

def load_cli_config(args: argparse.Namespace) -> Config:
    """The config of :func:`config_path`, loaded and validated (ConfigError on a bad one)."""
    from agent.config import load_config

    return load_config(config_path(getattr(args, "config", None)))


def _target(spec: str) -> Callable[[argparse.Namespace], int]:
    module, _, func = spec.partition(":")
    return getattr(importlib.import_module(module), func)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="millwright", description="Millwright edge agent for factory maintenance jobs.")
    p.add_argument("--version", action="version", version=f"millwright {__version__} (contract v1)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def cmd(name: str, target: str, help: str, parent=sub) -> argparse.ArgumentParser:
        sp = parent.add_parser(name, help=help, description=help)
        sp.set_defaults(func=target)
        return sp

    def with_config(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("-c", "--config", default=None,
                        help=f"agent config (default: ${CONFIG_ENV}, else {DEFAULT_CONFIG})")

    sp = cmd("run", "agent.daemon.core:cli_run", "run the agent in the foreground")
    with_config(sp)

    sp = cmd("demo", "agent.demo.scenario:cli_demo", "start etcd, mosquitto and 3 agents locally and show the product at work")
    sp.add_argument("--duration", type=float, default=None,
                    help="seconds of the job phase (default 45, at least 24; the whole demo takes ~20 s more)")
    sp.add_argument("--keep", action="store_true", help="keep the temporary directory for inspection")

    sp = cmd("status", "agent.daemon.admin:cli_status", "show shards, due jobs and running runs of the local agent")
    with_config(sp)
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.add_argument("--socket", help="admin socket (default: admin.socket from the config)")

    sp = cmd("reload", "agent.daemon.admin:cli_reload",
             "re-read the config and the keys file in the running agent; exit 2 when refused (one line per "
             "problem), 3 when the agent predates reload")
    with_config(sp)
    sp.add_argument("--socket", help="admin socket (default: admin.socket from the config)")
    sp.add_argument("--wait", action="store_true", help="wait up to a minute for the agent's answer (systemd)")

    sp = cmd("push", "agent.cloud.cli:cli_push", "sign and publish a job document, print its status")
    with_config(sp)
    sp.add_argument("file", help="job document (JSON); - for stdin")
    sp.add_argument("--key-file", required=True, help="keys file with the signing key")
    sp.add_argument("--kid", required=True, help="key id to sign with")
    sp.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the accepted/rejected status")
    sp.add_argument("--no-wait", action="store_true", help="publish without waiting for the status")
    sp.add_argument("--issued-at", metavar="RFC3339",
                    help="the document's issued_at when the file has none (default: now; push prints it)")
    sp.add_argument("--target-agent", metavar="ID", help="run only on this agent (adds target.agent)")
    sp.add_argument("--target-label", metavar="KEY=VALUE", action="append",
                    help="run on an agent with this label (repeatable: all must match; adds target.labels)")
    sp.add_argument("--fanout", action="store_true", help="with --target-label: run once on every matching agent")
    sp.add_argument("--save", metavar="OUT", help="also write the signed document that is published to OUT "
                                                  "(what approvers add their signatures to)")
    sp.add_argument("--approve", action="store_true",
                    help="FILE is a signed document: add this key's approval to it, write it back and publish it")

    sp = cmd("cancel", "agent.cloud.cli:cli_cancel", "sign and publish a cancel for a job id")
    with_config(sp)
    sp.add_argument("id", help="job id")
    sp.add_argument("--key-file", required=True)
    sp.add_argument("--kid", required=True)
    sp.add_argument("--timeout", type=float, default=10.0)

    sp = cmd("get", "agent.cloud.cli:cli_get",
             "ask the agents about a job, or every page of a filter, with a signed jobs/get query over MQTT")
    with_config(sp)
    sp.add_argument("id", nargs="?", help="job id (without it: every job matching the filter)")
    sp.add_argument("--state", help="only jobs in this state")
    sp.add_argument("--template", help="only jobs of this template")
    sp.add_argument("--updated-since", help="only jobs changed since this RFC 3339 time")
    sp.add_argument("--limit", type=int, help="jobs per page (1-1000)")
    sp.add_argument("--include", action="append", metavar="params,stderr",
                    help="also show the jobs' params and their runs' stderr tails")
    sp.add_argument("--key-file", required=True, help="keys file with the signing key")
    sp.add_argument("--kid", required=True, help="key id to sign with")
    sp.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the answer (every page)")
    sp.add_argument("--json", action="store_true", help="machine-readable output")

    broker = sub.add_parser("broker", help="the broker's ACL and settings for a cluster (mosquitto)")
    brsub = broker.add_subparsers(dest="broker_command", metavar="SUBCOMMAND")
    sp = cmd("acl", "agent.cloud.broker:cli_broker_acl",
             "print a cluster's mosquitto ACL: one user block per agent and per cloud user", brsub)
    sp.add_argument("--cluster", required=True)
    sp.add_argument("--agent", action="append", metavar="ID[=USERNAME]",
                    help="an agent and its broker username (default: the agent id); repeatable")
    sp.add_argument("--cloud-user", action="append", metavar="NAME",
                    help="a cloud-side client's username (push, cancel, get); repeatable, one per client")
    sp.add_argument("--gate-topic", action="append", metavar="TOPIC",
                    help="a production gate's MQTT topic the agents read (templates.<t>.gates.<g>.mqtt); repeatable")
    sp = cmd("settings", "agent.cloud.broker:cli_broker_settings",
             "print the listener settings the ACL relies on (client id = username, message size limit)", brsub)
    with_config(sp)
    sp.add_argument("--max-payload-bytes", type=int, help="default: mqtt.max_payload_bytes of the config")

    sp = cmd("keygen", "agent.cloud.cli:cli_keygen",
             "write a new ed25519 signing key pair (private file 0600) and print the agents' keys-file entry")
    sp.add_argument("--kid", required=True, help="key id ([A-Za-z0-9._-]{1,128})")
    sp.add_argument("--out", required=True, help="private keys file to create (never overwritten)")
    sp.add_argument("--agent-keys", metavar="FILE",
                    help="also append the public entry to this agents' keys file (signing.keys_file; "
                         "created with mode 0600 when missing)")

    jobs = sub.add_parser("jobs", help="list jobs or show one, read from etcd")
    jsub = jobs.add_subparsers(dest="jobs_command", metavar="SUBCOMMAND")
    sp = cmd("list", "agent.jobs.cli:cli_jobs_list", "list the cluster's jobs with state and next due time", jsub)
    with_config(sp)
    sp.add_argument("--state", help="only jobs in this state (scheduled, running, succeeded, failed, cancelled, ...)")
    sp.add_argument("--template", help="only jobs of this template")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp = cmd("show", "agent.jobs.cli:cli_jobs_show", "show one job: document, state, next due, last runs", jsub)
    with_config(sp)
    sp.add_argument("id", help="job id")
    sp.add_argument("--json", action="store_true", help="machine-readable output")

    sp = cmd("runs", "agent.jobs.cli:cli_runs", "list a job's run records, read from etcd")
    with_config(sp)
    sp.add_argument("id", help="job id")
    sp.add_argument("--json", action="store_true", help="machine-readable output")

    sp = cmd("logs", "agent.jobs.cli:cli_logs", "print a run's stdout and stderr (from this agent's disk)")
    with_config(sp)
    sp.add_argument("run", help="JOB_ID/FIRE_ID, or JOB_ID for its latest run")
    sp.add_argument("-f", "--follow", action="store_true", help="keep printing until the run ends")
    sp.add_argument("--json", action="store_true", help="one JSON document (with -f: one JSON line per chunk)")

    audit = sub.add_parser("audit", help="verify or read the audit log")
    asub = audit.add_subparsers(dest="audit_command", metavar="SUBCOMMAND")
    sp = cmd("verify", "agent.audit:cli_verify", "verify the hash chain, MACs and checkpoints", asub)
    with_config(sp)
    sp.add_argument("dir", nargs="?", help="audit directory (default: audit.dir from the config)")
    sp.add_argument("--key-file", help="audit key file (default: audit.key_file from the config)")
    sp = cmd("show", "agent.audit:cli_show", "print audit records, filtered", asub)
    with_config(sp)
    sp.add_argument("dir", nargs="?", help="audit directory (default: audit.dir from the config)")
    sp.add_argument("--type", action="append", help="record type (repeatable)")
    sp.add_argument("--job", help="job id")
    sp.add_argument("--since", help="RFC3339 time or a duration like 10m, 2h")
    sp.add_argument("--until", help="RFC3339 time")
    sp.add_argument("--json", action="store_true", help="raw JSON lines")

    bpf = sub.add_parser("bpf", help="kernel sensor tools")
    bsub = bpf.add_subparsers(dest="bpf_command", metavar="SUBCOMMAND")
    sp = cmd("check", "agent.signals.check:cli_check", "check what the BCC sensor needs on this machine", bsub)
    sp.add_argument("--headers-dir", help="kernel headers directory to check (default /lib/modules/$(uname -r))")
    sp.add_argument("--tracefs", help="tracefs mount to check (default /sys/kernel/tracing)")
    sp.add_argument("--json", action="store_true")

    cfg = sub.add_parser("config", help="configuration tools")
    csub = cfg.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    sp = cmd("check", "agent.cli:cli_config_check", "validate a config file; one line per problem, exit 2", csub)
    sp.add_argument("file", nargs="?", default=None, help=f"default: ${CONFIG_ENV}, else {DEFAULT_CONFIG}")
    sp = cmd("reference", "agent.cli:cli_config_reference", "print the configuration reference (Markdown)", csub)
    return p


def cli_config_check(args: argparse.Namespace) -> int:
    from agent.cloud.profile import check_profile
    from agent.config import load_config
    from agent.configcheck import advisory_rollouts, ignored_peers_keys, unknown_users

    path = config_path(args.file)
    cfg = load_config(path, broker=True, broker_checks=(check_profile,))  # every problem in one report
    print(f"{path}: ok (cluster {cfg.cluster}, agent {cfg.agent_id}, {cfg.shards} shards, "
          f"{len(cfg.templates)} templates)")
    for line in ignored_peers_keys(cfg) + unknown_users(cfg) + advisory_rollouts(cfg):
        print(f"warning: {line}")
    for line in _hiding_lines(cfg):
        print(line)
    for line in _backend_lines(cfg):
        print(line)
    return 0


def _hiding_lines(cfg) -> list[str]:
    """What job isolation cannot hide from root runs as this config places the agent's
    secrets (agent/execute/hiding.py): a refusal stops a root agent's start."""
    from agent.execute import hiding

    p = hiding.plan(cfg)
    return [f"error (a root agent will not start): {line}" for line in p.refused] + \
        [f"warning: {line}" for line in p.problems]


def _backend_lines(cfg) -> list[str]:
    """What the runtime would choose here (quota backend, BPF); best effort."""
    lines = []
    try:
        from agent.execute.backends import describe_backend

        lines.append("quota backend: " + describe_backend(cfg.execute.quota_backend))
    except ImportError:
        pass
    except Exception as exc:  # probing must never fail a config check
        lines.append(f"quota backend: unknown ({exc})")
    return lines


def cli_config_reference(args: argparse.Namespace) -> int:
    from agent.config import reference_markdown

    sys.stdout.write(reference_markdown())
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    target = getattr(args, "func", None)
    if target is None:
        parser.print_help(sys.stderr)
        return 2
    from agent.config import ConfigError

    try:
        return int(_target(target)(args) or 0)
    except ConfigError as exc:
        for line in exc.problems:
            print(f"millwright: config: {line}", file=sys.stderr)
        return 2
    except UserError as exc:
        print(f"millwright: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
