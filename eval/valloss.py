"""Deterministic validation loss: the same clips, noise levels and noise for every checkpoint.

Open-Sora's ``misc/eval_loss`` idea (the rectified-flow loss on held-out clips at fixed
timesteps), made a pure function of (checkpoint, manifest):

  clips       every clip of a loader manifest (``catalog manifest --cache``), grouped by bucket,
              in clip-id order; read with the loader's own ``source_row`` (a ranged read each, caption too);
  latent      the posterior MEAN the cache stored (no sample: the number must not move because a
              draw did), or the stored sample for ``store = "sample"`` caches;
  timesteps   K = 10 evenly spaced levels t_k = (k + 0.5) * 1000 / K (50, 150, ..., 950), used
              as they are, WITHOUT Open-Sora's resolution/length ``timestep_transform``. Upstream's
              eval passes t explicitly, which skips the transform too; and only an untransformed t
              means the same noise level x_t = (1 - t/1000) x0 + t/1000 eps in every bucket and
              stage, so numbers compare across stages trained at other resolutions;
  noise       drawn on CPU in fp32 from a generator seeded by blake2b(clip id, k), so the same on
              every device, batch size and checkpoint;
  loss        ``train.flow.training_losses`` (velocity MSE, mean over C, T, H, W), no frame mask,
              no caption dropout; fps, height and width as the trainer feeds them (its ``Conditioning``).

Reported: the mean over (clip, t) overall and per bucket (every clip counts once per t, so a
bucket's share is its clip count), and per timestep (where in the noise range a model improves).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from reelcache.train.flow import NUM_TIMESTEPS, Conditioning, stable_seed, training_losses
from reelcache.train.loader import pad_text
from reelcache.train.sections import ConditioningConfig
from reelcache.train.source import load_source, source_row

__all__ = ["TIMESTEPS", "eval_timesteps", "validation_loss"]

TIMESTEPS = 10
DEFAULT_CONDITIONING = ConditioningConfig().build(frame_interval=1)  # 24 fps: a manifest of videos without fps


def eval_timesteps(k: int = TIMESTEPS) -> list[float]:
    return [(i + 0.5) * float(NUM_TIMESTEPS) / k for i in range(k)]


def _latent(sample: dict) -> torch.Tensor:
    return (sample["mean"] if "mean" in sample else sample["sample"]).float()


@torch.no_grad()
def validation_loss(
    model,
    manifest,
    root,
    *,
    device,
    dtype=torch.float32,
    cond: Conditioning = DEFAULT_CONDITIONING,
    batch_size: int = 4,
    timesteps: int = TIMESTEPS,
    max_clips: int | None = None,
    progress=None,
) -> dict:
    """The loss of ``model`` (eval mode) over a loader manifest: {overall, buckets, timesteps, clips};
    ``cond``: the checkpoint's training conditioning (``ConditioningConfig.build``).

    ``progress(done, total)`` is called after each batch."""
    src = load_source(manifest, view=0)  # one fixed view per clip: a cache of K views holds K rows
    order = np.arange(len(src.clip_id))
    if max_clips:
        order = order[:max_clips]  # clip-id order: the same first clips every time
    by_bucket: dict[str, list[int]] = {}
    for i in order:
        by_bucket.setdefault(str(src.bucket[i]), []).append(int(i))
    ts = eval_timesteps(timesteps)
    total = sum(math.ceil(len(v) / batch_size) for v in by_bucket.values()) * len(ts)
    done = 0
    sums = {b: np.zeros(len(ts)) for b in by_bucket}
    root = root if str(root).startswith("s3://") else Path(root)  # shards in S3: read by ranged GETs
    for bucket, idx in sorted(by_bucket.items()):
        for s in range(0, len(idx), batch_size):
            part = idx[s : s + batch_size]
            samples = []
            for i in part:
                samples.append(source_row(root, src, i))
            x0 = torch.stack([_latent(smp) for smp in samples]).to(device)
            y, mask, _ = pad_text([smp["text"] for smp in samples])
            inputs = cond(bucket, src.fps[part].astype(np.float32))
            del inputs["num_frames"]  # evaluated at fixed timesteps: no resolution shift
            b = len(part)
            kwargs = {"y": y.to(device, dtype), "mask": mask.to(device), **{k: v.to(device) for k, v in inputs.items()}}
            for k, t in enumerate(ts):
                noise = torch.stack(
                    [
                        torch.randn(
                            x0.shape[1:],
                            generator=torch.Generator().manual_seed(stable_seed("val-noise", src.clip_id[i], k)),
                        )
                        for i in part
                    ]
                ).to(device)
                losses = training_losses(model, x0, kwargs, noise, torch.full((b,), t, device=device))
                sums[bucket][k] += float(losses.double().sum())
                done += 1
                if progress:
                    progress(done, total)
    counts = {b: len(v) for b, v in by_bucket.items()}
    n = sum(counts.values())
    return {
        "overall": float(sum(s.sum() for s in sums.values()) / (n * len(ts))),
        "buckets": {
            b: {"loss": float(sums[b].sum() / (counts[b] * len(ts))), "clips": counts[b]} for b in sorted(sums)
        },
        "timesteps": {f"{t:g}": float(sum(s[k] for s in sums.values()) / n) for k, t in enumerate(ts)},
        "clips": n,
        "timestep_values": ts,
    }
