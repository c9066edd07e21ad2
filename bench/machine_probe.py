"""What this machine adds to a staging benchmark's system time, apart from any tool: the two costs that made the
same tool's rounds differ by 2-3x here (docs/staging.md of 14aa98a (in git), "Where the benchmark writes").

1. Making files soon after deleting others, on the work directory's file system (this machine's root: ext4
   without a journal, which skips inodes deleted in the last minute; bench/nodedisk.py) and on a fresh journaled
   ext4 (what `make bench-stage` writes to now): 5,000 files of 100 KB, deleted, 4 rounds.
2. Writing 2 GiB into new page-cache pages, 3 rounds: the guest hands freed pages back to its host (virtio-balloon
   free page reporting; ``/sys/module/page_reporting``), and the first write to a page the host took back costs a
   fault in the host, which the guest sees as system time in the copy.

    sudo python bench/machine_probe.py [OUT_DIR]     # default bench/results/machine
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nodedisk import node_disk  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REPORTED = Path("/sys/module/page_reporting/parameters/reported_kib")


def _sys_s() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def make_files(d: Path, n: int = 5000, size: int = 100_000) -> dict:
    """Make ``n`` files of ``size`` bytes in ``d``, then delete them: the system time and wall time of making."""
    data = os.urandom(size)
    d.mkdir(parents=True, exist_ok=True)
    s0, t0 = _sys_s(), time.monotonic()
    for i in range(n):
        fd = os.open(d / f"{i:06d}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, data)
        os.close(fd)
    out = {"sys_s": round(_sys_s() - s0, 2), "wall_s": round(time.monotonic() - t0, 2)}
    shutil.rmtree(d)
    return out


def write_new_pages(path: Path, total: int = 2 << 30, buf: int = 512 << 10) -> dict:
    """Write ``total`` bytes into a new file (new page-cache pages), then delete it: system time of the writes, and
    how many KiB the guest reported free to its host in the 5 s after (None without page reporting)."""
    view = memoryview(bytearray(buf))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    s0, t0 = _sys_s(), time.monotonic()
    for i in range(total // buf):
        os.pwrite(fd, view, i * buf)
    out = {"sys_s": round(_sys_s() - s0, 2), "wall_s": round(time.monotonic() - t0, 2)}
    os.close(fd)
    os.sync()
    before = int(REPORTED.read_text()) if REPORTED.exists() else None
    path.unlink()
    time.sleep(5)  # an observation window, not a wait for anything: reporting runs ~2 s after pages are freed
    out["reported_kib_after"] = int(REPORTED.read_text()) - before if before is not None else None
    return out


def main() -> None:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "bench" / "results" / "machine"
    work = Path("/var/tmp/appliance-probe")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    res: dict = {"files_workdir": [], "files_node_disk": [], "pages": []}
    try:
        for _ in range(4):
            res["files_workdir"].append(make_files(work / "files"))
        with node_disk(work, 4 << 30) as (disk, what):
            res["node_disk"] = what
            for _ in range(4):
                res["files_node_disk"].append(make_files(disk / "files"))
        for _ in range(3):
            res["pages"].append(write_new_pages(work / "pages.bin"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cmd = " ".join(["python bench/machine_probe.py", *sys.argv[1:]])
    fmt = lambda rs: ", ".join(f"{r['sys_s']}" for r in rs)  # noqa: E731
    lines = [f"# What the machine adds ({when}, {os.cpu_count()} cores, `{cmd}`)", "",
             "| what | system s, each round |", "|---|---|",
             f"| 5,000 files of 100 KB made, then deleted: the work directory's file system | "
             f"{fmt(res['files_workdir'])} |",
             f"| the same on {res.get('node_disk', '?')} | {fmt(res['files_node_disk'])} |",
             f"| 2 GiB written into new page-cache pages, then deleted | {fmt(res['pages'])} |", "",
             "KiB the guest reported free to its host within 5 s of each 2 GiB delete: "
             + ", ".join(str(r["reported_kib_after"]) for r in res["pages"]) + "."]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "machine.json").write_text(json.dumps({"command": cmd, "when": when, **res}, indent=1))
    (out_dir / "machine.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
