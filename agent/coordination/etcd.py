"""A small, thread-safe etcd v3 client over python-etcd3's gRPC stubs.

Why not use etcd3.Etcd3Client directly everywhere: it talks to one endpoint, its
transaction() drops the response header (we need revisions for fencing and for the
history checker), and its Watcher thread leaks and spins at 100% CPU after a broken
connection (see watch.py). We keep its generated stubs and request builders, add
endpoint failover, per-call deadlines, TLS and auth, and turn every transport failure
into one exception type, :class:`EtcdUnavailable`, that callers retry with backoff.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Optional
from urllib.parse import urlparse

import etcd3
import etcd3.etcdrpc as rpc
import grpc
from etcd3 import transactions as tx
from etcd3 import utils as etcd_utils

from agent.config import EtcdConfig
from agent.runtime.metrics import counter, histogram

log = logging.getLogger(__name__)

REQUESTS = counter("millwright_etcd_requests_total", "etcd requests by operation and result", ("op", "result"))
PAGE_SIZE = histogram("millwright_etcd_range_page_bytes", "Size of one paged range response",
                      buckets=(1 << 10, 16 << 10, 128 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20))
FAILOVERS = counter("millwright_etcd_endpoint_failovers_total", "Switches to the next etcd endpoint")

# Paged ranges: at most this many keys per response, adapted to stay near PAGE_BYTES
# (gRPC refuses responses over 4 MiB by default).
PAGE_KEYS = 1000
PAGE_BYTES = 1 << 20

# ops and compares, re-exported so callers need only this module
Put = tx.Put
Delete = tx.Delete
Get = tx.Get
Create = tx.Create
Mod = tx.Mod
Version = tx.Version
Value = tx.Value
Txn = tx.Txn  # a nested transaction, as one op of another


class EtcdUnavailable(Exception):
    """Transport failure (unreachable, timeout, leader lost). Retry with backoff."""


class EtcdError(Exception):
    """etcd answered with an error that retrying will not fix."""


@dataclass(frozen=True)
class KV:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    responses: list


def as_kv(kv: Any) -> KV:
    """The KV of an etcd KeyValue message."""
    return KV(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease)


def _txn_result(r: Any, revision: int) -> TxnResult:
    """A TxnResponse as a TxnResult: ranges as lists of KV, nested transactions (ops of
    kind Txn) as TxnResults of their own (same revision), other responses as they came."""
    out: list = []
    for resp in r.responses:
        kind = resp.WhichOneof("response")
        if kind == "response_range":
            out.append([as_kv(kv) for kv in resp.response_range.kvs])
        elif kind == "response_txn":
            out.append(_txn_result(resp.response_txn, revision))
        else:
            out.append(getattr(resp, kind))
    return TxnResult(r.succeeded, revision, out)


def op_key_value(op: Any) -> tuple[Optional[str], bytes]:
    """The key and value an etcd3 transaction op writes or reads: (key, b"") for a Get or
    a Delete, (None, b"") for a nested Txn, which has no key of its own."""
    return getattr(op, "key", None), getattr(op, "value", b"") or b""


def _closed_channel(exc: ValueError) -> bool:
    """grpc raises ValueError (not RpcError) for calls on a channel another thread closed."""
    return "closed" in str(exc).lower() and "channel" in str(exc).lower()


_TRANSPORT_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


class EtcdClient:
    """Endpoint failover in config order; one gRPC channel at a time."""

    def __init__(self, cfg: EtcdConfig):
        self.cfg = cfg
        self.timeout = cfg.request_timeout_s
        self._lock = threading.Lock()
        self._index = 0
        self._client: Optional[etcd3.Etcd3Client] = None
        self._generation = 0

    # --- connection management ------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return self.cfg.endpoints[self._index % len(self.cfg.endpoints)]

    def endpoint_hostport(self) -> tuple[str, int]:
        u = urlparse(self.endpoint)
        return u.hostname or "127.0.0.1", u.port or 2379

    def _connect(self) -> etcd3.Etcd3Client:
        u = urlparse(self.endpoint)
        tls = self.cfg.tls
        kwargs: dict[str, Any] = dict(host=u.hostname, port=u.port or 2379, timeout=self.timeout,
                                      grpc_options=[("grpc.enable_retries", 0),
                                                    ("grpc.initial_reconnect_backoff_ms", 200),
                                                    ("grpc.max_reconnect_backoff_ms", 2000)])
        if u.scheme == "https" or tls is not None:
            if tls is None or not tls.ca:
                raise EtcdError(f"{self.endpoint}: https needs etcd.tls.ca")
            kwargs.update(ca_cert=tls.ca, cert_cert=tls.cert, cert_key=tls.key)
        if self.cfg.username is not None:
            kwargs.update(user=self.cfg.username, password=self.cfg.password)
        try:
            return etcd3.Etcd3Client(**kwargs)
        except grpc.RpcError as exc:
            raise self._translate(exc, "connect") from None
        except etcd3.exceptions.Etcd3Exception as exc:
            raise EtcdUnavailable(f"{self.endpoint}: {exc}") from None

    def client(self) -> tuple[etcd3.Etcd3Client, int]:
        with self._lock:
            if self._client is None:
                self._client = self._connect()
            return self._client, self._generation

    def _failover(self, generation: int) -> None:
        """Drop the channel and move to the next endpoint (once per failure generation)."""
        with self._lock:
            if generation != self._generation:
                return
            old, self._client = self._client, None
            self._generation += 1
            if len(self.cfg.endpoints) > 1:
                self._index = (self._index + 1) % len(self.cfg.endpoints)
                FAILOVERS.inc()
                log.warning("switching etcd endpoint", extra={"fields": {"endpoint": self.endpoint}})
        _close_quietly(old)

    def reconfigure(self, tls: Any, password: Optional[str]) -> None:
        """A reload changed etcd.tls (or renewed its files) or the password: the channel is
        dropped and the next call connects with them (same endpoint). The session lease is
        not tied to a connection, and each watch resumes from its revision on the new one."""
        with self._lock:
            self.cfg.tls, self.cfg.password = tls, password
            old, self._client = self._client, None
            self._generation += 1
        log.info("etcd channel reconfigured (reload)", extra={"fields": {"endpoint": self.endpoint}})
        _close_quietly(old)

    def close(self) -> None:
        with self._lock:
            c, self._client = self._client, None
        if c is not None:
            c.close()

    def _translate(self, exc: grpc.RpcError, op: str) -> Exception:
        code = exc.code() if hasattr(exc, "code") else None
        detail = exc.details() if hasattr(exc, "details") else str(exc)
        REQUESTS.labels(op, "unavailable" if code in _TRANSPORT_CODES else "error").inc()
        if code in _TRANSPORT_CODES:
            return EtcdUnavailable(f"{self.endpoint}: {op}: {code.name if code else '?'} {detail or ''}".strip())
        return EtcdError(f"{self.endpoint}: {op}: {code.name if code else '?'} {detail or ''}".strip())

    def _call(self, op: str, fn, timeout: Optional[float] = None):
        c, gen = self.client()
        try:
            result = fn(c, timeout or self.timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED and "token" in (exc.details() or "") \
                    and self.cfg.username is not None:
                # etcd's auth tokens expire (--auth-token-ttl): authenticate again on a new channel
                self._failover(gen)
                REQUESTS.labels(op, "reauth").inc()
                raise EtcdUnavailable(f"{self.endpoint}: {op}: auth token expired; re-authenticating") from None
            err = self._translate(exc, op)
            if isinstance(err, EtcdUnavailable):
                self._failover(gen)
            raise err from None
        except ValueError as exc:  # "Cannot invoke RPC on closed channel!": another thread failed over
            if not _closed_channel(exc):
                raise
            REQUESTS.labels(op, "unavailable").inc()
            raise EtcdUnavailable(f"{self.endpoint}: {op}: channel closed during failover") from None
        REQUESTS.labels(op, "ok").inc()
        return result

    def _md(self, c: etcd3.Etcd3Client) -> dict:
        # gRPC refuses call credentials on a plaintext channel; the auth token also travels
        # as metadata, which is what etcd reads, so plaintext channels send only that.
        creds = c.call_credentials if getattr(c, "uses_secure_channel", False) else None
        return dict(credentials=creds, metadata=c.metadata)

    # --- KV --------------------------------------------------------------------------
    def get(self, key: str, timeout: Optional[float] = None) -> Optional[KV]:
        def fn(c, t):
            r = c.kvstub.Range(rpc.RangeRequest(key=key.encode()), t, **self._md(c))
            return as_kv(r.kvs[0]) if r.kvs else None
        return self._call("get", fn, timeout)

    def get_prefix(self, prefix: str, keys_only: bool = False, revision: int = 0,
                   timeout: Optional[float] = None, page: int = PAGE_KEYS) -> tuple[list[KV], int]:
        """All keys under prefix, and the store revision they were read at.

        Read in pages (see range_pages): no single response nears gRPC's 4 MiB limit,
        however large the prefix grows. Every page is read at the first page's revision,
        so the result is one consistent snapshot."""
        out: list[KV] = []
        rev = revision
        for kvs, page_rev in self.range_pages(prefix, keys_only=keys_only, revision=revision, timeout=timeout,
                                              page=page):
            out.extend(kvs)
            rev = page_rev
        return out, rev

    def range_pages(self, prefix: str, keys_only: bool = False, revision: int = 0,
                    timeout: Optional[float] = None, page: int = PAGE_KEYS, start: Optional[str] = None):
        """Yield (kvs, revision) pages of a prefix in key order (from ``start``, a key
        under the prefix, when given: a paged reader continues where it stopped).

        Each page is one Range request with a limit; the next starts just after the last
        key returned (key + NUL) at the same revision. The limit adapts so a page stays
        near PAGE_BYTES (values differ in size: run records ~0.6 KB, jobs up to 64 KiB),
        and is halved when etcd or gRPC refuses a response as too large."""
        if start is not None and not start.startswith(prefix):
            raise ValueError("range_pages: start must be a key under the prefix")
        start_key = (start or prefix).encode()
        end = etcd_utils.increment_last_byte(prefix.encode())
        limit = max(1, page)
        while True:
            def fn(c, t, key=start_key, lim=limit, rev=revision):
                # no sort order: keys come in key order anyway, and a sorted range makes
                # etcd read the whole range before applying the limit
                req = rpc.RangeRequest(key=key, range_end=end, keys_only=keys_only, revision=rev, limit=lim)
                r = c.kvstub.Range(req, t, **self._md(c))
                return [as_kv(kv) for kv in r.kvs], r.header.revision, r.more, r.ByteSize()
            try:
                kvs, rev, more, size = self._call("range_page", fn, timeout)
            except EtcdError as exc:
                if "RESOURCE_EXHAUSTED" in str(exc) and limit > 1:
                    limit = max(1, limit // 4)
                    continue
                raise
            if not revision:
                revision = rev  # later pages read the same snapshot
            PAGE_SIZE.observe(size)
            yield kvs, revision
            if not more or not kvs:
                return
            start_key = kvs[-1].key.encode() + b"\0"
            if size > PAGE_BYTES:
                limit = max(1, int(limit * PAGE_BYTES / size))
            elif size < PAGE_BYTES // 4 and limit < page:
                limit = min(page, limit * 2)

    def get_last(self, prefix: str, timeout: Optional[float] = None) -> Optional[KV]:
        """The last key under prefix (in key order), in one small response (etcd still
        sorts the range server-side: use on prefixes retention keeps small)."""
        def fn(c, t):
            key = prefix.encode()
            req = rpc.RangeRequest(key=key, range_end=etcd_utils.increment_last_byte(key), limit=1,
                                   sort_order=rpc.RangeRequest.DESCEND, sort_target=rpc.RangeRequest.KEY)
            r = c.kvstub.Range(req, t, **self._md(c))
            return as_kv(r.kvs[0]) if r.kvs else None
        return self._call("get_last", fn, timeout)

    def count_prefix(self, prefix: str, timeout: Optional[float] = None) -> int:
        """How many keys are under prefix (count only: no keys or values travel)."""
        def fn(c, t):
            key = prefix.encode()
            req = rpc.RangeRequest(key=key, range_end=etcd_utils.increment_last_byte(key), count_only=True)
            return c.kvstub.Range(req, t, **self._md(c)).count
        return self._call("count", fn, timeout)

    def put(self, key: str, value: bytes | str, lease: int = 0, timeout: Optional[float] = None) -> int:
        def fn(c, t):
            req = rpc.PutRequest(key=key.encode(), value=etcd_utils.to_bytes(value), lease=lease)
            return c.kvstub.Put(req, t, **self._md(c)).header.revision
        return self._call("put", fn, timeout)

    def delete(self, key: str, timeout: Optional[float] = None) -> int:
        def fn(c, t):
            return c.kvstub.DeleteRange(rpc.DeleteRangeRequest(key=key.encode()), t, **self._md(c)).header.revision
        return self._call("delete", fn, timeout)

    def txn(self, compare: Iterable[Any], success: Iterable[Any] = (), failure: Iterable[Any] = (),
            timeout: Optional[float] = None) -> TxnResult:
        def fn(c, t):
            req = rpc.TxnRequest(compare=[x.build_message() for x in compare],
                                 success=c._ops_to_requests(list(success)),
                                 failure=c._ops_to_requests(list(failure)))
            r = c.kvstub.Txn(req, t, **self._md(c))
            return _txn_result(r, r.header.revision)
        return self._call("txn", fn, timeout)

    # --- maintenance -------------------------------------------------------------------
    def compact(self, revision: int, timeout: Optional[float] = None) -> None:
        """Drop the history before revision (keys' current values stay). Compacting at or
        below the last compacted revision is a no-op here (etcd refuses it)."""
        def fn(c, t):
            try:
                c.kvstub.Compact(rpc.CompactionRequest(revision=revision, physical=False), t, **self._md(c))
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.OUT_OF_RANGE:  # already compacted
                    return None
                raise
        return self._call("compact", fn, timeout)

    def status(self, timeout: Optional[float] = None) -> dict:
        """The connected member's status: DB size (allocated and in use), revision, leader."""
        def fn(c, t):
            r = c.maintenancestub.Status(rpc.StatusRequest(), t, **self._md(c))
            return {"db_size": r.dbSize, "db_size_in_use": getattr(r, "dbSizeInUse", 0),
                    "revision": r.header.revision, "leader": r.leader, "member": r.header.member_id,
                    "raft_term": r.raftTerm}
        return self._call("status", fn, timeout)

    # --- leases ----------------------------------------------------------------------
    def lease_grant(self, ttl: int, timeout: Optional[float] = None) -> tuple[int, int]:
        def fn(c, t):
            r = c.leasestub.LeaseGrant(rpc.LeaseGrantRequest(TTL=ttl, ID=0), t, **self._md(c))
            if r.error:
                raise EtcdError(f"lease grant: {r.error}")
            return r.ID, r.TTL
        return self._call("lease_grant", fn, timeout)

    def lease_keepalive(self, lease_id: int, timeout: Optional[float] = None) -> int:
        """One keepalive round trip; returns the remaining TTL (0: the lease is gone)."""
        def fn(c, t):
            stream = c.leasestub.LeaseKeepAlive(iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]), t, **self._md(c))
            try:
                for r in stream:
                    return r.TTL
                return 0
            finally:
                stream.cancel()
        return self._call("lease_keepalive", fn, timeout)

    def lease_revoke(self, lease_id: int, timeout: Optional[float] = None) -> None:
        def fn(c, t):
            try:
                c.leasestub.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease_id), t, **self._md(c))
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return None
                raise
        return self._call("lease_revoke", fn, timeout)

    def lease_ttl(self, lease_id: int, timeout: Optional[float] = None) -> int:
        def fn(c, t):
            return c.leasestub.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease_id), t, **self._md(c)).TTL
        return self._call("lease_ttl", fn, timeout)

    # --- watch (used by watch.PrefixWatch) ----------------------------------------------
    def open_watch(self, request_iter, prefix: str):
        """Open a raw Watch stream on the current channel; returns (call, generation)."""
        c, gen = self.client()
        try:
            return rpc.WatchStub(c.channel).Watch(request_iter, **self._md(c)), gen
        except ValueError as exc:
            if not _closed_channel(exc):
                raise
            raise EtcdUnavailable(f"{self.endpoint}: watch: channel closed during failover") from None

    def report_stream_failure(self, generation: int) -> None:
        self._failover(generation)


def _close_quietly(client: Any) -> None:
    """A channel given up (a failover or a reload): its close may fail, nothing waits on it."""
    if client is not None:
        try:
            client.close()
        except Exception:
            pass
