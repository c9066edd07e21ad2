"""The appliance's checkpoints on a Keras 3 job (appliance/node/keras3_fit.py, rngstate.py): what a checkpoint
says of its Keras, the refusal of a resume across a switch of Keras, and the resumed fit's first epoch (the input
replayed, the batches already trained on skipped). Fakes only: no TensorFlow, no Keras imported."""

import sys
import types

import pytest

from appliance.node import keras3_fit, rngstate
from appliance.protocol import keras_switch


def _keras3_layer_class():
    layer = type("Layer", (), {"__module__": "keras.src.layers.layer"})
    return type("Sequential", (layer,), {"__module__": "keras.src.models.sequential"})


def test_a_keras3_model_is_told_from_a_tf_keras_one(monkeypatch):
    monkeypatch.setitem(sys.modules, "keras", types.SimpleNamespace(__version__="3.15.1"))
    tf_keras = type("Sequential", (type("Layer", (), {"__module__": "tf_keras.src.engine.base_layer"}),), {})
    assert keras3_fit.is_keras3_model(_keras3_layer_class()()) and rngstate.keras_of(_keras3_layer_class()()) == "3"
    assert not keras3_fit.is_keras3_model(tf_keras()) and rngstate.keras_of(tf_keras()) == "2"
    monkeypatch.setitem(sys.modules, "keras", types.SimpleNamespace(__version__="2.15.0"))  # Keras 2's own `keras`
    assert not keras3_fit.is_keras3_model(_keras3_layer_class()())


def test_every_layers_seed_generator_once_in_layer_order():
    a, b, c = object(), object(), object()
    layers = [types.SimpleNamespace(_seed_generators=[a]), types.SimpleNamespace(_seed_generators=[]),
              types.SimpleNamespace(_seed_generators=[b, c]), types.SimpleNamespace(_seed_generators=[a]),
              types.SimpleNamespace()]
    model = types.SimpleNamespace(_flatten_layers=lambda include_self: layers)
    assert keras3_fit.seed_generators(model) == [a, b, c]


@pytest.mark.parametrize("saved, now, refused", [
    (None, "2", False), ("2", "2", False), ("3", "3", False),  # a checkpoint without `keras`: a tf_keras job's
    (None, "3", True), ("2", "3", True), ("3", "2", True)])
def test_a_resume_across_a_switch_of_keras_is_refused_in_one_line(saved, now, refused):
    why = keras_switch(saved, now)
    assert bool(why) == refused
    if refused:
        assert "\n" not in why and "a resume across a switch of Keras is refused" in why
        assert f"set train.keras: {saved or '2'}" in why


class _Epochs:
    """Keras 3's EpochIterator as far as the wrapped ``_enumerate_iterator`` uses it: batches numbered from 0 on;
    with ``steps_per_epoch`` one iterator kept across epochs, else a new one per epoch (``made`` counts them)."""

    def __init__(self, steps_per_epoch=None, batches=6):
        self.steps_per_epoch, self.steps_per_execution, self.batches = steps_per_epoch, 1, batches
        self._current_iterator, self._steps_seen, self.made = None, 0, 0

    def _get_iterator(self):
        me = self

        class Data:
            def __iter__(self):
                me.made += 1
                return iter(range(1000 * me.made, 1000 * me.made + 10_000))
        return Data()

    def original(self):
        if self.steps_per_epoch:
            if self._current_iterator is None:
                self._current_iterator = iter(self._get_iterator())
            it, n = self._current_iterator, self.steps_per_epoch
        else:
            it, n = iter(self._get_iterator()), self.batches
        for step in range(n):
            yield step, step, it


def _first_epoch(epochs: _Epochs, epoch: int, batch: int) -> tuple[list, list]:
    said: list[str] = []
    keras3_fit._STATE["plan"] = (epoch, batch, said.append)
    got = []
    for step, _, it in keras3_fit._resumed(epochs, _Epochs.original, epoch, batch, said.append):
        got.append((step, next(it)))
    return got, said


def test_a_resumed_fit_with_steps_per_epoch_skips_the_earlier_epochs_and_batches_of_its_one_iterator():
    got, said = _first_epoch(_Epochs(steps_per_epoch=5), epoch=2, batch=3)
    # one iterator (made once), 2 epochs of 5 batches and 3 more taken off it: steps 3 and 4 get batches 13 and 14
    assert got == [(3, 1013), (4, 1014)]
    assert said == ["skipped the 13 batch(es) the run had already trained on (epoch 2, batch 3)"]


def test_a_resumed_fit_of_a_finite_input_makes_the_earlier_epochs_iterators_again():
    e = _Epochs(batches=6)
    got, said = _first_epoch(e, epoch=2, batch=4)
    # the iterators of epochs 0 and 1 made again (a seeded reshuffle advances per iterator), then epoch 2's
    assert e.made == 3 and got == [(4, 3004), (5, 3005)]
    assert said == ["skipped the 4 batch(es) the run had already trained on (epoch 2, batch 4)"]


def test_a_resumed_fit_whose_data_ran_out_says_so():
    got, said = _first_epoch(_Epochs(batches=3), epoch=0, batch=5)
    assert got == [] and said[0].endswith("(epoch 0, batch 5); the data ran out after 3 of 5")


def test_the_plan_goes_to_the_next_fits_first_epoch_only_and_not_past_its_end(monkeypatch):
    monkeypatch.setattr(keras3_fit, "_STATE", {"iter": True, "plan": None})
    model = types.SimpleNamespace(_initial_epoch=None)
    keras3_fit.resume_at(model, 2, 3, lambda m: None)
    assert model._initial_epoch == 2 and keras3_fit._STATE["plan"][:2] == (2, 3)
    keras3_fit.end_fit(model)  # a fit that ran no epoch (the run had finished): no plan left for an evaluate
    assert model._initial_epoch is None and keras3_fit._STATE["plan"] is None


def test_the_launcher_refuses_a_resume_across_a_switch_of_keras_before_any_lease(tmp_path, monkeypatch):
    from appliance.errors import ApplianceError
    from appliance.flows import steps
    from appliance.spec import parse_spec
    from appliance.store.checkpoints import Committed

    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text("import keras\nfrom keras import ops\n")  # auto: Keras 3
    spec = parse_spec({"name": "k", "train": {"code": "code", "command": "python train.py"},
                       "checkpoint": {"url": "file:///nowhere/"}}, path=str(tmp_path / "k.yaml"))
    meta = {"epoch": 1, "offset": 3, "world_size": 2}
    ck = Committed(name="ckpt-000000042", step=42)
    cs = types.SimpleNamespace(newest_good=lambda: (ck, []), read_manifest=lambda c: {"meta": meta})
    monkeypatch.setattr(steps, "refuse_if_running", lambda *a: None)
    ctx = types.SimpleNamespace(spec=spec, checkpoints=cs, site=None)
    with pytest.raises(ApplianceError) as e:  # a tf_keras job's checkpoint (no `keras` in it), the job now Keras 3
        steps._resume_point(ctx)
    assert str(e.value).startswith("run k: checkpoint ckpt-000000042: the checkpoint was written by a Keras 2 "
                                   "(tf_keras) job and this job runs Keras 3") and "\n" not in str(e.value)
    meta["keras"] = "3"
    assert steps._resume_point(ctx) is ck


@pytest.mark.parametrize("probe, status, detail", [
    ({"keras": "3.15.1", "keras_backend": "tensorflow"}, "ok", "3.15.1, backend tensorflow"),
    ({"keras": "3.15.1", "keras_backend": "jax"}, "fail", "3.15.1, backend jax"),
    ({"keras": "3.9.0", "keras_backend": "tensorflow"}, "fail", "3.9.0, the lock pins 3.15.1"),
    ({"keras": "2.15.0", "keras_backend": "tensorflow"}, "fail", "keras 2.15.0 is not Keras 3"),
    ({"keras_error": "ModuleNotFoundError: No module named 'keras'"}, "fail", "ModuleNotFoundError: No module named "
     "'keras'"),
])
def test_the_doctor_checks_keras_3_on_the_node(probe, status, detail):
    from appliance.node import doctor

    checks = doctor.stack_checks({"python": "3.11.7", "executable": "/v/bin/python", "tensorflow": "2.18.1",
                                  "tf_keras": "2.18.0", "horovod": "0.28.1", **probe}, {"keras": "3.15.1"})
    c = checks[3]
    assert (c.name, c.status, c.detail) == ("keras 3", status, detail)
    assert (c.fix is None) == (status == "ok")
    if "jax" in detail:
        assert "KERAS_BACKEND" in c.fix
