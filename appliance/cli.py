"""The `appliance` command line. Thin: each verb parses its arguments and calls one library function.

Errors the user can act on are printed as one line, `error: WHAT (fix: HOW)`, with a non-zero
exit code (2 for a bad spec or bad arguments).
"""

from __future__ import annotations

import json
import sys

import click

from . import __version__, report
from .errors import ApplianceError


def _json_out(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


def _messages(err: bool = False, quiet: bool = False):
    """Where the library's messages (appliance.report) go while a verb runs: the terminal by default (main sets
    it); stderr with ``err`` (under --json, so stdout holds only the JSON); nowhere with ``quiet`` (verbs whose
    JSON says it all)."""
    return report.to(None if quiet else (lambda m: click.echo(m, err=True)) if err else click.echo)


class _Group(click.Group):
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
    """
    if not debug:  # the clients' own warnings (keystoneauth's version discovery) before our one-line error
        import logging

        for name in ("keystoneauth", "openstack"):
            logging.getLogger(name).setLevel(logging.ERROR)
    click.get_current_context().with_resource(_messages())  # each verb's messages to the terminal, until it ends


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
    from . import flows

    with _messages(quiet=as_json):
        flows.testbed_up(name, nodes, slots=slots, mode=mode)
    st = flows.testbed_status(name)
    if as_json:
        _json_out(st)
    else:
        _print_testbed(st)


@testbed.command("down")
@click.option("--name", default="tb", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def testbed_down(name, as_json):
    """Remove the testbed: its processes (by PID), namespaces, bridge and state. Safe to repeat."""
    from . import flows

    with _messages(quiet=as_json):
        removed = flows.testbed_down(name)
    if as_json:
        _json_out({"name": name, "removed": removed})


@testbed.command("status")
@click.option("--name", default="tb", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def testbed_status(name, as_json):
    """Show the testbed's nodes, addresses and whether each sshd answers. Exit 1 if a node is down."""
    from . import flows

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
    """


@cloud.command("start")
@click.option("--time-scale", default=1.0, show_default=True,
              help="Cloud seconds per real second (60: a 1 h lease ends in 1 min).")
@click.option("--hosts", type=click.IntRange(1, 64), default=None,
              help="compute_local hosts Blazar can lease (default 4; each server is a testbed node).")
@click.option("--json", "as_json", is_flag=True)
def cloud_start(time_scale, hosts, as_json):
    """Start the local cloud (no-op if it runs)."""
    from . import flows

    with _messages(quiet=as_json):
        st = flows.cloud_start(time_scale=time_scale, hosts=hosts)
    _json_out(st) if as_json else click.echo(f"local cloud at {st['endpoint']}, clock {st.get('now')} UTC")


@cloud.command("stop")
def cloud_stop():
    """Stop the local cloud; its servers (testbed nodes) are deleted."""
    from . import flows

    flows.cloud_stop()


@cloud.command("status")
@click.option("--json", "as_json", is_flag=True)
def cloud_status(as_json):
    """Whether the local cloud runs, where, and its clock. Exit 1 if it is not running."""
    from . import flows

    st = flows.cloud_status()
    if as_json:
        _json_out(st)
    elif st["running"]:
        click.echo(f"local cloud running at {st['endpoint']} (pid {st['pid']}), clock {st['now']} UTC "
                   f"x{st['time_scale']:g}; clouds.yaml {st['clouds_yaml']}")
    else:
        click.echo("local cloud not running (start it with `appliance cloud start`)")
    if not st["running"]:
        sys.exit(1)


# ---------------------------------------------------------------------------------------------
# leases


def _default_cloud() -> str:
    import os

    return "chameleon" if os.environ.get("OS_CLOUD") or os.environ.get("OS_AUTH_URL") else "local"


_cloud_opt = click.option("--cloud", "cloud_kind", type=click.Choice(["chameleon", "local"]), default=None,
                          help="Default: chameleon if OS_CLOUD or OS_AUTH_URL is set, else local.")
_site_opt = click.option("--site", default=None, help="Chameleon site (region), e.g. CHI@UC or CHI@TACC.")


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
@click.option("--json", "as_json", is_flag=True)
def lease_create(spec, start, as_json):
    """Reserve the spec's nodes (nodes.count x nodes.node_type) for lease.duration."""
    from . import flows

    with _messages(quiet=as_json):
        d = flows.lease_create(spec, start=start)
    _json_out(d) if as_json else _print_lease(d)


@lease.command("show")
@click.argument("lease_id")
@_cloud_opt
@_site_opt
@click.option("--json", "as_json", is_flag=True)
def lease_show(lease_id, cloud_kind, site, as_json):
    """Status, dates, time left and the reservation id of one lease."""
    from . import flows

    d = flows.lease("show", lease_id, cloud=cloud_kind or _default_cloud(), site_name=site)
    _json_out(d) if as_json else _print_lease(d)


@lease.command("list")
@_cloud_opt
@_site_opt
@click.option("--json", "as_json", is_flag=True)
def lease_list(cloud_kind, site, as_json):
    """Your leases on the site."""
    from . import flows

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
@click.option("--json", "as_json", is_flag=True)
def lease_extend(lease_id, by, to, cloud_kind, site, as_json):
    """Move the lease's end (an absolute end date is sent). Refused outside the 48 h window, with when it opens."""
    from . import flows

    d = flows.lease("extend", lease_id, by=by, to=to, cloud=cloud_kind or _default_cloud(), site_name=site)
    _json_out(d) if as_json else _print_lease(d)


@lease.command("delete")
@click.argument("lease_id")
@_cloud_opt
@_site_opt
@click.option("--yes", is_flag=True, help="Do not ask.")
def lease_delete(lease_id, cloud_kind, site, yes):
    """Delete a lease: its servers are deleted with it."""
    from . import flows

    if not yes:
        click.confirm(f"delete lease {lease_id} and every server on it?", abort=True)
    ok = flows.lease("delete", lease_id, cloud=cloud_kind or _default_cloud(), site_name=site)
    click.echo(f"lease {lease_id} deleted" if ok else f"no lease {lease_id} (already gone)")


# ---------------------------------------------------------------------------------------------
# clusters


def _cluster_name(name_or_spec: str) -> str:
    if name_or_spec.endswith((".yaml", ".yml")):
        from .sites import load_spec

        return load_spec(name_or_spec).name
    return name_or_spec


@main.command("up")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--lease", "lease_id", default=None, help="Use this existing lease instead of creating one.")
@click.option("--install", is_flag=True,
              help="Install the training stack on every node (for stock CC-Ubuntu22.04-CUDA images; not needed "
                   "with the appliance image). Horovod's built wheel is cached in --wheel-cache.")
@click.option("--variant", type=click.Choice(["cpu", "gpu"]), default=None,
              help="With --install: default gpu for gpu_* node types, else cpu.")
@click.option("--wheel-cache", default=None, help="With --install: where built wheels are cached "
              "(default swift://appliance-wheels/).")
@click.option("--json", "as_json", is_flag=True)
def up_cmd(spec, lease_id, install, variant, wheel_cache, as_json):
    """Lease -> servers on the reservation -> floating IP on the head -> pinned host keys -> SSH -> contextualize.

    \b
    Idempotent and resumable: every step is recorded in the cluster's state file, so running it
    again after a failure makes only what is missing (servers in ERROR are replaced); after the
    lease has ended it makes a new lease.
    """
    from . import flows

    with _messages(err=as_json):
        cl = flows.up(spec, lease_id=lease_id, install=install, variant=variant, wheel_cache=wheel_cache)
    if as_json:
        import dataclasses

        _json_out(dataclasses.asdict(cl))


@main.command("adopt")
@click.argument("stack")
@click.option("--cloud", "cloud_kind", type=click.Choice(["chameleon", "local"]), default="chameleon",
              show_default=True, help="Where the stack is (local: the local cloud).")
@click.option("--site", default=None, help="CHI@UC or CHI@TACC (default: OS_REGION_NAME / clouds.yaml).")
@click.option("--key-name", default=None, help="The key pair the stack was launched with.")
@click.option("--key-file", default=None, help="Its private key here (default ~/.ssh/id_ed25519, then id_rsa).")
@click.option("--slots", type=int, default=1, show_default=True, help="Horovod ranks per node (GPUs per node).")
@click.option("--json", "as_json", is_flag=True)
def adopt_cmd(stack, cloud_kind, site, key_name, key_file, slots, as_json):
    """Take over a cluster launched from heat-templates/horovod-cluster.yaml (e.g. in Horizon).

    \b
    Reads the stack's outputs (head, workers, floating IP, reservation), finds the lease, pins every
    node's host key (each node publishes it at boot through Nova's server password), writes the cluster's state file and contextualizes it, so
    that `appliance train SPEC --cluster STACK`, `stage`, `status` and `resume` work on it.
    """
    from . import flows

    with _messages(err=as_json):
        cl = flows.adopt(stack, cloud=cloud_kind, site_name=site, key_name=key_name, key_file=key_file, slots=slots)
    if as_json:
        import dataclasses

        _json_out(dataclasses.asdict(cl))


@main.command("status")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
def status_cmd(name, as_json):
    """Lease time left, nodes and addresses of a cluster (NAME, or the SPEC that made it)."""
    from . import flows

    st = flows.status(_cluster_name(name))
    if as_json:
        _json_out(st)
        return
    left = st.get("seconds_left", 0)
    click.echo(f"cluster {st['name']} ({st['cloud']}): lease {st['lease_id']} {st['lease_status']}, "
               f"{left // 3600}h{left % 3600 // 60:02d}m left" + (f", FIP {st['floating_ip']}" if st['floating_ip'] else ""))
    for n in st["nodes"]:
        click.echo(f"  {n['name']:<16} {n['state']:<8} {n['private_ip']:<15} ssh via {n['address']}")
    if st.get("message"):
        click.echo(st["message"])


@main.command("down")
@click.argument("name")
@click.option("--yes", is_flag=True, help="Do not ask.")
def down_cmd(name, yes):
    """Delete a cluster's servers, release its floating IP, delete its lease (NAME, or its SPEC)."""
    from . import flows

    import time

    cname = _cluster_name(name)
    busy = "".join(f"; run {j['run']} has a job running on it (started "
                   f"{time.strftime('%H:%M', time.gmtime(j['started'] or 0))} UTC): its work since its last "
                   f"checkpoint would be lost (Ctrl-C in its `appliance train` saves a checkpoint and stops it)"
                   for j in flows.running_on(cname))
    if not yes:
        click.confirm(f"delete cluster {cname}: its servers (and their local disks) and its lease{busy}?",
                      abort=True)
    elif busy:
        click.echo(f"warning: {busy[2:]}", err=True)
    flows.down(cname)


# ---------------------------------------------------------------------------------------------
# spec and training


@main.command("check")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--online", is_flag=True,
              help="Also ask the object store: the dataset URL names objects, checkpoint.url is reachable.")
@click.option("--json", "as_json", is_flag=True)
def check_spec(spec, online, as_json):
    """Validate a run spec before a lease is paid for; print it as the appliance understands it.

    \b
    Checks the spec's fields, its site's rules (Chameleon: at most 7 days, CHI@UC or CHI@TACC, key_name; the local
    cloud: its node types and pool sizes) and the training code (train.code exists, small enough to copy).
    --online also asks the object store, with the site's credentials, what would otherwise be found only
    after the nodes boot: the dataset URL names objects (how many, how large), checkpoint.url is reachable and
    not refused, and whether the run already has committed checkpoints. It reads only.
    Exit 2 if the spec is invalid, 1 if the code is not usable or the store says no.

    \b
      appliance check my.yaml --online
    """
    import dataclasses

    from . import flows

    s = flows.check(spec)
    with _messages(err=True):
        found = flows.check_online(s) if online else None
    if as_json:
        _json_out({**dataclasses.asdict(s), **({"online": found} if online else {})})
        return
    click.echo(f"{spec}: ok: run {s.name!r} on {s.cloud}, {s.nodes.count} x {s.nodes.node_type}, "
               f"{s.world_size} rank(s)")
    if found and "dataset" in found:
        d = found["dataset"]
        click.echo(f"  dataset {d['url']}: {d['objects']:,} object(s), {d['size']}")
    if found and "checkpoint" in found:
        c = found["checkpoint"]
        if c["container"] != "there":
            said = "reachable; its container is not there yet (the first job makes it)"
        elif c["committed"]:
            said = (f"run {s.name!r} has {c['committed']} committed checkpoint(s), newest {c['newest']}: "
                    f"`appliance resume {s.name}` continues it (`appliance train` would refuse to start over it)")
        else:
            said = f"reachable, no checkpoint of run {s.name!r} yet"
        click.echo(f"  checkpoint.url {c['url']}: {said}")


@main.command("stage")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--cluster", default=None, help="Cluster to use (default: the run's own, or the local testbed).")
@click.option("--concurrency", default=16, show_default=True, help="Parallel transfers per node.")
@click.option("--keep-extra", is_flag=True,
              help="Keep files staged earlier whose objects are no longer in the store (default: remove them).")
@click.option("--json", "as_json", is_flag=True, help="Print each node's result as JSON.")
def stage_cmd(spec, cluster, concurrency, keep_extra, as_json):
    """Download the spec's dataset to every node's local disk, in parallel, verified, resumable.

    \b
    dataset.mode full: every node gets everything; shard: node r gets every n-th object (sorted
    names), so rank r's input pipeline reads only what is local. A re-run fetches only what is
    missing or changed (a manifest on each node), and removes files whose objects left the store
    (--keep-extra keeps them). Zero-byte `folder/` objects are directories. Names that would escape
    the destination or name one path twice are refused before anything is written. Free space is
    checked before starting.
    """
    from . import flows

    with _messages(err=as_json):
        res = flows.stage_spec(spec, cluster, concurrency=concurrency, keep_extra=keep_extra)
    if as_json:
        _json_out(res)


@main.group()
def data():
    """Object stores (swift://, s3://, file:// URLs): upload, ls, rm, and pack small files into shards."""


@data.command("upload")
@click.argument("src", type=click.Path(exists=True))
@click.argument("url")
@_cloud_opt
@_site_opt
@click.option("--segment-size", default=5 * 1024**3, show_default=True,
              help="Bytes; larger files become SLOs of segments this size (Swift caps one object at 5 GiB).")
def data_upload(src, url, cloud_kind, site, segment_size):
    """Upload a file or a directory tree to URL/<relative path>.

    \b
    Run it again after an interruption: files already at URL with the same size and MD5 are not sent again.
    """
    from . import flows

    flows.data_upload(src, url, cloud=cloud_kind or _default_cloud(), site_name=site, segment_size=segment_size)


@data.command("pack")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.argument("url")
@click.option("--shard-size", default=64 * 1024**2, show_default=True, help="Bytes per shard (about).")
@click.option("--format", "fmt", type=click.Choice(["tar", "tfrecord"]), default="tar", show_default=True,
              help="tar: WebDataset layout; tfrecord: one tf.train.Example per sample.")
@_cloud_opt
@_site_opt
@click.option("--json", "as_json", is_flag=True, help="Print the index.")
def data_pack(src, url, shard_size, fmt, cloud_kind, site, as_json):
    """Pack many small files into shards + index.json, uploaded in parallel (index last).

    \b
    Files sharing a key (the name up to the first dot: 0001.jpg, 0001.cls) form one sample and
    stay in one shard. Read them back with examples/packed/input_pipeline.py.
    """
    from . import flows

    with _messages(quiet=as_json):
        idx = flows.data_pack(src, url, shard_size=shard_size, fmt=fmt, cloud=cloud_kind or _default_cloud(),
                              site_name=site)
    if as_json:
        _json_out(idx)


@data.command("ls")
@click.argument("url")
@_cloud_opt
@_site_opt
@click.option("--json", "as_json", is_flag=True)
def data_ls(url, cloud_kind, site, as_json):
    """List objects under URL (every page: no 10,000-name cap)."""
    from . import flows

    with _messages(err=True):
        items = flows.data_list(url, cloud=cloud_kind or _default_cloud(), site_name=site)
    if as_json:
        _json_out(items)
    else:
        for o in items:
            click.echo(f"{o['size']:>12}  {o['etag']}  {o['name']}")
        click.echo(f"{len(items)} object(s), {sum(o['size'] for o in items)} bytes")


@data.command("rm")
@click.argument("url")
@_cloud_opt
@_site_opt
@click.option("--yes", is_flag=True)
def data_rm(url, cloud_kind, site, yes):
    """Delete every object under URL (SLO segments too)."""
    from . import flows

    if not yes:
        click.confirm(f"delete every object under {url}?", abort=True)
    with _messages(err=True):
        n = flows.data_remove(url, cloud=cloud_kind or _default_cloud(), site_name=site)
    click.echo(f"deleted {n} object(s)")


@main.command("train")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--cluster", default=None, help="Cluster to use (default: the run's own, or the local testbed).")
@click.option("--json", "as_json", is_flag=True, help="Print the job summary as JSON (rank output still streams to stderr).")
def train_cmd(spec, cluster, as_json):
    """Run the spec's training job across the cluster with horovodrun, from the head node.

    \b
    Every rank's output streams back as `[rank|host] line`. The exit code is the job's.
    Ctrl-C (with checkpoint.url): the job saves a checkpoint at its next step and stops, exit 75;
    `appliance resume RUN` continues it. A second Ctrl-C stops it at once.
    If a rank crashes or a node dies the job is stopped (within ~30 s) and the message
    names the rank and node. The full log is kept under ~/.appliance/runs/RUN/.
    """
    from . import flows

    out = (lambda line: click.echo(line, err=True)) if as_json else None
    with _messages(err=as_json):
        res = flows.train_spec(spec, cluster, out=out)
    _report(res, as_json)


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
def logs_cmd(run, cluster, lines, follow, url, cloud_kind, site):
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
    from . import flows

    try:
        flows.logs(run, cluster, lines=lines, follow=follow, out=click.echo, url=url,
                   cloud=cloud_kind or _default_cloud(), site_name=site)
    except KeyboardInterrupt:
        click.echo("stopped following; the job goes on", err=True)


def _report(res, as_json: bool, done: dict | None = None) -> None:
    """The job summary (text or JSON), then the job's exit code. ``res`` None: the run had finished already
    (nothing ran; with --json, ``done`` says so)."""
    from .flows import job_summary
    from .train.launch import check

    if res is None:
        if as_json:
            _json_out(done or {"complete": True})
        return
    summary = job_summary(res)
    if as_json:
        _json_out(summary)
    else:
        click.echo("")
        for line in format_summary(summary):
            click.echo(line)
    check(res)


@main.command("run")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--max-restarts", default=0, show_default=True, type=click.IntRange(min=0),
              help="Times in a row a job that failed (not for its lease) is resumed before the run fails.")
@click.option("-f", "--foreground", is_flag=True, help="Be the controller in this process (its output here; the run "
              "stops with Ctrl-C) instead of starting it detached.")
@click.option("--json", "as_json", is_flag=True, help="Print the controller (or, with -f, the last job's summary) "
              "as JSON.")
def run_cmd(spec, max_restarts, foreground, as_json):
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
      appliance runs RUN [--url URL]     the run, lease by lease, handovers and downtime,
                                         node-hours, the estimated finish
      appliance logs RUN -f [--url URL]  the job's output
      appliance cancel RUN [--url URL]   stop: a checkpoint, then the cluster goes
    If the controller's machine goes away, `appliance run SPEC` again (anywhere) continues
    the run once its controller lock is stale (5 minutes; at once on the same machine).
    """
    from . import flows

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
        click.echo(f"  watch: appliance runs {d['run']}   |   appliance logs {d['run']} -f")
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

    The run's controller, wherever it runs, sees the request within ~15 s: the job
    saves a checkpoint at its next step and stops, and the run's cluster goes (its
    lease with it). `appliance run SPEC` later continues the run from that checkpoint.
    """
    from . import flows

    with _messages(err=as_json):
        d = flows.cancel_run(run, url=url, cloud=cloud_kind or _default_cloud(), site_name=site)
    if as_json:
        _json_out(d)
    else:
        click.echo(f"run {run}: asked its controller ({d['host']} pid {d['pid']}) to cancel it: the job stops with a "
                   "checkpoint and the cluster goes (`appliance runs RUN` shows when)".replace("RUN", run))


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
    from . import flows

    with _messages(err=as_json):
        res = flows.resume(run, spec_path=spec_path, cluster_name=cluster, nodes=nodes, url=url,
                           cloud=cloud_kind or _default_cloud(), site_name=site,
                           out=(lambda line: click.echo(line, err=True)) if as_json else None)
    _report(res, as_json, done={"run": run, "complete": True})


def _command_line() -> str:
    """This command as typed (for result files: every number says the command that produced it)."""
    import shlex

    return "appliance " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _csv(kind):
    def parse(ctx, param, value):
        if value is None:
            return None
        try:
            return [kind(v.strip()) for v in value.split(",") if v.strip()]
        except ValueError:
            raise click.BadParameter(f"expected comma-separated {kind.__name__}s, got {value!r}") from None
    return parse


@main.command("bench")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--cluster", default=None, help="Cluster to use (default: the run's own, or the local testbed).")
@click.option("--models", default="cnn,mlp", show_default=True, callback=_csv(str),
              help="resnet50, cnn (CIFAR-sized), mlp (MNIST-sized), comma-separated.")
@click.option("--batch-sizes", default="16,32", show_default=True, callback=_csv(int), help="Per-rank batch sizes.")
@click.option("--nodes", default=None, callback=_csv(int),
              help="Node counts to run on, e.g. 1,2,4 (default: 1, powers of two, all).")
@click.option("--steps", default=20, show_default=True, help="Measured steps per cell.")
@click.option("--warmup", default=5, show_default=True, help="Unmeasured warm-up steps per cell.")
@click.option("--precision", type=click.Choice(["fp32", "mixed"]), default="fp32", show_default=True,
              help="mixed = float16 compute on GPUs (refused on CPU nodes).")
@click.option("--image-size", default=224, show_default=True, help="ResNet-50 input size (smaller = faster on CPU).")
@click.option("--overhead", is_flag=True,
              help="Instead: the same job through `appliance train` vs bare horovodrun on all nodes (ratio, goal >= 0.98).")
@click.option("--repeats", default=3, show_default=True, help="With --overhead: alternating runs of each path.")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="Results folder (default: ~/.appliance/runs/RUN-bench/TIME/).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (rank output goes to stderr).")
def bench_cmd(spec, cluster, models, batch_sizes, nodes, steps, warmup, precision, image_size, overhead, repeats,
              out_dir, as_json):
    """Measure training throughput on synthetic data before you spend a lease on it.

    \b
    Runs through the same path as `appliance train` (horovodrun on the head node), on 1..N nodes
    of SPEC's cluster. For every model x batch size: the measured aggregate samples/s (all ranks'
    samples / wall time between barriers), per-rank spread, speedup and scaling efficiency against
    1 node, and the allreduce share of a step. Writes bench.json, bench.md and PNG plots.
    \b
    Examples:
      appliance bench examples/digits.yaml                                   # testbed: cnn, mlp on 1, 2 nodes
      appliance bench my.yaml --models resnet50 --batch-sizes 8,16,32,64 --precision mixed   # GPU nodes
      appliance bench examples/digits.yaml --overhead --models cnn --batch-sizes 32
    On the CPU testbed every node shares this machine's cores: the numbers measure the path, not the hardware.
    """
    from pathlib import Path

    from . import flows
    from .bench import BenchConfig, report

    out = (lambda line: click.echo(line, err=True)) if as_json else None
    cfg = BenchConfig(models=models, batch_sizes=batch_sizes, nodes=nodes, steps=steps, warmup=warmup,
                      precision=precision, image_size=image_size)
    with _messages(err=as_json):
        rep = flows.bench(spec, cluster, cfg, overhead=overhead, repeats=repeats, out_dir=out_dir,
                          command=_command_line(), out=out)
    if overhead:
        if as_json:
            _json_out(rep)
        else:
            click.echo("")
            for line in report.overhead_lines(rep):
                click.echo(line)
        return
    if as_json:
        _json_out(rep)
        return
    click.echo("")
    if rep.get("note"):
        click.echo(f"note: {rep['note']}")
    for line in report.table(rep):
        click.echo(line)
    click.echo(f"\nresults: {rep['out_dir']}/bench.md, bench.json" + "".join(f", {Path(p).name}" for p in rep["plots"]))


@main.group()
def image():
    """The appliance image: a GPU training stack on Chameleon's CC-Ubuntu22.04-CUDA (docs/image.md).

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
@click.option("--json", "as_json", is_flag=True)
def image_upload_cmd(path, name, disk_format, cloud_kind, site, as_json):
    """Upload a built image to the site's Glance (private). Re-running with the same file is a no-op."""
    from . import flows

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
@click.option("--json", "as_json", is_flag=True)
def doctor_cmd(cluster, python, etc, no_allreduce, as_json):
    """Is this node (or every node of a cluster) ready to train? One line per check, with the fix.

    \b
    Python, TensorFlow, tf-keras, Horovod (built with TensorFlow + Gloo; NCCL on GPU nodes), the NVIDIA
    driver, CUDA, NCCL, TensorFlow sees every GPU, a 2-rank allreduce, the NIC, firewalld's trusted peers.
    GPU checks are skipped on nodes without NVIDIA GPUs. Exit 1 if any check fails.
    \b
      appliance doctor                    # on a node, e.g. after `ssh cc@HEAD`
      appliance doctor --cluster digits   # every node of a cluster, from your machine
    """
    from . import flows
    from .node import doctor as dr

    per_node = flows.doctor(cluster, python, etc, allreduce=not no_allreduce)
    failed = any(c.status == "fail" for checks in per_node.values() for c in checks)
    if as_json:
        _json_out({node: dr.as_dicts(checks) for node, checks in per_node.items()})
    else:
        for node, checks in per_node.items():
            click.echo(f"{node}:")
            for line in dr.format_checks(checks):
                click.echo(f"  {line}")
    if failed:
        sys.exit(1)


@main.command("watchdog")
@click.option("--node", "on_node", is_flag=True, required=True,
              help="Watch this node's lease end (Chameleon vendordata); the image runs this as a systemd unit.")
@click.option("--margin", default="10m", show_default=True, help="Act this long before the lease end.")
@click.option("--poll", default=60.0, show_default=True, help="Seconds between looks.")
@click.option("--once", is_flag=True, help="Look once and exit (prints the runs it asked to stop).")
def watchdog_cmd(on_node, margin, poll, once):
    """On a node: before the lease ends, ask every running training job to stop with a committed checkpoint.

    \b
    `appliance train` watches the lease itself (and can extend it); this covers jobs whose launcher
    went away. It writes the job's STOP file; rank 0 stops every rank after the same step and commits.
    """
    from .flows import node_watch
    from .spec import duration_seconds

    try:
        margin_s = float(duration_seconds(margin))
    except Exception:
        raise click.BadParameter(f"{margin!r} is not a duration like 10m or 1h", param_hint="--margin") from None
    stopped = node_watch(margin=margin_s, poll=poll, once=once)
    if once:
        _json_out({"stopped": stopped})


@main.command("runs")
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
    """List runs: status, step, last committed checkpoint and its age, lease time left, node-hours.

    \b
    status: running | stopped (resumable: `appliance resume RUN`) | complete | failed
    node-hours lost: node time spent after the last commit of a job that then failed.
    `appliance runs RUN` lists the run's jobs, and for each resume its downtime by phase (lease, boot,
    SSH + contextualize, staging, Horovod start, restore, first step); for a managed run
    (`appliance run`), its controller and timeline: each lease, job and handover.
    `appliance runs RUN --plot` draws the run's metrics from its newest committed checkpoint.
    """
    from .flows import list_runs, plot_run

    if plot_png is not None:
        if not run:
            raise click.UsageError("--plot needs a RUN: `appliance runs RUN --plot`")
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
        from .flows import run_details

        d = run_details(run)
        tl = _timeline(run, url, cloud_kind, site) if url or (d and d.get("managed")) else None
        if d is None and tl is None:
            raise ApplianceError(f"no record of run {run!r} on this machine",
                                 "`appliance runs` lists the runs; `--url URL` reads a managed run's from its store")
        if as_json:
            _json_out({**(d or {"run": run}), **({"timeline": tl} if tl is not None else {})})
            return
        for line in format_timeline(tl) if tl is not None else []:
            click.echo(line)
        if d is None:
            return
        click.echo(f"run {d['run']}: {d['status']}, step {d['step']}, last checkpoint {d['last_checkpoint'] or '-'}, "
                   f"{d['node_hours_used']:.3f} node-hours used, {d['node_hours_lost']:.3f} lost")
        for i, j in enumerate(d["jobs"], 1):
            steps = f"steps {j.get('first_step') or 0}..{j['last_step'] if j.get('last_step') is not None else '?'}"
            click.echo(f"  job {i} {j['job_id']}: {j.get('status')}, {steps} on {j.get('nodes')} node(s)"
                       + (f": {j['failure']}" if j.get("failure") else ""))
            if j.get("resume_breakdown"):
                click.echo(f"    downtime {format_breakdown(j['resume_breakdown'])}")
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
               f"{'NODE-H USED':>11} {'LOST':>6}")
    for r in rows:
        click.echo(f"{r['run']:<20} {r['status']:<9} {r['step']:>7} {r['last_checkpoint'] or '-':<16} "
                   f"{age(r['checkpoint_age_s']):>6} {age(r['lease_left_s']):>10} {r['node_hours_used']:>11.3f} "
                   f"{r['node_hours_lost']:>6.3f}")


def _timeline(run: str, url, cloud_kind, site) -> dict | None:
    """A managed run's state from its store; a store that does not answer is said, not fatal."""
    from .flows import timeline

    try:
        return timeline(run, url=url, cloud=cloud_kind or _default_cloud(), site_name=site)
    except ApplianceError as e:
        if url:
            raise
        click.echo(f"(the managed run's timeline was not read: {e})", err=True)
        return None


def format_timeline(tl: dict) -> list[str]:
    """A managed run's controller and its timeline, one line per lease, job end and handover."""
    import datetime as dt

    def at(t):
        return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%m-%d %H:%M:%S")

    c = tl.get("controller") or {}
    alive = (f"alive on {c.get('host')} pid {c.get('pid')} (heartbeat {tl.get('controller_heartbeat_age_s')}s ago)"
             if tl.get("controller_alive") else f"not running (last: {c.get('host')} pid {c.get('pid')})")
    out = [f"managed run {tl.get('run')}: {tl.get('status')}; controller {alive}", *format_progress(tl)]
    for e in tl.get("events") or []:
        kind = e.get("event")
        if kind == "job":
            hosts = e.get("hosts") or []
            ends = f", lease {str(e.get('lease_id'))[:8]} ends {str(e['lease_end'])[:16].replace('T', ' ')}" \
                if e.get("lease_end") else ""
            out.append(f"  {at(e['at'])} job {e.get('job_id')} {'resumed' if e.get('restore') else 'started'} on "
                       f"{len(hosts)} {e.get('node_type')} at {e.get('site')} ({', '.join(hosts)}){ends}")
        elif kind == "job end":
            why = "for the lease end" if e.get("lease_end") else f"exit {e.get('exit_code')}"
            out.append(f"  {at(e['at'])} job {e.get('job_id')} ended at step {e.get('step')}, {why}"
                       + (f": {e['failure']}" if e.get("failure") and not e.get("lease_end") else ""))
        elif kind == "downtime":
            out.append(f"  {at(e['at'])} handover: {format_breakdown(e.get('breakdown') or {})}")
        elif kind in ("controller", "cancel", "end"):
            what = {"controller": f"controller {e.get('id')}" + (" (took over)" if e.get("took_over") else "")
                    + (f", its credential expires {e['credential_expires']} UTC" if e.get("credential_expires") else ""),
                    "cancel": f"cancel asked from {e.get('by')}", "end": f"run {e.get('status')}"}[kind]
            out.append(f"  {at(e['at'])} {what}")
        elif kind == "waiting for hosts":
            out.append(f"  {at(e['at'])} no hosts free now: {e.get('node_type')} booked from {e.get('start')}, a wait of "
                       f"{e.get('wait_s', 0) / 60:.0f} min")
        elif kind == "hosts free":
            out.append(f"  {at(e['at'])} {e.get('node_type')} free after {e.get('waited_s')} s")
        elif kind == "lease extended":
            out.append(f"  {at(e['at'])} lease {str(e.get('lease_id'))[:8]} extended to {str(e.get('end'))[:16]}")
        elif kind in ("next lease", "next cluster ready", "next cluster failed", "no hosts", "parked", "stuck",
                      "extend refused", "no next lease", "limit"):
            detail = e.get("node_type") or e.get("error") or e.get("reason") or e.get("cluster") or ""
            out.append(f"  {at(e['at'])} {kind}" + (f": {detail}" if detail else ""))
    return out


def format_progress(tl: dict) -> list[str]:
    """A managed run's node-hours against its limits, its steps and its estimated finish (flows/budget.py)."""
    import datetime as dt

    out, nh, est = [], tl.get("node_hours") or {}, tl.get("estimate") or {}
    if nh:
        limit = nh.get("limit")
        left = f", limit {limit:g} ({max(0.0, limit - nh['spent'] - nh['booked']):.1f} left)" if limit else ""
        out.append(f"  node-hours: {nh['spent']:.1f} spent, {nh['booked']:.1f} booked ahead{left}"
                   + (f"; deadline {nh['deadline']} UTC" if nh.get("deadline") else ""))
    if est.get("step") is not None:
        of = f" of {est['total_steps']} ({100 * est['step'] / est['total_steps']:.0f}%)" if est.get("total_steps") else ""
        eta = (f"; at {est['steps_per_s']:.2f} steps/s it should finish about "
               f"{dt.datetime.fromtimestamp(est['eta'], dt.timezone.utc):%Y-%m-%d %H:%M} UTC, "
               f"{est['lease_ends_ahead']} lease end(s) ahead" if est.get("eta") else "")
        out.append(f"  steps: {est['step']}{of}{eta}")
    return out


def format_breakdown(b: dict) -> str:
    """A resume's downtime on one line: the total to the first step, then each part that took time."""
    from .flows import RESUME_PHASES

    parts = [f"{k} {b[k]:.1f}s" for k in RESUME_PHASES if b.get(k) is not None and b[k] >= 0.05]
    total = b.get("total")
    return (f"{total:.1f}s to the first step: " if total is not None else "") + ", ".join(parts)


def format_summary(s: dict) -> list[str]:
    ok = s["exit_code"] == 0
    stopped = bool(s.get("stopped") and s["stopped"].get("committed"))
    head = "done" if ok else ("STOPPED (resumable)" if stopped else "FAILED")
    lines = [f"== {head}: job {s['job_id']} =="]
    if s.get("resumed"):
        r = s["resumed"]
        lines.append(f"  resumed   from step {r['step']} (epoch {r['epoch']}, batch {r['batch']})"
                     + ("" if r.get("bit_exact") else f", world size {r['checkpoint_world_size']} -> {r['world_size']}"))
    if s.get("resume_breakdown"):
        lines.append(f"  downtime  {format_breakdown(s['resume_breakdown'])}")
    if stopped and s["stopped"].get("step") is None:  # level 3: rank 0's syncer ended the job
        st = s["stopped"]
        lines.append(f"  stopped   {st['reason']}, once its working directory was committed (manifest "
                     f"{st.get('files')}): `appliance resume` puts the files back")
    elif stopped:
        st = s["stopped"]
        lines.append(f"  stopped   after step {st['step']}: {st['reason']}")
        lines.append(f"  committed {st['checkpoint']} ({st['seconds']} s from the stop request to the commit)")
    elif s.get("last_checkpoint"):
        lines.append(f"  committed {s['checkpoints_committed']} checkpoint(s), the last {s['last_checkpoint']}")
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
    if not ok and not stopped:
        lines.append(f"  failure   {s['failure']}")
    if stopped or (not ok and s.get("last_checkpoint")):
        s.setdefault("next", []).insert(0, f"  appliance resume {s['run']}        # continue from the last commit")
    lines += ["", "next:"] + s.get("next", ["  appliance testbed status     # the nodes",
                                             "  appliance testbed down       # remove them"])
    return lines


if __name__ == "__main__":  # pragma: no cover
    main()
