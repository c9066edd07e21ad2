"""An SSH connection that sshd closes before its banner is tried again; one that times out or is refused is not.

OpenSSH's sshd drops new connections while it holds too many unauthenticated ones (MaxStartups 10:30:100 by
default, on Chameleon's images as on the local cloud's nodes): paramiko then says "Error reading SSH protocol
banner". A managed run's handover once ended on that one line. Here a loopback listener closes the first
connections at once, then hands the next to an SSH server (paramiko's own, in this process). The tries are a
second apart (`CONNECT_PAUSE`, 0.01 s here).
"""

from __future__ import annotations

import socket
import threading

import paramiko
import pytest

from appliance import remote
from appliance.cluster import Cluster, Node
from appliance.errors import ApplianceError, Unreachable


class _Accept(paramiko.ServerInterface):
    def check_auth_publickey(self, username, key):
        return paramiko.AUTH_SUCCESSFUL

    def get_allowed_auths(self, username):
        return "publickey"


class Listener:
    """Accepts on 127.0.0.1: ``how(n)`` for the n-th connection (from 1): "close", "hold" (say nothing) or "ssh"."""

    def __init__(self, how, host_key):
        self.how, self.host_key, self.accepted = how, host_key, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.kept: list = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            how = self.how(self.accepted)
            if how == "close":
                conn.close()
            elif how == "hold":
                self.kept.append(conn)
            else:
                t = paramiko.Transport(conn)
                t.add_server_key(self.host_key)
                t.start_server(server=_Accept())
                self.kept.append(t)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.sock.shutdown(socket.SHUT_RDWR)  # ends the accept() under way (close() alone leaves it listening)
        self.sock.close()
        for k in self.kept:
            k.close()


@pytest.fixture
def keys(tmp_path):
    host, user = paramiko.RSAKey.generate(1024), paramiko.RSAKey.generate(1024)
    user.write_private_key_file(str(tmp_path / "id_rsa"))
    return host, user, tmp_path


def _cluster(keys, port) -> Cluster:
    host, _, d = keys
    (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {host.get_name()} {host.get_base64()}\n")
    node = Node(name="node1", private_ip="127.0.0.1", address="127.0.0.1", workdir="/tmp", port=port, user="cc")
    return Cluster(name="c", cloud="testbed", nodes=[node], key_file=str(d / "id_rsa"),
                   known_hosts=str(d / "known_hosts"))


def test_a_connection_closed_before_the_banner_is_tried_again(keys, monkeypatch):
    monkeypatch.setattr(remote, "CONNECT_PAUSE", 0.01)
    with Listener(lambda n: "close" if n <= 2 else "ssh", keys[0]) as srv:
        cl = _cluster(keys, srv.port)
        r = remote.connect(cl, cl.head, timeout=5)
        assert r.transport.is_active() and srv.accepted == 3
        r.close()


def test_a_close_is_told_from_a_timeout_also_while_another_error_is_handled(keys, monkeypatch):
    """paramiko raises the transport thread's error again in the caller's: inside an `except` or `finally` (a
    `contextualize` in a `finally`), Python then replaces its cause with the error being handled."""
    monkeypatch.setattr(remote, "CONNECT_PAUSE", 0.01)
    with Listener(lambda n: "close" if n <= 1 else "ssh", keys[0]) as srv:
        cl = _cluster(keys, srv.port)
        try:
            raise KeyError("being handled")
        except KeyError:
            r = remote.connect(cl, cl.head, timeout=5)
        assert srv.accepted == 2
        r.close()


def test_closes_past_the_tries_are_said_in_one_line(keys, monkeypatch):
    monkeypatch.setattr(remote, "CONNECT_PAUSE", 0.01)
    with Listener(lambda n: "close", keys[0]) as srv:
        cl = _cluster(keys, srv.port)
        with pytest.raises(Unreachable, match=r"SSH to node1 .* failed after \d+\.\ds: Error reading SSH protocol banner"):
            remote.connect(cl, cl.head, timeout=5)
        assert srv.accepted == remote.CONNECT_TRIES


def test_a_banner_that_never_comes_and_a_refusal_are_not_tried_again(keys, monkeypatch):
    monkeypatch.setattr(remote, "CONNECT_PAUSE", 0.01)
    with Listener(lambda n: "hold", keys[0]) as srv:
        cl = _cluster(keys, srv.port)
        with pytest.raises(Unreachable, match="SSH to node1 .* failed") as e:  # paramiko: "No existing session"
            remote.connect(cl, cl.head, timeout=0.3)
        assert srv.accepted == 1 and not isinstance(e.value, remote.ClosedBeforeBanner)
    with pytest.raises(Unreachable, match="cannot reach node1"):  # nothing listens there now
        remote.connect(cl, cl.head, timeout=0.3)


def test_a_key_file_that_cannot_be_read_is_said_at_once_not_waited_for(keys, tmp_path, monkeypatch):
    """A managed run waits for a node that does not answer SSH (errors.Unreachable); a key file missing or not a key
    is no such wait: its own error, at once."""
    import dataclasses

    monkeypatch.setattr(remote, "CONNECT_PAUSE", 0.01)
    garbage = tmp_path / "garbage"
    garbage.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnot base64 at all\n-----END OPENSSH PRIVATE KEY-----\n")
    with Listener(lambda n: "ssh", keys[0]) as srv:
        cl = _cluster(keys, srv.port)
        for key_file, said in ((tmp_path / "missing", "cannot read the SSH key file"), (garbage, "failed after")):
            bad = dataclasses.replace(cl, key_file=str(key_file))
            with pytest.raises(ApplianceError, match=said) as e:
                remote.connect(bad, bad.head, timeout=5)
            assert not isinstance(e.value, Unreachable), e.value
