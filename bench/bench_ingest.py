"""make bench: ingest and catalog speed, as ratios against baselines measured in the same run.

1. Probe: reelcache's probe through the isolated worker process ``ingest run`` uses (the
   headline; in-process shown too) vs ``ffprobe`` per file, ``ffprobe -count_packets`` (what exact
   frame counts cost with it), a full PyAV decode (what Open-Sora's metadata script does), and a bare open + 64 KB read
   (the floor: probing should be bound by opening files, not by the tool).
2. Shard writing: ShardWriter MB/s vs ``cat`` of the same bytes into one file (both fsynced).
3. Catalog at OpenVid + MiraData scale: 1.3M synthetic rows in 1,300 sidecars: merge time, a
   curriculum query (bucket + level + hardest-0.01% cut), manifest build; peak RSS of each.

Files are in the page cache for every contender (each is run once to warm up first): the
numbers compare tools, not disks. Contenders run in interleaved rounds (bench/interleave.py), so
load from elsewhere hits them alike; a ratio is the median of the per-round ratios, printed with
their range. Results: stdout, bench-out/results.json, bench-out/bench.png.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from interleave import Ratio, median, rounds, table_note

OUT = Path(os.environ.get("BENCH_OUT", "bench-out"))
ROWS = int(os.environ.get("BENCH_ROWS", 1_300_000))
PROBE_REPS = int(os.environ.get("BENCH_REPS", 5))  # interleaved rounds; each probes 1/PROBE_REPS of the files
SHARD_REPS = int(os.environ.get("BENCH_REPS", 4))  # interleaved rounds of a whole shard write each
RESULTS: dict[str, dict] = {}


def run_measured(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (MB) of one child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(proc.pid, 0)
    dt = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"{cmd} failed: {proc.stderr.read().decode()[-2000:]}")
    return dt, ru.ru_maxrss // 1024


def clips() -> list[str]:
    data = Path("demo-data")
    if not (data / "OpenVid-demo.csv").exists():
        from reelcache.ingest.demo import generate

        data = OUT / "demo-data"
        if not (data / "OpenVid-demo.csv").exists():
            generate(data)
    from reelcache.ingest.filters import Rejected
    from reelcache.ingest.probe import probe

    good = []
    for p in sorted((data / "videos").iterdir()):
        try:
            probe(str(p))
            good.append(str(p))
        except Rejected:
            pass
    return good


def per_file(fn, part: list[str], min_s: float = 0.5) -> float:
    """Files per second of fn over part; a quick fn goes over it again until min_s have passed, so
    that a round of a cheap contender is not a timer's resolution."""
    n, t0 = 0, time.perf_counter()
    while True:
        fn(part)
        n += len(part)
        dt = time.perf_counter() - t0
        if dt >= min_s:
            return n / dt


def _probe_ours(part):
    from reelcache.ingest.probe import probe

    for f in part:
        probe(f)


def _probe_isolated(part, size=1000):
    """A unit as `ingest run` sees it: the default 1000 rows, one worker process started per unit
    (its ~0.3 s start is paid once per unit, as in production, not once per 243 files)."""
    from reelcache.ingest.probe import probe
    from reelcache.isolate import isolated_map

    unit = (part * -(-size // len(part)))[:size]
    for _, r in isolated_map(probe, unit, workers=1, timeout=30):
        assert isinstance(r, dict), r
    return len(unit)


def _ffprobe(part, extra=()):
    for f in part:
        subprocess.run(
            ["ffprobe", "-v", "error", *extra, "-show_streams", "-show_format", "-of", "json", f],
            check=True,
            capture_output=True,
        )


def _pyav_open(part):
    import av

    for f in part:
        with av.open(f, metadata_errors="ignore") as c:
            _ = c.streams.video[0].codec_context.name  # opening the codec context is the probe


def _open_read(part):
    for f in part:
        with open(f, "rb") as fh:
            fh.read(65536)


def _full_decode(part):
    import av

    for f in part:
        with av.open(f) as c:
            for _ in c.decode(video=0):
                pass


def bench_probe(files: list[str]) -> None:
    sub = files[:: max(1, len(files) // 40)]

    # Round r probes every PROBE_REPS-th file from the r-th (full decode: of the 40-file subset),
    # so the rounds together cost one pass over the files per contender, as one timed pass did;
    # the isolated worker gets a whole 1000-file unit of its round's files every round. Warm-up:
    # a few files each (imports, ffprobe's binary); the files are page-cached by clips() already.
    def part(fs, r):
        return fs[r::PROBE_REPS] if r >= 0 else fs[:2]

    def isolated(r):
        t0 = time.perf_counter()
        n = _probe_isolated(part(files, r), 1000 if r >= 0 else 20)
        return n / (time.perf_counter() - t0)

    contenders = {
        "reelcache probe (in-process)": lambda r: per_file(_probe_ours, part(files, r)),
        "reelcache probe (isolated worker)": isolated,
        "ffprobe per file": lambda r: per_file(_ffprobe, part(files, r)),
        "ffprobe -count_packets per file": lambda r: per_file(
            lambda p: _ffprobe(p, ["-count_packets"]), part(files, r)
        ),
        "full decode (PyAV)": lambda r: per_file(_full_decode, part(sub, r)),
        "PyAV open + stream info only": lambda r: per_file(_pyav_open, part(files, r)),
        "open + 64 KB read (floor)": lambda r: per_file(_open_read, part(files, r)),
    }
    per_round = rounds(contenders, reps=PROBE_REPS)
    head = "reelcache probe (isolated worker)"  # what `ingest run` does: the headline
    ratios = {k: Ratio.of(per_round[head], v) for k, v in per_round.items()}
    rates = {k: median(v) for k, v in per_round.items()}
    n = len(files)
    RESULTS["probe"] = {
        "files": n,
        "files_per_s": rates,
        "headline": head,
        "rounds": PROBE_REPS,
        "speedup_vs_ffprobe": ratios["ffprobe per file"].as_dict(),
        "speedup_vs_ffprobe_count_packets": ratios["ffprobe -count_packets per file"].as_dict(),
        "speedup_vs_full_decode": ratios["full decode (PyAV)"].as_dict(),
        "fraction_of_pyav_open": ratios["PyAV open + stream info only"].as_dict(),
    }
    print(
        f"\n== probe ({n} demo clips, 240p-720p, page-cached; ratios are of the isolated worker `ingest run` "
        f"uses, over a 1000-file unit; files/s: medians of {PROBE_REPS} rounds)"
    )
    print(table_note(PROBE_REPS))
    for k, v in rates.items():
        print(f"  {k:36s} {v:9.1f} files/s   reelcache/this = {ratios[k].short()}")


def bench_shards() -> None:
    from reelcache.base.shards import ShardWriter

    src = OUT / "shard-src"
    src.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(96):
        p = src / f"v{i:03d}.mp4"
        if not p.exists() or p.stat().st_size != (4 << 20):
            p.write_bytes(os.urandom(4 << 20))
        files.append(p)
    total = sum(p.stat().st_size for p in files)
    dst = OUT / "shard-dst"

    def cat(sync):
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir()
        with open(dst / "cat.out", "wb") as out:
            subprocess.run(["cat", *map(str, files)], stdout=out, check=True)
            if sync:
                os.fsync(out.fileno())

    def writer(sync):
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir()
        w = ShardWriter(dst, "000000", 1 << 30, fsync=sync)
        for i, p in enumerate(files):
            w.write_sample(
                f"{i:020x}",
                [("mp4", str(p), p.stat().st_size), ("json", b'{"a": 1}', None), ("txt", b"a caption", None)],
            )
        w.close()

    RESULTS["shards"] = {"bytes": total, "rounds": SHARD_REPS}
    print(
        f"\n== shard writing ({total / 1e6:.0f} MB in {len(files)} files; {SHARD_REPS} interleaved rounds after "
        f"a warm-up, MB/s are medians)"
    )
    for sync in (False, True):  # interleaved: disk write-back is noisy
        secs = rounds({"cat": lambda r, s=sync: cat(s), "writer": lambda r, s=sync: writer(s)}, reps=SHARD_REPS)
        cat_mb, ours_mb = ([total / 1e6 / dt for dt in secs[k]] for k in ("cat", "writer"))
        ratio = Ratio.of(ours_mb, cat_mb)
        tag = "fsynced" if sync else "page cache"
        RESULTS["shards"][tag] = {
            "cat_MBps": median(cat_mb),
            "shardwriter_MBps": median(ours_mb),
            "ratio": ratio.as_dict(),
        }
        print(
            f"  {tag:10s}  cat > file {median(cat_mb):7.0f} MB/s   ShardWriter {median(ours_mb):7.0f} MB/s   "
            f"ratio {ratio.describe()} (goal >= 0.8x)"
        )
    shutil.rmtree(dst, ignore_errors=True)


def synth_sidecars(root: Path, rows: int, per_unit: int = 1000) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from reelcache.catalog.db import clips_arrow_schema

    schema = clips_arrow_schema()
    sdir = root / "raw" / "synth"
    sdir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    heights = np.array([240, 360, 480, 720, 1080])
    for u in range(-(-rows // per_unit)):
        n = min(per_unit, rows - u * per_unit)
        idx = np.arange(u * per_unit, u * per_unit + n)
        h = rng.choice(heights, n, p=[0.15, 0.25, 0.2, 0.3, 0.1])
        w = np.where(rng.random(n) < 0.85, (h * 16) // 9, (h * 9) // 16)
        fps = rng.choice([24.0, 25.0, 30.0, 60.0], n)
        nf = rng.integers(30, 3000, n)
        ok = rng.random(n) > 0.03
        cols = {
            "clip_id": pa.array([f"{i:020x}" for i in idx]),
            "source": pa.array(["synth"] * n),
            "unit": pa.array([f"synth/{u:06d}"] * n),
            "row": pa.array(idx),
            "path": pa.array([f"/data/v/{i}.mp4" for i in idx]),
            "text": pa.array(["a caption"] * n),
            "status": pa.array(np.where(ok, "ok", "rejected")),
            "reject_reason": pa.array(np.where(ok, None, "truncated")),
            "num_frames": pa.array(nf),
            "fps": pa.array(fps),
            "duration": pa.array(nf / fps),
            "width": pa.array(w.astype(np.int32)),
            "height": pa.array(h.astype(np.int32)),
            "aspect_ratio": pa.array(h / w),
            "resolution": pa.array((h * w).astype(np.int64)),
            "file_size": pa.array(rng.integers(1 << 20, 50 << 20, n)),
            "noun_count": pa.array(rng.poisson(6, n).astype(np.int32)),
            "noun_tagger": pa.array(["textblob-pattern"] * n),
            "shard": pa.array([f"raw/synth/{u:06d}-{k // 128:02d}.tar" for k in range(n)]),
            "shard_offset": pa.array(rng.integers(0, 1 << 30, n)),
            "ext": pa.array(["mp4"] * n),
        }
        arrays = [cols[f.name].cast(f.type) if f.name in cols else pa.nulls(n, f.type) for f in schema]
        pq.write_table(pa.Table.from_arrays(arrays, schema=schema), sdir / f"{u:06d}.parquet", compression="zstd")


CURRICULUM = """
SELECT count(*) FROM clips
WHERE status = 'ok' AND resolution >= 0.8 * 230400 AND aspect_ratio BETWEEN 0.5 AND 0.6
  AND num_frames > 51 * 2 AND level <= 4 AND noun_pct < 99.99
"""


def bench_catalog() -> None:
    import duckdb

    root = OUT / "catalog-root"
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    synth_sidecars(root, ROWS)
    gen = time.perf_counter() - t0
    rc = [sys.executable, "-m", "reelcache"]
    merge_s, merge_mb = run_measured(rc + ["catalog", "merge", "--root", str(root)])
    remerge_s, _ = run_measured(rc + ["catalog", "merge", "--root", str(root)])
    manifest_s, manifest_mb = run_measured(
        rc
        + [
            "catalog",
            "manifest",
            "--root",
            str(root),
            "--name",
            "bench",
            "--where",
            "level <= 4 AND noun_pct < 99.99 AND height >= 360",
        ]
    )
    start_s, _ = run_measured(rc + ["catalog", "sql", "--root", str(root), "SELECT 1"])
    con = duckdb.connect(str(root / "catalog.duckdb"), read_only=True)
    q_times = []
    for _ in range(5):
        t0 = time.perf_counter()
        con.execute(CURRICULUM).fetchall()
        q_times.append(time.perf_counter() - t0)
    con.close()
    RESULTS["catalog"] = {
        "rows": ROWS,
        "synth_sidecars_s": gen,
        "merge_s": merge_s,
        "merge_peak_MB": merge_mb,
        "remerge_noop_s": remerge_s,
        "curriculum_query_s": min(q_times),
        "manifest_s": manifest_s,
        "manifest_peak_MB": manifest_mb,
        "cli_sql_roundtrip_s": start_s,
    }
    print(f"\n== catalog at {ROWS:,} rows ({-(-ROWS // 1000)} sidecars; wall time includes process start)")
    print(f"  merge                    {merge_s:7.2f} s   peak RSS {merge_mb} MB")
    print(f"  merge again (no-op)      {remerge_s:7.2f} s")
    print(f"  curriculum query         {min(q_times):7.3f} s   (bucket + level + hardest-0.01% cut)")
    print(f"  manifest build           {manifest_s:7.2f} s   peak RSS {manifest_mb} MB")
    print(f"  `catalog sql` round trip {start_s:7.2f} s")
    shutil.rmtree(root, ignore_errors=True)


def plot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    r = RESULTS["probe"]["files_per_s"]
    a.barh(list(r), list(r.values()), color="#3b6ea5")
    a.set_xscale("log")
    a.set_xlabel("files/s (log)")
    a.set_title("probe throughput")
    s = RESULTS["shards"]
    labels, vals, colors = [], [], []
    for tag in ("page cache", "fsynced"):
        labels += [f"cat\n{tag}", f"ShardWriter\n{tag}"]
        vals += [s[tag]["cat_MBps"], s[tag]["shardwriter_MBps"]]
        colors += ["#999999", "#5a9e6f"]
    b.bar(labels, vals, color=colors)
    b.set_ylabel("MB/s")
    b.set_title("shard writing vs cat")
    fig.tight_layout()
    fig.savefig(OUT / "bench.png", dpi=80)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("REELCACHE_PROGRESS", "0")
    bench_probe(clips())
    bench_shards()
    bench_catalog()
    (OUT / "results.json").write_text(json.dumps(RESULTS, indent=2))
    plot()
    print(f"\nresults: {OUT / 'results.json'}, {OUT / 'bench.png'}")


if __name__ == "__main__":
    main()
