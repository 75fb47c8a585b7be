"""A TCP proxy in front of one etcd member for one client, that can lose or delay etcd's
replies while the requests still arrive and are acted on (the fault test's "lost reply":
a claim that landed in etcd although its writer never heard so).

Modes: ``pass``; ``hold`` (replies are kept and delivered, late, when healed); ``drop``
(replies are discarded; when healed, the connections that lost bytes are reset, since a
stream with a hole in it cannot go on). Threads, one pair per connection; only loopback.
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Optional


class _Conn:
    def __init__(self, client: socket.socket, server: socket.socket):
        self.client, self.server = client, server
        self.held: list[bytes] = []
        self.lost = False
        self.lock = threading.Lock()
        self.closed = False

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
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if not reply:
                    dst.sendall(data)
                    continue
                # replies: decided and sent under the connection's lock, so a heal that
                # flushes the held ones keeps their order
                with c.lock:
                    if self.mode == "hold" or (self.mode == "pass" and c.held):
                        c.held.append(data)
                    elif self.mode == "drop" or c.lost:
                        c.lost = True   # a stream with a hole: reset when healed
                    else:
                        dst.sendall(data)
        except OSError:
            pass
        c.close()

    def set_mode(self, mode: str) -> None:
        """``pass`` heals: held replies go out (late), connections that lost some are reset."""
        assert mode in ("pass", "hold", "drop")
        self.mode = mode
        if mode != "pass":
            return
        with self.lock:
            conns = list(self.conns)
        for c in conns:
            reset = False
            with c.lock:
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
