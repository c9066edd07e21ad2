"""An https body read through Python's ssl module (a TLS record, 16 KiB, per call: the GIL released and taken back
for each) against appliance/store/_tlsread.c (a 512 KiB buffer of records per call, the GIL released once), without
and with OpenSSL's read-ahead (httpget.READ_AHEAD: a read() per record's header and another per its body, against
one read() of what the socket holds), with 8 streams read by 8 threads at once, as the stager reads 8 large
objects. The server is another process on this machine (Python's ssl, TLS 1.3), so the client's own CPU, context
switches and read() calls are what is counted (getrusage, /proc/self/io).

    python bench/tls_reads.py [ROUNDS] [MIB_PER_STREAM] [--out DIR]   # 3 rounds, 128 MiB, bench/results/tls-reads
"""

import json
import multiprocessing as mp
import os
import resource
import socket
import ssl
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance.localcloud.rgw_server import self_signed  # noqa: E402
from appliance.store import httpget  # noqa: E402

STREAMS = 8


def serve(cert: Path, key: Path, size: int, port_q) -> None:
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(cert, key)
    ls = socket.create_server(("127.0.0.1", 0))
    port_q.put(ls.getsockname()[1])
    chunk = os.urandom(1 << 20)

    def one(c):
        with sctx.wrap_socket(c, server_side=True) as s:
            for _ in range(size >> 20):
                s.sendall(chunk)

    while True:
        c, _ = ls.accept()
        threading.Thread(target=one, args=(c,), daemon=True).start()


def read(port: int, cert: Path, size: int, how: str, ahead: int | None = None) -> None:
    """One stream read to its end by ``how``; ``ahead``: OpenSSL's read-ahead length (0: none; default: httpget's
    for "read-ahead", none for the others)."""
    ctx = ssl.create_default_context(cafile=str(cert))
    if ahead is None:
        ahead = httpget.READ_AHEAD if how == "read-ahead" else 0
    if ahead:
        httpget._tlsread.read_ahead(ctx, ahead)
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(60)  # as httpget's connections: non-blocking underneath
    with ctx.wrap_socket(s, server_hostname="127.0.0.1") as t:
        buf = memoryview(bytearray(httpget.BUF))
        n = 0
        while n < size:
            want = buf[:min(len(buf), size - n)]
            k = t.recv_into(want) if how == "ssl" else httpget._tlsread.recv_into(t._sslobj, t.fileno(), want, 60000)
            if not k:
                raise RuntimeError("the stream ended early")
            n += k


def syscr() -> int:
    """The read system calls this process has made (/proc/self/io: read(), readv(), recvmsg() and the like)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("syscr:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    args = sys.argv[1:]
    out = ROOT / "bench" / "results" / "tls-reads"
    if "--out" in args:
        i = args.index("--out")
        out = Path(args[i + 1]).resolve()
        del args[i:i + 2]
    rounds = int(args[0]) if args else 3
    size = (int(args[1]) if len(args) > 1 else 128) << 20
    if httpget._tlsread is None:
        sys.exit("appliance/store/_tlsread.c is not built here (pip install -e . builds it)")
    tmp = tempfile.TemporaryDirectory(prefix="tls-reads-")  # the certificate and key, removed at the end
    cert, key = self_signed(Path(tmp.name), "127.0.0.1")
    q = mp.Queue()
    srv = mp.Process(target=serve, args=(cert, key, size, q), daemon=True)
    srv.start()
    port = q.get()
    hows = {"ssl": "the ssl module (SSLSocket.recv_into: a record per call)",
            "tlsread": "_tlsread.recv_into (a 512 KiB buffer of records per call)",
            "read-ahead": f"the same, with OpenSSL's read-ahead ({httpget.READ_AHEAD:,} bytes a read(): httpget's)"}
    runs = {h: [] for h in hows}
    try:
        for rnd in range(rounds):
            for how in list(hows)[rnd % len(hows):] + list(hows)[:rnd % len(hows)]:
                c0, r0, t0 = syscr(), resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
                ts = [threading.Thread(target=read, args=(port, cert, size, how)) for _ in range(STREAMS)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                t1, r1, c1 = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF), syscr()
                runs[how].append({"user": round(r1.ru_utime - r0.ru_utime, 2),
                                  "sys": round(r1.ru_stime - r0.ru_stime, 2), "wall": round(t1 - t0, 2), "voluntary_switches": r1.ru_nvcsw - r0.ru_nvcsw,
                                  "involuntary_switches": r1.ru_nivcsw - r0.ru_nivcsw, "reads": c1 - c0})
                print(json.dumps({"how": how, "round": rnd, **runs[how][-1]}), flush=True)
    finally:
        srv.terminate()
        tmp.cleanup()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cmd = "python bench/tls_reads.py " + " ".join(sys.argv[1:])
    total = lambda r: r["user"] + r["sys"]  # noqa: E731
    lines = [f"# https reads: the ssl module against _tlsread ({when}, {os.cpu_count()} cores, `{cmd}`)", "",
             f"{STREAMS} TLS 1.3 streams of {size >> 20} MiB read at once by {STREAMS} threads from a server process "
             f"on 127.0.0.1 ({ssl.OPENSSL_VERSION}); the client's own time and context switches (getrusage), medians "
             f"of {rounds} rounds, the {len(hows)} in turn (each round starts with the next).", "",
             "| read by | user s | system s | CPU s | wall s | voluntary context switches | involuntary | read() calls |",
             "|---|---|---|---|---|---|---|---|"]
    for how, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        lines.append(f"| {hows[how]} | {med['user']:.2f} | {med['sys']:.2f} | {statistics.median(map(total, rs)):.2f} "
                     f"| {med['wall']:.2f} | {med['voluntary_switches']:.0f} | {med['involuntary_switches']:.0f} | "
                     f"{med['reads']:,.0f} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "tls.json").write_text(json.dumps({"command": cmd, "when": when, "runs": runs}, indent=1))
    (out / "tls.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
