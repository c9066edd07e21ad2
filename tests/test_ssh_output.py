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


class _SlowReader:
    """A real paramiko server (over a socketpair) whose command starts reading its stdin only ``late`` seconds after
    it started, then answers with the number of bytes it got: `tar -xzf -` on a node whose disk is slower than the
    link."""

    def __init__(self, late: float, reads: int | None = None):
        import socket

        import paramiko

        self.late, self.reads = late, reads
        a, b = socket.socketpair()
        self.server = paramiko.Transport(b)
        self.server.add_server_key(paramiko.RSAKey.generate(1024))
        outer = self

        class Server(paramiko.ServerInterface):
            def check_auth_none(self, username): return paramiko.AUTH_SUCCESSFUL
            def get_allowed_auths(self, username): return "none"
            def check_channel_request(self, kind, chanid): return paramiko.OPEN_SUCCEEDED

            def check_channel_exec_request(self, channel, command):
                threading.Thread(target=outer._serve, args=(channel,), daemon=True).start()
                return True

        self.server.start_server(event=threading.Event(), server=Server())  # returns at once; the client negotiates
        self.client = paramiko.Transport(a)
        self.client.connect()
        self.client.auth_none("u")

    def _serve(self, chan):
        threading.Event().wait(self.late)  # the slow disk: a fault modelled, not a wait for the other side
        got = 0
        while self.reads is None or got < self.reads:
            b = chan.recv(1 << 16)
            if not b:
                break
            got += len(b)
        chan.sendall(f"{got}\n".encode())
        chan.send_exit_status(0)
        chan.close()

    def get_transport(self):
        return self.client

    def close(self):
        self.client.close()
        self.server.close()


def test_stdin_larger_than_the_window_arrives_whole_when_the_command_reads_it_late():
    """CI lost the wheels' tarball this way (`gzip: stdin: unexpected end of file` on a 24.04 node): the channel
    polls with a 0.2 s timeout, paramiko's send raised socket.timeout once the peer's window stayed full that long,
    and the writer took that for the end of the stream and closed stdin."""
    ssh = _SlowReader(late=0.8)
    data = os.urandom(6 << 20)  # three times paramiko's default window (2 MiB): full within milliseconds
    node = Node(name="node1", private_ip="10.0.0.1", address="10.0.0.1", workdir="/tmp")
    try:
        r = SSHRemote(node, ssh).run("cat", stdin=data)
    finally:
        ssh.close()
    assert r.rc == 0 and r.out == str(len(data))


def test_a_command_that_says_success_over_part_of_its_stdin_is_a_lost_connection():
    """`cat > creds` that ended early would leave a cut file and exit 0: bytes that did not all arrive are never a
    success."""
    import pytest

    from appliance.remote import ConnectionLost

    ssh = _SlowReader(late=0.0, reads=1 << 20)
    node = Node(name="node1", private_ip="10.0.0.1", address="10.0.0.1", workdir="/tmp")
    try:
        with pytest.raises(ConnectionLost, match="node1 got .* of the 6291456 bytes sent to it"):
            SSHRemote(node, ssh).run("cat > creds", stdin=os.urandom(6 << 20))
    finally:
        ssh.close()


def test_a_link_that_breaks_under_the_writer_is_a_lost_connection_not_a_threads_traceback(monkeypatch):
    """paramiko's packetizer raises EOFError when the socket breaks under a write (packet.py write_all), from send
    and from shutdown_write alike: one ConnectionLost at the command's end, no traceback from the writer's thread."""
    import pytest

    from appliance.remote import ConnectionLost, _Feeder

    class Broken:
        def send(self, b):
            raise EOFError()

        def shutdown_write(self):
            raise EOFError()

    seen = []
    monkeypatch.setattr(threading, "excepthook", seen.append)
    f = _Feeder(Broken(), b"x" * 10)
    assert f.done.wait(5) and not seen
    with pytest.raises(ConnectionLost, match="node1 got 0 of the 10 bytes sent to it"):
        f.judge("node1", 0)
