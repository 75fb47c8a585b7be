"""`millwright audit verify` and `millwright audit show`.

Defaults come from the config (``-c``, ``$MILLWRIGHT_CONFIG`` or the packaged
``/etc/millwright/agent.yaml``: ``audit.dir``, ``audit.key_file``). A command given all it
needs (``audit show DIR``, ``audit verify DIR --key-file KEY``: a copied directory) reads
no config; one that needs a config and finds none says what it looked for, and never
falls back to the built-in system paths.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from agent.audit.keyfile import KeyFileError, load_key
from agent.audit.record import parse_time
from agent.audit.show import Filter, print_json, print_table, rows
from agent.audit.verify import verify
from agent.cli import load_cli_config
from agent.config import AuditConfig
from agent.errors import UserError


def _audit_config(args: argparse.Namespace, needs_key: bool) -> AuditConfig:
    """The audit section: the command line's DIR and --key-file where given, the config's
    for the rest (a config is read only when something is missing)."""
    key_file = getattr(args, "key_file", None)
    if args.dir and (key_file or not needs_key):
        return AuditConfig(dir=args.dir, key_file=key_file or "")
    audit = load_cli_config(args).audit
    return AuditConfig(dir=args.dir or audit.dir, key_file=key_file or audit.key_file)


def _directory(audit: AuditConfig) -> str:
    d = audit.dir
    if not os.path.exists(d):
        raise UserError(f"audit directory {d} does not exist")
    if not os.path.isdir(d):
        raise UserError(f"{d} is not a directory")
    if not os.access(d, os.R_OK | os.X_OK):
        raise UserError(f"cannot read audit directory {d}: permission denied (run as root)")
    return d


def cli_verify(args: argparse.Namespace) -> int:
    audit = _audit_config(args, needs_key=True)
    directory = _directory(audit)
    key_file = audit.key_file
    try:
        key = load_key(key_file, create=False)
    except KeyFileError as exc:
        raise UserError(str(exc)) from None
    t0 = time.monotonic()
    try:
        report = verify(directory, key)
    except PermissionError as exc:
        raise UserError(f"cannot read {exc.filename}: permission denied (run as root)") from None
    elapsed = time.monotonic() - t0
    for note in report.notes:
        print(f"note: {note}")
    if report.problem is not None:
        print(f"FAILED: {os.path.join(directory, str(report.problem))}")
        print(f"verified before the failure: {report.summary()}", file=sys.stderr)
        return 1
    if report.records == 0 and not report.retired:
        raise UserError(f"no audit records in {directory}")
    print(f"ok: {report.summary()}; {elapsed:.2f}s")
    return 0


def cli_show(args: argparse.Namespace) -> int:
    directory = _directory(_audit_config(args, needs_key=False))
    types = None
    if args.type:
        types = {t.strip() for spec in args.type for t in spec.split(",") if t.strip()}
    try:
        since = parse_time(args.since) if args.since else None
        until = parse_time(args.until) if args.until else None
    except ValueError as exc:
        raise UserError(f"--since/--until: {exc}") from None
    flt = Filter(types=types, job=args.job, since=since, until=until)
    listed = rows(directory, flt)
    if args.json:
        print_json(listed, sys.stdout)
    else:
        n = print_table(listed, sys.stdout)
        if n == 0:
            print("(no matching records)", file=sys.stderr)
    sys.stdout.flush()
    return 0
