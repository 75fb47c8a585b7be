"""`millwright bpf check`: what the BCC sensor needs on this machine, and how to fix it.

Each check reads the real thing (process capabilities, tracefs, each tracepoint's
format file, the kernel headers tree, the installed BCC) and, when it fails, says what is
missing and the fix on Debian, Ubuntu and Jetson L4T. The same format-file parsing
decides the loader's compile flags, so `bpf check` and the sensor agree on what this
kernel offers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Optional

from agent.signals import abi

TRACEFS_CANDIDATES = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
CAP_PERFMON = 38
CAP_BPF = 39
CAP_SYS_ADMIN = 21

FIXES = {
    "privileges": {
        "debian": "run the agent as root (the packaged systemd unit does), or grant it "
                  "AmbientCapabilities=CAP_BPF CAP_PERFMON in a systemd drop-in (kernel >= 5.8; tracefs must then be "
                  "readable by the agent's user, e.g. mounted with mode=0755)",
        "ubuntu": "same as Debian: root, or AmbientCapabilities=CAP_BPF CAP_PERFMON",
        "jetson": "same as Debian; L4T 35/36 kernels (5.10/5.15) support CAP_BPF and CAP_PERFMON",
    },
    "tracefs": {
        "debian": "mount -t tracefs tracefs /sys/kernel/tracing (fstab: 'tracefs /sys/kernel/tracing tracefs defaults 0 0')",
        "ubuntu": "mount -t tracefs tracefs /sys/kernel/tracing (systemd mounts it by default)",
        "jetson": "mount -t tracefs tracefs /sys/kernel/tracing; L4T kernels have CONFIG_FTRACE enabled",
    },
    "tracepoint": {
        "debian": "needs a kernel with CONFIG_TRACEPOINTS, CONFIG_FTRACE_SYSCALLS (syscalls:*) and >= 4.16 (tcp:*); "
                  "the stock linux-image-* has them",
        "ubuntu": "the stock linux-image-generic has them",
        "jetson": "JetPack 5/6 (L4T 35/36) kernels have them; custom kernels need CONFIG_FTRACE_SYSCALLS",
    },
    "headers": {
        "debian": "apt install linux-headers-$(uname -r); when the running kernel has no headers package, install "
                  "linux-headers-$(dpkg --print-architecture) and link /lib/modules/$(uname -r)/build and /source "
                  "to /usr/src/linux-headers-<ver>-<arch> and -common (scripts/setup-host.sh does this)",
        "ubuntu": "apt install linux-headers-$(uname -r)",
        "jetson": "apt install nvidia-l4t-kernel-headers, then check that /lib/modules/$(uname -r)/build points at "
                  "/usr/src/linux-headers-$(uname -r)-ubuntu*/ (link it if not)",
    },
    "bcc": {
        "debian": "apt install python3-bpfcc libbpfcc (bookworm ships 0.26)",
        "ubuntu": "apt install python3-bpfcc libbpfcc (22.04 ships 0.18, 24.04 ships 0.29)",
        "jetson": "apt install python3-bpfcc libbpfcc (from the Ubuntu 22.04 archive on JetPack 6)",
    },
}


@dataclass
class Item:
    name: str
    ok: bool
    detail: str
    required: bool = True
    missing: list[str] = field(default_factory=list)
    fix: Optional[dict] = None


# ---------------------------------------------------------------------- format files


def find_tracefs(explicit: Optional[str] = None) -> Optional[str]:
    cands = [explicit] if explicit else list(TRACEFS_CANDIDATES)
    for c in cands:
        if c and os.path.isdir(os.path.join(c, "events")):
            return c
    return None


_FIELD_RE = re.compile(r"field:(?P<decl>[^;]*);\s*offset:(?P<off>\d+);\s*size:(?P<size>\d+);")


def parse_format(text: str) -> dict[str, str]:
    """Field name -> C declaration from a tracepoint format file (common_* skipped)."""
    fields: dict[str, str] = {}
    for m in _FIELD_RE.finditer(text):
        decl = m.group("decl").strip()
        name = re.sub(r"\[.*\]$", "", decl.split()[-1]).lstrip("*")
        if name.startswith("common_"):
            continue
        fields[name] = decl
    return fields


def read_format(tracefs: str, tp: str) -> Optional[dict[str, str]]:
    cat, name = tp.split(":")
    try:
        with open(os.path.join(tracefs, "events", cat, name, "format")) as f:
            return parse_format(f.read())
    except OSError:
        return None


def headers_dirs(headers_dir: Optional[str] = None) -> tuple[str, str]:
    """(build, source) trees from a /lib/modules/<ver>-style dir or a headers tree itself."""
    base = headers_dir or f"/lib/modules/{os.uname().release}"
    if os.path.exists(os.path.join(base, "include", "generated", "autoconf.h")):
        return base, base
    return os.path.join(base, "build"), os.path.join(base, "source")


def compile_flags(tracefs: str, node_activity: bool = True, headers_dir: Optional[str] = None) -> list[str]:
    """The -D flags bpf/sensor.c needs on this kernel (from its format files and headers)."""
    flags = [f"-DNODE_ACTIVITY={1 if node_activity else 0}"]
    for tp, spec in abi.TRACEPOINTS.items():
        fmt = read_format(tracefs, tp) or {}
        for flag, names in spec.get("optional", {}).items():
            if all(n in fmt for n in names):
                flags.append(f"-D{flag}")
    send_reset = read_format(tracefs, "tcp:tcp_send_reset") or {}
    if any("enum sk_rst_reason" in d for d in send_reset.values()):
        build, source = headers_dirs(headers_dir)
        if not any(os.path.exists(os.path.join(d, "include", "net", "rstreason.h")) for d in (build, source)):
            flags.append("-DNEED_SK_RST_REASON_ENUM")
    return flags


# ---------------------------------------------------------------------------- checks


def _caps() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def check_privileges() -> Item:
    if os.geteuid() == 0:
        return Item("privileges", True, "running as root")
    caps = _caps()
    have = [n for n, b in (("CAP_BPF", CAP_BPF), ("CAP_PERFMON", CAP_PERFMON)) if caps >> b & 1]
    if len(have) == 2 or caps >> CAP_SYS_ADMIN & 1:
        return Item("privileges", True, "capabilities: " + (", ".join(have) or "CAP_SYS_ADMIN"))
    missing = [n for n in ("CAP_BPF", "CAP_PERFMON") if n not in have]
    return Item("privileges", False, f"not root and missing {', '.join(missing)}", missing=missing,
                fix=FIXES["privileges"])


def check_tracefs(tracefs: Optional[str]) -> tuple[Item, Optional[str]]:
    found = find_tracefs(tracefs)
    if found:
        return Item("tracefs", True, f"mounted at {found}"), found
    where = tracefs or " or ".join(TRACEFS_CANDIDATES)
    for c in [tracefs] if tracefs else TRACEFS_CANDIDATES:
        try:
            os.listdir(c)
        except PermissionError:
            return Item("tracefs", False, f"{c} is not readable by uid {os.geteuid()} (BCC reads the format files: "
                        "run as root, or mount tracefs with mode=0755)", missing=[f"{c} (permission)"],
                        fix=FIXES["tracefs"]), None
        except OSError:
            continue
    return Item("tracefs", False, f"no tracefs events/ under {where}", missing=[f"{where}/events"],
                fix=FIXES["tracefs"]), None


def check_tracepoints(tracefs: Optional[str]) -> list[Item]:
    items = []
    for tp, spec in abi.TRACEPOINTS.items():
        if not tracefs:
            items.append(Item(f"tracepoint {tp}", False, "cannot be checked: tracefs not available", missing=[tp],
                              fix=FIXES["tracefs"]))
            continue
        fmt = read_format(tracefs, tp)
        if fmt is None:
            items.append(Item(f"tracepoint {tp}", False, "not present in this kernel (no format file)",
                              missing=[tp], fix=FIXES["tracepoint"]))
            continue
        missing = [f for f in spec["required"] if f not in fmt]
        opt = []
        for names in spec.get("optional", {}).values():
            absent = [n for n in names if n not in fmt]
            opt.append(f"{'+' if not absent else '-'}{','.join(names)}")
        used = len(spec["required"])
        detail = (f"present, {used} field(s) read: ok" if used else "present") if not missing \
            else f"missing fields: {', '.join(missing)}"
        if opt:
            detail += "; optional " + " ".join(opt)
        items.append(Item(f"tracepoint {tp}", not missing, detail, missing=[f"{tp}:{m}" for m in missing],
                          fix=None if not missing else FIXES["tracepoint"]))
    return items


def check_headers(headers_dir: Optional[str]) -> Item:
    build, source = headers_dirs(headers_dir)
    need = {
        "generated headers (include/generated/autoconf.h)": [os.path.join(build, "include", "generated", "autoconf.h")],
        "kernel headers (include/linux/kconfig.h)": [os.path.join(build, "include", "linux", "kconfig.h"),
                                                     os.path.join(source, "include", "linux", "kconfig.h")],
        "arch headers (arch/*/include)": [os.path.join(build, "arch"), os.path.join(source, "arch")],
    }
    missing = []
    for what, paths in need.items():
        if not any(os.path.exists(p) for p in paths):
            missing.append(f"{what} at {paths[0]}")
    if missing:
        return Item("kernel headers", False, "kernel headers missing: " + "; ".join(missing), missing=missing,
                    fix=FIXES["headers"])
    release = ""
    try:
        with open(os.path.join(build, "include", "config", "kernel.release")) as f:
            release = f.read().strip()
    except OSError:
        pass
    detail = f"{os.path.realpath(build)}" + (f" (headers {release})" if release else "")
    if release and release != os.uname().release:
        detail += f"; running {os.uname().release}: fine for tracepoint programs (layouts come from format files)"
    return Item("kernel headers", True, detail)


def check_bcc() -> Item:
    problems = []
    version = None
    try:
        from agent.signals import bpfsys

        bpfsys.lib()
    except OSError as exc:
        problems.append(str(exc))
    try:
        import importlib.util

        spec = importlib.util.find_spec("bcc")
        if spec is None:
            problems.append("python module bcc (python3-bpfcc) not installed")
        else:
            vfile = os.path.join(os.path.dirname(spec.origin or ""), "version.py")
            try:
                with open(vfile) as f:
                    m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", f.read())
                    version = m.group(1) if m else None
            except OSError:
                pass
    except (ImportError, ValueError) as exc:
        problems.append(f"python module bcc: {exc}")
    if problems:
        return Item("bcc", False, "; ".join(problems), missing=problems, fix=FIXES["bcc"])
    return Item("bcc", True, f"BCC {version or 'unknown version'} (python3-bpfcc), libbcc_bpf loadable")


def run_checks(headers_dir: Optional[str] = None, tracefs: Optional[str] = None) -> list[Item]:
    items = [check_privileges()]
    tf_item, tf = check_tracefs(tracefs)
    items.append(tf_item)
    items.extend(check_tracepoints(tf))
    items.append(check_headers(headers_dir))
    items.append(check_bcc())
    items.append(Item("kprobes", True, "not needed (tracepoints only)", required=False))
    return items


def preflight(tracefs: Optional[str] = None) -> Optional[str]:
    """Cheap checks before spawning the loader; returns the first reason it cannot work."""
    for item in [check_privileges(), check_tracefs(tracefs)[0]] + check_tracepoints(find_tracefs(tracefs)) + [check_headers(None)]:
        if item.required and not item.ok:
            return f"{item.name}: {item.detail}"
    return None


def _distro() -> str:
    if os.path.exists("/etc/nv_tegra_release"):
        return "jetson"
    try:
        with open("/etc/os-release") as f:
            text = f.read()
        if re.search(r"^ID=ubuntu", text, re.M):
            return "ubuntu"
    except OSError:
        pass
    return "debian"


def cli_check(args: argparse.Namespace) -> int:
    items = run_checks(getattr(args, "headers_dir", None), getattr(args, "tracefs", None))
    failed = [i for i in items if i.required and not i.ok]
    if getattr(args, "json", False):
        print(json.dumps({"ok": not failed, "distro": _distro(), "items": [asdict(i) for i in items]}, indent=2))
        return 1 if failed else 0
    here = _distro()
    for i in items:
        print(f"{'ok ' if i.ok else 'MISSING' if i.required else 'warn'} {i.name}: {i.detail}")
    if failed:
        print()
        print(f"{len(failed)} required item(s) missing; fixes (this host looks like {here}):")
        for i in failed:
            print(f"- {i.name}:")
            for distro in ("debian", "ubuntu", "jetson"):
                mark = "*" if distro == here else " "
                print(f"  {mark} {distro:7s} {i.fix[distro] if i.fix else ''}")
        print("Without these the agent runs degraded (node-level counters from /proc only).")
        return 1
    print("all required items present: the sensor can load")
    return 0
