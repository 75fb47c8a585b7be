#!/usr/bin/python3
"""The installed .deb under a real systemd: stop, restart and the watchdog during a long run.

    packaging/test-systemd.py [--deb FILE]        (root; needs systemd-nspawn: systemd-container)

Boots systemd with ``systemd-nspawn --boot`` in a throw-away overlay of the host's own
Debian 12 root (the host has the package's dependencies; the packaging tests' debootstrap
roots are minbase and would need the network for them), installs the .deb there, starts
``millwright.service`` against an etcd on the host, plus a peer agent on the host, and
checks, with a 30 s job whose script logs its own heartbeats:

1. ``systemctl restart`` during the run (retries allowed, default retry.on): the run is
   killed and recorded (killed/agent_stopped, one run_end audit record), no process of it
   is left, and no second run ever starts;
2. ``systemctl stop`` with retry.on owner_lost: the peer runs attempt 2 only after every
   process of attempt 1 is gone;
3. Type=notify and the watchdog: the unit is active only after READY=1; with a drop-in
   ``WatchdogSec=3``, a SIGSTOPped agent is killed by systemd's watchdog, and its run
   dies before its lease can expire.

Everything is torn down at the end (container, overlay mount, etcd, peer).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from agent.config import EtcdConfig  # noqa: E402
from agent.coordination.etcd import EtcdClient  # noqa: E402
from agent.coordination.jobstore import JobStore  # noqa: E402
from agent.coordination.keys import Keys, shard_of  # noqa: E402
from agent.demo.services import AgentProcess, EtcdServer  # noqa: E402

SHARDS = 4
OWNER_LOST = ["failed", "timed_out", "owner_lost"]


class Box:
    """A booted systemd container over an overlay of the host root."""

    def __init__(self, work: str, deb_dir: str):
        self.work = work
        self.root = os.path.join(work, "root")
        for d in ("upper", "ovl-work", "root"):
            os.makedirs(os.path.join(work, d), exist_ok=True)
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir=/,upperdir={work}/upper,workdir={work}/ovl-work", self.root], check=True)
        env = {**os.environ, "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "0"}   # this host is a v1 hybrid
        self.log = open(os.path.join(work, "nspawn.log"), "wb")
        self.nspawn = subprocess.Popen(["systemd-nspawn", "--register=no", "--keep-unit", "-D", self.root, "--boot",
                                        f"--machine=mwtest{os.getpid()}", f"--bind-ro={deb_dir}:/mnt/deb"],
                                       stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.init = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = subprocess.run(["pgrep", "-P", str(self.nspawn.pid), "-x", "systemd"], capture_output=True, text=True)
            if out.stdout.strip():
                self.init = out.stdout.split()[0]
                if self.sh("systemctl is-system-running").strip() in ("running", "degraded"):
                    return
            time.sleep(0.5)
        raise RuntimeError(f"the container did not boot (see {work}/nspawn.log)")

    def sh(self, cmd: str) -> str:
        r = subprocess.run(["nsenter", "-t", str(self.init), "-a", "--", "/bin/sh", "-c", cmd],
                           capture_output=True, text=True)
        return (r.stdout + r.stderr).strip()

    def close(self) -> None:
        if self.nspawn.poll() is None:
            self.nspawn.terminate()   # nspawn asks the container's systemd to power off
            try:
                self.nspawn.wait(30)
            except subprocess.TimeoutExpired:
                self.nspawn.kill()
                self.nspawn.wait()
        subprocess.run(["umount", self.root], check=False)


def group_alive(pgid: int) -> list[int]:
    out = []
    for n in os.listdir("/proc"):
        if n.isdigit():
            try:
                d = open(f"/proc/{n}/stat", "rb").read()
            except OSError:
                continue
            r = d[d.rfind(b")") + 2:].split()
            if r[0] not in (b"Z", b"X") and int(r[2]) == pgid:
                out.append(int(n))
    return out


def host_pid(ns_pid: int) -> int:
    """The host pid of the heartbeat script whose pid in the container is ns_pid."""
    for n in os.listdir("/proc"):
        if n.isdigit():
            try:
                for line in open(f"/proc/{n}/status"):
                    if line.startswith("NSpid:"):
                        f = line.split()[1:]
                        if len(f) > 1 and int(f[-1]) == ns_pid and b"mw-heartbeat" in open(f"/proc/{n}/cmdline", "rb").read():
                            return int(n)
            except OSError:
                pass
    raise AssertionError(f"run with container pid {ns_pid} not found")


def wait(pred, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deb", help="the package (default: built from this tree)")
    args = ap.parse_args()
    if os.geteuid() != 0 or not shutil.which("systemd-nspawn"):
        print("test-systemd: needs root and systemd-nspawn (apt-get install systemd-container)", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="mw-systemd-", dir="/var/tmp")
    deb_dir = os.path.join(work, "deb")
    os.makedirs(deb_dir)
    if args.deb:
        shutil.copy(args.deb, deb_dir)
    else:
        subprocess.run([os.path.join(REPO, "packaging", "build.sh"), "--no-lint", "--out", deb_dir], check=True,
                       stdout=subprocess.DEVNULL)
    deb = os.path.basename(glob.glob(os.path.join(deb_dir, "millwright_*.deb"))[0])
    etcd = EtcdServer(os.path.join(work, "etcd"))
    os.makedirs(etcd.dir, exist_ok=True)
    etcd.start()
    box = peer = None
    failures = []
    try:
        box = Box(work, deb_dir)
        hb = "/var/lib/millwright/hb.log"
        hb_host = box.root + hb
        print(box.sh(f"dpkg -i /mnt/deb/{deb} >/dev/null 2>&1; dpkg -s millwright | grep -E '^(Status|Version)'"))
        shutil.copy(os.path.join(REPO, "tests", "jobs", "heartbeat.sh"), box.root + "/usr/local/bin/mw-heartbeat")
        os.chmod(box.root + "/usr/local/bin/mw-heartbeat", 0o755)
        with open(box.root + "/etc/millwright/keys.yaml", "w") as fh:
            fh.write('cloud-1: {alg: hmac-sha256, secret: "' + "A" * 44 + '"}\n')
        os.chmod(box.root + "/etc/millwright/keys.yaml", 0o600)
        tpl = {"argv": ["/usr/local/bin/mw-heartbeat", hb, "{secs}"], "params": {"secs": "^[0-9]+$"}, "user": "root",
               "allow_exec": ["/bin/*", "/usr/bin/*", "/usr/local/bin/*"]}
        cfg = {"cluster": "sd", "shards": SHARDS, "agent_id": "boxed", "drain_timeout_s": 2,
               "etcd": {"endpoints": [etcd.endpoint], "lease_ttl_s": 4, "renew_deadline_s": 2.5, "retry_period_s": 0.5,
                        "insecure": True},
               "mqtt": {"url": "mqtt://127.0.0.1:9", "insecure": True}, "metrics": {"listen": ""}, "bpf": {"enabled": False},
               "execute": {"kill_grace_s": 1}, "templates": {"hb": tpl}}
        with open(box.root + "/etc/millwright/agent.yaml", "w") as fh:
            json.dump(cfg, fh)   # JSON is YAML
        print(box.sh("millwright config check | head -1; systemctl start millwright; "
                     "systemctl show millwright -p Type -p ActiveState -p SubState -p WatchdogUSec | tr '\\n' ' '"))
        peer_cfg = {k: v for k, v in cfg.items() if k != "agent_id"}
        peer_cfg["templates"] = {"hb": {**tpl, "argv": [os.path.join(REPO, "tests", "jobs", "heartbeat.sh"), hb_host, "{secs}"],
                                        "allow_exec": ["/bin/*", "/usr/bin/*", os.path.join(REPO, "tests", "jobs", "*")]}}
        peer_cfg.pop("drain_timeout_s")
        cwd = os.getcwd()
        os.chdir(REPO)
        try:
            peer = AgentProcess("peer", os.path.join(work, "peer"), peer_cfg).start()
        finally:
            os.chdir(cwd)
        keys = Keys("sd")
        client = EtcdClient(EtcdConfig(endpoints=[etcd.endpoint], request_timeout_s=2.0))
        store = JobStore(client, keys, SHARDS, "test")

        def owners():
            kvs, _ = client.get_prefix(keys.shards_prefix())
            return {keys.shard_number(kv.key): kv.value.decode() for kv in kvs}

        wait(lambda: set(owners().values()) == {"boxed", "peer"}, 30, "both agents to own shards")

        def log():
            try:
                return [l.split() for l in open(hb_host) if l.strip()]
            except OSError:
                return []

        def start_job(name: str, retry: dict):
            o = owners()
            i = 0
            while o.get(shard_of(f"{name}{i}", SHARDS)) != "boxed":
                i += 1
            jid = f"{name}{i}"
            n0 = len(log())
            store.create({"v": 1, "id": jid, "template": "hb", "params": {"secs": "30"}, "schedule": {}, "retry": retry})
            wait(lambda: len([l for l in log()[n0:] if l[0] == "hb"]) > 3, 30, f"{jid} running")
            first = [l for l in log()[n0:] if l[0] == "start"][0]
            return jid, n0, host_pid(int(first[4]))

        def records(jid):
            kvs, _ = client.get_prefix(keys.runs_prefix(shard_of(jid, SHARDS), jid))
            return [json.loads(kv.value) for kv in kvs]

        def check(cond: bool, what: str) -> None:
            print(("ok   " if cond else "FAIL ") + what)
            if not cond:
                failures.append(what)

        # 1. restart during a long run, retries allowed (default retry.on)
        jid, n0, pgid = start_job(f"restart{int(time.time())}-", {"max_attempts": 3, "backoff_s": 0})
        before = box.sh("systemctl show -p MainPID --value millwright")
        t0 = time.monotonic()
        box.sh("systemctl restart millwright")
        print(f"\n1. systemctl restart took {time.monotonic() - t0:.2f} s")
        check(not group_alive(pgid), "no process of the run is left when restart returns")
        time.sleep(6)
        starts = [l for l in log()[n0:] if l[0] == "start"]
        (rec,) = records(jid)
        check(len(starts) == 1, f"one run only (starts: {[(s[1], s[2]) for s in starts]})")
        check((rec["state"], rec["reason"]) == ("killed", "agent_stopped"), f"record {rec['state']}/{rec['reason']}")
        check(box.sh(f"millwright audit show --type job --job {jid} --json | grep -c '\"run_end\"'") == "1",
              "one run_end audit record")
        check(box.sh("systemctl show -p MainPID --value millwright") != before
              and box.sh("systemctl is-active millwright") == "active", "the unit restarted and is active")

        # 2. stop with owner_lost retries: the peer's attempt 2 starts after attempt 1 is dead
        jid, n0, pgid = start_job(f"stop{int(time.time())}-", {"max_attempts": 3, "backoff_s": 0, "on": OWNER_LOST})
        t0 = time.monotonic()
        box.sh("systemctl stop millwright")
        print(f"\n2. systemctl stop took {time.monotonic() - t0:.2f} s")
        check(not group_alive(pgid), "no process of the run is left when stop returns")
        wait(lambda: [l for l in log()[n0:] if l[0] == "start" and l[2] == "2"], 20, "the peer's attempt 2")
        lines = log()[n0:]
        last1 = max(float(l[2]) for l in lines if l[0] == "hb" and l[1] == "1")
        start2 = float([l for l in lines if l[0] == "start" and l[2] == "2"][0][3])
        check(start2 > last1, f"attempt 2 started {start2 - last1:.3f} s after attempt 1's last heartbeat")
        box.sh("systemctl start millwright")

        # 3. the watchdog kills a frozen agent; its run dies before the lease can expire
        box.sh("mkdir -p /etc/systemd/system/millwright.service.d && printf '[Service]\\nWatchdogSec=3\\n"
               "TimeoutAbortSec=2\\nRestartSec=1\\n' > /etc/systemd/system/millwright.service.d/wd.conf && "
               "systemctl daemon-reload && systemctl restart millwright")
        wait(lambda: "boxed" in owners().values(), 30, "the agent to own shards again")
        jid, n0, pgid = start_job(f"wd{int(time.time())}-", {"max_attempts": 3, "backoff_s": 0})
        t_stop = time.time()
        box.sh("systemctl kill -s SIGSTOP --kill-whom=main millwright")
        wait(lambda: not group_alive(pgid), 20, "the frozen agent's run to die")
        last = max(float(l[2]) for l in log()[n0:] if l[0] == "hb" and l[1] == "1")
        print(f"\n3. run's last heartbeat {last - t_stop:.2f} s after the agent was frozen (lease TTL 4 s)")
        check(last - t_stop < 4.0, "the frozen agent's run died before its lease could expire")
        wait(lambda: "watchdog" in box.sh("journalctl -u millwright --no-pager | grep -i 'watchdog timeout'").lower(),
             20, "systemd's watchdog")
        check(True, "systemd killed the frozen agent: " + box.sh(
            "journalctl -u millwright --no-pager -o cat | grep -i 'watchdog timeout' | tail -1"))
        box.sh("rm /etc/systemd/system/millwright.service.d/wd.conf; systemctl daemon-reload")
    finally:
        if peer is not None:
            peer.kill()
        if box is not None:
            box.close()
        etcd.close()
        shutil.rmtree(work, ignore_errors=True)
    print("\ntest-systemd:", "FAILED: " + "; ".join(failures) if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
