"""A job's metrics (node/checkpointer.py): one CSV and TensorBoard events under the run's metrics directory, on one
step axis across resumes (a resume starts from the restored checkpoint's copy). A mixin of ``Checkpointer``."""

from __future__ import annotations

import csv
import shutil
import time
from pathlib import Path


class Metrics:
    def _open_metrics(self, restore: Path | None) -> None:
        import tensorflow as tf

        if restore is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            if (restore / "metrics").exists():
                shutil.copytree(restore / "metrics", self.metrics_dir)
        elif self.metrics_dir.exists():
            shutil.rmtree(self.metrics_dir)  # a fresh run starts a fresh step axis
        self.metrics_dir.mkdir(parents=True, exist_ok=True)
        path = self.metrics_dir / "metrics.csv"
        new = not path.exists()
        fh = open(path, "a", newline="")
        w = csv.writer(fh)
        if new:
            w.writerow(["step", "epoch", "metric", "value", "time"])
        self._csv = (fh, w)
        self._writer = tf.summary.create_file_writer(str(self.metrics_dir / "tb"))
        # the process's first summary op costs ~0.2 s (measured: 0.18-0.20 s here, then ~1 ms): paid now, before
        # training, into a writer that writes nothing, not in the first steps, where Keras times the callbacks
        with tf.summary.create_noop_writer().as_default(step=0):
            tf.summary.scalar("appliance/warm-up", 0.0)

    def _log_metrics(self, logs: dict, every: int, epoch_end: bool = False) -> None:
        import tensorflow as tf

        if self._csv is None or (self.step % every and not epoch_end):
            return
        now = time.time()
        epoch = self.epoch + (1 if epoch_end else 0)
        with self._writer.as_default(step=self.step):
            for k, v in sorted(logs.items()):
                try:
                    v = float(v)
                except (TypeError, ValueError):
                    continue
                name = f"epoch/{k}" if epoch_end else f"step/{k}"
                self._csv[1].writerow([self.step, epoch, name, f"{v:.6g}", f"{now:.3f}"])
                tf.summary.scalar(name, v)

    def _close_metrics(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
        if self._csv is not None:
            self._csv[0].close()
            self._csv = None
