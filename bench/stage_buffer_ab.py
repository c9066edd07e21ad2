"""A/B of the stager's receive buffer (appliance/store/httpget.py BUF, one per thread): user and system time of
`appliance.node.stage_main` fetching 8 x 256 MiB put by our upload (the CRC-32 path) through S3 from one Ceph RGW
on 127.0.0.1, each buffer size in turn, in a rotated order each round.

    python bench/stage_buffer_ab.py [ROUNDS] [SIZES]    # default 6 1048576,524288,262144,131072
Writes bench/results/stage-buffer/buffer.{json,md}.
"""

import os
import sys
import time
from pathlib import Path

from stage_usersys import OBJECTS, ROOT, SIZE_MIB, median_rows, stager_variants, write_report  # bench/stage_usersys.py (this script's folder)

from appliance.store.httpget import _l2_bytes


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    sizes = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1 << 20, 512 << 10, 256 << 10,
                                                                                 128 << 10]
    variants = {b: f"import appliance.store.httpget as h; h.BUF = {b}" for b in sizes}
    out = stager_variants(variants, rounds, Path("/var/tmp/appliance-bufab"))
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cmd = "python bench/stage_buffer_ab.py " + " ".join(sys.argv[1:])
    l2 = _l2_bytes()
    l2s = f"{l2 >> 10}K" if l2 else "unknown"
    lines = [f"# The stager's receive buffer ({when}, {os.cpu_count()} cores, L2 {l2s} per core, `{cmd}`)", "",
             f"{OBJECTS} x {SIZE_MIB} MiB put by our upload (checked by CRC-32), through S3, one Ceph RGW on 127.0.0.1; "
             f"medians of {rounds} rounds, the sizes in a rotated order.", "",
             "| buffer | user s | system s | wall s | system s, every round | all files |", "|---|---|---|---|---|---|"]
    lines += median_rows(out, lambda b: f"{b >> 10} KiB", "sys")
    write_report(ROOT / "bench" / "results" / "stage-buffer", "buffer",
                 {"command": cmd, "when": when, "l2_per_core": l2s, "runs": {str(b): v for b, v in out.items()}}, lines)

if __name__ == "__main__":
    main()
