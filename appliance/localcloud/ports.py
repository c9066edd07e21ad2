"""Ports for the stores' servers (Swift's, Ceph's), chosen here and handed to them in their configuration.

A port that the kernel gave a throwaway socket (bind to port 0) comes from the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), where every outgoing connection of the machine takes its local port
too: between our choice and the server's own bind, a connection (a test's, a job's) could take it, and the server
then waited out its bind timeout (Swift: 30 s, ``bind_timeout`` in swift/common/wsgi.py) with nothing in its log.
So a server's port is picked below that range, where nothing takes ports by itself, and checked free by binding it.
"""

from __future__ import annotations

import random
import socket

LOW = 10000  # above the well-known and most registered services' ports


def ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    try:
        with open(path) as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts there


def listen_port(ip: str = "127.0.0.1") -> int:
    """A port on ``ip`` that no socket holds now, outside the ephemeral range."""
    high = ephemeral_low() - 1
    for _ in range(200):
        port = random.randint(LOW, high) if high > LOW else 0
        with socket.socket() as s:
            try:
                s.bind((ip, port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:  # a machine whose low ports are all taken: the kernel's choice, as before
        s.bind((ip, 0))
        return s.getsockname()[1]
