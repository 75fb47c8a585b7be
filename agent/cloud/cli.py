"""`millwright push FILE`, `millwright cancel ID`: bind, sign, publish (QoS 1), print the status;
`millwright get ID|--state …`: a signed jobs/get query, every page of the answers;
`millwright keygen`: a new ed25519 signing pair; `millwright broker acl`: the broker's
per-cluster ACL and settings (agent/cloud/broker.py).

Binding: the CLI adds ``cluster`` (from the config), ``kind`` and ``issued_at`` (``--issued-at``,
else now) when the document does not carry them, so what it signs is valid only in that
cluster and only for ``mqtt.max_age_s``. A push that stamped ``issued_at`` prints it: the same
document pushed again is a repeat only with the same ``issued_at`` (a conflict answer says
when that is all that differs).

Four-eyes approval: ``push --save OUT`` keeps the signed document it publishes; ``push OUT
--approve`` adds another key's approval to that file (a signature over the same bytes),
writes it back and publishes it: the job store merges the approvals into the stored job.

Exit codes: 0 accepted or waiting_approval (or cancelled), 1 rejected, 3 no answer within --timeout,
4 broker unreachable (or it did not acknowledge the publish), 2 usage errors only
(unreadable file, bad JSON, keys file, unknown kid).
The broker URL, TLS, credentials and the cluster come from the agent config (-c).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import time
from datetime import datetime, timezone
from typing import Optional

from agent.errors import UserError
from agent.jobs.states import JobState, RecordState

EXIT_ACCEPTED, EXIT_REJECTED, EXIT_USAGE, EXIT_NO_ANSWER, EXIT_BROKER = 0, 1, 2, 3, 4


def _config(args):
    from agent.cli import load_cli_config
    from agent.cloud.profile import require_fit
    from agent.configcheck import require_secure_mqtt

    cfg = load_cli_config(args)
    require_secure_mqtt(cfg)  # plain or anonymous MQTT only with mqtt.insecure: true
    require_fit(cfg)
    if cfg.mqtt.username is not None and cfg.mqtt.username == cfg.agent_id:
        # the broker makes a client's id its username: this connection would take over
        # (and, being a clean session, discard) the agent's own session
        raise UserError(f"{cfg.source}: mqtt.username is this agent's id ({cfg.agent_id}): push, cancel and get "
                        "connect as a cloud user; use a config with a cloud user's credentials")
    return cfg


def _keyring(path: str, kid: str):
    from agent.jobs.signing import KeyFileError, KeyRing

    try:
        ring = KeyRing.load(path, require_private=False)
    except KeyFileError as exc:
        raise UserError(exc.problems[0]) from None
    key = ring.get(kid)
    if key is None:
        raise UserError(f"--kid {kid}: not in {path} (keys: {', '.join(ring.kids) or 'none'})")
    if not key.can_sign:
        raise UserError(f"--kid {kid}: {path} has no private key material for it")
    return ring


def _sign(doc: dict, ring, kid: str) -> bytes:
    from agent.jobs.signing import SignatureError, sign

    try:
        signed = sign(doc, ring, kid)
        return json.dumps(signed, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except SignatureError as exc:
        raise UserError(f"cannot sign: {exc.detail}") from None
    except (TypeError, ValueError) as exc:
        raise UserError(f"cannot sign: the document has no canonical JSON form ({exc})") from None


def publish_and_wait(cfg, topic: str, payload: bytes, job_id, timeout: float, wait: bool = True,
                     states=(JobState.ACCEPTED, JobState.REJECTED, JobState.WAITING_APPROVAL)):
    """Publish one QoS 1 message and return the first status answering it (matched by the
    payload's sha256), or None on timeout."""
    from agent.cloud.ingest import push_digest
    from agent.cloud.mqtt import MqttLink
    from agent.cloud.topics import Topics

    topics = Topics(cfg.cluster)
    digest = push_digest(payload)
    got: "queue.Queue" = queue.Queue()
    link: Optional[MqttLink] = None

    def on_message(msg):
        if link is not None:  # set before the link starts delivering
            link.ack(msg)
        try:
            doc = json.loads(msg.payload)
        except ValueError:
            return
        if isinstance(doc, dict) and doc.get("push_sha256") == digest and doc.get("state") in states:
            got.put(doc)

    filters = ((topics.job_status_filter(job_id), 1), (topics.rejections_filter(), 1))
    link = MqttLink(cfg.mqtt, f"millwright-cli-{os.getpid()}-{int(time.time() * 1000) % 100000}",
                    clean_session=True, on_message=on_message,
                    subscriptions=filters if wait else (), topic_kind=topics.kind,
                    reconnect_min_s=0.2, reconnect_max_s=1.0)
    link.start()
    try:
        if not link.wait_connected(min(timeout, 10.0)):
            raise UserError(f"cannot connect to the broker at {cfg.mqtt.url}", EXIT_BROKER)
        time.sleep(0.05)  # let the SUBACK arrive before the push can be answered
        if not link.publish_wait(topic, payload, qos=1, timeout=min(timeout, 10.0)):
            raise UserError(f"the broker at {cfg.mqtt.url} did not acknowledge the publish", EXIT_BROKER)
        if not wait:
            return None
        try:
            return got.get(timeout=timeout)
        except queue.Empty:
            return None
    finally:
        link.stop()


def _report(doc, job_id, timeout: float) -> int:
    if doc is None:
        print(f"no status for {job_id or 'the document'} within {timeout:g}s (is an agent connected?)",
              file=sys.stderr)
        return EXIT_NO_ANSWER
    redelivery = " (repeat: already accepted)" if doc.get("redelivery") else ""
    if doc.get("published_by") and doc.get("published_by") != doc.get("agent"):
        redelivery += f" (published by {doc['published_by']})"
    if doc.get("state") in (JobState.ACCEPTED, RecordState.CANCELLED, JobState.WAITING_APPROVAL):
        print(f"{doc['state']} {doc.get('job_id')}{redelivery} by {doc.get('agent')} (shard {doc.get('shard')})"
              + (f": {doc['detail']}" if doc.get("state") == JobState.WAITING_APPROVAL and doc.get("detail") else ""))
        where = doc.get("placement")
        if isinstance(where, dict):
            if where.get("eligible"):
                print(f"target {json.dumps(where.get('target'), sort_keys=True)}: eligible {', '.join(where['eligible'])}")
            else:
                print(f"target {json.dumps(where.get('target'), sort_keys=True)}: waiting ({where.get('reason')}"
                      + (f": {where['detail']}" if where.get("detail") else "") + ")")
        return EXIT_ACCEPTED
    print(f"rejected {doc.get('job_id') or job_id or ''}: {doc.get('reason')}: {doc.get('detail') or ''}"
          .replace("  ", " ").rstrip(": "))
    return EXIT_REJECTED


def bind(doc: dict, cluster: str, kind: str, now=None) -> dict:
    """The document with ``cluster``, ``kind`` and ``issued_at`` set (kept when present and
    consistent). Raises UserError when the file names another cluster or kind."""
    out = dict(doc)
    for key, want in (("cluster", cluster), ("kind", kind)):
        if key in out and out[key] != want:
            raise UserError(f"{key}: the document says {out[key]!r}, but this is a {kind} for cluster {cluster!r}")
        out[key] = want
    if "issued_at" not in out:
        out["issued_at"] = (now or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return out


def with_target(doc: dict, agent: Optional[str], labels: Optional[list], fanout: bool) -> dict:
    """The document with the target the command line names (--target-agent, --target-label
    k=v, --fanout). Raises UserError on a bad or conflicting target."""
    from agent.coordination.placement import TargetError, check_target

    if not agent and not labels and not fanout:
        return doc
    if "target" in doc:
        raise UserError("target: the document already names a target; drop --target-*/--fanout or the key")
    target: dict = {}
    if agent:
        target["agent"] = agent
    if labels:
        sel = {}
        for item in labels:
            k, sep, v = item.partition("=")
            if not sep:
                raise UserError(f"--target-label {item!r}: expected KEY=VALUE")
            sel[k] = v
        target["labels"] = sel
    if fanout:
        target["fanout"] = True
    try:
        check_target(target)
    except TargetError as exc:
        raise UserError(f"{exc.field}: {exc.message}") from None
    return {**doc, "target": target}


def _approve(doc: dict, ring, kid: str, path: str) -> bytes:
    """``doc`` (a signed job document) with ``kid``'s approval added, written back to ``path``."""
    from agent.jobs.signing import SignatureError, approve

    if "sig" not in doc:
        raise UserError(f"{path}: not a signed document (push it first with --save, then approve that file)")
    try:
        payload = json.dumps(approve(doc, ring, kid), separators=(",", ":"), ensure_ascii=False,
                             allow_nan=False).encode()
    except SignatureError as exc:
        raise UserError(f"cannot approve: {exc.detail}") from None
    except (TypeError, ValueError) as exc:
        raise UserError(f"cannot approve: the document has no canonical JSON form ({exc})") from None
    if path != "-":
        _write(path, payload)
    return payload


def _write(path: str, payload: bytes) -> None:
    try:
        with open(path, "wb") as fh:
            fh.write(payload + b"\n")
    except OSError as exc:
        raise UserError(f"{path}: {exc.strerror or exc}") from None


def cli_push(args: argparse.Namespace) -> int:
    cfg = _config(args)
    ring = _keyring(args.key_file, args.kid)
    try:
        raw = sys.stdin.buffer.read() if args.file == "-" else open(args.file, "rb").read()
    except OSError as exc:
        raise UserError(f"{args.file}: {exc.strerror or exc}") from None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise UserError(f"{args.file}: not valid JSON ({str(exc)[:120]})") from None
    if not isinstance(doc, dict):
        raise UserError(f"{args.file}: a job document must be a JSON object")
    stamped = False
    if getattr(args, "approve", False):
        if getattr(args, "target_agent", None) or getattr(args, "target_label", None) or getattr(args, "fanout", False):
            raise UserError("--approve adds a signature to the document as it is: drop --target-*/--fanout")
        payload = _approve(doc, ring, args.kid, args.file)
    else:
        doc = with_target(doc, getattr(args, "target_agent", None), getattr(args, "target_label", None),
                          getattr(args, "fanout", False))
        doc = with_issued_at(doc, getattr(args, "issued_at", None))
        stamped = "issued_at" not in doc
        payload = _sign(bind(doc, cfg.cluster, "job"), ring, args.kid)
    if getattr(args, "save", None):
        _write(args.save, payload)
    from agent.cloud.ingest import peek_id
    from agent.cloud.topics import Topics

    job_id = peek_id(payload, len(payload))
    status = publish_and_wait(cfg, Topics(cfg.cluster).push, payload, job_id, args.timeout,
                              wait=not getattr(args, "no_wait", False))
    if getattr(args, "no_wait", False):
        print(f"published {job_id}")
        code = 0
    else:
        code = _report(status, job_id, args.timeout)
    if stamped:   # what a repeat of this very push needs (--issued-at), since the file lacks it
        print(f"issued_at {json.loads(payload)['issued_at']} (stamped by push: the file has none)")
    return code


def with_issued_at(doc: dict, issued_at: Optional[str]) -> dict:
    """The document with the command line's --issued-at (checked: RFC 3339, and the file's
    own issued_at, if any, is the same)."""
    if issued_at is None:
        return doc
    from agent.runtime.timefmt import parse_rfc3339

    try:
        parse_rfc3339(issued_at)
    except (ValueError, TypeError):
        raise UserError(f"--issued-at {issued_at!r}: not an RFC 3339 time (e.g. 2026-12-02T12:00:00Z)") from None
    if "issued_at" in doc and doc["issued_at"] != issued_at:
        raise UserError(f"--issued-at {issued_at}: the document says issued_at {doc['issued_at']!r}; drop one")
    return {**doc, "issued_at": issued_at}


def cli_cancel(args) -> int:
    cfg = _config(args)
    from agent.cloud.topics import ID_RE, Topics

    if not ID_RE.fullmatch(args.id) or args.id.startswith("."):
        raise UserError(f"{args.id!r} is not a job id ([A-Za-z0-9._-]{{1,128}}, not starting with '.')")
    ring = _keyring(args.key_file, args.kid)
    payload = _sign(bind({"v": 1, "id": args.id}, cfg.cluster, "cancel"), ring, args.kid)
    status = publish_and_wait(cfg, Topics(cfg.cluster).cancel, payload, args.id, args.timeout,
                              states=(RecordState.CANCELLED, JobState.REJECTED))
    return _report(status, args.id, args.timeout)


def cli_keygen(args) -> int:
    """Write a new ed25519 pair to --out (0600, never overwritten), print the agents' entry
    (and with --agent-keys append it to that keys file), then the guidance: after the
    entry, stdout flushed first, so it never lands before the YAML it describes."""
    from agent.jobs.keysfile import KeysFileError, add_public_entry, check_can_add
    from agent.jobs.signing import HAVE_ED25519, SignatureError, keygen_files

    if not HAVE_ED25519:
        raise UserError("ed25519 needs python3-cryptography (apt install python3-cryptography)")
    agent_keys = getattr(args, "agent_keys", None)
    try:
        if agent_keys:
            check_can_add(agent_keys, args.kid)   # refused before any key is made
        entry = keygen_files(args.kid, args.out)
    except KeysFileError as exc:
        raise UserError(str(exc)) from None
    except FileExistsError:
        raise UserError(f"{args.out}: exists; keygen never overwrites a key") from None
    except OSError as exc:
        raise UserError(f"{args.out}: {exc.strerror or exc}") from None
    except SignatureError as exc:
        raise UserError(f"--kid: {exc.detail}") from None
    sys.stdout.write(entry)
    sys.stdout.flush()
    created = False
    if agent_keys:
        try:
            created = add_public_entry(agent_keys, args.kid, entry)
        except KeysFileError as exc:
            raise UserError(f"{exc} (the private key is in {args.out}; add the entry above by hand)") from None
        except OSError as exc:
            raise UserError(f"{agent_keys}: {exc.strerror or exc} (the private key is in {args.out}; "
                            "add the entry above by hand)") from None
    print(f"# private key written to {args.out} (mode 0600): keep it with the signer (cloud), never on gateways",
          file=sys.stderr)
    if agent_keys:
        print(f"# the public entry above was {'written to new' if created else 'appended to'} {agent_keys}"
              f"{' (mode 0600)' if created else ''}: the keys file of every agent (signing.keys_file) needs it; "
              "an agent reads its keys file at start", file=sys.stderr)
    else:
        print("# add the entry above to every agent's signing.keys_file (public key only; a root-owned file, "
              "mode 0600), or make one with --agent-keys FILE; an agent reads its keys file at start",
              file=sys.stderr)
    return 0


def cli_get(args) -> int:
    """Exit 0 answered (found / every page), 1 not found or refused, 3 no (complete) answer in
    time, 4 broker unreachable, 2 usage."""
    from agent.cloud.asking import Asker
    from agent.cloud.topics import ID_RE

    cfg = _config(args)
    ring = _keyring(args.key_file, args.kid)
    include = [i for spec in (args.include or []) for i in spec.split(",") if i]
    bad_include = [i for i in include if i not in ("params", "stderr")]
    if bad_include:
        raise UserError(f"--include {bad_include[0]!r}: params or stderr")
    flt = {k: v for k, v in (("state", args.state), ("template", args.template),
                             ("updated_since", args.updated_since), ("limit", args.limit)) if v is not None}
    if args.id is not None:
        if flt:
            raise UserError("give a job id or a filter (--state, --template, --updated-since, --limit), not both")
        if not ID_RE.fullmatch(args.id) or args.id.startswith("."):
            raise UserError(f"{args.id!r} is not a job id ([A-Za-z0-9._-]{{1,128}}, not starting with '.')")
    asker = Asker(cfg.mqtt, cfg.cluster, ring, args.kid)
    try:
        if not asker.start(min(args.timeout, 10.0)):
            raise UserError(f"cannot connect to the broker at {cfg.mqtt.url}", EXIT_BROKER)
        try:
            if args.id is not None:
                return _print_one(asker.get(args.id, include, args.timeout), args)
            return _print_list(asker.list(flt, include, args.timeout), args)
        except OSError:
            raise UserError(f"the broker at {cfg.mqtt.url} did not acknowledge the request", EXIT_BROKER) from None
    finally:
        asker.stop()


def _print_one(ans: Optional[dict], args) -> int:
    if ans is None:
        print(f"no answer for {args.id} within {args.timeout:g}s (is the agent owning its shard connected?)",
              file=sys.stderr)
        return EXIT_NO_ANSWER
    if args.json:
        print(json.dumps(ans, indent=2, sort_keys=True))
    if "error" in ans:
        print(f"refused: {ans['error']}: {ans.get('detail', '')}", file=sys.stderr)
        return EXIT_REJECTED
    if not ans.get("found"):
        if not args.json:
            print(f"no job {args.id} (answered by {ans.get('agent')})")
        return EXIT_REJECTED
    if not args.json:
        job = ans["job"]
        if job.get("truncated") is True:   # a stub: the view could not fit the answer (agent/jobs/bounded.py)
            print(f"{job.get('id')}  shard {job.get('shard')}  its view is {job.get('bytes')} bytes: cut whole "
                  f"(answered by {ans.get('agent')})")
            return EXIT_ACCEPTED
        print(f"{job['id']}  shard {job['shard']}  {job.get('template')}  {job['state']}  next due "
              f"{job.get('next_due') or '-'}  (answered by {ans.get('agent')})")
        for r in job.get("runs") if isinstance(job.get("runs"), list) else []:
            if not isinstance(r, dict):
                continue
            print(f"  {r.get('fire_id')}  attempt {r.get('attempt')}  {r.get('state')}  {r.get('agent')}  "
                  f"exit {r.get('exit_code')}  {r.get('reason') or ''}".rstrip())
    return EXIT_ACCEPTED


def _print_list(got: dict, args) -> int:
    jobs = sorted(got["jobs"], key=lambda j: (j.get("shard", 0), str(j.get("id"))))
    if args.json:
        print(json.dumps({"jobs": jobs, "complete": got["complete"], "missing_shards": got["missing"],
                          "pages": len(got["pages"])}, indent=2, sort_keys=True))
    else:
        for j in jobs:
            print(f"{j.get('id')}  shard {j.get('shard')}  {j.get('template')}  {j.get('state', 'cut whole')}  next due "
                  f"{j.get('next_due') or '-'}")
        print(f"{len(jobs)} job(s) in {len(got['pages'])} page(s)")
    for e in got["errors"]:
        print(f"refused by {e.get('agent')}: {e['error']}: {e.get('detail', '')}", file=sys.stderr)
    if got["errors"]:
        return EXIT_REJECTED
    if not got["complete"]:
        print(f"incomplete after {args.timeout:g}s: no answer for shard(s) "
              f"{', '.join(map(str, got['missing'])) or 'unknown'}", file=sys.stderr)
        return EXIT_NO_ANSWER
    return EXIT_ACCEPTED
