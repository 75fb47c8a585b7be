#!/usr/bin/env python3
"""Where an agent's CPU goes while it ingests pushes (issue 18): the evidence for what
bounds bench/bench_ingest.py's figures.

Runs bench_ingest's workload (its ``run``, one agent, same setup: real etcd, mosquitto
and ``millwright run``) with bench/thread_sampler.py armed inside the agent (through a
``sitecustomize`` first on its PYTHONPATH) and profiles two phases: the paced pushes
(100/s) and the burst. A phase ends when the agent is quiet again (its CPU under 5% of a
core for 0.3 s, at most 10 s after the last accepted status), so the work that follows
an answer (PUBACKs, marker deletes, the ``scheduled`` statuses) counts too.

Prints, per phase: pushes/s, the agent's CPU seconds per push (process total from
/proc/<pid>/stat, the sampler's own share listed apart), the CPU of etcd, mosquitto and
this benchmark process (pusher + status collector) over the same time (all share the
machine's cores), and where the agent's CPU goes: by thread, by component (the library
or our module at the innermost frame) and by function (top 25, innermost agent frame).

    /usr/bin/python3 bench/profile_ingest.py            # BENCH_PUSHES=5000, paho 1.6
    /usr/bin/python3 bench/profile_ingest.py --paho2    # paho-mqtt 2.x (make paho2)
    PROFILE_INTERVAL_MS=1 PROFILE_TOP=25 ...        # PROFILE_INTERVAL_MS=0: CPU figures only
"""

from __future__ import annotations

import collections
import json
import linecache
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import bench_ingest  # noqa: E402

TOP = int(os.environ.get("PROFILE_TOP", "25"))
INTERVAL_S = float(os.environ.get("PROFILE_INTERVAL_MS", "1")) / 1000
TICK = os.sysconf("SC_CLK_TCK")

SITECUSTOMIZE = """\
import os
if os.environ.get("MW_SAMPLER_PARENT") == str(os.getppid()):  # the agent itself, not its children
    import sys
    sys.path.insert(0, {here!r})
    import thread_sampler
    thread_sampler.arm({dir!r}, {interval!r})
"""


def proc_cpu(pid: int) -> float:
    """utime + stime of a process, seconds."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            text = fh.read()
    except OSError:
        return float("nan")
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def self_cpu() -> float:
    t = os.times()
    return t.user + t.system


class Profiler:
    """bench_ingest.run's observer: starts and stops the agent's sampler per phase."""

    def __init__(self, directory: str, sampling: bool = True):
        self.dir = directory
        self.sampling = sampling
        self.pids: dict = {}
        self.phases: dict[str, dict] = {}
        self._t0: dict = {}

    def _control(self, text: str) -> None:
        with open(os.path.join(self.dir, "control.tmp"), "w") as fh:
            fh.write(text)
        os.replace(os.path.join(self.dir, "control.tmp"), os.path.join(self.dir, "control"))

    def _cpus(self) -> dict:
        return {"agent": proc_cpu(self.agent), "etcd": proc_cpu(self.pids["etcd"]),
                "mosquitto": proc_cpu(self.pids["mosquitto"]), "bench": self_cpu()}

    def _quiet(self, timeout: float = 10.0) -> None:
        """Until the agent uses under 5% of a core for 0.3 s (its tail of work is done)."""
        deadline = time.monotonic() + timeout
        prev = proc_cpu(self.agent)
        while time.monotonic() < deadline:
            time.sleep(0.3)
            cur = proc_cpu(self.agent)
            if cur - prev < 0.015:
                return
            prev = cur

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "ready":
            self.pids = info
            self.agent = next(iter(info["agents"].values()))
            # the agent's idle cost, for reference
            c0, t0 = proc_cpu(self.agent), time.monotonic()
            time.sleep(2.0)
            self.idle_cpu_per_s = (proc_cpu(self.agent) - c0) / (time.monotonic() - t0)
            return
        name, _, edge = phase.partition("_")
        if edge == "start":
            self._control(f"start {name}")
            self._t0[name] = (time.monotonic(), self._cpus())
            return
        t_answered = time.monotonic()
        self._quiet()
        t1, c1 = time.monotonic(), self._cpus()
        self._control(f"stop {name}")
        prof = None
        if self.sampling:
            path = os.path.join(self.dir, f"{self.agent}.{name}.json")
            deadline = time.monotonic() + 30
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.05)
            with open(path) as fh:
                prof = json.load(fh)
        t0, c0 = self._t0[name]
        self.phases[name] = {**info, "wall_s": t1 - t0, "answered_s": t_answered - t0,
                             "cpu": {k: c1[k] - c0[k] for k in c1}, "profile": prof}


def component(leaf_cat: str, leaf: str) -> str:
    """The library at the innermost frame; for our own code, what the line calls (a C
    call shows as the agent line making it) or 'agent <module>'."""
    if leaf_cat != "agent":
        return leaf_cat
    path_line, _, _ = leaf.partition(" ")
    path, _, line = path_line.rpartition(":")
    src = linecache.getline(os.path.join(ROOT, path), int(line)) if line.isdigit() else ""
    for needle, what in (("_db.", "sqlite3 (C)"), ("json.", "json (C)"), ("hmac", "hmac (C)"),
                         ("hashlib", "hashlib (C)"), ("sha256", "hashlib (C)")):
        if needle in src:
            return what
    return "agent " + path.rsplit("/", 1)[0].replace("/", ".")


def table(title: str, rows: list[tuple[str, float]], total: float, top: int, per: int) -> None:
    print(f"  {title}")
    print(f"    {'CPU s':>7} {'share':>6} {'us/push':>8}  what")
    for what, s in rows[:top]:
        print(f"    {s:7.3f} {100 * s / total:5.1f}% {1e6 * s / per:8.1f}  {what}")


def report(name: str, ph: dict, idle_per_s: float) -> None:
    prof, cpu = ph["profile"], ph["cpu"]  # profile None: no sampler
    n = max(1, ph["pushes"])
    agent_s = cpu["agent"]
    rate = ph.get("per_s") or n / ph["answered_s"]
    print(f"\n== {name}: {n} pushes; {rate:.0f} pushes/s answered (durable, acknowledged)"
          + (f"; p50 {ph['p50_ms']:.1f} ms p99 {ph['p99_ms']:.1f} ms" if "p50_ms" in ph
             else f"; p99 {ph['p99_ms']:.0f} ms"))
    print(f"  window {ph['wall_s']:.2f} s (answers done after {ph['answered_s']:.2f} s, then until the agent is quiet)")
    if prof is None:  # PROFILE_INTERVAL_MS=0: the process figures only, no sampler
        print(f"  agent CPU {agent_s:.2f} s = {1000 * agent_s / n:.3f} ms/push (no sampler; idle agent "
              f"{idle_per_s * 100:.1f}% of a core)")
        print(f"  same window: etcd {cpu['etcd']:.2f} s ({1000 * cpu['etcd'] / n:.3f} ms/push), mosquitto "
              f"{cpu['mosquitto']:.2f} s ({1000 * cpu['mosquitto'] / n:.3f} ms/push), bench pusher+collector "
              f"{cpu['bench']:.2f} s (cpus={os.cpu_count()}, load {os.getloadavg()[0]:.2f})")
        return
    print(f"  agent CPU {agent_s:.2f} s = {1000 * agent_s / n:.3f} ms/push (user {prof['cpu_user_s']:.2f} s, "
          f"sys {prof['cpu_sys_s']:.2f} s; of it the sampler {prof['sampler_cpu_s']:.2f} s, "
          f"{prof['samples']} samples; gc {prof['gc_s']:.3f} s in {prof['gc_runs']} runs; "
          f"idle agent {idle_per_s * 100:.1f}% of a core)")
    net = agent_s - prof["sampler_cpu_s"]
    print(f"  without the sampler: {1000 * net / n:.3f} ms/push, i.e. at most {n / net:.0f} pushes/s "
          f"per core of agent CPU")
    print(f"  same window: etcd {cpu['etcd']:.2f} s ({1000 * cpu['etcd'] / n:.3f} ms/push), mosquitto "
          f"{cpu['mosquitto']:.2f} s ({1000 * cpu['mosquitto'] / n:.3f} ms/push), bench pusher+collector "
          f"{cpu['bench']:.2f} s; all {sum(cpu.values()):.2f} s of {2 * ph['wall_s']:.2f} core-s "
          f"(cpus={os.cpu_count()}, load {os.getloadavg()[0]:.2f})")
    threads = sorted(prof["threads_proc_s"].items(), key=lambda kv: -kv[1])
    table("by thread (/proc/self/task, 10 ms ticks)", [(k, v) for k, v in threads if v > 0], agent_s, TOP, n)
    cells = prof["cells"]  # thread, leaf_cat, leaf, agent_fn, lib, cpu_s, samples
    sampled = sum(c[5] for c in cells) or 1e-9
    print(f"  sampled CPU {sampled:.2f} s of {agent_s:.2f} s (the rest: native threads, the sampler, "
          f"threads that ended)")
    comp: dict[str, float] = collections.Counter()
    fn: dict[str, float] = collections.Counter()
    leaf: dict[str, float] = collections.Counter()
    for th, leaf_cat, lf, agent_fn, lib, s, _ in cells:
        comp[component(leaf_cat, lf)] += s
        fn[f"{agent_fn}" + (f" -> {lib}" if lib else "") + f"   [{th}]"] += s
        leaf[f"{lf}   [{th}]"] += s
    table("by component (innermost frame)", sorted(comp.items(), key=lambda kv: -kv[1]), sampled, TOP, n)
    table("by function (innermost agent frame -> the library it called) [thread]",
          sorted(fn.items(), key=lambda kv: -kv[1]), sampled, TOP, n)
    table("by line (innermost frame) [thread]", sorted(leaf.items(), key=lambda kv: -kv[1]), sampled, TOP, n)


def main() -> int:
    paho2 = "--paho2" in sys.argv[1:]
    bench_ingest.PUSHES = int(os.environ.get("BENCH_PUSHES", "5000"))
    d = tempfile.mkdtemp(prefix="mw-profile-ingest-")
    site = os.path.join(d, "site")
    os.makedirs(site)
    with open(os.path.join(site, "sitecustomize.py"), "w") as fh:
        fh.write(SITECUSTOMIZE.format(here=HERE, dir=d, interval=INTERVAL_S))
    path = ([site] if INTERVAL_S > 0 else []) + ([bench_ingest.PAHO2] if paho2 else []) + [ROOT]
    env = {"PYTHONPATH": os.pathsep.join(path), "MW_SAMPLER_PARENT": str(os.getpid())}
    print(f"ingest profile: paho {'2.x' if paho2 else '1.6'}, 1 agent, paced {bench_ingest.RATE:g}/s x 5 s, "
          f"burst of {bench_ingest.PUSHES}; "
          + (f"sampling every {INTERVAL_S * 1000:g} ms; " if INTERVAL_S > 0 else "no sampler; ")
          + f"cpus={os.cpu_count()} load={os.getloadavg()[0]:.2f}", flush=True)
    prof = Profiler(d, sampling=INTERVAL_S > 0)
    r = bench_ingest.run(1, paho2, observe=prof, agent_env=env)
    print(f"bench_ingest figures of this run: burst {r['burst_per_s']:.0f}/s (p99 {r['burst_p99_ms']:.0f} ms), "
          f"paced p50 {r['p50_ms']:.1f} ms p99 {r['p99_ms']:.1f} ms")
    for name in ("paced", "burst"):
        if name in prof.phases:
            report(name, prof.phases[name], prof.idle_cpu_per_s)
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
