"""store/md5lanes.py: MD5s of many files' ranges at once, as their bytes are written (the stager's check of other
tools' objects), with the C lanes (appliance/store/_md5lanes.c) and with hashlib where they are not built."""

import hashlib
import os
import random

import pytest

from appliance.store import md5lanes

SIZES = [0, 1, 55, 56, 63, 64, 65, 119, 120, 128, md5lanes.CHUNK - 1, md5lanes.CHUNK, md5lanes.CHUNK + 1,
         3 * md5lanes.CHUNK + 77]


@pytest.fixture(params=["lanes", "hashlib"])
def lanes(request, monkeypatch):
    if request.param == "hashlib":
        monkeypatch.setattr(md5lanes, "LANES", 1)
    elif md5lanes.LANES == 1:
        pytest.skip("the lanes are not built or the CPU has no AVX2")
    return request.param


def avx2() -> bool:
    with open("/proc/cpuinfo") as f:
        return " avx2" in f.read()


@pytest.mark.skipif(not avx2(), reason="this CPU has no AVX2")
def test_the_lanes_are_built_and_used_on_this_machine():
    """make install builds the C extension (setup.py); a build that quietly failed would leave hashlib's speed.
    16 lanes: two AVX2 registers of 8 streams, their steps interleaved."""
    from appliance.store import _md5lanes

    assert _md5lanes.LANES == 16 and md5lanes.lanes_in_use() == 16


def test_the_lanes_give_hashlibs_md5_for_any_lengths_and_mixes():
    if md5lanes._md5lanes is None:
        pytest.skip("not built")
    rng = random.Random(5)
    for _ in range(300):
        data = [os.urandom(rng.choice(SIZES[:10] + [rng.randrange(5000)])) for _ in range(rng.randint(1, 16))]
        states = [bytearray(md5lanes._IV) for _ in data]
        md5lanes._md5lanes.update([(s, d[:len(d) // 64 * 64]) for s, d in zip(states, data)])
        md5lanes._md5lanes.update([(s, d[len(d) // 64 * 64:] + md5lanes._padding(len(d)))
                                   for s, d in zip(states, data)])
        assert [bytes(s).hex() for s in states] == [hashlib.md5(d).hexdigest() for d in data]


def test_a_lanes_data_may_be_a_list_of_pieces_hashed_in_turn():
    """The hasher hands each stream's bytes of a call as the buffers they are in (receive buffers, the file's map):
    any number of whole-block pieces, empty ones too, give the MD5 of them joined, beside streams given whole."""
    if md5lanes._md5lanes is None:
        pytest.skip("not built")
    rng = random.Random(6)
    for _ in range(200):
        pieces = [[os.urandom(64 * rng.randrange(0, 30)) for _ in range(rng.randint(0, 5))]
                  for _ in range(rng.randint(1, 16))]
        states = [bytearray(md5lanes._IV) for _ in pieces]
        md5lanes._md5lanes.update([(s, p if rng.random() < 0.8 else b"".join(p)) for s, p in zip(states, pieces)])
        md5lanes._md5lanes.update([(s, md5lanes._padding(sum(map(len, p)))) for s, p in zip(states, pieces)])
        assert [bytes(s).hex() for s in states] == [hashlib.md5(b"".join(p)).hexdigest() for p in pieces]
    with pytest.raises(ValueError):
        md5lanes._md5lanes.update([(bytearray(md5lanes._IV), [b"x" * 64, b"x" * 63])])  # a piece not whole blocks
    with pytest.raises(TypeError):
        md5lanes._md5lanes.update([(bytearray(md5lanes._IV), [b"x" * 64, 7])])


def test_the_c_update_refuses_what_it_cannot_hash():
    if md5lanes._md5lanes is None:
        pytest.skip("not built")
    st = bytearray(md5lanes._IV)
    with pytest.raises(ValueError):
        md5lanes._md5lanes.update([(st, b"x" * 65)])  # not whole blocks
    with pytest.raises(ValueError):
        md5lanes._md5lanes.update([(bytearray(md5lanes._IV), b"")] * 17)  # more than 16
    with pytest.raises(BufferError):
        md5lanes._md5lanes.update([(b"read-only state!", b"")])
    assert bytes(st) == md5lanes._IV


def test_md5_ranges_of_a_file(tmp_path, lanes):
    data = os.urandom(sum(SIZES) + 11)
    (tmp_path / "f").write_bytes(data)
    ranges, off = [], 5
    for k in SIZES:
        ranges.append((off, k))
        off += k
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        got = md5lanes.md5_ranges(fd, ranges)
        with pytest.raises(OSError):
            md5lanes.md5_ranges(fd, [(0, len(data) + 1)])
    finally:
        os.close(fd)
    assert [d.hex() for d in got] == [hashlib.md5(data[a:a + k]).hexdigest() for a, k in ranges]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _files_in_pieces(h, tmp_path, sizes, rng, cuts: int, step: int) -> tuple[list, list]:
    """A file per size (random bytes, its size made), a stream of ``h`` over it in up to ``cuts`` + 1 pieces cut at
    multiples of ``step``; and every (file, piece) in a random order, as parallel GETs come."""
    files = []
    for i, size in enumerate(sizes):
        data = os.urandom(size)
        fd = os.open(tmp_path / str(i), os.O_RDWR | os.O_CREAT)
        os.ftruncate(fd, size)
        at = sorted({0, size, *(rng.randrange(0, size + 1, step) for _ in range(cuts))})
        pieces = [(a, b - a) for a, b in zip(at, at[1:])] or [(0, 0)]
        files.append((data, fd, h.stream(fd, pieces), pieces))
    todo = [(f, j) for f in files for j in range(len(f[3]))]
    rng.shuffle(todo)
    return files, todo


def test_streams_written_out_of_order_in_any_pieces(tmp_path, lanes):
    """Eleven files at once, each in pieces written in random order and random chunks, as parallel GETs write them:
    every stream's MD5 is the file's, and the hasher lets go of every fd it took."""
    rng = random.Random(7)
    before = open_fds()
    with md5lanes.Hasher() as h:
        files, todo = _files_in_pieces(h, tmp_path, SIZES[3:], rng, 3, 1)
        for (data, fd, s, pieces), j in todo:
            a, k = pieces[j]
            pos = a
            while pos < a + k:  # a GET's buffers, written then shown
                n = min(a + k - pos, rng.choice([1, 100, 4096, 70000]))
                os.pwrite(fd, data[pos:pos + n], pos)
                s.wrote(j, n)
                pos += n
        for data, fd, s, _ in files:
            os.close(fd)  # the writer's fd: the hasher reads its own
        assert [s.result().hexdigest() for _, _, s, _ in files] == [hashlib.md5(d).hexdigest() for d, *_ in files]
    assert open_fds() == before


def test_ready_streams_are_hashed_together(tmp_path, monkeypatch):
    """LANES (16) files complete at once: one call of the lanes takes them all (the point of them)."""
    if md5lanes.LANES == 1:
        pytest.skip("the lanes are not built or the CPU has no AVX2")
    widths = []
    real = md5lanes._md5lanes.update

    class Counting:
        LANES = md5lanes.LANES

        @staticmethod
        def update(jobs):
            widths.append(len(jobs))
            return real(jobs)

    monkeypatch.setattr(md5lanes, "_md5lanes", Counting)
    data = [os.urandom(md5lanes.CHUNK * 2 + i) for i in range(md5lanes.LANES)]
    with md5lanes.Hasher() as h:
        streams = []
        with h.cv:  # every stream is ready before the hashing thread looks
            for i, d in enumerate(data):
                (tmp_path / str(i)).write_bytes(d)
                fd = os.open(tmp_path / str(i), os.O_RDONLY)
                s = h.stream(fd, [(0, len(d))])
                os.close(fd)
                s.wrote(0, len(d))
                streams.append(s)
        assert [s.result().hexdigest() for s in streams] == [hashlib.md5(d).hexdigest() for d in data]
    assert widths[0] == md5lanes.LANES and max(widths) == md5lanes.LANES


def _one_file_streams(tmp_path, h, n):
    """``n`` streams of one CHUNK each (one call of the lanes each) over one file written beforehand."""
    data = os.urandom(md5lanes.CHUNK * n)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    streams = h.streams(fd, [[(i * md5lanes.CHUNK, md5lanes.CHUNK)] for i in range(n)])
    os.close(fd)
    return streams, [hashlib.md5(data[i * md5lanes.CHUNK:(i + 1) * md5lanes.CHUNK]).hexdigest() for i in range(n)]


def test_a_ready_stream_waits_for_a_full_batch_while_others_are_coming(tmp_path):
    """A call of the lanes costs as much for two streams as for eight (and for nine as for 16): a ready stream
    waits (up to ``flush``) while others are unfinished. Before, the hasher took whatever was ready: 8 x 256 MiB multipart objects from Ceph RGW
    made 1,153 calls of one stream and 231 of eight."""
    if md5lanes.LANES == 1:
        pytest.skip("the lanes are not built or the CPU has no AVX2")
    with md5lanes.Hasher(flush=60) as h:
        streams, want = _one_file_streams(tmp_path, h, md5lanes.LANES)
        streams[0].wrote(0, md5lanes.CHUNK)
        assert not streams[0].done.wait(0.2)  # held: more are coming
        for s in streams[1:]:
            s.wrote(0, md5lanes.CHUNK)
        assert [s.result().hexdigest() for s in streams] == want
        assert h.batches == {md5lanes.LANES: 1}


def test_a_ready_stream_goes_alone_when_nothing_else_can_come_or_after_the_flush(tmp_path, lanes):
    """No wait where no other stream is unfinished (a run's last object), and at most ``flush`` where one is."""
    with md5lanes.Hasher(flush=60) as h:
        (alone,), want = _one_file_streams(tmp_path, h, 1)
        alone.wrote(0, md5lanes.CHUNK)
        assert alone.done.wait(30) and alone.hexdigest() == want[0]  # not 60 s: nothing else could come
        assert h.batches == {1: 1}
    with md5lanes.Hasher(flush=0.05) as h:
        (first, stuck), want = _one_file_streams(tmp_path, h, 2)
        first.wrote(0, md5lanes.CHUNK)
        assert first.done.wait(30) and first.hexdigest() == want[0]  # the other's writer never comes
        assert h.batches == {1: 1}
        stuck.cancel()


def test_a_cancelled_short_or_abandoned_stream_fails_rather_than_hangs(tmp_path, lanes):
    before = open_fds()
    (tmp_path / "f").write_bytes(b"x" * 1000)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    with md5lanes.Hasher() as h:
        cancelled = h.stream(fd, [(0, 1000)])
        cancelled.wrote(0, 10)
        cancelled.cancel()
        cancelled.cancel()  # twice: nothing more
        with pytest.raises(ValueError):
            h.stream(fd, [(0, 3000)])  # bytes the file does not have: said when the stream is made, never read
        unfinished = h.stream(fd, [(0, 1000)])
        with pytest.raises(ValueError):
            unfinished.digest()  # not every byte was written: a caller's mistake, said at once
    assert unfinished.done.is_set() and isinstance(unfinished.error, OSError)  # closing the hasher ended it
    os.close(fd)
    assert open_fds() == before


def test_then_calls_back_once_each_stream_is_hashed_or_has_failed(tmp_path, lanes):
    """``then``: the writer goes on and the verdict comes back in the hashing thread (the stager's objects of a few
    MB), once per stream: after its hashing, or at once when it is done already; never for one not whole (a
    cancelled GET). A callback that raises is kept and the others still run."""
    import threading

    data = os.urandom(3 * md5lanes.CHUNK + 77)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    seen, me = [], threading.get_ident()
    with md5lanes.Hasher() as h:
        a, b, done, bad = h.streams(fd, [[(0, len(data))], [(0, 100)], [(0, 64)], [(0, 1000)]])
        with pytest.raises(ValueError):
            a.then(seen.append)  # not every byte is written: a caller's mistake, said at once
        done.wrote(0, 64)
        done.result()
        done.then(lambda s: seen.append(("done", s.hexdigest(), threading.get_ident() == me)))  # done: at once
        assert seen == [("done", hashlib.md5(data[:64]).hexdigest(), True)]
        bad.wrote(0, 1000)
        bad.then(lambda s: 1 / 0)
        a.wrote(0, len(data))
        got = threading.Event()
        a.then(lambda s: (seen.append(("a", s.error, s.hexdigest())), got.set()))
        assert got.wait(30)
        assert seen[1] == ("a", None, hashlib.md5(data).hexdigest())
        b.wrote(0, 50)
        b.cancel()
        with pytest.raises(ValueError):
            b.then(seen.append)
        c = h.stream(fd, [(0, 10)])
    os.close(fd)
    assert bad.done.is_set() and any(isinstance(e, ZeroDivisionError) for e in h.errors)
    assert len(seen) == 2 and c.done.is_set() and isinstance(c.error, OSError)


def test_a_stream_ended_by_closing_the_hasher_calls_back_with_its_error(tmp_path, lanes):
    (tmp_path / "f").write_bytes(b"y" * 5000)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    seen = []
    h = md5lanes.Hasher(flush=60)
    s, other = h.streams(fd, [[(0, 100)], [(0, 5000)]])
    s.wrote(0, 100)
    s.then(lambda st: seen.append(st.error))
    os.close(fd)
    h.close()  # a stage that failed: what was not hashed yet ends with the hasher, each verdict said once
    assert len(seen) == 1 and (seen[0] is None or isinstance(seen[0], OSError))
    assert other.done.is_set() and isinstance(other.error, OSError)


def test_a_files_streams_share_one_map(tmp_path, lanes):
    """A multipart object has up to 10,000 parts and a process up to vm.max_map_count maps (65,530 by default):
    16 such objects at once with a map per part would pass it. One map per file, gone once its streams are."""
    path = tmp_path / "many"
    data = os.urandom(3000 * 100)
    path.write_bytes(data)

    def maps() -> int:
        with open("/proc/self/maps") as f:
            return sum(1 for line in f if line.rstrip().endswith(str(path)))

    fd = os.open(path, os.O_RDONLY)
    with md5lanes.Hasher() as h:
        streams = h.streams(fd, [[(a, 100)] for a in range(0, len(data), 100)])
        os.close(fd)
        assert maps() == 1
        for s in streams:
            s.wrote(0, 100)
        assert [s.result().hexdigest() for s in streams] == [hashlib.md5(data[a:a + 100]).hexdigest()
                                                              for a in range(0, len(data), 100)]
        del s, streams
    assert maps() == 0


def test_bodies_give_hashlibs_md5_sixteen_in_a_call_and_one_alone_after_the_wait():
    """``Bodies``: the small objects' MD5s (the stager copies each body in and goes on). LANES (16) queued bodies
    are one call of the lanes; fewer wait ``flush`` seconds for more, then go as they are (one alone through
    hashlib)."""
    if md5lanes.LANES == 1:
        pytest.skip("the lanes are not built or the CPU has no AVX2")
    import threading

    L = md5lanes.LANES
    sizes = ([s for s in SIZES if s <= 1 << 20] + [5000 + 999 * i for i in range(L)])[:L]
    data = [os.urandom(n) for n in sizes] + [os.urandom(100_000)]
    got = {}
    done = threading.Event()

    def verdict(i):
        def d(digest):
            got[i] = digest
            if len(got) == len(data):
                done.set()
        return d

    with md5lanes.Bodies(flush=3600) as b:  # only a full batch goes before close
        for i, x in enumerate(data[:L]):
            job = b.job(len(x))
            job.buf[:] = x
            b.submit(job, verdict(i))
        job = b.job(len(data[L]))
        job.buf[:] = data[L]
        b.submit(job, verdict(L))
    assert b.batches == {L: 1, 1: 1} and not b.errors  # the last went at close
    assert [got[i] for i in range(L + 1)] == [hashlib.md5(x).digest() for x in data]

    got.clear()
    done = threading.Event()
    b = md5lanes.Bodies(flush=0.001)
    job = b.job(3)
    job.buf[:] = b"abc"
    b.submit(job, lambda digest: (got.setdefault(0, digest), done.set()))
    assert done.wait(10) and got[0] == hashlib.md5(b"abc").digest()  # alone, after its wait: not held to close
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        b.submit(b.job(1), lambda d: None)


def test_a_body_verdict_that_raises_leaves_the_others_theirs():
    b = md5lanes.Bodies(flush=3600)
    out = []
    for i in range(3):
        job = b.job(10)
        job.buf[:] = bytes([i]) * 10

        def done(digest, i=i):
            if i == 1:
                raise ValueError("a verdict's own bug")
            out.append(digest)
        b.submit(job, done)
    b.close()
    assert out == [hashlib.md5(bytes([i]) * 10).digest() for i in (0, 2)]
    assert [str(e) for e in b.errors] == ["a verdict's own bug"]


def test_bodies_wait_for_room_when_their_queue_is_full():
    """A submitter that outruns the hashing waits (the copies are memory) rather than queues without end."""
    import threading
    import time

    b = md5lanes.Bodies(flush=3600, queued=2)  # no batch before close: 2 < LANES, and an hour's wait
    hashed, third = [], []
    for i in range(2):
        b.submit(b.job(1), hashed.append)

    def submit_third():
        try:
            b.submit(b.job(1), hashed.append)
            third.append("queued")
        except RuntimeError as e:
            third.append(str(e))
    t = threading.Thread(target=submit_third)
    t.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until the third submitter waits for room
        with b.lock:
            if b.room._waiters:
                break
    with b.lock:
        assert b.room._waiters and len(b.waiting) == 2 and not third
    b.close()  # hashes the 2 queued; the third, still waiting, is refused
    t.join(10)
    assert len(hashed) == 2 and third == ["the hashing of bodies is closed"]


def test_bodies_reuse_their_buffers_whatever_the_mix_of_sizes():
    """A buffer given back was reused only if it was the last one given back and big enough: sizes in a random mix
    made a new one nearly every time, and kept them all."""
    rng = random.Random(5)
    b = md5lanes.Bodies(flush=3600)
    made = set()
    for _ in range(500):
        jobs = [b.job(rng.randrange(1, 1 << 20)) for _ in range(8)]  # 8 in hand at once
        made.update(id(j.store) for j in jobs)
        for j in jobs:
            b.drop(j)
    b.close()
    assert len(made) <= 8 * 5  # classes 64 KiB .. 1 MiB, 8 of each at most


def test_streams_fed_from_receive_buffers_and_the_file_at_once(tmp_path, lanes):
    """The stager's GETs hand the bytes that come where a stream's written bytes end to the stream itself (``hold``,
    their buffer shared until hashed; httpget writes them past the page cache) and write the rest to the file
    (``wrote``). The held bytes are written to the file as garbage here: every MD5 is still the data's, so they
    were hashed from the buffers, and every buffer is given back."""
    from appliance.store.httpget import _POOL, Lease

    rng = random.Random(11)
    leases, lent = [], _POOL.lent
    with md5lanes.Hasher() as h:
        sizes = [md5lanes.CHUNK * 5 + 300, 64 * 1000, 3 * md5lanes.CHUNK, 1000, 0]
        files, todo = _files_in_pieces(h, tmp_path, sizes, rng, 2, 64)
        for (data, fd, s, pieces), j in todo:
            a, k = pieces[j]
            pos = a
            while pos < a + k:
                n = min(a + k - pos, rng.choice([64 * 5, 4096, 70000, md5lanes.CHUNK * 2]))
                with h.cv:
                    held = s.holds(j, n)
                    if held:
                        lease = Lease(_POOL.spare())  # a receive buffer, as get_into lends it
                        lease.buf[:n] = data[pos:pos + n]
                        s.hold(j, lease.buf[:n], lease)
                        leases.append(lease)
                if held:
                    os.pwrite(fd, b"\xee" * n, pos)  # not the bytes: the hash must not read them from here
                    lease.release()  # the lender's share
                else:
                    os.pwrite(fd, data[pos:pos + n], pos)
                    s.wrote(j, n)
                pos += n
        assert [s.result().hexdigest() for _, _, s, _ in files] == [hashlib.md5(d).hexdigest() for d, *_ in files]
        for _, fd, _, _ in files:
            os.close(fd)
    assert leases and all(lease.refs == 0 for lease in leases) and _POOL.lent == lent


def test_a_cancelled_stream_gives_its_held_buffers_back(tmp_path, lanes):
    from appliance.store.httpget import _POOL, Lease

    lent = _POOL.lent
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, 4 * md5lanes.CHUNK)
    with md5lanes.Hasher() as h:
        s = h.stream(fd, [(0, 4 * md5lanes.CHUNK)])
        with h.cv:
            assert s.holds(0, 128) and not s.holds(1, 128) and not s.holds(0, 100)
            lease = Lease(_POOL.spare())
            s.hold(0, lease.buf[:128], lease)
        lease.release()
        s.cancel()
        assert s.done.is_set() and isinstance(s.error, OSError)
    os.close(fd)
    assert lease.refs == 0 and _POOL.lent == lent
