"""Provisioning: leases, servers, floating IPs, and contextualizing the cluster they form."""
