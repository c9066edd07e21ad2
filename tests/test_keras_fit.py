"""Levels 2 and 1 of docs/checkpoints.md: an ordinary Keras + Horovod script, with no line of the appliance in it (or
the appliance's callback passed to model.fit by hand: the plot test), stops before the lease end with a committed
checkpoint and resumes bit-exactly, mid-epoch.

Real parts: examples/plain_fit/train.py (Dropout, BatchNormalization, Horovod's callbacks, rank 0's
ModelCheckpoint) on 2 testbed nodes through horovodrun, a real Swift. The stop comes after a random step (the
Checkpointer's ``stop-at:N`` test hook asks for it on every rank, so it lands exactly there), and the resumed run's
final weights must equal an uninterrupted run's, for the input forms Keras users write: a finite tf.data pipeline
with a seeded shuffle (Keras re-creates its iterator each epoch) and NumPy arrays (Keras shuffles them); the third,
``.repeat()`` with ``steps_per_epoch`` (Horovod's MNIST example), resumes across a lease end in test_lease_end.py.
With Keras' own random layers (the "legacy" RNG, ``APPLIANCE_KERAS_RNG=legacy``), the same resume is not bit-exact:
that run is the check that the test can fail.
"""

import json
import random
import re
import shutil
from pathlib import Path

import pytest

from appliance import report
from appliance.flows import resume
from appliance.flows import run_job as train
from appliance.spec import load_spec
from conftest import NETNS_OK, ROOT, digits_code

pytestmark = pytest.mark.skipif(not NETNS_OK, reason="needs network namespaces")

CODE = ROOT / "examples" / "plain_fit"
EPOCHS = 3
STEPS = {"tfdata": 28, "repeat": 28, "numpy": 29}  # per epoch on 2 ranks (898 or 899 digits per rank, batch 32)


def spec_file(tmp_path: Path, name: str, data: str, *, url: str | None, env: dict | None = None,
              code: Path | None = None,
              command: str | None = None, more: tuple[str, ...] = ()) -> str:
    env = {"APPLIANCE_STOP_CHECK_SECONDS": "0.0001", **(env or {})}  # a check every step: the stop lands anywhere
    command = command or f"python train.py --data {data} --epochs {EPOCHS}"
    lines = [f"name: {name}", "cloud: local", "nodes: {count: 2, node_type: compute_local, slots: 1}", *more,
             "train:", f"  code: {code or digits_code('plain_fit')}", f"  command: {command}",
             "  env: " + json.dumps(env)]
    if url:
        lines.append(f"checkpoint: {{url: {json.dumps(url)}, keep: 2}}")
    p = tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}.yaml"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def final_weights(lines: list[str]) -> tuple[str, int]:
    found = [m for m in (re.search(r"weights sha256 (\w+) after (\d+) optimizer steps", x) for x in lines) if m]
    assert len(found) == 1, lines[-20:]
    return found[0].group(1), int(found[0].group(2))


def interrupted_and_resumed(cluster, tmp_path, name, data, stop_at, env=None):
    said: list[str] = []
    res = train(load_spec(spec_file(tmp_path, name, data, url="swift://fitckpt/",
                                    env={"APPLIANCE_FAULT": f"stop-at:{stop_at}", **(env or {})})),
                cluster, out=said.append)
    assert res.exit_code == 75, (res.failure, said[-30:])
    assert res.stopped["committed"] and res.stopped["step"] == stop_at
    assert any("[appliance] protected (level 2, " in x for x in said), said[:10]
    cluster.save()
    fixed = spec_file(tmp_path, name, data, url="swift://fitckpt/", env=env)
    out2: list[str] = []
    with report.to(out2.append):
        res2 = resume(name, spec_path=fixed, cluster_name=cluster.name, out=out2.append)
    assert res2.exit_code == 0, (res2.failure, out2[-30:])
    assert res2.resumed["step"] == stop_at  # 0 steps lost
    return res2, out2


@pytest.fixture(scope="module")
def references(cluster2, tmp_path_factory):
    """The uninterrupted run of each input form, made once for the module: (final weights, steps, its lines)."""
    made: dict = {}

    def ref(data: str) -> tuple[str, int, list[str]]:
        if data not in made:
            out: list[str] = []
            res = train(load_spec(spec_file(tmp_path_factory.mktemp("ref"), f"fitref-{data}", data, url=None)),
                        cluster2, out=out.append)
            assert res.exit_code == 0, res.failure
            made[data] = (*final_weights(out), out)
        return made[data]
    return ref


def checked_reference(references, data: str) -> tuple[str, int]:
    """The uninterrupted run of an input form, with what its output must show: (final weights, steps)."""
    ref_sha, steps, out = references(data)
    assert any("warning: no checkpoint.url" in x for x in out)
    assert steps == EPOCHS * STEPS[data]
    # rank 0's Keras progress bar (verbose=1, redrawn with \r and \b): one clean line per epoch, nothing else
    n = STEPS[data]
    assert len([x for x in out if re.search(rf"^\[0\|node1\] {n}/{n} \[=+\] - ", x)]) == EPOCHS, out[-20:]
    assert not any("\r" in x or "\b" in x for x in out)
    return ref_sha, steps


@pytest.mark.slow
# tfdata: the two resumes of the plot test; repeat (Horovod's MNIST shape): across a lease end in test_lease_end.py
@pytest.mark.parametrize("data", ["numpy"])
def test_an_unchanged_keras_script_resumes_mid_epoch_bit_exactly(data, references, cluster2, swift, st_env, tmp_path):
    ref_sha, steps = checked_reference(references, data)
    stop_at = random.randint(STEPS[data] + 1, 2 * STEPS[data] - 2)  # mid-epoch 1: replays epoch 0's iterator too
    res2, out2 = interrupted_and_resumed(cluster2, tmp_path, f"fit-{data}", data, stop_at)
    assert res2.resumed["bit_exact"], res2.resumed
    assert any("skipped the" in x and f"(epoch 1, batch {stop_at - STEPS[data]})" in x for x in out2), out2[-30:]
    assert final_weights(out2) == (ref_sha, steps), f"stopped after step {stop_at}"


@pytest.mark.slow
def test_keras_legacy_random_layers_cannot_resume_exactly(cluster2, swift, st_env, tmp_path):
    """The counter-check: the same resume with Keras' stateful-kernel RNG for Dropout differs from its reference."""
    legacy = {"APPLIANCE_KERAS_RNG": "legacy"}
    out: list[str] = []
    ref = train(load_spec(spec_file(tmp_path, "fitleg-ref", "tfdata", url=None, env=legacy)), cluster2,
                out=out.append)
    assert ref.exit_code == 0, ref.failure
    res2, out2 = interrupted_and_resumed(cluster2, tmp_path, "fitleg", "tfdata", STEPS["tfdata"] + 5, env=legacy)
    assert final_weights(out2)[0] != final_weights(out)[0]


def level_1_code(tmp_path: Path) -> Path:
    """examples/plain_fit/train.py with the appliance's `callback()` passed to model.fit by hand (level 1)."""
    code = tmp_path / "code"
    code.mkdir()
    text = (CODE / "train.py").read_text()
    text = text.replace("import horovod.tensorflow.keras as hvd\n",
                        "import horovod.tensorflow.keras as hvd\n\nfrom appliance.checkpoint.keras import callback\n")
    text = text.replace("    verbose = 1 if hvd.rank() == 0 else 0\n",
                        "    callbacks.append(callback())\n    verbose = 1 if hvd.rank() == 0 else 0\n")
    assert "callbacks.append(callback())" in text and "import callback" in text
    (code / "train.py").write_text(text)
    shutil.copy(digits_code("plain_fit") / "digits.npz", code)
    return code


@pytest.mark.slow
def test_two_resumes_continue_one_step_axis_bit_exactly_and_plot_it(references, cluster2, swift, st_env, tmp_path):
    """Level 1 (the script passes the appliance's `callback()` to model.fit by hand, `checkpoint.auto: false`), the
    finite tf.data form, stopped twice: the launch line says level 1, and the second resume, mid-epoch 1 (it replays
    epoch 0's iterator too), still ends bit-exactly on the unchanged script's uninterrupted run's weights (the
    callback changes nothing in the training). The run's metrics are one curve across stops and resumes: the CSV's
    step axis never restarts, and `appliance ls RUN --plot` draws it with both resumes marked."""
    from appliance.checkpoint import runs
    from appliance.flows import plot_run

    name, n = "fitplot", STEPS["tfdata"]
    code = level_1_code(tmp_path)

    def spec(env=None):
        p = Path(spec_file(tmp_path, name, "tfdata", url="swift://fitckpt/", env=env, code=code))
        p.write_text(p.read_text().replace("keep: 2}", "keep: 2, auto: false}"))
        return str(p)

    first, second = random.randint(3, n - 3), random.randint(n + 3, 2 * n - 3)
    said: list[str] = []
    res = train(load_spec(spec({"APPLIANCE_FAULT": f"stop-at:{first}"})), cluster2, out=said.append)
    assert res.exit_code == 75 and res.stopped["step"] == first, res.failure
    assert any("[appliance] protected (level 1, the appliance's callback in model.fit)" in x for x in said)
    cluster2.save()
    res = resume(name, spec_path=spec({"APPLIANCE_FAULT": f"stop-at:{second}"}), cluster_name=cluster2.name,
                 out=lambda m: None)
    assert res.exit_code == 75 and res.stopped["step"] == second and res.resumed["step"] == first
    done = spec()
    out3: list[str] = []
    with report.to(out3.append):
        res = resume(name, spec_path=done, cluster_name=cluster2.name, out=out3.append)
    assert res.exit_code == 0 and res.resumed["step"] == second and res.resumed["bit_exact"], res.resumed
    assert any("skipped the" in x and f"(epoch 1, batch {second - n})" in x for x in out3), out3[-30:]
    assert final_weights(out3) == checked_reference(references, "tfdata"), f"stopped after steps {first} and {second}"
    assert [j["first_step"] for j in runs.load(name)["jobs"]] == [0, first, second]
    d = plot_run(name, str(tmp_path / "m.png"), spec_path=done)
    assert Path(d["png"]).stat().st_size > 10_000 and d["resumed_at"] == [first, second]
    assert d["step_axis_problems"] == [] and d["steps"] == [1, EPOCHS * n]
    assert {"step/loss", "step/accuracy", "epoch/loss"} <= set(d["metrics"])
