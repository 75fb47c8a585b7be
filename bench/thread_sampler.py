"""A stdlib CPU-weighted sampling profiler over all threads of a process (bench only).

Every ``interval_s`` the sampler thread reads each Python thread's own CPU clock
(``pthread_getcpuclockid``) and, for a thread that used CPU since the last sample, walks
its stack (``sys._current_frames``) and charges that CPU to: the thread, the innermost
frame inside ``agent/`` (the function of ours that was running, callees included), and
the innermost frame overall (file:line, so a C call such as sqlite3's ``execute`` or
``json.dumps`` shows as the agent line that made it). Per-thread totals, Python or not
(grpc's C threads), come from /proc/self/task/*/stat. Time spent in the garbage
collector is measured with ``gc.callbacks``.

It is armed from a ``sitecustomize`` that bench/profile_ingest.py puts first on the
agent's PYTHONPATH, and controlled through files in ``directory``: it starts a phase when
``control`` says ``start <tag>`` and writes ``<pid>.<tag>.json`` when it says ``stop
<tag>``. Idle (between phases) it only stats the control file every 20 ms.

Caveat (the GIL): the sampler runs when it gets the GIL, so a thread's CPU is charged to
where it is when the sampler looks, which can be the wait it went into after the work
(e.g. ``select``, a lock). During a phase the interpreter's switch interval is lowered to
half the sampling interval (from 5 ms), so a thread busy in Python is seen mid-work; a
short burst of work that ends in a blocking call is still charged to that call.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import re
import sys
import threading
import time

_AGENT = os.sep + "agent" + os.sep
_LIBS = (("/paho/", "paho"), ("/grpc/", "grpc"), ("/etcd3/", "etcd3"), ("/google/protobuf/", "protobuf"),
         ("/json/", "json"), ("/sqlite3/", "sqlite3"), ("/nacl/", "crypto"), ("/cryptography/", "crypto"),
         ("/hmac.py", "hmac"), ("/hashlib.py", "hashlib"), ("/logging/", "logging"),
         ("/prometheus_client/", "prometheus"), ("/yaml/", "yaml"), ("/croniter/", "croniter"),
         ("/threading.py", "threading"), ("/queue.py", "queue"), ("/selectors.py", "selectors"),
         ("/socket.py", "socket"), ("/ssl.py", "ssl"), ("/dataclasses.py", "dataclasses"),
         ("/_strptime.py", "strptime"), ("/datetime.py", "datetime"), ("/re/", "re"), ("/enum.py", "enum"))


def _tasks() -> dict[int, tuple[str, float]]:
    """tid -> (comm, cpu seconds) for every thread of this process."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                text = fh.read()
        except OSError:
            continue
        comm = text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        out[int(tid)] = (comm, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _thread_name(name: str) -> str:
    """'Thread-12 (_thread_main)' -> 'Thread (_thread_main)': one row per kind of thread."""
    return re.sub(r"^Thread-\d+", "Thread", name)


class Sampler:
    def __init__(self, directory: str, interval_s: float = 0.001):
        self.dir = directory
        self.interval_s = interval_s
        self._cat: dict[str, tuple[str, str]] = {}
        self._gc_t0 = 0.0
        self.gc_s = 0.0
        self.gc_runs = 0

    # --- stack classification ----------------------------------------------------------
    def _where(self, filename: str) -> tuple[str, str]:
        """(category, short file name), cached per file."""
        got = self._cat.get(filename)
        if got is None:
            i = filename.rfind(_AGENT)
            if i >= 0:
                got = ("agent", filename[i + 1:])
            else:
                cat = "other"
                for needle, name in _LIBS:
                    if needle in filename:
                        cat = name
                        break
                got = (cat, os.path.basename(filename))
            self._cat[filename] = got
        return got

    def _stack_key(self, frame) -> tuple[str, str, str, str]:
        """(leaf category, leaf 'file:line func', innermost agent function, library the
        innermost agent function called into ('' when the leaf is our own code))."""
        leaf_cat, leaf_file = self._where(frame.f_code.co_filename)
        leaf = f"{leaf_file}:{frame.f_lineno} {frame.f_code.co_name}"
        agent_fn, lib = "-", ""
        f = frame
        below = None
        while f is not None:
            cat, short = self._where(f.f_code.co_filename)
            if cat == "agent":
                agent_fn = f"{short}:{f.f_code.co_name}"
                lib = below or ""
                break
            below = cat
            f = f.f_back
        return leaf_cat, leaf, agent_fn, lib

    # --- gc ----------------------------------------------------------------------
    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.thread_time()
        else:
            self.gc_s += time.thread_time() - self._gc_t0
            self.gc_runs += 1

    # --- one phase ------------------------------------------------------------------
    def profile(self, until) -> dict:
        """Sample until ``until()`` is true; the phase's figures."""
        me = threading.get_ident()
        last: dict[int, int] = {}
        cells: dict[tuple, list] = collections.defaultdict(lambda: [0, 0])
        by_thread: dict[str, int] = collections.Counter()
        self.gc_s, self.gc_runs = 0.0, 0
        gc.callbacks.append(self._gc)
        # a thread that holds the GIL gives it up at least this often, so the sampler sees it
        # in the middle of its work, not only at its next blocking call (the bias above)
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, self.interval_s / 2))
        tasks0 = _tasks()
        times0 = os.times()
        wall0 = time.monotonic()
        my0 = time.thread_time()
        samples = 0
        check = 0
        try:
            while True:
                check += 1
                if check % 20 == 0 and until():
                    break
                frames = sys._current_frames()
                active = threading._active  # type: ignore[attr-defined]
                for ident, frame in frames.items():
                    if ident == me:
                        continue
                    try:
                        cpu = time.clock_gettime_ns(time.pthread_getcpuclockid(ident))
                    except OSError:
                        continue
                    prev = last.get(ident)
                    last[ident] = cpu
                    if prev is None or cpu <= prev:
                        continue
                    t = active.get(ident)
                    name = _thread_name(t.name) if t is not None else f"ident-{ident}"
                    key = (name, *self._stack_key(frame))
                    c = cells[key]
                    c[0] += cpu - prev
                    c[1] += 1
                    by_thread[name] += cpu - prev
                samples += 1
                del frames
                time.sleep(self.interval_s)
        finally:
            gc.callbacks.remove(self._gc)
            sys.setswitchinterval(switch)
        wall = time.monotonic() - wall0
        times1 = os.times()
        tasks1 = _tasks()
        names = {t.native_id: _thread_name(t.name) for t in threading.enumerate()}
        per_task: dict[str, float] = collections.Counter()
        for tid, (comm, cpu) in tasks1.items():
            base = tasks0.get(tid, (comm, 0.0))[1]
            per_task[names.get(tid, f"[native] {comm}")] += cpu - base
        return {
            "pid": os.getpid(), "wall_s": wall, "samples": samples,
            "cpu_user_s": times1.user - times0.user, "cpu_sys_s": times1.system - times0.system,
            "sampler_cpu_s": time.thread_time() - my0,
            "gc_s": self.gc_s, "gc_runs": self.gc_runs,
            "threads_sampled_s": {k: v / 1e9 for k, v in by_thread.items()},
            "threads_proc_s": dict(per_task),
            "cells": [[*k, v[0] / 1e9, v[1]] for k, v in cells.items()],
        }

    # --- control ------------------------------------------------------------------------
    def _control(self) -> tuple[str, str]:
        try:
            with open(os.path.join(self.dir, "control")) as fh:
                word, _, tag = fh.read().strip().partition(" ")
                return word, tag
        except OSError:
            return "", ""

    def run(self) -> None:
        done: set = set()
        while True:
            word, tag = self._control()
            if word == "start" and tag not in done:
                out = self.profile(lambda: self._control() != ("start", tag))
                done.add(tag)
                path = os.path.join(self.dir, f"{os.getpid()}.{tag}.json")
                with open(path + ".tmp", "w") as fh:
                    json.dump(out, fh)
                os.replace(path + ".tmp", path)
                continue
            time.sleep(0.02)


def arm(directory: str, interval_s: float = 0.001) -> None:
    """Start the (idle) sampler thread in this process."""
    s = Sampler(directory, interval_s)
    threading.Thread(target=s.run, name="bench-sampler", daemon=True).start()
