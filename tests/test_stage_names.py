"""The stager's names and paths (issue 14, items 6 and 7), in the fast tier with an in-memory store
(tests/fakes.py). The same stager runs against a real Swift and S3 in test_stage.py."""

import os
import shutil
import threading

import pytest

from appliance.errors import ApplianceError
from appliance.node import fetch as stage_mod
from appliance.node.stage import MANIFEST, stage
from fakes import DictStore


def test_x_and_x_part_do_not_collide(tmp_path, monkeypatch):
    """Object `x` used to download to `x.part`, the final path of object `x.part`: with a slow GET of `x`,
    `x` ended with `x.part`'s bytes and staging reported success."""
    st = DictStore({"d/x": b"A" * 400_000, "d/x.part": b"B" * 1000})
    parts = []
    real = stage_mod._fetch_one
    monkeypatch.setattr(stage_mod, "_fetch_one", lambda store, o, part, *a, **kw: (parts.append((o.name, part)),
                                                                                     real(store, o, part, *a, **kw))[1])
    st.slow["d/x"] = threading.Event()
    threading.Thread(target=lambda: (st.got["d/x.part"].wait(10), st.slow["d/x"].set()), daemon=True).start()
    stage(st, "d/", tmp_path / "out", concurrency=4)
    assert (tmp_path / "out" / "x").read_bytes() == b"A" * 400_000
    assert (tmp_path / "out" / "x.part").read_bytes() == b"B" * 1000
    targets = {tmp_path / "out" / n[len("d/"):] for n in st.objects}
    assert not [p for _, p in parts if p in targets]  # no download ever writes where another object lands


def test_folder_markers_are_directories(tmp_path):
    st = DictStore({"d/": b"", "d/images/": b"", "d/images/a.jpg": b"jpg", "d/empty/": b""})
    res = stage(st, "d/", tmp_path / "out")
    assert (tmp_path / "out" / "images" / "a.jpg").read_bytes() == b"jpg"
    assert (tmp_path / "out" / "empty").is_dir() and res.files_total == 1


@pytest.mark.parametrize("names", [
    ["d/p/x", "d/p/./x"],  # one path, two names
    ["d/p/x", "d/p//x"],
    ["d/a/.", "d/b"],
    [f"d/{MANIFEST}"],  # the stager's own manifest
    ["d/.appliance-staging/x"],
    ["d/" + "n" * 256],  # a part over 255 bytes
    ["d/p", "d/p/q"],  # a file and a directory at one path
])
def test_ambiguous_or_reserved_names_are_refused_before_anything_is_written(tmp_path, names):
    st = DictStore({n: b"z" for n in names} | {"d/ok": b"ok"})
    with pytest.raises(ApplianceError, match="refusing") as e:
        stage(st, "d/", tmp_path / "out")
    assert "nothing was written" in str(e.value)
    assert not (tmp_path / "out" / "ok").exists()


def test_objects_deleted_from_the_store_leave_the_node_unless_kept(tmp_path):
    st = DictStore({"d/a": b"a", "d/b": b"b"})
    out = tmp_path / "out"
    stage(st, "d/", out)
    (out / "mine.txt").write_text("not staged: never touched")
    del st.objects["d/b"]
    res = stage(st, "d/", out, keep_extra=True)
    assert (out / "b").exists() and res.files_removed == 0
    res = stage(st, "d/", out)
    assert not (out / "b").exists() and (out / "a").exists() and res.files_removed == 1
    assert (out / "mine.txt").exists()


def test_a_dest_staged_from_another_prefix_loses_that_stages_files_and_nothing_else(tmp_path):
    """Issue 49: the manifest's names of a stage from data/v1/ were resolved against data/v2/: the files of v1 stayed,
    and a file of the user's at dest/data/v1/x.bin (the name read as a path) was unlinked."""
    st = DictStore({"data/v1/x.bin": b"1" * 100, "data/v1/sub/y.bin": b"2" * 100, "data/v2/z.bin": b"3" * 100})
    out = tmp_path / "out"
    stage(st, "data/v1/", out)
    assert (out / "x.bin").exists() and (out / "sub" / "y.bin").exists()
    (out / "data" / "v1").mkdir(parents=True)
    (out / "data" / "v1" / "x.bin").write_bytes(b"the user's")  # where the old code looked
    (out / "mine.txt").write_bytes(b"the user's too")
    res = stage(st, "data/v2/", out)
    assert res.files_fetched == 1 and (out / "z.bin").read_bytes() == b"3" * 100
    assert not (out / "x.bin").exists() and not (out / "sub" / "y.bin").exists()  # v1's files went
    assert (out / "data" / "v1" / "x.bin").read_bytes() == b"the user's"
    assert (out / "mine.txt").read_bytes() == b"the user's too"
    assert stage(st, "data/v2/", out).files_skipped == 1  # the same prefix again: nothing fetched
    # a dest staged before the prefix was recorded: names outside the prefix are forgotten, never read as paths
    (out / ".appliance-manifest.prefix").unlink()
    stage(st, "data/v1/", out)
    assert (out / "data" / "v1" / "x.bin").read_bytes() == b"the user's" and (out / "z.bin").exists()


def test_a_url_that_lists_nothing_is_refused_and_the_nodes_copy_stays(tmp_path):
    """A dataset URL with a typo listed nothing, was staged as an empty dataset ("0 fetched", exit 0), and removed
    every file the node had staged from the right URL as "no longer in the store"."""
    st = DictStore({"d/a": b"a", "d/b": b"b"})
    out = tmp_path / "out"
    stage(st, "d/", out)
    with pytest.raises(ApplianceError, match=r"mem:///dd/: no object under it; nothing was staged") as e:
        stage(st, "dd/", out)
    assert "appliance data ls mem:///" in e.value.fix
    assert (out / "a").read_bytes() == b"a" and (out / "b").read_bytes() == b"b"


def test_a_url_names_a_folder_not_every_name_that_starts_like_it(tmp_path):
    """`swift://c/data` staged `data-old/b` as `-old/b` beside `data/`'s files; rclone and `aws s3 sync` read it as
    the folder `data/`."""
    st = DictStore({"data/a": b"a", "data/sub/c": b"c", "data-old/b": b"b", "data/": b""})
    res = stage(st, "data", tmp_path / "out")
    assert sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*")
                  if p.is_file() and not p.name.startswith(".appliance")) == ["a", "sub/c"]
    assert res.files_total == 2


def test_a_url_that_names_one_object_stages_that_object(tmp_path):
    """`swift://c/x/data.tar` left the object itself out (as if it were the folder's marker) and staged
    `x/data.tar.old` as `.old`."""
    st = DictStore({"x/data.tar": b"tar", "x/data.tar.old": b"old"})
    stage(st, "x/data.tar", tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir() if not p.name.startswith(".appliance")] == ["data.tar"]
    assert (tmp_path / "out" / "data.tar").read_bytes() == b"tar"


class _NoContainer(DictStore):
    scheme, where = "swift", "datsets"

    def list(self, prefix=""):
        raise FileNotFoundError("swift://datsets/")


def test_a_container_that_is_not_there_is_said_with_the_fix(tmp_path):
    with pytest.raises(ApplianceError, match=r"swift://datsets/x/: there is no container 'datsets'; nothing was "
                                             r"staged") as e:
        stage(_NoContainer({}), "x/", tmp_path / "out")
    assert "appliance data upload" in e.value.fix


def test_the_progress_line_sums_up_a_large_cluster_and_names_its_slowest_node():
    """Issue 16 goal 4 (make bench-scale): on 16 nodes the progress line was 16 bars long, every second. Beyond a
    few nodes it is the cluster's totals and the slowest node."""
    from appliance.data import progress_line

    def p(done, eta):
        return {"files": done, "files_total": 4, "bytes": done << 20, "bytes_total": 4 << 20, "rate": 1 << 20,
                "eta": eta}

    few = progress_line({"n0": p(1, 3), "n1": p(2, 2)}, 2)
    assert few.count("|") == 1 and few.startswith("[stage] n0: 1/4 files")
    many = progress_line({f"n{i:02d}": p(3 if i != 7 else 1, 1 if i != 7 else 9) for i in range(16)}, 16)
    assert many.count("|") == 0 and len(many) < 160, many
    assert many.startswith("[stage] 16/16 nodes: 46/64 files 48.2 MB/67.1 MB (72%) 16.8 MB/s"), many
    assert many.endswith("ETA 9s; slowest n07 25%"), many


def test_a_second_upload_sends_only_what_is_not_there_yet(tmp_path, monkeypatch, said):
    """`appliance data upload` sent every file again on a re-run (an interrupted 200 GB upload started over), and
    said nothing until it ended."""
    from appliance.data import upload
    from appliance.store.objects import FileStore

    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "a.txt").write_text("a")
    (src / "d" / "b.bin").write_bytes(bytes(range(256)) * 10_000)
    sent = []
    real = FileStore.put
    monkeypatch.setattr(FileStore, "put", lambda self, name, path, **kw: (sent.append(name), real(self, name, path,
                                                                                               **kw))[1])
    url = f"file://{tmp_path}/store/"
    said.clear()
    assert upload(str(src), url + "x/", creds=None, segment_size=1_000_000) == 2
    assert sorted(sent) == ["a.txt", "d/b.bin"] and said[-1].startswith("uploaded 2 file(s)")
    sent.clear()
    assert upload(str(src), url + "x/", creds=None, segment_size=1_000_000) == 2
    assert sent == [] and said[-1].endswith("; 2 already there with the same size and MD5")
    (src / "a.txt").write_text("b")  # same size, other bytes
    assert upload(str(src), url + "x/", creds=None, segment_size=1_000_000) == 2
    assert sent == ["a.txt"] and (tmp_path / "store" / "x" / "a.txt").read_text() == "b"


def test_a_file_rewritten_in_place_at_the_same_size_is_fetched_again(tmp_path):
    """A re-stage (every resume stages) skipped a file whose size and ETag matched the manifest, so a file the job had
    rewritten in place at the same size (an array normalised and saved over itself) was kept, and the resumed run
    read other bytes than the store's. The manifest now keeps each file's mtime as staged."""
    import json
    import os

    st = DictStore({"d/x.npy": b"A" * 1000, "d/y": b"B" * 10})
    out = tmp_path / "out"
    stage(st, "d/", out)
    p = out / "x.npy"
    before = p.stat().st_mtime_ns
    p.write_bytes(b"Z" * 1000)
    os.utime(p, ns=(before + 10**9, before + 10**9))  # a second later (file times tick every few ms)
    res = stage(st, "d/", out)
    assert (res.files_fetched, res.files_skipped) == (1, 1) and p.read_bytes() == b"A" * 1000
    assert stage(st, "d/", out).files_skipped == 2  # and then it is left alone
    # a manifest written before (name -> [size, ETag]) still skips what is there at its size
    m = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).write_text(json.dumps({k: v[:2] for k, v in m.items()}))
    assert stage(st, "d/", out).files_skipped == 2


def test_a_second_pack_sends_only_the_shards_the_store_lacks(tmp_path, monkeypatch, said):
    """`appliance data pack` re-run after an interruption (or over unchanged files) sent every shard again; shards
    are deterministic (tar mtimes 0), so those the store holds with the same MD5 now stay; index.json is rewritten."""
    from appliance.data.pack import pack
    from appliance.store.objects import FileStore

    src = tmp_path / "src"
    src.mkdir()
    for i in range(30):
        (src / f"{i:03d}.bin").write_bytes(bytes([i]) * 3000)
    store = FileStore(str(tmp_path / "store"))
    said.clear()
    first = pack(src, store, "p", shard_size=20_000)
    assert len(first["shards"]) == 5
    sent = []
    real = FileStore.put
    monkeypatch.setattr(FileStore, "put", lambda self, name, path, **kw: (sent.append(name), real(self, name, path,
                                                                                                   **kw))[1])
    (tmp_path / "store" / "p" / "shard-000003.tar").unlink()  # the interruption: one shard never arrived
    again = pack(src, store, "p", shard_size=20_000)
    assert again == first and sorted(sent) == ["p/index.json", "p/shard-000003.tar"]
    assert said[-1].endswith("; 4 of them already in the store with the same MD5, not sent again")


@pytest.mark.parametrize("count", [1, 8])
def test_many_large_objects_are_one_get_each_and_a_few_are_ranges(tmp_path, monkeypatch, count):
    """A large plain object's MD5 cannot be combined from ranges: fetched as ranges, it is read back from the page
    cache to be hashed. With 8 or more large objects the parallel GETs come from the objects: each is one GET,
    hashed as it arrives (WHOLE_SHARE). A single one is still fetched as parallel ranges, and each is verified."""
    monkeypatch.setattr(stage_mod, "LARGE", 64_000)
    monkeypatch.setattr(stage_mod, "RANGE", 16_000)
    monkeypatch.setattr(stage_mod, "MAX_RANGE", 32_000)
    data = {f"d/big{i}": bytes([i]) * 100_000 + bytes(range(256)) for i in range(count)}
    st = DictStore(data)
    res = stage(st, "d/", tmp_path / "out", concurrency=4)
    assert res.files_fetched == count and not res.size_only
    for name, body in data.items():
        assert (tmp_path / "out" / name[2:]).read_bytes() == body
    gets = [g for g in st.gets if g[0] == "d/big0"]
    if count == 8:
        assert gets == [("d/big0", 0, 100_255)]  # one GET of the whole object
    else:
        assert len(gets) == 7 and {g[1] for g in gets} == set(range(0, 100_256, 16_000))


def test_a_download_is_named_for_this_process(tmp_path, monkeypatch):
    """Another stager on the same directory, opening the same name with O_TRUNC, would cut a download under this
    one. Each process's downloads have names of their own; another stager can only unlink them."""
    st = DictStore({"d/x": b"A" * 1000})
    parts = []
    real = stage_mod._fetch_one
    monkeypatch.setattr(stage_mod, "_fetch_one", lambda store, o, part, *a, **kw: (parts.append(part),
                                                                                     real(store, o, part, *a, **kw))[1])
    stage(st, "d/", tmp_path / "out")
    assert [p.name.split(".")[1:] for p in parts] == [[str(os.getpid()), "part"]]


def test_a_second_stager_on_the_same_directory_is_refused_and_the_first_finishes(tmp_path):
    """Two stagers on one directory cleared each other's downloads (.appliance-staging/): the first failed with
    "object ... vanished from the store", which was not so. The second is now refused before it touches anything,
    with the fix, and the first finishes."""
    st = DictStore({"d/x": b"A" * 400_000, "d/y": b"B" * 1000})
    st.slow["d/x"] = threading.Event()
    out = tmp_path / "out"
    first: dict = {}
    t = threading.Thread(target=lambda: first.update(res=stage(st, "d/", out, concurrency=2)))
    t.start()
    try:
        assert st.got["d/y"].wait(10)  # the first stager is under way, its download of x held
        with pytest.raises(ApplianceError, match="another staging run is writing into") as e:
            stage(DictStore({"d/x": b"C" * 10}), "d/", out)
        assert "wait for it" in e.value.fix
    finally:
        st.slow["d/x"].set()
        t.join(20)
    assert first["res"].files_fetched == 2 and (out / "x").read_bytes() == b"A" * 400_000
    assert stage(st, "d/", out).files_skipped == 2  # the lock goes with the run that held it


def test_a_download_removed_by_something_else_is_said_as_such(tmp_path):
    """A download that something else removed from the staging directory was reported as an object that "vanished
    from the store"; the store still has it."""
    st = DictStore({"d/x": b"A" * 400_000})
    st.slow["d/x"] = threading.Event()
    out = tmp_path / "out"
    threading.Thread(target=lambda: (st.started["d/x"].wait(10), shutil.rmtree(out / ".appliance-staging"),
                                     st.slow["d/x"].set()), daemon=True).start()
    with pytest.raises(ApplianceError, match="was removed while 'd/x' was staged") as e:
        stage(st, "d/", out)
    assert "vanished" not in str(e.value) and "let nothing else write into" in e.value.fix


def test_a_file_where_a_directory_goes_is_one_line_before_any_fetch(tmp_path, monkeypatch):
    """The directories the files go into are made once, before the fetches (each fetch asked for its own, a system
    call and an exception per file). A file standing where one must go was 5 fetches of every object in it with
    backoff, then "could not fetch"; it is one line naming the path, and nothing is fetched."""
    st = DictStore({"d/a/1.bin": b"1", "d/a/2.bin": b"2", "d/b/c/3.bin": b"3", "d/4.bin": b"4"})
    out = tmp_path / "out"
    mkdirs = []
    real = os.mkdir
    monkeypatch.setattr(os, "mkdir", lambda p, *a, **k: (mkdirs.append(str(p)), real(p, *a, **k))[1])
    stage(st, "d/", out, concurrency=2)
    assert sorted((out / n[2:]).read_bytes() for n in st.objects) == [b"1", b"2", b"3", b"4"]
    # under out only: os.mkdir is the process's, and another test's thread still running may call it meanwhile
    made = [p for p in mkdirs if p.startswith(str(out) + os.sep) and ".appliance" not in p]
    assert sorted(made) == [str(out / "a"), str(out / "b"), str(out / "b" / "c")]  # each once, not once per file

    st2 = DictStore({"d/a/1.bin": b"1", "d/x/2.bin": b"2"})
    out2 = tmp_path / "out2"
    out2.mkdir()
    (out2 / "x").write_bytes(b"mine")  # a file where directory x must go
    with pytest.raises(ApplianceError, match="cannot make the directory .*x to stage into") as e:
        stage(st2, "d/", out2)
    assert str(out2 / "x") in e.value.fix and not st2.gets  # nothing was fetched
    assert (out2 / "x").read_bytes() == b"mine"
