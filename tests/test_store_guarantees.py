"""Issue 49's guarantees on the real stores: OpenStack Swift and Ceph RGW, each through its Swift and its S3 API.

- the fault matrix (tests/faults.py): a 503, then a connection closed without an answer, at each store call of
  commit + prune, lock take + heartbeat + takeover, sync + prune + restore: nothing committed lost or written over,
  nothing wrong said as success;
- a committed checkpoint is never written over by a second save of its step;
- the store's create-only write (the run lock's): which stores honour ``If-None-Match: *``, measured."""

from __future__ import annotations

import time as real_time

import pytest

from appliance.store.checkpoints import CheckpointStore
from appliance.store.objects import StoreCreds
from faultproxy import FaultProxy
from faults import matrix

STORES = [("swift", "swift"), ("swift", "s3"), ("rgw", "swift"), ("rgw", "s3")]


def creds_via(server, endpoint: str, api: str) -> StoreCreds:
    c = server.credentials()
    if api == "s3":
        return StoreCreds(s3_endpoint=endpoint, s3_access_key=c["s3_access_key"], s3_secret_key=c["s3_secret_key"])
    return StoreCreds(auth_url=f"{endpoint}/auth/v1.0", user=c["user"], key=c["key"])


class ProxyFaults:
    """tests/faults.py's faults from the HTTP proxy: the k-th request from now answered 503 (``mode="fail"``) or
    closed without an answer (``"reset"``)."""

    def __init__(self, proxy: FaultProxy, mode: str):
        self.proxy, self.mode = proxy, mode

    def arm(self, k):
        self.proxy.arm(**({f"{self.mode}_at": k} if k else {}))

    def disarm(self):
        self.proxy.fail_at = self.proxy.reset_at = None

    @property
    def counted(self) -> int:
        return self.proxy.counted


@pytest.mark.parametrize("swift", ["swift", "rgw"], indirect=True)
def test_the_fault_matrix_on_real_stores(swift, tmp_path, monkeypatch):
    """Both APIs of the store, a fault at every other call of every scenario: on Swift 503s through its Swift API
    and resets through S3 at the odd calls, on RGW the other way round at the even ones, so that between the two
    stores each API meets a fault at every call (each run is ~28 requests at ~9 ms here: every call on both, or
    all four kinds, would double the test's 70 CPU-s per store for no new path; the fast tier puts a reset at
    every call of a directory store, tests/test_no_overwrite.py)."""
    monkeypatch.setattr(real_time, "sleep", lambda s: None)  # the retries' backoff (ours and botocore's), not sync
    proxy = FaultProxy(swift.s3_endpoint, bind_ip=swift.bind_ip).start()
    rgw = swift.__class__.__name__ == "RGWServer"
    try:
        for api in ("swift", "s3"):
            creds = creds_via(swift, proxy.url, api)
            CheckpointStore(f"{api}://faults{api}/", "x", creds).ensure_container()
            for mode in [("fail" if (api == "swift") != rgw else "reset")]:
                faults = ProxyFaults(proxy, mode)
                stores: dict[str, CheckpointStore] = {}  # one client per run (a boto3 client costs ~0.3 s of CPU)
                got = matrix(lambda run: stores.setdefault(run, CheckpointStore(
                    f"{api}://faults{api}/", f"{mode}-{run}", creds)), faults, tmp_path, first=2 if rgw else 1, every=2)
                assert all(len(v) >= 2 for v in got.values()), (api, mode, got)
        assert proxy.failed  # the faults did land (botocore retries a reset itself: every S3 run may end "ok")
    finally:
        proxy.stop()


@pytest.mark.parametrize("swift", ["swift", "rgw"], indirect=True)
def test_a_second_save_of_a_step_never_writes_over_the_first_and_create_is_exclusive(swift, tmp_path):
    """Measured here: OpenStack Swift (both APIs) and RGW's S3 API refuse a create-only write over an existing name
    with 412; Ceph RGW 16.2's Swift API writes it (the run lock reads back and fences for it: store/runlock.py)."""
    from appliance.store.runlock import RunLock

    for api in ("swift", "s3"):
        cs = CheckpointStore(f"{api}://nooverwrite{api}/", "r", creds_via(swift, swift.s3_endpoint, api))
        cs.ensure_container()
        for i, fill in enumerate((b"1", b"2")):
            d = tmp_path / f"{api}{i}" / "ckpt-000000200"
            d.mkdir(parents=True)
            (d / "state.data").write_bytes(fill * 5000)
            cs.upload(d, {"step": 200})
        good, problems = cs.newest_good()
        assert [c.name for c in cs.committed()] == ["ckpt-000000200.1", "ckpt-000000200"], problems
        assert good.name == "ckpt-000000200.1" and cs.verify(cs.committed()[1]) is None
        name = cs.prefix + "create-probe"
        assert cs.store.create(name, b"first") is True
        exclusive = not cs.store.create(name, b"second")
        assert exclusive == (swift.__class__.__name__ != "RGWServer" or api == "s3"), (api, exclusive)
        # whichever the store, two takers of one instant end with one holder at their next heartbeat
        a, b = RunLock(cs, "job-a", cluster="a", head="h"), RunLock(cs, "job-b", cluster="b", head="h")
        seen = b.current()
        a.acquire(tmp_path)
        real, calls = b.current, []
        b.current = lambda: seen if not calls.append(1) and len(calls) == 1 else real()
        b.acquire(tmp_path)
        b.current = real
        assert [lk.job_id for lk in (a, b) if lk.heartbeat(tmp_path)] == [RunLock(cs, "", cluster="", head="")
                                                                          .read()["job_id"]]
    # what `appliance cloud stop` says it empties (issue 49: the local store lost everything without a word)
    from appliance.localcloud import account_usage

    c = swift.credentials()
    used = account_usage(c["auth_url"], c["user"], c["key"])
    assert used["containers"] >= 2 and used["objects"] >= 8 and used["bytes"] >= 20000, used
    assert account_usage(c["auth_url"], c["user"], "wrong") is None


@pytest.mark.slow  # a real Ceph RGW of its own
def test_a_full_local_store_refuses_writes_in_one_line(tmp_path):
    """Issue 49: the local cloud's memstore OSD, once full, held writes (RGW's PUT hung) instead of refusing them.
    Its RGW user now has a quota of 3/4 of what the OSD keeps: past it, both APIs refuse with QuotaExceeded, said
    in one line and not asked again."""
    import os

    from appliance.localcloud.rgw_server import RGWServer
    from appliance.store.objects import StoreRefused, open_store

    srv = RGWServer(tmp_path / "rgw", memstore_bytes=256 << 20).start()  # a quota of 192 MiB
    try:
        c = srv.credentials()
        blob = tmp_path / "blob"
        blob.write_bytes(os.urandom(60 << 20))
        refused = {}
        for api in ("s3", "swift"):
            st, _ = open_store(f"{api}://full{api}/", creds_via(srv, srv.s3_endpoint, api))
            st.ensure_container()
            for i in range(5):
                try:
                    st.put(f"x{i}", blob)
                except StoreRefused as e:
                    refused[api] = (i, str(e))
                    break
        assert refused["s3"][0] == 3 and refused["swift"][0] == 0, refused  # the quota is the project's
        assert all("quota is used up" in m and "\n" not in m for _, m in refused.values())
    finally:
        srv.stop()
