#!/bin/sh
# Contextualize one node of an appliance cluster. Idempotent: running it twice changes nothing.
#
# `appliance up`, `adopt` (a Heat stack) and `train` run this over SSH on every node
# (appliance/provision/contextualize.py); its inputs include a private key, so they never go in user_data.
#
# Inputs, as shell variables set before this script runs (never on a command line):
#   APPLIANCE_NODE          this node's name (hostname peers use)
#   APPLIANCE_PEERS         one "name ip slots" line per node, head first
#   APPLIANCE_ETC           directory for cluster.json, hostfile, env and bin/ssh
#   APPLIANCE_SSH_DIR       ~/.ssh of the user that runs training
#   APPLIANCE_CLUSTER_KEY   private key for node-to-node SSH (generated per cluster)
#   APPLIANCE_CLUSTER_PUB   its public key
#   APPLIANCE_KNOWN_HOSTS   known_hosts lines pinning every node's host key (may be empty)
#   APPLIANCE_CLUSTER_JSON  contents of cluster.json
#   APPLIANCE_HOSTS_FILE    /etc/hosts (overridable for tests)
#   APPLIANCE_OWNER         user that owns APPLIANCE_SSH_DIR and APPLIANCE_ETC when this runs under sudo (optional)
# Prints KEY=VALUE lines: APPLIANCE_NIC, APPLIANCE_FIREWALL, APPLIANCE_CONTEXT=ok.
set -eu
umask 077

: "${APPLIANCE_HOSTS_FILE:=/etc/hosts}"
BEGIN="# BEGIN appliance cluster"
END="# END appliance cluster"

# Replace the managed block of file $1 with the contents of $2 (written in place: /etc/hosts may be a bind mount).
put_block() {
    file=$1 content=$2
    [ -e "$file" ] || : >"$file"
    tmp=$(mktemp)
    awk -v b="$BEGIN" -v e="$END" '$0==b{skip=1;next} $0==e{skip=0;next} !skip' "$file" >"$tmp"
    { printf '%s\n' "$BEGIN"; printf '%s\n' "$content"; printf '%s\n' "$END"; } >>"$tmp"
    if ! cmp -s "$tmp" "$file"; then cat "$tmp" >"$file"; fi
    rm -f "$tmp"
}

my_ip=$(printf '%s\n' "$APPLIANCE_PEERS" | awk -v n="$APPLIANCE_NODE" '$1==n{print $2}')
[ -n "$my_ip" ] || { echo "contextualize: $APPLIANCE_NODE is not in the peer list" >&2; exit 3; }

# 1. Names: every peer in /etc/hosts.
hosts_block=$(printf '%s\n' "$APPLIANCE_PEERS" | awk 'NF>=2{print $2"\t"$1}')
umask 022
put_block "$APPLIANCE_HOSTS_FILE" "$hosts_block"
umask 077

# 2. Node-to-node SSH: the cluster key, authorized on every node; host keys pinned; strict checking.
mkdir -p "$APPLIANCE_SSH_DIR"
chmod 700 "$APPLIANCE_SSH_DIR"
printf '%s\n' "$APPLIANCE_CLUSTER_KEY" >"$APPLIANCE_SSH_DIR/id_appliance.new"
mv "$APPLIANCE_SSH_DIR/id_appliance.new" "$APPLIANCE_SSH_DIR/id_appliance"
printf '%s\n' "$APPLIANCE_CLUSTER_PUB" >"$APPLIANCE_SSH_DIR/id_appliance.pub"
touch "$APPLIANCE_SSH_DIR/authorized_keys"
grep -qxF "$APPLIANCE_CLUSTER_PUB" "$APPLIANCE_SSH_DIR/authorized_keys" ||
    printf '%s\n' "$APPLIANCE_CLUSTER_PUB" >>"$APPLIANCE_SSH_DIR/authorized_keys"
chmod 600 "$APPLIANCE_SSH_DIR/authorized_keys"
if [ -n "${APPLIANCE_KNOWN_HOSTS:-}" ]; then
    put_block "$APPLIANCE_SSH_DIR/known_hosts" "$APPLIANCE_KNOWN_HOSTS"
fi
peer_names=$(printf '%s\n' "$APPLIANCE_PEERS" | awk 'NF>=2{printf "%s %s ", $1, $2}')
put_block "$APPLIANCE_SSH_DIR/config" "Host $peer_names
    IdentityFile $APPLIANCE_SSH_DIR/id_appliance
    IdentitiesOnly yes
    StrictHostKeyChecking yes
    BatchMode yes
    ConnectTimeout 10
    ServerAliveInterval 5
    ServerAliveCountMax 3"

# 3. Cluster files: cluster.json, hostfile (horovodrun --hostfile), env (NIC for Gloo/NCCL).
umask 022
# under sudo, the directories made here are the login user's: the work directory's appliance/ holds the job's
# code, data and runs too, which the user's job writes (a root-owned one would refuse them; an earlier version
# made it root's, and this gives it back)
if [ -n "${APPLIANCE_OWNER:-}" ]; then
    for d in "$(dirname "$APPLIANCE_ETC")" "$APPLIANCE_ETC" "$APPLIANCE_ETC/bin"; do
        [ -d "$d" ] || install -d -o "$APPLIANCE_OWNER" -g "$(id -g "$APPLIANCE_OWNER")" "$d"
        [ "$(stat -c %U "$d")" = "$APPLIANCE_OWNER" ] || chown "$APPLIANCE_OWNER:" "$d"
    done
fi
mkdir -p "$APPLIANCE_ETC/bin"
printf '%s\n' "$APPLIANCE_CLUSTER_JSON" >"$APPLIANCE_ETC/cluster.json"
printf '%s\n' "$APPLIANCE_PEERS" | awk 'NF>=3{print $1" slots="$3}' >"$APPLIANCE_ETC/hostfile"
nic=$(ip -o -4 addr show 2>/dev/null | awk -v ip="$my_ip" '{split($4,a,"/")} a[1]==ip{print $2; exit}')
[ -n "$nic" ] || { echo "contextualize: no interface carries $my_ip on $APPLIANCE_NODE" >&2; exit 4; }
cat >"$APPLIANCE_ETC/env" <<EOF
GLOO_SOCKET_IFNAME=$nic
NCCL_SOCKET_IFNAME=$nic
HOROVOD_GLOO_IFACE=$nic
EOF
# horovodrun calls `ssh -o StrictHostKeyChecking=no`; ssh takes the first value it sees for an option,
# so this wrapper, first on horovodrun's PATH, keeps host-key checking strict.
cat >"$APPLIANCE_ETC/bin/ssh" <<'EOF'
#!/bin/sh
exec /usr/bin/ssh -o StrictHostKeyChecking=yes -o BatchMode=yes -o ConnectTimeout=10 \
    -o ServerAliveInterval=5 -o ServerAliveCountMax=3 "$@"
EOF
chmod 755 "$APPLIANCE_ETC/bin/ssh"

# 4. firewalld (Chameleon bare metal): trust exactly the peers' addresses, runtime and permanent.
fw=none
if command -v firewall-cmd >/dev/null 2>&1 && firewall-cmd --state >/dev/null 2>&1; then
    wanted=$(printf '%s\n' "$APPLIANCE_PEERS" | awk -v me="$my_ip" 'NF>=2 && $2!=me{print $2"/32"}')
    old=$(cat "$APPLIANCE_ETC/firewall-sources" 2>/dev/null || true)
    for src in $old; do
        if ! printf '%s\n' "$wanted" | grep -qxF "$src"; then
            firewall-cmd -q --zone=trusted --remove-source="$src" || true
            firewall-cmd -q --permanent --zone=trusted --remove-source="$src" || true
        fi
    done
    for src in $wanted; do
        firewall-cmd -q --zone=trusted --query-source="$src" || firewall-cmd -q --zone=trusted --add-source="$src"
        firewall-cmd -q --permanent --zone=trusted --query-source="$src" ||
            firewall-cmd -q --permanent --zone=trusted --add-source="$src"
    done
    printf '%s\n' "$wanted" >"$APPLIANCE_ETC/firewall-sources"
    fw="trusted:$(printf '%s\n' "$wanted" | grep -c . || true)"
fi

if [ -n "${APPLIANCE_OWNER:-}" ]; then chown -R "$APPLIANCE_OWNER:" "$APPLIANCE_SSH_DIR" "$APPLIANCE_ETC"; fi

echo "APPLIANCE_NIC=$nic"
echo "APPLIANCE_FIREWALL=$fw"
echo "APPLIANCE_CONTEXT=ok"
