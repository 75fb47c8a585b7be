"""What the sensor hands to the rest of the agent (plain dataclasses, no kernel types)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class ExecEvent:
    """A successful exec. `slot` is the job slot the process belongs to, None for node
    activity (a process outside any job)."""

    pid: int
    ppid: int
    uid: int
    gid: int
    filename: str
    argv: list[str]
    slot: Optional[int]
    ts: float                      # wall clock (time.time()) of the exec
    mono_ns: int = 0               # CLOCK_MONOTONIC ns (bpf_ktime_get_ns), 0 from /proc
    tid: int = 0                   # the thread that called execve (differs from pid after de_thread)
    argv_truncated: bool = False   # more than 20 args, an arg over 127 bytes, or over 1 KiB in all
    argv_source: str = "kernel"    # kernel | proc (read from /proc/<pid>/cmdline) | none
    source: str = "bpf"            # bpf | proc (degraded mode polling)

    @property
    def node_activity(self) -> bool:
        return self.slot is None

    def to_record(self) -> dict:
        """Fields for an audit `exec` record (the daemon adds job id, run id, policy verdict)."""
        return {"pid": self.pid, "ppid": self.ppid, "uid": self.uid, "gid": self.gid, "filename": self.filename,
                "argv": list(self.argv), "argv_truncated": self.argv_truncated, "argv_source": self.argv_source,
                "node_activity": self.node_activity, "source": self.source, "ts": self.ts}


@dataclass(frozen=True)
class ConnEvent:
    """A state change of a TCP connection opened by a tracked process.

    kind: connect (SYN sent), established, connect_failed (SYN_SENT -> CLOSE: refused,
    reset or timed out) or close. duration_s: for established and connect_failed the time
    since connect(); for close the connection's lifetime."""

    kind: str
    slot: int
    pid: int
    saddr: str
    sport: int
    daddr: str
    dport: int
    duration_s: float
    retransmits: int
    ts: float
    mono_ns: int


@dataclass(frozen=True)
class Gap:
    """Events the kernel could not deliver (perf buffer full). Counters kept in maps
    (retransmits, resets, failed connects, exec counts per slot) are not affected."""

    lost: int
    cpu: int                      # -1 for an inferred gap
    ts: float
    total_lost: int               # perf-buffer losses so far (kernel-reported)
    inferred: bool = False        # True: found by exec accounting (slot's kernel exec count > events)
    slot: Optional[int] = None    # the slot whose exec events are missing (inferred gaps)

    def to_record(self) -> dict:
        """Fields for an audit `gap` record."""
        return {"lost": self.lost, "cpu": self.cpu, "ts": self.ts, "total_lost": self.total_lost,
                "inferred": self.inferred, "slot": self.slot,
                "what": "exec events of this slot" if self.inferred else "sensor events (perf buffer full)"}


@dataclass(frozen=True)
class SlotSignals:
    """Network and exec signals of one job slot since it was first tracked."""

    slot: int
    available: bool                 # False in degraded mode: no per-job attribution
    retransmits: int = 0
    retrans_per_s: float = 0.0      # over the sensor's window (shorter while the slot is young)
    resets: int = 0                 # received + sent on the slot's connections
    resets_rx: int = 0
    resets_tx: int = 0
    connects: int = 0
    failed_connects: int = 0
    failed_connects_in_window: int = 0
    execs: int = 0                  # counted in the kernel: exact even when events were lost
    stalled_connections: int = 0    # in SYN_SENT or in an active retransmit streak
    oldest_stall_age_s: float = 0.0  # age of the oldest of those, 0 when none


@dataclass(frozen=True)
class EndpointSignals:
    """Retransmits towards one watched endpoint (the agent's etcd or MQTT server),
    counted for every socket on the node that talks to it."""

    host: str
    port: int
    available: bool
    addresses: tuple[str, ...] = ()
    retransmits: int = 0
    retrans_per_s: float = 0.0
    resets: int = 0
    failed_connects: int = 0
    last_retransmit_age_s: Optional[float] = None   # None: never
    stalled_sockets: Optional[int] = None            # degraded mode: sockets with unrecovered retransmits (/proc/net/tcp)


@dataclass(frozen=True)
class NodeSignals:
    """Node-wide TCP counters from /proc/net/snmp and /proc/net/netstat (both modes)."""

    retrans_segs: int = 0
    retrans_per_s: float = 0.0
    syn_retrans: int = 0
    active_opens: int = 0
    attempt_fails: int = 0
    estab_resets: int = 0
    out_rsts: int = 0
    ts: float = 0.0
    extra: dict = field(default_factory=dict)
