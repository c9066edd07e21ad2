"""One reporter (appliance.report): library code says, the entry point chooses where it goes (issue 15, item 8)."""

from __future__ import annotations

import json
import threading

from click.testing import CliRunner

from appliance import report
from appliance.cli import main

log = report.get("appliance.tests")


def test_messages_go_to_the_sink_chosen_and_the_one_before_comes_back():
    outer, inner = [], []
    log.info("before any sink: nowhere")  # library use without a sink stays quiet
    with report.to(outer.append):
        log.info("one")
        with report.to(inner.append):
            log.info("two")
        log.info("three")
    log.info("after: nowhere")
    assert outer == ["one", "three"] and inner == ["two"]


def test_a_thread_a_step_starts_reports_to_the_same_sink():
    said = []
    with report.to(said.append):
        t = threading.Thread(target=lambda: log.info("from a worker"))
        t.start()
        t.join()
    assert said == ["from a worker"]


def test_muted_and_prefixed_act_on_the_calling_thread_only():
    said = []
    with report.to(said.append):
        with report.prefixed("[resume] "):
            log.info("checkpoint ckpt-2 is corrupted")
            with report.muted():
                log.info("hidden")
                t = threading.Thread(target=lambda: log.info("a worker is not muted"))
                t.start()
                t.join()
        log.info("plain")
    assert said == ["[resume] checkpoint ckpt-2 is corrupted", "a worker is not muted", "plain"]


def test_node_side_default_leaves_a_sink_already_chosen_in_place():
    import logging

    said, node = [], []
    root = logging.getLogger(report.ROOT)
    before = list(root.handlers)
    with report.to(said.append):
        report.default(node.append)  # a Checkpointer made inside a test: the test's sink stays
        log.info("x")
    assert said == ["x"] and node == []
    assert root.handlers == before


def test_the_cli_prints_messages_and_under_json_only_json_on_stdout(tmp_path):
    src = tmp_path / "d"
    src.mkdir()
    (src / "a.bin").write_bytes(b"x" * 10)
    url = f"file://{tmp_path / 'store'}/"
    r = CliRunner().invoke(main, ["data", "upload", str(src), url])
    assert r.exit_code == 0, r.output
    assert "uploaded 1 file(s)" in r.stdout  # the library's message, through the CLI's sink
    r = CliRunner().invoke(main, ["data", "pack", str(src), url + "packed/", "--json"])
    assert r.exit_code == 0, r.output
    json.loads(r.stdout)  # nothing but the JSON (the pack's own line is not printed under --json)
    assert "packed" not in r.stderr
    r = CliRunner().invoke(main, ["data", "ls", url, "--json"])
    assert r.exit_code == 0, r.output
    assert {o["name"] for o in json.loads(r.stdout)} >= {"a.bin"}
