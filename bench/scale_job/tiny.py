"""The scale benchmark's job: Horovod starts on every rank, 20 allreduces, one result line per rank."""
import json
import os
import time

import horovod.tensorflow as hvd
import tensorflow as tf

t0 = time.time()
hvd.init()
for _ in range(20):
    v = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)
assert float(v[0]) == hvd.size()
print("APPLIANCE_RESULT " + json.dumps({"rank": hvd.rank(), "size": hvd.size(), "steps_s": round(time.time() - t0, 3),
                                        "pid": os.getpid()}), flush=True)
