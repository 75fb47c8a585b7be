"""Short-lived loader process: compile bpf/sensor.c with BCC, attach it, hand the file
descriptors to the agent, exit.

Run as ``python3 -m agent.signals.loader --sock-fd N --config JSON`` by
:func:`agent.signals.attach.attach`. The agent never imports bcc: LLVM and clang cost
~74 MB on import and ~130 MB after a compile, and that memory is not given back. This
process pays it for about a second, then sends over a SOCK_SEQPACKET socket (SCM_RIGHTS)
the map fds and the tracepoint perf-event fds that keep the programs attached, and leaves
with os._exit so that BCC's atexit cleanup never detaches what the agent now owns.

It holds only what loading needs: CAP_BPF and CAP_PERFMON (every other capability leaves
its effective, permitted and bounding sets before anything is parsed or compiled), and an
environment of its own (environment()), none of the agent's.
"""

from __future__ import annotations

import argparse
import ctypes as ct
import json
import os
import resource
import socket
import sys
import time

# capability numbers (capabilities(7)): what compiling, loading and attaching needs
CAP_PERFMON, CAP_BPF = 38, 39
KEEP_CAPABILITIES = frozenset({CAP_BPF, CAP_PERFMON})
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def environment(package_root: str) -> dict[str, str]:
    """The loader's whole environment: where Python finds the agent's package, a PATH and
    a locale; nothing of the agent's (its environment may carry what a helper that runs
    LLVM on a kernel-facing source has no use for)."""
    return {"PATH": PATH, "LANG": "C.UTF-8", "PYTHONPATH": package_root, "PYTHONDONTWRITEBYTECODE": "1"}


def drop_privileges() -> None:
    """Keep CAP_BPF and CAP_PERFMON only (a loader started by a non-root agent has none to
    drop)."""
    if os.geteuid() != 0:
        return
    from agent.runtime.kernel import keep_only_capabilities

    keep_only_capabilities(set(KEEP_CAPABILITIES))


def _reply(sock: socket.socket, doc: dict, fds: list[int]) -> None:
    socket.send_fds(sock, [json.dumps(doc).encode()], fds)


def load(config: dict) -> tuple[dict, list[int]]:
    from agent.signals import abi, check

    tracefs = check.find_tracefs(config.get("tracefs"))
    if not tracefs:
        raise RuntimeError("tracefs is not mounted (run: millwright bpf check)")
    cflags = check.compile_flags(tracefs, node_activity=bool(config.get("node_activity", True)))
    t0 = time.monotonic()
    import bcc.version
    from bcc import BPF  # noqa: E402  (the whole point: only this process imports it)

    t1 = time.monotonic()
    with open(config.get("source") or abi.SOURCE, "rb") as f:
        text = f.read()
    b = BPF(text=text, cflags=cflags + ["-Wno-macro-redefined"])
    t2 = time.monotonic()
    attached = sorted(k.decode() for k in b.tracepoint_fds)
    want = sorted(abi.TRACEPOINTS)
    if attached != want:
        raise RuntimeError(f"attached {attached}, expected {want}")
    # The Python mirror must match what clang laid out (silent garbage otherwise).
    for name, (ktype, vtype) in abi.MAPS.items():
        t = b[name.encode()]
        for what, mine, theirs in (("key", ktype, t.Key), ("value", vtype, getattr(t, "sLeaf", t.Leaf))):
            if ct.sizeof(mine) != ct.sizeof(theirs):
                raise RuntimeError(f"ABI mismatch: map {name} {what} is {ct.sizeof(theirs)} bytes in sensor.c, "
                                   f"{ct.sizeof(mine)} in abi.py")
    fds: list[int] = []
    maps = {}
    for name in list(abi.MAPS) + list(abi.PERF_MAPS):
        maps[name] = len(fds)
        fds.append(b[name.encode()].map_fd)
    tps = {}
    for tp, fd in b.tracepoint_fds.items():
        tps[tp.decode()] = len(fds)
        fds.append(fd)
    doc = {
        "ok": True,
        "maps": maps,
        "tracepoints": tps,
        "cflags": cflags,
        "bcc_version": bcc.version.__version__,
        "import_s": round(t1 - t0, 3),
        "compile_s": round(t2 - t1, 3),
        "loader_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "pid": os.getpid(),
    }
    return doc, fds


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sock-fd", type=int, required=True)
    p.add_argument("--config", default="{}")
    a = p.parse_args(argv)
    sock = socket.socket(fileno=a.sock_fd)
    try:
        drop_privileges()
        doc, fds = load(json.loads(a.config))
    except BaseException as exc:  # report every failure to the agent as a reason
        msg = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        try:
            _reply(sock, {"ok": False, "error": f"{type(exc).__name__}: {msg}"}, [])
        finally:
            sys.stderr.flush()
            os._exit(1)
    _reply(sock, doc, fds)
    # Wait until the agent confirms it holds the fds (or went away), then leave without
    # running BCC's cleanup, which would detach the programs the agent now owns.
    try:
        sock.settimeout(30)
        sock.recv(16)
    except OSError:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
