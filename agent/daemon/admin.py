"""Local admin endpoint: a root-only Unix socket that answers `millwright status` and
`millwright reload`.

A client sends one request line (``{"op": "status"}`` or ``{"op": "reload"}``) and shuts
its side; a client that sends nothing (an older CLI) gets the status. The server thread
asks the loop (which owns the state) and writes the answer back as one JSON document.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional

from agent.config import config_path, load_config
from agent.errors import UserError

if TYPE_CHECKING:
    from agent.runtime.loop import EventLoop

log = logging.getLogger(__name__)

REQUEST_WAIT_S = 0.5    # how long the server waits for a request line before it answers status
RELOAD_WAIT_S = 60.0    # a reload reads the files on a thread and applies on the loop: seconds at most
Reload = Callable[[Optional[Callable[[dict], None]]], None]


def bind_private(path: str) -> socket.socket:
    """A Unix socket bound at ``path`` with mode 0600 from the moment the path exists: bound
    under a temporary name, chmod'ed, then renamed into place (a connect follows the inode).
    The process umask is never touched: other threads create files meanwhile (run
    directories), and umask is process-wide."""
    tmp = f"{path}.{os.getpid()}.tmp"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        s.bind(tmp)
        os.chmod(tmp, 0o600)
        os.rename(tmp, path)
    except OSError:
        s.close()
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return s


class AdminServer:
    """Answers each connection with ``status()``, taken on the loop thread (which owns the state)."""

    def __init__(self, path: str, loop: EventLoop, status: Callable[[], dict], reload: Optional[Reload] = None):
        self.path = path
        self.loop = loop
        self.status = status
        self.reload = reload
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            os.makedirs(os.path.dirname(self.path), mode=0o750, exist_ok=True)
            if os.path.exists(self.path):
                os.unlink(self.path)
            s = bind_private(self.path)
            s.listen(8)
        except OSError as exc:
            log.warning("admin socket unavailable; `millwright status` will not work",
                        extra={"fields": {"path": self.path, "error": exc.strerror or str(exc)}})
            return
        self._sock = s
        self._thread = threading.Thread(target=self._serve, name="admin", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                op = _request(conn)
                if op == "reload":
                    payload = self._reload()
                else:
                    payload = self._status()
                try:
                    conn.sendall(payload)
                except OSError:
                    pass

    def _status(self) -> bytes:
        done = threading.Event()
        box: dict = {}

        def snap() -> None:
            # bound now: a snapshot arriving after its request timed out must not answer the next one
            box["doc"] = self.status()
            done.set()

        self.loop.post(snap)
        if done.wait(3):
            return json.dumps(box["doc"], default=str).encode()
        return json.dumps({"error": "agent loop did not answer within 3 s"}).encode()

    def _reload(self) -> bytes:
        if self.reload is None:
            return json.dumps({"error": "this agent has no reload"}).encode()
        done = threading.Event()
        box: dict = {}

        def answer(doc: dict) -> None:
            box["doc"] = doc
            done.set()

        self.loop.post(self.reload, answer)
        if done.wait(RELOAD_WAIT_S):
            return json.dumps({"reload": box["doc"]}).encode()
        return json.dumps({"error": f"the reload did not finish within {RELOAD_WAIT_S:g} s"}).encode()

    def stop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass


def _request(conn: socket.socket) -> str:
    """The op a client asked for: its first line, or "status" when it sent none."""
    conn.settimeout(REQUEST_WAIT_S)
    data = b""
    try:
        while b"\n" not in data and len(data) < 4096:
            b = conn.recv(4096)
            if not b:
                break
            data += b
    except OSError:
        pass
    conn.settimeout(3)
    try:
        op = json.loads(data.split(b"\n")[0] or b"{}").get("op")
    except (ValueError, AttributeError):
        op = None
    return op if isinstance(op, str) else "status"


def query(path: str, timeout: float = 5.0, op: str = "status") -> dict:
    """Ask the agent at ``path``. An agent older than the request line answers status without
    reading it, and its close may then reset the connection: what it sent is used, and a
    status asked again without a request line."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    chunks: list[bytes] = []
    try:
        s.connect(path)
        s.sendall(json.dumps({"op": op}).encode() + b"\n")
        s.shutdown(socket.SHUT_WR)
        while True:
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
    except ConnectionResetError:
        if not chunks:
            return {} if op != "status" else _query_plain(path, timeout)
    except FileNotFoundError:
        raise UserError(f"no agent admin socket at {path} (is the agent running?)", 1) from None
    except PermissionError:
        raise UserError(f"{path}: permission denied (the admin socket is root-only)", 1) from None
    except OSError as exc:
        raise UserError(f"{path}: {exc.strerror or exc}", 1) from None
    finally:
        s.close()
    try:
        return json.loads(b"".join(chunks))
    except ValueError:   # cut short by the reset
        return {} if op != "status" else _query_plain(path, timeout)


def _query_plain(path: str, timeout: float) -> dict:
    """The status of an agent that predates the request line: connect and read."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    chunks = []
    try:
        s.connect(path)
        while True:
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
    except OSError as exc:
        raise UserError(f"{path}: {exc.strerror or exc}", 1) from None
    finally:
        s.close()
    return json.loads(b"".join(chunks))


def render(doc: dict) -> str:
    """A human table of the status document."""
    if "error" in doc and len(doc) == 1:
        return f"error: {doc['error']}"
    sess = doc.get("session", {})
    sh = doc.get("shards", {})
    lines = [
        f"agent     {doc.get('agent')}  cluster {doc.get('cluster')}  version {doc.get('version')}  up {doc.get('uptime_s')}s",
        f"session   lease {sess.get('lease') or '-'}  valid {sess.get('valid')}  "
        f"fenced {sess.get('fenced') or 'no'}  etcd {sess.get('endpoint')}",
        f"members   {', '.join(sorted(doc.get('members', {}))) or '-'}",
        f"shards    {sh.get('count', 0)}/{sh.get('total', '?')} owned{'  (draining)' if sh.get('draining') else ''}: "
        f"{_ranges(sh.get('owned', []))}",
    ]
    if doc.get("labels"):
        lines.append("labels    " + ", ".join(f"{k}={v}" for k, v in sorted(doc["labels"].items())))
    for pool, p in sorted((doc.get("pools") or {}).items()):
        # a targeted pool: who may run its jobs, or why they wait (no_eligible_agent)
        state = p.get("state", "?")
        why = f" ({p.get('reason')}{': ' + p['detail'] if p.get('detail') else ''})" if state == "waiting" else ""
        lines.append(f"pool      {pool} {json.dumps(p.get('target', {}), sort_keys=True)}  {state}{why}  "
                     f"eligible {', '.join(p.get('eligible', [])) or '-'}  owned {_ranges(p.get('owned', []))}")
    conf = doc.get("config")
    if isinstance(conf, dict):
        loaded = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(conf.get("loaded_at") or 0))
        lines.append(f"config    {conf.get('digest')}  loaded {loaded}  from {conf.get('source')}")
        refusal = conf.get("last_refusal")
        if refusal:
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(refusal.get("at") or 0))
            lines.append(f"          last reload refused at {when}: {'; '.join(refusal.get('problems', []))}")
    for section in ("quota", "sensor", "cloud", "health"):
        if section in doc:
            v = doc[section]
            lines.append(f"{section:<9} " + (", ".join(f"{k}={v[k]}" for k in v) if isinstance(v, dict) else str(v)))
    jobs = doc.get("jobs")
    if isinstance(jobs, dict):
        running = jobs.get("running", [])
        due = jobs.get("due", [])
        lines.append(f"runs      {len(running)} running, {jobs.get('waiting', 0)} waiting, {len(due)} due soon")
        if running:
            lines.append("  RUNNING  job_id                                   fire_id                    attempt pid      age_s  health")
            for r in running:
                lines.append(f"           {r.get('job_id',''):<40} {r.get('fire_id',''):<26} {r.get('attempt',''):<7} "
                             f"{r.get('pid',''):<8} {r.get('age_s',''):<6} {r.get('health','')}")
        if due:
            lines.append("  DUE      job_id                                   due")
            for d in due[:20]:
                lines.append(f"           {d.get('job_id',''):<40} {d.get('due','')}")
    return "\n".join(lines)


def _ranges(nums: list[int]) -> str:
    out: list[str] = []
    start: Optional[int] = None
    prev = 0
    for n in sorted(nums):
        if start is None:
            start = prev = n
        elif n == prev + 1:
            prev = n
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = n
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out) or "-"


def cli_status(args) -> int:
    path = args.socket
    if not path:
        path = load_config(config_path(args.config)).admin.socket
    doc = query(path)
    print(json.dumps(doc, indent=2, sort_keys=True) if args.json else render(doc))
    return 0


def _socket_of(path: str) -> str:
    """admin.socket of a config that may be broken: the agent, not this command, says what
    is wrong with it (and records the refusal)."""
    from agent.config import AdminConfig, ConfigError

    try:
        return load_config(path).admin.socket
    except ConfigError:
        pass
    try:
        import yaml

        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
        sock = data.get("admin", {}).get("socket") if isinstance(data, dict) else None
        if isinstance(sock, str):
            return sock
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        pass
    return AdminConfig().socket


def cli_reload(args) -> int:
    """`millwright reload`: 0 applied (or nothing changed), 2 refused (one line per problem
    on stderr), 3 the running agent predates reload (restart it instead)."""
    path = args.socket or _socket_of(config_path(args.config))
    doc = query(path, timeout=RELOAD_WAIT_S + 5 if args.wait else 15.0, op="reload")
    answer = doc.get("reload")
    if not isinstance(answer, dict):
        if "error" in doc and "no reload" not in str(doc["error"]) and "agent" not in doc:
            raise UserError(str(doc["error"]), 1)
        print("millwright: the running agent predates reload: restart it to apply the config", file=sys.stderr)
        return 3
    if answer.get("result") == "refused":
        for line in answer.get("problems", []):
            print(f"millwright: {line}", file=sys.stderr)
        return 2
    changed = ", ".join(answer.get("changed", [])) or "nothing changed"
    print(f"reload {answer.get('result')}: {changed} (config {answer.get('digest')})")
    return 0
