"""Run-queue wait of armed launchers + job, cgroup v1 vs rlimit, same moment: the job
reads its own /proc/$$/schedstat (field 2: ns waited on a run queue, cumulative over the
launcher's and the job's execs) before exec'ing date."""
import os, sys, time, statistics
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from agent.execute import Executor, RunSpec, Limits
from agent.execute.backends import probe
out = os.path.join(TMP, "rq.txt"
job = os.path.join(TMP, "rqjob.sh"
open(job, "w").write('#!/bin/sh\nread a b c </proc/$$/schedstat\nexec /bin/date "+$MILLWRIGHT_JOB_ID $b %s.%N" >>' + out + "\n")
os.chmod(job, 0o755)
try: os.unlink(out)
except FileNotFoundError: pass
exs = {name: Executor(probe(name, root_name=f"mw-rq-{os.getpid()}"), fos.path.join(TMP, "runs-{name}") for name in ("cgroup1", "rlimit")}
due = {}
done = []
t0 = time.monotonic() + 2.0
n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
for i in range(n):
    for k, (name, ex) in enumerate(exs.items()):
        at = t0 + i * 0.05 + k * 0.025
        jid = f"{name}-{i}"
        due[jid] = time.time() + (at - time.monotonic())
        ex.prepare(RunSpec(jid, [job], job_id=jid, limits=Limits(1.0, 64, 16)), lambda h, r: done.append(r),
                   release_at=at, guard=lambda: True, guard_until=at + 60)
    # prepare ahead by at most ~1 s (like the claim lead): sleep while far ahead
    while time.monotonic() < t0 + i * 0.05 - 1.0:
        time.sleep(0.01)
while len(done) < 2 * n:
    time.sleep(0.1)
rows = {}
for line in open(out):
    jid, wait_ns, ts = line.split()
    rows.setdefault(jid.split("-")[0], []).append((float(ts) - due[jid], int(wait_ns) / 1e6))
print(f"load {os.getloadavg()[0]:.2f}")
for name, xs in rows.items():
    d = sorted(x[0] * 1000 for x in xs); w = sorted(x[1] for x in xs)
    print(f"{name:8s} n={len(xs)} job clock p50 {d[len(d)//2]:.2f} ms p90 {d[int(len(d)*.9)]:.2f} ms max {d[-1]:.2f} ms | "
          f"run-queue wait (launcher+sh) p50 {w[len(w)//2]:.2f} ms p90 {w[int(len(w)*.9)]:.2f} ms max {w[-1]:.2f} ms")
for ex in exs.values():
    ex.close()
