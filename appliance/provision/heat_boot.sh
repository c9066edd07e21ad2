#!/bin/sh
# appliance boot script: the user_data of every server of heat-templates/horovod-cluster.yaml.
# Generated into the template by appliance/provision/heat.py (`make heat-template`) together with
# contextualize.sh, the same script `appliance up` runs over SSH: one source of truth.
#
# Heat's str_replace fills in the placeholder fields below. Information flows one way (user_data): workers boot first and know only
# the cluster key; the head knows every worker's name and address, waits for their sshd, records their
# host keys (first use, inside the private network: `appliance adopt` pins them from what each node published),
# then contextualizes every node, itself included, over SSH with the cluster key.
set -eu
ROLE='%%ROLE%%'
STACK='%%STACK%%'
WORKER_IPS='%%WORKER_IPS%%'
WORKER_NAMES='%%WORKER_NAMES%%'
CLUSTER_PUB='%%CLUSTER_PUB%%'
LIB=/usr/local/lib/appliance
LOG=/var/log/appliance-boot.log
ETC=/etc/appliance
# the local cloud's nodes (network namespaces) share the host's /etc and /usr: keep to the node's own disk there
if mountpoint -q /mnt/local 2>/dev/null; then LIB=/mnt/local/appliance/lib; ETC=/mnt/local/appliance/etc; LOG=$LIB/boot.log; fi
say() { echo "APPLIANCE_BOOT $*"; echo "$(date -u +%FT%TZ) $*" >>"$LOG" 2>/dev/null || true; }

mkdir -p "$LIB"
chmod 755 "$LIB"
# every node publishes its SSH host public keys to the stack's owner (`appliance adopt` pins them from there)
cat >"$LIB/hostkeys.sh" <<'APPLIANCE_HOSTKEYS_EOF'
%%HOSTKEYS%%
APPLIANCE_HOSTKEYS_EOF
sh "$LIB/hostkeys.sh" || say "could not publish the host keys"
umask 077
cat >"$LIB/cluster_key" <<'APPLIANCE_KEY_EOF'
%%CLUSTER_KEY%%
APPLIANCE_KEY_EOF
umask 022
cat >"$LIB/contextualize.sh" <<'APPLIANCE_SCRIPT_EOF'
%%CONTEXTUALIZE%%
APPLIANCE_SCRIPT_EOF

# the login user: cc on Chameleon's images, else root
if id cc >/dev/null 2>&1; then LUSER=cc; LHOME=/home/cc; SUDO="sudo -n"; else LUSER=root; LHOME=/root; SUDO=""; fi
mkdir -p "$LHOME/.ssh"
touch "$LHOME/.ssh/authorized_keys"
grep -qxF "$CLUSTER_PUB" "$LHOME/.ssh/authorized_keys" || printf '%s\n' "$CLUSTER_PUB" >>"$LHOME/.ssh/authorized_keys"
chmod 700 "$LHOME/.ssh"
chmod 600 "$LHOME/.ssh/authorized_keys"
chown -R "$LUSER:" "$LHOME/.ssh" 2>/dev/null || true
if [ -x /opt/appliance/venv/bin/appliance ] && [ "$ETC" = /etc/appliance ]; then
    ln -sf /opt/appliance/venv/bin/appliance /usr/local/bin/appliance
fi
if [ "$ROLE" = worker ]; then
    say "worker $(hostname) ready for the head"
    exit 0
fi

# --- the head -------------------------------------------------------------------------------------------
me=$(hostname)
first=$(echo $WORKER_IPS | awk '{print $1}')
if [ -n "$first" ]; then
    my_ip=$(ip -o -4 route get "$first" 2>/dev/null | sed -n 's/.* src \([0-9.]*\).*/\1/p')
else
    my_ip=$(hostname -I 2>/dev/null | awk '{print $1}')
fi
slots=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${slots:-0}" -gt 0 ] 2>/dev/null || slots=1

# wait for every node's sshd (bare metal boots in 10-20 min), then record its host key
: >"$LIB/known_hosts"
known=""
peers="$me $my_ip $slots"
set -- $WORKER_NAMES
for ip in $my_ip $WORKER_IPS; do
    if [ "$ip" = "$my_ip" ]; then name=$me; else name=$1; shift; peers="$peers
$name $ip $slots"; fi
    tries=0
    until keys=$(ssh-keyscan -T 5 -t ed25519 "$ip" 2>/dev/null) && [ -n "$keys" ]; do
        tries=$((tries + 1))
        [ $tries -lt 360 ] || { say "FAILED: $name ($ip) never answered on port 22"; exit 5; }
        sleep 5
    done
    printf '%s\n' "$keys" >>"$LIB/known_hosts"
    known="$known$(printf '%s\n' "$keys" | awk -v n="$name" '{print n","$1" "$2" "$3}')
"
done

lease_id=null
lease_end=null
vd=/var/cache/vendordata2.json
if [ -r "$vd" ] && command -v python3 >/dev/null; then
    lease_id=$(python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["chameleon"].get("lease_id")))' "$vd" 2>/dev/null || echo null)
    lease_end=$(python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["chameleon"].get("lease_end")))' "$vd" 2>/dev/null || echo null)
fi
nodes_json=$(printf '%s\n' "$peers" | awk 'BEGIN{s=""} NF>=3{s=s (s?", ":"") "{\"name\": \""$1"\", \"ip\": \""$2"\", \"slots\": "$3"}"} END{print s}')
cluster_json="{\"name\": \"$STACK\", \"cloud\": \"heat\", \"stack\": \"$STACK\", \"head\": \"$me\", \"nodes\": [$nodes_json], \"lease_id\": $lease_id, \"lease_end\": $lease_end}"

# The inputs of contextualize.sh for one node, as shell assignments (sent on stdin, never on a command line).
inputs() {
    cat <<EOF
APPLIANCE_NODE='$1'
APPLIANCE_ETC='$ETC'
APPLIANCE_SSH_DIR='$LHOME/.ssh'
APPLIANCE_OWNER='$( [ "$LUSER" = root ] || echo "$LUSER" )'
APPLIANCE_CLUSTER_PUB='$CLUSTER_PUB'
APPLIANCE_CLUSTER_KEY=\$(cat <<'APPLIANCE_V_EOF'
$(cat "$LIB/cluster_key")
APPLIANCE_V_EOF
)
APPLIANCE_PEERS=\$(cat <<'APPLIANCE_V_EOF'
$peers
APPLIANCE_V_EOF
)
APPLIANCE_KNOWN_HOSTS=\$(cat <<'APPLIANCE_V_EOF'
$known
APPLIANCE_V_EOF
)
APPLIANCE_CLUSTER_JSON=\$(cat <<'APPLIANCE_V_EOF'
$cluster_json
APPLIANCE_V_EOF
)
EOF
    cat "$LIB/contextualize.sh"
}

inputs "$me" | sh >"$LIB/context-$me.out"
set -- $WORKER_NAMES
for ip in $WORKER_IPS; do
    name=$1
    shift
    inputs "$name" | ssh -i "$LIB/cluster_key" -o UserKnownHostsFile="$LIB/known_hosts" -o StrictHostKeyChecking=yes \
        -o BatchMode=yes -o ConnectTimeout=10 "$LUSER@$ip" "$SUDO sh -s" >"$LIB/context-$name.out"
done
nic=$(sed -n 's/^APPLIANCE_NIC=//p' "$LIB/context-$me.out")
say "head $me ready: $(printf '%s\n' "$peers" | grep -c .) node(s), NIC $nic; adopt with: appliance adopt $STACK"
