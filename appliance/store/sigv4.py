"""Presigned S3 URLs (AWS Signature Version 4, query parameters), signed by botocore (``botocore.auth.
S3SigV4QueryAuth``, what ``generate_presigned_url`` uses) without a boto3 client: path-style URL, only ``host``
signed (so a Range header may be added), payload ``UNSIGNED-PAYLOAD``. The stager signs one URL per object, its
listing pages and part HEADs too, and so never builds a boto3 client. tests/test_httpget.py checks the URLs against a
client's ``generate_presigned_url``; the e2e staging tests have a real Ceph RGW and OpenStack Swift's s3api accept
them."""

from __future__ import annotations

from urllib.parse import quote, urlsplit


class Presigner:
    def __init__(self, endpoint: str, access_key: str, secret_key: str, region: str):
        from botocore.auth import S3SigV4QueryAuth
        from botocore.credentials import Credentials

        u = urlsplit(endpoint.rstrip("/"))
        self.scheme, self.host, self.base = u.scheme, u.netloc, u.path
        self._creds, self._region = Credentials(access_key, secret_key), region
        self._auth = S3SigV4QueryAuth

    def url(self, bucket: str, key: str = "", *, method: str = "GET", params: dict[str, str] | None = None,
            expires: int = 3600) -> str:
        """The presigned URL of ``method bucket/key?params`` (no key: the bucket itself, as a listing asks); send it
        with ``Host: self.host`` (what was signed)."""
        from botocore.awsrequest import AWSRequest

        path = f"{self.base}/{quote(bucket, safe='~')}" + (f"/{quote(key, safe='/~')}" if key else "")
        req = AWSRequest(method=method, url=f"{self.scheme}://{self.host}{path}", params=dict(params or {}))
        self._auth(self._creds, "s3", self._region, expires=expires).add_auth(req)
        return req.prepare().url
