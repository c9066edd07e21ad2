"""The `appliance` command line. Thin: each verb parses its arguments and calls one library function.

The verbs live by theme: infra.py (testbed, local cloud, leases, images, doctor, watchdog), steps.py (up, status,
down, check, stage, data, train, bench), runs.py (run, runs, logs, resume, cancel); views.py formats results.

Errors the user can act on are printed as one line, `error: WHAT (fix: HOW)`, with a non-zero
exit code (2 for a bad spec or bad arguments).
"""

from __future__ import annotations

import json
import sys

import click

from .. import __version__, report
from ..errors import ApplianceError


def _json_out(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


def _messages(err: bool = False, quiet: bool = False):
    """Where the library's messages (appliance.report) go while a verb runs: the terminal by default (main sets
    it); stderr with ``err`` (under --json, so stdout holds only the JSON); nowhere with ``quiet`` (verbs whose
    JSON says it all)."""
    return report.to(None if quiet else (lambda m: click.echo(m, err=True)) if err else click.echo)


# `appliance --help` lists the verbs by what they are for, each with its whole first sentence
SECTIONS = (
    ("Before a lease", ("check", "bench", "doctor")),
    ("Runs longer than a lease (a controller leases again at each end)", ("run", "ls", "cancel", "logs")),
    ("One cluster, by hand", ("up", "status", "stage", "train", "resume", "down", "adopt")),
    ("Data, leases and images at a site", ("data", "lease", "image")),
    ("This machine: the local cloud and the testbed", ("cloud", "testbed")),
)
EXIT_CODES = ("Exit codes: 0 done; 1 an error of the cloud, the store or the job (one line: `error: WHAT (fix: HOW)`); "
              "2 a bad spec or bad arguments; 75 the job stopped before a lease end with a checkpoint (`appliance "
              "resume RUN` continues it); `train` and `resume` exit with the job's own code when it fails.")


class _Group(click.Group):
    def format_commands(self, ctx, formatter):
        if ctx.parent is not None:  # a group under main (data, lease, ...): click's plain list
            return super().format_commands(ctx, formatter)
        cmds = {n: c for n in self.list_commands(ctx) if (c := self.get_command(ctx, n)) is not None and not c.hidden}
        listed = {n for _, names in SECTIONS for n in names}
        for title, names in SECTIONS + (("Other", tuple(n for n in cmds if n not in listed)),):
            rows = [(n, cmds[n].get_short_help_str(limit=200)) for n in names if n in cmds]
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)
        formatter.write_paragraph()
        formatter.write_text(EXIT_CODES)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except ApplianceError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException, KeyboardInterrupt):
            raise
        except Exception as e:  # anything else: one line, the traceback only with --debug
            if ctx.params.get("debug"):
                raise
            first = (str(e).strip().splitlines() or [""])[0][:300]
            click.echo(f"error: {type(e).__name__}: {first} (fix: run again with `appliance --debug ...` for the "
                       "traceback, and report it if it is not about your input)", err=True)
            sys.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="appliance")
@click.option("--debug", is_flag=True, help="On an unexpected error, show the Python traceback.")
def main(debug):
    """Train Horovod/Keras jobs on leased GPU nodes (Chameleon Cloud), or on a local testbed.

    \b
    The flow: spec -> lease -> cluster -> stage -> train -> checkpoint -> resume.
    Start here (the local cloud stands in for Chameleon; `cloud: chameleon` + OS_CLOUD for the real one):
      appliance up examples/digits.yaml        # lease, 2 servers, floating IP, SSH, contextualize
      appliance stage examples/digits.yaml     # the dataset to every node's local disk
      appliance train examples/digits.yaml     # horovodrun on the head node, every rank streamed
      appliance status digits                  # lease time left, nodes
      appliance down digits                    # servers, floating IP, lease: gone
    Longer than a lease, with nobody at its end: `appliance run examples/digits.yaml`.
    Without any cloud: `appliance testbed up --nodes 2`, then `appliance train SPEC`.
    Before spending a lease: `appliance bench SPEC` (throughput, scaling); is a node ready: `appliance doctor`.
    Your own script on Chameleon, from a laptop: docs/quickstart.md, with examples/chameleon.yaml.
    """
    if not debug:  # the clients' own warnings (keystoneauth's version discovery) before our one-line error
        import logging

        for name in ("keystoneauth", "openstack"):
            logging.getLogger(name).setLevel(logging.ERROR)
    click.get_current_context().with_resource(_messages())  # each verb's messages to the terminal, until it ends



# ---------------------------------------------------------------------------------------------
# leases


def _default_cloud() -> str:
    import os

    return "chameleon" if os.environ.get("OS_CLOUD") or os.environ.get("OS_AUTH_URL") else "local"


_cloud_opt = click.option("--cloud", "cloud_kind", type=click.Choice(["chameleon", "local"]), default=None,
                          help="Default: chameleon if OS_CLOUD or OS_AUTH_URL is set, else local.")
_site_opt = click.option("--site", default=None, help="Chameleon site (region), e.g. CHI@UC or CHI@TACC.")
_json_opt = click.option("--json", "as_json", is_flag=True,
                         help="Print the result as JSON: stdout holds only the JSON (messages go to stderr).")



# ---------------------------------------------------------------------------------------------
# clusters


def _cluster_name(name_or_spec: str) -> str:
    if name_or_spec.endswith((".yaml", ".yml")):
        from ..sites import load_spec

        return load_spec(name_or_spec).name
    return name_or_spec




from . import infra, runs, steps  # noqa: E402,F401 - each registers its verbs on main
main.add_command(runs.runs_alias, "runs")  # noqa: E402 - the old name of `ls`, kept for scripts; hidden from help
from .views import _report, format_breakdown, format_progress, format_summary, format_timeline  # noqa: E402,F401
