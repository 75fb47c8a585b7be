"""Fault primitives for the seeded fault test (tests/support/chaos.py), each undone by its
``heal`` and by ``close`` however the run ends.

- :class:`NftRules`: nftables rules in a table of our own (``mw_chaos_<pid>_<random>``):
  link cuts, one-way and reply-only partitions, a member isolated on its peer port.
- :class:`NetCls`: a net_cls hierarchy of our own, so a rule can match one process's
  packets (``meta cgroup``): how an etcd member's own outgoing peer traffic is told apart
  on loopback, where every member dials from 127.0.0.1.
- :class:`LoopDisk`: a small ext4 file system on a loop device for one data directory:
  "full" is a ballast file taking every free block; "slow" is a blkio write-IOPS limit on
  that device for the process using it (:class:`BlkioThrottle`): each fsync waits for it.
- :class:`Clock`: an agent's wall clock offset, read by an LD_PRELOAD shim
  (clockshim.c) from a file the test rewrites; monotonic clocks are left alone, as a real
  clock step leaves them.

Only loopback, devices and cgroups this module creates are touched.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from typing import Optional

BLKIO = "/sys/fs/cgroup/blkio"


def _run(*argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True, **kw)


class NftRules:
    """Rules in a table of our own. Loopback packets pass the output hook, then the input
    hook: a drop in ``input`` is a segment lost on the way (the sender retransmits); only
    ``output`` knows the sending process (``meta cgroup``)."""

    def __init__(self, rules: str, hook: str = "input"):
        self.table = f"mw_chaos_{os.getpid()}_{secrets.token_hex(3)}"
        self.rules, self.hook = rules, hook
        self.active = False

    def apply(self) -> "NftRules":
        text = (f"table inet {self.table} {{\n  chain c {{ type filter hook {self.hook} priority -10; policy accept;\n"
                f"{self.rules}\n  }}\n}}\n")
        subprocess.run(["nft", "-f", "-"], input=text.encode(), check=True)
        self.active = True
        return self

    def heal(self) -> None:
        if self.active:
            subprocess.run(["nft", "delete", "table", "inet", self.table], check=False)
            self.active = False


def ports(ps) -> str:
    return "{ " + ", ".join(str(p) for p in ps) + " }"


def cut_rules(addr: str, server_ports: list[int], direction: str) -> str:
    """Drop TCP between clients on ``addr`` and the servers on ``server_ports`` (they listen
    on ``addr``): ``both``, ``requests`` (client to server only) or ``replies`` (server to
    client only: the requests arrive and are acted on, their answers are lost)."""
    to_server = f"    ip daddr {addr} tcp dport {ports(server_ports)} drop"
    to_client = f"    ip saddr {addr} tcp sport {ports(server_ports)} drop"
    return {"both": to_server + "\n" + to_client, "requests": to_server, "replies": to_client}[direction]


class NetCls:
    """A net_cls hierarchy mounted for this run; :meth:`tag` puts a process (all its
    threads, its open sockets included) in a class nftables can match (``meta cgroup``)."""

    def __init__(self, workdir: str):
        self.root = os.path.join(workdir, "net_cls")
        self.mounted = False
        self.tagged: dict[int, str] = {}

    def mount(self) -> "NetCls":
        os.makedirs(self.root, exist_ok=True)
        _run("mount", "-t", "cgroup", "-o", "net_cls", f"mw_chaos_{os.getpid()}", self.root)
        self.mounted = True
        return self

    def tag(self, pid: int, classid: int) -> None:
        d = os.path.join(self.root, f"c{classid:x}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "net_cls.classid"), "w") as fh:
            fh.write(str(classid))
        with open(os.path.join(d, "cgroup.procs"), "w") as fh:
            fh.write(str(pid))
        self.tagged[pid] = d

    def untag(self, pid: int) -> None:
        d = self.tagged.pop(pid, None)
        if d is None:
            return
        _move_all(d, self.root)
        try:
            os.rmdir(d)
        except OSError:
            pass

    def close(self) -> None:
        for pid in list(self.tagged):
            self.untag(pid)
        if self.mounted:
            _run("umount", self.root, check=False)
            self.mounted = False


def _move_all(src_cgroup: str, dst_cgroup: str) -> None:
    """Move every process of a cgroup to another (processes gone meanwhile are skipped)."""
    try:
        with open(os.path.join(src_cgroup, "cgroup.procs")) as fh:
            pids = fh.read().split()
    except OSError:
        return
    for pid in pids:
        try:
            with open(os.path.join(dst_cgroup, "cgroup.procs"), "w") as fh:
                fh.write(pid)
        except OSError:
            pass


class LoopDisk:
    """``mountpoint`` on its own ext4 file system (a sparse image in the run's directory,
    no blocks reserved for root), so filling it or slowing it touches nothing else."""

    def __init__(self, image: str, mountpoint: str, size_mb: int):
        self.image, self.mountpoint, self.size_mb = image, mountpoint, size_mb
        self.device: Optional[str] = None
        self.mounted = False
        self.ballast = os.path.join(mountpoint, ".mw-chaos-ballast")

    def create(self) -> "LoopDisk":
        with open(self.image, "wb") as fh:
            fh.truncate(self.size_mb << 20)
        self.device = _run("losetup", "--find", "--show", self.image).stdout.strip()
        _run("mkfs.ext4", "-q", "-F", "-m", "0", self.device)
        os.makedirs(self.mountpoint, exist_ok=True)
        _run("mount", self.device, self.mountpoint)
        self.mounted = True
        os.rmdir(os.path.join(self.mountpoint, "lost+found"))
        os.chmod(self.mountpoint, 0o700)
        return self

    @property
    def majmin(self) -> str:
        st = os.stat(self.device or "")
        return f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"

    def fill(self) -> None:
        """Take every free block: the next write that needs one fails with ENOSPC."""
        st = os.statvfs(self.mountpoint)
        _run("fallocate", "-l", str(st.f_bavail * st.f_frsize), self.ballast, check=False)
        # what fallocate could not take (metadata rounding), a plain write takes
        try:
            with open(self.ballast, "ab") as fh:
                while True:
                    fh.write(b"\0" * (1 << 16))
                    fh.flush()
        except OSError:
            pass

    def unfill(self) -> None:
        try:
            os.unlink(self.ballast)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self.mounted:
            if _run("umount", self.mountpoint, check=False).returncode != 0:
                _run("umount", "-l", self.mountpoint, check=False)
            self.mounted = False
        if self.device:
            _run("losetup", "-d", self.device, check=False)
            self.device = None


class BlkioThrottle:
    """A write-IOPS limit on one device for one process, in a blkio cgroup of our own:
    every fsync it makes on that device waits its turn (cgroup v1 charges the writeback an
    fsync starts to the process that calls it)."""

    def __init__(self, name: str):
        self.dir = os.path.join(BLKIO, f"mw_chaos_{os.getpid()}_{name}")
        self.majmin: Optional[str] = None

    @staticmethod
    def available() -> bool:
        return os.path.exists(os.path.join(BLKIO, "blkio.throttle.write_iops_device"))

    def apply(self, pid: int, majmin: str, iops: int) -> None:
        os.makedirs(self.dir, exist_ok=True)
        with open(os.path.join(self.dir, "cgroup.procs"), "w") as fh:
            fh.write(str(pid))
        for what in ("write_iops_device", "write_bps_device"):
            limit = iops if what == "write_iops_device" else 256 * 1024 * max(1, iops)
            with open(os.path.join(self.dir, f"blkio.throttle.{what}"), "w") as fh:
                fh.write(f"{majmin} {limit}")
        self.majmin = majmin

    def heal(self) -> None:
        if not os.path.isdir(self.dir):
            return
        if self.majmin:
            for what in ("write_iops_device", "write_bps_device"):
                try:
                    with open(os.path.join(self.dir, f"blkio.throttle.{what}"), "w") as fh:
                        fh.write(f"{self.majmin} 0")
                except OSError:
                    pass
        _move_all(self.dir, BLKIO)
        try:
            os.rmdir(self.dir)
        except OSError:
            pass
        self.majmin = None


SHIM_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "clockshim.c")


class Clock:
    """One agent's wall-clock offset in seconds, read by an LD_PRELOAD shim
    (tests/support/clockshim.c, built with gcc into the run's directory) from a file the
    test rewrites; the shim reads it again every 200 ms."""

    def __init__(self, path: str, shim: str):
        self.path, self.shim = path, shim
        self.offset = 0
        self.set(0)

    @staticmethod
    def build(workdir: str) -> str:
        """The shim, compiled for this run (gcc is on every machine of this project)."""
        out = os.path.join(workdir, "clockshim.so")
        _run("gcc", "-O2", "-shared", "-fPIC", "-Wall", "-Werror", "-o", out, SHIM_SOURCE, "-ldl", "-lpthread")
        return out

    def env(self) -> dict:
        return {"LD_PRELOAD": self.shim, "MW_CLOCK_OFFSET_FILE": self.path}

    def set(self, offset: int) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            fh.write(f"{offset:+d}\n")
        os.replace(tmp, self.path)
        self.offset = offset
