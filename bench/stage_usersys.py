"""User and system time apart (`/usr/bin/time`): our stager on 8 x 256 MiB put by another tool (checked by MD5)
and put as `appliance data upload` puts them (checked by their CRC-32: CRC_META in appliance/store/objects.py),
through both APIs, beside s5cmd and rclone s3, in a rotated order each round. One Ceph RGW on 127.0.0.1.

    python bench/stage_usersys.py [ROUNDS] [OUT_DIR]     # default 4, bench/results/stage-usersys
BENCH_OBJECTS and BENCH_MIB change the 8 x 256 MiB (a quick check of the script itself).
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance.localcloud.rgw_server import RGWServer  # noqa: E402
from appliance.store.objects import StoreCreds, SwiftStore  # noqa: E402

TOOLS = ROOT / "bench" / ".venv-tools"
OBJECTS, SIZE_MIB = int(os.environ.get("BENCH_OBJECTS", 8)), int(os.environ.get("BENCH_MIB", 256))


def seed(sw, work: Path, containers=("bours", "bplain")) -> None:
    """OBJECTS random objects in each of ``containers``: ``bours`` put as our uploads put them (SwiftStore.put,
    CRC_META), ``bplain`` by plain swiftclient (no metadata: checked by MD5), ``bmulti`` by boto3's upload_file at
    its defaults (`aws s3 cp`'s: 8 MiB parts, ETag ``<md5>-32``; checked by the parts' MD5s)."""
    import boto3
    import swiftclient

    ours = SwiftStore("bours", StoreCreds(auth_url=sw.auth_url, user=sw.user, key=sw.key))
    conn = swiftclient.Connection(authurl=sw.auth_url, user=sw.user, key=sw.key, timeout=600, retries=0)
    cr = sw.credentials()
    s3 = boto3.client("s3", endpoint_url=sw.s3_endpoint, aws_access_key_id=cr["s3_access_key"],
                      aws_secret_access_key=cr["s3_secret_key"], region_name="us-east-1")
    for c in containers:
        conn.put_container(c)
    big = work / "big.bin"
    for i in range(OBJECTS):
        with open(big, "wb") as fh:
            for _ in range(SIZE_MIB):
                fh.write(os.urandom(1 << 20))
        if "bplain" in containers:
            with open(big, "rb") as fh:
                conn.put_object("bplain", f"large-{i:02d}.bin", fh, content_length=big.stat().st_size)
        if "bmulti" in containers:
            s3.upload_file(str(big), "bmulti", f"large-{i:02d}.bin")
        if "bours" in containers:
            ours.put(f"large-{i:02d}.bin", big)
    big.unlink()


def stager_job(sw, container: str, api: str, dest: str) -> str:
    """The stage_main job (its stdin) for the whole container through ``api`` at concurrency 32."""
    cr = sw.credentials()
    creds = (StoreCreds(auth_url=sw.auth_url, user=sw.user, key=sw.key).scoped() if api == "swift" else
             StoreCreds(s3_endpoint=sw.s3_endpoint, s3_access_key=cr["s3_access_key"],
                        s3_secret_key=cr["s3_secret_key"]))
    return json.dumps({"url": f"{api}://{container}/", "dest": dest, "mode": "full", "rank": 0, "nodes": 1,
                       "concurrency": 32, "creds": creds.__dict__})


def timed(argv: list[str], stdin: str | None, env: dict, dest: Path) -> dict:
    """Run ``argv`` under /usr/bin/time into an empty ``dest`` (after a sync): user, sys, wall, rc, files."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir()
    os.sync()  # the last run's dirty pages are written before this one starts
    r = subprocess.run(["/usr/bin/time", "-f", "TIME %U %S %e", *argv], input=stdin, text=True,
                       capture_output=True, env=env)
    user, sys_s, wall = map(float, r.stderr.strip().splitlines()[-1].split()[1:])
    files = sum(1 for p in dest.iterdir() if p.is_file() and not p.name.startswith(".appliance"))
    return {"user": user, "sys": sys_s, "wall": wall, "rc": r.returncode, "files": files}


def all_fetched(rs: list[dict]) -> str:
    """'yes' when every run of a row exited 0 with all OBJECTS files, else 'NO'."""
    return "yes" if all(r["rc"] == 0 and r["files"] == OBJECTS for r in rs) else "NO"


def write_report(out_dir: Path, stem: str, payload: dict, lines: list[str]) -> None:
    """``stem``.json (every run) and ``stem``.md (the table) in ``out_dir``; the table on stdout too."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def median_rows(out: dict, label, every: str) -> list[str]:
    """A table row per variant of ``stager_variants``' runs: ``label(variant)``, the medians of user, system and
    wall time, ``every`` (a key) over every round sorted, and whether every run fetched every file."""
    rows = []
    for v, rs in out.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("user", "sys", "wall")}
        rows.append(f"| {label(v)} | {med['user']:.2f} | {med['sys']:.2f} | {med['wall']:.2f} | "
                    f"{', '.join(str(x) for x in sorted(r[every] for r in rs))} | {all_fetched(rs)} |")
    return rows


def rates_and_variants_report(script: str, stem: str, title: str, rates_caption: str, rates_header: str,
                              rates: dict[str, float], stager_caption: str, variant_header: str,
                              out: dict[str, list[dict]]) -> None:
    """bench/results/``stem``/``stem``.{json,md} of a one-core rates + ``stager_variants`` benchmark (crc_speed.py,
    md5_lanes.py): the title with the time and the command, the rates table, the stager's median rows."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cmd = f"python bench/{script} " + " ".join(sys.argv[1:])
    lines = [f"# {title} ({when}, {os.cpu_count()} cores, `{cmd}`)", "", rates_caption, "",
             f"| {rates_header} | GB/s |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in rates.items()]
    lines += ["", stager_caption, "", f"| {variant_header} | user s | system s | wall s | user s, every round | "
              "all files |", "|---|---|---|---|---|---|"]
    lines += median_rows(out, str, "user")
    write_report(ROOT / "bench" / "results" / stem, stem,
                 {"command": cmd, "when": when, "one_core_gb_s": rates, "runs": out}, lines)


def stager_variants(variants: dict[str, str], rounds: int, work: Path, container: str = "bours"
                    ) -> dict[str, list[dict]]:
    """An A/B of the stager itself: for each round, each variant in a rotated order, ``timed`` runs of
    stage_main fetching OBJECTS through S3 from a fresh RGW in ``work``, in ``container`` (``seed``: our uploads'
    objects, the CRC-32 path; another tool's, the MD5 path; multipart uploads, their parts' MD5s); a variant is Python code run in the stager's process
    before stage_main (a setting changed)."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sw = RGWServer(work / "rgw").start()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": os.environ.get("HOME", "/root")}
    out: dict[str, list[dict]] = {v: [] for v in variants}
    names = list(variants)
    try:
        seed(sw, work, (container,))
        for rnd in range(rounds):
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                code = f"{variants[name]}; import runpy; runpy.run_module('appliance.node.stage_main', run_name='__main__')"
                out[name].append(timed([sys.executable, "-P", "-c", code],
                                       stager_job(sw, container, "s3", str(work / "dest")), env, work / "dest"))
                print(json.dumps({"variant": name, "round": rnd, **out[name][-1]}), flush=True)
    finally:
        sw.stop()
        shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    out_dir = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "bench" / "results" / "stage-usersys"
    work = Path("/var/tmp/appliance-usersys")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sw = RGWServer(work / "rgw").start()
    try:
        seed(sw, work)
        cr = sw.credentials()
        ak, sk = cr["s3_access_key"], cr["s3_secret_key"]
        env = {"PATH": f"{TOOLS}/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8",
               "PYTHONPATH": str(ROOT), "AWS_ACCESS_KEY_ID": ak, "AWS_SECRET_ACCESS_KEY": sk,
               "AWS_DEFAULT_REGION": "us-east-1", "RCLONE_S3_PROVIDER": "Other", "RCLONE_S3_ENDPOINT": sw.s3_endpoint,
               "RCLONE_S3_ACCESS_KEY_ID": ak, "RCLONE_S3_SECRET_ACCESS_KEY": sk, "RCLONE_S3_FORCE_PATH_STYLE": "true"}
        ours = [sys.executable, "-P", "-m", "appliance.node.stage_main"]
        runs = {
            "ours s3, other tool's (MD5)": lambda d: (ours, stager_job(sw, "bplain", "s3", d)),
            "ours s3, data upload's (CRC)": lambda d: (ours, stager_job(sw, "bours", "s3", d)),
            "ours swift, other tool's (MD5)": lambda d: (ours, stager_job(sw, "bplain", "swift", d)),
            "ours swift, data upload's (CRC)": lambda d: (ours, stager_job(sw, "bours", "swift", d)),
            "s5cmd": lambda d: ([f"{TOOLS}/bin/s5cmd", "--endpoint-url", sw.s3_endpoint, "--numworkers", "32",
                                 "cp", "s3://bours/*", d + "/"], None),
            "rclone s3": lambda d: ([f"{TOOLS}/bin/rclone", "copy", ":s3:bours", d, "--transfers", "32",
                                     "--checkers", "32"], None),
        }
        out: dict[str, list[dict]] = {k: [] for k in runs}
        names = list(runs)
        for rnd in range(rounds):
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                argv, stdin = runs[name](str(work / "dest"))
                out[name].append(timed(argv, stdin, env, work / "dest"))
                print(json.dumps({"tool": name, "round": rnd, **out[name][-1]}), flush=True)
    finally:
        sw.stop()
        shutil.rmtree(work, ignore_errors=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cmd = "python bench/stage_usersys.py " + " ".join(sys.argv[1:])
    lines = [f"# Stager user and system time ({when}, {os.cpu_count()} cores, `{cmd}`)", "",
             f"{OBJECTS} x {SIZE_MIB} MiB from one Ceph RGW on 127.0.0.1, concurrency 32, each tool under "
             f"`/usr/bin/time`, {rounds} rounds in a rotated order. Ranges over the rounds; wall: the median too.", "",
             f"| run | user s | system s | wall s | wall median s | all {OBJECTS} files |", "|---|---|---|---|---|---|"]
    for name, rs in out.items():
        u, s, e = ([r[k] for r in rs] for k in ("user", "sys", "wall"))
        lines.append(f"| {name} | {min(u)}-{max(u)} | {min(s)}-{max(s)} | {min(e)}-{max(e)} | "
                     f"{statistics.median(e):.2f} | {all_fetched(rs)} |")
    write_report(out_dir, "usersys", {"command": cmd, "when": when, "machine": f"{os.cpu_count()} cores",
                                      "runs": out}, lines)

if __name__ == "__main__":
    main()
