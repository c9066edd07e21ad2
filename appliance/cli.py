"""The `appliance` command line. Thin: each verb parses its arguments and calls one library function.

Errors the user can act on are printed as one line, `error: WHAT (fix: HOW)`, with a non-zero
exit code (2 for a bad spec or bad arguments).
"""

from __future__ import annotations

import json
import sys

import click

from . import __version__
from .errors import ApplianceError


def _json_out(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


def _quiet(_msg: str) -> None:
    pass


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except ApplianceError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="appliance")
def main():
    """Train Horovod/Keras jobs on leased GPU nodes (Chameleon Cloud), or on a local testbed.

    \b
    The flow: spec -> lease -> cluster -> stage -> train -> checkpoint -> resume.
    Start here:
      appliance testbed up --nodes 2           # two local nodes (netns + sshd)
      appliance train examples/digits.yaml     # train across them with horovodrun
      appliance testbed down                   # remove everything the testbed made
    """


# ---------------------------------------------------------------------------------------------
# testbed


@main.group()
def testbed():
    """Local test nodes: network namespaces, each with its own hostname, /etc/hosts, disk and sshd."""


@testbed.command("up")
@click.option("--nodes", "-n", default=2, show_default=True, help="How many nodes.")
@click.option("--slots", default=1, show_default=True, help="Horovod ranks per node.")
@click.option("--name", default="tb", show_default=True, help="Testbed name (1-6 letters/digits).")
@click.option("--mode", type=click.Choice(["auto", "netns", "single-host"]), default="auto", show_default=True,
              help="netns needs root; auto falls back to single-host (all slots here, no SSH) and says so.")
@click.option("--json", "as_json", is_flag=True, help="Print the testbed as JSON.")
def testbed_up(nodes, slots, name, mode, as_json):
    """Bring up N nodes. Idempotent: a healthy testbed of that size is left as it is.

    \b
    Example:
      appliance testbed up --nodes 2
      ssh -i ~/.appliance/testbeds/tb/id_ed25519 \\
          -o UserKnownHostsFile=~/.appliance/testbeds/tb/known_hosts root@10.77.0.11
    """
    from . import testbed as tbm

    tbm.up(name, nodes, slots=slots, mode=mode, log=_quiet if as_json else click.echo)
    st = tbm.status(name)
    if as_json:
        _json_out(st)
    else:
        _print_testbed(st)


@testbed.command("down")
@click.option("--name", default="tb", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def testbed_down(name, as_json):
    """Remove the testbed: its processes (by PID), namespaces, bridge and state. Safe to repeat."""
    from . import testbed as tbm

    removed = tbm.down(name, log=_quiet if as_json else click.echo)
    if as_json:
        _json_out({"name": name, "removed": removed})


@testbed.command("status")
@click.option("--name", default="tb", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def testbed_status(name, as_json):
    """Show the testbed's nodes, addresses and whether each sshd answers. Exit 1 if a node is down."""
    from . import testbed as tbm

    st = tbm.status(name)
    if as_json:
        _json_out(st)
    else:
        _print_testbed(st)
    if st["nodes"] and not st["up"]:
        sys.exit(1)


def _print_testbed(st: dict) -> None:
    if not st["nodes"]:
        click.echo(f"testbed {st['name']}: not up (start one with `appliance testbed up`)")
        return
    click.echo(f"testbed {st['name']}: {st['mode']}" + (f" ({st['reason']})" if st.get("reason") else "")
               + (f", bridge {st['bridge']}" if st.get("bridge") else ""))
    for n in st["nodes"]:
        click.echo(f"  {n['name']:<8} {n['ip']:<14} {n['state']:<5} slots={n['slots']}  disk={n['disk']}")


# ---------------------------------------------------------------------------------------------
# spec and training


@main.command("check")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True)
def check_spec(spec, as_json):
    """Validate a run spec; print it as the appliance understands it. Exit 2 if invalid."""
    import dataclasses

    from .spec import load_spec

    s = load_spec(spec)
    if as_json:
        _json_out(dataclasses.asdict(s))
    else:
        click.echo(f"{spec}: ok: run {s.name!r} on {s.cloud}, {s.nodes.count} x {s.nodes.node_type}, "
                   f"{s.world_size} rank(s)")


@main.command("train")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--cluster", default=None, help="Cluster to use (default: the run's own, or the local testbed).")
@click.option("--json", "as_json", is_flag=True, help="Print the job summary as JSON (rank output still streams to stderr).")
def train_cmd(spec, cluster, as_json):
    """Run the spec's training job across the cluster with horovodrun, from the head node.

    \b
    Every rank's output streams back as `[rank|host] line`. The exit code is the job's.
    If a rank crashes or a node dies the job is stopped (within ~30 s) and the message
    names the rank and node. The full log is kept under ~/.appliance/runs/RUN/.
    """
    from .train.launch import check, train_spec

    out = (lambda line: click.echo(line, err=True)) if as_json else None
    res = train_spec(spec, cluster, out=out, log=(lambda m: click.echo(m, err=True)) if as_json else click.echo)
    summary = job_summary(res)
    if as_json:
        _json_out(summary)
    else:
        click.echo("")
        for line in format_summary(summary):
            click.echo(line)
    check(res)


def job_summary(res) -> dict:
    r0 = res.results.get(0, {})
    return {
        "job_id": res.job_id, "exit_code": res.exit_code, "failure": res.failure,
        "ranks": res.world_size, "nodes": sorted(set(res.rank_hosts)), "hostnames_reported": res.hostnames,
        "ranks_reported": sorted(res.results), "epochs": r0.get("epochs"),
        "val_accuracy": r0.get("val_accuracy"),
        "same_weights_on_all_ranks": len({r.get("weights_sha256") for r in res.results.values()}) == 1
        if res.results else None,
        "wall_seconds": round(res.wall_s, 1), "log": res.log_path,
    }


def format_summary(s: dict) -> list[str]:
    ok = s["exit_code"] == 0
    lines = [f"== {'done' if ok else 'FAILED'}: job {s['job_id']} =="]
    lines.append(f"  nodes     {len(s['nodes'])} ({', '.join(s['nodes'])})")
    lines.append(f"  ranks     {s['ranks']} (reported from {', '.join(s['hostnames_reported']) or 'none'})")
    if s.get("epochs") is not None:
        lines.append(f"  epochs    {s['epochs']}")
    if s.get("val_accuracy") is not None:
        lines.append(f"  accuracy  {s['val_accuracy']:.4f} (validation)")
    if s.get("same_weights_on_all_ranks") is not None:
        lines.append(f"  weights   {'identical on all ranks' if s['same_weights_on_all_ranks'] else 'DIFFER between ranks'}")
    lines.append(f"  wall time {s['wall_seconds']:.1f} s")
    lines.append(f"  log       {s['log']}")
    if not ok:
        lines.append(f"  failure   {s['failure']}")
    lines += ["", "next:", "  appliance testbed status     # the nodes", "  appliance testbed down       # remove them"]
    return lines


if __name__ == "__main__":  # pragma: no cover
    main()
