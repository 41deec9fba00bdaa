"""What the replication's caches store, cache format 1 (each sample holds its caption's embedding) against
the content-addressed store (each (text encoder, caption) once, cache/store.py), from `cache plan`'s own
functions on 20k synthetic clips shaped like OpenVid-1M + MiraData, scaled to 1.33M clips.

Clips (seeded): 3/4 OpenVid-like (480p, 720p or 1080p, 16:9 or 9:16, 2-15 s at 30 fps, captions of 40-110
words), 1/4 MiraData-like (720p or 1080p, 30-120 s, captions of 90-180 words, cut at T5's 300
tokens); caption tokens estimated from words as `cache plan` does before a unit has measured them.
Prints K = 1..5 for os12-stage1/2/3 and the three caches' total (B1 K = 5, B2 and B3 K = 2), before and
after; writes BENCH_OUT/cache_bytes.json.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
N, SCALE = 20_000, 1_330_000 / 20_000
OUT = Path(os.environ.get("BENCH_OUT", "bench-out"))


def clips(seed: int = 0) -> pa.Table:
    rng, rows = random.Random(seed), []
    for i in range(N):
        mira = rng.random() < 0.25
        h = rng.choice([720, 1080] if mira else [480, 720, 1080])
        w = h * 16 // 9
        if rng.random() < 0.1:
            h, w = w, h
        secs = rng.uniform(30, 120) if mira else rng.uniform(2, 15)
        words = rng.randint(90, 180) if mira else rng.randint(40, 110)
        rows.append(
            {
                "clip_id": f"{rng.getrandbits(64):016x}",
                "shard": f"raw/s/{i // 1000:06d}-00.tar",
                "shard_offset": 512 * (i + 1),
                "file_size": 1,
                "num_frames": int(secs * 30),
                "height": h,
                "width": w,
                "fps": 30.0,
                "text": " ".join(f"w{rng.randint(0, 5000)}" for _ in range(words)),
            }
        )
    return pa.Table.from_pylist(rows)


def main() -> None:
    from reelcache.base.buckets import BucketConfig
    from reelcache.base.latents import text_key
    from reelcache.cache.costs import SAMPLE_OVERHEAD, view_costs
    from reelcache.cache.plan import CacheConfig, _draws

    table = clips()
    ident = {"video_encoder": {"config": {}}, "text_encoder": {"config": {"d_model": 4096}}}
    out, used = {}, {}
    for stage, k in (("stage1", 5), ("stage2", 2), ("stage3", 2)):
        cfg = CacheConfig.from_toml(REPO / f"configs/cache/opensora12-{stage}.toml")
        draws = _draws(table, cfg, BucketConfig.from_toml(cfg.buckets), 5)
        costs = view_costs([(r["text"], text_key("t5", r["text"]), False, d) for r, d in draws], cfg, ident, upto=5)
        out[stage] = {"views": k, "costs": costs}
        used[stage] = {r["clip_id"] for r, d in draws if any(x["bucket"] for x in d[:k])}
        print(f"\n== os12-{stage} (per 1.33M clips; * = its views)")
        print(f"   {'K':>3} {'encodes/clip':>12} {'format 1':>10} {'store':>10} {'captions f1':>12} {'store':>8}")
        for c in costs:
            print(
                f" {'*' if c['views'] == k else ' '} {c['views']:>3} {c['encodes'] / N:>12.2f} "
                f"{c['bytes_before'] * SCALE / 1e12:>8.1f} TB {c['bytes'] * SCALE / 1e12:>7.1f} TB "
                f"{100 * c['text_bytes_before'] / c['bytes_before']:>11.0f}% "
                f"{100 * c['text_bytes'] / c['bytes']:>7.0f}%"
            )
    before = sum(v["costs"][v["views"] - 1]["bytes_before"] for v in out.values())
    latents = sum(v["costs"][v["views"] - 1]["bytes"] - v["costs"][v["views"] - 1]["text_bytes"] for v in out.values())
    # the three caches share one text encoder: a clip's caption is stored once for all of them
    union = set().union(*used.values())
    captions = sum(
        min(300, 1 + round(1.3 * len(r["text"].split()))) * 4096 * 2 + SAMPLE_OVERHEAD
        for r in table.to_pylist()
        if r["clip_id"] in union
    )
    after = latents + captions
    print(
        f"\n== the replication's three caches (B1 K = 5, B2 and B3 K = 2), per 1.33M clips: format 1 "
        f"{before * SCALE / 1e12:.1f} TB, store {after * SCALE / 1e12:.1f} TB "
        f"(captions stored once for all three: {len(union)} of {N} clips have a latent in one of them)"
    )
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "cache_bytes.json").write_text(json.dumps({"scale": SCALE, "caches": out, "before": before, "after": after}))


if __name__ == "__main__":
    sys.exit(main())
