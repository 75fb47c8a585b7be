#!/usr/bin/env python3
"""How many Python function calls the daemon's loop makes per firing, and where (issue
36): a deterministic profile (cProfile) of the loop thread only, enabled and disabled by
callbacks posted to the loop at the edges of bench_trigger's firing window (from just
before the first claim to 1.5 s after the last due time).

Call counts per firing are exact; times are inflated by the profiler (about 1.5-2x),
so read them as shares, and take CPU figures from bench_trigger.py or
profile_firing_cpu.py. Time in the loop's queue wait and in its wait for a spawn thread
is listed apart from the CPU.

    /usr/bin/python3 bench/profile_loop_calls.py [--jobs 3000] [--over 30] [--top 40] [--sort tottime|cumulative|ncalls]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from agent.runtime import loop as loop_module  # noqa: E402
from trigger_millwright import Options, run_millwright, window_start  # noqa: E402
from trigger_workload import Workload  # noqa: E402

WAITS = ("{method 'get' of '_queue.SimpleQueue' objects}", "{method 'acquire' of '_thread.lock' objects}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=3000)
    ap.add_argument("--over", type=float, default=30.0)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--sort", default="tottime", choices=("tottime", "cumulative", "ncalls"))
    ap.add_argument("--lead", type=float, default=0.25)
    a = ap.parse_args()
    loops: list = []
    run = loop_module.EventLoop.run

    def captured(self):   # the agent's loop, to post the profiler's switches to
        loops.append(self)
        return run(self)

    loop_module.EventLoop.run = captured   # type: ignore[method-assign]
    prof = cProfile.Profile()
    w = Workload.even(a.jobs, a.over)

    def on_start(first_due: float) -> None:
        def edges() -> None:
            time.sleep(max(0.0, window_start(first_due, a.lead) - time.time()))
            loops[-1].post(prof.enable)
            time.sleep(max(0.0, first_due + w.span + 1.5 - time.time()))
            loops[-1].post(prof.disable)
        threading.Thread(target=edges, daemon=True).start()

    o = Options(backend="auto", lead=a.lead, bpf=False, slim=False, user="root", drain_s=30, runtime_dir=None)
    res = run_millwright(w, o, on_start=on_start, say=lambda line: None)
    n = max(1, res["ended"])
    st = pstats.Stats(prof, stream=io.StringIO())
    stats = st.stats  # type: ignore[attr-defined]
    calls = sum(v[1] for v in stats.values())
    waits = {k: v for k, v in stats.items() if pstats.func_std_string(k) in WAITS}
    own = sum(v[2] for k, v in stats.items() if k not in waits)
    print(f"{res['ended']} of {a.jobs} firings ended; the loop, per firing: {calls / n:.0f} function calls, "
          f"{own / n * 1e3:.3f} ms of own time under the profiler")
    for k, v in waits.items():
        print(f"  waiting in {pstats.func_std_string(k)}: {v[1] / n:.2f} calls, {v[2] / n * 1e3:.3f} ms per firing")
    key = {"tottime": 2, "cumulative": 3, "ncalls": 1}[a.sort]
    rows = sorted(((k, v) for k, v in stats.items() if k not in waits), key=lambda kv: -kv[1][key])[:a.top]
    print(f"\n{'calls/firing':>12} {'own us/firing':>14} {'cum us/firing':>14}  function")
    for k, v in rows:
        name = pstats.func_std_string(k).replace(os.path.dirname(HERE) + "/", "")
        print(f"{v[1] / n:12.2f} {v[2] / n * 1e6:14.1f} {v[3] / n * 1e6:14.1f}  {name}")


if __name__ == "__main__":
    main()
