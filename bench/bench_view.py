"""make bench (viewer part): `reelcache view` on a 1.3M-row catalog, and a latent preview made once.

1. Pages on bench_ingest's synthetic catalog (BENCH_ROWS rows, 1.3M by default, merged with the real
   `catalog merge`, plus a manifest, and runs/synth: a loader manifest of every ok clip, 1000 steps of
   metrics and consumed logs of 8 ranks): time to the first byte (status line and headers received) and
   to the last byte of every page, over HTTP to the real server (`reelcache view`, uvicorn) in its
   own process. Each page is requested once cold (the first request of that page after start) and
   then REPS times; the median is printed beside the cold one. Targets (issue 23): every page's
   first byte in under 1 s, a clip grid page in under 2 s. The floor, measured in the same run: a
   404 (a clip id the catalog lacks), which costs one indexed lookup and no template.
2. Previews on the demo root (DEMO_ROOT, made by `make demo`), for two views: the first request of a
   latent decodes it with the cache's VAE and writes the mp4 into ROOT/view-cache/ (for the first
   view of a freshly started viewer this includes importing torch and building the VAE), the first
   request of a window decodes the raw clip's window; the next requests serve the files.

Results: stdout and bench-out/view.json.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_ingest import synth_sidecars

OUT = Path(os.environ.get("BENCH_OUT", "bench-out"))
ROWS = int(os.environ.get("BENCH_ROWS", 1_300_000))
REPS = int(os.environ.get("BENCH_REPS", 5))
DEMO_ROOT = Path(os.environ.get("DEMO_ROOT", "demo-root"))
RC = [sys.executable, "-m", "reelcache"]


def start(root: Path) -> tuple[subprocess.Popen, str, int]:
    p = subprocess.Popen(RC + ["view", "--root", str(root), "--port", "0"], stdout=subprocess.PIPE, text=True)
    m = re.search(r"http://(127\.0\.0\.1):(\d+)/", p.stdout.readline())
    assert m, "reelcache view did not print its URL"
    return p, m[1], int(m[2])


def get(host: str, port: int, path: str) -> tuple[int, float, float, int]:
    """(status, seconds to the first byte, seconds to the last, body bytes)."""
    c = http.client.HTTPConnection(host, port, timeout=600)
    t0 = time.perf_counter()
    c.request("GET", path)
    r = c.getresponse()
    first = time.perf_counter() - t0
    body = r.read()
    last = time.perf_counter() - t0
    c.close()
    return r.status, first, last, len(body)


def pages(rows: int) -> dict[str, str]:
    some = f"{rows // 2:020x}"
    last_rejects = max(0, int(rows * 0.03) // 50 - 1)
    return {
        "overview": "/",
        "rejects, first page": "/rejects",
        "rejects, a late page": f"/rejects?reason=truncated&page={last_rejects}",
        "clips grid (default)": "/clips",
        "clips grid, a curriculum": "/clips?where="
        + "level%20%3C%3D%203%20AND%20height%20%3E%3D%20720%20AND%20noun_pct%20%3C%2099.99",
        "clips grid, page 10000": "/clips?page=10000",
        "clips grid, a bad clause": "/clips?where=no_such_column%20%3E%201",
        "clip": f"/clip?id={some}",
        "manifest (1M clips)": "/manifest?name=bench",
        "run (1000 steps)": "/run?name=synth",
        "step (16 clips)": "/step?name=synth&step=500",
        "stage (2 epochs of all ok)": "/stage?name=synth",
        "floor: a 404": "/clip?id=nope",
    }


def synth_run(root: Path, steps: int = 1000, world: int = 8, batch: int = 2) -> None:
    """runs/synth: a loader manifest of every ok clip over the demo buckets, its config.json (2 epochs), and
    metrics and consumed logs of `steps` steps of `world` ranks, as the trainer writes them (one generation)."""
    import duckdb
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    con = duckdb.connect(str(root / "catalog.duckdb"), read_only=True)
    ids = con.execute("SELECT clip_id FROM clips WHERE status = 'ok' ORDER BY clip_id").fetchnumpy()["clip_id"]
    con.close()
    rng = np.random.default_rng(0)
    buckets = np.array(["144p/33/0.56", "144p/17/1.00", "144p/33/1.78"], dtype=object)[rng.integers(0, 3, len(ids))]
    n = len(ids)
    manifest = root / "manifests" / "synth-latents.parquet"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    shard = np.array([f"latents/synth/{i // 1000:06d}-00.tar" for i in range(n)], dtype=object)
    pq.write_table(
        pa.table({"clip_id": ids, "bucket": buckets, "shard": shard, "shard_offset": np.arange(n) * 4096}), manifest
    )
    run = root / "runs" / "synth"
    for d in ("metrics", "consumed"):
        (run / d).mkdir(parents=True, exist_ok=True)
    cfg = {"data": {"manifests": [{"name": str(manifest.resolve()), "weight": 1.0}], "block": 64,
                    "buckets": str(Path(__file__).resolve().parents[1] / "configs/buckets/demo.toml")},
           "run": {"seed": 42, "epochs": 2}}  # fmt: skip
    (run / "config.json").write_text(json.dumps(cfg))
    step = np.arange(steps)
    pq.write_table(pa.table({"step": step, "epoch": np.zeros(steps, np.int32), "epoch_step": step,
                             "loss": 0.5 + 0.1 * rng.random(steps), "skipped": np.zeros(steps, bool),
                             "generation": np.zeros(steps, np.int32)}), run / "metrics" / "g000.parquet")  # fmt: skip
    rows = steps * world * batch
    rank = np.tile(np.repeat(np.arange(world), batch), steps)
    pq.write_table(pa.table({"generation": np.zeros(rows, np.int32), "epoch": np.zeros(rows, np.int32),
                             "step": np.repeat(step, world * batch), "rank": rank,
                             "clip_id": ids[:rows], "bucket": buckets[:rows], "pad": np.zeros(rows, bool),
                             "view": np.zeros(rows, np.int32)}), run / "consumed" / "rank00000.parquet")  # fmt: skip


def bench_pages() -> dict:
    root = OUT / "view-root"
    shutil.rmtree(root, ignore_errors=True)
    synth_sidecars(root, ROWS)
    env = {**os.environ, "REELCACHE_PROGRESS": "0"}
    subprocess.run(RC + ["catalog", "merge", "--root", str(root)], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(
        RC + ["catalog", "manifest", "--root", str(root), "--name", "bench", "--where", "level <= 4"],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    synth_run(root)
    p, host, port = start(root)
    out = {}
    try:
        print(
            f"\n== reelcache view at {ROWS:,} rows: seconds to the first byte / last byte (cold, then median of {REPS})"
        )
        for name, path in pages(ROWS).items():
            status, cold_first, cold_last, size = get(host, port, path)
            warm = [get(host, port, path) for _ in range(REPS)]
            first, last = statistics.median(w[1] for w in warm), statistics.median(w[2] for w in warm)
            out[name] = {"path": path, "status": status, "bytes": size, "cold_first_s": cold_first,
                         "cold_last_s": cold_last, "first_s": first, "last_s": last}  # fmt: skip
            grid = name.startswith("clips grid")  # targets: every first byte < 1 s, a grid page's last < 2 s
            ok = "ok" if max(cold_first, first) < 1.0 and (not grid or max(cold_last, last) < 2.0) else "OVER TARGET"
            print(f"  {name:26s} {status}  cold {cold_first:6.3f} / {cold_last:6.3f}   warm {first:6.3f} / {last:6.3f}"
                  f"   {size / 1e3:7.1f} kB  {ok}")  # fmt: skip
    finally:
        p.terminate()
        p.wait()
        shutil.rmtree(root, ignore_errors=True)
    return out


def bench_preview() -> dict:
    import duckdb

    if not (DEMO_ROOT / "catalog.duckdb").exists():
        print(f"\n== latent preview: skipped, no demo root at {DEMO_ROOT} (make demo)")
        return {}
    con = duckdb.connect(str(DEMO_ROOT / "catalog.duckdb"), read_only=True)
    rows = con.execute(
        "SELECT cache, clip_id, view FROM latents WHERE status = 'ok' ORDER BY cache, clip_id DESC, view LIMIT 2"
    ).fetchall()
    con.close()
    if len(rows) < 2:
        print(f"\n== latent preview: skipped, fewer than 2 latents in {DEMO_ROOT}")
        return {}
    for cache in {r[0] for r in rows}:  # made afresh below
        for kind in ("latent", "window"):
            shutil.rmtree(DEMO_ROOT / "view-cache" / kind / cache, ignore_errors=True)
    p, host, port = start(DEMO_ROOT)
    res = {}
    try:
        for (cache, clip_id, view), when in zip(rows, ("first", "second")):
            for kind in ("latent", "window"):
                path = f"/media/{kind}?id={clip_id}&cache={cache}&view={view}"
                made = get(host, port, path)
                served = statistics.median(get(host, port, path)[2] for _ in range(REPS))
                res[f"{kind}, {when} clip"] = {"made_s": made[2], "served_s": served, "bytes": made[3]}
    finally:
        p.terminate()
        p.wait()
    print(f"\n== previews on {DEMO_ROOT} (cache {rows[0][0]}): made on the first request, then served from view-cache/")
    for name, r in res.items():
        print(f"  {name:22s} made {r['made_s']:7.2f} s   served {r['served_s']:6.3f} s (median of {REPS})"
              f"   {r['bytes'] / 1e3:5.0f} kB")  # fmt: skip
    print("  (the first latent of a server's life includes importing torch and diffusers and building the VAE)")
    return res


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    results = {"rows": ROWS, "pages": bench_pages(), "latent_preview": bench_preview()}
    (OUT / "view.json").write_text(json.dumps(results, indent=2))
    print(f"\nresults: {OUT / 'view.json'}")


if __name__ == "__main__":
    main()
