"""Presigned S3 URLs (AWS Signature Version 4, query parameters), signed here in microseconds.

botocore's ``generate_presigned_url`` costs ~0.3 ms of CPU per URL (measured: bench/results/stage-rgw.md), more than
a 100 KB GET itself through ``httpget``; the stager signs one URL per object, and its listing pages and part HEADs
too, so a stager through S3 never imports boto3 (its import and client cost 0.21-0.25 s of CPU: docs/staging.md).
The algorithm is AWS's "Authenticating Requests: Using Query Parameters (AWS Signature Version 4)"
(docs.aws.amazon.com/AmazonS3/latest/API/sigv4-query-string-auth.html), as botocore implements it in
``botocore/auth.py`` (``S3SigV4QueryAuth``): path-style URL, only ``host`` signed (so a Range header may be added),
payload ``UNSIGNED-PAYLOAD``. tests/test_httpget.py checks that it gives botocore's signature byte for byte
(GetObject, ListObjectsV2, HeadObject with a part number); the e2e staging tests have a real Ceph RGW and OpenStack
Swift's s3api accept it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import re
import time
from urllib.parse import quote, urlsplit

_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.~/-]*")  # what quote(key, safe="/~") leaves as it is
_clock = time.time


def _hmac(key: bytes, msg: str) -> bytes:
    """HMAC-SHA256 with an HMAC object, not hmac.digest: CPython's one-shot (_hashlib.hmac_digest) gives the GIL back
    around even a 150-byte message, a hand-over per URL among the stager's threads (1.2 waits for the GIL per object
    in bench/results/stage-switches/gil-waits.txt); an HMAC object's update keeps it below 2 KiB."""
    return hmac.new(key, msg.encode(), "sha256").digest()


class Presigner:
    def __init__(self, endpoint: str, access_key: str, secret_key: str, region: str):
        u = urlsplit(endpoint.rstrip("/"))
        self.scheme, self.host, self.base = u.scheme, u.netloc, u.path
        self.access_key, self.secret_key, self.region = access_key, secret_key, region
        self._keys: dict[str, bytes] = {}  # date -> signing key (derived once a day)
        self._second: tuple = (None, "", "")  # (the clock's second, its X-Amz-Date, its date)
        self._query: tuple = (None, "")  # ((X-Amz-Date, expires), a GET's query string without parameters)

    def _signing_key(self, date: str) -> bytes:
        k = self._keys.get(date)
        if k is None:
            k = _hmac(_hmac(_hmac(_hmac(f"AWS4{self.secret_key}".encode(), date), self.region), "s3"), "aws4_request")
            self._keys = {date: k}
        return k

    def url(self, bucket: str, key: str = "", *, method: str = "GET", params: dict[str, str] | None = None,
            expires: int = 3600, now: dt.datetime | None = None) -> str:
        """The presigned URL of ``method bucket/key?params`` (no key: the bucket itself, as a listing asks); send it
        with ``Host: self.host`` (what was signed)."""
        if now is None:  # one URL per object: what changes only once a second is made once a second (~6 us a URL)
            sec, second = int(_clock()), self._second  # read once: other threads sign with this presigner too
            if second[0] != sec:
                now = dt.datetime.fromtimestamp(sec, dt.timezone.utc)
                second = self._second = (sec, now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d"))
            amz_date, date = second[1], second[2]
        else:
            amz_date, date = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        scope = f"{date}/{self.region}/s3/aws4_request"
        path = f"{self.base}/{quote(bucket, safe='~')}"
        if key:
            path += "/" + (key if _PLAIN_KEY.fullmatch(key) else quote(key, safe="/~"))
        cached = self._query
        if params or cached[0] != (amz_date, expires):
            query = "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted({
                **(params or {}),
                "X-Amz-Algorithm": "AWS4-HMAC-SHA256", "X-Amz-Credential": f"{self.access_key}/{scope}",
                "X-Amz-Date": amz_date, "X-Amz-Expires": str(expires), "X-Amz-SignedHeaders": "host"}.items()))
            if not params:
                self._query = ((amz_date, expires), query)
        else:
            query = cached[1]
        canonical = f"{method}\n{path}\n{query}\nhost:{self.host}\n\nhost\nUNSIGNED-PAYLOAD"
        to_sign = f"AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        sig = _hmac(self._signing_key(date), to_sign).hex()
        return f"{self.scheme}://{self.host}{path}?{query}&X-Amz-Signature={sig}"
