"""`appliance run SPEC --plan`: the leases a managed run expects to need, what they cost, and whether they meet
Chameleon's usage policy, before anything is booked.

What it costs: each lease's node-hours (nodes x hours; a warm handover's overlap counts twice, both leases run
through it) and SUs, node-hours x the node type's ``su_factor`` (an extra capability of each Blazar host, visible in
``GET /v1/os-hosts``; 1.0 where a host has none: ChameleonCloud/portal balance_service/enforcement/
usage_enforcement.py ``DEFAULT_SU_FACTOR``).

The policy (Chameleon's docs, "lease stacking": consecutive or overlapping leases on the same resource to get past
the 7-day limit are discouraged; extend the lease, or ask the help desk for a longer one) and the checks that
report it (ChameleonCloud/hammers hammers/scripts/lease_stack_notifier.py, thresholds from its test config, the
production values are not public):
- stacking: per node type, a project's leases from now on covering >= 90% of a window of >= 21 days
  (``lease_coverage_threshold``, ``minimum_lease_window_days``);
- hogging: the hosts of a project's leases ending within 21 days, more than half of a high-end node type (gpu,
  storage, fpga in its name) that has more than 4 nodes (``high_end_node_coverage_threshold``,
  ``min_nodes_for_coverage``).
A run held by its controller books one lease ahead at most, so the notifier's look at any moment sees at most two
of its leases; the plan says that number too, and judges the run by the policy itself: more than one lease of a
node type past 7 days is stacking unless ``lease.exemption`` names the help desk's answer. ``lease.extend: true``
is the path the policy asks for: the controller extends the lease (within 48 h of its end) before it books another,
and books one only when Blazar refuses the extension (the hosts are reserved after the end).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math

from ..errors import ApplianceError
from ..spec import Spec, deadline_of, duration_seconds

DAY = 86400
MAX_LEASE_S = 7 * DAY  # Chameleon's lease cap
STACK_WINDOW_S = 21 * DAY  # lease_stack_notifier: minimum_lease_window_days
STACK_COVERAGE = 0.9  # lease_coverage_threshold
HOG_SHARE = 0.5  # high_end_node_coverage_threshold
HOG_MIN_NODES = 4  # min_nodes_for_coverage: node types of at most this many nodes are not checked
HIGH_END = ("gpu", "storage", "fpga")  # lease_stack_notifier.py Host.is_high_end


@dataclasses.dataclass
class Planned:
    start: dt.datetime
    end: dt.datetime
    node_type: str
    nodes: int
    extensions: int = 0  # lease.extend: times the one lease is extended by lease.duration

    def node_hours(self) -> float:
        return self.nodes * (self.end - self.start).total_seconds() / 3600


def run_length(spec: Spec, now: dt.datetime, run_for: str | None) -> tuple[float, str]:
    """Seconds the run is planned for, and what says so: --for, limits.deadline, limits.node_hours, else one
    lease."""
    if run_for:
        return float(duration_seconds(run_for)), f"--for {run_for}"
    deadline = deadline_of(spec)
    if deadline is not None:
        return max(0.0, (deadline - now).total_seconds()), f"limits.deadline {spec.limits.deadline}"
    if spec.limits.node_hours:
        return spec.limits.node_hours / spec.nodes.count * 3600, f"limits.node_hours {spec.limits.node_hours:g}"
    return float(duration_seconds(spec.lease.duration)), "one lease.duration (say how long with --for 30d)"


def leases(spec: Spec, now: dt.datetime, length_s: float) -> list[Planned]:
    """The leases of a run of ``length_s`` from ``now``: with lease.extend one lease extended, else consecutive
    leases of lease.duration, each starting lease.overlap before the one before it ends."""
    lease_s = duration_seconds(spec.lease.duration)
    nt, n = spec.nodes.node_type, spec.nodes.count
    if spec.lease.extend:
        ext = max(0, math.ceil((length_s - lease_s) / lease_s))
        return [Planned(now, now + dt.timedelta(seconds=lease_s * (1 + ext)), nt, n, ext)]
    step = lease_s - duration_seconds(spec.lease.overlap)
    count = max(1, math.ceil(max(0.0, length_s - lease_s) / step) + 1) if length_s > lease_s else 1
    return [Planned(now + dt.timedelta(seconds=i * step), now + dt.timedelta(seconds=i * step + lease_s), nt, n)
            for i in range(count)]


def notifier_coverage(planned: list[Planned], now: dt.datetime) -> float:
    """The largest share of the notifier's window its look would see covered, at any moment of the run: the lease
    that runs and the one booked ahead of it (the notifier counts one host per lease, from now on)."""
    worst = 0.0
    for i, cur in enumerate(planned):
        seen = planned[i:i + 2]
        at = max(cur.start, now)
        covered = sum((p.end - max(at, p.start)).total_seconds() for p in seen)
        window = max((at + dt.timedelta(seconds=STACK_WINDOW_S)), max(p.end for p in seen)) - min(p.start for p in seen)
        worst = max(worst, covered / window.total_seconds())
    return worst


def site_facts(ctx) -> dict:
    """The site's clock and name, its hosts of the spec's node type and their su_factor: asked of the site (Blazar)
    when its credential works; else from what the appliance ships (Site.catalog: a dated table of Chameleon's node
    types), with why the site was not asked and what the table assumed ("assumed"), so that a plan needs no
    credential. A site that ships nothing (the local cloud) is asked, or its refusal raised."""
    spec, nt = ctx.spec, ctx.spec.nodes.node_type
    try:
        cloud = ctx.site.cloud
        try:
            now = cloud.now()
        except ApplianceError:
            raise
        except Exception as e:  # Blazar's own error (a 401 or a 5xx on GET /leases): its one line
            from ..sites.openstack_api import explain_blazar

            raise explain_blazar(e) from None
        hosts, su_factor = cloud.node_type_hosts(nt)
        return {"now": now, "site": spec.site or ctx.site.region or cloud.region_name() or spec.cloud,
                "hosts": hosts, "su_factor": su_factor}
    except ApplianceError as e:
        table = ctx.site.catalog(nt, spec.site)
        if table is None:
            raise
        why = e.message
    return {"now": dt.datetime.now(dt.timezone.utc).replace(tzinfo=None), "site": table["site"] or spec.cloud,
            "hosts": table["hosts"], "su_factor": table["su_factor"], "assumed": {**table, "why": why}}


def make(ctx, run_for: str | None = None) -> dict:
    """The plan of ``ctx.spec``'s managed run: its leases, their node-hours and SUs, the policy's verdicts."""
    spec = ctx.spec
    facts = site_facts(ctx)
    now, hosts, su_factor = facts["now"], facts["hosts"], facts["su_factor"]
    length_s, basis = run_length(spec, now, run_for)
    planned = leases(spec, now, length_s)
    node_hours = sum(p.node_hours() for p in planned)
    out = {"run": spec.name, "site": facts["site"], "node_type": spec.nodes.node_type,
           "nodes": spec.nodes.count, "run_for_s": round(length_s), "basis": basis, "su_factor": su_factor,
           "hosts_of_node_type": hosts, "path": "extend" if spec.lease.extend else "successor leases",
           "source": "table" if facts.get("assumed") else "site",
           **({"assumed": facts["assumed"]} if facts.get("assumed") else {}),
           "leases": [{"start": f"{p.start:%Y-%m-%d %H:%M}", "end": f"{p.end:%Y-%m-%d %H:%M}",
                       "node_hours": round(p.node_hours(), 1), "sus": round(p.node_hours() * su_factor, 1),
                       **({"extensions": p.extensions} if p.extensions else {})} for p in planned],
           "node_hours": round(node_hours, 1), "sus": round(node_hours * su_factor, 1),
           "notifier_coverage": round(notifier_coverage(planned, now), 3), "findings": []}
    span = (planned[-1].end - planned[0].start).total_seconds()
    if len(planned) > 1 and span > MAX_LEASE_S:
        if spec.lease.exemption:
            out["findings"].append({"rule": "stacking", "ok": True, "line": f"{len(planned)} consecutive leases of "
                                    f"{spec.nodes.node_type} over {span / DAY:.0f} days: covered by your help-desk "
                                    f"exemption ({spec.lease.exemption})"})
        else:
            out["findings"].append({"rule": "stacking", "ok": False, "line": (
                f"{len(planned)} consecutive leases of {spec.nodes.node_type} over {span / DAY:.0f} days are what "
                "Chameleon's usage policy calls lease stacking (fix: `lease.extend: true`, which extends one lease "
                "within 48 h of its end and books another only when Blazar refuses; or nodes.alternatives and a gap "
                "between leases; or ask the help desk for a longer lease and put its ticket in lease.exemption)")})
    held = spec.nodes.count * (2 if duration_seconds(spec.lease.overlap) else 1)
    if any(k in spec.nodes.node_type.lower() for k in HIGH_END) and hosts is not None and hosts > HOG_MIN_NODES \
            and held > HOG_SHARE * hosts:
        out["findings"].append({"rule": "hogging", "ok": False, "line": (
            f"{held} of the {hosts} {spec.nodes.node_type} hosts at once (more than half of a high-end node type, "
            "which Chameleon's notifier reports; fix: fewer nodes, lease.overlap 0s, or ask the help desk)")})
    return out


def lines(p: dict) -> list[str]:
    """The plan as said to a user."""
    out = [f"plan of run {p['run']}: {p['nodes']} x {p['node_type']} at {p['site']} for "
           f"{p['run_for_s'] / 3600:.1f} h ({p['basis']}); {p['path']}"]
    a = p.get("assumed")
    if a:
        gpus = f", {a['gpus']} x {a['gpu']} per node" if a.get("gpus") else ""
        out.append(f"  the site was not asked ({a['why']}): its figures are from the appliance's table of Chameleon "
                   f"node types as of {a['date']} ({a['table']})")
        out.append(f"  table: {p['hosts_of_node_type'] if p['hosts_of_node_type'] is not None else 'unknown'} "
                   f"{p['node_type']} hosts ({a['hosts_from']}){gpus}; su_factor {p['su_factor']:g} "
                   f"({a['su_factor_from']})")
    shown = list(enumerate(p["leases"], 1))
    if len(shown) > 6:  # the first three and the last (--json has them all)
        shown = [*shown[:3], (None, len(shown) - 4), shown[-1]]
    for i, x in shown:
        if i is None:
            out.append(f"  ... {x} more alike")
            continue
        ext = f", extended {x['extensions']} time(s)" if x.get("extensions") else ""
        out.append(f"  lease {i}: {x['start']} -> {x['end']} UTC{ext}: {x['node_hours']:g} node-hours, "
                   f"{x['sus']:g} SUs")
    hosts = p["hosts_of_node_type"]
    out.append(f"  total: {len(p['leases'])} lease(s), {p['node_hours']:g} node-hours, {p['sus']:g} SUs "
               f"(su_factor {p['su_factor']:g} of {p['node_type']}, "
               + (f"{hosts} hosts at the site)" if hosts is not None else "its hosts at the site not known)"))
    out.append(f"  Chameleon's stacking notifier would see at most {p['notifier_coverage']:.0%} of its 21-day window "
               "covered at any moment (it reports >= 90%)")
    for f in p["findings"]:
        out.append(("  ok: " if f["ok"] else "  policy: ") + f["line"])
    if not p["findings"]:
        out.append("  policy: the plan keeps to Chameleon's usage policy (no lease stacking, no hogging)")
    return out
