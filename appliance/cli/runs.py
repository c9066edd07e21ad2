"""`appliance run|ls|logs|resume|cancel`: a run across its jobs and leases."""

from __future__ import annotations

import copy

import click

from ..errors import ApplianceError
from . import _cloud_opt, _default_cloud, _json_opt, _json_out, _messages, _site_opt, main
from .views import _report, format_breakdown, format_ettr, format_stream, format_timeline


@main.command("logs")
@click.argument("run")
@click.option("--cluster", default=None, help="The cluster the job runs on (default: the run's, from its record).")
@click.option("-n", "--lines", default=50, show_default=True, type=click.IntRange(min=0), help="Show the last N lines first (0: all of them).")
@click.option("-f", "--follow", is_flag=True, help="Keep showing new lines until the job ends (Ctrl-C stops "
              "following, not the job).")
@click.option("--url", default=None, help="A managed run's checkpoint URL: its output from the store, from any "
              "machine.")
@_cloud_opt
@_site_opt
@_json_opt
def logs_cmd(run, cluster, lines, follow, url, cloud_kind, site, as_json):
    """The output of RUN's newest job, read from the head node.

    \b
    A job runs detached on its head node and writes its output there
    (<workdir>/appliance/runs/RUN/JOB.out): it goes on when the `appliance train`
    that started it is gone (the network dropped, the laptop was closed). From any
    machine that has the cluster's record:
      appliance logs RUN -f          # the last 50 lines, then follow to the job's end
      appliance logs RUN -n 0        # the whole output so far
    Lines are shown as `appliance train` shows them ([rank|host] text); the
    last line says whether the job still runs, or its exit code. When the head
    node is gone (the lease ended, `appliance down`), this machine's copy of what
    `appliance train` showed is shown instead, and says so. A managed run
    (`appliance run`) keeps its newest job's output in its store as well:
      appliance logs RUN --url swift://ckpts/ -f   # from any machine
    """
    from .. import flows

    if as_json and follow:
        raise click.UsageError("--json prints the lines at hand; it cannot --follow")
    shown: list[str] = []
    try:
        with _messages(err=as_json):
            flows.logs(run, cluster, lines=lines, follow=follow, out=shown.append if as_json else click.echo, url=url,
                       cloud=cloud_kind or _default_cloud(), site_name=site)
    except KeyboardInterrupt:
        click.echo("stopped following; the job goes on", err=True)
    if as_json:
        _json_out({"run": run, "lines": shown})



@main.command("run")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--max-restarts", default=0, show_default=True, type=click.IntRange(min=0),
              help="Times in a row a job that failed (not for its lease) is resumed before the run fails.")
@click.option("-f", "--foreground", is_flag=True, help="Be the controller in this process (its output here; the run "
              "stops with Ctrl-C) instead of starting it detached.")
@click.option("--plan", "plan", is_flag=True, help="Book nothing: print the leases the run expects to need, their "
              "node-hours and SUs, and whether they keep to Chameleon's usage policy (lease stacking, hogging).")
@click.option("--for", "run_for", default=None, metavar="DURATION",
              help="With --plan: how long the training runs (30d, 72h); default: to limits.deadline, or "
                   "limits.node_hours, else one lease.")
@click.option("--json", "as_json", is_flag=True, help="Print the controller (or, with -f, the last job's summary; "
              "with --plan, the plan) as JSON.")
def run_cmd(spec, max_restarts, foreground, plan, run_for, as_json):
    """Run SPEC to its end across leases, with nobody at the lease ends.

    \b
    1. the run's own cluster (`appliance up`: a lease and servers, or the ones it has)
       and its dataset staged; or, when the run has committed work, a resume
    2. the job; before the lease ends it stops after a step with a committed checkpoint
    3. the cluster goes, a new lease and servers come up, the checkpoint is staged, and
       the job continues (bit-exact on the same world size); again at every lease end.
       With lease.extend the lease is extended first; with lease.overlap the next
       cluster is booted while the job trains (no boot in the downtime); without hosts,
       nodes.alternatives or the next free slot
    The run stops when a job finishes (exit 0), fails for another reason (after
    --max-restarts resumes of it), reaches a limit of the spec (limits: node_hours,
    deadline: each lease is cut to fit), or is cancelled. docs/managed.md says more.

    \b
    The run's controller is a process of its own, started here: this command returns
    once it holds the run, and closing the terminal or killing this shell leaves it
    running (keep the machine up: a lab server, a Chameleon KVM instance). It holds a
    Keystone application credential of its own, made here and deleted at the run's end,
    not yours. Its state is in the object store beside the checkpoints, so from any
    machine with the credentials:
      appliance ls RUN [--url URL]     the run, lease by lease, handovers and downtime,
                                         node-hours, the estimated finish
      appliance logs RUN -f [--url URL]  the job's output
      appliance cancel RUN [--url URL]   stop: a checkpoint, then the cluster goes
    If the controller's machine goes away, `appliance run SPEC` again (anywhere) continues
    the run once its controller lock is stale (5 minutes; at once on the same machine).

    \b
    Before you start: `appliance run SPEC --plan --for 30d` prints the leases it expects
    to book, their node-hours and SUs, and whether they keep to Chameleon's usage policy
    (without a credential: from a dated table of Chameleon's node types, and it says so).
    """
    from .. import flows

    if plan:
        from ..flows.plan import lines

        with _messages(err=as_json):
            p = flows.plan_run(spec, run_for=run_for)
        _json_out(p) if as_json else click.echo("\n".join(lines(p)))
        return
    if run_for:
        raise click.UsageError("--for goes with --plan")
    if not foreground:
        with _messages(err=as_json):
            d = flows.start_managed(spec, max_restarts=max_restarts)
        if as_json:
            _json_out(d)
            return
        click.echo(f"run {d['run']}: controller started (pid {d['pid']}); its output: {d['log']}")
        own = d.get("credential")
        click.echo(f"  its credential: its own ({own['credential'][:8]}, expires {own['expires']} UTC), deleted at the "
                   "run's end" if own else "  its credential: yours (Keystone would not make it one)")
        click.echo(f"  watch: appliance ls {d['run']}   |   appliance logs {d['run']} -f")
        click.echo(f"  stop:  appliance cancel {d['run']}")
        return
    with _messages(err=as_json):
        res = flows.run_managed(spec, max_restarts=max_restarts,
                                out=(lambda line: click.echo(line, err=True)) if as_json else None)
    _report(res, as_json, done={"spec": spec, "complete": True})


@main.command("cancel")
@click.argument("run")
@click.option("--url", default=None, help="The run's checkpoint URL, when this machine has no record of RUN.")
@_cloud_opt
@_site_opt
@click.option("--json", "as_json", is_flag=True, help="Print the controller asked, as JSON.")
def cancel_cmd(run, url, cloud_kind, site, as_json):
    """Stop the managed run RUN (`appliance run`), from any machine.

    The run's controller, wherever it runs, sees the request within ~15 s, and the
    job's head node within ~15 s too (the stop request in the store): the job saves a
    checkpoint at its next step and stops, and the run's cluster goes (its lease with
    it). A job that does not answer within two heartbeats of its lock loses its lease.
    `appliance run SPEC` later continues the run from that checkpoint.
    """
    from .. import flows

    with _messages(err=as_json):
        d = flows.cancel_run(run, url=url, cloud=cloud_kind or _default_cloud(), site_name=site)
    if as_json:
        _json_out(d)
    else:
        job = f"job {d['job']}" if d.get("job") else "the job"
        click.echo(f"run {run}: asked its controller ({d['host']} pid {d['pid']}) to cancel it: {job} stops with a "
                   "checkpoint and the cluster goes (`appliance ls RUN` shows when)".replace("RUN", run))


@main.command("resume")
@click.argument("run")
@click.option("--spec", "spec_path", default=None, type=click.Path(dir_okay=False),
              help="The run's spec (default: the one recorded when it started, or the copy beside its checkpoints).")
@click.option("--cluster", default=None, help="Resume on this existing cluster instead of the run's own.")
@click.option("--nodes", type=int, default=None, help="Resume on this many nodes (the spec's resize policy applies).")
@click.option("--url", default=None, help="Checkpoint URL, to find the spec when this machine has no record of RUN.")
@_cloud_opt
@_site_opt
@click.option("--json", "as_json", is_flag=True, help="Print the job summary as JSON.")
def resume_cmd(run, spec_path, cluster, nodes, url, cloud_kind, site, as_json):
    """Continue RUN from its newest committed checkpoint, on a new lease if needed.

    \b
    1. the newest committed checkpoint that matches its manifest (older ones if not, said so)
    2. a cluster: the run's own if its lease still runs, else a new lease + servers
    3. the dataset and the checkpoint staged to every node, verified
    4. the job, restored: same world size = bit-exact continuation; another world size
       continues with the spec's checkpoint.resize policy (lr or batch) and says so
    Exit codes as `appliance train`: 0 done, 75 stopped again before a lease end (resume again).
    """
    from .. import flows

    with _messages(err=as_json):
        res = flows.resume(run, spec_path=spec_path, cluster_name=cluster, nodes=nodes, url=url,
                           cloud=cloud_kind or _default_cloud(), site_name=site,
                           out=(lambda line: click.echo(line, err=True)) if as_json else None)
    _report(res, as_json, done={"run": run, "complete": True})



@main.command("ls")
@click.argument("run", required=False)
@click.option("--plot", "plot_png", is_flag=False, flag_value="", default=None, metavar="[PNG]",
              help="With RUN: draw its loss/accuracy over the global step, every job on one axis, resumes marked "
                   "(default ~/.appliance/runs/RUN/metrics.png).")
@click.option("--url", default=None, help="With RUN: the run's checkpoint URL, to show a managed run's timeline on a "
              "machine that has no record of RUN.")
@_cloud_opt
@_site_opt
@click.option("--json", "as_json", is_flag=True, help="Print the runs as JSON.")
def runs_cmd(run, plot_png, url, cloud_kind, site, as_json):
    """List runs (RUN: one run in detail): status, step, last checkpoint, lease left, node-hours.

    \b
    status: running | stopped (resumable: `appliance resume RUN`) | complete | failed; a managed run
    (`appliance run`) shows its controller's: running | handover | parked | finished | limit | cancelled |
    stopped | failed, or "no controller" when this machine's controller was killed mid-run (`appliance run SPEC`
    again takes it over)
    Two meters, on two clocks:
      training node-hours (TRAIN NODE-H): nodes x the wall time of the run's jobs, by this machine's clock;
      lost: the part of it after the last commit of a job that then failed (redone on resume);
      leased node-hours (a managed run, `appliance ls RUN`): nodes x the time of every lease the run holds,
      by the cloud's clock, "spent" so far and "booked ahead": what Chameleon charges, in SUs = node-hours x the
      node type's su_factor (`appliance run SPEC --plan` shows it), and what limits.node_hours caps.
    `appliance ls RUN` lists the run's jobs, and for each resume its downtime by phase (lease, boot,
    SSH + contextualize, staging, Horovod start, restore, first step); for a managed run
    (`appliance run`), its controller and timeline: each lease, job and handover, and its ETTR: the
    share of its time spent on steps committed and kept, and what took the rest (handovers by phase,
    waits for hosts, lost steps), on the controller's clock (docs/managed.md).
    `appliance ls RUN --plot` draws the run's metrics from its newest committed checkpoint.
    """
    from ..flows import list_runs, plot_run

    if plot_png is not None:
        if not run:
            raise click.UsageError("--plot needs a RUN: `appliance ls RUN --plot`")
        d = plot_run(run, plot_png or None)
        if as_json:
            _json_out(d)
        else:
            click.echo(f"wrote {d['png']}: {', '.join(d['metrics'])} over steps {d['steps']}, resumed at "
                       f"{d['resumed_at'] or 'no resume'}")
            for p in d["step_axis_problems"]:
                click.echo(f"warning: the step axis restarts: {p}")
        return
    if run:  # one run: its row, then every job (steps, how it ended, a resume's downtime by phase)
        from ..flows import run_details, run_ettr

        d = run_details(run)
        tl = _timeline(run, url, cloud_kind, site) if url or (d and d.get("managed")) else None
        if d is None and tl is None:
            raise ApplianceError(f"no record of run {run!r} on this machine",
                                 "`appliance ls` lists the runs; `--url URL` reads a managed run's from its store")
        e = run_ettr(tl, (d or {}).get("jobs")) if tl is not None else None
        if as_json:
            _json_out({**(d or {"run": run}), **({"timeline": tl, "ettr": e} if tl is not None else {})})
            return
        for line in [*format_timeline(tl), *(format_ettr(e) if e else [])] if tl is not None else []:
            click.echo(line)
        if d is None:
            return
        click.echo(f"run {d['run']}: {d['status']}, step {d['step']}, last checkpoint {d['last_checkpoint'] or '-'}, "
                   f"{d['node_hours_used']:.3f} training node-hours, {d['node_hours_lost']:.3f} lost")
        for i, j in enumerate(d["jobs"], 1):
            steps = f"steps {j.get('first_step') or 0}..{j['last_step'] if j.get('last_step') is not None else '?'}"
            click.echo(f"  job {i} {j['job_id']}: {j.get('status')}, {steps} on {j.get('nodes')} node(s)"
                       + (f": {j['failure']}" if j.get("failure") else ""))
            if j.get("resume_breakdown"):
                click.echo(f"    downtime {format_breakdown(j['resume_breakdown'])}")
            if j.get("stream"):
                click.echo(f"    input    {format_stream(j['stream'])}")
        return
    rows = list_runs()
    if as_json:
        _json_out(rows)
        return
    if not rows:
        click.echo("no runs yet (start one with `appliance train SPEC`)")
        return

    def age(v):
        if v is None:
            return "-"
        v = int(v)
        return f"{v}s" if v < 120 else (f"{v // 60}m" if v < 7200 else f"{v // 3600}h{(v % 3600) // 60:02d}m")

    click.echo(f"{'RUN':<20} {'STATUS':<9} {'STEP':>7} {'CHECKPOINT':<16} {'AGE':>6} {'LEASE LEFT':>10} "
               f"{'TRAIN NODE-H':>12} {'LOST':>6}")
    for r in rows:
        click.echo(f"{r['run']:<20} {r['status']:<9} {r['step']:>7} {r['last_checkpoint'] or '-':<16} "
                   f"{age(r['checkpoint_age_s']):>6} {age(r['lease_left_s']):>10} {r['node_hours_used']:>12.3f} "
                   f"{r['node_hours_lost']:>6.3f}")


runs_alias = copy.copy(runs_cmd)  # `appliance runs`: the name `ls` had, one letter from `run` (cli/__init__.py)
runs_alias.hidden = True


def _timeline(run: str, url, cloud_kind, site) -> dict | None:
    """A managed run's state from its store; a store that does not answer is said, not fatal."""
    from ..flows import timeline

    try:
        return timeline(run, url=url, cloud=cloud_kind or _default_cloud(), site_name=site)
    except ApplianceError as e:
        if url:
            raise
        click.echo(f"(the managed run's timeline was not read: {e})", err=True)
        return None
