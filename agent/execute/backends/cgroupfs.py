"""Access to the cgroup file system: the few file operations the cgroup backends use, and
the parsers of /proc's cgroup mount and membership tables.

Every cgroup file access of a backend goes through :class:`CgroupFS`, so the cgroup v2
code paths run on a plain directory tree where the host has no usable cgroup2 hierarchy
(a v1 hybrid host's cgroup2 mount has no controllers)."""

from __future__ import annotations

import fcntl
import os

JOINER_FD_MIN = 10
READ_SIZE = 65536
WHOLE_BELOW = 2048


class CgroupFS:
    """The few filesystem operations the cgroup backends use (overridable in tests)."""

    def read(self, path: str) -> str:
        # os.read, not open(): a run's end reads a handful of small cgroup files, and the
        # text layer costs several times the syscalls' own time on the reaper's path. A
        # cgroup file's read(2) returns a whole page of its seq_file (or its end): less
        # than half a page is all of it, with no second read to see the end.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            chunks = []
            while True:
                chunk = os.read(fd, READ_SIZE)
                if not chunk:
                    break
                chunks.append(chunk)
                if len(chunk) < WHOLE_BELOW:
                    break
        finally:
            os.close(fd)
        return b"".join(chunks).decode()

    def write(self, path: str, data: str) -> None:
        # one write(2) per call: cgroup files act on each write
        fd = self.open_writer(path)
        try:
            self.write_fd(fd, data)
        finally:
            self.close_fd(fd)

    def open_writer(self, path: str) -> int:
        """An fd of a cgroup file to write again and again (each write(2) acts on its own)."""
        return os.open(path, os.O_WRONLY | os.O_CLOEXEC)

    def open_joiner(self, path: str) -> int:
        """An fd of a cgroup's `tasks` file for a launcher to inherit and join by (a write
        of "0"), numbered JOINER_FD_MIN or above: the launcher's shell names it by a single
        digit below that, which no fd to be moved there may occupy."""
        fd = self.open_writer(path)
        if fd >= JOINER_FD_MIN:
            return fd
        try:
            return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, JOINER_FD_MIN)
        finally:
            os.close(fd)

    def open_reader(self, path: str) -> int:
        """An fd of a cgroup file to read again and again with pread()."""
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def open_rw(self, path: str) -> int:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)

    def pread(self, fd: int, n: int) -> str:
        """Up to n bytes from the start of an open cgroup file."""
        return os.pread(fd, n, 0).decode()

    def write_fd(self, fd: int, data: str) -> None:
        os.write(fd, data.encode())

    def close_fd(self, fd: int) -> None:
        os.close(fd)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def mkdir(self, path: str) -> None:
        try:
            os.mkdir(path)
        except FileExistsError:
            pass

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def writable(self, path: str) -> bool:
        return os.access(path, os.W_OK)


def parse_kv(text: str) -> dict[str, int]:
    """A flat keyed cgroup file ("key value" lines) as a dict; other lines are skipped."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                out[parts[0]] = int(parts[1])
            except ValueError:
                pass
    return out


def mountinfo(path: str = "/proc/self/mountinfo") -> list[tuple[str, str, set[str], str]]:
    """(mount point, fstype, super options, root) of the cgroup mounts."""
    out: list[tuple[str, str, set[str], str]] = []
    try:
        with open(path) as fh:
            lines = fh.read().splitlines()
    except OSError:
        return out
    for line in lines:
        pre, _, post = line.partition(" - ")
        f = pre.split()
        p = post.split()
        if len(f) < 5 or len(p) < 3 or p[0] not in ("cgroup", "cgroup2"):
            continue
        mnt = f[4].replace("\\040", " ")
        out.append((mnt, p[0], set(p[2].split(",")), f[3]))
    return out


def self_cgroups(path: str = "/proc/self/cgroup") -> dict[str, str]:
    """controller (or '' for cgroup2) -> path of this process."""
    out: dict[str, str] = {}
    try:
        with open(path) as fh:
            for line in fh.read().splitlines():
                _, ctrls, p = line.split(":", 2)
                if ctrls == "":
                    out[""] = p
                for c in ctrls.split(","):
                    if c:
                        out[c] = p
    except OSError:
        pass
    return out

