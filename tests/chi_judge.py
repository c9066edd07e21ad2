"""Run by tests/test_provision.py::test_python_chi_speaks_to_the_local_cloud under .venv-chi (python-chi,
Chameleon's own client, requirements-chi.lock), against `appliance cloud start`, unchanged: the object API of
python-chi's docs ("Getting started": a lease with a node and a floating IP, a server on it, the floating IP
associated, SSH, everything deleted). Credentials come as OS_* variables, as in Chameleon's Jupyter. Prints one JSON
line of what it saw; any exception is the test's failure."""

import datetime as dt
import json
import sys
import time

import chi.lease
import chi.server

name = sys.argv[1]
seen = {}
lease = chi.lease.Lease(name, duration=dt.timedelta(hours=2))
lease.add_node_reservation(amount=1, node_type="compute_local")
lease.add_fip_reservation(amount=1)
lease.submit(wait_for_active=True, wait_timeout=120)
seen["lease_status"] = lease.status
seen["reserved_fips"] = lease.get_reserved_floating_ips()
seen["listed"] = [x.name for x in chi.lease.list_leases()]
server = chi.server.Server(f"{name}-0", reservation_id=lease.node_reservations[0]["id"], image_name="appliance-cpu")
seen["boot_errors"] = []
asking_until = time.monotonic() + 120  # the reserved node's cleaning: seconds here, minutes on Chameleon
while True:
    server.submit(wait_for_active=True, wait_timeout=300, show="text")
    if server.status == "ACTIVE" or time.monotonic() > asking_until:
        break
    # python-chi's wait returns at ERROR too: "No valid host" while the reserved node is still cleaned after an
    # earlier server's delete (Ironic, as on Chameleon: the local cloud's rows in docs/localcloud.md); a user
    # deletes it and asks again a moment later
    seen["boot_errors"].append(str((server.conn.compute.get_server(server.id).fault or {}).get("message")))
    server.delete()
    while any(x.id == server.id for x in server.conn.compute.servers()):  # Nova's delete is asynchronous
        time.sleep(0.5)
    time.sleep(1)  # a user's pause before asking again: nothing says when a cleaning ends
seen["server_status"] = server.status
# the lease's own floating IP: without one, python-chi takes the first unbound floating IP of the project
# (chi/network.py get_free_floating_ip), which may be another lease's
try:
    seen["fip"] = server.associate_floating_ip(seen["reserved_fips"][0])
except Exception:  # python-chi swallows the API's answer for each port: say the server's ports and state
    st = server.conn.compute.get_server(server.id)
    print("server", st.status, st.fault, "ports", [(p.id, p.fixed_ips) for p in
                                                    server.conn.network.ports(device_id=server.id)], file=sys.stderr)
    raise
server.check_connectivity(timeout=120, show="text")
# python-chi's default login user, cc, as CC images make it (and the local cloud's images do)
seen["hostname"] = server.ssh_connection().run("hostname", hide=True).stdout.strip()
seen["sudo"] = server.ssh_connection().run("sudo -n id -u", hide=True).stdout.strip()
server.delete()
lease.delete()
again = chi.lease.Lease(name, duration=dt.timedelta(hours=1))  # a deleted lease's name can be used again
again.add_node_reservation(amount=1, node_type="compute_local")
again.submit(wait_for_active=True, wait_timeout=120)
seen["again_status"] = again.status
again.delete()
seen["after"] = [x.name for x in chi.lease.list_leases()]
print("CHI_JUDGE " + json.dumps(seen))
