"""A/B of the collective stop check's interval: steps/s of bench/ckpt_job --mode stopcheck at several
APPLIANCE_STOP_CHECK_SECONDS, interleaved with --mode plain, on 2 nodes of the local cloud.

    .venv/bin/python bench/stopcheck_ab.py plain,0.5,1,1000 REPEATS HIDDEN EPOCHS   # e.g. ... 2 512 20
"""
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import ckpt_bench as cb  # noqa: E402
from appliance import flows, localcloud  # noqa: E402

settings = sys.argv[1].split(",")  # e.g. plain,0.5,1,1000
repeats, hidden, epochs = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tmp = tempfile.TemporaryDirectory(prefix="stopcheck-ab-")  # the specs, removed at the end
d = Path(tmp.name)
localcloud.start()
base = cb.write_spec(d, "abx", "python ckpt_job.py", None)
cluster = flows.up(base)
rates = {s: [] for s in settings}
try:
    for r in range(repeats):
        for s in settings:
            mode = "plain" if s == "plain" else "stopcheck"
            p = Path(cb.write_spec(d, "abx", f"python ckpt_job.py --mode {mode} --hidden {hidden} --epochs {epochs}", None))
            if s != "plain":
                p.write_text(p.read_text().replace("train:\n", "train:\n  env: {\"APPLIANCE_STOP_CHECK_SECONDS\": \"%s\"}\n" % s))
            res = cb.run(str(p), cluster)
            assert res.exit_code == 0, res.failure
            r0 = res.results[0]
            rates[s].append(round(r0["steps"] / r0["seconds"], 2))
            print(s, rates[s][-1], flush=True)
finally:
    flows.down("abx")
    tmp.cleanup()
print(json.dumps({s: {"runs": v, "best": max(v), "median": sorted(v)[len(v) // 2]} for s, v in rates.items()}))
