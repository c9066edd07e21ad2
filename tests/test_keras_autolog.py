"""checkpoint.auto (level 2) in the fast tier: which Model.fit calls get the appliance's callback, without TF."""

import sys
import types

import pytest

from appliance.node import checkpointer, keras_fit


class _Mine(checkpointer.ApplianceCallback):
    pass


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(keras_fit, "_STATE", dict(keras_fit._STATE, auto_used=False, auto_said=False,
                                                 beside_said=False))
    monkeypatch.setattr(checkpointer, "_AUTO", {})
    made = []
    monkeypatch.setattr(checkpointer, "auto_callback", lambda: made.append(_Mine()) or made[-1])
    return made


def test_the_first_fit_gets_the_callback_once_by_keyword_or_position(fresh, capsys):
    args, kw = keras_fit._with_callback(("x",), {"epochs": 3, "callbacks": ["hvd-broadcast"]})
    assert kw["callbacks"] == ["hvd-broadcast", fresh[0]] and args == ("x",)
    args, kw = keras_fit._with_callback(("x", None, 32, 3, 1, ["cb"]), {})  # a second fit: not hooked, said once
    assert args[5] == ["cb"] and len(fresh) == 1
    keras_fit._with_callback(("x",), {})
    assert capsys.readouterr().err.count("protects only the first one") == 1


def test_positional_callbacks_and_a_script_that_already_passes_one(fresh):
    args, kw = keras_fit._with_callback(("x", None, 32, 3, 1, ("cb",)), {"shuffle": False})
    assert args[5] == ["cb", fresh[0]] and kw == {"shuffle": False}
    keras_fit._STATE["auto_used"] = False
    mine = _Mine()
    args, kw = keras_fit._with_callback(("x",), {"callbacks": [mine]})  # level 1: left alone
    assert kw["callbacks"] == [mine] and len(fresh) == 1
    args, kw = keras_fit._with_callback(("x",), {})  # no callbacks at all
    assert kw["callbacks"] == [fresh[1]]


def test_a_fit_beside_the_scripts_own_checkpointer_is_left_alone(fresh, capsys):
    """A script with its own Checkpointer (its loop) that also calls a plain Model.fit (a warm-up): checkpoint.auto
    used to hook that fit with a second Checkpointer, which restored a resumed run's checkpoint into the warm-up and
    committed the warm-up's state (step 2 of a fresh job, seen in make bench-ckpt) into the run's store, where a
    later resume could take it as the newest."""
    checkpointer._note_made()  # the script's Checkpointer(...)
    args, kw = keras_fit._with_callback(("x",), {"callbacks": ["hvd-broadcast"]})
    assert kw["callbacks"] == ["hvd-broadcast"] and not fresh
    keras_fit._with_callback(("x",), {})
    assert capsys.readouterr().err.count("not checkpointed") == 1


def test_the_checkpointer_that_checkpoint_auto_makes_is_not_the_scripts(monkeypatch):
    seen = []
    monkeypatch.setattr(checkpointer, "Checkpointer", lambda **kw: seen.append(checkpointer._note_made())
                        or type("C", (), {"callback": "cb"})())
    monkeypatch.setattr(checkpointer, "_AUTO", {})
    # Horovod already set up by the script (horovod.tensorflow stood in for: its import is TensorFlow's, 5 s)
    monkeypatch.setitem(sys.modules, "horovod.tensorflow", types.SimpleNamespace(is_initialized=lambda: True))
    assert checkpointer.auto_callback() == "cb" and seen
    assert not checkpointer.made_by_script()
