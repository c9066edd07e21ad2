"""Running commands on cluster nodes: paramiko SSH with pinned host keys, or this machine.

``connect(cluster, node)`` gives a ``Remote`` with ``run`` (streamed, line by line, with an
exit code) and ``put_dir`` (a directory copied as one tar stream). Host keys are checked
against the cluster's known_hosts with paramiko's RejectPolicy: an unknown or changed key is an
error, never accepted silently. Workers behind the head node are reached with the head as
jump host (a direct-tcpip channel), like ``ssh -J``.
"""

from __future__ import annotations

import io
import logging
import os
import select
import socket
import subprocess
import tarfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import paramiko

from .cluster import Cluster, Node
from .errors import ApplianceError, Unreachable

LineFn = Callable[[str, str], None]  # (stream "out"|"err", line)


@dataclass
class Result:
    rc: int
    out: str
    err: str


class ConnectionLost(ApplianceError):
    pass


class HostKeyMismatch(ApplianceError):
    """A node presented a host key other than the pinned one: never retried, never accepted."""


class KeyRefused(ApplianceError):
    """A node's sshd refused our key: waiting does not cure it (cloud-init writes authorized_keys before sshd starts
    on CC images: its init stage runs before ssh.service), so it is said at once, naming the key."""


# paramiko logs what it also raises (with tracebacks, through logging's last resort): the exceptions are said here,
# in one line each, and its own lines stay out of the terminal (issue 51)
logging.getLogger("paramiko").addHandler(logging.NullHandler())


def _splitter(stream: str, fn: LineFn | None, sink: list[str]):
    """Bytes -> complete lines for ``fn(stream, line)``. A line callback that has a ``partial`` attribute also gets
    ``fn.partial(stream, fragment)`` for the newest carriage-return-ended fragment of a line still open (a progress
    bar redrawing itself), as it arrives."""
    buf = bytearray()
    partial = getattr(fn, "partial", None)
    scanned = [0]  # how far buf is known to hold no newline

    def feed(data: bytes, final: bool = False):
        buf.extend(data)
        while True:
            i = buf.find(b"\n", scanned[0])
            if i < 0:
                scanned[0] = len(buf)
                break
            line = buf[:i].decode(errors="replace")
            del buf[: i + 1]
            scanned[0] = 0
            sink.append(line)
            if fn:
                fn(stream, line)
        if partial is not None and data and not final:
            j = buf.rfind(b"\r")
            if j > 0:
                partial(stream, buf[buf.rfind(b"\r", 0, j) + 1:j].decode(errors="replace"))
        if final and buf:
            line = buf.decode(errors="replace")
            buf.clear()
            sink.append(line)
            if fn:
                fn(stream, line)

    return feed


class Remote:
    """``run(command, stdin=...)``: the command must read its stdin to the end; one that exits 0 without all of it
    is a lost connection (ConnectionLost), as its input may have been cut."""

    node: Node

    def run(self, command: str, *, stdin: bytes | None = None, on_line: LineFn | None = None,
            timeout: float | None = None, stop: threading.Event | None = None, check: bool = False) -> Result:
        raise NotImplementedError

    def put_dir(self, local: str | Path, remote_dir: str, *, exclude: tuple[str, ...] = ("__pycache__", ".git")) -> None:
        """Replace ``remote_dir`` with a copy of ``local`` (atomically: extract beside, then rename)."""
        data = _tar_dir(Path(local), exclude)
        tmp = f"{remote_dir}.incoming"
        cmd = (f"set -e; rm -rf {_q(tmp)}; mkdir -p {_q(tmp)}; tar -xzf - -C {_q(tmp)}; "
               f"rm -rf {_q(remote_dir)}.old; if [ -e {_q(remote_dir)} ]; then mv {_q(remote_dir)} {_q(remote_dir)}.old; fi; "
               f"mv {_q(tmp)} {_q(remote_dir)}; rm -rf {_q(remote_dir)}.old")
        r = self.run(cmd, stdin=data)
        if r.rc != 0:
            raise ApplianceError(f"copying {local} to {self.node.name}:{remote_dir} failed: {r.err.strip()[-300:]}")

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _q(s: str) -> str:
    import shlex

    return shlex.quote(s)


class _TooBig(Exception):
    pass


class _CappedBuffer(io.BytesIO):
    """The tarball in memory, refused as soon as it passes MAX_CODE_BYTES (not once the whole tree is read)."""

    def write(self, b) -> int:
        if self.tell() + len(b) > MAX_CODE_BYTES:
            raise _TooBig(f"over {MAX_CODE_BYTES / 2**20:.0f} MB compressed")
        return super().write(b)


def _tar_dir(path: Path, exclude: tuple[str, ...]) -> bytes:
    if not path.is_dir():
        raise ApplianceError(f"{path}: not a directory", "set train.code in the spec to the directory of your training code")
    bio = _CappedBuffer()
    raw = [0]

    def filt(ti: tarfile.TarInfo):
        parts = Path(ti.name).parts
        if any(p in exclude or p.startswith(".venv") for p in parts):  # never ship a virtualenv
            return None
        raw[0] += ti.size
        if raw[0] > MAX_CODE_RAW_BYTES:  # before its bytes are read: `train.code: /` stops here, not minutes later
            raise _TooBig(f"over {MAX_CODE_RAW_BYTES / 2**30:.0f} GiB of files")
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = "root"
        return ti

    try:
        with tarfile.open(fileobj=bio, mode="w:gz") as tf:
            tf.add(str(path), arcname=".", filter=filt)
    except _TooBig as e:
        raise ApplianceError(f"{path} is {e}: too big to copy as training code",
                             "keep data out of train.code (use dataset: to stage it) or point train.code at a "
                             "smaller directory") from None
    return bio.getvalue()


MAX_CODE_BYTES = 256 * 2**20  # the tarball
MAX_CODE_RAW_BYTES = 2 * 2**30  # the files in it, before compression


def pack_code(path: Path) -> bytes:
    """The training code directory as it will be copied to the nodes (refused when missing or too big)."""
    return _tar_dir(Path(path), ("__pycache__", ".git"))


class LocalRemote(Remote):
    """This machine (single-host mode): commands run with bash, no SSH."""

    def __init__(self, node: Node):
        self.node = node

    def run(self, command, *, stdin=None, on_line=None, timeout=None, stop=None, check=False) -> Result:
        proc = subprocess.Popen(["bash", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        out: list[str] = []
        err: list[str] = []
        feeds = {proc.stdout.fileno(): _splitter("out", on_line, out), proc.stderr.fileno(): _splitter("err", on_line, err)}
        feeder = _Feeder(_PipeEnd(proc.stdin), stdin)
        deadline = time.monotonic() + timeout if timeout else None
        open_fds = set(feeds)
        while open_fds:
            ready, _, _ = select.select(list(open_fds), [], [], 0.2)
            for fd in ready:
                data = os.read(fd, 65536)
                if not data:
                    feeds[fd](b"", final=True)
                    open_fds.discard(fd)
                else:
                    feeds[fd](data)
            if (stop is not None and stop.is_set()) or (deadline and time.monotonic() > deadline):
                _killpg(proc)
                break
        rc = proc.wait()
        res = Result(rc, "\n".join(out), "\n".join(err))
        feeder.judge(self.node.name, rc)
        if check and rc != 0:
            raise ApplianceError(f"{self.node.name}: `{command[:80]}` failed ({rc}): {res.err.strip()[-300:]}")
        return res


class _PipeEnd:
    """A subprocess's stdin as a channel-like end for ``_Feeder``."""

    def __init__(self, fh):
        self.fh = fh

    def send(self, b) -> int:
        self.fh.write(b)
        self.fh.flush()
        return len(b)

    def shutdown_write(self):
        self.fh.close()


class _Feeder:
    """A command's stdin, written whole from a thread, and judged after the command: bytes that did not all arrive
    are never a success. The SSH channel polls with a short timeout (``settimeout(0.2)``), and paramiko's ``send``
    raises ``socket.timeout`` when the peer's window stays full that long (a node whose disk is slower than the
    link): that is a wait, not an end of the stream."""

    CHUNK = 1 << 20

    def __init__(self, end, data: bytes | None):
        self.end, self.data, self.sent, self.error = end, data or b"", 0, None
        self.done = threading.Event()
        if data:
            threading.Thread(target=self._write, daemon=True).start()
        else:
            self._close()

    def _write(self):
        view = memoryview(self.data)
        try:
            while self.sent < len(view):
                try:
                    n = self.end.send(view[self.sent:self.sent + self.CHUNK])
                except socket.timeout:
                    continue  # the window is full: the command reads slower than we send
                if n <= 0:
                    break  # the channel was closed
                self.sent += n
        except (OSError, EOFError, ValueError, paramiko.SSHException) as e:  # EOFError: paramiko's write_all
            self.error = e  # on a socket that broke (packet.py)
        finally:
            self._close()

    def _close(self):
        try:
            self.end.shutdown_write()
        except (OSError, EOFError, ValueError, paramiko.SSHException):
            pass
        finally:
            self.done.set()

    def judge(self, node: str, rc: int) -> None:
        """After the command ended: a command that says success over a stdin it did not get whole is a lost
        connection (a command that failed says why itself)."""
        self.done.wait(EOF_GRACE)
        if rc == 0 and self.sent < len(self.data):
            why = f" ({self.error})" if self.error else ""
            raise ConnectionLost(f"{node} got {self.sent} of the {len(self.data)} bytes sent to it{why}",
                                 f"check that {node} is up (`appliance status`) and run the step again")


def _killpg(proc: subprocess.Popen):
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


EOF_GRACE = 5.0  # seconds to wait for the channel's EOF once the exit status is in


class SSHRemote(Remote):
    """A node over SSH (paramiko)."""

    def __init__(self, node: Node, client: paramiko.SSHClient, jump: SSHRemote | None = None):
        self.node = node
        self.client = client
        self.jump = jump

    @property
    def transport(self) -> paramiko.Transport:
        t = self.client.get_transport()
        if t is None or not t.is_active():
            raise ConnectionLost(f"lost the SSH connection to {self.node.name}",
                                 f"check that {self.node.name} is up (`appliance status`)")
        return t

    def run(self, command, *, stdin=None, on_line=None, timeout=None, stop=None, check=False) -> Result:
        try:  # bounded: on a node that vanished (lease end) the connection is dead but not closed
            chan = self.transport.open_session(timeout=min(timeout or 30.0, 30.0))
        except (paramiko.SSHException, EOFError, OSError) as e:
            raise ConnectionLost(f"lost the SSH connection to {self.node.name} ({e})",
                                 f"check that {self.node.name} is up (`appliance status`)") from None
        chan.settimeout(0.2)
        chan.exec_command(command)
        feeder = _Feeder(chan, stdin)
        out: list[str] = []
        err: list[str] = []
        fo = _splitter("out", on_line, out)
        fe = _splitter("err", on_line, err)
        deadline = time.monotonic() + timeout if timeout else None
        eof_by = None
        while True:
            got = False
            while chan.recv_ready():
                fo(chan.recv(65536))
                got = True
            while chan.recv_stderr_ready():
                fe(chan.recv_stderr(65536))
                got = True
            if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                # sshd may send exit-status before the last of the output (openssh session.c
                # session_exit_message runs at SIGCHLD while the pipe still holds data): the output
                # is complete only at the channel's EOF. Bounded, for a command that left a
                # background child holding stdout open.
                if chan.eof_received or chan.closed:
                    break
                eof_by = eof_by or time.monotonic() + EOF_GRACE
                if time.monotonic() > eof_by:
                    break
            if not self.client.get_transport() or not self.client.get_transport().is_active() or chan.closed and not got:
                if chan.exit_status_ready():
                    break
                # an unfinished last line is not passed on: it was cut, not ended (a follower that reconnects
                # reads it again whole)
                raise ConnectionLost(f"lost the SSH connection to {self.node.name} while running a command",
                                     f"check that {self.node.name} is up (`appliance status`)")
            if (stop is not None and stop.is_set()) or (deadline and time.monotonic() > deadline):
                chan.close()
                fo(b"", final=True)
                fe(b"", final=True)
                return Result(-1, "\n".join(out), "\n".join(err))
            if not got:
                r, _, _ = select.select([chan], [], [], 0.2)
        if chan.status_event.is_set():  # the command ended: its unfinished last line is a line. Without an exit
            fo(b"", final=True)  # status (paramiko's exit_status_ready is also true for a channel that closed:
            fe(b"", final=True)  # a connection that dropped, a command killed by a signal) rc is -1 and a cut
        rc = chan.recv_exit_status()  # last line is not passed on (a follower reads it again whole)
        chan.close()
        res = Result(rc, "\n".join(out), "\n".join(err))
        feeder.judge(self.node.name, rc)
        if check and rc != 0:
            raise ApplianceError(f"{self.node.name}: `{command[:80]}` failed ({rc}): {res.err.strip()[-300:]}")
        return res

    def close(self) -> None:
        self.client.close()


class ClosedBeforeBanner(Unreachable):
    """sshd closed (or reset) the connection before its banner."""


def _closed_before_banner(e: paramiko.SSHException, seconds: float, timeout: float) -> bool:
    """paramiko's "Error reading SSH protocol banner" over a connection that was closed or reset, not over a banner
    that never came (paramiko/transport.py `_check_banner` raises it from the EOFError, reset or timeout it caught,
    with nothing in its text to tell them apart): the cause it was raised from, or its coming before the banner's
    timeout (the cause does not always survive paramiko raising it again in the caller's thread)."""
    return str(e).startswith("Error reading SSH protocol banner") and \
        (isinstance(e.__context__, (EOFError, ConnectionResetError)) or seconds < timeout)


def _connect_ssh(cluster: Cluster, node: Node, sock=None, timeout: float = 15.0) -> paramiko.SSHClient:
    if not cluster.known_hosts or not Path(cluster.known_hosts).exists():
        raise ApplianceError(f"cluster {cluster.name}: no pinned host keys (known_hosts missing)",
                             "re-run `appliance up` or `appliance adopt` to record the nodes' host keys")
    client = paramiko.SSHClient()
    client.load_host_keys(cluster.known_hosts)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    t0 = time.monotonic()
    try:
        client.connect(node.address, port=node.port, username=node.user, key_filename=cluster.key_file,
                       sock=sock, timeout=timeout, banner_timeout=timeout, auth_timeout=timeout,
                       allow_agent=False, look_for_keys=False)
    except BaseException as e:
        client.close()
        raise _connect_error(cluster, node, e, time.monotonic() - t0, timeout) from None
    client.get_transport().set_keepalive(5)
    return client


def _connect_error(cluster: Cluster, node: Node, e: BaseException, seconds: float, timeout: float) -> BaseException:
    """What a failed connection is said as."""
    if isinstance(e, paramiko.BadHostKeyException):
        return HostKeyMismatch(f"{node.name} ({node.address}) presented a host key that does not match the pinned one",
                               "if the node was rebuilt, run `appliance up` again to re-pin; otherwise do not connect")
    if isinstance(e, paramiko.AuthenticationException):
        return KeyRefused(f"{node.name} ({node.address}) refused the key {cluster.key_file} for user {node.user}",
                          "give the private key of the key pair the nodes were launched with (key_file in the spec, "
                          "or --key-file)")
    if isinstance(e, paramiko.SSHException):
        if "not found in known_hosts" in str(e):
            return ApplianceError(f"{node.name} ({node.address}) has no pinned host key",
                                  "re-run `appliance up` to record host keys")
        # the connection lost or never answered is the node's or the network's (waited for: Unreachable); any other
        # (a key file paramiko cannot read, no algorithm in common) is said at once
        lost = str(e).startswith("Error reading SSH protocol banner") or str(e) == "No existing session" or \
            isinstance(e.__context__, (EOFError, ConnectionError, TimeoutError))
        cls = ClosedBeforeBanner if _closed_before_banner(e, seconds, timeout) else Unreachable if lost else \
            ApplianceError
        return cls(f"SSH to {node.name} ({node.address}:{node.port}) failed after {seconds:.1f}s: {e}",
                   f"check that {node.name} is up (`appliance status`)" if lost else
                   f"check the key file {cluster.key_file} and the node's sshd")
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError)):  # the key file, not the node
        return ApplianceError(f"cannot read the SSH key file {cluster.key_file} ({e.strerror})",
                              "give the private key of the key pair the nodes were launched with (key_file in the "
                              "spec, or --key-file)")
    if isinstance(e, (OSError, EOFError)):  # socket.timeout is an OSError
        return Unreachable(f"cannot reach {node.name} at {node.address}:{node.port} ({e})",
                           f"check that {node.name} is up (`appliance status`)")
    return e


# sshd closes new connections before its banner while it holds too many unauthenticated ones: OpenSSH's MaxStartups,
# 10:30:100 by default (from 10 on, it drops each new one with a chance that rises from 30% to all at 100;
# sshd_config(5)), on Chameleon's CC images as on the local cloud's nodes. Such a close is tried again, a second
# apart, up to CONNECT_TRIES tries in all; a refusal or a banner that never comes is said at once (a node that is gone).
CONNECT_TRIES = 4
CONNECT_PAUSE = 1.0  # seconds between tries


def connect(cluster: Cluster, node: Node, *, head: SSHRemote | None = None, timeout: float = 15.0) -> Remote:
    if node.address is None:
        return LocalRemote(node)
    if node.via_head and node is not cluster.head and head is None:
        head = connect(cluster, cluster.head, timeout=timeout)  # type: ignore[assignment]
    for attempt in range(1, CONNECT_TRIES + 1):
        sock = None
        if node.via_head and node is not cluster.head:
            try:
                sock = head.transport.open_channel("direct-tcpip", (node.address, node.port), ("127.0.0.1", 0),
                                                   timeout=timeout)
            except (paramiko.SSHException, OSError) as e:
                raise Unreachable(f"cannot reach {node.name} ({node.address}) through the head node ({e})",
                                  f"check that {node.name} is up (`appliance status`)") from None
        try:
            return SSHRemote(node, _connect_ssh(cluster, node, sock=sock, timeout=timeout), jump=head)
        except ClosedBeforeBanner:
            if attempt == CONNECT_TRIES:
                raise
            time.sleep(CONNECT_PAUSE)
    raise AssertionError("unreachable")


class Session:
    """Connections to every node of a cluster, opened in parallel, closed together."""

    def __init__(self, cluster: Cluster, timeout: float = 15.0):
        self.cluster = cluster
        head = connect(cluster, cluster.head, timeout=timeout)
        self.remotes: dict[str, Remote] = {cluster.head.name: head}
        rest = cluster.nodes[1:]
        if rest:
            with ThreadPoolExecutor(max_workers=min(16, len(rest))) as ex:
                futs = {n.name: ex.submit(connect, cluster, n, head=head if isinstance(head, SSHRemote) else None,
                                          timeout=timeout) for n in rest}
                try:
                    for name, f in futs.items():
                        self.remotes[name] = f.result()
                except BaseException:
                    self.close()
                    raise

    @property
    def head(self) -> Remote:
        return self.remotes[self.cluster.head.name]

    def __getitem__(self, name: str) -> Remote:
        return self.remotes[name]

    def each(self, fn: Callable[[Remote], object]) -> dict[str, object]:
        """Call fn(remote) on every node in parallel; re-raise the first error."""
        with ThreadPoolExecutor(max_workers=min(16, len(self.remotes))) as ex:
            futs = {name: ex.submit(fn, r) for name, r in self.remotes.items()}
            return {name: f.result() for name, f in futs.items()}

    def close(self):
        for r in reversed(list(self.remotes.values())):
            r.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
