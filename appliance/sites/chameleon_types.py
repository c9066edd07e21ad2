"""Chameleon's GPU node types, shipped with the appliance: what `appliance run SPEC --plan` uses when it cannot ask
the site (no credential yet, or one the site refuses). With a credential that works, the plan asks the site's Blazar
instead (GET /v1/os-hosts: its hosts of the node type and their ``su_factor``), and this table is not read.

Where each column comes from (read as of TABLE_DATE; a site changes its hardware, so the plan says the date):
- ``hosts``: the nodes of the type the reference-repository lists at each site (ChameleonCloud/reference-repository,
  served at https://api.chameleoncloud.org/sites/<uc|tacc>/clusters/chameleon/nodes.json, which python-chi
  chi/hardware.py get_nodes reads). Blazar may offer fewer (a node in maintenance). None: the type is at that site,
  its count is not in this table.
- ``gpus``, ``gpu``: GPUs per node and their model, from the same nodes (the fewest where nodes of a type differ;
  ``gpu`` says so).
- ``su_factor``: not public per node type. 1 SU is one node-hour of a base node and GPU nodes are charged more
  (Chameleon's FAQ, https://chameleoncloud.org/learn/frequently-asked-questions/); the portal charges a lease its
  hosts' ``su_factor`` extra capability, 1.0 where a host has none (ChameleonCloud/portal
  balance_service/enforcement/usage_enforcement.py ``DEFAULT_SU_FACTOR``). So every type here is *assumed* at
  ASSUMED_SU_FACTOR, and for a GPU type the SUs the plan shows are a lower bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TABLE_DATE = "2026-06"
TABLE = "appliance/sites/chameleon_types.py"
ASSUMED_SU_FACTOR = 1.0  # the portal's DEFAULT_SU_FACTOR


@dataclass(frozen=True)
class NodeType:
    gpus: int  # per node (the fewest where the type's nodes differ)
    gpu: str  # the model, and how the nodes differ
    hosts: dict = field(default_factory=dict)  # site -> nodes listed (None: there, count not in the table)
    su_factor: float | None = None  # None: not public, ASSUMED_SU_FACTOR


UC, TACC = "CHI@UC", "CHI@TACC"
NODE_TYPES: dict[str, NodeType] = {
    "gpu_rtx_6000": NodeType(1, "Quadro RTX 6000", {UC: 37}),
    "gpu_v100": NodeType(4, "V100 32GB (1 PCIe, 3 SXM2)", {UC: 4}),
    "gpu_a100_pcie": NodeType(4, "A100 PCIe 80GB", {UC: 4}),
    "gpu_a100_nvlink": NodeType(4, "A100 SXM4 80GB", {UC: 1}),
    "compute_gigaio": NodeType(1, "A100 80GB at CHI@UC, A100 40GB or A30 at CHI@TACC, recomposable",
                               {UC: None, TACC: None}),
    "compute_liqid": NodeType(1, "A100 PCIe 40GB, 1 or 2 per node", {TACC: 8}),
    "gpu_h100": NodeType(4, "H100 SXM5 94GB", {TACC: 2}),
    "gpu_p100": NodeType(2, "P100 PCIe 16GB", {TACC: 15}),
    "gpu_p100_nvlink": NodeType(2, "P100 SXM2, 2 to 4 per node", {TACC: 4}),
    "gpu_p100_v100": NodeType(2, "V100 PCIe 16GB", {TACC: 1}),
    "gpu_k80": NodeType(2, "K80 (Kepler: the CUDA-11 image's R470 driver)", {TACC: 2}),
    "gpu_m40": NodeType(1, "M40", {TACC: 2}),
}


def facts(node_type: str, site: str | None) -> dict:
    """What the table says of ``node_type`` at ``site`` (None: the sites it lists), and where each figure is from:
    {table, date, site, hosts (None: not known), gpus, gpu, su_factor, su_factor_from, hosts_from}."""
    t = NODE_TYPES.get(node_type)
    out = {"table": TABLE, "date": TABLE_DATE, "site": site, "hosts": None, "gpus": None, "gpu": None}
    su = t.su_factor if t is not None and t.su_factor is not None else None
    out["su_factor"] = su if su is not None else ASSUMED_SU_FACTOR
    out["su_factor_from"] = "Chameleon's portal" if su is not None else (
        "assumed: not public; GPU nodes are charged more than a base node's 1 SU per hour, so the SUs are a lower "
        "bound" if t is not None and t.gpus else "assumed: the portal's default, 1 SU per node-hour of a base node")
    if t is None:
        out["hosts_from"] = f"{node_type} is not in the table (its hosts at the site are not known)"
        return out
    out.update(gpus=t.gpus, gpu=t.gpu)
    sites = [site] if site else list(t.hosts)
    if site and site not in t.hosts:
        out["hosts"], out["hosts_from"] = 0, f"the reference-repository lists no {node_type} at {site}"
        return out
    counts = [t.hosts[s] for s in sites]
    out["site"] = " or ".join(sites)
    if len(sites) == 1 and counts[0] is not None:
        out["hosts"], out["hosts_from"] = counts[0], f"the nodes the reference-repository lists at {sites[0]}"
    else:
        out["hosts_from"] = (f"at {out['site']}, count not in the table" if len(sites) == 1 else
                             f"at {out['site']}: the spec names no site")
    return out
