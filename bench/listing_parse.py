"""The launcher's CPU per server in a Nova listing: openstacksdk's Server resource built from a listed server's JSON
(what `up` paid per server a round, before) against appliance.sites.openstack.ListedServer (now). 64 servers as
Nova 2.1 lists them (nova/api/openstack/compute/views/servers.py), best of 5.

    .venv/bin/python bench/listing_parse.py
"""
import json, time
from openstack.compute.v2.server import Server
from appliance.sites.openstack import ListedServer
d = {"id": "6c2b5f1e-0c7e-4a8e-9b7e-5a0c0d0e0f01", "name": "run-12", "status": "BUILD", "tenant_id": "p"*32, "user_id": "u"*32,
     "metadata": {}, "hostId": "h"*56, "image": {"id": "i"*36, "links": []}, "flavor": {"id": "baremetal", "links": []},
     "created": "2026-11-26T01:00:00Z", "updated": "2026-11-26T01:00:05Z",
     "addresses": {"sharednet1": [{"version": 4, "addr": "10.140.81.12", "OS-EXT-IPS:type": "fixed", "OS-EXT-IPS-MAC:mac_addr": "fa:16:3e:00:00:01"}]},
     "accessIPv4": "", "accessIPv6": "", "links": [], "OS-DCF:diskConfig": "MANUAL", "progress": 0,
     "OS-EXT-AZ:availability_zone": "nova", "config_drive": "", "key_name": "k", "OS-SRV-USG:launched_at": None,
     "OS-SRV-USG:terminated_at": None, "security_groups": [{"name": "default"}], "OS-EXT-STS:task_state": "spawning",
     "OS-EXT-STS:vm_state": "building", "OS-EXT-STS:power_state": 0, "os-extended-volumes:volumes_attached": []}
body = json.dumps({"servers": [dict(d, name=f"run-{i}") for i in range(64)]})
for label, fn in (("openstacksdk Server per listed server", lambda s: Server.existing(**s)), ("ListedServer.from_nova", ListedServer.from_nova)):
    best = 1e9
    for _ in range(5):
        t = time.process_time()
        out = [fn(s) for s in json.loads(body)["servers"]]
        best = min(best, time.process_time() - t)
    print(f"{label}: {best * 1000 / 64:.3f} ms CPU per server (64 servers, best of 5)")
