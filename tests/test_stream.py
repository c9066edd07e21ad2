"""Stream mode's reader (appliance/node/stream.py), without TensorFlow or a store: the order is the seed's and the
epoch's alone, a reader started at a position yields exactly what an uninterrupted one would have after it, the
cache never holds more than its capacity, a shard is read only once its MD5 matches, a missing shard is named."""

import io
import shutil
import tarfile
from pathlib import Path

import pytest

from appliance.errors import ApplianceError
from appliance.node.stream import Position, ShardCache, epoch_order, rank_share


def packed(d: Path, n_shards: int, per_shard: int) -> dict:
    """tar shards as `appliance data pack` writes them (WebDataset: members sharing a key are a sample)."""
    import hashlib

    d.mkdir(parents=True, exist_ok=True)
    shards = []
    for s in range(n_shards):
        name = f"shard-{s:06d}.tar"
        with tarfile.open(d / name, "w") as t:
            for k in range(per_shard):
                for ext, data in (("txt", f"sample {s}/{k}".encode()), ("cls", str(k % 3).encode())):
                    info = tarfile.TarInfo(f"{s:03d}{k:03d}.{ext}")
                    info.size = len(data)
                    t.addfile(info, io.BytesIO(data))
        shards.append({"name": name, "size": (d / name).stat().st_size,
                       "md5": hashlib.md5((d / name).read_bytes()).hexdigest(), "samples": per_shard})
    return {"format": "tar", "shards": shards}


def copier(src: Path, calls=None):
    def fetch(name, dest):
        if calls is not None:
            calls.append(name)
        shutil.copyfile(src / name, dest)
    return fetch


def test_the_order_is_the_seeds_and_the_epochs_and_the_ranks_share_it():
    a, b = epoch_order(7, 0, 10), epoch_order(7, 0, 10)
    assert a == b and sorted(a) == list(range(10)) and epoch_order(7, 1, 10) != a and epoch_order(8, 0, 10) != a
    shares = [rank_share(a, r, 3) for r in range(3)]
    assert sorted(sum(shares, [])) == sorted(a[:9]) and {len(x) for x in shares} == {3}


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
    cache = ShardCache(index["shards"], tmp_path / "c", flaky, capacity=1 << 30)
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


def test_the_position_behind_a_step_is_known_from_the_seed(tmp_path):
    """A checkpoint keeps only the step (the Checkpointer's epoch and batch); consumed = batches x batch size maps
    back to a position in the rank's share of the epoch: a shard and the samples into it."""
    from appliance.node.stream import position_of

    index = packed(tmp_path / "src", 5, 3)  # rank 0 of 2: 2 shards of 3 samples an epoch
    at = lambda n: position_of(index, seed=7, rank=0, world=2, epoch=1, consumed=n)  # noqa: E731
    assert [at(n) for n in (0, 2, 3, 5, 6)] == [Position(1, 0, 0), Position(1, 0, 2), Position(1, 1, 0),
                                                Position(1, 1, 2), Position(2, 0, 0)]
    assert len(repr(at(5).as_dict())) < 1024 and Position.of(at(5).as_dict()) == at(5)
    with pytest.raises(ApplianceError, match="past rank 0's share"):
        at(7)


def test_every_rank_takes_the_same_whole_batches_every_epoch():
    from appliance.node.stream import samples_per_epoch

    index = {"shards": [{"samples": n} for n in (10, 10, 10, 10, 7)]}
    assert samples_per_epoch(index, 2, 4) == 16  # 2 shards a rank; the fewest two hold 17; whole batches of 4
    assert samples_per_epoch(index, 1, 4) == 44
    with pytest.raises(ApplianceError, match="less than one batch"):
        samples_per_epoch(index, 2, 64)


def stream(index, src, root, *, rank=0, world=2, batch=2, capacity=1 << 30):
    from appliance.node.stream import Stream

    return Stream(index, seed=7, rank=rank, world=world, batch_size=batch, root=root, fetch=copier(src),
                  capacity=capacity)


def take(s, n):
    it = s.samples()
    try:
        return [next(it)[0] for _ in range(n)]
    finally:
        it.close()


def test_a_stream_reads_its_share_each_epoch_and_a_resume_at_any_batch_continues_exactly(tmp_path):
    """What Keras sees: ``steps_per_epoch`` batches an epoch from one iterator; a resume at (epoch, batch) gives
    exactly the uninterrupted stream's samples after it, and fetches none of the shards already read whole."""
    index = packed(tmp_path / "src", 7, 5)  # 3 shards a rank (2 ranks), 15 samples, 7 batches of 2: 14 an epoch
    s = stream(index, tmp_path / "src", tmp_path / "a")
    assert s.per_epoch == 14 and s.steps_per_epoch == 7
    whole = take(s, 3 * 14)
    order0 = rank_share(epoch_order(7, 0, 7), 0, 2)
    first = [k for j in order0 for k in sorted({f"{j:03d}{i:03d}" for i in range(5)})][:14]
    assert whole[:14] == first  # the share's shards in the epoch's order, the 15th sample left out
    for epoch, batch in [(0, 0), (0, 3), (1, 2), (1, 6), (2, 5)]:
        r = stream(index, tmp_path / "src", tmp_path / f"r{epoch}{batch}")
        calls = []
        r.fetch, r.fetchers = copier(tmp_path / "src", calls), 1  # one GET at a time: the calls in reading order
        r.start_at(epoch, batch)
        cut = epoch * 14 + batch * 2
        assert take(r, 3 * 14 - cut) == whole[cut:], (epoch, batch)
        mine = rank_share(epoch_order(7, epoch, 7), 0, 2)
        assert calls[0] == index["shards"][mine[batch * 2 // 5]]["name"]  # the shard of the next sample, first


@pytest.mark.parametrize("was, now", [(2, 3), (3, 2)])
def test_on_another_world_size_the_interrupted_epoch_is_read_from_the_new_shares_and_the_next_are_whole(
        tmp_path, was, now):
    """What docs/stream.md promises when a resume has another number of ranks: the interrupted epoch's remainder
    comes from the new shares at the same batch (so some of its samples may be read twice, others not at all), the
    epochs after it are whole (every sample of the epoch's shares once across the ranks)."""
    index = packed(tmp_path / "src", 12, 4)
    keys = lambda share: [f"{j:03d}{i:03d}" for j in share for i in range(4)]  # noqa: E731
    before = [take(stream(index, tmp_path / "src", tmp_path / f"a{r}", rank=r, world=was), 6) for r in range(was)]
    got, per = [], 48 // now
    for r in range(now):  # interrupted at epoch 0, batch 3 (6 samples a rank); resumed on `now` ranks
        s = stream(index, tmp_path / "src", tmp_path / f"b{r}", rank=r, world=now)
        s.start_at(0, 3)
        assert s.per_epoch == per
        got.append(take(s, per - 6 + per))
        assert got[r][:per - 6] == keys(rank_share(epoch_order(7, 0, 12), r, now))[6:]
    epoch0 = [k for b in before for k in b] + [k for g in got for k in g[:per - 6]]
    if now > was:
        assert len(epoch0) == len(set(epoch0)) < 48  # more ranks: some never read in that epoch
    else:
        assert len(set(epoch0)) < len(epoch0)  # fewer ranks: some read twice
    assert sorted(k for g in got for k in g[per - 6:]) == sorted(keys(range(12)))


def test_a_stream_never_holds_more_than_its_cache(tmp_path):
    index = packed(tmp_path / "src", 12, 3)
    size = max(x["size"] for x in index["shards"])
    s = stream(index, tmp_path / "src", tmp_path / "c", world=1, batch=3, capacity=2 * size)
    assert len(take(s, 3 * 36)) == 108
    assert 0 < s.peak <= 2 * size and 12 * size >= 4 * s.capacity


def test_a_keras_resume_positions_the_processs_stream(tmp_path, monkeypatch):
    from appliance.node import stream as mod

    monkeypatch.setattr(mod, "_ACTIVE", [])
    assert mod.take_plan(1, 2) is None  # no stream: Keras' own skip replays the batches
    index = packed(tmp_path / "src", 4, 4)
    s = stream(index, tmp_path / "src", tmp_path / "c")
    mod._ACTIVE.append(s)
    assert mod.take_plan(1, 3) == s.start == Position(1, 1, 2)  # 6 samples: one shard of 4, 2 into the next


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


def test_the_next_epochs_shards_are_fetched_while_this_ones_are_read(tmp_path):
    """One cache across epoch ends: the fetcher asks for epoch 1's first shard while the reader is still in
    epoch 0, so an epoch does not start with a wait."""
    import threading

    index = packed(tmp_path / "src", 4, 3)
    s = stream(index, tmp_path / "src", tmp_path / "c", world=1, batch=3)
    want = index["shards"][rank_share(epoch_order(7, 1, 4), 0, 1)[0]]["name"]
    asked = threading.Event()
    calls = []

    def fetch(name, dest):
        calls.append(name)
        if calls.count(want) == 2:  # epoch 0 reads each of the 4 shards once, then epoch 1's first
            asked.set()
        shutil.copyfile(tmp_path / "src" / name, dest)
    s.fetch = fetch
    it = s.samples()
    try:
        for _ in range(s.per_epoch - 1):  # all of epoch 0 but its last sample
            next(it)
        assert asked.wait(10), calls
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
        assert hook.rank_line(0, format_line(Line.STREAM, {"epoch": e, "read": 10, "ready": 9, "stalls": 1,
                                                           "waited_s": 0.5, "refetched": 0, "peak": 3000,
                                                           "capacity": 8000, "wall_s": 20.0}))
    assert not hook.rank_line(0, "Epoch 3/3")
    assert said[1] == ("[appliance] stream epoch 1: rank 0 read 10 shard(s), 9 ready when asked, 1 waited for (0.5s), "
                       "0 fetched again; cache peak 3.0 KB of 8.0 KB")
    res = SimpleNamespace(stream=None)
    hook.finish(res)
    assert res.stream == {"epochs": 2, "shards": 20, "stalls": 2, "waited_s": 1.0, "wall_s": 40.0}
    assert format_stream(res.stream) == ("rank 0 waited 1.0s of 40.0s (2.5%) for shards from the store, 2 of 20 "
                                         "shard(s), over 2 epoch(s)")


def test_the_dataset_credential_goes_to_every_node_is_renewed_at_an_extension_and_goes_at_the_end(tmp_path):
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
    hook = JobStream(SimpleNamespace(job_store_creds=job_store_creds))
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
