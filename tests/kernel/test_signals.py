"""The BCC sensor on the real kernel (root, real BCC, real nftables, real etcd).

One sensor is loaded for the module (loading compiles the C program in the loader
process, ~1-2 s); the loss test loads its own with a one-page perf buffer.
"""

from __future__ import annotations

import os
import queue
import shutil
import socket
import subprocess
import threading
import time

import pytest

from tests.support.kernel import require_kernel

from agent.runtime import metrics
from agent.signals import ConnEvent, ExecEvent, Gap, Sensor, check

PY = "/usr/bin/python3"


class Pump:
    """Stands in for the daemon's event loop: post() queues, run_until() executes the
    callbacks on the test thread until a condition holds."""

    def __init__(self):
        self.q: "queue.Queue" = queue.Queue()
        self.execs: list[ExecEvent] = []
        self.conns: list[ConnEvent] = []
        self.gaps: list[Gap] = []
        self.changed_slots: set[int] = set()
        self.changed_eps: set = set()

    def post(self, fn, *args):
        self.q.put((fn, args))

    def on_signals(self, slots, eps):
        self.changed_slots |= slots
        self.changed_eps |= eps

    def run_until(self, pred, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while True:
            if pred():
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False
            try:
                fn, args = self.q.get(timeout=min(left, 0.05))
            except queue.Empty:
                continue
            fn(*args)


def _kernel_ready():
    if os.geteuid() != 0:
        return "needs root"
    return check.preflight()


def _start(pump: Pump, **kw) -> Sensor:
    why = _kernel_ready()
    require_kernel(why is None, f"BPF sensor unavailable: {why}")
    s = Sensor(pump.post, on_exec=pump.execs.append, on_conn=pump.conns.append, on_gap=pump.gaps.append,
               on_signals=pump.on_signals, **kw)
    s.start()
    if not s.is_bpf:
        s.stop()
        require_kernel(False, f"sensor did not load: {s.mode}")
    return s


@pytest.fixture(scope="module")
def sensor_pump():
    pump = Pump()
    s = _start(pump)
    yield s, pump
    s.stop()


@pytest.fixture
def blackhole():
    """Drop TCP to given loopback ports with our own nftables table, always removed."""
    require_kernel(shutil.which("nft") is not None, "nft not installed")
    table = f"mw_test_{os.getpid()}"

    def nft(*args):
        subprocess.run(["nft", *args], check=True, capture_output=True, timeout=10)

    nft("add", "table", "inet", table)
    try:
        nft("add", "chain", "inet", table, "input", "{ type filter hook input priority -10 ; policy accept ; }")

        def add(port: int):
            nft("add", "rule", "inet", table, "input", "iifname", "lo", "tcp", "dport", str(port), "drop")

        yield add
    finally:
        subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True, timeout=10)


def _spawn(sensor: Sensor, slot: int, argv: list[str], **kw) -> subprocess.Popen:
    with sensor.spawning(slot):
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)
    sensor.track(p.pid, slot)
    return p


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ------------------------------------------------------------------------ acceptance 1


def test_exec_events_attributed_to_slot_and_node_activity(sensor_pump):
    sensor, pump = sensor_pump
    slot = 11
    script = "/bin/echo one two; /bin/true three 'four five'; /bin/ls /nonexistent-mw-dir; exit 0"
    p = _spawn(sensor, slot, ["/bin/sh", "-c", script], user=65534, group=65534)
    p.wait(timeout=10)
    marker = f"mw-node-{os.getpid()}-{time.monotonic_ns()}"
    subprocess.run(["/bin/true", marker], check=True)

    def mine():
        return [e for e in pump.execs if e.slot == slot]

    def node():
        return [e for e in pump.execs if e.slot is None and marker in e.argv]

    assert pump.run_until(lambda: len(mine()) >= 4 and node(), 10), (mine(), len(pump.execs))
    by_file = {e.filename: e for e in mine()}
    assert set(by_file) == {"/bin/sh", "/bin/echo", "/bin/true", "/bin/ls"}
    assert by_file["/bin/echo"].argv == ["/bin/echo", "one", "two"]
    assert by_file["/bin/true"].argv == ["/bin/true", "three", "four five"]
    assert by_file["/bin/ls"].argv == ["/bin/ls", "/nonexistent-mw-dir"]
    for f in ("/bin/echo", "/bin/true", "/bin/ls"):
        e = by_file[f]
        assert (e.uid, e.gid) == (65534, 65534)
        assert e.ppid == p.pid, (f, e.ppid, p.pid)
        assert e.argv_source == "kernel" and not e.node_activity
    assert by_file["/bin/sh"].pid == p.pid and by_file["/bin/sh"].ppid == os.getpid()
    (n,) = node()
    assert n.node_activity and n.uid == 0 and n.ppid == os.getpid() and n.argv == ["/bin/true", marker]
    pump.run_until(lambda: sensor.slot_signals(slot).execs >= 4, 2)
    assert sensor.slot_signals(slot).execs == 4
    pump.run_until(lambda: False, 0.6)  # two sample ticks: the exec accounting finds no gap
    assert not pump.gaps
    assert metrics.sample("millwright_bpf_events_total", {"kind": "exec"}) >= 4
    tracked = sensor._kernel.maps["tracked"]
    assert p.pid not in [k.value for k in tracked.keys()]  # cleaned on exit in the kernel
    child = _spawn(sensor, slot, ["/bin/sleep", "5"])
    assert tracked.get(child.pid).value == slot
    sensor.untrack(slot)
    assert child.pid not in [k.value for k in tracked.keys()]  # untrack removes live processes too
    child.kill()
    child.wait()


def test_node_execs_reach_the_loop_in_batches_and_a_jobs_at_once(sensor_pump):
    """Execs outside any job come through a ring that wakes the poll thread once per
    batch, and the events of one wake-up reach the loop in one post; every one of them
    still arrives. A job's exec is not held back for a batch."""
    from agent.signals.polling import deliver_all

    sensor, pump = sensor_pump
    posts: list[list] = []
    real = pump.post

    def counting(fn, *args):
        if fn is deliver_all:
            posts.append([ev for _cb, ev in args[0]])
        real(fn, *args)

    sensor._poller._post = counting
    try:
        assert sensor._kernel.perf.batched   # libbcc_bpf here can set the wake-up mark
        marker = f"mw-batch-{os.getpid()}-{time.monotonic_ns()}"
        n = 200
        subprocess.run(["/bin/sh", "-c", f"i=0; while [ $i -lt {n} ]; do /bin/true {marker} $i; i=$((i+1)); done"],
                       check=True, timeout=60)

        def node():
            return [e for e in pump.execs if e.slot is None and marker in e.argv]

        assert pump.run_until(lambda: len(node()) >= n, 10), len(node())
        # all of them, once each (in order per CPU: one ring per CPU)
        assert sorted(int(e.argv[2]) for e in node()) == list(range(n))
        with_marker = [p for p in posts if any(e.slot is None and marker in e.argv for e in p)]
        assert len(with_marker) <= n // 8, [len(p) for p in with_marker]
        # a job's exec: delivered at its own wake-up, not after a batch of 32
        slot = 12
        before = len(posts)
        p = _spawn(sensor, slot, ["/bin/true", marker])
        p.wait(timeout=10)
        assert pump.run_until(lambda: any(e.slot == slot and marker in e.argv for e in pump.execs), 10)
        job_post = next(i for i, q in enumerate(posts) if any(e.slot == slot for e in q))
        assert job_post >= before
    finally:
        sensor._poller._post = real
        sensor.untrack(12)


# ------------------------------------------------------------------------ acceptance 2


def test_syn_retransmits_to_blackholed_port_attributed(sensor_pump, blackhole):
    sensor, pump = sensor_pump
    bad, good = 21, 22
    dead_port = _closed_port()
    blackhole(dead_port)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    live_port = listener.getsockname()[1]
    stuck = _spawn(sensor, bad, [PY, "-c", f"import socket; s=socket.socket(); s.settimeout(8); s.connect(('127.0.0.1', {dead_port}))"])
    healthy = _spawn(sensor, good, [PY, "-c", f"import socket,time; c=socket.create_connection(('127.0.0.1', {live_port})); c.sendall(b'x'*1000); time.sleep(0.2)"])
    try:
        assert pump.run_until(lambda: any(c.slot == bad and c.kind == "connect" for c in pump.conns), 10)
        t_connect = next(c.mono_ns for c in pump.conns if c.slot == bad and c.kind == "connect") / 1e9
        # Acceptance: attributed within 2 s of the first SYN retransmit (initial RTO 1 s).
        deadline = t_connect + 1.0 + 2.0
        assert pump.run_until(lambda: sensor.slot_signals(bad).retransmits >= 1,
                              max(0.0, deadline - time.monotonic())), sensor.slot_signals(bad)
        sig = sensor.slot_signals(bad)
        assert sig.retrans_per_s > 0 and sig.stalled_connections == 1 and sig.oldest_stall_age_s >= 1.0
        assert bad in pump.changed_slots
        assert pump.run_until(lambda: any(c.slot == good and c.kind == "established" for c in pump.conns), 10)
        healthy.wait(timeout=10)
        assert pump.run_until(lambda: any(c.slot == good and c.kind == "close" for c in pump.conns), 5)
        g = sensor.slot_signals(good)
        assert (g.retransmits, g.stalled_connections, g.failed_connects) == (0, 0, 0) and g.connects == 1
    finally:
        stuck.kill()
        healthy.kill()
        listener.close()
        stuck.wait()
    assert pump.run_until(lambda: sensor.slot_signals(bad).stalled_connections == 0, 3)
    sensor.untrack(bad)
    sensor.untrack(good)


# ------------------------------------------------------------------------ acceptance 3


def test_resets_and_failed_connects_attributed(sensor_pump):
    sensor, pump = sensor_pump
    slot = 31
    port = _closed_port()
    p = _spawn(sensor, slot, [PY, "-c", "import socket\n"
                              f"for _ in range(3):\n"
                              f"    try: socket.create_connection(('127.0.0.1', {port}))\n"
                              f"    except ConnectionRefusedError: pass"])
    p.wait(timeout=10)
    assert pump.run_until(lambda: sensor.slot_signals(slot).failed_connects >= 3, 5), sensor.slot_signals(slot)
    sig = sensor.slot_signals(slot)
    assert sig.failed_connects == 3 and sig.resets_rx == 3 and sig.resets == 3 and sig.retransmits == 0
    assert sig.failed_connects_in_window == 3
    failed = [c for c in pump.conns if c.slot == slot and c.kind == "connect_failed"]
    assert len(failed) == 3 and all(c.dport == port and c.daddr == "127.0.0.1" for c in failed)
    # a connection from outside the job (this test process) is not attributed to it
    n_conns = len(pump.conns)
    try:
        socket.create_connection(("127.0.0.1", port))
    except ConnectionRefusedError:
        pass
    pump.run_until(lambda: False, 0.6)
    assert sensor.slot_signals(slot).failed_connects == 3 and len(pump.conns) == n_conns
    sensor.untrack(slot)


def test_retransmits_towards_watched_etcd_endpoint(sensor_pump, blackhole, etcd_server):
    import etcd3

    sensor, pump = sensor_pump
    host, port = "127.0.0.1", etcd_server.port
    assert "127.0.0.1" in sensor.watch_endpoint(host, port)
    other = _closed_port()
    sensor.watch_endpoint(host, other)
    client = etcd3.client(host=host, port=port, timeout=2)
    try:
        client.put("/mw-test/k", "v")  # the agent's own connection, established and healthy
        pump.run_until(lambda: False, 0.5)
        assert sensor.endpoint_signals(host, port).retransmits == 0
        blackhole(port)
        with pytest.raises(Exception):  # noqa: B017 (a timeout or an unavailable endpoint)
            client.put("/mw-test/k", "v2")  # stalls: the request segments are dropped
        assert pump.run_until(lambda: sensor.endpoint_signals(host, port).retransmits >= 1, 5)
        sig = sensor.endpoint_signals(host, port)
        assert sig.retrans_per_s > 0 and sig.last_retransmit_age_s is not None
        assert (host, port) in pump.changed_eps
        assert sensor.endpoint_signals(host, other).retransmits == 0
    finally:
        client.close()
        sensor.unwatch_endpoint(host, port)
        sensor.unwatch_endpoint(host, other)


# ------------------------------------------------------------------------ acceptance 4


def test_exec_flood_against_tiny_buffer_counts_the_loss():
    pump = Pump()
    gate = threading.Event()
    gate.set()

    def slow_post(fn, *args):
        gate.wait(30)  # a consumer that stalls: the poll thread stops draining the ring
        pump.post(fn, *args)

    why = _kernel_ready()
    require_kernel(why is None, f"BPF sensor unavailable: {why}")
    fds_before = set(os.listdir("/proc/self/fd"))
    s = Sensor(slow_post, on_exec=pump.execs.append, on_gap=pump.gaps.append, perf_pages=1, node_activity=False)
    s.start()
    if not s.is_bpf:
        s.stop()
        require_kernel(False, f"sensor did not load: {s.mode}")
    before = metrics.sample("millwright_bpf_lost_events_total") or 0.0
    try:
        slot, n = 41, 300
        long_args = " ".join(["x" * 100] * 9)
        gate.clear()
        p = _spawn(s, slot, ["/bin/sh", "-c", f"i=0; while [ $i -lt {n} ]; do /bin/true {long_args}; i=$((i+1)); done"])
        p.wait(timeout=60)
        gate.set()
        # After the burst the node is quiet: the exec accounting reports the gap even
        # before the kernel's own loss record (written in front of the next event).
        assert pump.run_until(lambda: any(g.inferred for g in pump.gaps), 10), (pump.gaps, len(pump.execs))
        delivered = [e for e in pump.execs if e.slot == slot]
        inferred = sum(g.lost for g in pump.gaps if g.inferred and g.slot == slot)
        assert inferred == n + 1 - len(delivered)
        _spawn(s, slot, ["/bin/true", "after-flood"]).wait(timeout=10)
        n += 1
        assert pump.run_until(lambda: any(not g.inferred for g in pump.gaps) and s.slot_signals(slot).execs == n + 1,
                              10), (pump.gaps, s.slot_signals(slot), len(pump.execs), s.lost_events)
        delivered = [e for e in pump.execs if e.slot == slot]
        lost = sum(g.lost for g in pump.gaps if not g.inferred)
        assert lost > 0 and s.lost_events == lost
        assert len(delivered) < n + 1            # events were lost ...
        assert s.slot_signals(slot).execs == n + 1  # ... but the in-kernel count is exact
        assert metrics.sample("millwright_bpf_lost_events_total") - before == lost
        assert all(e.slot is not None for e in pump.execs)  # node_activity=False
    finally:
        gate.set()
        s.stop()
    # every map, perf and attachment fd is closed: the programs are detached and freed
    assert set(os.listdir("/proc/self/fd")) <= fds_before


# ------------------------------------------------------------------ degraded fallback


def test_degraded_mode_sees_a_stalled_job_connection(blackhole):
    """Without BPF the per-job view is reduced to stalled sockets found through /proc."""
    pump = Pump()
    s = Sensor(pump.post, on_signals=pump.on_signals, enabled=False, proc_interval_s=0.2)
    assert s.start().startswith("degraded")
    port = _closed_port()
    blackhole(port)
    p = subprocess.Popen([PY, "-c", f"import socket; s=socket.socket(); s.settimeout(8); s.connect(('127.0.0.1', {port}))"])
    try:
        s.track(p.pid, 51)
        assert pump.run_until(lambda: s.slot_signals(51).stalled_connections == 1, 5), s.slot_signals(51)
        assert 51 in pump.changed_slots and not s.slot_signals(51).available
        pump.run_until(lambda: False, 0.5)
        assert s.slot_signals(51).oldest_stall_age_s >= 0.4
    finally:
        p.kill()
        p.wait()
        s.stop()
