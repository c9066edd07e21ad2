#!/bin/sh
# appliance: publish this node's SSH host public keys to its owner, so the launcher can pin them before it connects.
#
# Bare-metal servers have no console log (Nova's Ironic driver has no get_console_output), so cloud-init's printed
# fingerprints never reach the API. Nova's metadata `password` is the channel from a server to its owner: only the
# server itself can POST it (the metadata proxy identifies it by its address), once; the owner reads it with
# `GET /servers/{id}/os-server-password` (nova/api/metadata/password.py, server_password.py). Public keys only:
# nothing secret travels in user_data or through the metadata service.
# `appliance up` passes this file as user_data; the Heat template's boot script includes it.
MD=http://169.254.169.254/openstack/latest
keys=""
for f in /etc/ssh/ssh_host_ed25519_key.pub /etc/ssh/ssh_host_ecdsa_key.pub; do
    [ -r "$f" ] && keys="$keys$(awk '{print $1" "$2}' "$f")
"
done
if [ -n "$keys" ]; then
    body="appliance-hostkeys/1
$keys"
    tries=0
    # the metadata service can be slow to answer right after boot; 409 means the keys are already there
    until code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 10 -X POST --data-binary "$body" "$MD/password"); \
          [ "$code" = 200 ] || [ "$code" = 409 ]; do
        tries=$((tries + 1))
        [ "$tries" -ge 30 ] && { echo "appliance: could not publish host keys (HTTP $code)" >&2; break; }
        sleep 2
    done
fi
