"""examples/keras3_digits as the e2e tests run it (tests/test_lease_end.py): its spec, its ranks' final weights, and
the check that its best.keras loads in a Python without Horovod or the appliance."""

import json
from pathlib import Path

from conftest import digits_code

K3_EPOCHS = 10  # 28 steps each on 2 ranks; the lease end comes at epoch 2 or 3 (the stop lands within ~1 epoch)


def keras3_spec(tmp_path: Path, name: str, url: str | None) -> str:
    p = tmp_path / f"{name}.yaml"
    p.write_text("\n".join([
        f"name: {name}", "cloud: local", "nodes: {count: 2, node_type: compute_local, slots: 1}",
        "image: appliance-cpu", "train:", f"  code: {digits_code('keras3_digits')}",
        f"  command: python train.py --epochs {K3_EPOCHS}", '  env: {"APPLIANCE_STOP_CHECK_SECONDS": "0.05"}',
        *([f"checkpoint: {{url: {json.dumps(url)}, keep: 2}}", "lease: {duration: 1h, stop_margin: 60s}"]
          if url else [])]) + "\n")
    return str(p)


def keras3_weights(lines: list[str]) -> dict[int, tuple[str, int]]:
    """Each rank's final weights' digest and optimizer steps, from examples/keras3_digits' last lines."""
    import re

    found = [m.groups() for m in (re.search(r"weights sha256 (\w+) after (\d+) optimizer steps \(rank (\d)\)", x)
                                  for x in lines) if m]
    return {int(r): (h, int(n)) for h, n, r in found}


LOAD_BEST = """
import sys
sys.path.insert(0, sys.argv[2])
import keras, model
m = keras.models.load_model(sys.argv[1])
print(type(m.optimizer).__name__, "horovod" in sys.modules, "appliance" in sys.modules)
"""
