"""Local admin endpoint: a root-only Unix socket that answers `millwright status`.

The server thread accepts a connection, asks the loop for a status snapshot (the loop
owns the state) and writes it back as one JSON document.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from typing import TYPE_CHECKING, Callable, Optional

from agent.config import config_path, load_config
from agent.errors import UserError

if TYPE_CHECKING:
    from agent.runtime.loop import EventLoop

log = logging.getLogger(__name__)


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

    def __init__(self, path: str, loop: EventLoop, status: Callable[[], dict]):
        self.path = path
        self.loop = loop
        self.status = status
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
                conn.settimeout(3)
                done = threading.Event()
                box: dict = {}

                def snap(box: dict = box, done: threading.Event = done) -> None:
                    # bound now: a snapshot arriving after its request timed out must not answer the next one
                    box["doc"] = self.status()
                    done.set()

                self.loop.post(snap)
                if done.wait(3):
                    payload = json.dumps(box["doc"], default=str).encode()
                else:
                    payload = json.dumps({"error": "agent loop did not answer within 3 s"}).encode()
                try:
                    conn.sendall(payload)
                except OSError:
                    pass

    def stop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass


def query(path: str, timeout: float = 5.0) -> dict:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        chunks = []
        while True:
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
    except FileNotFoundError:
        raise UserError(f"no agent admin socket at {path} (is the agent running?)", 1) from None
    except PermissionError:
        raise UserError(f"{path}: permission denied (the admin socket is root-only)", 1) from None
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
