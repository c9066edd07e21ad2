"""The run's metrics plot (fast tier): one step axis, restarts found, a PNG drawn."""

from appliance.checkpoint import plot

CSV = "step,epoch,metric,value,time\n" + "".join(
    f"{s},{s // 10},step/loss,{1 / s:.4f},0\n{s},{s // 10},step/accuracy,{1 - 1 / s:.4f},0\n" for s in range(1, 31))


def test_metrics_on_one_axis_and_a_png(tmp_path):
    series = plot.read_metrics(CSV + "10,1,epoch/loss,0.1,0\nbad,row\n")
    assert len(series["step/loss"]) == 30 and series["epoch/loss"] == [(10, 0.1)]
    assert plot.step_axis_problems(series) == []
    png = plot.plot(series, [{"first_step": 0}, {"first_step": 12}], tmp_path / "m.png", "run r")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_restarted_step_axis_is_reported():
    series = plot.read_metrics(CSV + "1,0,step/loss,2.3,0\n")  # a job that started over at step 0
    assert plot.step_axis_problems(series) == ["step/loss: step 30 is followed by 1"]
