"""Rendezvous ports for the torch.distributed worlds hybridflow starts itself (local mode, spawned test worlds).

A bottom-layer module (standard library only): the controller and parallel/launch.py both import it.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
