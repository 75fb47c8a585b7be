"""A TCP proxy in front of one etcd member for one client, that can lose or delay etcd's
replies while the requests still arrive and are acted on (the fault test's "lost reply":
a claim that landed in etcd although its writer never heard so), or delay the requests
themselves (the "late write": one that reaches etcd after its writer gave up on it).

Modes: ``pass``; ``hold`` (replies are kept and delivered, late, when healed); ``drop``
(replies are discarded; when healed, the connections that lost bytes are reset, since a
stream with a hole in it cannot go on); ``hold_requests`` (the client's HTTP/2 frames are
kept and delivered, late, when healed, without its RST_STREAM frames: a request the client
gave up on still runs, as one a slow network or a middlebox delivered after its cancel
would; a connection the client closed meanwhile stays open to etcd until it answered).
Threads, one pair per connection; only loopback.
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Optional


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
RST_STREAM = 0x3
LINGER_S = 10.0     # a connection its client closed while its requests were held stays open to etcd this long


class _Conn:
    def __init__(self, client: socket.socket, server: socket.socket):
        self.client, self.server = client, server
        self.held: list[bytes] = []
        self.lost = False
        self.lock = threading.Lock()
        self.closed = False
        # the client's bytes, cut into whole HTTP/2 frames (after the connection preface)
        self.req_buf = b""
        self.preface_left = len(PREFACE)
        self.framed = True          # False: not cleartext HTTP/2 (bytes pass as they come)
        self.held_req: list[bytes] = []
        self.client_gone = False    # the client closed while its requests were held

    def frames(self, data: bytes) -> list[bytes]:
        """The whole units (preface, frames) ``data`` completes; the rest waits for more."""
        if not self.framed:
            return [data]
        buf, out = self.req_buf + data, []
        if self.preface_left:
            n = min(self.preface_left, len(buf))
            if buf[:n] != PREFACE[len(PREFACE) - self.preface_left:][:n]:
                self.framed, self.req_buf = False, b""
                return [buf]
            out.append(buf[:n])
            buf, self.preface_left = buf[n:], self.preface_left - n
        while len(buf) >= 9:
            end = 9 + int.from_bytes(buf[:3], "big")
            if len(buf) < end:
                break
            out.append(buf[:end])
            buf = buf[end:]
        self.req_buf = buf
        return out

    def close(self, reset: bool = False) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        for s in (self.client, self.server):
            try:
                if reset:   # RST, not FIN: the client sees the connection fail at once
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            except OSError:
                pass


class ReplyProxy:
    def __init__(self, listen_host: str, listen_port: int, target: tuple[str, int]):
        self.listen = (listen_host, listen_port)
        self.target = target
        self.mode = "pass"
        self.conns: list[_Conn] = []
        self.lock = threading.Lock()
        self.sock: Optional[socket.socket] = None

    @property
    def port(self) -> int:
        return self.listen[1]

    def start(self) -> "ReplyProxy":
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(self.listen)
        s.listen(64)
        self.sock = s
        threading.Thread(target=self._accept, daemon=True, name=f"proxy-{self.port}").start()
        return self

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=2.0)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c = _Conn(client, server)
            with self.lock:
                self.conns = [x for x in self.conns if not x.closed] + [c]
            threading.Thread(target=self._pump, args=(c, client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(c, server, client, True), daemon=True).start()

    def _pump(self, c: _Conn, src: socket.socket, dst: socket.socket, reply: bool) -> None:
        # bytes are decided and sent under the connection's lock, so a heal that flushes
        # the held ones keeps their order
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    if not reply:
                        with c.lock:
                            if c.held_req:   # delivered at the heal; etcd's answers then go nowhere
                                c.client_gone = True
                                return
                    break
                with c.lock:
                    if not reply:
                        frames = c.frames(data)
                        if self.mode == "hold_requests" or c.held_req:
                            c.held_req.extend(f for f in frames if not _is_rst(f))
                        else:
                            dst.sendall(b"".join(frames))
                    elif c.client_gone:
                        continue
                    elif self.mode == "hold" or (self.mode == "pass" and c.held):
                        c.held.append(data)
                    elif self.mode == "drop" or c.lost:
                        c.lost = True   # a stream with a hole: reset when healed
                    else:
                        dst.sendall(data)
        except OSError:
            pass
        c.close()

    def set_mode(self, mode: str) -> None:
        """``pass`` heals: held requests go to etcd and held replies to the client (late),
        connections that lost some are reset."""
        assert mode in ("pass", "hold", "drop", "hold_requests")
        self.mode = mode
        if mode != "pass":
            return
        with self.lock:
            conns = list(self.conns)
        for c in conns:
            reset = False
            with c.lock:
                requests, c.held_req = c.held_req, []
                try:
                    for data in requests:
                        c.server.sendall(data)
                except OSError:
                    pass
                if c.client_gone:
                    t = threading.Timer(LINGER_S, c.close)
                    t.daemon = True
                    t.start()
                held, c.held = c.held, []
                reset = c.lost
                if not reset:
                    try:
                        for data in held:
                            c.client.sendall(data)
                    except OSError:
                        reset = True
            if reset:
                c.close(reset=True)

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        with self.lock:
            conns, self.conns = self.conns, []
        for c in conns:
            c.close()


def _is_rst(frame: bytes) -> bool:
    return len(frame) >= 9 and frame[3] == RST_STREAM and not frame.startswith(PREFACE[:9])
