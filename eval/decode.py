"""Latents back to video: the inverse of the cache's normalization, then the VAE's own decoder.

The cache stores z' = (z - shift) x scale per channel (``reelcache.cache.encoders.normalization``:
exactly what each kind's diffusers pipeline feeds its transformer), so a sampled z' is turned
back with z = z' / scale + shift, the step the pipeline takes before ``vae.decode``. Then:

  opensora-v1.2   ``OpenSoraVAE.decode(z', num_frames)``: it un-normalizes itself (its shift and
                  scale are inside the module, normalization() reports identity for it), decodes
                  5-latent chunks temporally, then every frame with the SDXL decoder;
  sd-per-frame    the image ``AutoencoderKL`` on every frame, (B T) flattened;
  other kinds     the diffusers video VAE's ``decode(z).sample`` on the whole clip.

Pixels come back in [-1, 1] and become uint8 [B, T, H, W, 3] the way the encoders' input was made
(x / 127.5 - 1), clipped, rounded. A decode may return more frames than asked (causal VAEs
decode 1 + k*ratio frames): the first ``num_frames`` are kept.

Trade-off: decoding lives here, beside the sampler, instead of on ``VideoEncoder``, because only
evaluation needs it and the cache must not change under a running cache job. It reads nothing
private of VideoEncoder beyond its documented attributes (model, shift, scale, per_frame,
opensora); it can move into cache/encoders.py as ``VideoEncoder.decode`` unchanged.

Real LTX-Video 0.9.1+ VAEs condition their decoder on a timestep (``timestep_conditioning``);
the pipeline passes ``decode_timestep`` with noise added to the latents. This module decodes
with the VAE's defaults (no timestep), which is exact for the tiny models and for VAEs without
timestep conditioning.
"""

from __future__ import annotations

import torch

__all__ = ["decode", "denormalize", "to_uint8"]


def denormalize(z: torch.Tensor, shift, scale) -> torch.Tensor:
    """z' -> z = z' / scale + shift, per channel (dim 1); scalars broadcast."""
    shape = (1, -1) + (1,) * (z.dim() - 2)
    shift = torch.as_tensor(shift, dtype=torch.float32, device=z.device).view(shape)
    scale = torch.as_tensor(scale, dtype=torch.float32, device=z.device).view(shape)
    return z.float() / scale + shift


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """[B, 3, T, H, W] in [-1, 1] -> uint8 [B, T, H, W, 3] on CPU (the inverse of the encoders' x/127.5 - 1)."""
    x = (x.float().clamp(-1, 1) + 1) * 127.5
    return x.round().to(torch.uint8).permute(0, 2, 3, 4, 1).contiguous().cpu()


@torch.inference_mode()
def decode(encoder, z: torch.Tensor, num_frames: int) -> torch.Tensor:
    """Normalized latents [B, C, t, h, w] (as the cache stores them) -> uint8 video [B, T, H, W, 3].

    ``encoder`` is a ``reelcache.cache.encoders.VideoEncoder``."""
    model = encoder.model
    z = z.to(encoder.device)
    if encoder.opensora:
        x = model.decode(z.to(encoder.dtype), num_frames=num_frames)
    else:
        raw = denormalize(z, encoder.shift, encoder.scale).to(encoder.dtype)
        if encoder.per_frame:
            b, c, t, h, w = raw.shape
            img = model.decode(raw.transpose(1, 2).reshape(b * t, c, h, w)).sample
            x = img.reshape(b, t, *img.shape[1:]).transpose(1, 2)
        else:
            x = model.decode(raw).sample
    if x.shape[2] < num_frames:
        raise ValueError(f"the VAE decoded {x.shape[2]} frames from {z.shape[2]} latent frames, "
                         f"fewer than the {num_frames} asked for")
    return to_uint8(x[:, :, :num_frames])
