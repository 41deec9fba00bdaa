"""The one S3 client of reelcache: a root or a file may be ``s3://bucket/prefix`` (docs/STORAGE.md).

Everything that reads or writes object storage goes through these functions, on boto3: no request is signed or
sent by hand. One layer of retries a request: the reads (GETs) are retried by ours alone (``_retrying``, below;
botocore's off under it), every other request by botocore's standard retry mode (``ATTEMPTS`` tries in all).
The endpoint, the region and the credentials are found the standard way: ``AWS_ENDPOINT_URL`` (a non-AWS
server: SeaweedFS, MinIO, Ceph RGW, R2), ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE`` and the shared config files.

What the functions promise, whatever the network does:

- a read never returns short or wrong bytes: the length is checked against what was asked (and the
  server's ``Content-Range``), a whole object's checksum is checked where the store keeps one
  (``x-amz-checksum-*``, which botocore validates); a body cut short, reset or failing its checksum is read
  again, at most ``ATTEMPTS`` times, with full-jitter exponential backoff (``_backoff``);
- a stall (no byte for ``REELCACHE_S3_STALL_S`` seconds, default 120) ends in one line naming the object
  (``Stalled``), never a hang;
- a write is whole or absent: ``put`` is one PUT (optionally conditional: ``if_none_match`` creates only,
  ``if_match`` overwrites only that ETag); a PUT whose response was lost after the server committed it is
  recognised, when botocore's retry of it then fails its condition, by the token this write stamped in the
  object's metadata (``x-amz-meta-reelcache-write``): it was our own write, and succeeded;
- a large file is a multipart upload (``Upload``, 8 MB parts) completed only when told, aborted on failure:
  no reader ever sees part of it;
- ``check_root``: before any work, the bucket exists, the credentials work and the store honours
  conditional writes (the leases need them), each failure one line naming the bucket and what to do.

boto3 is the client for everything but ranged reads: the most used and best kept S3 client for Python, the
standard credential chain, standard retries, conditional writes, multipart uploads and flexible checksums.
Ranged reads (``get_range``: the training loader's one or two a sample, the viewer's, the cache's raw members)
are sent by obstore (Rust's object_store) with the same endpoint, region and credentials, its own retries off
and ours, the same checks, kept: measured on the loader, 1.2-1.7 ms of CPU a sample against boto3's 3.4-6.0
(docs/STORAGE.md, "How it is built"). obstore's runtime does not survive a fork: a process forked from one that
has used it (a DataLoader worker) reads by boto3.
"""

from __future__ import annotations

import os
import random
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from reelcache import UserError
from reelcache.settings import env_seconds

# boto3 is imported by the first call that needs a client: `reelcache --help` and plain local roots start without it.

ATTEMPTS = 5  # tries of one read (ours, botocore's retries off) and of any other request (botocore's), at most
BACKOFF_BASE_S = 0.05  # full jitter: sleep uniform(0, min(BACKOFF_CAP_S, BASE * 2**attempt))
BACKOFF_CAP_S = 5.0
PART_BYTES = 8 * 1024 * 1024  # multipart part size, and the size from which upload_file goes multipart
WRITE_TOKEN = "reelcache-write"  # metadata key stamped by put: a lost response is recognised as our own write
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class S3Error(UserError):
    """An S3 request failed for good (after its retries): one line naming the object and what to do."""


class Stalled(S3Error):
    """No byte came for REELCACHE_S3_STALL_S seconds."""


class PreconditionFailed(S3Error):
    """A conditional write lost: the object exists (If-None-Match) or changed (If-Match)."""


def stall_s() -> float:
    """``REELCACHE_S3_STALL_S`` (default 120): no byte from the store for this long ends a request."""
    return env_seconds("REELCACHE_S3_STALL_S", 120, ge=0.1, le=3600)


@dataclass(frozen=True)
class Url:
    """``s3://bucket/key``: a key ('' for a bucket's top), a prefix (a root) or an object."""

    bucket: str
    key: str = ""

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def __truediv__(self, part: str) -> Url:
        part = str(part).strip("/")
        return Url(self.bucket, f"{self.key.rstrip('/')}/{part}" if self.key.strip("/") else part)

    @property
    def name(self) -> str:
        return self.key.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> Url:
        return Url(self.bucket, self.key.rstrip("/").rpartition("/")[0])


def is_url(s) -> bool:
    return isinstance(s, Url) or (isinstance(s, str) and s.startswith("s3://"))


def parse(url) -> Url:
    """``s3://bucket[/prefix]`` -> Url; a malformed one is one line saying what is allowed."""
    if isinstance(url, Url):
        return url
    s = str(url)
    if not s.startswith("s3://"):
        raise UserError(f"{s!r} is not an S3 URL: expected s3://bucket/prefix")
    bucket, _, key = s[5:].partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise UserError(
            f"{s!r}: bucket {bucket!r} is not a valid bucket name (3-63 characters: lower-case letters, digits, "
            "'.' and '-', starting and ending with a letter or digit)"
        )
    return Url(bucket, key.strip("/"))


_clients: dict[tuple[int, float, bool], object] = {}
_clients_lock = threading.Lock()


def client(retried: bool = False):
    """This process's boto3 S3 client (thread-safe; one per process: a forked child makes its own). botocore's
    standard retries (ATTEMPTS tries in all) for every request but those `retried` by ours (``_retrying``: the
    reads, whose bodies botocore does not retry), which are tried once by botocore: a GET failing for good is
    tried ATTEMPTS times, not ATTEMPTS times ATTEMPTS."""
    key = (os.getpid(), stall_s(), retried)
    c = _clients.get(key)
    if c is None:
        import boto3
        from botocore.config import Config

        with _clients_lock:
            c = _clients.get(key)
            if c is None:
                conf = Config(
                    retries={"mode": "standard", "total_max_attempts": 1 if retried else ATTEMPTS},
                    connect_timeout=min(10.0, key[1]),
                    read_timeout=key[1],  # no byte for this long: a stall
                    max_pool_connections=32,
                    request_checksum_calculation="when_supported",
                    response_checksum_validation="when_supported",
                )
                c = _clients[key] = boto3.session.Session().client("s3", config=conf)
    return c


_stores: dict[tuple[int, float, str], object] = {}
_obstore_pid = 0  # the process that started obstore's runtime: its threads are not in a child forked from it


def _obstore_usable() -> bool:
    """Whether this process may use obstore: it started its runtime itself, or no ancestor did before forking it
    (obstore's tokio threads do not survive a fork, and a forked child's first request would hang)."""
    return _obstore_pid in (0, os.getpid())


def _store(bucket: str):
    """This process's obstore S3Store for `bucket`, the ranged reads' client (``get_range``): the endpoint, the
    region and the credentials are the boto3 client's (the same AWS_* environment, profiles and refreshes:
    obstore's Boto3CredentialProvider); no retries of its own (``_retrying``'s, as for every read); no byte for
    REELCACHE_S3_STALL_S is a timeout (``Stalled``)."""
    from datetime import timedelta

    key = (os.getpid(), stall_s(), bucket)
    st = _stores.get(key)
    if st is not None:
        return st
    import boto3
    from obstore.auth.boto3 import Boto3CredentialProvider
    from obstore.store import S3Store

    global _obstore_pid
    c = client()
    with _clients_lock:
        st = _stores.get(key)
        if st is None:
            _obstore_pid = os.getpid()
            session = boto3.session.Session()
            if session.get_credentials() is None:
                raise S3Error(
                    f"reading s3://{bucket}: no S3 credentials found: set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
                )
            ep = c.meta.endpoint_url
            st = _stores[key] = S3Store(
                bucket,
                endpoint=ep,
                region=c.meta.region_name or "us-east-1",
                credential_provider=Boto3CredentialProvider(session),
                client_options={
                    "allow_http": ep.startswith("http://"),
                    "connect_timeout": timedelta(seconds=min(10.0, key[1])),
                    "read_timeout": timedelta(seconds=key[1]),  # no byte for this long: a stall
                    "timeout": timedelta(days=1),  # no bound on a whole transfer that keeps moving
                    "pool_max_idle_per_host": "32",
                },
                retry_config={"max_retries": 0},
            )
    return st


def endpoint() -> str:
    return client().meta.endpoint_url


def _code(e) -> str:
    resp = getattr(e, "response", None) or {}
    return str(resp.get("Error", {}).get("Code", "")) or str(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


def _status(e) -> int:
    resp = getattr(e, "response", None) or {}
    return int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _backoff(attempt: int) -> None:
    time.sleep(random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt)))


_OB_STATUS = re.compile(r"non-2xx status code: (\d{3})")


def _obstore_kind(e: BaseException) -> str:
    """What an obstore error (``get_range``) is: 'stall' (no byte for the read timeout), 'transient' (a 5xx or
    a 429/408 answer, a body reset or cut short, no connection: read again), 'status' (another answer: final),
    '' (not obstore's)."""
    if not type(e).__module__.startswith("obstore"):
        return ""
    text = str(e)
    if "kind: Timeout" in text:
        return "stall"
    m = _OB_STATUS.search(text)
    if m:
        return "transient" if int(m[1]) >= 500 or int(m[1]) in (408, 429) else "status"
    if "request or response body error" in text or "error sending request" in text or "kind: Interrupted" in text:
        return "transient"
    return "status"


def _transient(e: BaseException) -> bool:
    """A body reset, cut short or failing its checksum: read it again."""
    from botocore import exceptions as bx

    if _obstore_kind(e):
        return _obstore_kind(e) == "transient"
    if isinstance(e, ShortBody | bx.ResponseStreamingError | bx.FlexibleChecksumError | bx.ConnectionError):
        return True
    if isinstance(e, bx.ClientError):  # botocore's retry does not run here: its throttling answers are ours too
        return _status(e) >= 500 or _status(e) in (408, 429) or _code(e) in ("SlowDown", "RequestTimeout", "Throttling")
    try:
        from urllib3 import exceptions as ux

        return isinstance(e, ux.ProtocolError | ux.IncompleteRead | ConnectionError)
    except ImportError:
        return isinstance(e, ConnectionError)


def _stalled(e: BaseException) -> bool:
    from botocore import exceptions as bx

    if _obstore_kind(e):
        return _obstore_kind(e) == "stall"
    if isinstance(e, bx.ReadTimeoutError | bx.ConnectTimeoutError):
        return True
    try:
        from urllib3 import exceptions as ux

        return isinstance(e, ux.ReadTimeoutError | TimeoutError)
    except ImportError:
        return isinstance(e, TimeoutError)


class ShortBody(OSError):
    """A body shorter or longer than its stated length."""


def explain(e: BaseException, url, doing: str) -> S3Error:
    """One line for a failed request on `url`: what happened and what to do."""
    from botocore import exceptions as bx

    where = f"at {endpoint()}" if _clients else ""
    if isinstance(e, S3Error):
        return e
    if _stalled(e):
        return Stalled(
            f"{doing} {url}: no byte for {stall_s():g} s {where} (REELCACHE_S3_STALL_S): the store stalled; "
            "run it again, or raise the limit"
        )
    if _obstore_kind(e):
        text = str(e)
        if type(e).__name__ in ("PermissionDeniedError", "UnauthenticatedError") or "status code: 403" in text:
            return S3Error(
                f"{doing} {url}: the store {where} refused the credentials ({type(e).__name__}): check "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE, and the key's rights on the bucket"
            )
        if "<Code>NoSuchBucket</Code>" in text:
            return S3Error(f"{doing} {url}: bucket s3://{parse(url).bucket} does not exist {where}: create it first")
        if isinstance(e, FileNotFoundError):
            return S3Error(f"{doing} {url}: no such object {where}")
        if "status code: 416" in text:
            return S3Error(f"{doing} {url}: the range asked starts past the object's end {where}")
        if "error sending request" in text:
            return S3Error(
                f"{doing} {url}: cannot reach the S3 endpoint {endpoint()}: check AWS_ENDPOINT_URL and that the "
                "server runs"
            )
    if isinstance(e, bx.NoCredentialsError | bx.PartialCredentialsError):
        return S3Error(
            f"{doing} {url}: no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
        )
    if isinstance(e, bx.EndpointConnectionError | bx.ConnectionError):
        return S3Error(
            f"{doing} {url}: cannot reach the S3 endpoint {endpoint()} ({str(e).splitlines()[0][:200]}): "
            "check AWS_ENDPOINT_URL and that the server runs"
        )
    if isinstance(e, bx.ClientError):
        code, status = _code(e), _status(e)
        if code in ("SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied", "403") or status == 403:
            return S3Error(
                f"{doing} {url}: the store {where} refused the credentials ({code or status}): check "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE, and the key's rights on the bucket"
            )
        if code in ("NoSuchBucket",):
            return S3Error(f"{doing} {url}: bucket s3://{parse(url).bucket} does not exist {where}: create it first")
        if code in ("PreconditionFailed", "412") or status == 412:
            return PreconditionFailed(f"{doing} {url}: its condition did not hold (412 PreconditionFailed)")
        return S3Error(f"{doing} {url}: {code or status} {str(e).splitlines()[0][:200]} {where}")
    return S3Error(f"{doing} {url}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''} {where}")


def _read(url: Url, rng: str | None) -> tuple[bytes, dict]:
    """One GET and its body read to the end, checked: its length equals Content-Length (and the range asked),
    and botocore checks the object's checksum where the store gives one for a whole-object read."""
    kw = {"Range": rng} if rng else {"ChecksumMode": "ENABLED"}
    r = client(retried=True).get_object(Bucket=url.bucket, Key=url.key, **kw)  # only ever inside _retrying
    body = r["Body"]
    try:
        data = body.read()
    finally:
        body.close()
    if len(data) != r["ContentLength"]:
        raise ShortBody(f"{len(data)} of {r['ContentLength']} bytes")
    return data, r


def _retrying(url: Url, doing: str, fn):
    last = None
    for attempt in range(ATTEMPTS):
        try:
            return fn()
        except Exception as e:
            if _stalled(e) or not _transient(e):
                raise explain(e, url, doing) from e
            last = e
            if attempt + 1 < ATTEMPTS:
                _backoff(attempt)
    if _obstore_kind(last) and "error sending request" in str(last):
        raise explain(last, url, doing) from last
    raise S3Error(
        f"{doing} {url}: failed {ATTEMPTS} times, last: {type(last).__name__}: {str(last).splitlines()[0][:200]}"
    ) from last


def get(url) -> bytes:
    """The whole object; its length and (where the store keeps one) its checksum checked; read again on a reset
    or short body."""
    url = parse(url)
    return _retrying(url, "reading", lambda: _read(url, None)[0])


def get_range(url, start: int, length: int) -> bytes:
    """`length` bytes of the object from `start`, exactly: never short bytes (a short or reset body is read
    again; a range past the object's end is an error naming it). Sent by obstore (``_store``: a ranged read costs
    a fifth of boto3's CPU, docs/STORAGE.md "How it is built"), or by boto3 in a process forked from one that
    started obstore (``_obstore_usable``); the checks and the retries are ours, the same for both."""
    url = parse(url)
    if length <= 0:
        return b""

    def once():
        if _obstore_usable():
            import obstore

            r = obstore.get(_store(url.bucket), url.key, options={"range": (start, start + length)})
            data = bytes(r.bytes())
            got, size = tuple(r.range), int(r.meta["size"])
        else:
            data, r = _read(url, f"bytes={start}-{start + length - 1}")
            m = re.match(r"bytes (\d+)-(\d+)/(\d+)", r.get("ContentRange", ""))
            got, size = ((int(m[1]), int(m[2]) + 1), int(m[3])) if m else ((start, start + len(data)), -1)
        if len(data) != length or got != (start, start + length):
            if size < start + length and got == (start, size):
                raise S3Error(f"reading {url}: bytes {start}..{start + length - 1} asked, the object has {size}")
            raise ShortBody(f"{len(data)} of {length} bytes (bytes {got[0]}..{got[1] - 1} sent)")
        return data

    return _retrying(url, "reading", once)


def head(url) -> dict | None:
    """The object's metadata (ContentLength, ETag, LastModified, Metadata, ...), None when absent."""
    url = parse(url)
    try:
        return client().head_object(Bucket=url.bucket, Key=url.key)
    except Exception as e:
        if _status(e) == 404 or _code(e) in ("404", "NoSuchKey", "NotFound"):
            return None
        raise explain(e, url, "reading") from e


def put(url, data: bytes, *, if_none_match: bool = False, if_match: str | None = None, metadata=None) -> str:
    """Write the object whole in one PUT; returns its ETag. ``if_none_match``: only if absent; ``if_match``: only
    if its ETag is that. A condition that fails raises PreconditionFailed, unless the object holds this very
    write (botocore resent it after the first response was lost)."""
    url = parse(url)
    token = secrets.token_hex(8)
    kw = {"Metadata": {**(metadata or {}), WRITE_TOKEN: token}}
    if if_none_match:
        kw["IfNoneMatch"] = "*"
    if if_match is not None:
        kw["IfMatch"] = if_match
    try:
        return client().put_object(Bucket=url.bucket, Key=url.key, Body=data, **kw)["ETag"]
    except Exception as e:
        err = explain(e, url, "writing")
        if isinstance(err, PreconditionFailed):
            h = head(url)
            if h is not None and h.get("Metadata", {}).get(WRITE_TOKEN) == token:
                return h["ETag"]  # our write was committed; its response was lost
        raise err from e


def delete(url, *, if_match: str | None = None) -> None:
    """Remove the object (absent already: fine); ``if_match``: only while its ETag is that."""
    url = parse(url)
    kw = {"IfMatch": if_match} if if_match is not None else {}
    try:
        client().delete_object(Bucket=url.bucket, Key=url.key, **kw)
    except Exception as e:
        if _status(e) == 404:
            return
        raise explain(e, url, "deleting") from e


def list_objects(prefix) -> list[dict]:
    """Every object whose key starts with `prefix`'s key (a plain string prefix: end it with '/' for a folder's),
    as boto3 lists them
    (Key, Size, ETag, LastModified), in key order."""
    url = parse(prefix)
    key = url.key + ("/" if url.key and str(prefix).endswith("/") and not url.key.endswith("/") else "")
    out = []
    try:
        for page in client().get_paginator("list_objects_v2").paginate(Bucket=url.bucket, Prefix=key):
            out.extend(page.get("Contents", []))
    except Exception as e:
        raise explain(e, url, "listing") from e
    return sorted(out, key=lambda o: o["Key"])


def list_uploads(prefix) -> list[dict]:
    """The incomplete multipart uploads under `prefix` (Key, UploadId, Initiated)."""
    url = parse(prefix)
    out = []
    try:
        for page in client().get_paginator("list_multipart_uploads").paginate(Bucket=url.bucket, Prefix=url.key):
            out.extend(page.get("Uploads", []))
    except Exception as e:
        raise explain(e, url, "listing uploads under") from e
    return out


def abort_upload(bucket: str, key: str, upload_id: str) -> None:
    try:
        client().abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
    except Exception as e:
        if _status(e) != 404:
            raise explain(e, Url(bucket, key), "aborting the upload of") from e


class Upload:
    """A multipart upload of one object: ``write`` buffers and sends each full 8 MB part; ``complete`` sends the
    last and makes the object visible, whole; ``abort`` (also on any failure inside ``with``) removes the
    parts. Until ``complete`` no reader sees anything under the key."""

    def __init__(self, url, metadata=None):
        self.url = parse(url)
        self.metadata = metadata or {}
        self.upload_id: str | None = None
        self.parts: list[dict] = []
        self.buf = bytearray()
        self.size = 0

    def _start(self):
        try:
            r = client().create_multipart_upload(Bucket=self.url.bucket, Key=self.url.key, Metadata=self.metadata)
        except Exception as e:
            raise explain(e, self.url, "starting the upload of") from e
        self.upload_id = r["UploadId"]

    def _send(self, data: bytes):
        if self.upload_id is None:
            self._start()
        n = len(self.parts) + 1
        try:
            r = client().upload_part(
                Bucket=self.url.bucket, Key=self.url.key, UploadId=self.upload_id, PartNumber=n, Body=bytes(data)
            )
        except Exception as e:
            raise explain(e, self.url, f"uploading part {n} of") from e
        self.parts.append({"ETag": r["ETag"], "PartNumber": n})

    def write(self, data) -> None:
        self.buf += data
        self.size += len(data)
        while len(self.buf) >= PART_BYTES:
            self._send(self.buf[:PART_BYTES])
            del self.buf[:PART_BYTES]

    def complete(self) -> str:
        """Send what is left and make the object visible; returns its ETag. An upload that never filled one part
        is one plain PUT."""
        if self.upload_id is None:
            etag = put(self.url, bytes(self.buf), metadata=self.metadata)
            self.buf = bytearray()
            return etag
        if self.buf or not self.parts:
            self._send(self.buf)
            self.buf = bytearray()
        try:
            r = client().complete_multipart_upload(
                Bucket=self.url.bucket, Key=self.url.key, UploadId=self.upload_id, MultipartUpload={"Parts": self.parts}
            )
        except Exception as e:
            raise explain(e, self.url, "completing the upload of") from e
        self.upload_id = None
        return r["ETag"]

    def abort(self) -> None:
        self.buf = bytearray()
        if self.upload_id is not None:
            uid, self.upload_id = self.upload_id, None
            abort_upload(self.url.bucket, self.url.key, uid)

    def __enter__(self):
        return self

    def __exit__(self, et, e, tb):
        if et is not None:
            try:
                self.abort()
            except S3Error:
                pass  # the first error is the one to tell; an upload left behind is listed by `list_uploads`


def upload_file(path, url, metadata=None) -> str:
    """A local file to `url`, whole or not at all: one PUT up to PART_BYTES, else a multipart upload completed
    after its last part (aborted on failure). Returns the ETag."""
    with Upload(url, metadata) as up, open(path, "rb") as f:
        while chunk := f.read(PART_BYTES):
            up.write(chunk)
        return up.complete()


def download(url, path) -> None:
    """The whole object into a local file (written to a temporary name, renamed when whole)."""
    from reelcache.files import atomic_path

    with atomic_path(path) as tmp:
        Path(tmp).write_bytes(get(url))


def check_root(url, write: bool = True) -> Url:
    """Before any work on a root in S3: the bucket exists, the credentials work, and (`write`) the store honours
    conditional writes (a second create of one key with If-None-Match: * is refused), or one line saying which
    and what to do. A bucket is checked first by HEAD: some stores (SeaweedFS) create a missing bucket on the
    first PUT."""
    url = parse(url)
    bucket = Url(url.bucket)
    try:
        client().head_bucket(Bucket=url.bucket)
    except Exception as e:
        status = _status(e)
        if status == 404 or _code(e) in ("NoSuchBucket", "404"):
            raise S3Error(
                f"s3://{url.bucket}: no such bucket at {endpoint()}: create it, or name an existing one in --root"
            ) from None
        if status in (401, 403):
            raise S3Error(
                f"s3://{url.bucket}: the store at {endpoint()} refused the credentials ({_code(e) or status}): check "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE, and the key's rights on the bucket"
            ) from None
        raise explain(e, bucket, "checking the bucket") from None
    if not write:
        return url
    probe = url / f".reelcache-check-{secrets.token_hex(6)}"
    put(probe, b"conditional write check", if_none_match=True)
    try:
        try:
            client().put_object(Bucket=probe.bucket, Key=probe.key, Body=b"second", IfNoneMatch="*")
        except Exception as e:
            if isinstance(explain(e, probe, "writing"), PreconditionFailed):
                return url
            raise explain(e, probe, "writing") from e
        raise S3Error(
            f"{probe}: the store at {endpoint()} does not honour conditional writes (a second PUT with "
            "If-None-Match: * succeeded): reelcache's unit leases need them; use a store that does (AWS S3, "
            "SeaweedFS, MinIO, R2, Ceph RGW >= 18)"
        )
    finally:
        delete(probe)


def forget_clients() -> None:
    """Drop the clients made so far: the next call makes one from the environment as it is now (tests)."""
    with _clients_lock:
        _clients.clear()
        _stores.clear()


def get_with_age(url) -> tuple[bytes, str, float] | None:
    """The whole object, its ETag and its age by the server's own clock (the response's Date minus the object's
    Last-Modified, in seconds: the client's clock plays no part); None when absent. The object lease reads its
    holder so (base/lease.py)."""
    from email.utils import parsedate_to_datetime

    url = parse(url)

    def once():
        try:
            data, r = _read(url, None)
        except Exception as e:
            if _status(e) == 404 or _code(e) in ("NoSuchKey", "404"):
                return None
            raise
        date = parsedate_to_datetime(r["ResponseMetadata"]["HTTPHeaders"]["date"])
        return data, r["ETag"], max(0.0, (date - r["LastModified"]).total_seconds())

    return _retrying(url, "reading", once)


def mirror_dir(url) -> Path:
    """The local folder that mirrors a root in S3: ``$REELCACHE_S3_MIRROR/<bucket>/<prefix>`` (default
    ``~/.cache/reelcache/s3``, under ``$XDG_CACHE_HOME`` where set). It holds what the stages keep on a local disk
    for that root: the catalog (``catalog.duckdb``), the sidecars and plans it was merged from, and the unit's
    shards while they are written, before each is uploaded whole (docs/STORAGE.md)."""
    url = parse(url)
    base = os.environ.get("REELCACHE_S3_MIRROR")
    if not base:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "reelcache" / "s3"
    return Path(base) / url.bucket / url.key


def mirror_object(url, path: Path) -> bool:
    """One object mirrored as ``sync_down`` mirrors many, without listing its prefix (a run's holds its whole
    consumed log): downloaded into `path` when it exists (True), else a local copy at `path` removed (False)."""
    if head(url) is None:
        Path(path).unlink(missing_ok=True)
        return False
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    download(url, path)
    return True


def sync_down(prefix, local: Path, keep, prune=True, under=("",)) -> list[Path]:
    """Mirror the objects under `prefix` whose path below it `keep(rel)` accepts into `local`: an object is
    downloaded when the local copy's size or mtime differ from the object's (its mtime is set to the object's
    Last-Modified), and a local file `keep` accepts whose object is gone is removed, if `prune` is True or a
    function of `rel` that accepts it too (False: none is): gone by a HEAD of it, not by its absence from the
    listing (a listing may be briefly stale: a store behind a cache, an eventually consistent one). Returns the
    local files.

    `under`: the sub-prefixes listed (plain string prefixes of `rel`, e.g. ``("store/", "manifests/")``), each by
    its own listing; the default lists all of `prefix`. A caller that reads only some folders of a root names them
    (a root holds ~100k store objects and the runs' consumed logs): `keep` must accept nothing outside them, and
    only files under them are mirrored or pruned."""
    prefix = parse(prefix)
    base = prefix.key.rstrip("/") + "/" if prefix.key else ""
    under = tuple(sorted(set(under)))
    for u in under:
        if u.startswith("/") or ".." in u.split("/"):
            raise ValueError(f"sync_down under={u!r}: a relative sub-prefix of {prefix} ('store/', 'manifests/')")
    want = {}
    for u in under:
        if any(u.startswith(v) for v in under if v != u):
            continue  # listed with a shorter one
        for o in list_objects(Url(prefix.bucket, base + u)):
            rel = o["Key"][len(base) :]
            if keep(rel):
                want[rel] = o
    out = []
    for rel, o in want.items():
        p = local / rel
        mtime = o["LastModified"].timestamp()
        try:
            st = p.stat()
            same = st.st_size == o["Size"] and st.st_mtime == mtime
        except FileNotFoundError:
            same = False
        if not same:
            p.parent.mkdir(parents=True, exist_ok=True)
            download(Url(prefix.bucket, o["Key"]), p)
            os.utime(p, (mtime, mtime))
        out.append(p)
    if prune:
        # walk only the folders listed: the folder part of each sub-prefix ('' for the whole of `local`)
        tops = {u.rpartition("/")[0] for u in under}
        tops = {""} if "" in tops else {t for t in tops if not any(t.startswith(v + "/") for v in tops if v != t)}
        for top in sorted(tops):
            d = local / top if top else local
            if not d.is_dir():
                continue
            for p in d.rglob("*"):
                rel = p.relative_to(local).as_posix()
                if not (p.is_file() and rel.startswith(under) and keep(rel) and rel not in want):
                    continue
                if prune is True or prune(rel):
                    if head(Url(prefix.bucket, base + rel)) is not None:  # a stale listing left it out: it exists
                        out.append(p)
                        continue
                    p.unlink()
    return sorted(out)


def root_arg(text: str) -> str:
    """argparse type of a ``--root``: an existing folder, or a well-formed ``s3://bucket/prefix`` (whether the
    bucket exists and the credentials work is ``check_root``'s, once the command runs)."""
    from reelcache.args import existing_dir

    return new_root_arg(text) if text.startswith("s3://") else existing_dir(text)


def new_root_arg(text: str) -> str:
    """argparse type of a ``--root`` that may not exist yet: any folder, or a well-formed ``s3://bucket/prefix``."""
    import argparse

    if text.startswith("s3://"):
        try:
            parse(text)
        except UserError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return text
