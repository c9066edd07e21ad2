"""scikit-learn's bundled 8x8 digits as files to pack: sample i is ``{i:05d}.x`` (64 float32, 0..1) and
``{i:05d}.y`` (its label, as text). ``--copies N`` writes the set N times (keys ``c{k}-{i:05d}``): a larger dataset.

    python make_dataset.py DIR [--copies N]
    appliance data pack DIR swift://digits-packed/v1/ --shard-size 65536
"""

import argparse
from pathlib import Path

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--copies", type=int, default=1)
    args = ap.parse_args()
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images / 16.0).astype("float32")
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    for k in range(args.copies):
        for i in range(len(x)):
            key = f"{i:05d}" if args.copies == 1 else f"c{k}-{i:05d}"
            (out / f"{key}.x").write_bytes(x[i].tobytes())
            (out / f"{key}.y").write_text(str(int(d.target[i])))
    print(f"{args.copies * len(x)} samples in {out}")


if __name__ == "__main__":
    main()
