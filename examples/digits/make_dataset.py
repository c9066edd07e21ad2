"""Write the digits dataset (scikit-learn's bundled copy, no network) as digits.npz into DIR.

`make deploy` uploads it to the local cloud's Swift; `appliance stage` brings it to every node's
local disk; train.py reads it from there ($APPLIANCE_DATA_DIR).
"""

import sys
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

out = Path(sys.argv[1] if len(sys.argv) > 1 else "digits-data")
out.mkdir(parents=True, exist_ok=True)
d = load_digits()
np.savez(out / "digits.npz", x=(d.data / 16.0).astype("float32"), y=d.target.astype("int64"))
print(f"wrote {out / 'digits.npz'} ({len(d.data)} images)")
