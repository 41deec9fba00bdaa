"""CPU per ranged read: ``s3.get_range`` (obstore, with base/s3.py's checks and retries), the same forced onto its
boto3 path (a forked worker's), boto3 bare and obstore bare, on a SeaweedFS S3 server on loopback
(tests/s3_local.py): the choice of client in docs/STORAGE.md.

    .venv/bin/python bench/bench_s3_client.py [READS] [KB]

Each client reads READS ranges of KB kB (a store sample's size) at random offsets of one 64 MB object, one after
another in one thread; printed: this process's CPU seconds per read (user + system, time.process_time) and the
wall time per read. The server's CPU is not counted (it runs in its own process).
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def measure(name: str, read, n: int, size: int, total: int) -> None:
    rng = random.Random(0)
    offsets = [rng.randrange(0, total - size) for _ in range(n)]
    for off in offsets[:20]:  # warm: connections, imports
        read(off, size)
    c0, w0 = time.process_time(), time.perf_counter()
    for off in offsets:
        got = read(off, size)
        assert len(got) == size
    c, w = time.process_time() - c0, time.perf_counter() - w0
    print(
        f"{name:24s} {1e3 * c / n:7.3f} ms CPU/read  {1e3 * w / n:7.3f} ms wall/read  ({n} reads of {size // 1024} kB)"
    )


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    size = (int(sys.argv[2]) if len(sys.argv) > 2 else 300) * 1024
    from s3_local import local_s3

    with local_s3() as server:
        os.environ.update(server.env())
        from reelcache.base import s3

        total = 64 << 20
        url = f"s3://{server.shared_bucket}/bench/object.bin"
        data = os.urandom(total)
        s3.put(url, data)
        u = s3.parse(url)
        measure("s3.get_range (obstore)", lambda off, k: s3.get_range(url, off, k), n, size, total)
        usable, s3._obstore_usable = s3._obstore_usable, lambda: False
        try:
            measure("s3.get_range (boto3)", lambda off, k: s3.get_range(url, off, k), n, size, total)
        finally:
            s3._obstore_usable = usable
        c = s3.client()

        def bare(off, k):
            return c.get_object(Bucket=u.bucket, Key=u.key, Range=f"bytes={off}-{off + k - 1}")["Body"].read()

        measure("boto3 get_object", bare, n, size, total)
        import obstore
        from obstore.store import S3Store

        store = S3Store(
            u.bucket,
            endpoint=server.endpoint,
            access_key_id=server.env()["AWS_ACCESS_KEY_ID"],
            secret_access_key=server.env()["AWS_SECRET_ACCESS_KEY"],
            region="us-east-1",
            client_options={"allow_http": True},
        )
        measure(
            "obstore get_range",
            lambda off, k: bytes(obstore.get_range(store, u.key, start=off, length=k)),
            n,
            size,
            total,
        )


if __name__ == "__main__":
    main()
