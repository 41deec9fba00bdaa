"""Sample videos from a checkpoint: prompts -> text encoder -> Euler sampler with CFG -> VAE decoder.

Presets are Open-Sora 1.2's inference-server settings (OPENSORA12.md §8; everything not in its
table comes from ``configs/opensora-v1-2/inference/sample.py``: 30 steps, guidance 7, fps 24):

  preset   frames  resolution  aspect  pixels     batch
  low4s    102     360p        9:16    360x640    8
  high4s   102     720p        9:16    720x1280   2
  low16s   408     360p        9:16    360x640    2
  debug    17      (tiny)      9:16    72x128     2      4 steps: CPU tests and the demo

"9:16" is Open-Sora's AR key 0.56, a landscape frame (H < W). The latent size follows the
cache's VAE: Open-Sora 1.2's VAE gives 5 latent frames per 17 pixel frames (102 -> 30); a
diffusers video VAE with temporal ratio r needs 1 + k*r frames, so the frame count is rounded
down to that (102 -> 97 for LTX's r = 8) and the sample says so. Height and width are rounded
down to the VAE's spatial multiple, as the cache crops.

Randomness: prompt i starts from z ~ N(0, 1) drawn on CPU from a generator seeded with
seed + i (seed 42), so a prompt's video does not depend on the batch it shares or the device.
The model's size inputs are the preset's pixel size and frame count, as in training
(``timestep_transform`` shifts the 30 timesteps by them); fps is 24 (Open-Sora's sampling fps),
given to the model as it is (``Conditioning.inputs``, the tensors training builds for a bucket).
Open-Sora appends " aesthetic score: 6.5." to every prompt because its captions carried scores;
ours do not, so prompts are used as written.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from reelcache.cache.spec import spatial_multiple, temporal_ratio
from reelcache.settings import check, setting
from reelcache.train.flow import Conditioning, euler_sample
from reelcache.train.loader import pad_text

__all__ = ["PRESETS", "Preset", "latent_shape", "read_prompts", "sample"]

# cache/opensora_vae.py (diffusers: ~3 s to import) is imported by latent_shape for an Open-Sora VAE, whose
# encoder has imported it already: an evaluation of the validation loss alone starts without it.


@dataclass(frozen=True)
class Preset:
    frames: int = setting(doc="pixel frames (rounded down to what the VAE encodes)", ge=1)
    height: int = setting(doc="pixel height (rounded down to the VAE's spatial multiple)", ge=1)
    width: int = setting(doc="pixel width (rounded down to the VAE's spatial multiple)", ge=1)
    batch: int = setting(doc="prompts per sampler call", ge=1)
    steps: int = setting(30, "Euler steps", ge=1)
    cfg_scale: float = setting(7.0, "classifier-free guidance scale (1: none, 0: the null caption only)", ge=0)
    fps: float = setting(24.0, "the model's fps input", gt=0)
    seed: int = setting(42, "prompt i starts from noise seeded with seed + i", ge=0)

    def __post_init__(self):
        check(self)


PRESETS = {
    "low4s": Preset(102, 360, 640, 8),
    "high4s": Preset(102, 720, 1280, 2),
    "low16s": Preset(408, 360, 640, 2),
    "debug": Preset(17, 72, 128, 2, steps=4),
}


def read_prompts(path) -> list[str]:
    """One prompt per line; blank lines and lines starting with # are skipped."""
    lines = [ln.strip() for ln in Path(path).read_text().splitlines()]
    prompts = [ln for ln in lines if ln and not ln.startswith("#")]
    if not prompts:
        raise ValueError(f"{path} has no prompts (one per line)")
    return prompts


def latent_shape(encoder, channels: int, frames: int, height: int, width: int) -> tuple[tuple, int, int, int]:
    """((C, t, h, w), pixel frames, pixel height, pixel width) the VAE actually produces/decodes."""
    m = spatial_multiple(encoder.spec)
    height, width = height - height % m, width - width % m
    f = encoder.spatial_factor
    if encoder.opensora:
        from reelcache.cache.opensora_vae import latent_frames

        t = latent_frames(frames)
    else:
        r = temporal_ratio(encoder.spec)
        frames = 1 + (frames - 1) // r * r
        t = 1 + (frames - 1) // r
    return (channels, t, height // f, width // f), frames, height, width


@torch.no_grad()
def sample(
    model, text: list[torch.Tensor], video_encoder, preset: Preset, *, device, dtype=torch.float32, progress=None
) -> tuple[list[torch.Tensor], int]:
    """Videos for the prompts whose text-encoder outputs are ``text`` (one [L, D] each, as the
    cache's TextEncoder.encode returns them): a list of uint8 [T, H, W, 3], and the frame count used.

    ``progress(done_steps, total_steps)`` is called after each sampler batch."""
    shape, frames, height, width = latent_shape(
        video_encoder, model.config.in_channels, preset.frames, preset.height, preset.width
    )
    maxlen = model.config.model_max_length
    videos = []
    batches = math.ceil(len(text) / preset.batch)
    for k in range(batches):
        idx = list(range(k * preset.batch, min(len(text), (k + 1) * preset.batch)))
        y, mask, _ = pad_text([text[i][:maxlen] for i in idx])
        z = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(preset.seed + i)) for i in idx])
        b = len(idx)
        out = euler_sample(
            model,
            z.to(device),
            y.to(device, dtype),
            mask.to(device),
            **Conditioning.inputs(b, frames, height, width, preset.fps),
            steps=preset.steps,
            cfg_scale=preset.cfg_scale,
            progress=sys.stderr.isatty(),
        )
        for j in range(b):  # one video at a time: the decoder's activations dwarf the latents
            videos.append(video_encoder.decode(out[j : j + 1].float(), frames)[0])
        if progress:
            progress(k + 1, batches)
    return videos, frames
