#!/bin/sh
# appliance boot script: the user_data of every server of heat-templates/horovod-cluster.yaml.
# Generated into the template by appliance/provision/heat.py (`make heat-template`) together with hostkeys.sh.
#
# No secret travels in user_data (any process on a node can read it from the metadata service), and no node
# trusts another's host key on first use. So a node does only what it can alone: it publishes its SSH host public
# keys to the stack's owner (Nova's server password) and readies the appliance command. `appliance adopt STACK`,
# run with the owner's credentials and key, then pins every node's published keys and contextualizes the cluster
# over SSH with the same contextualize.sh `appliance up` runs: /etc/hosts, an intra-cluster key made on the
# owner's machine, pinned known_hosts, hostfile, firewalld peers, the NIC, cluster.json.
set -eu
ROLE='%%ROLE%%'
STACK='%%STACK%%'
LIB=/usr/local/lib/appliance
LOG=/var/log/appliance-boot.log
# the local cloud's nodes (network namespaces) share the host's /usr and /var: keep to the node's own disk there
if mountpoint -q /mnt/local 2>/dev/null; then LIB=/mnt/local/appliance/lib; LOG=$LIB/boot.log; fi
say() { echo "APPLIANCE_BOOT $*"; echo "$(date -u +%FT%TZ) $*" >>"$LOG" 2>/dev/null || true; }

mkdir -p "$LIB"
chmod 755 "$LIB"
cat >"$LIB/hostkeys.sh" <<'APPLIANCE_HOSTKEYS_EOF'
%%HOSTKEYS%%
APPLIANCE_HOSTKEYS_EOF
sh "$LIB/hostkeys.sh" || say "could not publish the host keys"
if [ -x /opt/appliance/venv/bin/appliance ] && [ "$LIB" = /usr/local/lib/appliance ]; then
    ln -sf /opt/appliance/venv/bin/appliance /usr/local/bin/appliance
fi
say "$ROLE $(hostname) booted (stack $STACK): host keys published; set the cluster up with: appliance adopt $STACK"
