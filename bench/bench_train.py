"""make bench (trainer part): training from the latent cache vs the Open-Sora way, same batches.

Both contenders train the debug STDiT3 (configs/train/debug/stage1.toml) for the same steps, in
one process, on the same micro-batches (clip ids and buckets from the same epoch plan):

- cached (reelcache): the real trainer over the demo's tiny latent cache: the streaming loader
  reads VAE posteriors and trimmed T5 embeddings; per step only the model trains. Timed the way
  ``Trainer.train`` times its steps (step time from asking the loader for a batch to the end of
  the optimizer step; data wait up to the batch's arrival).
- online (Open-Sora 1.2's train.py): every step decodes each clip's window from the raw shard
  (PyAV, the same windows and sizes the cache used), encodes it with the same tiny VAE and the
  captions with the same tiny T5, samples the posterior, then the same model step. Decoding runs
  inline here; Open-Sora decodes in DataLoader workers, so the bench also reports the online time
  with decoding fully hidden (the VAE and T5 stay on the training device in both cases).

The two trainers advance in turns of BLOCK steps (one by default; bench/interleave.py: the order
rotates every pair, the first WARMUP steps of each are not timed), so a pair covers the same plan
steps for both, and load from elsewhere, which comes in bursts of seconds, hits both alike. The
headline is the median of the per-pair ratios of samples/s, with their spread.

The cached loader's workers keep making batches while the online path has its turn, so in the
pairs its prefetch is always full: its data wait there is a lower bound. The data wait share
reported is therefore measured on SOLO cached steps run alone after the pairs (the first ones,
served from the refilled prefetch, not counted); if it is not small, the ratio flatters the cache
by about that share. Needs the demo root (`make demo`): DEMO_ROOT=demo-root by default.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from interleave import Ratio, rounds

REPO = Path(__file__).resolve().parents[1]
ROOT = Path(os.environ.get("DEMO_ROOT", REPO / "demo-root"))
STEPS = int(os.environ.get("BENCH_TRAIN_STEPS", 30))  # per contender, warm-up included
BLOCK = int(os.environ.get("BENCH_TRAIN_BLOCK", 1))  # steps per contender per pair
WARMUP = 3  # DataLoader workers starting and the allocator warming up
SOLO = 8  # cached steps alone after the pairs, for the data wait
CONFIG = REPO / "configs/train/debug/stage1.toml"


def config(name: str):
    from reelcache.train.config import load_config

    return load_config(
        CONFIG,
        [
            f'run.name="{name}"',
            f"run.max_steps={STEPS}",
            'log.wandb_mode="disabled"',
            "checkpoint.every=0",
            "run.epochs=100",
            "log.every=1",
        ],
    )


def trainer(name: str):
    from reelcache.train.trainer import Trainer

    shutil.rmtree(ROOT / "runs" / name, ignore_errors=True)
    tr = Trainer(config(name), ROOT)
    tr.model.train()
    return tr


def sync(tr) -> None:
    import torch

    if tr.par.device.type == "cuda":
        torch.cuda.synchronize()


def batches(tr):
    """The loader's batches across epochs, each with the seconds spent waiting for it."""
    while True:
        it = iter(tr.loader)
        while True:
            t0 = time.monotonic()
            batch = next(it, None)
            if batch is None:
                break
            yield batch, time.monotonic() - t0


def cached(tr):
    """The real trainer's step over the latent cache; per step: samples, step seconds, data wait."""
    for batch, wait in batches(tr):
        t0 = time.monotonic()
        out = tr.step(batch, tr.state)
        sync(tr)
        tr.state.global_step += 1
        yield {"samples": out.samples, "step_s": wait + time.monotonic() - t0, "wait_s": wait}


def online(tr):
    """Open-Sora's data path in front of the same trainer step; per step: samples and phase seconds."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    from reelcache.base.buckets import BucketConfig
    from reelcache.cache.decode import decode_clip
    from reelcache.cache.encoders import TextEncoder, VideoEncoder
    from reelcache.cache.plan import load_cache
    from reelcache.train.loader import pad_text

    cfg_cache, _, _ = load_cache(ROOT, "tiny")
    frame_interval = BucketConfig.from_toml(cfg_cache.buckets).frame_interval
    jobs = {r["clip_id"]: r for r in pq.read_table(ROOT / "latents/tiny/_plan/input.parquet").to_pylist()}
    video, text = VideoEncoder(cfg_cache.video_encoder, "cpu"), TextEncoder(cfg_cache.text_encoder, "cpu")
    tr.loader.read = False  # the plan's clip ids and buckets only: the data comes from video
    for batch, _ in batches(tr):
        t0 = time.monotonic()
        frames = [decode_clip(dict(jobs[c], interval=frame_interval), str(ROOT)) for c in batch["clip_id"]]
        t1 = time.monotonic()
        lat = video.encode(torch.as_tensor(np.stack(frames)))
        caps = text.encode([jobs[c]["text"] or "" for c in batch["clip_id"]])
        eps = torch.randn(lat["mean"].shape)
        x = lat["mean"].float() + torch.exp(0.5 * lat["logvar"].float()) * eps
        y, mask, _ = pad_text(caps)
        t2 = time.monotonic()
        out = tr.step(
            {
                **batch,
                "x": x,
                "text": y,
                "text_mask": mask,
                "fps": torch.tensor([float(jobs[c]["fps"] or 24) for c in batch["clip_id"]]),
            },
            tr.state,
        )
        sync(tr)  # as the trainer does: a step ends when the device is done
        t3 = time.monotonic()
        tr.state.global_step += 1
        yield {"samples": out.samples, "decode": t1 - t0, "encode": t2 - t1, "step": t3 - t2}


def block(steps, n: int) -> dict:
    """The sums of the next n steps' measurements."""
    total: dict = {}
    for _ in range(n):
        for k, v in next(steps).items():
            total[k] = total.get(k, 0.0) + v
    return total


def main() -> int:
    if not (ROOT / "latents/tiny/cache.json").exists():
        print(f"bench_train needs the demo root with its tiny cache ({ROOT}): run `make demo` first", file=sys.stderr)
        return 2
    os.environ.setdefault("REELCACHE_PROGRESS", "0")
    reps = (STEPS - WARMUP) // BLOCK
    if reps < 1:
        print(f"BENCH_TRAIN_STEPS={STEPS} leaves no block after {WARMUP} warm-up steps", file=sys.stderr)
        return 2
    tr_a, tr_b = trainer("bench-cached"), trainer("bench-online")
    steps_a, steps_b = cached(tr_a), online(tr_b)
    # Batches the DataLoader holds in flight: the first solo steps get them ready-made.
    ahead = tr_a.cfg.data.workers * tr_a.cfg.data.prefetch
    try:
        res = rounds(
            {
                "cached": lambda r: block(steps_a, WARMUP if r < 0 else BLOCK),
                "online": lambda r: block(steps_b, WARMUP if r < 0 else BLOCK),
            },
            reps=reps,
        )
        block(steps_a, ahead)
        solo = block(steps_a, SOLO)
    finally:
        steps_a.close(), steps_b.close()  # stops the cached loader's DataLoader workers
        tr_a.par.close()  # one process group, shared by both trainers
    a, b = res["cached"], res["online"]
    sps_a = [x["samples"] / x["step_s"] for x in a]
    sps_b = [x["samples"] / (x["decode"] + x["encode"] + x["step"]) for x in b]
    sps_b_hidden = [x["samples"] / (x["encode"] + x["step"]) for x in b]
    ratio, hidden = Ratio.of(sps_a, sps_b), Ratio.of(sps_a, sps_b_hidden)

    def tot(xs, *keys):
        return sum(x[k] for x in xs for k in keys)

    n = reps * BLOCK
    time_a, time_b = tot(a, "step_s"), tot(b, "decode", "encode", "step")
    turns = f"{BLOCK}-step turns" if BLOCK > 1 else "single-step turns"
    print(
        f"\n== training step: cached latents vs Open-Sora's online VAE + T5 ({n} timed steps each after {WARMUP} "
        f"warm-up, in {reps} interleaved pairs of {turns}; 1 process, CPU)"
    )
    print(
        f"cached (reelcache): {tot(a, 'samples') / time_a:.2f} samples/s, {time_a / n * 1e3:.0f} ms/step, "
        f"data wait {100 * solo['wait_s'] / solo['step_s']:.1f}% of step time (over {SOLO} steps alone after the "
        f"pairs; {100 * tot(a, 'wait_s') / time_a:.1f}% in them, its prefetch refilled during the other's turn)"
    )
    print(
        f"online (Open-Sora): {tot(b, 'samples') / time_b:.2f} samples/s, {time_b / n * 1e3:.0f} ms/step "
        f"(decode {100 * tot(b, 'decode') / time_b:.0f}%, VAE + T5 {100 * tot(b, 'encode') / time_b:.0f}%, "
        f"model step {100 * tot(b, 'step') / time_b:.0f}%)"
    )
    print(f"cached vs online: {ratio.describe()}")
    print(f"cached vs online with its decode fully hidden in workers: {hidden.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
