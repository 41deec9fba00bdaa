"""The loader's samples/s from shards in S3 (a SeaweedFS on loopback, tests/s3_local.py) against the same manifest's
shards on the local disk, with 0 and 2 data workers, and again through the tests' fault proxy adding 20 ms to every
request; requests per sample and bytes transferred per byte used (counted by the proxy).

    .venv/bin/python bench/bench_loader_s3.py [SAMPLES] [FETCH_THREADS]

Samples are store samples (latent and caption embedding in two shards, tests/latent_data.py): latents of
30..110 kB (64 channels) and captions of 24..90 kB (width 4096), as a T5-XXL embedding trimmed to its tokens.
Each configuration reads one whole epoch; the first batch's time is left out (the plan, the shard check, the
workers' start). CPU ms/sample: this process's CPU (user + system) and its data workers', per sample; the proxy
rows include the proxy's (threads of this process); SeaweedFS's is not counted (a process of its own). The
machine's load is printed first: on a shared machine the numbers move with it.
"""

from __future__ import annotations

import os
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def cpu_s() -> float:
    """CPU seconds (user + system) of this process and of its children that have ended (the data workers)."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def epoch(manifest, root, shard_root, workers, threads) -> tuple[float, list, float]:
    from reelcache.base.buckets import BucketConfig
    from reelcache.train.loader import LatentLoader

    buckets = BucketConfig.from_toml(REPO / "configs/buckets/tiny.toml")
    ld = LatentLoader(
        [manifest], buckets, root=root, shard_root=shard_root, seed=1, workers=workers, fetch_threads=threads
    )
    it = iter(ld)
    ids = list(next(it)["clip_id"])
    first = len(ids)
    t0, c0 = time.perf_counter(), cpu_s()
    for b in it:
        ids += b["clip_id"]
    del it  # the workers end (and are counted)
    n = len(ids) - first
    return n / (time.perf_counter() - t0), ids, 1e3 * (cpu_s() - c0) / n


def main() -> None:
    samples = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    import pyarrow.parquet as pq
    from latent_data import write_latents
    from s3_local import FaultProxy, local_s3

    from reelcache.base import s3

    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp, local_s3() as server:
        root = Path(tmp)
        manifest = write_latents(root, samples, name="b", store=True, channels=64, text_dim=4096, shard_bytes=64 << 20)
        c = server.client()
        for p in sorted((root / "latents").rglob("*.tar")):
            c.upload_file(str(p), server.shared_bucket, f"bench/{p.relative_to(root).as_posix()}")
        s3root = f"s3://{server.shared_bucket}/bench"
        t = pq.read_table(manifest).to_pydict()
        import tarfile

        used_of = {}
        for shard_col, off_col in (("shard", "shard_offset"), ("text_shard", "text_offset")):
            for s in set(t[shard_col]):
                with tarfile.open(root / s) as tar:
                    size = {m.offset_data: m.size for m in tar}
                for cid, s2, o in zip(t["clip_id"], t[shard_col], t[off_col]):
                    if s2 == s:
                        used_of[cid] = used_of.get(cid, 0) + size[o]
        mb = sum(used_of.values()) / samples / 1e3
        print(f"{samples} store samples, {mb:.0f} kB each on average (latent + caption); fetch_threads={threads}")
        rows = []
        for workers in (2, 0):  # workers first: forked before this process starts obstore (base/s3.py)
            rate, _, cpu = epoch(manifest, root, None, workers, threads)
            rows.append(("local disk", workers, rate, cpu, None))
            os.environ.update(server.env())
            s3.forget_clients()
            rate, _, cpu = epoch(manifest, root, s3root, workers, threads)
            rows.append(("S3 loopback", workers, rate, cpu, None))
            for latency in (0.0, 0.02):
                proxy = FaultProxy(server.port, latency_s=latency)
                os.environ.update(server.env(proxy.endpoint))
                s3.forget_clients()
                try:
                    rate, ids, cpu = epoch(manifest, root, s3root, workers, threads)
                    gets = [k for m, p, k in proxy.bodies if m == "GET" and ".tar" in p]
                    stats = (len(gets) / len(ids), sum(gets) / sum(used_of[c] for c in ids))
                finally:
                    proxy.close()
                name = f"S3 + proxy{' +20 ms' if latency else ''}"
                rows.append((name, workers, rate, cpu, stats))
        local = {w: r for name, w, r, _, _ in rows if name == "local disk"}
        head = ("source", "workers", "samples/s", "x local", "CPU ms/sample", "GETs/sample", "bytes/used")
        print("{:20s} {:>7s} {:>10s} {:>8s} {:>13s} {:>12s} {:>11s}".format(*head))
        for name, w, rate, cpu, stats in sorted(rows, key=lambda r: r[1]):
            extra = f"{stats[0]:12.2f} {stats[1]:11.4f}" if stats else ""
            print(f"{name:20s} {w:7d} {rate:10.1f} {rate / local[w]:8.2f} {cpu:13.2f} {extra}")
        print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
