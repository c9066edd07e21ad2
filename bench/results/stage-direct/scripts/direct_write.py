"""2 GiB written into 8 new files from one page-aligned 512 KiB buffer (the stager's receive buffer), through the
page cache and with O_DIRECT in turn, on the fresh journaled ext4 the stage benchmark writes to (bench/nodedisk.py:
a loop device with direct I/O over a sparse file). Prints the write's wall time, the time with the sync after it,
and the process's user and system time for the writes.

    python bench/results/stage-direct/scripts/direct_write.py [ROUNDS]
"""
import mmap
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # bench/
from nodedisk import node_disk  # noqa: E402

BUF = 512 << 10
TOTAL = 2 << 30


def run(dest: Path, direct: bool, files: int = 8) -> tuple[float, float, float, float]:
    buf = mmap.mmap(-1, BUF)  # page-aligned, as httpget's
    buf.write(os.urandom(BUF))
    per = TOTAL // files
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    for i in range(files):
        fd = os.open(dest / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0))
        os.ftruncate(fd, per)
        pos = 0
        while pos < per:
            pos += os.pwrite(fd, buf, pos)
        os.close(fd)
    t1, r1 = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
    os.sync()
    t2 = time.monotonic()
    for i in range(files):
        (dest / f"f{i}").unlink()
    os.sync()
    return t1 - t0, t2 - t0, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    print(f"# python bench/results/stage-direct/scripts/direct_write.py {rounds}  ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    with node_disk(Path("/var/tmp/appliance-direct"), 16 << 30) as (dest, why):
        print(f"# on {why}")
        print("| writes | write s | with sync s | user s | system s |")
        print("|---|---|---|---|---|")
        for _ in range(rounds):
            for direct in (False, True):
                w, ws, u, s = run(dest, direct)
                print(f"| {'O_DIRECT' if direct else 'page cache'} | {w:.2f} | {ws:.2f} | {u:.2f} | {s:.2f} |", flush=True)


if __name__ == "__main__":
    main()
