"""ACK a store's answer as it arrives: Ceph RGW's answers otherwise wait 40 ms for our delayed ACK.

Ceph RGW's beast frontend writes an answer's headers and its body in two writes, with Nagle's algorithm on:
``tcp_nodelay`` is a frontend option that is off unless the operator sets it (ceph ``src/rgw/rgw_asio_frontend.cc``,
``AsioFrontend::init``: ``use_nodelay`` only for ``tcp_nodelay=1``). On a kept-alive connection the body then
waits until the client ACKs the headers, and Linux delays that ACK by up to 40 ms (TCP_DELACK_MIN), because the
connection looks interactive. Measured here against radosgw 16.2.15 as the local cloud runs it: a 1 KB to 100 KB
GET took 44 ms, a container listing 48 ms; with ``TCP_QUICKACK`` asked before each answer, 1.2-1.6 ms and 6 ms.
A connection's first answer is quick anyway (the kernel starts in quick-ACK mode), which is why one request
never shows it. OpenStack Swift's proxy (eventlet.wsgi) writes small answers in one piece and is not affected.

``TCP_QUICKACK`` is not sticky (tcp(7): the kernel may leave quick-ACK mode again), so it is asked before each
answer is read: one ``setsockopt`` per request, where it matters.
"""

from __future__ import annotations

import os
import socket

# Linux only; elsewhere nothing to do. APPLIANCE_QUICKACK=0 turns it off (the benchmark's A/B, or a network stack
# that misbehaves with it)
_QUICKACK = getattr(socket, "TCP_QUICKACK", None) if os.environ.get("APPLIANCE_QUICKACK", "1") != "0" else None


def quickack(sock) -> None:
    """ACK what arrives on ``sock`` at once (until the kernel decides otherwise). Harmless where unsupported."""
    if sock is None or _QUICKACK is None:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)
    except (OSError, AttributeError):
        pass


def _quickack_pools(*pools) -> dict:
    """{"http": ..., "https": ...}: urllib3 pool classes like ``pools`` (plain, TLS) whose connections ask for a
    quick ACK before reading each answer."""
    def quick(base):
        def getresponse(self, *a, **kw):
            quickack(self.sock)
            return base.getresponse(self, *a, **kw)

        return type("QuickAck" + base.__name__, (base,), {"getresponse": getresponse})

    return {scheme: type("QuickAck" + pool.__name__, (pool,), {"ConnectionCls": quick(pool.ConnectionCls)})
            for scheme, pool in zip(("http", "https"), pools)}


_ADAPTER_CLASS = None


def _adapter_class():
    """A requests adapter whose connections ask for quick ACKs before reading each answer (made on first use:
    requests and urllib3 are imported only where swiftclient is)."""
    global _ADAPTER_CLASS
    if _ADAPTER_CLASS is None:
        from requests.adapters import HTTPAdapter
        from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

        classes = _quickack_pools(HTTPConnectionPool, HTTPSConnectionPool)

        class QuickAckAdapter(HTTPAdapter):
            def init_poolmanager(self, *a, **kw):
                super().init_poolmanager(*a, **kw)
                self.poolmanager.pool_classes_by_scheme = classes

            def proxy_manager_for(self, *a, **kw):
                pm = super().proxy_manager_for(*a, **kw)
                pm.pool_classes_by_scheme = classes
                return pm

        _ADAPTER_CLASS = QuickAckAdapter
    return _ADAPTER_CLASS


def quickack_session(session) -> None:
    """Every http(s) request of this requests ``Session`` asks for quick ACKs before reading its answer."""
    adapter = _adapter_class()()
    session.mount("http://", adapter)
    session.mount("https://", adapter)


def quickack_swift(conn) -> None:
    """A swiftclient ``Connection`` whose HTTP connections (made per request URL, ``Connection.http_connection``
    in swiftclient/client.py) use quick ACKs: the store's listings and small GETs come back without the 40 ms."""
    make = conn.http_connection

    def http_connection(url=None):
        parsed, http = make(url)
        quickack_session(http.request_session)
        return parsed, http

    conn.http_connection = http_connection


_BOTO_CLASSES = None


def _boto_classes() -> dict:
    """botocore's pool classes (botocore/awsrequest.py AWSHTTPConnectionPool, AWSHTTPSConnectionPool) with
    connections that ask for quick ACKs before reading each answer."""
    global _BOTO_CLASSES
    if _BOTO_CLASSES is None:
        from botocore.awsrequest import AWSHTTPConnectionPool, AWSHTTPSConnectionPool

        _BOTO_CLASSES = _quickack_pools(AWSHTTPConnectionPool, AWSHTTPSConnectionPool)
    return _BOTO_CLASSES


def quickack_boto(client) -> None:
    """A botocore client whose connections use quick ACKs: its small answers (bucket HEADs, deletes: the checkpoint
    store's pruning asks one per object) come back from Ceph RGW without the 40 ms. botocore's URLLib3Session
    (botocore/httpsession.py) hands its pool managers ``_pool_classes_by_scheme``; a botocore without them is left as
    it is (tests/test_httpget.py would say so)."""
    if _QUICKACK is None:
        return
    http = getattr(getattr(client, "_endpoint", None), "http_session", None)
    if http is None or not hasattr(http, "_pool_classes_by_scheme") or not hasattr(http, "_manager"):
        return
    classes = _boto_classes()
    http._pool_classes_by_scheme = classes
    http._manager.pool_classes_by_scheme = classes
    for pm in getattr(http, "_proxy_managers", {}).values():
        pm.pool_classes_by_scheme = classes
