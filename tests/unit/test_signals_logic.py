"""Pure logic of the sensor: decoding, rates, stall rule, /proc parsers, check logic."""

from __future__ import annotations

import collections
import ctypes as ct
import os

import pytest

from agent.signals import abi, check, procfs
from agent.signals.decode import decode_conn, decode_exec
from agent.signals.history import window_rate
from agent.signals.sensor import Sensor


def _exec_bytes(argv: list[bytes], **kw) -> bytes:
    raw = abi.ExecEventRaw(kind=abi.EV_EXEC, **kw)
    buf = b"".join(a + b"\0" for a in argv)
    ct.memmove(ct.addressof(raw) + abi.ExecEventRaw.args.offset, buf, len(buf))
    raw.argc, raw.args_len = len(argv), len(buf)
    return bytes(raw)[: abi.ExecEventRaw.args.offset + len(buf)]  # the kernel sends only what is used


def test_decode_exec_from_a_short_record():
    data = _exec_bytes([b"/bin/echo", b"hello world", b"\xff"], pid=10, tid=10, ppid=9, uid=1000, gid=100, slot=3,
                       ts_ns=5_000_000_000, filename=b"/bin/echo", flags=abi.EXEC_ARGV_TRUNCATED)
    e = decode_exec(data, wall_offset=1000.0)
    assert (e.pid, e.ppid, e.uid, e.gid, e.slot, e.filename) == (10, 9, 1000, 100, 3, "/bin/echo")
    assert e.argv == ["/bin/echo", "hello world", "\\xff"] and e.argv_truncated and e.argv_source == "kernel"
    assert e.ts == pytest.approx(1005.0) and not e.node_activity


def test_decode_exec_node_activity_and_missing_argv_falls_back_to_proc():
    data = _exec_bytes([], pid=os.getpid(), ppid=1, slot=0, filename=b"/usr/bin/python3", flags=abi.EXEC_ARGV_MISSING)
    e = decode_exec(data, 0.0)
    assert e.slot is None and e.node_activity
    assert e.argv_source == "proc" and e.argv and "python" in e.argv[0]


@pytest.mark.parametrize("old,new,kind", [(7, 2, "connect"), (2, 1, "established"), (2, 7, "connect_failed"),
                                          (1, 7, "close"), (8, 7, "close")])
def test_decode_conn_kinds(old, new, kind):
    raw = abi.ConnEventRaw(kind=abi.EV_CONN, slot=4, oldstate=old, newstate=new, family=abi.AF_INET, sport=40000,
                           dport=2379, duration_ns=1_500_000_000, retrans=2)
    raw.daddr[:4] = [127, 0, 0, 1]
    c = decode_conn(bytes(raw), 0.0)
    assert (c.kind, c.slot, c.daddr, c.dport, c.duration_s, c.retransmits) == (kind, 4, "127.0.0.1", 2379, 1.5, 2)


def test_window_rate_uses_age_for_young_series_and_window_later():
    h = collections.deque([(100.0, 0, 0), (101.0, 2, 1), (102.0, 4, 1)])
    rate, fails = window_rate(h, now=102.0, window=5.0, start=100.0)
    assert rate == pytest.approx(2.0) and fails == 1
    h = collections.deque([(100.0, 0, 0), (110.0, 10, 0), (118.0, 20, 3)])
    rate, fails = window_rate(h, now=120.0, window=5.0, start=100.0)
    assert rate == pytest.approx(2.0) and fails == 3


def test_stall_rule():
    s = abi.SockInfo(state=abi.TCP_SYN_SENT, start_ns=10)
    assert abi.sock_stall_start_ns(s, 10**12) == 10
    e = abi.SockInfo(state=abi.TCP_ESTABLISHED, streak_ns=1_000, last_retrans_ns=2_000_000_000, gap_ns=400_000_000)
    assert abi.sock_stall_start_ns(e, 3_000_000_000) == 1_000          # next RTO still due
    assert abi.sock_stall_start_ns(e, 2_000_000_000 + 1_900_000_000) == 0  # silence > 2*gap + 1 s: recovered
    assert abi.sock_stall_start_ns(abi.SockInfo(state=abi.TCP_ESTABLISHED), 5) == 0


def test_endpoint_keys_cover_v4_mapped():
    keys = abi.endpoint_keys(("127.0.0.1", "::1"), 2379)
    assert [(k.family, k.port) for k in keys] == [(2, 2379), (10, 2379), (10, 2379)]
    assert bytes(keys[0].addr[:4]) == b"\x7f\0\0\1" and bytes(keys[1].addr[10:]) == b"\xff\xff\x7f\0\0\1"
    assert bytes(keys[2].addr) == b"\0" * 15 + b"\1"
    assert ct.sizeof(abi.ep_key(2, b"\1\2\3\4", 1)) == 20


def test_snmp_and_proc_net_tcp_parsers():
    snmp = ("Ip: Forwarding DefaultTTL\nIp: 1 64\n"
            "Tcp: RtoAlgorithm ActiveOpens AttemptFails EstabResets RetransSegs OutRsts\nTcp: 1 20 3 1 42 7\n")
    assert procfs.parse_snmp_like(snmp)["Tcp"]["RetransSegs"] == 42
    tcp = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
           "   0: 0100007F:9C40 0100007F:0950 02 00000000:00000000 01:00000100 00000002     0        0 1 1\n"
           "   1: 0100007F:9C41 0100007F:0950 01 00000000:00000000 00:00000000 00000000     0        0 2 1\n")
    rows = procfs.parse_proc_net_tcp(tcp)
    assert rows[0] == ("127.0.0.1", 40000, "127.0.0.1", 2384, 2, 2, 1) and rows[1][4:] == (1, 0, 2)


def test_slot_and_perf_pages_validation_and_disabled_mode():
    with pytest.raises(ValueError):
        Sensor(lambda *a: None, perf_pages=3)
    s = Sensor(lambda fn, *a: None, enabled=False, proc_interval_s=60)
    assert s.start() == "degraded: bpf.enabled is false" and not s.is_bpf
    try:
        for bad in (0, 1024, "1"):
            with pytest.raises(ValueError):
                s.track(os.getpid(), bad)
        s.track(os.getpid(), 7)
        assert s.slot_signals(7).available is False
        assert s.tracked_slots() == [7]
        s.untrack(7)
        assert s.tracked_slots() == []
        assert s.status()["mode"].startswith("degraded")
    finally:
        s.stop()


def _fake_tracefs(tmp_path, drop: tuple[str, str] | None = None, extra: str = ""):
    for tp, spec in abi.TRACEPOINTS.items():
        cat, name = tp.split(":")
        d = tmp_path / "events" / cat / name
        d.mkdir(parents=True)
        names = list(spec["required"]) + [n for ns in spec.get("optional", {}).values() for n in ns]
        lines = [f"\tfield:int {n};\toffset:{8 + 4 * i};\tsize:4;\tsigned:1;" for i, n in enumerate(names)
                 if (tp, n) != drop]
        if tp == "tcp:tcp_send_reset":
            lines.append(extra)
        (d / "format").write_text(f"name: {name}\nformat:\n" + "\n".join(lines) + "\n")
    return str(tmp_path)


def test_check_names_a_missing_tracepoint_field(tmp_path):
    tf = _fake_tracefs(tmp_path, drop=("sock:inet_sock_set_state", "daddr_v6"))
    items = {i.name: i for i in check.check_tracepoints(tf)}
    bad = items["tracepoint sock:inet_sock_set_state"]
    assert not bad.ok and bad.missing == ["sock:inet_sock_set_state:daddr_v6"] and "jetson" in bad.fix
    assert items["tracepoint tcp:tcp_retransmit_skb"].ok


def test_compile_flags_follow_format_files(tmp_path):
    tf = _fake_tracefs(tmp_path, drop=("sched:sched_process_exit", "group_dead"),
                       extra="\tfield:enum sk_rst_reason reason;\toffset:60;\tsize:4;\tsigned:0;")
    empty = tmp_path / "hdr"
    empty.mkdir()
    flags = check.compile_flags(tf, node_activity=False, headers_dir=str(empty))
    assert "-DNODE_ACTIVITY=0" in flags and "-DHAVE_RR_ADDR" in flags
    assert "-DHAVE_EXIT_GROUP_DEAD" not in flags and "-DNEED_SK_RST_REASON_ENUM" in flags


def test_parse_format_handles_arrays_and_pointers():
    text = ("\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n"
            "\tfield:__u8 saddr[4];\toffset:34;\tsize:4;\tsigned:0;\n"
            "\tfield:const char *const * argv;\toffset:24;\tsize:8;\tsigned:0;\n"
            "\tfield:__data_loc char[] filename;\toffset:8;\tsize:4;\tsigned:0;\n")
    assert set(check.parse_format(text)) == {"saddr", "argv", "filename"}


def test_watch_url_and_records():
    s = Sensor(lambda fn, *a: None, enabled=False, proc_interval_s=60)
    s.start()
    try:
        assert s.watch_url("http://127.0.0.1:2379") == ("127.0.0.1", 2379)
        assert s.watch_url("mqtt://localhost") == ("localhost", 1883)
        with pytest.raises(ValueError):
            s.watch_url("etcd-without-port")
        assert s.endpoint_signals("127.0.0.1", 2379).available is False
    finally:
        s.stop()
    e = decode_exec(_exec_bytes([b"/bin/true"], pid=3, slot=2, filename=b"/bin/true"), 0.0)
    rec = e.to_record()
    assert rec["argv"] == ["/bin/true"] and rec["node_activity"] is False and rec["filename"] == "/bin/true"


def test_a_node_exec_ring_wakes_its_reader_well_before_it_could_fill():
    from agent.signals.polling import EXEC_RECORD_MAX, NODE_WAKEUP_EVENTS, node_wakeup

    assert node_wakeup(64) == NODE_WAKEUP_EVENTS              # the default ring: a batch of 32
    assert node_wakeup(1) == 1                                 # a one-page ring: every record
    for pages in (1, 2, 4, 8, 16, 32, 64, 128):
        assert node_wakeup(pages) * EXEC_RECORD_MAX * 4 <= max(pages * 4096, 4 * EXEC_RECORD_MAX)
