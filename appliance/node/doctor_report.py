"""The report of `appliance doctor --gpu`: one JSON file and its readable Markdown beside it, to attach to a question.

It holds every check of every node (status, detail, fix, seconds, the numbers behind it), each node's versions,
GPUs and nvidia-smi output, the cluster-wide checks (every rank's NCCL allreduce, the benchmark on 1 GPU and on
all), and the timings.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from .doctor import Check

FORMAT = 1  # the report's layout; a reader checks it


def build(nodes: dict[str, tuple[list[Check], dict]], cluster_checks: list[Check], *, cluster: str | None,
          command: str, seconds: float) -> dict:
    """The report: ``nodes`` maps each node to its checks and its info (appliance/node/gpudoctor.py node_info)."""
    every = [c for checks, _ in nodes.values() for c in checks] + cluster_checks
    return {
        "format": FORMAT, "command": command, "cluster": cluster,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "verdict": "fail" if any(c.status == "fail" for c in every) else "pass",
        "failed": [c.name for c in every if c.status == "fail"],
        "seconds": round(seconds, 1),
        "nodes": {name: {"checks": [asdict(c) for c in checks], "info": info}
                  for name, (checks, info) in nodes.items()},
        "cluster_checks": [asdict(c) for c in cluster_checks],
    }


def _cell(text) -> str:
    return str(text if text is not None else "").replace("|", "\\|").replace("\n", " ")


def _table(checks: list[dict]) -> list[str]:
    lines = ["| status | check | detail | seconds |", "|---|---|---|---|"]
    for c in checks:
        detail = c["detail"] + (f" (fix: {c['fix']})" if c.get("fix") else "")
        lines.append(f"| {c['status']} | {_cell(c['name'])} | {_cell(detail)} | {_cell(c.get('seconds'))} |")
    return lines


def markdown(rep: dict) -> str:
    """The report as Markdown: the verdict, each node's checks and versions, nvidia-smi, the cluster's checks."""
    out = [f"# appliance doctor --gpu: {rep['verdict'].upper()}", "",
           f"`{rep['command']}`, {rep['created']}, {rep['seconds']} s"
           + (f", cluster {rep['cluster']}" if rep.get("cluster") else ""), ""]
    if rep["failed"]:
        out += [f"Failed: {', '.join(rep['failed'])}.", ""]
    for name, node in rep["nodes"].items():
        info = node["info"]
        out += [f"## Node {name}", ""] + _table(node["checks"]) + [""]
        versions = info.get("versions", {})
        if versions:
            out += ["| version of | |", "|---|---|"] + [f"| {k} | {_cell(v)} |" for k, v in versions.items()] + [""]
        for key, title in (("nvidia_smi", "nvidia-smi"), ("nvidia_smi_topology", "nvidia-smi topo -m")):
            if info.get(key):
                out += [f"{title}:", "", "```", info[key].rstrip(), "```", ""]
    if rep["cluster_checks"]:
        out += ["## Every rank", ""] + _table(rep["cluster_checks"]) + [""]
    return "\n".join(out)


def write(rep: dict, path: Path) -> tuple[Path, Path]:
    """Write the report to ``path`` (.json) and its Markdown beside it (.md); returns both paths."""
    path = Path(path)
    path = path if path.suffix == ".json" else path.with_name(path.name + ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    md = path.with_suffix(".md")
    path.write_text(json.dumps(rep, indent=1, default=str) + "\n")
    md.write_text(markdown(rep) + "\n")
    return path, md
