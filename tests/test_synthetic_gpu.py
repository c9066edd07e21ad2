"""The synthetic benchmark's GPU pick (appliance/bench/job/synthetic.py): ``gpus[local_rank % len(gpus)]``, and a
note when ranks share a GPU (two ranks on a one-GPU node were an IndexError). TensorFlow, Horovod and tf_keras are
fakes here: no TensorFlow starts."""

import importlib.util
import json
import sys
import types

from conftest import ROOT


def load_synthetic(monkeypatch, gpus, local_rank, local_size):
    """synthetic.py with TensorFlow, Horovod and tf_keras replaced by fakes that record the GPU it picks."""
    picked = {}
    cfg = types.SimpleNamespace(
        list_physical_devices=lambda kind: list(gpus), set_visible_devices=lambda g, kind: picked.setdefault("gpu", g),
        experimental=types.SimpleNamespace(set_memory_growth=lambda g, on: None,
                                           get_device_details=lambda g: {"device_name": f"Fake {g}"}))
    tf = types.SimpleNamespace(config=cfg, __version__="2.18.1")
    hvd = types.SimpleNamespace(init=lambda: None, rank=lambda: local_rank, size=lambda: local_size,
                                local_rank=lambda: local_rank, local_size=lambda: local_size,
                                allgather_object=lambda o: [o] * local_size, nccl_built=lambda: True,
                                gloo_built=lambda: True)
    horovod = types.ModuleType("horovod")
    horovod.__version__, horovod.tensorflow = "0.28.1", hvd
    for name, mod in (("tensorflow", tf), ("horovod", horovod), ("horovod.tensorflow", hvd),
                      ("tf_keras", types.SimpleNamespace())):
        monkeypatch.setitem(sys.modules, name, mod)
    spec = importlib.util.spec_from_file_location("synthetic_under_test",
                                                  ROOT / "appliance" / "bench" / "job" / "synthetic.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", ["synthetic.py", "--models", ""])
    return mod, picked


def test_two_ranks_on_a_one_gpu_node_share_it_and_say_so(monkeypatch, capsys):
    mod, picked = load_synthetic(monkeypatch, ["GPU0"], local_rank=1, local_size=2)
    assert mod.main() == 0  # was an IndexError: gpus[hvd.local_rank()]
    out = capsys.readouterr().out
    assert picked["gpu"] == "GPU0" and "note: 2 ranks share 1 GPU(s) on" in out and "local rank 1 uses GPU 0" in out
    assert mod.pick_gpu(["GPU0", "GPU1"], 1, 2) == ("GPU1", None)


def test_rank_0_reports_whether_ranks_share_a_gpu(monkeypatch, capsys):
    mod, picked = load_synthetic(monkeypatch, ["GPU0"], local_rank=0, local_size=2)
    mod.main()
    result = json.loads(capsys.readouterr().out.split("APPLIANCE_RESULT ")[1])
    assert result["shared_gpu"] is True and result["device"] == "Fake GPU0"
