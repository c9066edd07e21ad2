"""Contextualize a cluster: run contextualize.sh on every node, in parallel, idempotently.

The script (beside this file) is the one way a node gets the cluster's state, for `up` and for a Heat stack's
`adopt` alike. Its inputs travel on the SSH channel's stdin, never on a command line or in user_data, because
they include the cluster's private key.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from .. import paths, report
from ..cluster import Cluster, Node
from ..errors import ApplianceError
from ..remote import Remote, Session

log = report.get(__name__)

SCRIPT = Path(__file__).with_name("contextualize.sh")


def cluster_key(cluster: Cluster) -> tuple[str, str]:
    """The cluster's node-to-node key pair (OpenSSH format), made once and kept 0600."""
    d = paths.clusters_dir()
    priv_p, pub_p = d / f"{cluster.name}.id_ed25519", d / f"{cluster.name}.id_ed25519.pub"
    if not priv_p.exists():
        key = ed25519.Ed25519PrivateKey.generate()
        priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                 serialization.NoEncryption()).decode()
        pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                            serialization.PublicFormat.OpenSSH).decode()
        pub_p.write_text(f"{pub} appliance-cluster-{cluster.name}\n")
        paths.write_private(priv_p, priv.encode())
    return priv_p.read_text().strip(), pub_p.read_text().strip()


def peers_text(cluster: Cluster) -> str:
    return "\n".join(f"{n.name} {n.private_ip} {n.slots}" for n in cluster.nodes)


def cluster_json(cluster: Cluster) -> str:
    return json.dumps({
        "name": cluster.name,
        "cloud": cluster.cloud,
        "head": cluster.head.name,
        "nodes": [{"name": n.name, "ip": n.private_ip, "slots": n.slots} for n in cluster.nodes],
        "lease_id": cluster.lease_id,
        "lease_end": cluster.lease_end,
    }, indent=2)


def script_for(cluster: Cluster, node: Node) -> bytes:
    """The contextualize script with this node's inputs prepended (sent on stdin)."""
    priv, pub = cluster_key(cluster)
    known = Path(cluster.known_hosts).read_text().strip() if cluster.known_hosts else ""
    home = "/root" if node.user == "root" else f"/home/{node.user}"
    inputs = {
        "APPLIANCE_NODE": node.name,
        "APPLIANCE_PEERS": peers_text(cluster),
        "APPLIANCE_ETC": cluster.config_dir(node),
        "APPLIANCE_SSH_DIR": f"{home}/.ssh",
        "APPLIANCE_CLUSTER_KEY": priv,
        "APPLIANCE_CLUSTER_PUB": pub,
        "APPLIANCE_KNOWN_HOSTS": known,
        "APPLIANCE_CLUSTER_JSON": cluster_json(cluster),
        "APPLIANCE_OWNER": "" if node.user == "root" else node.user,
    }
    head = "".join(f"{k}={shlex.quote(v)}\n" for k, v in inputs.items())
    return (head + SCRIPT.read_text()).encode()


def _parse(out: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in out.splitlines() if line.startswith("APPLIANCE_") and "=" in line)


def contextualize_node(cluster: Cluster, remote: Remote) -> dict[str, str]:
    node = remote.node
    shell = "sh -s" if node.user == "root" else "sudo -n sh -s"
    r = remote.run(shell, stdin=script_for(cluster, node))
    info = _parse(r.out)
    if r.rc != 0 or info.get("APPLIANCE_CONTEXT") != "ok":
        raise ApplianceError(f"contextualize failed on {node.name} (exit {r.rc}): {r.err.strip()[-300:]}",
                             "run `appliance status` and check the node; re-running is safe")
    return info


def contextualize(cluster: Cluster, session: Session | None = None) -> str:
    """Bring every node to the cluster's state; returns the NIC for Gloo/NCCL. Idempotent."""
    if cluster.single_host:
        cluster.nic = "lo"
        return "lo"
    cluster_key(cluster)  # once, before the parallel part
    own = session is None
    session = session or Session(cluster)
    try:
        infos = session.each(lambda r: contextualize_node(cluster, r))
    finally:
        if own:
            session.close()
    nics = {name: i["APPLIANCE_NIC"] for name, i in infos.items()}
    nic = nics[cluster.head.name]
    if len(set(nics.values())) > 1:
        log.info(f"note: nodes use different NIC names {nics}; horovodrun gets the head's ({nic})")
    fw = {i["APPLIANCE_FIREWALL"] for i in infos.values()}
    log.info(f"contextualized {len(infos)} node(s): NIC {nic}, firewalld {', '.join(sorted(fw))}")
    cluster.nic = nic
    return nic
