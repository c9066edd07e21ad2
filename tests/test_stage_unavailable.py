"""A staging the object store did not answer is Unavailable, end to end of the launcher's view (issue 77): the node's
fetch that ran out of tries for want of an answer says so on its error line, and stage_cluster raises Unavailable
when every failed node said that, so a managed run's handover waits and stages again (recovery.Recovery.patiently,
tests/test_fault_matrix.py) rather than failing; damaged bytes, a refusal or a node's own error stay final."""

from __future__ import annotations

import pytest

from appliance import data
from appliance.cluster import Cluster, Node
from appliance.errors import ApplianceError, Unavailable
from appliance.node import fetch
from appliance.node.stage import stage
from appliance.protocol import Line, format_line
from fakes import DictStore, FakeRemote


class Silent(DictStore):
    """A store whose every GET goes unanswered (a 503 after its retries, a reset)."""

    def get(self, name, write, *, start=None, end=None) -> dict:
        raise ConnectionResetError("HTTP 503 Service Unavailable")


def test_a_node_that_could_not_fetch_for_want_of_an_answer_raises_unavailable_and_damage_does_not(tmp_path,
                                                                                                   monkeypatch):
    monkeypatch.setattr(fetch.time, "sleep", lambda s: None)  # the back-off between tries, not sat out
    with pytest.raises(Unavailable, match="could not fetch 'd/a.bin' after 2 tries"):
        stage(Silent({"d/a.bin": b"a"}), "d/", tmp_path / "out", retries=1, processes=1)
    damaged = DictStore({"d/a.bin": b"abc"})
    damaged.damage["d/a.bin"] = 5  # every GET arrives with its first byte flipped
    with pytest.raises(ApplianceError, match="could not fetch") as e:
        stage(damaged, "d/", tmp_path / "out2", retries=1, processes=1)
    assert not isinstance(e.value, Unavailable)  # not something a wait cures


def _cluster() -> Cluster:
    return Cluster(name="su", cloud="local", nodes=[Node("su-0", "10.0.0.1", "10.0.0.1", "/w"),
                                                    Node("su-1", "10.0.0.2", None, "/w")])


@pytest.mark.parametrize("second", [True, False], ids=["both-unanswered", "one-refused"])
def test_stage_cluster_is_unavailable_only_when_every_failed_node_found_the_store_silent(monkeypatch, second):
    said = {"su-0": {"message": "could not fetch 'd/a' after 5 tries (HTTP 503)", "fix": None, "unavailable": True},
            "su-1": {"message": "could not fetch 'd/a' after 5 tries (HTTP 503)" if second else
                     "not enough free space on /w", "fix": None, "unavailable": second}}

    class Nodes:
        def __init__(self, cluster, **kw):
            self.remotes = {n.name: FakeRemote(n, {"stage_main": (1, format_line(Line.ERROR, said[n.name]), "")})
                            for n in cluster.nodes}

        def __getitem__(self, name):
            return self.remotes[name]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False
    monkeypatch.setattr(data, "Session", Nodes)
    with pytest.raises(ApplianceError, match="staging failed on su-0") as e:
        data.stage_cluster(_cluster(), "swift://d/", "data", out=lambda line: None)
    assert isinstance(e.value, Unavailable) is second
