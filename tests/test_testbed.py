"""The testbed: real namespaces, real sshd, pinned host keys, and a `down` that leaves nothing behind."""

import os
import subprocess
import uuid

import pytest

from appliance import testbed
from appliance.cluster import from_testbed
from appliance.errors import ApplianceError
from appliance.remote import Session, connect
from conftest import needs_netns, tb_name

LC, SH = tb_name("lc"), tb_name("sh")


def _netns_names():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _link_exists(name):
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


@pytest.mark.slow
@needs_netns
def test_lifecycle_idempotent_and_clean():
    tb = testbed.up(LC, 2, data_disk=4 << 20)  # each node has a data disk of 4 MiB
    try:
        pids = [n.sshd_pid for n in tb.nodes]
        st = testbed.status(LC)
        assert st["up"] and [n["name"] for n in st["nodes"]] == ["node1", "node2"]
        # a second `up` of the same size is a no-op
        again = testbed.up(LC, 2)
        assert [n.sshd_pid for n in again.nodes] == pids
        # a different size while up is a clear error, not a mess
        with pytest.raises(ApplianceError, match="is up with 2 nodes"):
            testbed.up(LC, 3)
        # each node: own hostname, own /etc/hosts, own disk, reachable over SSH with the pinned key
        cl = from_testbed(tb, name="lc-cluster")
        with Session(cl) as s:
            outs = s.each(lambda r: r.run("hostname; cat /etc/hosts; touch /mnt/local/mine; ls /mnt/local", check=True).out)
            # each node's /dev/shm is its own, as a machine's is: what a killed job leaves there (multiprocessing's
            # named semaphores) goes with the node, not into the host's
            mark = f"apl-mine-{uuid.uuid4().hex[:8]}"  # this run's own: a file an earlier run left is not this one
            shm = s.each(lambda r: r.run(f"touch /dev/shm/{mark}-$(hostname); ls /dev/shm", check=True).out.split())
        leaked = [f for f in os.listdir("/dev/shm") if f.startswith(mark)]
        for f in leaked:
            os.unlink(f"/dev/shm/{f}")
        assert shm == {"node1": [f"{mark}-node1"], "node2": [f"{mark}-node2"]}
        assert not leaked
        assert outs["node1"].splitlines()[0] == "node1" and outs["node2"].splitlines()[0] == "node2"
        assert "10.77." in outs["node1"] and outs["node1"] != outs["node2"]
        assert os.path.exists(os.path.join(tb.nodes[0].disk, "mine"))
        with Session(cl) as s:  # its size is what df says on the node, and a write past it fails (ENOSPC)
            full = s.each(lambda r: r.run("df -B1 --output=size /mnt/local/data | tail -1; dd if=/dev/zero "
                                          "of=/mnt/local/data/big bs=1M count=5 2>&1; echo dd=$?").out)
        for out in full.values():
            assert int(out.split()[0]) == 4 << 20 and "dd=1" in out and "No space left on device" in out, out
        host_hosts = open("/etc/hosts").read()
        assert "node1" not in host_hosts  # the host's own /etc/hosts is untouched
        _a_node_removed_leaves_the_other_reaching_this_machine(tb)
    finally:
        removed = testbed.down(LC)
    assert any("bridge" in r for r in removed)
    assert f"apl-{LC}-" not in _netns_names()
    assert not _link_exists(f"apl-{LC}")
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"apl{LC}v" not in links
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or "sshd" not in open(f"/proc/{pid}/cmdline").read()
    assert testbed.load(LC) is None
    assert f"/{LC}/" not in open("/proc/self/mounts").read()  # the data disks are unmounted
    assert testbed.down(LC) == []  # idempotent


def _a_node_removed_leaves_the_other_reaching_this_machine(tb):
    """As a Chameleon node's gateway stays where it was when another server is deleted, this machine's address on the
    bridge keeps its MAC when a node goes: Linux gives a bridge without an address of its own its lowest port's, and
    the other nodes' ARP entries then pointed at the removed node's port for up to a minute (a warm handover's resume,
    started as the old cluster went, timed out on the new head's SSH banner)."""
    import socket
    from pathlib import Path

    mac = lambda link: Path(f"/sys/class/net/{link}/address").read_text().strip()  # noqa: E731
    gone = min(tb.nodes, key=lambda n: mac(n.veth))  # the port an unset bridge address follows
    stay = next(n for n in tb.nodes if n is not gone)
    before = mac(tb.bridge)
    with socket.create_server((tb.host_ip, 0)) as srv:
        probe = f"timeout 2 bash -c 'exec 3<>/dev/tcp/{tb.host_ip}/{srv.getsockname()[1]}'"
        fresh = f"ip neigh flush to {tb.host_ip}; {probe}"  # its ARP entry for this machine: just asked, REACHABLE
        assert testbed.node_exec(LC, stay.name, fresh).returncode == 0
        testbed.remove_node(LC, gone.name)
        assert mac(tb.bridge) == before
        assert testbed.node_exec(LC, stay.name, probe).returncode == 0, "the node lost this machine"


@pytest.mark.slow
@needs_netns
def test_changed_host_key_is_rejected(cluster2, tmp_path):
    bad = tmp_path / "known_hosts"
    lines = open(cluster2.known_hosts).read().splitlines()
    # pin node1's name/address to node2's key
    k2 = lines[1].split(" ", 1)[1]
    bad.write_text(f"{lines[0].split(' ', 1)[0]} {k2}\n")
    import dataclasses

    wrong = dataclasses.replace(cluster2, known_hosts=str(bad))
    with pytest.raises(ApplianceError, match="does not match the pinned one"):
        connect(wrong, wrong.nodes[0])
    empty = tmp_path / "empty"
    empty.write_text("")
    with pytest.raises(ApplianceError, match="no pinned host key"):
        connect(dataclasses.replace(cluster2, known_hosts=str(empty)), cluster2.nodes[0])


def test_single_host_fallback_when_not_root(monkeypatch, said):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    ok, why = testbed.namespaces_available()
    assert not ok and "root" in why
    said.clear()
    tb = testbed.up(SH, 2)
    try:
        assert tb.mode == "single-host" and len(tb.nodes) == 1 and tb.nodes[0].slots == 2
        assert any("single-host mode" in m and "root" in m for m in said)
        cl = from_testbed(tb)
        assert cl.single_host and cl.world_size == 2
    finally:
        testbed.down(SH)


def test_a_process_that_ends_between_two_proc_reads_is_not_alive(monkeypatch):
    """`make test` saw cut_connections fail with ProcessLookupError: a killed sshd child ended after _alive read its
    /proc cmdline and before it read /proc stat."""
    import pathlib

    from appliance.testbed import netns

    real = pathlib.Path.read_text

    def gone(self, *a, **k):
        if str(self).endswith("/stat"):
            raise ProcessLookupError(3, "No such process")
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "read_text", gone)
    assert netns._alive(os.getpid()) is False


def test_stopping_the_local_cloud_waits_for_the_testbeds_lock_that_two_commands_do_not_wait_for(monkeypatch):
    """`down` from the local cloud's stop waits for the testbed's lock (its server, slow to stop on a loaded
    machine, still held it: make test's teardown failed with "another `appliance testbed up/down` is running");
    `appliance testbed down` beside a running `up` still fails at once."""
    import fcntl

    from appliance import paths
    from appliance.testbed import netns

    name = f"lk{uuid.uuid4().hex[:6]}"
    holder = open(paths.testbeds_dir() / f".{name}.lock", "w")
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with pytest.raises(ApplianceError, match="another `appliance testbed up/down` is running"):
        testbed.down(name)

    class Clock:  # the waits, not sat out: the holder lets go during the first
        t = 0.0

        def monotonic(self):
            return self.t

        def sleep(self, s):
            self.t += s
            holder.close()

    monkeypatch.setattr(netns, "time", Clock())
    assert testbed.down(name, wait=30.0) == []  # nothing was up: nothing removed, and no error
    assert holder.closed
