"""`appliance testbed|cloud|lease|image|doctor|watchdog`: the machines and the leases under a run."""

from __future__ import annotations

import sys

import click

from . import _cloud_opt, _json_opt, _default_cloud, _json_out, _messages, _site_opt, main


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
    from .. import flows

    with _messages(quiet=as_json):
        flows.testbed_up(name, nodes, slots=slots, mode=mode)
    st = flows.testbed_status(name)
    if as_json:
        _json_out(st)
    else:
        _print_testbed(st)


@testbed.command("down")
@click.option("--name", default="tb", show_default=True)
@_json_opt
def testbed_down(name, as_json):
    """Remove the testbed: its processes (by PID), namespaces, bridge and state. Safe to repeat."""
    from .. import flows

    with _messages(quiet=as_json):
        removed = flows.testbed_down(name)
    if as_json:
        _json_out({"name": name, "removed": removed})


@testbed.command("status")
@click.option("--name", default="tb", show_default=True)
@_json_opt
def testbed_status(name, as_json):
    """Show the testbed's nodes, addresses and whether each sshd answers. Exit 1 if a node is down."""
    from .. import flows

    st = flows.testbed_status(name)
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
# the local cloud


@main.group()
def cloud():
    """The local cloud: Keystone, Blazar, Nova, Neutron and Glance on 127.0.0.1, behaving like Chameleon.

    \b
    Its servers are testbed nodes; at a lease's end it deletes them, as Chameleon does.
    `cloud: local` in a spec starts it automatically; credentials are in its clouds.yaml
    (entry appliance-local), so the openstack CLI works against it too:
      OS_CLIENT_CONFIG_FILE=~/.appliance/localcloud/clouds.yaml OS_CLOUD=appliance-local openstack server list
    It has a second site, CHI@local2 (its own Keystone, hosts and credentials, entry appliance-local2 in
    ~/.appliance/localcloud-local2/clouds.yaml), as Chameleon has CHI@UC and CHI@TACC: it starts when first used
    (`--site CHI@local2`, or a spec that names it); both share one clock, and `stop` stops both.
    """


@cloud.command("start")
@click.option("--time-scale", default=1.0, show_default=True,
              help="Cloud seconds per real second (60: a 1 h lease ends in 1 min).")
@click.option("--hosts", type=click.IntRange(1, 64), default=None,
              help="compute_local hosts Blazar can lease (default 4; each server is a testbed node).")
@click.option("--site", default=None, metavar="SITE", help="CHI@local (the default) or CHI@local2.")
@click.option("--clean-seconds", type=click.FloatRange(0), default=None,
              help="Real seconds a node is cleaned after its server is deleted, unschedulable meanwhile, as Ironic "
                   "cleans Chameleon's (default 2).")
@click.option("--su-budget", type=click.FloatRange(0), default=None,
              help="The project's SUs: a lease that would spend more is refused, as Chameleon's portal refuses "
                   "it (default: not enforced).")
@click.option("--json", "as_json", is_flag=True, help="Print the cloud's status as JSON.")
def cloud_start(time_scale, hosts, site, clean_seconds, su_budget, as_json):
    """Start the local cloud (no-op if it runs)."""
    from .. import flows

    with _messages(quiet=as_json):
        st = flows.cloud_start(time_scale=time_scale, hosts=hosts, site=site, clean_seconds=clean_seconds,
                               su_budget=su_budget)
    _json_out(st) if as_json else click.echo(f"local cloud at {st['endpoint']}, clock {st.get('now')} UTC")


@cloud.command("stop")
@_json_opt
def cloud_stop(as_json):
    """Stop the local cloud; its servers (testbed nodes) are deleted."""
    from .. import flows

    with _messages(err=as_json):
        ran = flows.cloud_stop()
    if as_json:
        _json_out({"stopped": ran})


@cloud.command("status")
@click.option("--site", default=None, metavar="SITE", help="CHI@local (the default) or CHI@local2.")
@_json_opt
def cloud_status(site, as_json):
    """Whether the local cloud runs, where, and its clock. Exit 1 if it is not running."""
    from .. import flows

    st = flows.cloud_status(site)
    if as_json:
        _json_out(st)
    elif st["running"]:
        click.echo(f"local cloud {st['site']} running at {st['endpoint']} (pid {st['pid']}), clock {st['now']} UTC "
                   f"x{st['time_scale']:g}; clouds.yaml {st['clouds_yaml']} (entry {st['cloud']})")
    else:
        click.echo(f"local cloud {st['site']} not running (start it with `appliance cloud start"
                   + (f" --site {st['site']}`)" if site else "`)"))
    if not st["running"]:
        sys.exit(1)



@main.group()
def lease():
    """Blazar leases: create, show, list, extend, delete.

    \b
    Chameleon's rules apply: at most 7 days; an active lease can be extended only within
    48 h of its end, by at most 7 days past it. Dates are UTC.
    """


def _print_lease(d: dict) -> None:
    left = f", {d['seconds_left'] // 3600}h{d['seconds_left'] % 3600 // 60:02d}m left" if "seconds_left" in d else ""
    click.echo(f"{d['name']}  {d['id']}  {d['status']}  {d['start']} -> {d['end']}{left}"
               f"\n  reservation (for Nova): {d['reservation_id']}")


@lease.command("create")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--start", default="now", show_default=True, help="'now' or 'YYYY-MM-DD HH:MM' (UTC).")
@_json_opt
def lease_create(spec, start, as_json):
    """Reserve the spec's nodes (nodes.count x nodes.node_type) for lease.duration."""
    from .. import flows

    with _messages(quiet=as_json):
        d = flows.lease_create(spec, start=start)
    _json_out(d) if as_json else _print_lease(d)


@lease.command("show")
@click.argument("lease_id")
@_cloud_opt
@_site_opt
@_json_opt
def lease_show(lease_id, cloud_kind, site, as_json):
    """Status, dates, time left and the reservation id of one lease."""
    from .. import flows

    with _messages(err=True):
        d = flows.lease("show", lease_id, cloud=cloud_kind or _default_cloud(), site_name=site)
    _json_out(d) if as_json else _print_lease(d)


@lease.command("list")
@_cloud_opt
@_site_opt
@_json_opt
def lease_list(cloud_kind, site, as_json):
    """Your leases on the site."""
    from .. import flows

    with _messages(err=True):
        items = flows.lease("list", cloud=cloud_kind or _default_cloud(), site_name=site)
    if as_json:
        _json_out(items)
    else:
        for d in items:
            _print_lease(d)
        if not items:
            click.echo("no leases")


@lease.command("extend")
@click.argument("lease_id")
@click.option("--by", default=None, help="Duration to add, e.g. 1d, 12h.")
@click.option("--to", "to", default=None, help="New end 'YYYY-MM-DD HH:MM' (UTC).")
@_cloud_opt
@_site_opt
@_json_opt
def lease_extend(lease_id, by, to, cloud_kind, site, as_json):
    """Move the lease's end (an absolute end date is sent). Refused outside the 48 h window, with when it opens."""
    from .. import flows

    with _messages(err=True):
        d = flows.lease("extend", lease_id, by=by, to=to, cloud=cloud_kind or _default_cloud(), site_name=site)
    _json_out(d) if as_json else _print_lease(d)


@lease.command("delete")
@click.argument("lease_id")
@_cloud_opt
@_site_opt
@click.option("--yes", is_flag=True, help="Do not ask.")
@_json_opt
def lease_delete(lease_id, cloud_kind, site, yes, as_json):
    """Delete a lease: its servers are deleted with it."""
    from .. import flows

    if not yes:
        click.confirm(f"delete lease {lease_id} and every server on it?", abort=True, err=as_json)
    with _messages(err=True):
        ok = flows.lease("delete", lease_id, cloud=cloud_kind or _default_cloud(), site_name=site)
    if as_json:
        _json_out({"id": lease_id, "deleted": ok})
    else:
        click.echo(f"lease {lease_id} deleted" if ok else f"no lease {lease_id} (already gone)")



@main.group()
def image():
    """The appliance image: a GPU training stack on Chameleon's CC-Ubuntu24.04-CUDA (docs/image.md).

    \b
      make image                                    # build it with diskimage-builder
      appliance image upload build/appliance-gpu.qcow2 --name appliance-gpu --site CHI@UC
    Then `image: appliance-gpu` in your spec. Or stay on the stock image: `appliance up SPEC --install`.
    """


@image.command("upload")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--name", required=True, help="Glance image name, e.g. appliance-gpu.")
@click.option("--disk-format", type=click.Choice(["qcow2", "raw"]), default=None,
              help="Default: from the file name (.qcow2, .raw/.img).")
@_cloud_opt
@_site_opt
@_json_opt
def image_upload_cmd(path, name, disk_format, cloud_kind, site, as_json):
    """Upload a built image to the site's Glance (private). Re-running with the same file is a no-op."""
    from .. import flows

    with _messages(err=as_json):
        img = flows.image_upload(path, name, cloud=cloud_kind or _default_cloud(), site_name=site,
                                 disk_format=disk_format)
    if as_json:
        _json_out(img)
    else:
        click.echo(f"image {img['name']} ({img['id']}): {img['status']}, {img['size']} bytes, md5 {img['checksum']}")


@main.command("doctor")
@click.option("--cluster", default=None, help="Check every node of this cluster over SSH (default: this machine).")
@click.option("--python", "python", default=None, help="The venv's Python to check (default: this one).")
@click.option("--etc", default=None, help="The node's appliance config dir (default: $APPLIANCE_ETC or /etc/appliance).")
@click.option("--no-allreduce", is_flag=True, help="Skip the 2-rank horovodrun allreduce (~10 s).")
@click.option("--gpu", is_flag=True,
              help="Also check the stack on the GPUs (NCCL, every rank's allreduce, the benchmark, a bit-exact "
                   "resume) and write a report; minutes, the first thing to run on a GPU lease.")
@click.option("--report", "report_path", default=None, metavar="PATH",
              help="With --gpu: write the report here (.json, and .md beside it; default ~/.appliance/doctor/).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the checks as JSON (with --gpu: the whole report, its paths included).")
def doctor_cmd(cluster, python, etc, no_allreduce, gpu, report_path, as_json):
    """Is this node (or every node of a cluster) ready to train? One line per check, with the fix.

    \b
    Python, TensorFlow, tf-keras, Horovod (built with TensorFlow + Gloo; NCCL on GPU nodes), the NVIDIA
    driver, CUDA, NCCL, TensorFlow sees every GPU, a 2-rank allreduce, the NIC, firewalld's trusted peers.
    GPU checks are skipped on nodes without NVIDIA GPUs. Exit 1 if any check fails.
    \b
      appliance doctor                    # on a node, e.g. after `ssh cc@HEAD`
      appliance doctor --cluster digits   # every node of a cluster, from your machine
      appliance doctor --gpu --cluster digits   # and the GPU checks, with a report (docs/chameleon.md)
    """
    from .. import flows
    from ..node import doctor as dr

    if report_path and not gpu:
        raise click.UsageError("--report goes with --gpu")
    if gpu:
        with _messages(quiet=as_json):
            rep = flows.doctor_gpu(cluster, python, etc, allreduce=not no_allreduce, report_path=report_path,
                                   command="appliance doctor --gpu" + (f" --cluster {cluster}" if cluster else ""))
        _json_out(rep) if as_json else _print_gpu_report(rep)
        if rep["verdict"] == "fail":
            sys.exit(1)
        return
    per_node = flows.doctor(cluster, python, etc, allreduce=not no_allreduce)
    failed = any(c.status == "fail" for checks in per_node.values() for c in checks)
    if as_json:
        _json_out({node: dr.as_dicts(checks) for node, checks in per_node.items()})
    else:
        _print_checks(per_node)
    if failed:
        sys.exit(1)


def _print_checks(groups: dict[str, list]) -> None:
    from ..node import doctor as dr

    for node, checks in groups.items():
        click.echo(f"{node}:")
        for line in dr.format_checks(checks):
            click.echo(f"  {line}")


def _print_gpu_report(rep: dict) -> None:
    from ..node.doctor import Check

    groups = {name: [Check(**c) for c in node["checks"]] for name, node in rep["nodes"].items()}
    groups["every rank"] = [Check(**c) for c in rep["cluster_checks"]]
    _print_checks(groups)
    click.echo(f"{rep['verdict']} after {rep['seconds']:.0f} s; the report: {rep['report']['json']} "
               f"(readable: {rep['report']['markdown']})")


@main.command("watchdog")
@click.option("--node", "on_node", is_flag=True, required=True,
              help="Watch this node's lease end (Chameleon vendordata); the image runs this as a systemd unit.")
@click.option("--margin", default="10m", show_default=True, help="Act this long before the lease end.")
@click.option("--poll", default=60.0, show_default=True, help="Seconds between looks.")
@click.option("--once", is_flag=True, help="Look once and exit (prints the runs it asked to stop).")
@click.option("--json", "as_json", is_flag=True, help="With --once, print the runs it asked to stop as JSON.")
def watchdog_cmd(on_node, margin, poll, once, as_json):
    """On a node: before the lease ends, ask every running training job to stop with a committed checkpoint.

    \b
    `appliance train` watches the lease itself (and can extend it); this covers jobs whose launcher
    went away. It writes the job's STOP file; rank 0 stops every rank after the same step and commits.
    """
    from ..flows import node_watch
    from ..spec import duration_seconds

    try:
        margin_s = float(duration_seconds(margin))
    except Exception:
        raise click.BadParameter(f"{margin!r} is not a duration like 10m or 1h", param_hint="--margin") from None
    with _messages(err=as_json):
        stopped = node_watch(margin=margin_s, poll=poll, once=once)
    if as_json:
        _json_out({"stopped": stopped})
    elif once:
        click.echo(f"asked {len(stopped)} job(s) to stop" + (f": {', '.join(stopped)}" if stopped else ""))
