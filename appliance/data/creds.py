"""Object-store credentials, from the same place as provisioning.

Order: Swift v1 variables (ST_AUTH, ST_USER, ST_KEY) if set; else the local cloud's Swift for
``cloud: local``; else Keystone (OS_CLOUD / OS_*): the object-store endpoint from the catalog and a
token. S3 keys come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY with APPLIANCE_S3_ENDPOINT (on
Chameleon, EC2 credentials from `openstack ec2 credentials create`, endpoint https://chi.uc.chameleoncloud.org:7480).
"""

from __future__ import annotations

import os

from .store import StoreCreds


def _s3_from_env(creds: StoreCreds) -> StoreCreds:
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        creds.s3_access_key = env["AWS_ACCESS_KEY_ID"]
        creds.s3_secret_key = env["AWS_SECRET_ACCESS_KEY"]
        creds.s3_endpoint = env.get("APPLIANCE_S3_ENDPOINT") or creds.s3_endpoint
        creds.s3_region = env.get("AWS_DEFAULT_REGION", creds.s3_region)
    return creds


def resolve(cloud: str = "local", site: str | None = None, log=print) -> StoreCreds:
    env = os.environ
    if env.get("ST_AUTH") and env.get("ST_USER") and env.get("ST_KEY"):
        return _s3_from_env(StoreCreds(auth_url=env["ST_AUTH"], user=env["ST_USER"], key=env["ST_KEY"]))
    if cloud == "local":
        from .. import localcloud

        return _s3_from_env(StoreCreds(**localcloud.swift(log=log)))
    from ..provision.openstack import connect

    conn = connect(region=site)
    return _s3_from_env(StoreCreds(storage_url=conn.object_store.get_endpoint(), token=conn.session.get_token()))
