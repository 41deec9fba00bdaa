"""make bench (trainer part): training from the latent cache vs the Open-Sora way, same batches.

Both contenders train the debug STDiT3 (configs/train/debug/stage1.toml) for the same steps, in
one process, on the same micro-batches (clip ids and buckets from the same epoch plan):

- cached (reelcache): the real trainer over the demo's tiny latent cache: the streaming loader
  reads VAE posteriors and trimmed T5 embeddings; per step only the model trains.
- online (Open-Sora 1.2's train.py): every step decodes each clip's window from the raw shard
  (PyAV, the same windows and sizes the cache used), encodes it with the same tiny VAE and the
  captions with the same tiny T5, samples the posterior, then the same model step. Decoding runs
  inline here; Open-Sora decodes in DataLoader workers, so the bench also reports the online time
  with decoding fully hidden (the VAE and T5 stay on the training device in both cases).

The ratio of samples/s is the headline; the data wait of the cached run is reported as a share
of its step time. Needs the demo root (`make demo`): DEMO_ROOT=demo-root by default.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT = Path(os.environ.get("DEMO_ROOT", REPO / "demo-root"))
STEPS = int(os.environ.get("BENCH_TRAIN_STEPS", 30))
CONFIG = REPO / "configs/train/debug/stage1.toml"


def config(name: str):
    from reelcache.train.config import load_config

    return load_config(CONFIG, [f'run.name="{name}"', f"run.max_steps={STEPS}", 'run.wandb_mode="disabled"',
                                "run.ckpt_every=0", "run.epochs=100", "run.log_every=1"])


def cached() -> dict:
    """The real trainer; its own per-step metrics (step time, data wait) are the measurement."""
    import duckdb

    from reelcache.train.trainer import Trainer

    shutil.rmtree(ROOT / "runs/bench-cached", ignore_errors=True)
    t = time.monotonic()
    Trainer(config("bench-cached"), ROOT).train()
    wall = time.monotonic() - t
    # Skip the first steps: DataLoader workers starting and the allocator warming up.
    row = duckdb.sql(f"""SELECT sum(samples) / sum(step_s) AS sps, sum(data_wait_s) / sum(step_s) AS wait,
                                avg(step_s) AS step_s, count(*) AS n
                         FROM '{ROOT}/runs/bench-cached/metrics/*.parquet' WHERE step >= 3""").fetchall()[0]
    return {"samples_per_s": row[0], "data_share": row[1], "step_s": row[2], "steps": row[3], "wall_s": wall}


def online() -> dict:
    """Open-Sora's data path in front of the same trainer step."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    from reelcache.cache.encoders import TextEncoder, VideoEncoder
    from reelcache.cache.plan import load_cache
    from reelcache.cache.run import decode_clip
    from reelcache.train.loader import pad_text
    from reelcache.catalog.buckets import BucketConfig
    from reelcache.train.trainer import Trainer

    _, cfg_cache, _ = load_cache(ROOT, "tiny")
    frame_interval = BucketConfig.from_toml(cfg_cache.buckets).frame_interval
    jobs = {r["clip_id"]: r for r in pq.read_table(ROOT / "latents/tiny/_plan/input.parquet").to_pylist()}
    video, text = VideoEncoder(cfg_cache.video_encoder, "cpu"), TextEncoder(cfg_cache.text_encoder, "cpu")
    shutil.rmtree(ROOT / "runs/bench-online", ignore_errors=True)
    tr = Trainer(config("bench-online"), ROOT)
    tr.loader.read = False                 # the plan's clip ids and buckets only: the data comes from video
    tr.model.train()
    times = {"decode": 0.0, "encode": 0.0, "step": 0.0}
    samples, n = 0, 0
    try:
        for batch in tr.loader:
            if tr.global_step >= STEPS:
                break
            t0 = time.monotonic()
            frames = [decode_clip(dict(jobs[c], interval=frame_interval), str(ROOT)) for c in batch["clip_id"]]
            t1 = time.monotonic()
            lat = video.encode(torch.as_tensor(np.stack(frames)))
            caps = text.encode([jobs[c]["text"] or "" for c in batch["clip_id"]])
            eps = torch.randn(lat["mean"].shape)
            x = (lat["mean"].float() + torch.exp(0.5 * lat["logvar"].float()) * eps)
            y, mask, _ = pad_text(caps)
            t2 = time.monotonic()
            out = tr.step({**batch, "x": x, "text": y, "text_mask": mask,
                           "fps": torch.tensor([float(jobs[c]["fps"] or 24) for c in batch["clip_id"]])})
            t3 = time.monotonic()
            tr.global_step += 1
            if tr.global_step > 3:             # as for the cached run: skip the warm-up steps
                times["decode"] += t1 - t0
                times["encode"] += t2 - t1
                times["step"] += t3 - t2
                samples += out["samples"]
                n += 1
    finally:
        tr.par.close()
    total = sum(times.values())
    return {"samples_per_s": samples / total, "hidden_decode_samples_per_s": samples / (total - times["decode"]),
            "shares": {k: v / total for k, v in times.items()}, "step_s": total / n, "steps": n}


def main() -> int:
    if not (ROOT / "latents/tiny/cache.json").exists():
        print(f"bench_train needs the demo root with its tiny cache ({ROOT}): run `make demo` first", file=sys.stderr)
        return 2
    os.environ.setdefault("REELCACHE_PROGRESS", "0")
    a = cached()
    b = online()
    print(f"\n== training step: cached latents vs Open-Sora's online VAE + T5 ({STEPS} steps, 1 process, CPU)")
    print(f"cached (reelcache): {a['samples_per_s']:.2f} samples/s, {a['step_s'] * 1e3:.0f} ms/step, "
          f"data wait {100 * a['data_share']:.1f}% of step time")
    print(f"online (Open-Sora): {b['samples_per_s']:.2f} samples/s, {b['step_s'] * 1e3:.0f} ms/step "
          f"(decode {100 * b['shares']['decode']:.0f}%, VAE + T5 {100 * b['shares']['encode']:.0f}%, "
          f"model step {100 * b['shares']['step']:.0f}%)")
    print(f"ratio: {a['samples_per_s'] / b['samples_per_s']:.1f}x the online path "
          f"({a['samples_per_s'] / b['hidden_decode_samples_per_s']:.1f}x with its decode fully hidden in workers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
