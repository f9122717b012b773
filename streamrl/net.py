"""The one way streamrl picks a TCP port for something it starts (the embedded broker, a reward
server replica, the metrics endpoint, a process group's rendezvous): ask the OS for a free one."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (a wildcard host is asked on the loopback). Another process
    may take it before it is bound again: callers that start a server retry on a new port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("", "0.0.0.0") else "127.0.0.1", 0))
        return s.getsockname()[1]
