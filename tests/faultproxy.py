"""An HTTP proxy that sits between clients and the real Swift proxy and injects faults.

Modes: ``pass`` (forward everything), ``arm(fail_at=K)`` / ``arm(reset_at=K)`` (the K-th request from now, any
method, answered 503 / closed without an answer: the fault matrix, tests/faults.py), ``fail_puts = N`` (answer the next N PUTs with 503, then pass),
``fail_gets = N`` (the next N GETs, listings included, answered 503), ``reset_gets = N`` (the next N GETs: the
connection is closed without an answer), ``down`` (answer every request with 503), ``hold_after = N`` (pass N
object GETs, then hold every later one until ``release()``: a client stopped mid-way, at a point the test chose;
``wait_held(k)`` returns once k requests are held; ``stop()`` closes the held ones unanswered, so a client the test
killed, or what is left of it, gets nothing more), ``hold_gets = N`` (hold the next N object GETs, as
``hold_after``), ``trickle_gets = N`` (the next N object GETs get their headers, then their body a byte every
``trickle_every`` seconds: a store that never stops answering and never finishes). The Host header is forwarded as
the client sent it, so Swift's tempauth hands out storage URLs that point back at this proxy: every later request
goes through it too.
"""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse


class _Dropped(Exception):
    """A held request the stopped proxy closes without an answer."""


class _Quiet(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        """A client the test killed resets its connection: nothing to print (anything else is, as http.server does)."""
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FaultProxy:
    def __init__(self, upstream: str, bind_ip: str = "127.0.0.1"):
        u = urlparse(upstream)
        self.up_host, self.up_port = u.hostname, u.port or 80
        self.fail_puts = 0
        self.fail_gets = 0
        self.reset_gets = 0
        self.down = False
        self.hold_after: int | None = None
        self.hold_gets = 0
        self.trickle_gets = 0
        self.trickle_every = 1.0
        self.fail_at: int | None = None  # the fail_at-th request from now (any method, tokens aside): 503
        self.reset_at: int | None = None  # ... closed without an answer
        self.counted = 0  # requests counted for fail_at / reset_at
        self.released = threading.Event()
        self._stopping = threading.Event()
        self.stopped = False
        self.objects_got = 0
        self.held = 0
        self._held_cv = threading.Condition()
        self.failed: list[str] = []  # "METHOD path" of every request we failed on purpose
        self.forwarded = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body are two writes (localcloud/server.py Handler)

            def log_message(self, *a):
                pass

            def _nth(self) -> str | None:
                """"fail" or "reset" when this request is the one fail_at or reset_at names."""
                if "/auth/" in self.path:
                    return None
                with proxy._lock:
                    proxy.counted += 1
                    for what, at in (("fail", proxy.fail_at), ("reset", proxy.reset_at)):
                        if at is not None and proxy.counted == at:
                            proxy.failed.append(f"{what.upper()} {self.command} {self.path}")
                            return what
                return None

            def _fail(self) -> bool:
                with proxy._lock:
                    if proxy.down or (self.command == "PUT" and proxy.fail_puts > 0) or \
                            (self.command == "GET" and proxy.fail_gets > 0 and "/auth/" not in self.path):
                        if not proxy.down:
                            if self.command == "PUT":
                                proxy.fail_puts -= 1
                            else:
                                proxy.fail_gets -= 1
                        proxy.failed.append(f"{self.command} {self.path}")
                        return True
                return False

            def _reset(self) -> bool:
                with proxy._lock:
                    if self.command == "GET" and proxy.reset_gets > 0 and "/auth/" not in self.path:
                        proxy.reset_gets -= 1
                        proxy.failed.append(f"RESET {self.command} {self.path}")
                        return True
                return False

            def _hold(self) -> None:
                if self.command != "GET" or "/auth/" in self.path or "?" in self.path or \
                        self.path.rstrip("/").count("/") < 4:  # listings, containers and tokens pass
                    return
                with proxy._lock:
                    proxy.objects_got += 1
                    held = proxy.hold_after is not None and proxy.objects_got > proxy.hold_after or proxy.hold_gets > 0
                    proxy.hold_gets -= proxy.hold_gets > 0
                if held:
                    with proxy._held_cv:
                        proxy.held += 1
                        proxy._held_cv.notify_all()
                    proxy.released.wait()
                    if proxy.stopped:
                        self.close_connection = True
                        self.connection.close()
                        raise _Dropped

            def _any(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                try:
                    self._hold()
                except _Dropped:
                    return
                nth = self._nth()
                if nth == "reset" or self._reset():
                    self.close_connection = True
                    self.connection.close()  # no answer at all: the client sees a reset / a closed connection
                    return
                if nth == "fail" or self._fail():
                    msg = b"503 Service Unavailable (injected)"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                with proxy._lock:
                    trickle = self.command == "GET" and proxy.trickle_gets > 0 and "/auth/" not in self.path and \
                        "?" not in self.path and self.path.rstrip("/").count("/") >= 4
                    proxy.trickle_gets -= trickle
                    if trickle:
                        proxy.failed.append(f"TRICKLE {self.command} {self.path}")
                conn = http.client.HTTPConnection(proxy.up_host, proxy.up_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
                conn.request(self.command, self.path, body=body, headers=headers)
                r = conn.getresponse()
                data = r.read()
                self.send_response(r.status, r.reason)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                conn.close()
                if trickle:
                    return self._trickle(data)
                if self.command != "HEAD":
                    self.wfile.write(data)
                with proxy._lock:
                    proxy.forwarded += 1

            def _trickle(self, data: bytes) -> None:
                """A byte every ``trickle_every`` seconds, until the client goes away or the proxy stops."""
                self.close_connection = True
                self.wfile.flush()
                for k in range(len(data)):
                    if proxy._stopping.wait(proxy.trickle_every):
                        return
                    try:
                        self.wfile.write(data[k:k + 1])
                        self.wfile.flush()
                    except OSError:
                        return

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_COPY = _any

        self.server = _Quiet((bind_ip, 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{bind_ip}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)

    def release(self) -> None:
        self.released.set()

    def arm(self, *, fail_at: int | None = None, reset_at: int | None = None) -> None:
        """Count requests from now; fail (503) or reset the n-th one. ``arm()`` alone: count only."""
        with self._lock:
            self.counted, self.fail_at, self.reset_at = 0, fail_at, reset_at

    def wait_held(self, k: int, timeout: float = 120.0) -> bool:
        with self._held_cv:
            return self._held_cv.wait_for(lambda: self.held >= k, timeout=timeout)

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopped = True
        self._stopping.set()
        self.released.set()
        self.server.shutdown()
        self.server.server_close()

