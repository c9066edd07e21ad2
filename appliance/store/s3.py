"""S3 (boto3; Chameleon's Ceph RGW, or Swift's s3api)."""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import ApplianceError
from .tcp import quickack_boto
from .. import report

from .base import MAX_OBJECT, S3_PAGE, SEGMENTS_IN_FLIGHT, ObjectInfo, StoreCreds, StoreRefused, _status, transient_retry, _check_name, Store, quota_exceeded, date_header
from .hashes import EMPTY_MD5, _b64, _damaged, _crc_header, _Slice, large_object_etags, crc_from

log = report.get(__name__)
class S3Store(Store):
    scheme = "s3"

    def __init__(self, bucket: str, creds: StoreCreds):
        if not (creds.s3_endpoint and creds.s3_access_key and creds.s3_secret_key):
            raise ApplianceError("no S3 credentials or endpoint",
                                 "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY and APPLIANCE_S3_ENDPOINT "
                                 "(`openstack ec2 credentials create` makes the keys)")
        self.bucket = self.where = bucket
        self.creds = creds
        self._client = None
        self._presigner = None
        self._no_part_numbers = False  # the store ignores ?partNumber (part_sizes)
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return self.creds.s3_endpoint or ""

    def forked(self) -> None:
        self._client, self._lock = None, threading.Lock()

    def client(self):
        """One client for all threads: botocore's clients are thread-safe ("Low-level clients are thread safe",
        boto3's guide to multithreading), and each costs milliseconds of CPU to build (a client per thread cost
        the stager's 32 threads more than their downloads of small objects)."""
        with self._lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                # s3v4 also for presigned URLs (botocore presigns with SigV2 unless told), which every RGW accepts.
                # Timestamps stay the strings the store sent: botocore parses each listed object's LastModified
                # with dateutil, 60% of a listing's CPU (0.126 -> 0.050 ms per object listed, measured against
                # the real RGW), and nothing here reads them.
                # No CRC32 of botocore's own on uploads (its default since 1.36: `when_supported`): every PUT
                # we send carries its bytes' MD5 (Content-MD5, which the store checks: put), the CRC cost 0.6 s of
                # CPU per 1.6 GB (make bench-stage STORE=rgw, the upload rows), and RGWs before Squid do not know the
                # x-amz-checksum-* headers and aws-chunked trailers it sends them with over HTTPS (ceph/ceph PRs
                # 49986 and 63326; red-hat-storage/ceph-qe-scripts PR 766 lists the failures it met).
                # No SHA-256 of the payload either (UNSIGNED-PAYLOAD; the signature still covers every header,
                # Content-MD5 with them): botocore leaves it out itself over https when a PUT carries a checksum
                # header (botocore/auth.py S3SigV4Auth._should_sha256_sign_payload), and signs every byte over http
                # or without one. Ours always carry Content-MD5; the SHA-256 cost 0.5-0.6 s of CPU per 768 MiB
                # uploaded (1.08-1.21 s against 0.50-0.58, 3 rounds each, one RGW here).
                session = boto3.session.Session()
                session._session.get_component("response_parser_factory").set_parser_defaults(
                    timestamp_parser=str)
                self._client = session.client(
                    "s3", endpoint_url=self.creds.s3_endpoint, aws_access_key_id=self.creds.s3_access_key,
                    aws_secret_access_key=self.creds.s3_secret_key, region_name=self.creds.s3_region,
                    config=Config(retries={"max_attempts": 1},
                                  s3={"addressing_style": "path", "payload_signing_enabled": False},
                                  max_pool_connections=64, signature_version="s3v4",
                                  request_checksum_calculation="when_required"))
                quickack_boto(self._client)  # small answers from Ceph RGW without a 40 ms wait each (tcp.py)
            return self._client

    def _signer(self):
        if self._presigner is None:
            from .sigv4 import Presigner

            self._presigner = Presigner(self.creds.s3_endpoint, self.creds.s3_access_key, self.creds.s3_secret_key,
                                        self.creds.s3_region)
        return self._presigner

    def _ask(self, method: str, key: str = "", params: dict | None = None) -> tuple[int, dict, bytes]:
        """One small signed request (a listing page, a HEAD) through httpget's connections: the stager lists and
        asks for part sizes without importing boto3 (0.21-0.25 s of CPU on each node's start: docs/staging.md)."""
        from .httpget import request

        signer = self._signer()
        return request(method, signer.url(self.bucket, key, method=method, params=params), {"Host": signer.host})

    def _list_page(self, prefix: str, token: str | None):
        """One ListObjectsV2 page (AWS's API reference: ListObjectsV2), its names URL-encoded by the store
        (``encoding-type=url``, as boto3 asks: a name with characters XML 1.0 cannot carry still lists)."""
        from xml.etree import ElementTree

        from .httpget import HTTPError

        params = {"list-type": "2", "prefix": prefix, "encoding-type": "url", "max-keys": str(S3_PAGE),
                  **({"continuation-token": token} if token else {})}
        status, _, body = self._ask("GET", params=params)
        if status >= 300:
            m = re.search(rb"<Code>([^<]{1,64})</Code>", body)
            code = m.group(1).decode(errors="replace") if m else None
            if code == "NoSuchBucket" or (status == 404 and code is None):
                raise FileNotFoundError(f"s3://{self.bucket}: no such bucket")
            if status in (401, 403):
                raise self._refused(code or str(status))
            raise HTTPError(status, "", f"{self.endpoint}/{self.bucket}", code=code)
        try:
            page = ElementTree.fromstring(body)
        except ElementTree.ParseError:
            page = None
        if page is None or not page.tag.endswith("ListBucketResult"):
            raise ApplianceError(f"the S3 endpoint {self.endpoint} answered a bucket listing with something that "
                                 f"is not one ({body[:60]!r})", "check APPLIANCE_S3_ENDPOINT (the object store's "
                                 "S3 endpoint, e.g. https://chi.tacc.chameleoncloud.org:7480)")
        return page

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under ``prefix``, a page of up to 1,000 after another while the store says the listing is
        truncated; a page that fails transiently is asked again (up to LIST_DEADLINE)."""
        from urllib.parse import unquote_plus

        ns = "{http://s3.amazonaws.com/doc/2006-03-01/}"
        token = None
        while True:
            page = transient_retry(lambda: self._list_page(prefix, token), deadline=self.list_deadline,
                                   note=self._retry_note())
            for o in page.iterfind(f"{ns}Contents"):
                # botocore decodes these names with unquote_plus (botocore/handlers.py decode_list_object_v2):
                # AWS writes a space as '+', Ceph RGW and Swift's s3api as %20, and both write '+' as %2B
                name, size = unquote_plus(o.findtext(f"{ns}Key")), int(o.findtext(f"{ns}Size"))
                etag = (o.findtext(f"{ns}ETag") or "").strip('"')
                if etag == EMPTY_MD5 and size > 0:  # Ceph RGW lists a Swift SLO by its manifest here too: HEAD
                    status, h, _ = transient_retry(lambda: self._ask("HEAD", name), deadline=self.list_deadline)
                    if status < 300:
                        size, etag = int(h.get("content-length", size)), h.get("etag", etag).strip('"')
                yield ObjectInfo(name, size, etag)
            token = page.findtext(f"{ns}NextContinuationToken")
            if page.findtext(f"{ns}IsTruncated") != "true" or not token:
                return

    def get(self, name, write, *, start=None, end=None) -> dict:
        kw = {"Range": f"bytes={start}-{'' if end is None else end}"} if start is not None else {}
        r = self.client().get_object(Bucket=self.bucket, Key=name, **kw)
        for chunk in r["Body"].iter_chunks(1 << 20):
            write(chunk)
        return {k.lower(): v for k, v in r["ResponseMetadata"]["HTTPHeaders"].items()}

    def fetch(self, name, fd, offset, sink=None, *, start=None, end=None, on_headers=None, deadline=None):
        from .httpget import HTTPError, get_into

        # a presigned URL signs only the host, so the Range header may be added (sigv4: botocore's signer)
        signer = self._signer()
        url = signer.url(self.bucket, name)
        headers = {"Host": signer.host}
        if start is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end}"
        try:
            return get_into(url, headers, fd, offset, sink, on_headers=on_headers, deadline=deadline)
        except HTTPError as e:
            if e.http_status == 404:
                raise FileNotFoundError(f"s3://{self.bucket}/{name}") from None
            if e.http_status in (401, 403):
                raise self._refused(str(e.http_status)) from None
            raise

    def crc32(self, name, etag):
        status, h, _ = self._ask("HEAD", name)
        if status == 404:
            raise FileNotFoundError(f"s3://{self.bucket}/{name}")
        return crc_from(h, etag) if status < 300 else None

    def part_sizes(self, name, n, *, every=False):
        """HEAD ?partNumber=K: AWS, OpenStack Swift's s3api (swift/common/middleware/s3api/controllers/obj.py) and
        Ceph RGW from Reef on answer with that part's length, its Content-Range and x-amz-mp-parts-count. Ceph RGW
        16 (Pacific) answers with the whole object and no count: then None, and this store is not asked again.
        Any refusal of a HEAD is None too (the parts' sizes are then guessed: store/parts.py)."""
        from .parts import layout

        if self._no_part_numbers:
            return None
        sizes = []
        for k in range(1, (n if every else 1) + 1):
            status, h, _ = self._ask("HEAD", name, {"partNumber": str(k)})
            if status >= 300:
                return None
            count = h.get("x-amz-mp-parts-count")
            if count is None or not count.isdigit() or int(count) != n:
                self._no_part_numbers = count is None
                return None
            sizes.append(int(h.get("content-length", "0")))
        if every:
            return sizes
        total = str(h.get("content-range", "")).rpartition("/")[2]
        return layout(int(total), sizes[0]) if total.isdigit() and sizes[0] > 0 else None

    def _refused(self, why: str) -> StoreRefused:
        return StoreRefused(f"S3 refused access to bucket {self.bucket!r} ({why})",
                            "check the EC2 keys (`openstack ec2 credentials list`; AWS_ACCESS_KEY_ID, "
                            "AWS_SECRET_ACCESS_KEY) and that the bucket is yours at this site")

    def _keys_refused(self) -> StoreRefused | None:
        """After a 403 without a body (a HEAD): whether the store refuses our keys themselves, asked with a request
        any valid keys may make (the list of our buckets). None when the keys are good."""
        from botocore.exceptions import ClientError

        try:
            self.client().list_buckets()
            return None
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code") or str(_status(e))
            return StoreRefused(f"S3 refused the keys ({code})",
                                "check the EC2 keys (`openstack ec2 credentials list`; AWS_ACCESS_KEY_ID, "
                                "AWS_SECRET_ACCESS_KEY) and APPLIANCE_S3_ENDPOINT")

    def put(self, name, path, *, segment_size=MAX_OBJECT, md5s=None) -> str:
        """A file of ``segment_size`` bytes or more goes up in parts (a multipart upload, parts as boto3's upload_file
        sizes them: store/parts.py s3transfer_part, so the ETag is the one ``data upload`` expects), others in one
        PUT. Every PUT carries its bytes' MD5 (Content-MD5): the store refuses bytes that differ (400 BadDigest;
        AWS's PutObject and UploadPart, ceph src/rgw/rgw_op.cc, swift's s3api), and a multipart upload is completed
        only once every part is in as sent, so a failed upload leaves the key what it was."""
        from botocore.exceptions import ClientError

        from .parts import s3transfer_part

        path = Path(path)
        size = path.stat().st_size
        part = s3transfer_part(segment_size, size)
        if md5s is None or (size >= segment_size and len(md5s.get("parts") or [0]) != max(1, -(-size // part))):
            # the store checks the bytes against these, and its CRC_META is from the same reads (a caller's, made
            # for parts of another size than S3's smallest, would send every part with a wrong Content-MD5)
            md5s = large_object_etags(path, part, whole=False)
        # a file of segment_size or more goes in parts ("<md5 of the MD5s>-N", or -1 for one part)
        one = md5s.get("md5") and hashlib.md5(bytes.fromhex(md5s["md5"])).hexdigest() + "-1"
        want = md5s.get("md5") if size < segment_size else md5s.get("s3") or one
        meta = _crc_header("", md5s, want) or {}
        try:
            if size < segment_size:
                with open(path, "rb") as fh:
                    got = self.client().put_object(Bucket=self.bucket, Key=name, Body=fh, ContentLength=size,
                                                   Metadata=meta, ContentMD5=_b64(want))["ETag"]
            else:
                got = self._put_parts(name, path, size, part, md5s.get("parts") or [md5s["md5"]], meta)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if code == "NoSuchBucket":  # said as Swift's missing container
                raise FileNotFoundError(f"s3://{self.bucket}: no such bucket") from None
            if code in ("BadDigest", "InvalidDigest"):
                raise _damaged(name, want, None) from None
            if code == "QuotaExceeded":
                raise quota_exceeded(f"s3://{self.bucket}/") from None
            raise
        if got.strip('"') != want:
            raise _damaged(name, want, got)
        return got.strip('"')

    def _put_parts(self, name: str, path: Path, size: int, part: int, md5s: list[str], meta: dict) -> str:
        """A multipart upload: the parts in parallel (SEGMENTS_IN_FLIGHT, each on its own connection of the shared
        client), each with its Content-MD5; completed once all are in, else aborted (the parts are dropped and the
        key keeps what it held). Returns the store's ETag."""
        client = self.client()
        up = client.create_multipart_upload(Bucket=self.bucket, Key=name, Metadata=meta)["UploadId"]

        def one(i: int) -> dict:
            off, n = i * part, min(part, size - i * part)
            with open(path, "rb") as fh:  # a handle per part; streamed, never held in memory
                fh.seek(off)
                body = _Slice(fh, n)
                etag = client.upload_part(Bucket=self.bucket, Key=name, UploadId=up, PartNumber=i + 1, Body=body,
                                          ContentLength=n, ContentMD5=_b64(md5s[i]))["ETag"]
            if body.left or etag.strip('"') != md5s[i]:  # the file ended early; a store that did not check
                raise _damaged(f"part {i + 1} of {name}", md5s[i], etag)
            return {"PartNumber": i + 1, "ETag": etag}

        try:
            with ThreadPoolExecutor(max_workers=min(SEGMENTS_IN_FLIGHT, len(md5s))) as pool:
                done = list(pool.map(one, range(len(md5s))))
            etag = client.complete_multipart_upload(Bucket=self.bucket, Key=name, UploadId=up,
                                                    MultipartUpload={"Parts": done}).get("ETag")
            # Ceph RGW 16 answers the completion with an empty <ETag> (radosgw 16.2.15 here); its HEAD has it
            return etag or client.head_object(Bucket=self.bucket, Key=name)["ETag"]
        except BaseException:
            try:
                client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=up)
            except Exception:  # noqa: BLE001 - the store's lifecycle rules drop what an abort could not
                pass
            raise

    def delete(self, name) -> None:
        self.client().delete_object(Bucket=self.bucket, Key=name)

    def create(self, name, data) -> bool:
        """PutObject with ``If-None-Match: *`` (AWS S3's conditional write; Ceph RGW's S3 API reads it in
        src/rgw/rgw_rest_s3.cc ``RGWPutObj_ObjStore_S3::get_params`` and refuses an existing object with 412,
        src/rgw/driver/rados/rgw_rados.cc)."""
        from botocore.exceptions import ClientError

        try:
            self.client().put_object(Bucket=self.bucket, Key=name, Body=data, ContentMD5=_b64(
                hashlib.md5(data).hexdigest()), IfNoneMatch="*")
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412 or \
                    e.response.get("Error", {}).get("Code") == "PreconditionFailed":
                return False
            if e.response.get("Error", {}).get("Code") == "NoSuchBucket":
                raise FileNotFoundError(f"s3://{self.bucket}: no such bucket") from None
            raise
        return True

    def reach(self) -> None:
        """One signed request (HEAD of the bucket): the client built, the keys' first check by the store."""
        from botocore.exceptions import ClientError

        try:
            self.client().head_bucket(Bucket=self.bucket)
        except ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 404:
                raise FileNotFoundError(f"s3://{self.bucket}") from None
            if status in (401, 403):  # someone else's bucket, or keys the store does not take (HEAD says not which)
                raise (self._keys_refused() or self._taken()) from None
            raise

    def clock(self) -> float:
        from botocore.exceptions import ClientError

        try:
            got = self.client().head_bucket(Bucket=self.bucket)
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                raise FileNotFoundError(f"s3://{self.bucket}") from None
            raise
        return date_header(got.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date"))

    def _taken(self) -> StoreRefused:
        return StoreRefused(f"S3 bucket {self.bucket!r} belongs to someone else (bucket names are shared by every "
                            "project of the store)", "choose another bucket name in the s3:// URL")

    def ensure_container(self) -> None:
        """The bucket, made when it is not there (as SwiftStore makes its container): HEAD, then PUT. On a Ceph
        RGW without tenants (Chameleon's) bucket names are one namespace for every project, so a name another
        project holds is refused (403 on HEAD, 409 BucketAlreadyExists on PUT): said with the fix."""
        from botocore.exceptions import ClientError

        _check_name("s3", self.bucket)
        taken = self._taken()
        try:
            self.client().head_bucket(Bucket=self.bucket)
            return
        except ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status in (401, 403):  # someone else's bucket, or keys the store does not take (HEAD says not which)
                raise (self._keys_refused() or taken) from None
            if status != 404:
                raise
        try:
            self.client().create_bucket(Bucket=self.bucket)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if code == "BucketAlreadyExists":
                raise taken from None
            if _status(e) in (401, 403):
                raise self._refused(code or str(_status(e))) from None
            if code != "BucketAlreadyOwnedByYou":  # made meanwhile by another of our uploads
                raise
