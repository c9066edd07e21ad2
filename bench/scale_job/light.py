"""The light job of `bench/scale_bench.py --light`: one result line per rank and nothing else (no TensorFlow, no
Horovod import), so the node count is not bounded by N TensorFlow processes on this machine's memory and cores:
what it measures is the launcher's side of a job on N nodes (sessions, horovodrun's SSH fan-out, output)."""
import json
import os

print("APPLIANCE_RESULT " + json.dumps({"rank": int(os.environ.get("HOROVOD_RANK", -1)),
                                        "size": int(os.environ.get("HOROVOD_SIZE", -1)), "pid": os.getpid()}),
      flush=True)
