"""A run's progress and result channel (docs/jobs.md, "Progress and results").

Every run gets two paths, named in its environment:
``MILLWRIGHT_PROGRESS``, a FIFO the job appends JSON lines to
(``{"progress": 0..100, "step": "...", "detail": {...}, "result": {...}}``), and
``MILLWRIGHT_RESULT``, an empty file for one JSON object of at most 4 KiB. They are made in
the executor's scratch directory (``execute.runtime_dir``, on a tmpfs: two entries per run
that need no journal, and nothing there outlives its run; named after the run) or, without
one, in the run directory. Either directory is the agent's (a run cannot create, rename or
replace anything in it); the two entries are made by the agent and owned by the run's own
id (a root run's: its group), so the run can write them and no other run can.

The reaper thread reads the FIFO as lines come (its fd is in the reaper's poll set; the
agent holds it open for writing too, so a job that closes it causes no hang-up storm),
at most READ_PER_TICK bytes a watch tick: a job that writes faster waits on its full pipe,
and the reaper stays free for every other run. The result file is read once, at the end.
Parsing is pure (``parse_line``, ``check_result``), so it is tested without processes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import time
from typing import Any, Optional

log = logging.getLogger(__name__)

PROGRESS_NAME = "progress"          # the FIFO, in the run directory
RESULT_NAME = "result.json"
MAX_LINE = 8192                     # bytes; a longer line is invalid (skipped to its newline)
MAX_RESULT = 4096                   # bytes of compact JSON (a result line's) or of the file
MAX_STEP = 200                      # characters
READ_PER_TICK = 64 * 1024           # bytes read from one run's FIFO per watch tick, at most
LINE_KEYS = ("progress", "step", "detail", "result")


def make_channel(directory: str, owner: Optional[tuple[int, int, int]], prefix: str = "") -> tuple[str, str]:
    """Create the run's FIFO and result file in ``directory``, their names after
    ``prefix`` (owned by ``owner`` = (uid, gid, directory mode), or the agent's when
    None) and return their paths."""
    fifo, result = os.path.join(directory, prefix + PROGRESS_NAME), os.path.join(directory, prefix + RESULT_NAME)
    for path in (fifo, result):
        try:
            os.unlink(path)   # a staged run made again: its entries are made new
        except FileNotFoundError:
            pass
    os.mkfifo(fifo, 0o600)
    os.close(os.open(result, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    if owner is not None:
        uid, gid, mode = owner
        for path in (fifo, result):
            os.chown(path, uid, gid, follow_symlinks=False)
            os.chmod(path, mode & 0o666)
    return fifo, result


def scratch_dir(path: str, owner_id: Optional[int]) -> Optional[str]:
    """Make the executor's scratch directory (0711: runs reach their own entries by path
    and list nothing; owned by ``owner_id`` when given) and clear what a dead predecessor's
    runs left there (they died with it: the run guard). None when it cannot be made: the
    channels then stay in the run directories."""
    path = os.path.abspath(path)
    try:
        os.makedirs(path, mode=0o711, exist_ok=True)
        os.chmod(path, 0o711)
        if owner_id is not None:
            os.chown(path, owner_id, owner_id)
        for name in os.listdir(path):
            try:
                os.unlink(os.path.join(path, name))
            except OSError:
                pass
    except OSError as exc:
        log.warning("no scratch directory: progress channels go to the run directories",
                    extra={"fields": {"path": path, "error": exc.strerror or str(exc)}})
        return None
    return path


def _unlink_if_empty(path: str) -> None:
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_size == 0:
            os.unlink(path)
    except OSError:
        pass


def parse_line(raw: bytes) -> tuple[Optional[dict], Optional[str]]:
    """(the line's fields, None) or (None, why it is invalid). A valid line is a JSON
    object with only ``progress`` (a number 0..100), ``step`` (a string of at most
    MAX_STEP characters), ``detail`` (an object) and ``result`` (an object; judged by
    check_result)."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None, "not JSON (UTF-8, one object per line)"
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    unknown = [k for k in obj if k not in LINE_KEYS]
    if unknown:
        return None, f"unknown key {str(unknown[0])[:40]!r} (allowed: {', '.join(LINE_KEYS)})"
    p = obj.get("progress")
    if "progress" in obj and (isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p)
                              or not 0 <= p <= 100):
        return None, "progress must be a number from 0 to 100"
    if "step" in obj and (not isinstance(obj["step"], str) or len(obj["step"]) > MAX_STEP):
        return None, f"step must be a string of at most {MAX_STEP} characters"
    if "detail" in obj and not isinstance(obj["detail"], dict):
        return None, "detail must be an object"
    return obj, None


def check_result(value: Any, size: Optional[int] = None) -> Optional[str]:
    """Why ``value`` cannot be a run's result (None: it can). ``size``: its size as
    written, when it came from the file."""
    if not isinstance(value, dict):
        return "not a JSON object"
    n = size if size is not None else len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    if n > MAX_RESULT:
        return f"{n} bytes; at most {MAX_RESULT} are kept (nothing is truncated)"
    return None


def read_result_file(path: str) -> tuple[Optional[dict], Optional[str]]:
    """(result, None), (None, why it is refused), or (None, None) when nothing was
    written. Opened without following links, non-blocking, at most MAX_RESULT + 1 bytes
    read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return None, f"cannot be read: {exc.strerror}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "not a regular file"
        if st.st_size == 0:
            return None, None
        if st.st_size > MAX_RESULT:
            return None, f"{st.st_size} bytes; at most {MAX_RESULT} are kept (nothing is truncated)"
        raw = os.read(fd, MAX_RESULT + 1)
    finally:
        os.close(fd)
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None, "not JSON"
    why = check_result(value, len(raw))
    return (None, why) if why else (value, None)


class ProgressChannel:
    """One run's FIFO as the reaper reads it (reaper thread only)."""

    __slots__ = ("fd", "fifo", "result_path", "step_timeout_s", "buf", "skipping", "lines", "invalid", "error",
                 "last", "last_mono", "result", "result_error", "pending", "budget", "scratch")

    def __init__(self, fifo: str, result_path: str, step_timeout_s: Optional[float], scratch: bool = False):
        # read-write: the agent is a writer too, so the job's closing it is no hang-up
        self.fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
        self.fifo, self.result_path = fifo, result_path
        self.step_timeout_s = step_timeout_s
        self.buf = bytearray()
        self.skipping = False          # inside a line longer than MAX_LINE: dropped up to its newline
        self.lines = self.invalid = 0
        self.error: Optional[str] = None   # why the first invalid line was
        self.last: Optional[dict] = None   # the newest valid line (without its result)
        self.last_mono = time.monotonic()  # the step timer counts from here
        self.result: Optional[dict] = None
        self.result_error: Optional[str] = None
        self.pending: list[dict] = []      # valid lines not handed over yet
        self.budget = READ_PER_TICK
        self.scratch = scratch             # its files are scratch: both go at the end (its record has the result)

    def read(self) -> bool:
        """Read what the FIFO holds, within this tick's budget. True: the budget is spent
        (stop watching the fd until the next tick, refill())."""
        while self.budget > 0:
            try:
                data = os.read(self.fd, min(65536, self.budget))
            except BlockingIOError:
                return False
            except OSError:
                return False
            if not data:
                return False
            self.budget -= len(data)
            self.feed(data)
        return True

    def refill(self) -> None:
        self.budget = READ_PER_TICK

    def feed(self, data: bytes) -> None:
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                break
            if self.skipping:
                self.skipping = False
            else:
                self.buf += data[start:nl]
                self._line(bytes(self.buf))
            self.buf.clear()
            start = nl + 1
        if not self.skipping:
            self.buf += data[start:]
            if len(self.buf) > MAX_LINE:
                self._invalid(f"a line longer than {MAX_LINE} bytes")
                self.buf.clear()
                self.skipping = True

    def _line(self, raw: bytes) -> None:
        if not raw.strip():
            return
        if len(raw) > MAX_LINE:
            self._invalid(f"a line longer than {MAX_LINE} bytes")
            return
        obj, why = parse_line(raw)
        if obj is None:
            self._invalid(why or "invalid")
            return
        self.lines += 1
        self.last_mono = time.monotonic()
        if "result" in obj:
            result = obj.pop("result")
            self.result_error = check_result(result)
            self.result = None if self.result_error else result
        obj["at"] = time.time()
        self.last = obj
        self.pending.append(obj)

    def _invalid(self, why: str) -> None:
        self.invalid += 1
        if self.error is None:
            self.error = why

    def take(self) -> list[dict]:
        batch, self.pending = self.pending, []
        return batch

    def finish(self) -> tuple[Optional[dict], Optional[str]]:
        """At the run's end: what is left in the FIFO, then the result (the file's when the
        job wrote one, else the last progress line's); the FIFO goes."""
        self.refill()
        self.read()
        if self.buf and not self.skipping:
            self._line(bytes(self.buf))   # a last line without its newline
        self.buf.clear()
        self.close()
        result, why = read_result_file(self.result_path)
        if self.scratch:
            try:
                os.unlink(self.result_path)
            except OSError:
                pass
        elif result is None and why is None:
            _unlink_if_empty(self.result_path)   # a run that wrote nothing leaves no files
        if result is None and why is None:
            result, why = self.result, self.result_error
        return result, (f"result refused: {why}" if why else None)

    def close(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1
        try:
            os.unlink(self.fifo)
        except OSError:
            pass

    def summary(self) -> dict[str, Any]:
        """What the run record says of its progress."""
        out: dict[str, Any] = {"lines": self.lines}
        if self.last is not None:
            out.update({k: v for k, v in self.last.items() if k != "at"})
        if self.invalid:
            out["invalid"] = self.invalid
            out["invalid_reason"] = self.error
        return out
