"""SSHRemote.run returns a command's whole output even when the exit status arrives first.

OpenSSH's sshd sends `exit-status` when the child exits (session.c, session_exit_message) while
the pipe may still hold the last of the output; paramiko's transport thread then delivers the
data after `exit_status_ready()` is already true. CI saw this as `contextualize failed on node1
(exit 0)` with no output: the reader stopped at the exit status and lost `APPLIANCE_CONTEXT=ok`.
The fake channel below replays that order; the reader must wait for the channel's EOF.
"""

from __future__ import annotations

import os

from appliance.cluster import Node
from appliance.remote import SSHRemote


class LateDataChannel:
    """Exit status first; output after `late` polls; EOF after the output."""

    def __init__(self, data: bytes, late: int = 5):
        self.data, self.late, self.polls = data, late, 0
        self.eof_received = False
        self.closed = False
        self._r, self._w = os.pipe()
        os.write(self._w, b"x")  # always readable: select() returns at once

    def settimeout(self, t): pass
    def exec_command(self, cmd): self.cmd = cmd
    def shutdown_write(self): pass
    def fileno(self): return self._r
    def exit_status_ready(self): return True
    def recv_exit_status(self): return 0
    def recv_stderr_ready(self): return False

    def recv_ready(self):
        self.polls += 1
        return self.polls > self.late and bool(self.data)

    def recv(self, n):
        out, self.data = self.data[:n], self.data[n:]
        if not self.data:
            self.eof_received = True
        return out

    def close(self):
        self.closed = True
        os.close(self._r)
        os.close(self._w)


class Transport:
    def __init__(self, chan): self.chan = chan
    def is_active(self): return True
    def open_session(self, timeout=None): return self.chan


class Client:
    def __init__(self, chan): self.t = Transport(chan)
    def get_transport(self): return self.t


def test_output_that_arrives_after_the_exit_status_is_kept():
    chan = LateDataChannel(b"APPLIANCE_NIC=eth0\nAPPLIANCE_CONTEXT=ok\n")
    node = Node(name="node1", private_ip="10.0.0.1", address="10.0.0.1", workdir="/tmp")
    r = SSHRemote(node, Client(chan)).run("sh -s", stdin=None)
    assert r.rc == 0
    assert r.out.splitlines() == ["APPLIANCE_NIC=eth0", "APPLIANCE_CONTEXT=ok"]
