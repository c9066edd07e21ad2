"""Sites: Chameleon and the local cloud behind one interface (base.Site). Re-exports only, plus the routing
from a spec's `cloud:` or a cluster record to its site."""

from __future__ import annotations

from ..cluster import Cluster
from ..errors import ApplianceError
from ..spec import Spec
from ..spec import load_spec as _load_spec
from ..spec import parse_spec as _parse_spec
from .base import LoginKey, Site  # noqa: F401
from .chameleon import ChameleonSite
from .local import LocalSite

KINDS: dict[str, type[Site]] = {"chameleon": ChameleonSite, "local": LocalSite}


def open_site(kind: str, region: str | None = None) -> Site:
    try:
        return KINDS[kind](region)
    except KeyError:
        raise ApplianceError(f"unknown cloud {kind!r}", f"use one of {', '.join(KINDS)}") from None


def for_spec(spec: Spec) -> Site:
    return open_site(spec.cloud, spec.site)


def for_cluster(cluster: Cluster) -> Site | None:
    """The site a cluster record was made on; None for machines no site made (a testbed, a Heat head node's
    own view of its cluster)."""
    if cluster.cloud not in KINDS:
        return None
    return open_site(cluster.cloud, cluster.site.region)


def rank_env(cluster: Cluster) -> dict[str, str]:
    """What the ranks of a job on ``cluster`` get unless the spec says otherwise (Site.rank_env), by where its
    machines are, whatever the spec's `cloud:`: its site's; the local testbed's nodes are the local site's machines
    (its default cluster); a cluster no site made (a Heat head node's own view) gets nothing."""
    kind = "local" if cluster.cloud == "testbed" else cluster.cloud
    return dict(KINDS[kind].rank_env) if kind in KINDS else {}


def load_spec(path) -> Spec:
    """The spec, checked by its own rules and by its site's (Chameleon's 7-day cap, its sites, key_name)."""
    spec = _load_spec(path)
    KINDS[spec.cloud].check_spec(spec)
    return spec


def parse_spec(data, *args, **kw) -> Spec:
    """As load_spec, from parsed YAML."""
    spec = _parse_spec(data, *args, **kw)
    KINDS[spec.cloud].check_spec(spec)
    return spec
