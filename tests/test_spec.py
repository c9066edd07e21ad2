"""Spec parsing and validation: every problem is one line naming the field and the fix, exit code 2."""

import subprocess
import sys
from pathlib import Path

import pytest

from appliance.errors import SpecError
from appliance.sites import load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[1]
GOOD = {"name": "digits", "train": {"command": "python train.py"}}


def test_example_spec_is_valid():
    s = load_spec(ROOT / "examples" / "digits.yaml")
    assert s.name == "digits" and s.cloud == "local"
    assert s.nodes.count == 2 and s.world_size == 2
    assert s.code_dir == (ROOT / "examples" / "digits").resolve()
    assert len(s.digest) == 16


def test_the_chameleon_example_is_valid():
    s = load_spec(ROOT / "examples" / "chameleon.yaml")
    assert s.cloud == "chameleon" and s.nodes.node_type.startswith("gpu_") and s.checkpoint.url
    assert s.code_dir == (ROOT / "examples" / "digits").resolve()


def test_a_stream_cache_is_a_size():
    from appliance.spec import parse_size

    s = parse_spec({**GOOD, "dataset": {"source": "swift://data/p", "mode": "stream", "cache": "150GB"}})
    assert parse_size(s.dataset.cache) == 150 * 10**9 and parse_size("1.5 GiB") == 3 * 2**29


def test_a_mix_of_streams_and_a_validation_stream_keep_the_single_dataset_form():
    """dataset.source stays one packed dataset; dataset.streams is a weighted mix (MosaicML Streaming's proportion,
    repeat or choose), named by its URLs' last parts unless named; dataset.validation a stream of its own."""
    from appliance.spec import stream_names

    one = parse_spec({**GOOD, "dataset": {"source": "swift://data/p/", "mode": "stream"}}).dataset
    assert one.urls() == [("dataset.source", "swift://data/p/")] and one.streams == () and one.validation is None
    ds = parse_spec({**GOOD, "dataset": {"mode": "stream", "cache": "10GB", "streams": [
        {"source": "swift://data/web/", "proportion": 0.7}, {"source": "s3://books-1/v1/", "name": "books",
                                                            "proportion": 0.3}],
        "validation": {"source": "swift://data/val/", "cache": "1GB"}}}).dataset
    assert ds.source is None and [s.proportion for s in ds.streams] == [0.7, 0.3] and stream_names(ds) == ["web",
                                                                                                          "books"]
    assert ds.urls() == [("dataset.streams[0]", "swift://data/web/"), ("dataset.streams[1]", "s3://books-1/v1/"),
                         ("dataset.validation.source", "swift://data/val/")]
    same = parse_spec({**GOOD, "dataset": {"mode": "stream", "streams": [{"source": "swift://aa1/v1/"},
                                                                        {"source": "swift://bb1/v1/"}]}}).dataset
    assert stream_names(same) == ["v1-0", "v1-1"]


def test_defaults_fill_in():
    s = parse_spec(GOOD)
    assert s.nodes.slots == 1 and s.checkpoint.keep == 3 and s.dataset is None


STREAMS = {"mode": "stream", "streams": [{"source": "swift://data/a/", "proportion": 0.5},
                                        {"source": "swift://data/b/", "proportion": 0.5}]}


@pytest.mark.parametrize("data, field, words", [
    ({**GOOD, "nodez": {}}, "nodez", "unknown key"),
    ({**GOOD, "nodes": {"count": "two"}}, "nodes.count", "expected an integer"),
    ({**GOOD, "nodes": {"count": 0}}, "nodes.count", "at least 1"),
    ({**GOOD, "nodes": {"cont": 2}}, "nodes.cont", "unknown key"),
    ({"name": "x"}, "train", "missing required field"),
    ({**GOOD, "train": {}}, "train.command", "missing required field"),
    ({**GOOD, "cloud": "aws"}, "cloud", "one of 'local', 'chameleon'"),
    ({**GOOD, "name": "Bad Name"}, "name", "not a valid run name"),
    ({**GOOD, "lease": {"duration": "1w"}}, "lease.duration", "not a duration"),
    ({**GOOD, "cloud": "chameleon", "lease": {"duration": "8d"}}, "lease.duration", "7-day"),
    # the local cloud follows Chameleon's cap: `check` says what `up` would be told (issue 51)
    ({**GOOD, "lease": {"duration": "30d"}}, "lease.duration", "7-day"),
    ({**GOOD, "cloud": "chameleon", "site": "CHI@Mars"}, "site", "CHI@UC"),
    # a Chameleon spec does not inherit the local cloud's node type and image (issue 61)
    ({**GOOD, "cloud": "chameleon", "key_name": "k", "image": "appliance-gpu"}, "nodes.node_type", "local cloud's"),
    ({**GOOD, "cloud": "chameleon", "key_name": "k", "nodes": {"node_type": "gpu_rtx_6000"}}, "image",
     "local cloud's"),
    ({**GOOD, "train": {"command": "x", "env": {"OS_PASSWORD": "p"}}}, "train.env", "credential"),
    ({**GOOD, "train": {"command": "x", "env": {"MY_API_TOKEN": "p"}}}, "train.env", "credential"),
    ({**GOOD, "train": {"command": "x", "env": ["A=1"]}}, "train.env", "mapping"),
    # issue 49: keys went unquoted into the horovodrun shell line
    ({**GOOD, "train": {"command": "x", "env": {"A;touch /tmp/x;B": "1"}}}, "train.env", "not an environment"),
    ({**GOOD, "train": {"command": "x", "env": {"A\nB": "1"}}}, "train.env", "not an environment"),
    ({**GOOD, "train": {"command": "x", "env": {"1A": "1"}}}, "train.env", "not an environment"),
    # a fragment or query was silently dropped: the job used another prefix than the one written
    ({**GOOD, "checkpoint": {"url": "swift://ckpts/run#frag/"}}, "checkpoint.url", "'?' or '#'"),
    ({**GOOD, "dataset": {"source": "s3://data-sets/x?versionId=1"}}, "dataset.source", "'?' or '#'"),
    ({**GOOD, "dataset": {"source": "http://x/y"}}, "dataset.source", "swift://"),
    ({**GOOD, "dataset": {"source": "swift://data/p", "dest": "../etc"}}, "dataset.dest", "relative path"),
    ({**GOOD, "dataset": {"source": "swift://data/p", "mode": "half"}}, "dataset.mode", "one of"),
    ({**GOOD, "dataset": {"source": "swift://data/p", "cache": "10GB"}}, "dataset.cache", "only stream mode"),
    ({**GOOD, "dataset": {"source": "swift://data/p", "mode": "stream", "cache": "lots"}}, "dataset.cache",
     "not a size"),
    ({**GOOD, "dataset": {"source": "swift://data/p", "mode": "stream", "cache": "0GB"}}, "dataset.cache",
     "holds nothing"),
    ({**GOOD, "checkpoint": {"keep": 0}}, "checkpoint.keep", "at least 1"),
    # several streams (issue 78 item 3): a mix as MosaicML Streaming weights one, a validation stream
    ({**GOOD, "dataset": {"mode": "stream"}}, "dataset.source", "missing required field"),
    ({**GOOD, "dataset": {**STREAMS, "source": "swift://data/p/"}}, "dataset.streams", "given with dataset.source"),
    ({**GOOD, "dataset": {**STREAMS, "mode": "full"}}, "dataset.streams", "only stream mode"),
    ({**GOOD, "dataset": {"source": "swift://data/p/", "validation": {"source": "swift://data/v/"}}},
     "dataset.validation", "only stream mode"),
    ({**GOOD, "dataset": {**STREAMS, "streams": "swift://data/a/"}}, "dataset.streams", "a list of mappings"),
    ({**GOOD, "dataset": {**STREAMS, "streams": [{"source": "swift://data/a/", "weight": 2}]}},
     "dataset.streams[0].weight", "unknown key"),
    ({**GOOD, "dataset": {**STREAMS, "streams": [{"proportion": 1}]}}, "dataset.streams[0].source",
     "missing required field"),
    ({**GOOD, "dataset": {**STREAMS, "streams": [STREAMS["streams"][0], {"source": "http://x/"}]}},
     "dataset.streams[1]", "not a swift://"),
    ({**GOOD, "dataset": {**STREAMS, "streams": [STREAMS["streams"][0], {"source": "swift://data/b/", "repeat": 2}]}},
     "dataset.streams[1]", "weight every stream the same way"),
    ({**GOOD, "dataset": {**STREAMS, "streams": [{"source": "swift://data/a/", "repeat": 2, "choose": 9}]}},
     "dataset.streams[0]", "both repeat and choose"),
    ({**GOOD, "dataset": {**STREAMS, "streams": [{"source": "swift://data/a/", "proportion": -1}]}},
     "dataset.streams[0].proportion", "positive number"),
    ({**GOOD, "dataset": {**STREAMS, "streams": [{"source": "swift://data/a/", "name": "a/b"}]}},
     "dataset.streams[0].name", "not a name"),
    ({**GOOD, "dataset": {**STREAMS, "streams": [{"source": "swift://data/a/", "name": "x"},
                                                 {"source": "swift://data/b/", "name": "x"}]}},
     "dataset.streams", "two are named 'x'"),
    ({**GOOD, "dataset": {**STREAMS, "cache": "1GB", "validation": {"source": "swift://data/v/", "cache": "2GB"}}},
     "dataset.validation.cache", "not less than dataset.cache"),
    ({**GOOD, "dataset": {**STREAMS, "validation": {"source": "swift://data/v/", "cache": "lots"}}},
     "dataset.validation.cache", "not a size"),
    # a bucket or container Chameleon's RGW refuses to make: every checkpoint commit of the job would fail
    ({**GOOD, "checkpoint": {"url": "s3://My_Checkpoints/"}}, "checkpoint.url", "lower-case letters"),
    ({**GOOD, "checkpoint": {"url": "s3://ck/"}}, "checkpoint.url", "3-63 characters"),
    ({**GOOD, "checkpoint": {"url": "s3://ckpt..runs/"}}, "checkpoint.url", "no '.' next to"),
    ({**GOOD, "checkpoint": {"url": "s3://10.0.0.1/"}}, "checkpoint.url", "IP address"),
    ({**GOOD, "checkpoint": {"url": "swift://ck/"}}, "checkpoint.url", "3-255 characters"),
    ({**GOOD, "dataset": {"source": "s3://Data_Sets/imagenet/"}}, "dataset.source", "lower-case letters"),
    ({**GOOD, "lease": {"extend": "yes"}}, "lease.extend", "true or false"),
    # a warm handover's next cluster must be up before the job stops (stop_margin before the end)
    ({**GOOD, "lease": {"overlap": "5m"}}, "lease.overlap", "not longer than lease.stop_margin"),
    ({**GOOD, "lease": {"overlap": "4h"}}, "lease.overlap", "not shorter than lease.duration"),
    ({**GOOD, "lease": {"overlap": "half an hour"}}, "lease.overlap", "not a duration"),
    ({**GOOD, "lease": {"book_ahead": "1m"}}, "lease.book_ahead", "shorter than 5m"),
    ({**GOOD, "notify": "http://hooks.example.org/T0/secret"}, "notify", "in the clear"),
    ({**GOOD, "nodes": {"alternatives": "gpu_rtx_6000"}}, "nodes.alternatives", "a list of node types"),
    ({**GOOD, "nodes": {"alternatives": [{"site": "CHI@TACC"}]}}, "nodes.alternatives[0].node_type",
     "missing required field"),
    ({**GOOD, "nodes": {"alternatives": [{"node_type": "x", "zone": "a"}]}}, "nodes.alternatives[0].zone",
     "unknown key"),
    ({**GOOD, "lease": {"wait": "forever"}}, "lease.wait", "not a duration"),
    ({**GOOD, "train": {"command": "x", "requirements": "../reqs.txt"}}, "train.requirements", "file in train.code"),
    ({**GOOD, "train": {"command": "x", "requirements": "/etc/passwd"}}, "train.requirements", "file in train.code"),
    (["not", "a", "mapping"], "spec", "expected a mapping"),
])
def test_bad_specs_name_the_field_and_the_fix(data, field, words):
    with pytest.raises(SpecError) as ei:
        parse_spec(data)
    msg = str(ei.value)
    assert msg.startswith(field), msg
    assert words in msg, msg
    assert "(fix: " in msg, msg
    assert "\n" not in msg
    assert ei.value.exit_code == 2


def test_invalid_yaml_names_the_line(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("name: x\ntrain:\n  command: [unclosed\n")
    with pytest.raises(SpecError, match=r"line \d+ is not valid YAML"):
        load_spec(p)


def test_missing_file(tmp_path):
    with pytest.raises(SpecError, match="no such spec file"):
        load_spec(tmp_path / "nope.yaml")


def test_cli_exit_code_2_and_one_line(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("name: x\nnodes: {count: two}\ntrain: {command: python t.py}\n")
    r = subprocess.run([sys.executable, "-m", "appliance.cli", "check", str(p)], capture_output=True, text=True)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and "nodes.count" in lines[0] and "fix:" in lines[0]


def test_cli_check_ok():
    from click.testing import CliRunner

    from appliance.cli import main

    r = CliRunner().invoke(main, ["check", str(ROOT / "examples" / "digits.yaml")])
    assert r.exit_code == 0, r.output
    assert "2 rank(s)" in r.stdout


def test_check_finds_a_requirements_file_that_is_not_in_the_code(tmp_path):
    from appliance import flows

    (tmp_path / "code").mkdir()
    spec = tmp_path / "s.yaml"
    spec.write_text("name: r\ntrain: {code: code, command: python t.py, requirements: requirements.txt}\n")
    with pytest.raises(SpecError) as e:
        flows.check(str(spec))
    assert "train.requirements: no file requirements.txt" in str(e.value)
    (tmp_path / "code" / "requirements.txt").write_text("tabulate\n")
    assert flows.check(str(spec)).train.requirements == "requirements.txt"
