"""Loading bpf/sensor.c through the short-lived loader process, and what it hands back.

The agent never imports bcc: :func:`attach` runs ``python3 -m agent.signals.loader``,
which compiles and attaches the program and passes the map and tracepoint fds back
over a Unix socket, then exits. From then on the agent reads the maps and perf buffers
through bpfsys (libbcc_bpf only). Any failure is a :class:`LoadError` whose message is
the degraded-mode reason.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING, Any, Callable, Optional

from agent.signals import abi, check

if TYPE_CHECKING:
    from agent.signals import bpfsys

log = logging.getLogger(__name__)

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class LoadError(RuntimeError):
    """The BPF program could not be loaded; the message is the degraded-mode reason."""


class KernelObjects:
    """The attached program as the agent holds it: the maps by name (abi.MAPS), the perf
    buffers, and the fds that keep the program attached. Closing the last fds unloads it."""

    def __init__(self, maps: dict[str, Any], map_fds: list[int], tp_fds: list[int]):
        self.maps = maps
        self.map_fds = map_fds
        self.tp_fds = tp_fds
        self.perf: Optional[bpfsys.PerfBuffers] = None

    def close(self) -> None:
        if self.perf is not None:
            self.perf.close()
            self.perf = None
        for fd in self.tp_fds + self.map_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.tp_fds, self.map_fds, self.maps = [], [], {}


def attach(*, tracefs: Optional[str], node_activity: bool, perf_pages: int, timeout_s: float,
           on_raw: Callable[[int, bytes], None], on_lost: Callable[[int, int], None],
           info: dict[str, Any], node_wakeup: int = 1) -> KernelObjects:
    """Load and attach the program (blocking, about 1-2 s); perf records go to ``on_raw``
    and ``on_lost`` from inside ``perf.poll()`` and ``perf.consume()``; execs outside any
    job wake the reader once per ``node_wakeup`` of them. The loader's figures (bcc version,
    compile time, peak RSS, cflags) are put in ``info`` as soon as it answers."""
    reason = check.preflight(tracefs)
    if reason:
        raise LoadError(reason)
    try:
        from agent.signals import bpfsys

        bpfsys.lib()
    except OSError as exc:
        raise LoadError(str(exc)) from None
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    errf = tempfile.TemporaryFile()
    from agent.signals.loader import environment

    env = environment(PACKAGE_ROOT)
    config = {"node_activity": node_activity, "tracefs": tracefs}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent.signals.loader", "--sock-fd", str(child.fileno()),
             "--config", json.dumps(config)],
            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errf,
            env=env, cwd=PACKAGE_ROOT)
    except OSError as exc:
        raise LoadError(f"cannot start the loader: {exc}") from None
    finally:
        child.close()
    fds: list[int] = []
    try:
        parent.settimeout(timeout_s)
        try:
            msg, fds, _flags, _addr = socket.recv_fds(parent, 1 << 16, 128)
        except socket.timeout:
            proc.kill()
            raise LoadError(f"loader did not answer within {timeout_s:.0f}s") from None
        for fd in fds:
            os.set_inheritable(fd, False)
        doc = json.loads(msg.decode() or "{}") if msg else {}
        if not doc.get("ok"):
            errf.seek(0)
            tail = [ln for ln in errf.read().decode(errors="replace").splitlines() if ln.strip()][-3:]
            why = doc.get("error") or (f"loader exited: {' | '.join(tail)}" if tail else "loader exited")
            if tail and doc.get("error"):
                log.warning("loader stderr", extra={"fields": {"tail": " | ".join(tail)}})
            for fd in fds:
                os.close(fd)
            raise LoadError(why)
        try:
            parent.send(b"ok")
        except OSError:
            pass
    finally:
        parent.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        errf.close()
    info.update({k: doc[k] for k in ("bcc_version", "import_s", "compile_s", "loader_maxrss_kb", "cflags")})
    missing = [m for m in abi.PERF_MAPS if m not in doc["maps"]]
    if missing:
        for fd in fds:
            os.close(fd)
        raise LoadError(f"the loader handed over no {', '.join(missing)} map")
    kernel = KernelObjects({}, [fds[i] for i in doc["maps"].values()], [fds[i] for i in doc["tracepoints"].values()])
    from agent.signals import bpfsys

    for name, (k, v) in abi.MAPS.items():
        kernel.maps[name] = bpfsys.Map(name, fds[doc["maps"][name]], k, v)
    try:
        outputs = [(fds[doc["maps"]["events"]], 1)]
        if node_activity:
            outputs.append((fds[doc["maps"]["node_events"]], node_wakeup))
        kernel.perf = bpfsys.PerfBuffers(outputs, bpfsys.online_cpus(), perf_pages, on_raw, on_lost)
    except OSError as exc:
        kernel.close()
        raise LoadError(f"perf buffers: {exc}") from None
    return kernel
