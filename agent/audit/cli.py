"""`millwright audit verify` and `millwright audit show`.

Defaults come from the config (``audit.dir``, ``audit.key_file``); a missing default
config file (``/etc/millwright/agent.yaml``) is not an error, so an auditor can verify a
copied directory with ``millwright audit verify DIR --key-file KEY``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from agent.audit.keyfile import KeyFileError, load_key
from agent.audit.record import parse_time
from agent.audit.show import Filter, print_json, print_table, records
from agent.audit.verify import verify
from agent.cli import DEFAULT_CONFIG, UserError
from agent.config import Config, load_config


def _config(args: argparse.Namespace) -> Config:
    path = getattr(args, "config", None)
    if path is None or (path == DEFAULT_CONFIG and not os.path.exists(path)):
        return Config()
    return load_config(path)


def _directory(args: argparse.Namespace, cfg: Config) -> str:
    d = args.dir or cfg.audit.dir
    if not os.path.exists(d):
        raise UserError(f"audit directory {d} does not exist")
    if not os.path.isdir(d):
        raise UserError(f"{d} is not a directory")
    if not os.access(d, os.R_OK | os.X_OK):
        raise UserError(f"cannot read audit directory {d}: permission denied (run as root)")
    return d


def cli_verify(args: argparse.Namespace) -> int:
    cfg = _config(args)
    directory = _directory(args, cfg)
    key_file = args.key_file or cfg.audit.key_file
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
    cfg = _config(args)
    directory = _directory(args, cfg)
    types = None
    if args.type:
        types = {t.strip() for spec in args.type for t in spec.split(",") if t.strip()}
    try:
        since = parse_time(args.since) if args.since else None
        until = parse_time(args.until) if args.until else None
    except ValueError as exc:
        raise UserError(f"--since/--until: {exc}") from None
    flt = Filter(types=types, job=args.job, since=since, until=until)
    rows = records(directory, flt)
    if args.json:
        print_json(rows, sys.stdout)
    else:
        n = print_table(rows, sys.stdout)
        if n == 0:
            print("(no matching records)", file=sys.stderr)
    sys.stdout.flush()
    return 0
