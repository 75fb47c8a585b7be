"""Just enough of libbcc_bpf (450 KB, no LLVM) to use maps and perf buffers whose file
descriptors were handed over by the loader process.

This is what keeps the agent small: `import bcc` pulls in libbcc with LLVM and clang
(74 MB RSS before compiling anything); this module only loads libbcc_bpf.so, BCC's thin
C library over the bpf() and perf_event_open() syscalls, which handles the perf ring
buffer's memory barriers in C.
"""

from __future__ import annotations

import ctypes as ct
import ctypes.util
import errno
import os
from typing import Any, Callable, Iterator, Optional

RAW_CB = ct.CFUNCTYPE(None, ct.py_object, ct.c_void_p, ct.c_int)
LOST_CB = ct.CFUNCTYPE(None, ct.py_object, ct.c_ulonglong)


class PerfBufferOpts(ct.Structure):
    """BCC's struct bcc_perf_buffer_opts (libbcc_bpf 0.22+)."""

    _fields_ = [("pid", ct.c_int), ("cpu", ct.c_int), ("wakeup_events", ct.c_int)]

_lib: Optional[ct.CDLL] = None


class BpfSysError(OSError):
    pass


def lib() -> ct.CDLL:
    """Load libbcc_bpf once; raises BpfSysError with a readable reason."""
    global _lib
    if _lib is not None:
        return _lib
    names = ["libbcc_bpf.so.0", ctypes.util.find_library("bcc_bpf") or ""]
    last = None
    for name in names:
        if not name:
            continue
        try:
            so = ct.CDLL(name, use_errno=True)
            break
        except OSError as exc:
            last = exc
    else:
        raise BpfSysError(errno.ENOENT, f"libbcc_bpf not found ({last}); install libbpfcc")
    so.bpf_lookup_elem.argtypes = [ct.c_int, ct.c_void_p, ct.c_void_p]
    so.bpf_lookup_elem.restype = ct.c_int
    so.bpf_update_elem.argtypes = [ct.c_int, ct.c_void_p, ct.c_void_p, ct.c_ulonglong]
    so.bpf_update_elem.restype = ct.c_int
    so.bpf_delete_elem.argtypes = [ct.c_int, ct.c_void_p]
    so.bpf_delete_elem.restype = ct.c_int
    so.bpf_get_next_key.argtypes = [ct.c_int, ct.c_void_p, ct.c_void_p]
    so.bpf_get_next_key.restype = ct.c_int
    so.bpf_open_perf_buffer.argtypes = [RAW_CB, LOST_CB, ct.py_object, ct.c_int, ct.c_int, ct.c_int]
    so.bpf_open_perf_buffer.restype = ct.c_void_p
    so.perf_reader_poll.argtypes = [ct.c_int, ct.POINTER(ct.c_void_p), ct.c_int]
    so.perf_reader_poll.restype = ct.c_int
    so.perf_reader_consume.argtypes = [ct.c_int, ct.POINTER(ct.c_void_p)]
    so.perf_reader_consume.restype = ct.c_int
    if hasattr(so, "bpf_open_perf_buffer_opts"):
        so.bpf_open_perf_buffer_opts.argtypes = [RAW_CB, LOST_CB, ct.py_object, ct.c_int, ct.POINTER(PerfBufferOpts)]
        so.bpf_open_perf_buffer_opts.restype = ct.c_void_p
    so.perf_reader_free.argtypes = [ct.c_void_p]
    so.perf_reader_free.restype = None
    so.perf_reader_fd.argtypes = [ct.c_void_p]
    so.perf_reader_fd.restype = ct.c_int
    _lib = so
    return so


class Map:
    """A BPF map by fd, with ctypes key and value types (from abi.MAPS)."""

    def __init__(self, name: str, fd: int, key_type: Any, value_type: Any):
        self.name = name
        self.fd = fd
        self.key_type = key_type
        self.value_type = value_type
        self._lib = lib()

    def _key(self, key: Any) -> Any:
        return key if isinstance(key, self.key_type) else self.key_type(key)

    def get(self, key: Any) -> Any:
        k = self._key(key)
        v = self.value_type()
        if self._lib.bpf_lookup_elem(self.fd, ct.byref(k), ct.byref(v)) != 0:
            return None
        return v

    def set(self, key: Any, value: Any) -> None:
        k = self._key(key)
        v = value if isinstance(value, self.value_type) else self.value_type(value)
        if self._lib.bpf_update_elem(self.fd, ct.byref(k), ct.byref(v), 0) != 0:
            e = ct.get_errno()
            raise BpfSysError(e, f"bpf map {self.name}: update failed: {os.strerror(e)}")

    def delete(self, key: Any) -> bool:
        k = self._key(key)
        return self._lib.bpf_delete_elem(self.fd, ct.byref(k)) == 0

    def keys(self) -> Iterator[Any]:
        """Snapshot of the keys (collected first: deleting while walking restarts walks)."""
        out = []
        cur = self.key_type()
        nxt = self.key_type()
        first = True
        while True:
            rc = self._lib.bpf_get_next_key(self.fd, None if first else ct.byref(cur), ct.byref(nxt))
            if rc != 0:
                break
            first = False
            out.append(nxt)
            cur = nxt
            nxt = self.key_type()
            if len(out) > 1 << 20:  # a changing hash map can in theory loop
                break
        return iter(out)

    def items(self) -> Iterator[tuple[Any, Any]]:
        for k in self.keys():
            v = self.get(k)
            if v is not None:
                yield k, v


class PerfBuffers:
    """Perf rings, one per CPU and perf event array, wired into the program's
    BPF_PERF_OUTPUT maps: ``outputs`` is (map fd, wakeup_events) per array. The kernel
    wakes the reader after that many records on a ring (1: at each); what sits below the
    mark is read by ``consume()``. Where libbcc_bpf cannot set the mark (before 0.22),
    every ring wakes at each record (``batched`` is False)."""

    def __init__(self, outputs: list[tuple[int, int]], cpus: list[int], page_cnt: int,
                 on_raw: Callable[[int, bytes], None], on_lost: Callable[[int, int], None]):
        so = lib()
        self._lib = so
        self._cbs = []  # keep the ctypes callbacks alive
        self.batched = hasattr(so, "bpf_open_perf_buffer_opts")
        readers = []
        try:
            for map_fd, wakeup in outputs:
                events = Map("events", map_fd, ct.c_int, ct.c_int)
                for cpu in cpus:
                    def raw(cookie, data, size, _cpu=cpu):
                        on_raw(_cpu, ct.string_at(data, size))

                    def lost(cookie, n, _cpu=cpu):
                        on_lost(_cpu, int(n))

                    rcb, lcb = RAW_CB(raw), LOST_CB(lost)
                    self._cbs.append((rcb, lcb))
                    if wakeup > 1 and self.batched:
                        opts = PerfBufferOpts(pid=-1, cpu=cpu, wakeup_events=wakeup)
                        r = so.bpf_open_perf_buffer_opts(rcb, lcb, None, page_cnt, ct.byref(opts))
                    else:
                        r = so.bpf_open_perf_buffer(rcb, lcb, None, -1, cpu, page_cnt)
                    if not r:
                        e = ct.get_errno()
                        raise BpfSysError(e, f"perf buffer for cpu {cpu}: {os.strerror(e) if e else 'failed'}")
                    readers.append(r)
                    events.set(cpu, so.perf_reader_fd(r))
        except Exception:
            for r in readers:
                so.perf_reader_free(r)
            raise
        self._n = len(readers)
        self._readers = (ct.c_void_p * self._n)(*readers)

    def poll(self, timeout_ms: int) -> None:
        """Wait up to timeout_ms and run the callbacks for what woke us (poll thread)."""
        self._lib.perf_reader_poll(self._n, self._readers, int(timeout_ms))

    def consume(self) -> None:
        """Run the callbacks for every record in every ring, woken or not (poll thread)."""
        self._lib.perf_reader_consume(self._n, self._readers)

    def close(self) -> None:
        for i in range(self._n):
            if self._readers[i]:
                self._lib.perf_reader_free(self._readers[i])
                self._readers[i] = None
        self._n = 0


def online_cpus(path: str = "/sys/devices/system/cpu/online") -> list[int]:
    """Parse '0-3,5' style CPU lists."""
    with open(path) as f:
        text = f.read().strip()
    cpus: list[int] = []
    for part in text.split(","):
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-")
            cpus.extend(range(int(a), int(b) + 1))
        else:
            cpus.append(int(part))
    return cpus
