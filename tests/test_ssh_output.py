"""SSHRemote.run returns a command's whole output even when the exit status arrives first.

OpenSSH's sshd sends `exit-status` when the child exits (session.c, session_exit_message) while
the pipe may still hold the last of the output; paramiko's transport thread then delivers the
data after `exit_status_ready()` is already true. CI saw this as `contextualize failed on node1
(exit 0)` with no output: the reader stopped at the exit status and lost `APPLIANCE_CONTEXT=ok`.
The fake channel below replays that order; the reader must wait for the channel's EOF.
"""

from __future__ import annotations

import os
import threading

from appliance.cluster import Node
from appliance.remote import SSHRemote


class LateDataChannel:
    """Exit status first; output after `late` polls; EOF after the output."""

    def __init__(self, data: bytes, late: int = 5, status: bool = True):
        self.data, self.late, self.polls = data, late, 0
        self.eof_received = False
        self.closed = False
        self.status_event = threading.Event()  # as paramiko's Channel: set when an exit-status arrived
        if status:
            self.status_event.set()
        self._r, self._w = os.pipe()
        os.write(self._w, b"x")  # always readable: select() returns at once

    def settimeout(self, t): pass
    def exec_command(self, cmd): self.cmd = cmd
    def shutdown_write(self): pass
    def fileno(self): return self._r
    def exit_status_ready(self): return True
    def recv_exit_status(self): return 0 if self.status_event.is_set() else -1
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


def test_a_channel_that_closed_without_an_exit_status_passes_no_cut_line_on():
    """A dropped connection closes the channel with no exit status (paramiko's exit_status_ready() is true then
    too): the unfinished last line was cut, not ended. The launcher's follower counts the lines it consumed and
    reads on from there after a reconnect, so a cut line passed on would be shown cut and then again whole."""
    chan = LateDataChannel(b"step 10\nstep 2", late=0, status=False)
    node = Node(name="node1", private_ip="10.0.0.1", address="10.0.0.1", workdir="/tmp")
    seen = []
    r = SSHRemote(node, Client(chan)).run("tail -F out", on_line=lambda stream, line: seen.append(line))
    assert r.rc == -1 and seen == ["step 10"]


def test_progress_bar_redraws_become_one_clean_line_and_a_live_fragment():
    """Keras' progress bar through horovodrun: every redraw is a ``\\r``-ended fragment with the rank prefix
    (horovod/runner/common/util/safe_shell_exec.py prefix_connection), the line ends only at the epoch's end."""
    from appliance.remote import _splitter
    from appliance.train.launch import clean_progress

    lines, live = [], []

    def on_line(stream, line):
        lines.append(line)

    on_line.partial = lambda stream, frag: live.append(frag)
    feed = _splitter("out", on_line, [])
    feed(b"[0]<stdout>:Epoch 1/3\n[0]<stdout>: 1/28 [>....] - ETA: 3s - loss: 2.3\b\b\b\r[0]<stdout>: 2/2")
    feed(b"8 [=>...] - ETA: 2s - loss: 2.2\b\b\b\r[0]<stdout>:28/28 [=====] - 1s 10ms/step")
    assert lines == ["[0]<stdout>:Epoch 1/3"]
    assert live == ["[0]<stdout>: 1/28 [>....] - ETA: 3s - loss: 2.3\b\b\b",
                    "[0]<stdout>: 2/28 [=>...] - ETA: 2s - loss: 2.2\b\b\b"]
    feed(b" - loss: 0.5\n")
    assert len(lines) == 2
    assert clean_progress(lines[1][len("[0]<stdout>:"):]) == "28/28 [=====] - 1s 10ms/step - loss: 0.5"
    assert clean_progress("\r\b\b\r") == ""
