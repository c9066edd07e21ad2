"""How much to read from the socket per read(): bench/tls_reads.py's 8 streams read through _tlsread.recv_into with
OpenSSL's read-ahead at each LENGTH (0: no read-ahead, OpenSSL's two read()s a record; 1: read-ahead into OpenSSL's
own one-record buffer, ~17 KB; more: a buffer of that many bytes), the lengths in turn each round.

    python bench/results/tls-read-ahead/lengths.py ROUNDS MIB_PER_STREAM LENGTH,LENGTH,...
"""

import multiprocessing as mp
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import tls_reads  # noqa: E402
from appliance.localcloud.rgw_server import self_signed  # noqa: E402


def main() -> None:
    rounds, size, lengths = int(sys.argv[1]), int(sys.argv[2]) << 20, [int(x) for x in sys.argv[3].split(",")]
    cert, key = self_signed(Path(tempfile.mkdtemp()), "127.0.0.1")
    q = mp.Queue()
    srv = mp.Process(target=tls_reads.serve, args=(cert, key, size, q), daemon=True)
    srv.start()
    port = q.get()
    runs: dict[int, list] = {n: [] for n in lengths}
    try:
        for rnd in range(rounds):
            for n in lengths[rnd % len(lengths):] + lengths[:rnd % len(lengths)]:
                c0, r0 = tls_reads.syscr(), resource.getrusage(resource.RUSAGE_SELF)
                ts = [threading.Thread(target=tls_reads.read, args=(port, cert, size, "tlsread", n))
                      for _ in range(tls_reads.STREAMS)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                r1, c1 = resource.getrusage(resource.RUSAGE_SELF), tls_reads.syscr()
                runs[n].append((r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime, c1 - c0))
    finally:
        srv.terminate()
    print(f"# `python bench/results/tls-read-ahead/lengths.py {' '.join(sys.argv[1:])}` "
          f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}): {tls_reads.STREAMS} streams of {size >> 20} MiB, "
          f"medians of {rounds}")
    print("| read-ahead length | user s | system s | CPU s | read() calls |\n|---|---|---|---|---|")
    for n, rs in runs.items():
        u, s_, c = (statistics.median(r[i] for r in rs) for i in range(3))
        print(f"| {n:,} | {u:.2f} | {s_:.2f} | {statistics.median(r[0] + r[1] for r in rs):.2f} | {c:,.0f} |")


if __name__ == "__main__":
    main()
