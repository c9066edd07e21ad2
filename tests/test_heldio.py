"""store/heldio.py: the stager's small file calls with the GIL held (appliance/store/_heldio.c) do what the os
module's do, errors and file names included (the stager names the path something else removed), and the os module's
calls stand in where the extension is not built."""

import errno
import os
import stat

import pytest

from appliance.store import heldio


@pytest.fixture(params=["c", "os"])
def io(request, monkeypatch):
    if request.param == "os":
        monkeypatch.setattr(heldio, "_heldio", None)
    elif not heldio.built():
        pytest.skip("appliance/store/_heldio.c is not built here")
    return heldio


def test_the_extension_is_built_here():
    """make install builds it (setup.py); a build that quietly failed would hand the GIL over per call again."""
    assert heldio.built()


def test_the_calls_do_what_the_os_modules_do(tmp_path, io):
    part, target, journal = tmp_path / "x.part", tmp_path / "x", tmp_path / "j"
    target.write_bytes(b"old")
    fd = io.open_file(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    assert not os.get_inheritable(fd)
    os.pwrite(fd, b"new bytes", 0)
    io.close(fd)
    with pytest.raises(OSError) as e:
        os.fstat(fd)
    assert e.value.errno == errno.EBADF
    assert stat.S_IMODE(part.stat().st_mode) == 0o644 & ~_umask()
    io.replace(part, target)
    assert target.read_bytes() == b"new bytes" and not part.exists()
    assert io.mtime_ns(target) == os.stat(target).st_mtime_ns
    j = io.open_file(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    io.write_all(j, b"one\n")
    io.write_all(j, "two \u00e9\n".encode())
    io.close(j)
    assert journal.read_text() == "one\ntwo \u00e9\n"


def test_a_write_at_a_place_lands_whole_a_small_one_keeps_the_gil_and_a_large_one_goes_in_pieces(tmp_path, io,
                                                                                                monkeypatch):
    """pwrite_all (httpget.get_into's writes): every byte where it belongs. Up to HELD_WRITE bytes go through
    _heldio with the GIL held (os.pwrite gives it back: 1.5 waits for the GIL per 100 KB object among 32 threads,
    bench/results/stage-switches/gil-waits.txt); larger ones through _heldio.pwrite_pieces, the GIL released once,
    and where the extension is not built through os.pwrite, in pieces of WRITE_PIECE bytes at most."""
    monkeypatch.setattr(heldio, "WRITE_PIECE", 64 * 1024)
    p = tmp_path / "f"
    fd = os.open(p, os.O_RDWR | os.O_CREAT)
    small, large = os.urandom(100 * 1024), os.urandom(max(heldio.HELD_WRITE, 3 * heldio.WRITE_PIECE) + 4096)
    through_os = []
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda f, b, at: (through_os.append(len(b)), real(f, b, at))[1])
    try:
        io.pwrite_all(fd, memoryview(small), 5)
        io.pwrite_all(fd, memoryview(large), 5 + len(small))
    finally:
        os.close(fd)
    assert p.read_bytes() == bytes(5) + small + large
    pieces = [64 * 1024] * (len(large) // (64 * 1024)) + [4096]
    assert through_os == ([] if io._heldio is not None else [64 * 1024, 100 * 1024 - 64 * 1024] + pieces)
    ro = os.open(p, os.O_RDONLY)
    try:
        for view in (memoryview(b"x"), memoryview(large)):
            with pytest.raises(OSError) as e:
                io.pwrite_all(ro, view, 0)
            assert e.value.errno == errno.EBADF
    finally:
        os.close(ro)


def test_errors_are_the_os_modules_with_the_path(tmp_path, io):
    gone = tmp_path / "no" / "such"
    with pytest.raises(FileNotFoundError) as e:
        io.open_file(gone, os.O_WRONLY | os.O_CREAT)
    assert e.value.filename == str(gone)
    with pytest.raises(FileNotFoundError) as e:
        io.replace(gone, tmp_path / "x")
    assert e.value.filename == str(gone)
    with pytest.raises(FileNotFoundError) as e:
        io.mtime_ns(gone)
    assert e.value.filename == str(gone)
    with pytest.raises(OSError) as e:
        io.close(10_000)
    assert e.value.errno == errno.EBADF
    with pytest.raises(OSError) as e:
        io.write_all(10_000, b"x")
    assert e.value.errno == errno.EBADF


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m
