"""`appliance check` on a few hundred generated malformed specs: one line, exit 2, never a traceback (issue 14,
item 11). In process (click's runner), so it runs in the fast tier."""

import copy
import math
import random

import yaml
from click.testing import CliRunner

from appliance.cli import main
from conftest import ROOT

GOOD = {"name": "fz", "cloud": "local", "nodes": {"count": 2, "node_type": "compute_local", "slots": 1},
        "lease": {"duration": "2h", "stop_margin": "5m", "extend": False},
        "dataset": {"source": "swift://data/x/", "dest": "data", "mode": "full"},
        "train": {"code": str(ROOT / "examples" / "digits"), "command": "python train.py", "env": {"A": "1"},
                  "start_timeout": 60},
        "checkpoint": {"url": "swift://ckpts/", "every_steps": 10, "every_minutes": 5, "keep": 3, "resize": "lr"}}
BAD_VALUES = [None, "", ".", "..", "./", "x\n", "data\n", -1, 0, 10**12, 1e308, math.nan, math.inf, True, [], {},
              "999999999999d", "1w", "/etc", "a" * 300, "swift://", "s3://b/\x01", ".ssh", ".ssh/x", "data/../..",
              "http://x/", "file://relative", "CHI@Mars", "gpu_mars", "OS_PASSWORD", {"OS_TOKEN": "x"}, "lr\n",
              "p//q", "-", 3.5, "7d\n", "\x00"]


def leaves(d, path=()):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from leaves(v, path + (k,))
        yield path + (k,)


def mutate(rng: random.Random):
    spec = copy.deepcopy(GOOD)
    for _ in range(rng.randint(1, 3)):
        path = rng.choice(list(leaves(spec)))
        parent = spec
        for k in path[:-1]:
            parent = parent[k] if isinstance(parent.get(k), dict) else {}
        how = rng.random()
        if how < 0.7:
            parent[path[-1]] = rng.choice(BAD_VALUES)
        elif how < 0.85:
            parent.pop(path[-1], None)
        else:
            parent[path[-1] + "_typo"] = 1
    return spec


def test_malformed_specs_get_one_line_exit_2_and_no_traceback(tmp_path):
    rng = random.Random(14)
    runner = CliRunner()
    errors = 0
    for i in range(300):
        data = mutate(rng) if i % 50 else rng.choice([[1, 2], "just text", 42, None])
        p = tmp_path / f"s{i}.yaml"
        p.write_text(yaml.safe_dump(data))
        r = runner.invoke(main, ["check", str(p)])
        out = r.output.strip()
        assert "Traceback" not in out and not (r.exception and not isinstance(r.exception, SystemExit)), \
            (data, out, r.exception)
        assert r.exit_code in (0, 2), (data, r.exit_code, out)
        assert len(out.splitlines()) == 1, (data, out)
        if r.exit_code == 2:
            errors += 1
            assert out.startswith("error: ") and "(fix: " in out, (data, out)
    assert errors >= 250, errors  # nearly all of them are malformed


def test_the_cases_the_review_found(tmp_path):
    runner = CliRunner()
    cases = [("dataset", "dest", "."), ("dataset", "dest", ""), ("dataset", "dest", ".ssh"),
             ("lease", "duration", "999999999999d"), ("checkpoint", "every_minutes", math.nan),
             ("nodes", "count", 10**9), ("nodes", "node_type", "gpu_mars"), ("train", "code", "/nonexistent"),
             ("checkpoint", "url", "swift:/x"), (None, "name", "fz\n")]
    for section, key, value in cases:
        data = copy.deepcopy(GOOD)
        (data[section] if section else data)[key] = value
        p = tmp_path / "s.yaml"
        p.write_text(yaml.safe_dump(data))
        r = runner.invoke(main, ["check", str(p)])
        assert r.exit_code == 2, (section, key, value, r.output)
        field = f"{section}.{key}" if section else key
        assert r.output.startswith("error: ") and f": {field}: " in r.output, (field, r.output)
