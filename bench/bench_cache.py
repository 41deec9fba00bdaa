"""make bench (cache part): decode for a bucket vs ffmpeg and vs the full-decode path; storage.

1. Decode + resize + crop to a bucket (240p 9:16, 33 frames from a seeded window) on the demo
   clips: reelcache's decode_window vs ``ffmpeg -ss ... -vf scale=...:flags=area,crop=...`` to raw
   RGB on a pipe, and vs a full decode followed by a float-tensor resize in torch (the Open-Sora
   data path), in the same run.
2. Storage per clip: text embeddings trimmed to their tokens vs padded to 300 x 4096 in bf16
   (2.46 MB), using the token counts of the demo captions; latent bytes per bucket.

No GPU here: encoder throughput at real sizes is not measured by this script.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

OUT = Path(os.environ.get("BENCH_OUT", "bench-out"))


def clips(n=60):
    from reelcache.ingest.filters import Rejected
    from reelcache.ingest.probe import probe

    data = Path("demo-data") if Path("demo-data/videos").exists() else OUT / "demo-data"
    if not (data / "videos").exists():
        from reelcache.ingest.demo import generate

        generate(data)
    out = []
    for p in sorted((data / "videos").iterdir()):
        try:
            meta = probe(str(p))
        except Rejected:
            continue
        if meta["num_frames"] > 40 and meta["rotation"] == 0:
            out.append((str(p), meta))
        if len(out) == n:
            break
    return out


def bench_decode(results):
    import av
    import numpy as np
    import torch

    from reelcache.cache.decode import decode_window, window_start

    H, W, T = 240, 424, 33
    items = clips()
    jobs = [(p, window_start(p, 0, m["num_frames"], T), m) for p, m in items]

    def ours():
        for p, s, m in jobs:
            decode_window(p, frames=T, interval=1, height=H, width=W, start=s)

    def ffmpeg():
        for p, s, m in jobs:
            scale = max(H / m["height"], W / m["width"])
            sw, sh = -(-int(m["width"] * scale * 1000) // 1000), -(-int(m["height"] * scale * 1000) // 1000)
            sw, sh = max(W, sw + sw % 2), max(H, sh + sh % 2)
            out = subprocess.run(["ffmpeg", "-v", "error", "-ss", f"{s / m['fps']:.4f}", "-i", p, "-frames:v", str(T),
                                  "-vf", f"scale={sw}:{sh}:flags=area,crop={W}:{H}", "-f", "rawvideo",
                                  "-pix_fmt", "rgb24", "-"], check=True, capture_output=True).stdout
            np.frombuffer(out, np.uint8)

    def full_decode_torch():
        torch.set_num_threads(2)
        for p, s, m in jobs:
            with av.open(p) as c:
                frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
            x = torch.from_numpy(np.stack(frames[s:s + T])).permute(0, 3, 1, 2).float() / 255
            scale = max(H / x.shape[2], W / x.shape[3])
            x = torch.nn.functional.interpolate(x, size=(max(H, round(x.shape[2] * scale)),
                                                         max(W, round(x.shape[3] * scale))), mode="area")
            y0, x0 = (x.shape[2] - H) // 2, (x.shape[3] - W) // 2
            x[:, :, y0:y0 + H, x0:x0 + W].contiguous()

    rates = {}
    for name, fn in [("reelcache decode_window", ours), ("ffmpeg scale+crop to raw", ffmpeg),
                     ("full decode + torch float resize", full_decode_torch)]:
        fn() if name.startswith("reelcache") else None        # warm page cache and imports
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        rates[name] = {"clips_per_s": len(jobs) / dt, "frames_per_s": len(jobs) * T / dt}
    base = rates["reelcache decode_window"]["clips_per_s"]
    results["decode"] = {"clips": len(jobs), "bucket": f"{H}x{W}x{T}", "rates": rates,
                         "vs_ffmpeg": base / rates["ffmpeg scale+crop to raw"]["clips_per_s"],
                         "vs_full_decode": base / rates["full decode + torch float resize"]["clips_per_s"]}
    print(f"\n== decode for a bucket ({len(jobs)} demo clips -> {T} x {H} x {W} RGB, seeded windows)")
    for k, v in rates.items():
        print(f"  {k:34s} {v['clips_per_s']:7.1f} clips/s {v['frames_per_s']:8.0f} frames/s   "
              f"reelcache/this = {base / v['clips_per_s']:5.2f}x")


def bench_storage(results):
    import duckdb

    root = Path("demo-root")
    lens = []
    if (root / "catalog.duckdb").exists():
        con = duckdb.connect(str(root / "catalog.duckdb"), read_only=True)
        lens = [r[0] for r in con.execute("SELECT text_len FROM latents WHERE status = 'ok'").fetchall()]
        con.close()
    padded = 300 * 4096 * 2
    mean_len = sum(lens) / len(lens) if lens else 120
    trimmed = mean_len * 4096 * 2
    lat = {f"{res} x 51 frames -> {t}x{h}x{w}": 2 * 4 * t * h * w * 2
           for res, t, h, w in (("240p", 15, 30, 53), ("360p", 15, 45, 80), ("720p", 15, 90, 160))}
    results["storage"] = {"text_tokens_mean": mean_len, "t5xxl_padded_bytes": padded,
                          "t5xxl_trimmed_bytes": trimmed, "ratio": trimmed / padded, "posterior_bytes": lat}
    print(f"\n== storage per clip (T5-XXL, d=4096, bf16; mean {mean_len:.1f} caption tokens"
          f"{' in the demo cache' if lens else ' (OpenVid-like assumption)'})")
    print(f"  text padded to 300 tokens   {padded / 1e6:6.2f} MB")
    print(f"  text trimmed to its tokens  {trimmed / 1e6:6.2f} MB   ({trimmed / padded:.2f}x; "
          f"saves {(padded - trimmed) * 1.3e6 / 1e12:.1f} TB over 1.3M clips)")
    for k, v in lat.items():
        print(f"  posterior mean+logvar {k:30s} {v / 1e6:5.2f} MB")


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    results = {}
    bench_decode(results)
    bench_storage(results)
    (OUT / "cache-results.json").write_text(json.dumps(results, indent=2))
    print(f"\nresults: {OUT / 'cache-results.json'}")


if __name__ == "__main__":
    main()
