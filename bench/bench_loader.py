"""make bench (loader part): throughput over latent shards vs raw reads, plan/resume cost at 1.3M.

1. Throughput: LatentLoader samples/s and MB/s (ranged reads, safetensors decode, posterior
   sampling, collate), with 0 and 2 workers, over cache format 1 (a sample holds its caption) and
   over the store (cache/store.py: latent and caption embedding in two shards, two ranged reads),
   vs ``cat shards > /dev/null`` and a plain ``tarfile`` loop over the format-1 bytes, in the same
   run (page-cached for every contender): REPS
   interleaved rounds of whole epochs (bench/interleave.py), each ratio the median of the
   per-round ratios with their range.
2. Plan construction and resume for 1.3M samples (one manifest, and a mix of two where one is
   upsampled) at the start and deep in the epoch (the goal: about a second, independent of
   position), the peak RSS of a process doing it, and an audit of the plan: micro-batches that
   hold a clip twice (should be 0) and how close two copies of an upsampled clip come.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from interleave import Ratio, median, rounds, table_note

OUT = Path(os.environ.get("BENCH_OUT", "bench-out"))
N = int(os.environ.get("BENCH_LOADER_SAMPLES", 3000))
ROWS = int(os.environ.get("BENCH_ROWS", 1_300_000))
REPO = Path(__file__).resolve().parents[1]
REPS = int(os.environ.get("BENCH_REPS", 3))  # interleaved rounds; each reads all N samples per contender
PARTS = os.environ.get("BENCH_LOADER_PARTS", "throughput,plan").split(",")  # e.g. plan: only part 2


def write_shards(root: Path) -> tuple[Path, Path, int, int]:
    """The same N samples in both formats: format 1 (``latents/``: each sample holds its caption's
    embedding) and the store (``store/video`` latents, ``store/text`` caption embeddings, cache/store.py).
    Returns (format-1 manifest, store manifest, bytes of format 1, bytes of the store)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from reelcache.base.latents import LATENT_EXT, encode
    from reelcache.base.shards import ShardWriter

    root.mkdir(parents=True, exist_ok=True)
    for d in ("latents", "store/video", "store/text"):
        (root / d).mkdir(parents=True, exist_ok=True)
    w = ShardWriter(root / "latents", "000000", 256 << 20, fsync=False)
    wv = ShardWriter(root / "store/video", "000000", 256 << 20, fsync=False)
    wt = ShardWriter(root / "store/text", "000000", 256 << 20, fsync=False)
    rows, store_rows, rng = [], [], np.random.default_rng(0)
    buckets = ["240p/17/0.56", "240p/34/0.56", "360p/17/0.56"]
    for i in range(N):
        b = buckets[i % 3]
        t = 5 if "/17/" in b else 9
        x = {
            "mean": torch.randn(4, t, 30, 53).bfloat16(),
            "logvar": torch.randn(4, t, 30, 53).bfloat16(),
            "text": torch.randn(int(rng.integers(20, 120)), 1024).bfloat16(),
        }
        key = f"{i:020x}"
        shard, off = w.write_sample(key, [(LATENT_EXT, encode(x), None)])
        rows.append({"clip_id": key, "bucket": b, "shard": f"latents/{shard}", "shard_offset": off[LATENT_EXT]})
        vs, vo = wv.write_sample(key, [(LATENT_EXT, encode({k: x[k] for k in ("mean", "logvar")}), None)])
        ts, to = wt.write_sample(key, [(LATENT_EXT, encode({"text": x["text"]}), None)])
        store_rows.append(
            {"clip_id": key, "bucket": b, "shard": f"store/video/{vs}", "shard_offset": vo[LATENT_EXT]}
            | {"text_shard": f"store/text/{ts}", "text_offset": to[LATENT_EXT]}
        )
    for writer in (w, wv, wt):
        writer.close()
    pq.write_table(pa.Table.from_pylist(rows), root / "manifest.parquet")
    pq.write_table(pa.Table.from_pylist(store_rows), root / "manifest-store.parquet")
    size = lambda d: sum(p.stat().st_size for p in (root / d).rglob("*.tar"))  # noqa: E731
    return root / "manifest.parquet", root / "manifest-store.parquet", size("latents"), size("store")


def throughput(results: dict) -> None:
    from reelcache.base.buckets import BucketConfig
    from reelcache.train.loader import LatentLoader

    root = OUT / "loader-root"
    shutil.rmtree(root, ignore_errors=True)
    manifest, store_manifest, total, store_total = write_shards(root)
    tars = sorted(str(p) for p in (root / "latents").glob("*.tar"))
    sizes = BucketConfig.from_dict({"240p": {17: 8, 34: 4}, "360p": {17: 4}})

    def cat():
        subprocess.run(["cat", *tars], stdout=subprocess.DEVNULL, check=True)

    def tar_loop():
        for t in tars:
            with tarfile.open(t) as tf:
                for m in tf:
                    tf.extractfile(m).read()

    def loader(workers, limit=None, m=manifest):
        n = 0
        for b in LatentLoader([m], sizes, root=root, seed=0, workers=workers, prefetch=4):
            n += len(b["clip_id"])
            if limit and n >= limit:
                return
        assert n == N

    # Warm-up (not timed): cat fills the page cache for all contenders; each loader builds the
    # plan and imports what it uses on a few batches (a whole epoch each would cost a round).
    contenders = {
        "cat > /dev/null": lambda r: cat(),
        "tarfile loop": lambda r: tar_loop(),
        "LatentLoader, 0 workers": lambda r: loader(0, None if r >= 0 else 64),  # 1 torch thread
        "LatentLoader, 2 workers": lambda r: loader(2, None if r >= 0 else 64),
        # the store (cache format 2): the latent and its caption embedding, one ranged read each
        "store, 0 workers": lambda r: loader(0, None if r >= 0 else 64, store_manifest),
        "store, 2 workers": lambda r: loader(2, None if r >= 0 else 64, store_manifest),
    }
    secs = rounds(contenders, reps=REPS)
    rates = {k: [N / dt for dt in v] for k, v in secs.items()}
    ratios = {
        k: {"vs_tarfile": Ratio.of(v, rates["tarfile loop"]), "vs_cat": Ratio.of(v, rates["cat > /dev/null"])}
        for k, v in rates.items()
    }
    for w in (0, 2):  # the store against format 1, same run, same samples
        ratios[f"store, {w} workers"]["vs_format_1"] = Ratio.of(
            rates[f"store, {w} workers"], rates[f"LatentLoader, {w} workers"]
        )
    results["throughput"] = {
        "samples": N,
        "bytes": total,
        "store_bytes": store_total,
        "rounds": REPS,
        "rates": {k: {"MBps": total / N * median(v) / 1e6, "samples_per_s": median(v)} for k, v in rates.items()},
        "ratios": {k: {m: r.as_dict() for m, r in v.items()} for k, v in ratios.items()},
    }
    print(
        f"\n== loader throughput ({N} samples, {total / 1e6:.0f} MB of latent shards, page-cached; "
        f"medians of {REPS} rounds)"
    )
    print(table_note(REPS))
    for k, v in rates.items():
        sps = median(v)
        print(
            f"  {k:26s} {total / N * sps / 1e6:8.0f} MB/s {sps:9.0f} samples/s   "
            f"vs tarfile loop {ratios[k]['vs_tarfile'].short()}   vs cat {ratios[k]['vs_cat'].short()}"
            + (f"   vs format 1 {ratios[k]['vs_format_1'].short()}" if "vs_format_1" in ratios[k] else "")
        )
    print(
        f"  per sample a step reads {total / N / 1e3:.0f} kB in format 1 (one ranged read: latent and caption) and "
        f"{store_total / N / 1e3:.0f} kB from the store (two ranged reads: latent, caption embedding)"
    )
    shutil.rmtree(root, ignore_errors=True)


PLAN_CHILD = r"""
import json, sys, time
import numpy as np
t0 = time.perf_counter()
from reelcache.base.buckets import BucketConfig
from reelcache.train.plan import Source, epoch_plan
n, consumed_frac, mix = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "mix"
rng = np.random.default_rng(0)
buckets = np.array([f"{r}/{t}/0.56" for r in ("240p", "360p", "480p", "720p") for t in (17, 34, 51)], dtype=object)
def source(name, lo, hi, weight):
    k = hi - lo
    ids = np.array([f"{i:020x}" for i in range(lo, hi)], dtype=object)
    return Source(name * 64, ids, buckets[rng.integers(0, 12, k)],
                  np.array([f"latents/{name}/{i // 2000:06d}-00.tar" for i in range(lo, hi)], dtype=object),
                  rng.integers(0, 1 << 30, k).astype(np.int64), weight)
# mix: a 1.0M-clip source downsampled to 60% and a 0.3M one upsampled to 40% (1.73 copies per clip)
srcs = [source("a", 0, n - 3 * n // 13, 0.6), source("b", n - 3 * n // 13, n, 0.4)] if mix else [source("f", 0, n, 1.0)]
sizes = BucketConfig.from_dict({r: {17: 8, 34: 4, 51: 2} for r in ("240p", "360p", "480p", "720p")})
t1, c1 = time.perf_counter(), time.process_time()
plan = epoch_plan(srcs, sizes, seed=42, epoch=3)
consumed = int(plan.num_batches * consumed_frac)
sched = plan.rank_batches(consumed, rank=5, world=192)
first = plan.batch(sched[0][0])
t2, c2 = time.perf_counter(), time.process_time()
# audit (not timed): micro-batches holding one clip twice, and the closest two copies of a clip (in micro-batches)
batch_of = np.repeat(np.arange(plan.num_batches), np.diff(plan.starts))
o = np.lexsort((batch_of, plan.order))
same = plan.order[o][1:] == plan.order[o][:-1]
dup_batches = len(np.unique(batch_of[o][1:][same & (batch_of[o][1:] == batch_of[o][:-1])]))
gaps = (batch_of[o][1:] - batch_of[o][:-1])[same]
print(json.dumps({"build_inputs_s": t1 - t0, "plan_and_resume_s": t2 - t1, "plan_and_resume_cpu_s": c2 - c1,
                  "micro_batches": plan.num_batches,
                  "consumed": consumed, "steps_left": len(sched), "batches_with_duplicate": int(dup_batches),
                  "min_copy_gap": int(gaps.min()) if len(gaps) else None}))
"""


def plan_cost(results: dict) -> None:
    out = {}
    for mix in ("one", "mix"):
        for frac in (0.0, 0.9):
            proc = subprocess.Popen(
                [sys.executable, "-c", PLAN_CHILD, str(ROWS), str(frac), mix], stdout=subprocess.PIPE
            )
            _, status, ru = os.wait4(proc.pid, 0)
            assert status == 0
            r = json.loads(proc.stdout.read())
            r["peak_rss_MB"] = ru.ru_maxrss // 1024
            out[f"{mix} manifest{'s' if mix == 'mix' else ''}, position {frac:.0%}"] = r
    results["plan"] = {"rows": ROWS, **out}
    print(f"\n== plan + resume, {ROWS:,} samples, rank 5 of 192 (mix: 1.0M clips at weight 0.6 + 0.3M at 0.4)")
    for k, r in out.items():
        print(
            f"  {k:24s} plan+resume {r['plan_and_resume_s']:5.2f} s (CPU {r['plan_and_resume_cpu_s']:4.2f} s)  "
            f"({r['micro_batches']} micro-batches, "
            f"{r['steps_left']} steps left, {r['batches_with_duplicate']} with a clip twice, closest copies "
            f"{r['min_copy_gap']} micro-batches apart)   peak RSS {r['peak_rss_MB']} MB (incl. the test manifest)"
        )


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    results = {}
    if "throughput" in PARTS:
        throughput(results)
    if "plan" in PARTS:
        plan_cost(results)
    (OUT / "loader-results.json").write_text(json.dumps(results, indent=2))
    print(f"\nresults: {OUT / 'loader-results.json'}")


if __name__ == "__main__":
    main()
