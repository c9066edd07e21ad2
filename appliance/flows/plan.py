"""`appliance run SPEC --plan`: the leases a managed run expects to need, what they cost, and whether they meet
Chameleon's usage policy, before anything is booked.

The leases, by path (as managed.py and handover.py take them):
- successor leases, cold (lease.overlap 0s): back to back, each asked for at the end of the one before, so the run
  holds one lease at a time;
- successor leases, warm (lease.overlap): each starts lease.overlap before the one before it ends, and is booked
  lease.book_ahead before its start (handover.Warm); from then to the end of the one before, the run holds two;
- lease.extend: one lease, extended by lease.duration shortly before its end (with lease.overlap by the controller,
  lease.overlap + lease.book_ahead before it; else by the job's watchdog, about NODE_WATCH_MARGIN before it).
  Chameleon extends a lease only within 48 h of its end, by at most 7 days: it never ends more than 48 h + 7 d ahead.
The last lease is released when training ends (the run's length: --for, limits.deadline, limits.node_hours).

What it costs: node-hours (nodes x the hours the run holds each lease; a warm handover's overlap counts twice) and
SUs, node-hours x the node type's ``su_factor`` (an extra capability of each Blazar host, visible in
``GET /v1/os-hosts``; 1.0 where a host has none: ChameleonCloud/portal balance_service/enforcement/
usage_enforcement.py ``DEFAULT_SU_FACTOR``). The portal charges a lease's whole window when Blazar makes it
(``check_usage_against_allocation``), an extension from then to the new end
(``check_usage_against_allocation_update``), and stops a charge when its lease is deleted (``stop_charging``). So:
``sus``, what the run spends (the last lease released when training ends); ``sus_needed``, the balance the project
needs at the start (every lease charged whole when made); ``peak_sus``, the most the run holds charged at one
moment (two whole leases at each warm lease end: the next one booked while the current one is still charged).

The policy (Chameleon's docs, "lease stacking": consecutive or overlapping leases on the same resource to get past
the 7-day limit are discouraged; extend the lease, or ask the help desk for a longer one), judged two ways:
- by the policy itself: more than one lease of a node type past 7 days is stacking unless ``lease.exemption`` names
  the help desk's answer;
- as Chameleon's notifier computes it (notifier.py, from ChameleonCloud/hammers hammers/scripts/
  lease_stack_notifier.py): at each moment the run's leases change (its start, each booking, each extension; in
  between its figures only fall), on the leases the run holds then, plus the project's other leases of the node
  type (``GET /leases``, the user's to read: their dates, node type and hosts from their reservations; without a
  credential none is assumed, and the plan says so).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import re

from ..errors import ApplianceError
from ..protocol import NODE_WATCH_MARGIN
from ..spec import Spec, deadline_of, duration_seconds
from . import notifier
from .notifier import Seen

DAY = 86400
MAX_LEASE_S = 7 * DAY  # Chameleon's lease cap
EXTENSION_WINDOW_S = 48 * 3600  # Chameleon extends a lease only within 48 h of its end


@dataclasses.dataclass
class Planned:
    """A lease of the run: its dates as Blazar has them (``ends``: from each moment on, its end then: the first at
    its booking, then one per extension), when it is booked, and when the run lets it go (``until``)."""

    start: dt.datetime
    node_type: str
    nodes: int
    ends: list[tuple[dt.datetime, dt.datetime]]  # (from when, its end from then on)
    until: dt.datetime

    @property
    def booked(self) -> dt.datetime:
        return self.ends[0][0]

    @property
    def end(self) -> dt.datetime:
        return self.ends[-1][1]

    @property
    def extensions(self) -> int:
        return len(self.ends) - 1

    def node_hours(self) -> float:
        """Held: from its start to when the run lets it go."""
        return self.nodes * (self.until - self.start).total_seconds() / 3600

    def charged_hours(self) -> float:
        """Charged by the portal: its whole window, extensions included."""
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


def extend_ahead(spec: Spec) -> float:
    """Seconds before its end at which the run's lease is extended: with lease.overlap the controller's
    (handover.Warm: lease.overlap + lease.book_ahead, within Chameleon's 48 h window), else the job's watchdog's
    (watchdog.LeaseWatch.extend_at: NODE_WATCH_MARGIN and a minute, plus two polls)."""
    overlap = duration_seconds(spec.lease.overlap)
    if overlap:
        return float(min(EXTENSION_WINDOW_S, overlap + duration_seconds(spec.lease.book_ahead)))
    return NODE_WATCH_MARGIN + 60.0


def leases(spec: Spec, now: dt.datetime, length_s: float) -> list[Planned]:
    """The leases of a run of ``length_s`` from ``now``, by its path (the module's docstring)."""
    lease_s = duration_seconds(spec.lease.duration)
    nt, n, done = spec.nodes.node_type, spec.nodes.count, now + dt.timedelta(seconds=length_s)
    if spec.lease.extend:
        ends, ahead = [(now, now + dt.timedelta(seconds=lease_s))], dt.timedelta(seconds=extend_ahead(spec))
        while ends[-1][1] < done:
            end = ends[-1][1]
            ends.append((max(now, end - ahead), end + dt.timedelta(seconds=lease_s)))
        return [Planned(now, nt, n, ends, min(ends[-1][1], done))]
    overlap = duration_seconds(spec.lease.overlap)
    step = lease_s - overlap
    count = max(1, math.ceil(max(0.0, length_s - lease_s) / step) + 1) if length_s > lease_s else 1
    ahead = dt.timedelta(seconds=duration_seconds(spec.lease.book_ahead))
    out = []
    for i in range(count):
        start = now + dt.timedelta(seconds=i * step)
        end = start + dt.timedelta(seconds=lease_s)
        # cold: asked for at its start; warm: lease.book_ahead before it, at the earliest as the job before starts
        booked = start if i == 0 or not overlap else max(now + dt.timedelta(seconds=(i - 1) * step), start - ahead)
        out.append(Planned(start, nt, n, [(booked, end)], min(end, done) if i == count - 1 else end))
    return out


def moments(planned: list[Planned]) -> list[tuple[dt.datetime, str, list[tuple[Seen, float]]]]:
    """Each moment the run's leases change (its start, a booking, an extension): (when, what, [(each lease the run
    holds then as Blazar has it, the node-hours charged for it then: its whole window, or from its last
    extension)])."""
    events: dict[dt.datetime, str] = {}
    for i, p in enumerate(planned):
        for k, (at, _) in enumerate(p.ends):
            events.setdefault(at, "the run's start" if (i, k) == (0, 0) else
                              f"extension {k}" if k else f"lease {i + 1} booked")
    out = []
    for t in sorted(events):
        held = []
        for p in planned:
            if not p.booked <= t < p.until:
                continue
            k = max(j for j, (at, _) in enumerate(p.ends) if at <= t)
            end = p.ends[k][1]
            charged_from = p.start if k == 0 else p.ends[k][0]
            held.append((Seen(p.start, end, p.node_type, p.nodes),
                         p.nodes * (end - charged_from).total_seconds() / 3600))
        out.append((t, events[t], held))
    return out


def judge(planned: list[Planned], others: list[Seen], site_hosts: int | None, narrowed: tuple[str, ...]) -> dict:
    """The notifier's figures at the run's worst moments (notifier.py), on its leases held then plus the project's
    ``others`` (each counted while it has not ended), and the most node-hours the run holds charged at once."""
    nt = planned[0].node_type
    none = "no moment (no lease held)"
    out = {"coverage": 0.0, "coverage_at": none, "own_coverage": 0.0, "reserved": 0, "reserved_at": none,
           "stacking_reported": None, "hogging_reported": None, "peak_node_hours": 0.0, "peak_at": none,
           "peak_leases": 0}
    for t, what, held in moments(planned):
        own = [s for s, _ in held]
        seen = own + [o for o in others if o.end > t]
        st, mine = notifier.stacking(seen, nt, t), notifier.stacking(own, nt, t)
        hog = notifier.hogging(seen, nt, t, site_hosts, narrowed)
        if st is not None and st["coverage"] > out["coverage"]:
            out.update(coverage=st["coverage"], coverage_at=what)
        if mine is not None:
            out["own_coverage"] = max(out["own_coverage"], mine["coverage"])
        if st is not None and st["reported"] and out["stacking_reported"] is None:
            out["stacking_reported"] = {"at": what, **{k: round(v, 2) for k, v in st.items() if k != "reported"}}
        if hog["reserved"] > out["reserved"]:
            out.update(reserved=hog["reserved"], reserved_at=what)
        if hog["reported"] and out["hogging_reported"] is None:
            out["hogging_reported"] = {"at": what, "reserved": hog["reserved"], "hosts": site_hosts}
        charged = sum(h for _, h in held)
        if charged > out["peak_node_hours"] + 1e-9:
            out.update(peak_node_hours=charged, peak_at=what, peak_leases=len(held))
    out["hogging_checked"] = notifier.hogging([], nt, planned[0].start, site_hosts, narrowed)["checked"]
    return out


def own_lease(name: str, run: str) -> bool:
    """A lease of the run itself (lifecycle._lease_name of RUN or RUN_h): planned anew, not counted twice."""
    return re.fullmatch(rf"{re.escape(run)}(_h)?-\d{{10}}", name) is not None


def project_leases(cloud, spec: Spec) -> dict:
    """The project's other leases of the spec's node type as the notifier reads them (GET /leases: a user lists
    the project's leases), and how many it could not tell the node type of (asked by host, not by node type)."""
    others, untold = [], 0
    for x in cloud.list_leases():
        if own_lease(x.name, spec.name) or x.ended:
            continue
        if x.node_type is None:
            untold += 1
        elif x.node_type == spec.nodes.node_type:
            others.append(Seen(x.start, x.end, x.node_type, x.hosts, x.status))
    return {"others": others, "untold": untold}


def site_facts(ctx) -> dict:
    """The site's clock and name, its hosts of the spec's node type and their su_factor, and the project's other
    leases of that node type: asked of the site (Blazar) when its credential works; else from what the appliance
    ships (Site.catalog: a dated table of Chameleon's node types), with why the site was not asked and what the
    table assumed ("assumed": no other lease among them), so that a plan needs no credential. A site that ships
    nothing (the local cloud) is asked, or its refusal raised."""
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
                "hosts": hosts, "su_factor": su_factor, **project_leases(cloud, spec)}
    except ApplianceError as e:
        table = ctx.site.catalog(nt, spec.site)
        if table is None:
            raise
        why = e.message
    return {"now": dt.datetime.now(dt.timezone.utc).replace(tzinfo=None), "site": table["site"] or spec.cloud,
            "hosts": table["hosts"], "su_factor": table["su_factor"], "assumed": {**table, "why": why},
            "others": [], "untold": 0}


def make(ctx, run_for: str | None = None) -> dict:
    """The plan of ``ctx.spec``'s managed run: its leases, their node-hours and SUs, the policy's verdicts."""
    spec = ctx.spec
    facts = site_facts(ctx)
    now, hosts, su_factor = facts["now"], facts["hosts"], facts["su_factor"]
    length_s, basis = run_length(spec, now, run_for)
    planned = leases(spec, now, length_s)
    seen = judge(planned, facts["others"], hosts, spec.lease.hogging_node_types)
    node_hours = sum(p.node_hours() for p in planned)
    needed = sum(p.charged_hours() for p in planned)
    out = {"run": spec.name, "site": facts["site"], "node_type": spec.nodes.node_type,
           "nodes": spec.nodes.count, "run_for_s": round(length_s), "basis": basis, "su_factor": su_factor,
           "hosts_of_node_type": hosts, **_path(spec), "source": "table" if facts.get("assumed") else "site",
           **({"assumed": facts["assumed"]} if facts.get("assumed") else {}),
           "leases": [_lease_row(p, su_factor) for p in planned],
           "node_hours": round(node_hours, 1), "sus": round(node_hours * su_factor, 1),
           "sus_needed": round(needed * su_factor, 1),
           "peak_sus": round(seen["peak_node_hours"] * su_factor, 1), "peak_at": seen["peak_at"],
           "peak_leases": seen["peak_leases"],
           "notifier_coverage": round(seen["coverage"], 3),
           "notifier": {**{k: (round(v, 3) if isinstance(v, float) else v) for k, v in seen.items()
                           if not k.startswith("peak")},
                        "hosts": hosts, "other_leases": len(facts["others"]), "untold_leases": facts["untold"],
                        "others_from": "assumed none" if facts.get("assumed") else "GET /leases"},
           "findings": findings(spec, planned, seen, hosts, len(facts["others"]))}
    return out


def _path(spec: Spec) -> dict:
    return {"path": "extend" if spec.lease.extend else "successor leases",
            "handover": "warm" if duration_seconds(spec.lease.overlap) else "cold"}


def _lease_row(p: Planned, su_factor: float) -> dict:
    return {"start": f"{p.start:%Y-%m-%d %H:%M}", "end": f"{p.end:%Y-%m-%d %H:%M}",
            "booked": f"{p.booked:%Y-%m-%d %H:%M}",
            "node_hours": round(p.node_hours(), 1), "sus": round(p.node_hours() * su_factor, 1),
            **({"released": f"{p.until:%Y-%m-%d %H:%M}"} if p.until < p.end else {}),
            **({"extensions": p.extensions} if p.extensions else {})}


def findings(spec: Spec, planned: list[Planned], seen: dict, hosts: int | None, others: int) -> list[dict]:
    """The policy's verdicts, each one line naming the spec settings that change it."""
    out, nt = [], spec.nodes.node_type
    span = (max(p.until for p in planned) - planned[0].start).total_seconds()
    if len(planned) > 1 and span > MAX_LEASE_S:
        if spec.lease.exemption:
            out.append({"rule": "stacking", "ok": True, "line": f"{len(planned)} consecutive leases of {nt} over "
                        f"{span / DAY:.0f} days: covered by your help-desk exemption ({spec.lease.exemption})"})
        else:
            out.append({"rule": "stacking", "ok": False, "line": (
                f"{len(planned)} consecutive leases of {nt} over {span / DAY:.0f} days are what Chameleon's usage "
                "policy calls lease stacking (fix: `lease.extend: true`, which extends one lease within 48 h of its "
                "end and books another only when Blazar refuses; or a run of at most 7 days, `limits.deadline`; or "
                "ask the help desk for a longer lease and put its ticket in `lease.exemption`)")})
    rep = seen["stacking_reported"]
    if rep is not None:
        out.append({"rule": "notifier stacking", "ok": False, "line": (
            f"Chameleon's notifier would report lease stacking of {nt}: {rep['coverage']:.0%} of its "
            f"{rep['window_days']:.0f}-day window covered at {rep['at']}"
            + (f", with the project's {others} other lease(s) of it" if others else "")
            + " (fix: a shorter `lease.book_ahead`, or `lease.extend: true`; or its ticket in `lease.exemption`)")})
    hog = seen["hogging_reported"]
    if hog is not None:
        out.append({"rule": "hogging", "ok": False, "line": (
            f"{hog['reserved']} of the {hosts} {nt} hosts reserved at once at {hog['at']}: Chameleon's notifier "
            "reports more than half of a node type (fix: fewer nodes, `nodes.count`; or `lease.overlap: 0s`, one "
            "lease at a time; or ask the help desk)")})
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
    out += _lease_lines(p["leases"])
    hosts = p["hosts_of_node_type"]
    released = " (the last lease released when training ends)" if p["leases"][-1].get("released") else ""
    out.append(f"  total: {len(p['leases'])} lease(s), {p['node_hours']:g} node-hours, {p['sus']:g} SUs "
               f"(su_factor {p['su_factor']:g} of {p['node_type']}, "
               + (f"{hosts} hosts at the site)" if hosts is not None else "its hosts at the site not known)")
               + released)
    out.append(f"  SU balance: {p['sus_needed']:g} SUs needed from the start (each lease is charged whole when "
               f"Blazar makes it, the unused end of the last one comes back when it is released); at most "
               f"{p['peak_sus']:g} charged at once ({p['peak_leases']} lease(s), at {p['peak_at']})")
    out += _notifier_lines(p)
    for f in p["findings"]:
        out.append(("  ok: " if f["ok"] else "  policy: ") + f["line"])
    if not p["findings"]:
        out.append("  policy: the plan keeps to Chameleon's usage policy (no lease stacking, no hogging)")
    return out


def _lease_lines(rows: list[dict]) -> list[str]:
    shown = list(enumerate(rows, 1))
    if len(shown) > 6:  # the first three and the last (--json has them all)
        shown = [*shown[:3], (None, len(shown) - 4), shown[-1]]
    out = []
    for i, x in shown:
        if i is None:
            out.append(f"  ... {x} more alike")
            continue
        booked = f", booked {x['booked']}" if x["booked"] != x["start"] else ""
        ext = f", extended {x['extensions']} time(s)" if x.get("extensions") else ""
        rel = f", released {x['released']}" if x.get("released") else ""
        out.append(f"  lease {i}: {x['start']} -> {x['end']} UTC{booked}{ext}{rel}: {x['node_hours']:g} node-hours, "
                   f"{x['sus']:g} SUs")
    return out


def _notifier_lines(p: dict) -> list[str]:
    n = p["notifier"]
    if n["others_from"] == "assumed none":
        others = "the project's other leases not read (the site was not asked): none assumed"
    else:
        others = f"with the project's {n['other_leases']} other lease(s) of {p['node_type']} (GET /leases)" + (
            f"; {n['untold_leases']} lease(s) not asked by node type are not counted" if n["untold_leases"] else "")
    own = f", the run's own {n['own_coverage']:.0%}" if n["other_leases"] else ""
    hog = (f"; at most {n['reserved']} of the {n['hosts']} hosts reserved at once (at {n['reserved_at']}; it "
           "reports more than half)" if n["hogging_checked"] else
           f"; at most {n['reserved']} hosts reserved at once (not checked: {p['node_type']} "
           + ("not in `lease.hogging_node_types`)" if n["hosts"] is not None and n["hosts"] > notifier.HOG_MIN_NODES
              else "has at most 4 hosts, or an unknown number)"))
    return [f"  Chameleon's notifier (hammers lease_stack_notifier.py) at the run's worst moment: "
            f"{p['notifier_coverage']:.0%} of its 21-day window covered (at {n['coverage_at']}; it reports >= 90%)"
            f"{own}{hog}", f"  {others}"]
