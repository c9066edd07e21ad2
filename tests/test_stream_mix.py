"""Several streams (issue 78 item 3), without TensorFlow: a weighted mix of packed datasets (``dataset.streams``,
appliance/node/stream_mix.py) gives each dataset its weight's part of every epoch and of every global batch, reads
each dataset's samples once before any twice, and resumes mid-epoch exactly on another world size with the same
global batch; a resume with another mix is refused in one line; a validation stream (``open_validation``) reads the
same samples every pass, keeps its shards between passes and never moves the training stream; the launcher gives
the ranks every dataset, its weight and a credentials file for each store."""

import json
from collections import Counter
from types import SimpleNamespace

import pytest

from appliance.errors import ApplianceError
from appliance.node.stream import Member, Position
from appliance.node.stream_mix import epoch_counts, mix_of
from appliance.node.stream_order import global_batch
from test_stream import global_batches, packed, stream, take


def mix(tmp_path, weights=(55, 33, 22)):
    """Three packed datasets a (60 samples), b (37: an uneven last shard), c (10) under one root, as Members."""
    shapes = {"a": (6, 10, None), "b": (4, 10, 7), "c": (2, 5, None)}
    return [Member(n, packed(tmp_path / "src" / n, *shapes[n], tag=n), w) for n, w in zip("abc", weights)]


def test_a_mix_epoch_is_each_datasets_weight_as_streaming_counts_it():
    assert epoch_counts(None, [], [60, 37, 10]) == [60, 37, 10]
    assert epoch_counts("proportion", [0.5, 0.3, 0.2], [60, 37, 10]) == [54, 32, 21]  # 107 in all, as the datasets
    assert epoch_counts("proportion", [1, 3], [100, 200]) == [75, 225]  # normalised, as Streaming's
    assert epoch_counts("repeat", [3, 0.25], [100, 200]) == [300, 50]
    assert epoch_counts("choose", [7, 1], [5, 5]) == [7, 1]


def test_every_global_batch_and_every_epoch_holds_each_datasets_weight():
    """Weights 55, 33, 22 of 110 samples an epoch, global batches of 10 over 2 shares: each dataset's samples in an
    epoch are its weight (give or take one a share and level of the tree; exact over two epochs, 110 places a
    share), and every global batch holds its part of 10 within 2 a share; the small dataset c (10 samples, 22 an
    epoch) is read whole before any sample of it twice."""
    counts = ((10,) * 6, (10, 10, 10, 7), (5, 5))
    o = mix_of(counts, (55, 33, 22), 7, 10, 2, 3)
    assert o.steps_per_epoch == 11
    firsts = [0, 60, 97, 107]
    which = lambda g: next(s for s in range(3) if firsts[s] <= g < firsts[s + 1])  # noqa: E731
    batches = [[which(g) for g in global_batch(o, i)] for i in range(22)]
    for b in batches:
        assert all(abs(b.count(s) - 10 * w / 110) <= 2 * 2 for s, w in enumerate((55, 33, 22))), b
    one = Counter(s for b in batches[:11] for s in b)
    assert all(abs(one[s] - w) <= 2 * 2 for s, w in enumerate((55, 33, 22))), one
    assert Counter(s for b in batches for s in b) == {0: 110, 1: 66, 2: 44}
    cs = Counter(g for b in range(22) for g in global_batch(o, b) if g >= 97)  # c's 44 reads: 4 or 5 of each
    assert set(cs) == set(range(97, 107)) and set(cs.values()) == {4, 5}
    with pytest.raises(ApplianceError, match="fewer than the run's 4 canonical share"):
        mix_of(((3,), (10,)), (3, 10), 7, 8, 4, 0).check(4)


@pytest.mark.parametrize("was, now", [(2, 4), (4, 2)])
def test_a_mixed_stream_resumed_mid_epoch_on_another_world_size_reads_the_uninterrupted_runs_samples(tmp_path, was,
                                                                                                    now):
    members = mix(tmp_path)
    src = tmp_path / "src"
    whole = global_batches(members, src, tmp_path / "a", world=was, steps=15, shares=None)
    assert {k[0] for b in whole for k in b} == {"a", "b", "c"}
    first = stream(members, src, tmp_path / "rec", world=was, batch=12 // was, window=3)
    assert first.steps_per_epoch == 9  # 110 samples an epoch over global batches of 12
    rec = first.record(1, 2)  # epoch 1, batch 2: global step 11, mid-epoch
    assert rec["step"] == 11 and [(s["name"], s["weight"]) for s in rec["streams"]] == [("a", 55), ("b", 33),
                                                                                         ("c", 22)]
    assert sum(s["read"] for s in rec["streams"]) == 11 * 12 and rec["streams"][2]["epochs"] > 1  # c: past its 10
    later = global_batches(members, src, tmp_path / "b", world=now, steps=4, shares=None, start=(1, 2), rec=rec)
    assert later == whole[11:]


def test_a_resume_with_another_mix_is_refused_in_one_line(tmp_path):
    members = mix(tmp_path)
    src = tmp_path / "src"
    rec = stream(members, src, tmp_path / "r").record(1, 2)
    other = [members[0], Member("b", packed(tmp_path / "src" / "b2", 4, 10, tag="b"), 33), members[2]]
    cases = [([*members[:2], Member("c", members[2].index, 23)], "dataset.streams c's samples a mix epoch is 23"),
             (other, r"dataset.streams b's packed dataset \(index.json\) is"),
             (members[:2], r"its data is a mix of 2 \(a, b\), the checkpoint's is a mix of 3 \(a, b, c\)"),
             (members[0].index, r"its data is one packed dataset \(dataset.source\), the checkpoint's is a mix")]
    for now, msg in cases:
        with pytest.raises(ApplianceError, match=msg) as e:
            stream(now, src, tmp_path / "n").resume(1, 2, rec)
        assert "\n" not in str(e.value) and "cannot resume" in str(e.value)
    single = stream(members[0].index, src / "a", tmp_path / "s").record(1, 2)
    with pytest.raises(ApplianceError, match=r"its data is a mix of 3 \(a, b, c\), the checkpoint's is one packed"):
        stream(members, src, tmp_path / "m").resume(1, 2, single)


def streams_env(tmp_path, monkeypatch, **more):
    """A job's environment as the launcher sets it: a mix of a (24 samples) and b (12) weighted 24 and 12, and a
    validation stream v (12), all in file:// stores."""
    from appliance.node import stream as mod
    from appliance.protocol import Env

    shapes = {"a": (6, 4), "b": (3, 4), "v": (3, 4)}
    ix = {n: packed(tmp_path / n, *shapes[n], tag=n) for n in "abv"}
    for n in "abv":
        (tmp_path / n / "index.json").write_text(json.dumps(ix[n]))
    vbytes = sum(s["size"] for s in ix["v"]["shards"])
    env = {Env.STREAMS: json.dumps([{"name": n, "url": f"file://{tmp_path / n}/", "weight": w}
                                    for n, w in (("a", 24), ("b", 12))]),
           Env.STREAM_CACHE: str(tmp_path / "cache"), Env.STREAM_CACHE_BYTES: str(40 * vbytes),
           "HOROVOD_RANK": "0", "HOROVOD_SIZE": "1",
           Env.STREAM_VALIDATION: json.dumps({"url": f"file://{tmp_path / 'v'}/", "bytes": vbytes, "cache": 0}),
           **more}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(mod, "_ACTIVE", [])
    monkeypatch.setattr(mod, "_TRAINING", [])
    return mod, [Member(n, ix[n], w) for n, w in (("a", 24), ("b", 12))], vbytes


def test_a_validation_stream_reads_the_same_pass_keeps_its_shards_and_never_moves_the_training_stream(
        tmp_path, monkeypatch):
    mod, members, vbytes = streams_env(tmp_path, monkeypatch)
    val = mod.open_validation(2)  # opened first: still not the one a resume positions or a save records
    train = mod.open_stream(2, seed=7)  # the mix the launcher named
    assert val.capacity == vbytes and train.capacity == 39 * vbytes  # its dataset's size of the node's cache
    assert val.steps_per_epoch == 6 and val.order.window == 0 and train.steps_per_epoch == 18
    plain = take(stream(members, tmp_path, tmp_path / "p", world=1), 12)
    assert {k[0] for k in plain} == {"a", "b"}
    it = train.samples()
    got, passes = [], []
    for _ in range(3):  # a validation pass after every 4 training samples, the same 12 samples each time
        got += [next(it)[0] for _ in range(4)]
        passes.append([k for k, _ in val.samples()])
    it.close()
    assert passes[0] == passes[1] == passes[2] and sorted(passes[0]) == [f"v{j:03d}{i:03d}" for j in range(3)
                                                                         for i in range(4)]
    assert got == plain  # the training stream read on as if no validation ran
    assert val.cache.stats.fetched == 3 and val.cache.stats.kept == 6  # passes 2 and 3 fetched nothing
    data = object()  # what train.dataset() returned, and the fit reads
    train.datasets.append(data)
    rec = train.record(1, 3)
    assert mod.take_plan(1, 3, rec, data=data) == train.start == Position(21, 1, 6) and val.start == Position()
    assert mod.stream_record(1, 3) == rec and mod._ACTIVE == [train]


def test_a_validation_stream_is_one_line_without_a_spec_for_it_or_room_for_it(tmp_path, monkeypatch, capsys):
    from appliance.protocol import Env

    mod, _, vbytes = streams_env(tmp_path, monkeypatch, **{Env.STREAM_VALIDATION: ""})
    with pytest.raises(SystemExit):
        mod.open_validation(2)
    assert capsys.readouterr().err.strip() == ("[appliance] error: no validation stream: the job's spec has no "
                                               "dataset.validation (fix: add dataset.validation: {source: "
                                               "swift://...} to the spec)")
    monkeypatch.setenv(Env.STREAM_VALIDATION, json.dumps({"url": "file:///x/", "bytes": 1, "cache": 40 * vbytes}))
    with pytest.raises(SystemExit):
        mod.open_stream(2)
    assert "leaves none of the node's" in capsys.readouterr().err


def test_the_launcher_gives_the_ranks_every_dataset_its_weight_and_a_credential_for_each_store(monkeypatch):
    from appliance.data.stream import JobStream
    from appliance.protocol import Env
    from appliance.spec import parse_spec

    indexes = {"swift://data/web/": 600, "s3://books-1/v1/": 400, "swift://data/val/": 50}
    checked = []

    def check(url, creds, at):
        checked.append((at, url))
        return {"shards": [{"name": "s.tar", "size": 1000, "samples": indexes[url]}]}
    monkeypatch.setattr("appliance.data.stream.stream_check", check)
    made, ran = [], []
    site = SimpleNamespace(store_creds=lambda url: None, job_store_creds=lambda url, **kw: (
        made.append(url) or SimpleNamespace(token=f"t-{url[:2]}"), None))
    spec = parse_spec({"name": "m", "train": {"command": "x"}, "dataset": {
        "mode": "stream", "cache": "10GB", "streams": [{"source": "swift://data/web/", "proportion": 3},
                                                      {"source": "s3://books-1/v1/", "name": "books", "proportion": 1}],
        "validation": {"source": "swift://data/val/", "cache": "1GB"}}})
    nodes = SimpleNamespace(each=lambda fn: [fn(SimpleNamespace(run=lambda cmd, **kw: ran.append(cmd)))])
    said = []
    ctx = SimpleNamespace(spec=spec, cluster=SimpleNamespace(head=SimpleNamespace(workdir="/w"), lease_end_at=None),
                          run_dir="/w/r", job_id="j", say=said.append, nodes=nodes, abandoned=False)
    env = JobStream(site).prepare(ctx)
    assert checked == [("dataset.streams[0]", "swift://data/web/"), ("dataset.streams[1]", "s3://books-1/v1/"),
                       ("dataset.validation.source", "swift://data/val/")]
    assert made == ["swift://data/web/", "s3://books-1/v1/"]  # one credential a store, not one a dataset
    assert json.loads(env[Env.STREAMS]) == [
        {"name": "web", "url": "swift://data/web/", "creds": "/w/r/.stream-creds.json", "weight": 750},
        {"name": "books", "url": "s3://books-1/v1/", "creds": "/w/r/.stream-creds-s3.json", "weight": 250}]
    assert json.loads(env[Env.STREAM_VALIDATION]) == {"url": "swift://data/val/", "creds": "/w/r/.stream-creds.json",
                                                      "bytes": 1000, "cache": 10**9}
    assert Env.STREAM_URL not in env and "web (swift://data/web/, 750 sample(s) a mix epoch)" in said[0]


def test_check_online_names_the_stream_whose_shard_is_missing(tmp_path):
    from click.testing import CliRunner

    from appliance.cli import main
    from conftest import write_spec

    urls = {}
    for n, k in (("web", 4), ("books", 2), ("val", 2)):
        ix = packed(tmp_path / "store" / n, k, 3, tag=n)
        (tmp_path / "store" / n / "index.json").write_text(json.dumps(ix))
        urls[n] = f"file://{tmp_path / 'store' / n}/"
    code = tmp_path / "code"
    code.mkdir()
    (code / "x.py").write_text("")
    spec = write_spec(tmp_path, "python x.py", code=code, name="mx", extra=(
        f"dataset: {{mode: stream, streams: [{{source: '{urls['web']}', proportion: 3}}, {{source: '{urls['books']}',"
        f" proportion: 1}}], validation: {{source: '{urls['val']}'}}}}\n"))
    r = CliRunner().invoke(main, ["check", str(spec), "--online"], env={"APPLIANCE_HOME": str(tmp_path)})
    assert r.exit_code == 0 and f"  dataset.validation.source {urls['val']}: 3 object(s)" in r.stdout, r.output
    (tmp_path / "store" / "books" / "shard-000001.tar").unlink()
    r = CliRunner().invoke(main, ["check", str(spec), "--online"], env={"APPLIANCE_HOME": str(tmp_path)})
    assert r.exit_code == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"dataset.streams[1] {urls['books']}: of the 2 shard(s) index.json names, 1 not in the store" in r.stderr
