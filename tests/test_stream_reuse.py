"""Stream mode's cache keeps the shards it will read again (appliance/node/stream_reuse.py, used by
appliance/node/stream.py's ShardCache): the reading order of every epoch is known ahead, so a shard read is kept
while there is room and the one read again last goes first. A rank whose cache holds the dataset fetches each
shard once in the whole run; one whose cache holds half of it fetches about half the bytes each epoch; the bytes
read from the store are what each epoch reports. Through the in-process fake store of tests/test_stream.py (a
copying fetch that counts)."""

from collections import Counter

from appliance.node.stream_order import Order, reads
from appliance.node.stream_reuse import NEVER, Reuse
from test_stream import packed, stream, take


def counting(src, calls):
    import shutil

    def fetch(name, dest):
        calls.append(name)
        shutil.copyfile(src / name, dest)
    return fetch


def run(index, src, root, *, epochs, world=1, rank=0, capacity, window=2, batch=4):
    """Rank ``rank``'s stream read for ``epochs`` epochs: its samples, the shards it fetched (in order), and what
    each epoch reported (the store's bytes, the visits served from kept shards, the shards opened)."""
    calls, said = [], []
    s = stream(index, src, root, rank=rank, world=world, batch=batch, capacity=capacity, window=window)
    s.fetch = counting(src, calls)
    s.on_epoch = lambda e, st, peak, wall: said.append((st.store_bytes, st.kept, st.ready + st.stalls))
    return take(s, epochs * s.per_epoch), calls, said


def test_a_cache_that_holds_the_dataset_fetches_each_shard_once_per_rank_over_3_epochs(tmp_path):
    index = packed(tmp_path / "src", 12, 4)
    size = {x["name"]: x["size"] for x in index["shards"]}
    total = sum(size.values())
    for r in range(2):
        got, calls, said = run(index, tmp_path / "src", tmp_path / f"c{r}", epochs=3, world=2, rank=r,
                               capacity=total + 1)
        o = Order(tuple(x["samples"] for x in index["shards"]), 7, 8, 2, 2)
        it = reads(o, r, 2, 0)
        wanted = {index["shards"][next(it)[1]]["name"] for _ in got}  # the shards of what it read
        assert set(Counter(calls).values()) == {1} and wanted <= set(calls) and len(wanted) > 6  # each once
        assert sum(b for b, _, _ in said) == sum(size[n] for n in wanted)
        assert sum(k for _, k, _ in said) == sum(n for _, _, n in said) - len(wanted)  # the rest: kept shards
        small, _, _ = run(index, tmp_path / "src", tmp_path / f"s{r}", epochs=3, world=2, rank=r,
                          capacity=4 * max(size.values()))
        assert got == small  # what it keeps changes what it fetches, never what it reads


def test_a_cache_of_half_the_dataset_fetches_about_half_its_bytes_each_epoch(tmp_path):
    index = packed(tmp_path / "src", 40, 1)
    size = {x["name"]: x["size"] for x in index["shards"]}
    total = sum(size.values())
    _, calls, said = run(index, tmp_path / "src", tmp_path / "c", epochs=3, capacity=total // 2, batch=2)
    share = [b / total for b, _, _ in said]
    assert share[0] == 1.0 and all(0.4 <= x <= 0.6 for x in share[1:]), share
    # the store's count: what the epochs reported, and what was fetched ahead for the next (at most a cache full)
    assert 0 <= sum(size[n] for n in calls) - sum(b for b, _, _ in said) <= total // 2


def test_the_shard_read_again_last_goes_first_and_one_never_read_again_is_not_kept():
    a, b, c, d = ({"name": n, "size": 10} for n in "abcd")
    r = Reuse([a, b, c, a, d, b, c])
    for _ in range(3):
        r.take()
    assert all(r.keep(n, 10) for n in "abc")  # read again at visits 3, 5 and 6
    assert r.evict(15) == [("c", 10), ("b", 10)] and list(r.kept) == ["a"] and r.kept_bytes == 10
    r.take()  # a's second visit
    assert r.reuse("a") and r.next_visit("a") == NEVER and not r.keep("a", 10)
