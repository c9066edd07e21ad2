"""`appliance up|adopt|status|down|check|stage|data|train|bench`: the steps of a run, one verb each."""

from __future__ import annotations

import sys

import click

from . import _cloud_opt, _json_opt, _cluster_name, _default_cloud, _json_out, _messages, _site_opt, main
from .views import _report


@main.command("up")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--lease", "lease_id", default=None, help="Use this existing lease instead of creating one.")
@click.option("--install", is_flag=True,
              help="Install the training stack on every node (for stock CC-Ubuntu24.04-CUDA or 22.04 images; not needed "
                   "with the appliance image). Horovod's built wheel is cached in --wheel-cache.")
@click.option("--variant", type=click.Choice(["cpu", "gpu"]), default=None,
              help="With --install: default gpu for gpu_* node types, else cpu.")
@click.option("--wheel-cache", default=None, help="With --install: where built wheels are cached "
              "(default swift://appliance-wheels/).")
@_json_opt
def up_cmd(spec, lease_id, install, variant, wheel_cache, as_json):
    """Lease -> servers on the reservation -> floating IP on the head -> pinned host keys -> SSH -> contextualize.

    \b
    Idempotent and resumable: every step is recorded in the cluster's state file, so running it
    again after a failure makes only what is missing (servers in ERROR are replaced); after the
    lease has ended it makes a new lease.
    """
    from .. import flows

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
@_json_opt
def adopt_cmd(stack, cloud_kind, site, key_name, key_file, slots, as_json):
    """Take over a cluster launched from heat-templates/horovod-cluster.yaml (e.g. in Horizon).

    \b
    Reads the stack's outputs (head, workers, floating IP, reservation), finds the lease, pins every
    node's host key (each node publishes it at boot through Nova's server password), writes the cluster's state file and contextualizes it, so
    that `appliance train SPEC --cluster STACK`, `stage`, `status` and `resume` work on it.
    """
    from .. import flows

    with _messages(err=as_json):
        cl = flows.adopt(stack, cloud=cloud_kind, site_name=site, key_name=key_name, key_file=key_file, slots=slots)
    if as_json:
        import dataclasses

        _json_out(dataclasses.asdict(cl))


@main.command("status")
@click.argument("name")
@_json_opt
def status_cmd(name, as_json):
    """Lease time left, nodes and addresses of a cluster (NAME, or the SPEC that made it)."""
    from .. import flows

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
@_json_opt
def down_cmd(name, yes, as_json):
    """Delete a cluster's servers, release its floating IP, delete its lease (NAME, or its SPEC)."""
    from .. import flows

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
    with _messages(err=as_json):
        done = flows.down(cname)
    if as_json:
        _json_out({"cluster": cname, "deleted": done})



# ---------------------------------------------------------------------------------------------
# spec and training


@main.command("check")
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--online", is_flag=True,
              help="Also ask the object store: the dataset URL names objects, checkpoint.url is reachable.")
@_json_opt
def check_spec(spec, online, as_json):
    """Validate a run spec before a lease is paid for; print it as the appliance understands it.

    \b
    Checks the spec's fields, its site's rules (Chameleon: at most 7 days, CHI@UC or CHI@TACC, key_name; the local
    cloud: its node types and pool sizes) and the training code (train.code exists, small enough to copy).
    --online also asks the object store, with the site's credentials, what would otherwise be found only
    after the nodes boot: the dataset URL names objects (how many, how large; in mode stream, every shard
    index.json names is in the store at its size), checkpoint.url is reachable and
    not refused, and whether the run already has committed checkpoints; with a checkpoint.url, what
    `appliance run SPEC` would book (its plan: leases, node-hours, SUs, Chameleon's usage policy). It reads only.
    Exit 2 if the spec or its train.code is not usable, 1 if the store or the cloud says no.

    \b
      appliance check my.yaml --online
    """
    import dataclasses

    from .. import flows

    s = flows.check(spec)
    with _messages(err=True):
        found = flows.check_online(s) if online else None
    from ..spec import keras_choice, keras_line

    if as_json:
        keras, why = keras_choice(s)
        _json_out({**dataclasses.asdict(s), "keras": {"runs": keras, "why": why},
                   **({"online": found} if online else {})})
        return
    click.echo(f"{spec}: ok: run {s.name!r} on {s.cloud}, {s.nodes.count} x {s.nodes.node_type}, "
               f"{s.world_size} rank(s); {keras_line(s)}")
    for d in (found or {}).get("datasets", []):
        click.echo(f"  {d['field']} {d['url']}: {d['objects']:,} object(s), {d['size']}"
                   + (f"; a packed dataset of {d['shards']:,} tar shard(s), {d['samples']:,} sample(s), to stream"
                      if "shards" in d else ""))
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
    if found and "plan" in found:
        from ..flows.plan import lines

        p = found["plan"]
        click.echo(f"  appliance run: no plan ({p['error']})" if "error" in p else
                   "\n".join(f"  {x}" for x in lines(p)))


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
    names), so rank r's input pipeline reads only what is local; stream: nothing is staged (the
    job reads the packed shards while it trains: docs/stream.md), only index.json is checked.
    A re-run fetches only what is
    missing or changed (a manifest on each node), and removes files whose objects left the store
    (--keep-extra keeps them). Zero-byte `folder/` objects are directories. Names that would escape
    the destination or name one path twice are refused before anything is written. Free space is
    checked before starting.
    """
    from .. import flows

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
@_json_opt
def data_upload(src, url, cloud_kind, site, segment_size, as_json):
    """Upload a file or a directory tree to URL/<relative path>.

    \b
    Run it again after an interruption: files already at URL with the same size and MD5 are not sent again.
    """
    from .. import flows

    with _messages(err=as_json):
        n = flows.data_upload(src, url, cloud=cloud_kind or _default_cloud(), site_name=site,
                              segment_size=segment_size)
    if as_json:
        _json_out({"url": url, "files": n})


@data.command("pack")
@click.argument("src")
@click.argument("url")
@click.option("--shard-size", default=64 * 1024**2, show_default=True, help="Bytes per shard (about).")
@click.option("--format", "fmt", type=click.Choice(["tar", "tfrecord"]), default="tar", show_default=True,
              help="tar: WebDataset layout; tfrecord: one tf.train.Example per sample.")
@_cloud_opt
@_site_opt
@click.option("--json", "as_json", is_flag=True, help="Print the index.")
def data_pack(src, url, shard_size, fmt, cloud_kind, site, as_json):
    """Pack many small files (a local directory SRC, or the objects under a store URL SRC) into
    shards + index.json, uploaded in parallel (index last).

    \b
    Files sharing a key (the name up to the first dot: 0001.jpg, 0001.cls) form one sample and
    stay in one shard. Read them back with examples/packed/input_pipeline.py once staged, or
    stream them while training (dataset.mode: stream, tar shards; examples/stream).
    From a store (swift://, s3://) the objects go through memory into tar shards, with no local
    copy (docs/stream.md):

    \b
      appliance data pack swift://datasets/imagenet/ swift://datasets/imagenet-packed/
    """
    from .. import flows

    with _messages(quiet=as_json):
        idx = flows.data_pack(src, url, shard_size=shard_size, fmt=fmt, cloud=cloud_kind or _default_cloud(),
                              site_name=site)
    if as_json:
        _json_out(idx)


@data.command("ls")
@click.argument("url")
@_cloud_opt
@_site_opt
@_json_opt
def data_ls(url, cloud_kind, site, as_json):
    """List objects under URL (every page: no 10,000-name cap)."""
    from .. import flows

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
@click.option("--yes", is_flag=True, help="Do not ask.")
@_json_opt
def data_rm(url, cloud_kind, site, yes, as_json):
    """Delete every object under URL (SLO segments too)."""
    from .. import flows

    if not yes:
        click.confirm(f"delete every object under {url}?", abort=True)
    with _messages(err=True):
        n = flows.data_remove(url, cloud=cloud_kind or _default_cloud(), site_name=site)
    _json_out({"url": url, "deleted": n}) if as_json else click.echo(f"deleted {n} object(s)")


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
    from .. import flows

    out = (lambda line: click.echo(line, err=True)) if as_json else None
    with _messages(err=as_json):
        res = flows.train_spec(spec, cluster, out=out)
    _report(res, as_json)



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

    from .. import flows
    from ..bench import BenchConfig, report

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
