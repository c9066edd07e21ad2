"""Stream mode's reader (appliance/node/stream.py, its order: stream_order.py), without TensorFlow or a store: the
order is the run's settings' alone (not the world size's), its samples mixed across a window of shards, a reader
started at a position yields exactly what an uninterrupted one would have after it, on any world size with the same
global batch, every sample of an epoch is read once, the cache never holds more than its capacity, a shard is read
only once its MD5 matches, a missing shard is named, a resume in another order is refused in one line."""

import io
import shutil
import tarfile
from pathlib import Path

import pytest

from appliance.errors import ApplianceError
from appliance.node.stream import Position, ShardCache
from appliance.node.stream_order import Order, epoch_order, global_batch, reads


def first_shard(index, step, rank=0, world=1, window=16, shares=None, batch=1):
    """The first shard a rank reads from global ``step`` on."""
    o = Order(tuple(x["samples"] for x in index["shards"]), 7, batch * world, shares or world, window)
    return index["shards"][next(reads(o, rank, world, step))[1]]["name"]


def packed(d: Path, n_shards: int, per_shard: int, last: int | None = None, tag: str = "") -> dict:
    """tar shards as `appliance data pack` writes them (WebDataset: members sharing a key are a sample); ``last``:
    the last shard's samples, when it holds fewer; ``tag`` starts every key."""
    import hashlib

    d.mkdir(parents=True, exist_ok=True)
    shards = []
    for s in range(n_shards):
        name = f"shard-{s:06d}.tar"
        count = last if last is not None and s == n_shards - 1 else per_shard
        with tarfile.open(d / name, "w") as t:
            for k in range(count):
                for ext, data in (("txt", f"sample {s}/{k}".encode()), ("cls", str(k % 3).encode())):
                    info = tarfile.TarInfo(f"{tag}{s:03d}{k:03d}.{ext}")
                    info.size = len(data)
                    t.addfile(info, io.BytesIO(data))
        shards.append({"name": name, "size": (d / name).stat().st_size,
                       "md5": hashlib.md5((d / name).read_bytes()).hexdigest(), "samples": count})
    return {"format": "tar", "shards": shards}


def copier(src: Path, calls=None):
    def fetch(name, dest):
        if calls is not None:
            calls.append(name)
        shutil.copyfile(src / name, dest)
    return fetch


def test_the_order_is_the_seeds_and_the_epochs():
    a, b = epoch_order(7, 0, 10), epoch_order(7, 0, 10)
    assert a == b and sorted(a) == list(range(10)) and epoch_order(7, 1, 10) != a and epoch_order(8, 0, 10) != a
    o = Order((5,) * 10, 7, 4, 2, 3)
    assert [global_batch(o, i) for i in range(30)] == [global_batch(o, i) for i in range(30)]
    assert global_batch(o, 0) != global_batch(Order((5,) * 10, 8, 4, 2, 3), 0)


def test_the_ranks_read_every_shard_of_an_epoch_once(tmp_path):
    index = packed(tmp_path / "src", 6, 4)
    seen = [take(stream(index, tmp_path / "src", tmp_path / f"c{r}", rank=r, world=2, batch=1), 12) for r in range(2)]
    keys = [k for s in seen for k in s]
    assert len(keys) == 24 == len(set(keys))


def test_the_cache_holds_at_most_its_capacity_and_releases_what_was_read(tmp_path):
    index = packed(tmp_path / "src", 8, 5)
    size = max(s["size"] for s in index["shards"])
    cache = ShardCache(index["shards"], tmp_path / "c", copier(tmp_path / "src"), capacity=2 * size)
    try:
        for i in range(8):
            path = cache.get(i)
            assert len(list((tmp_path / "c").glob("*.tar"))) <= 2
            assert path.exists()
            cache.release(i)
            assert not path.exists()
        assert cache.peak <= 2 * size and cache.stats.fetched == 8
        assert cache.stats.ready + cache.stats.stalls == 8
    finally:
        cache.close()
    with pytest.raises(ApplianceError, match="larger than the stream cache"):
        ShardCache(index["shards"], tmp_path / "c2", copier(tmp_path / "src"), capacity=size - 1)


def test_a_shard_whose_bytes_do_not_match_is_fetched_again_and_never_read(tmp_path):
    index = packed(tmp_path / "src", 2, 3)
    bad = {"n": 1}

    def flaky(name, dest):
        shutil.copyfile(tmp_path / "src" / name, dest)
        if bad["n"]:
            bad["n"] -= 1
            with open(dest, "r+b") as fh:
                fh.seek(600)
                fh.write(b"X")
    # one fetcher: the first GET (shard 0's) is the bad one, not whichever of two concurrent GETs ran first
    cache = ShardCache(index["shards"], tmp_path / "c", flaky, capacity=1 << 30, fetchers=1)
    try:
        assert cache.get(0).read_bytes() == (tmp_path / "src" / index["shards"][0]["name"]).read_bytes()
        assert cache.stats.refetched == 1
    finally:
        cache.close()


def test_a_shard_missing_from_the_store_is_one_error_naming_it(tmp_path):
    index = packed(tmp_path / "src", 3, 2)
    gone = index["shards"][epoch_order(7, 0, 3)[1]]["name"]
    (tmp_path / "src" / gone).unlink()
    with pytest.raises(ApplianceError, match=f"shard {gone} is in index.json but not in the store"):
        take(stream(index, tmp_path / "src", tmp_path / "c", world=1, batch=1), 6)


def test_up_to_fetchers_gets_run_at_once_in_reading_order_within_the_capacity(tmp_path):
    """A rank's GETs overlap (one TCP stream is not the link, each first byte waits a round trip): ``fetchers`` of
    them at once, never more, never past the cache's capacity, and the reader gets each shard by its place."""
    import threading

    index = packed(tmp_path / "src", 9, 2)
    size = max(s["size"] for s in index["shards"])
    lock = threading.Lock()
    for cap, fetchers, want in ((9 * size, 3, 3), (2 * size, 3, 2)):
        together = threading.Barrier(want, timeout=10)  # broken (the test fails) unless `want` GETs run at once
        now, most = [0], [0]

        def fetch(name, dest):
            with lock:
                now[0] += 1
                most[0] = max(most[0], now[0])
            if name in [s["name"] for s in index["shards"][:want]]:
                together.wait()
            shutil.copyfile(tmp_path / "src" / name, dest)
            with lock:
                now[0] -= 1
        cache = ShardCache(index["shards"], tmp_path / f"c{cap}", fetch, capacity=cap, fetchers=fetchers)
        try:
            for i in range(9):
                assert cache.get(i).read_bytes() == (tmp_path / "src" / index["shards"][i]["name"]).read_bytes()
                assert cache.held <= cap
                cache.release(i)
        finally:
            cache.close()
        assert most[0] == want and cache.peak <= cap


def test_a_full_cache_waits_for_the_reader_and_never_fails(tmp_path):
    index = packed(tmp_path / "src", 6, 2)
    size = max(s["size"] for s in index["shards"])
    calls = []
    cache = ShardCache(index["shards"], tmp_path / "c", copier(tmp_path / "src", calls), capacity=size)
    try:
        cache.get(0)  # the fetcher now waits on a full cache: the second shard is not fetched while the first is held
        assert calls == [index["shards"][0]["name"]]
        cache.release(0)
        assert cache.get(1).exists()
    finally:
        cache.close()


def stream(index, src, root, *, rank=0, world=2, batch=2, capacity=1 << 30, window=16, shares=None, seed=7):
    from appliance.node.stream import Stream

    return Stream(index, seed=seed, rank=rank, world=world, batch_size=batch, root=root, fetch=copier(src),
                  capacity=capacity, window=window, shares=shares)


def take(s, n):
    it = s.samples()
    try:
        return [next(it)[0] for _ in range(n)]
    finally:
        it.close()


def test_an_epoch_is_the_datasets_samples_over_the_global_batch_and_its_remainder_opens_the_next():
    from appliance.node.stream_order import Order

    o = Order((10, 10, 10, 10, 7), 7, 8, 2)
    assert o.total == 47 and o.steps_per_epoch == 5 and [o.share_size(c) for c in range(2)] == [23, 24]
    with pytest.raises(ApplianceError, match="less than one global batch"):
        Order((10, 7), 7, 64, 2).check(2)
    with pytest.raises(ApplianceError, match="does not split"):
        Order((10, 7), 7, 6, 4).check(2)


def class_mix(window: int) -> list[int]:
    """Distinct classes in each global batch of 32 of 2 epochs of a folder packed from class00/ .. class09/ (each
    class 4 shards of 200 samples, in pack order: a shard holds one class)."""
    o = Order((200,) * 40, 7, 32, 1, window)
    it = reads(o, 0, 1, 0)
    return [len({next(it)[1] // 4 for _ in range(32)}) for _ in range(2 * o.steps_per_epoch)]


def test_samples_are_mixed_across_shards_so_batches_mix_classes_as_a_uniform_shuffle_would():
    """A uniform shuffle gives 9.7 distinct classes of 10 in a batch of 32; shards alone shuffled give one."""
    mixed, off = class_mix(32), class_mix(0)
    assert sum(mixed) / len(mixed) >= 8 and min(mixed) >= 5
    assert sum(x == 1 for x in off) / len(off) >= 0.85  # the shard order only: batches of one class


def global_batches(index, src, root, *, world, steps, shares, start=None, rec=None, window=3):
    """Every rank's batches of 12 / world from (epoch, batch) ``start`` (a resume of a checkpoint with stream
    record ``rec``), put together rank after rank: the global batches the ranks read."""
    per, out = 12 // world, [[] for _ in range(steps)]
    for r in range(world):
        s = stream(index, src, root / f"w{world}r{r}", rank=r, world=world, batch=per, shares=shares, window=window)
        if start is not None:
            s.resume(*start, rec)
        got = take(s, steps * per)
        for i in range(steps):
            out[i] += got[i * per:(i + 1) * per]
    return out


@pytest.mark.parametrize("was, now", [(2, 4), (4, 2)])
def test_a_resume_on_another_world_size_with_the_same_global_batch_reads_the_same_global_batches(tmp_path, was,
                                                                                                  now):
    """The run's canonical shares are the first job's world size; the global batches are theirs, whatever the
    world size: interrupted mid-epoch on ``was`` ranks, resumed on ``now``, every step's global batch is the
    uninterrupted run's."""
    index = packed(tmp_path / "src", 9, 7, last=4)  # 60 samples, an uneven last shard: 5 steps of 12 an epoch
    src = tmp_path / "src"
    whole = global_batches(index, src, tmp_path / "a", world=was, steps=15, shares=None)
    first = stream(index, src, tmp_path / "rec", world=was, batch=12 // was, window=3)
    assert first.steps_per_epoch == 5
    rec = first.record(1, 2)  # a checkpoint at epoch 1, batch 2: global step 7
    assert rec["step"] == 7 and rec["shares"] == was
    later = global_batches(index, src, tmp_path / "b", world=now, steps=8, shares=None, start=(1, 2), rec=rec)
    assert later == whole[7:]


def test_every_sample_of_an_epoch_is_read_once_with_an_uneven_last_shard_on_3_ranks(tmp_path):
    """3 ranks, 3 shares of 38 samples (12, 13, 13): each rank's first 12 or 13 samples are its share's part of
    epoch 0, the next ones of epoch 1; together each epoch is every sample once."""
    index = packed(tmp_path / "src", 8, 5, last=3)
    keys = {f"{j:03d}{i:03d}" for j in range(8) for i in range(5 if j < 7 else 3)}
    epochs = [[], []]
    for r in range(3):
        s = stream(index, tmp_path / "src", tmp_path / f"c{r}", rank=r, world=3, batch=2, window=3)
        n = s.order.share_size(r)
        got = take(s, 2 * n)
        epochs[0] += got[:n]
        epochs[1] += got[n:]
    for e in epochs:
        assert sorted(e) == sorted(keys)


def test_a_resume_at_an_epochs_end_starts_the_next_and_the_stream_sees_every_epoch_end(tmp_path):
    """5 shards of 4 on one rank, batches of 3: 6 steps (18 samples) an epoch, 2 left over; a resume at the
    epoch's last batch (or past it) is the next epoch's first, and the stream says each epoch's end after it."""
    index = packed(tmp_path / "src", 5, 4)
    whole = take(stream(index, tmp_path / "src", tmp_path / "w", world=1, batch=3, window=2), 3 * 18)
    for batch in (6, 9):
        s = stream(index, tmp_path / "src", tmp_path / f"r{batch}", world=1, batch=3, window=2)
        said = []
        s.on_epoch = lambda e, *_: said.append(e)
        assert s.start_at(0, batch) == s.start_at(1, 0) == Position(6, 0, 18)
        assert take(s, 2 * 18) == whole[18:] and said == [1, 2]


def test_a_resume_in_another_order_is_refused_in_one_line(tmp_path):
    index = packed(tmp_path / "src", 4, 4)
    rec = stream(index, tmp_path / "src", tmp_path / "a").record(1, 2)
    cases = [(dict(seed=8), "its seed is 8, the checkpoint's is 7"), (dict(batch=4), "its global batch is 8"),
             (dict(window=2), "dataset.shuffle window is 2")]
    for kw, msg in cases:
        with pytest.raises(ApplianceError, match=msg) as e:
            stream(index, tmp_path / "src", tmp_path / "b", **kw).resume(1, 2, rec)
        assert "\n" not in str(e.value) and "cannot resume" in str(e.value)
    other = packed(tmp_path / "src2", 4, 4, last=3)
    with pytest.raises(ApplianceError, match=r"its packed dataset \(index.json\) is"):
        stream(other, tmp_path / "src2", tmp_path / "c").resume(1, 2, rec)
    with pytest.raises(ApplianceError, match="another steps_per_epoch"):
        stream(index, tmp_path / "src", tmp_path / "d").resume(1, 3, rec)
    s = stream(index, tmp_path / "src", tmp_path / "e", world=4, batch=1)  # 4 ranks, the run's 2 shares
    assert s.resume(1, 2, rec).step == rec["step"] and s.order.shares == 2


def test_a_stream_reads_every_epoch_and_a_resume_at_any_batch_continues_exactly(tmp_path):
    """What Keras sees: ``steps_per_epoch`` batches an epoch from one iterator; a resume at (epoch, batch) gives
    exactly the uninterrupted stream's samples after it, and fetches first the shard of its next sample."""
    index = packed(tmp_path / "src", 7, 5)  # 35 samples, global batches of 4: 8 steps, 16 samples a rank
    s = stream(index, tmp_path / "src", tmp_path / "a", window=3)
    assert s.per_epoch == 16 and s.steps_per_epoch == 8
    whole = take(s, 3 * 16)
    for epoch, batch in [(0, 0), (0, 3), (1, 2), (1, 7), (2, 5)]:
        r = stream(index, tmp_path / "src", tmp_path / f"r{epoch}{batch}", window=3)
        calls = []
        r.fetch, r.fetchers = copier(tmp_path / "src", calls), 1  # one GET at a time: the calls in reading order
        r.start_at(epoch, batch)
        cut = (epoch * 8 + batch) * 2
        assert take(r, 3 * 16 - cut) == whole[cut:], (epoch, batch)
        assert calls[0] == first_shard(index, epoch * 8 + batch, world=2, window=3, batch=2)


def test_a_stream_never_holds_more_than_its_cache_and_refuses_one_its_shuffle_does_not_fit(tmp_path):
    index = packed(tmp_path / "src", 12, 3)
    size = max(x["size"] for x in index["shards"])
    s = stream(index, tmp_path / "src", tmp_path / "c", world=1, batch=3, capacity=2 * size, window=2)
    assert len(take(s, 3 * 36)) == 108
    assert 0 < s.peak <= 2 * size and 12 * size >= 4 * s.capacity
    with pytest.raises(ApplianceError, match="cannot hold the 3 shard"):
        stream(index, tmp_path / "src", tmp_path / "d", world=1, batch=3, capacity=2 * size, window=3)


def test_a_keras_resume_positions_the_stream_the_fit_trains_on_not_a_validation_one(tmp_path, monkeypatch):
    from appliance.node import stream as mod

    monkeypatch.setattr(mod, "_ACTIVE", [])
    monkeypatch.setattr(mod, "_TRAINING", [])
    assert mod.take_plan(1, 2) is None  # no stream: Keras' own skip replays the batches
    index = packed(tmp_path / "src", 4, 4)
    train, val = (stream(index, tmp_path / "src", tmp_path / n) for n in ("t", "v"))
    data = object()  # what train.dataset() returned, and the fit reads
    train.datasets.append(data)
    mod._ACTIVE += [train, val]
    rec = train.record(1, 3)
    assert mod.take_plan(1, 3, rec, data=data) == train.start == Position(7, 1, 12)  # 4 steps an epoch
    assert val.start == Position()
    assert mod.stream_record(1, 3) == rec


def test_a_tf_data_shuffle_of_a_streams_dataset_is_refused_in_one_line():
    from types import SimpleNamespace

    from appliance.node.stream_data import refuse_shuffle

    ds = refuse_shuffle(SimpleNamespace())
    with pytest.raises(ApplianceError, match="not shuffled by tf.data") as e:
        ds.shuffle(1000)
    assert "\n" not in str(e.value)


def test_the_store_fetch_names_a_missing_object_and_the_index_check_refuses_what_is_not_packed(tmp_path):
    import json

    from appliance.data.stream import stream_index
    from appliance.node.stream import store_fetch

    index = packed(tmp_path / "src", 2, 2)
    url = f"file://{tmp_path / 'src'}/"
    with pytest.raises(ApplianceError, match="no index.json there"):
        stream_index(url, None)
    (tmp_path / "src" / "index.json").write_text(json.dumps({**index, "format": "tfrecord"}))
    with pytest.raises(ApplianceError, match="not one of tar shards"):
        stream_index(url, None)
    (tmp_path / "src" / "index.json").write_text(json.dumps(index))
    assert stream_index(url, None)["shards"] == index["shards"]
    fetch = store_fetch(url, None, print)
    fetch(index["shards"][0]["name"], tmp_path / "got")
    assert (tmp_path / "got").read_bytes() == (tmp_path / "src" / index["shards"][0]["name"]).read_bytes()
    with pytest.raises(FileNotFoundError):
        fetch("shard-999999.tar", tmp_path / "none")


def test_the_next_epochs_first_shard_is_in_the_cache_while_this_ones_last_is_read(tmp_path):
    """One cache across epoch ends: the fetcher takes epoch 1's first shard (fetched, or kept from epoch 0) while
    the reader is still in epoch 0, so an epoch does not start with a wait, even in a cache of 2 shards."""
    index = packed(tmp_path / "src", 4, 3)
    size = max(x["size"] for x in index["shards"])
    s = stream(index, tmp_path / "src", tmp_path / "c", world=1, batch=3, capacity=2 * size, window=1)
    it = s.samples()
    try:
        for _ in range(s.per_epoch - 1):  # all of epoch 0 but its last sample: 4 visits, one a shard
            next(it)
        c = s.cache
        with c._cv:
            assert c._cv.wait_for(lambda: c._next > 4 and c.shards[4]["name"] in c._ready, timeout=10)
        assert c.shards[4]["name"] == first_shard(index, s.steps_per_epoch, window=1, batch=3)
    finally:
        it.close()


def test_the_launcher_says_each_epoch_of_the_stream_and_keeps_the_waits_on_the_result():
    from types import SimpleNamespace

    from appliance.cli.views import format_stream
    from appliance.data.stream import JobStream
    from appliance.protocol import Line, format_line

    said = []
    hook = JobStream(site=None)
    hook.ctx = SimpleNamespace(say=said.append)
    for e in range(2):
        for rank in (1, 0):  # every rank says its bytes from the store; rank 0's epoch is said (a line's own
            # rank counts: horovodrun may glue rank 1's line to rank 0's open progress bar)
            assert hook.rank_line(0, format_line(Line.STREAM, {
                "rank": rank, "epoch": e, "read": 10, "ready": 9, "stalls": 1, "waited_s": 0.5, "refetched": 0, "peak": 3000,
                "capacity": 8000, "wall_s": 20.0, "store_bytes": 4000 >> e, "kept": 5 * e, "dataset_bytes": 8000}))
    assert not hook.rank_line(0, "Epoch 3/3")
    assert said[1] == ("[appliance] stream epoch 1: rank 0 read 10 shard(s), 9 ready when asked, 1 waited for (0.5s), "
                       "0 fetched again; cache peak 3.0 KB of 8.0 KB; 2.0 KB from the store, 5 shard(s) kept from "
                       "before") and len(said) == 2
    res = SimpleNamespace(stream=None)
    hook.finish(res)
    assert res.stream == {"epochs": 2, "shards": 20, "stalls": 2, "waited_s": 1.0, "wall_s": 40.0,
                          "store_bytes": 12000, "rank0_store_bytes": [4000, 2000], "dataset_bytes": 8000}
    assert format_stream(res.stream) == ("rank 0 waited 1.0s of 40.0s (2.5%) for shards from the store, 2 of 20 "
                                         "shard(s), over 2 epoch(s); the ranks read 12.0 KB from the store, 6.0 KB "
                                         "an epoch (0.75x the dataset)")
    old = {k: res.stream[k] for k in ("epochs", "shards", "stalls", "waited_s", "wall_s")}  # a record before
    assert format_stream(old).endswith("over 2 epoch(s)")


def test_the_dataset_credential_goes_to_every_node_is_renewed_at_an_extension_and_goes_at_the_end(tmp_path,
                                                                                                     monkeypatch):
    """The launcher's side (data/stream.py): a 0600 file on every node, never the secret in the environment; a new
    credential at a lease extension; at the end the file leaves every node and both credentials are deleted."""
    import json
    from types import SimpleNamespace

    from appliance.data.stream import JobStream
    from appliance.protocol import Env
    from appliance.spec import parse_spec
    from appliance.store.objects import StoreCreds

    made, withdrawn, ran = [], [], []

    def job_store_creds(url, *, name, lease_end, say):
        made.append((url, name, lease_end))
        n = len(made)
        return StoreCreds(app_cred_id=f"id{n}", app_cred_secret=f"secret{n}"), lambda: withdrawn.append(n)

    class Node:
        def __init__(self, name):
            self.name = name

        def run(self, cmd, stdin=None, check=False, timeout=None):
            ran.append((self.name, cmd, stdin))

    nodes = SimpleNamespace(each=lambda fn: {n.name: fn(n) for n in (Node("n1"), Node("n2"))})
    spec = parse_spec({"name": "s", "train": {"command": "x"},
                       "dataset": {"source": "swift://data/p/", "mode": "stream", "cache": "10GB"}})
    ctx = SimpleNamespace(spec=spec, cluster=SimpleNamespace(head=SimpleNamespace(workdir="/mnt/local"),
                                                             lease_end_at="end1"),
                          run_dir="/mnt/local/appliance/runs/s", job_id="j1", say=lambda m: None, nodes=nodes,
                          abandoned=False)
    monkeypatch.setattr("appliance.data.stream.stream_check",  # (test_stream_faults)
                        lambda url, creds, at: {"shards": []})
    hook = JobStream(SimpleNamespace(job_store_creds=job_store_creds, store_creds=lambda url: None))
    env = hook.prepare(ctx)
    assert env[Env.STREAM_URL] == "swift://data/p/" and env[Env.STREAM_CACHE_BYTES] == str(10**10)
    assert env[Env.STREAM_CREDS] == "/mnt/local/appliance/runs/s/.stream-creds.json"
    assert not any("secret" in v for v in env.values())
    writes = [(n, stdin) for n, cmd, stdin in ran if "umask 077" in cmd]
    assert [n for n, _ in writes] == ["n1", "n2"] and json.loads(writes[0][1])["app_cred_secret"] == "secret1"
    hook.renew("end2")
    assert made[-1][2] == "end2" and json.loads(ran[-1][2])["app_cred_secret"] == "secret2"
    ran.clear()
    hook.close()
    assert [(n, cmd) for n, cmd, _ in ran] == [(n, "rm -f /mnt/local/appliance/runs/s/.stream-creds.json")
                                                for n in ("n1", "n2")]
    assert withdrawn == [1, 2]
    assert JobStream(SimpleNamespace()).prepare(SimpleNamespace(spec=parse_spec({"name": "s", "train": {
        "command": "x"}}))) == {}  # not a stream: nothing


def test_a_resume_under_resize_batch_keeps_the_runs_global_batch_on_another_world_size(tmp_path, monkeypatch,
                                                                                        capsys):
    """A script opens its stream with its own batch (32); resumed on 4 ranks from a checkpoint of 2 under
    ``checkpoint.resize: batch``, its stream reads the checkpoint's global batch of 64 (16 a rank) and the
    position goes on; under ``resize: lr`` (the per-rank batch kept) the resume is refused in one line that names
    the policy; on 3 ranks (64 does not split) one line and exit status 1. A stream of another dataset (a
    validation one) keeps the script's batch."""
    import json

    from appliance.node import stream as mod
    from appliance.protocol import Env

    index = packed(tmp_path / "src", 8, 16)  # 128 samples: 2 steps of 64 an epoch
    (tmp_path / "src" / "index.json").write_text(json.dumps(index))
    rec = stream(index, tmp_path / "src", tmp_path / "a", world=2, batch=32).record(0, 1)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "meta.json").write_text(json.dumps({"step": 1, "stream": rec}))
    monkeypatch.setattr(mod, "_ACTIVE", [])
    for k, v in {Env.STREAM_URL: f"file://{tmp_path / 'src'}/", Env.STREAM_CACHE: str(tmp_path / "c"),
                 Env.STREAM_CACHE_BYTES: str(1 << 30), Env.RESTORE: str(tmp_path / "ck"), Env.CKPT_RESIZE: "batch",
                 "HOROVOD_RANK": "0", "HOROVOD_SIZE": "4"}.items():
        monkeypatch.setenv(k, v)
    s = mod.open_stream(32, seed=7)
    assert s.batch_size == 16 and s.order.global_batch == 64 and s.resume(0, 1, rec).step == 1
    assert ("[appliance] the stream keeps the run's global batch of 64 (checkpoint.resize: batch): 16 a rank on 4 "
            "rank(s), not 32") in capsys.readouterr().err
    other = packed(tmp_path / "val", 2, 16)  # a validation stream of another dataset: the script's batch
    (tmp_path / "val" / "index.json").write_text(json.dumps(other))
    assert mod.open_stream(8, seed=7, url=f"file://{tmp_path / 'val'}/").batch_size == 8
    monkeypatch.setenv(Env.CKPT_RESIZE, "lr")
    s = mod.open_stream(32, seed=7)
    with pytest.raises(ApplianceError, match=r"global batch is 128, the checkpoint's is 64 .*resize: batch keeps it"):
        s.resume(0, 1, rec)
    monkeypatch.setenv(Env.CKPT_RESIZE, "batch")
    monkeypatch.setenv("HOROVOD_SIZE", "3")
    with pytest.raises(SystemExit):
        mod.open_stream(32, seed=7)
    assert capsys.readouterr().err == ("[appliance] error: checkpoint.resize: batch keeps the stream's global batch "
                                       "64, which 3 rank(s) cannot split evenly (fix: resume on a number of ranks "
                                       "that divides it)\n")
