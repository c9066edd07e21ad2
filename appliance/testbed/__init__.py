"""The testbed: the local cloud's machines.

Each node is a Linux network namespace with its own UTS namespace (hostname), mount namespace
(private /etc/hosts, /root/.ssh and local disk at /mnt/local; a login user other than root, such as the
local cloud's cc, gets private users, sudoers and /home) and its own sshd on a private
address on a bridge the testbed creates. Where namespaces are unavailable (not root, no sshd),
the testbed falls back to single-host mode: every slot on this machine, no SSH.
"""

from .cloudnodes import (add_node, ensure_bridge, ensure_metadata, listen_in_netns, node_exec,  # noqa: F401
                         remove_node, wipe_aside)
from .netns import (  # noqa: F401
    Testbed,
    METADATA_IP,
    TestbedNode,
    cut_connections,
    down,
    kill_node,
    kill_pids,
    node_address,
    load,
    namespaces_available,
    status,
    up,
)
