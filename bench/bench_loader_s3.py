"""The loader's samples/s from shards in S3 (a SeaweedFS on loopback, tests/s3_local.py) against the same manifest's
shards on the local disk, with 0 and 2 data workers, and again through the tests' fault proxy adding 20 ms to every
request; requests per sample and bytes transferred per byte used (counted by the proxy).

    .venv/bin/python bench/bench_loader_s3.py [SAMPLES] [FETCH_THREADS] [STEP_MS ...]

Samples are store samples (latent and caption embedding in two shards, tests/latent_data.py): latents of
30..110 kB (64 channels) and captions of 24..90 kB (width 4096), as a T5-XXL embedding trimmed to its tokens.
Each configuration reads one whole epoch; the first batch's time is left out (the plan, the shard check, the
workers' start).

Two kinds of rows:
- **flat out**: the loader read as fast as it goes (the issue's comparison). On a small machine this measures the
  machine: SeaweedFS serves each GET from the same cores (its CPU per sample is the "store CPU" column).
- **paced** (STEP_MS, default 25 and 100): after each batch the consumer sleeps STEP_MS, as a training's host
  thread waits on its accelerator's step; the rows say how much of the epoch the step waited for data
  (``wait %``) and the epoch's rate against the local disk's at the same pace.

CPU ms/sample: this process's CPU (user + system) and its data workers', per sample. The fault proxy runs in a
process of its own (its Python threads would otherwise share the in-process loader's GIL); its CPU and
SeaweedFS's are the "store CPU" column (read from /proc). The machine's load is printed first: on a shared
machine the numbers move with it.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s() -> float:
    """CPU seconds (user + system) of this process and of its children that have ended (the data workers)."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def proc_cpu_s(pids) -> float:
    """CPU seconds (user + system) of live processes, from /proc (the store's side: SeaweedFS and the proxy)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def _proxy(conn, upstream_port: int, latency_s: float) -> None:
    """A FaultProxy in a process of its own: sends its port, then on any message the bodies it counted."""
    from s3_local import FaultProxy

    proxy = FaultProxy(upstream_port, latency_s=latency_s)
    conn.send(proxy.port)
    conn.recv()
    with proxy.lock:
        conn.send(list(proxy.bodies))
    proxy.close()


class ProxyProcess:
    def __init__(self, upstream_port: int, latency_s: float):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_proxy, args=(child, upstream_port, latency_s), daemon=True)
        self.proc.start()
        self.port = self.conn.recv()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def bodies(self) -> list:
        self.conn.send("bodies")
        got = self.conn.recv()
        self.proc.join(10)
        return got


def epoch(manifest, root, shard_root, workers, threads, step_s=0.0, store=()) -> dict:
    from reelcache.base.buckets import BucketConfig
    from reelcache.train.loader import LatentLoader

    buckets = BucketConfig.from_toml(REPO / "configs/buckets/tiny.toml")
    ld = LatentLoader(
        [manifest], buckets, root=root, shard_root=shard_root, seed=1, workers=workers, fetch_threads=threads
    )
    it = iter(ld)
    ids = list(next(it)["clip_id"])
    first = len(ids)
    t0, c0, s0, waited = time.perf_counter(), cpu_s(), proc_cpu_s(store), 0.0
    while True:
        w = time.perf_counter()
        b = next(it, None)
        waited += time.perf_counter() - w
        if b is None:
            break
        ids += b["clip_id"]
        if step_s:
            time.sleep(step_s)
    del it  # the workers end (and are counted)
    n = len(ids) - first
    took = time.perf_counter() - t0
    return {
        "rate": n / took,
        "ids": ids,
        "cpu": 1e3 * (cpu_s() - c0) / n,
        "store": 1e3 * (proc_cpu_s(store) - s0) / n if store else None,
        "wait": waited / took,
    }


def main() -> None:
    samples = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    steps_ms = [float(x) for x in sys.argv[3:]] or [25.0, 100.0]
    import pyarrow.parquet as pq
    from latent_data import write_latents
    from s3_local import local_s3

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
        weed = [server.proc.pid]

        def run(name, workers, shard_root, step_s=0.0, latency=None):
            if shard_root is None:
                return {**epoch(manifest, root, None, workers, threads, step_s), "name": name, "workers": workers}
            proxy = ProxyProcess(server.port, latency) if latency is not None else None
            os.environ.update(server.env(proxy.endpoint if proxy else None))
            s3.forget_clients()
            store = weed + ([proxy.proc.pid] if proxy else [])
            r = epoch(manifest, root, shard_root, workers, threads, step_s, store)
            if proxy:
                gets = [k for m, p, k in proxy.bodies() if m == "GET" and ".tar" in p]
                r["stats"] = (len(gets) / len(r["ids"]), sum(gets) / sum(used_of[c] for c in r["ids"]))
            return {**r, "name": name, "workers": workers}

        flat, paced = [], []
        for workers in (2, 0):  # workers first: forked before this process starts obstore (base/s3.py)
            flat.append(run("local disk", workers, None))
            flat.append(run("S3 loopback", workers, s3root))
            flat.append(run("S3 + proxy", workers, s3root, latency=0.0))
            flat.append(run("S3 + proxy +20 ms", workers, s3root, latency=0.02))
        for step_ms in steps_ms:  # in-process only: obstore is started in this process by now
            paced.append({**run("local disk", 0, None, step_ms / 1e3), "step": step_ms})
            paced.append({**run("S3 + proxy +20 ms", 0, s3root, step_ms / 1e3, latency=0.02), "step": step_ms})

        local = {r["workers"]: r["rate"] for r in flat if r["name"] == "local disk"}
        print("\nflat out")
        head = ("source", "workers", "samples/s", "x local", "CPU ms/sample", "store CPU", "GETs/sample", "bytes/used")
        print("{:20s} {:>7s} {:>10s} {:>8s} {:>13s} {:>10s} {:>12s} {:>11s}".format(*head))
        for r in sorted(flat, key=lambda r: r["workers"]):
            store = f"{r['store']:10.2f}" if r.get("store") is not None else " " * 10
            extra = f" {r['stats'][0]:12.2f} {r['stats'][1]:11.4f}" if r.get("stats") else ""
            print(
                f"{r['name']:20s} {r['workers']:7d} {r['rate']:10.1f} {r['rate'] / local[r['workers']]:8.2f}"
                f" {r['cpu']:13.2f} {store}{extra}"
            )
        print("\npaced: the consumer sleeps STEP ms after each batch (workers = 0)")
        head = ("source", "step ms", "samples/s", "x local", "wait %", "CPU ms/sample", "store CPU")
        print("{:20s} {:>7s} {:>10s} {:>8s} {:>7s} {:>13s} {:>10s}".format(*head))
        for r in paced:
            base = next(p["rate"] for p in paced if p["step"] == r["step"] and p["name"] == "local disk")
            store = f"{r['store']:10.2f}" if r.get("store") is not None else ""
            print(
                f"{r['name']:20s} {r['step']:7.0f} {r['rate']:10.1f} {r['rate'] / base:8.2f} {100 * r['wait']:7.1f}"
                f" {r['cpu']:13.2f} {store}"
            )
        print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
