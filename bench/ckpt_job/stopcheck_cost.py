"""What one collective stop check costs: the Checkpointer's allreduce (Max) of a 2-element int32 tensor, timed
1,000 times on every rank after 50 warm-up calls; rank 0 prints one STOPCHECK_COST line (ms: mean, p50, p90, p99)."""

import json
import time

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

hvd.init()
for _ in range(50):
    hvd.allreduce(tf.constant([0, 0], dtype=tf.int32), op=hvd.Max, name="appliance.stop")
ts = []
for _ in range(1000):
    t = time.perf_counter()
    v = hvd.allreduce(tf.constant([0, 0], dtype=tf.int32), op=hvd.Max, name="appliance.stop")
    int(v[0])
    ts.append(time.perf_counter() - t)
ms = np.array(ts) * 1000
if hvd.rank() == 0:
    print("STOPCHECK_COST " + json.dumps({"calls": len(ms), "mean_ms": round(float(ms.mean()), 3),
                                          **{f"p{q}_ms": round(float(np.percentile(ms, q)), 3) for q in (50, 90, 99)}}),
          flush=True)
