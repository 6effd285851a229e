"""A port held from the moment it is chosen: a socket bound, not yet listening, for a server to
listen on (asyncio's create_server listens on the sockets it is given). A port picked free, released
and bound again later can be taken in between by another process or an outgoing connection."""

from __future__ import annotations

import socket


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (0: a free port), not listening, so connections are refused
    until its server serves. Bound, the port is out of reach of other processes' port-0 binds and
    outgoing connections. SO_REUSEADDR as uvicorn binds: a server restarted on its port binds it
    again while the old one's connections wait in TIME_WAIT (they keep the listener's setting)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def inherited_sockets(fd: int | None) -> list[socket.socket] | None:
    """`--listen-fd`'s socket, for uvicorn's `serve(sockets=...)`; None: uvicorn binds --host/--port."""
    return None if fd is None else [socket.socket(fileno=fd)]
