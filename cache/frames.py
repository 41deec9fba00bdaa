"""Frames folded into the batch and back: for the VAEs whose convolutions are 2-D (cache/encoders.py's
``sd-per-frame``, cache/opensora_vae.py's spatial stage). Tensor methods only: importing this loads no torch."""

from __future__ import annotations


def fold_frames(x):
    """[B, C, T, H, W] -> [(B T), C, H, W], batch-major: every frame an image, for a VAE that sees
    one frame at a time (the module docstring says which)."""
    b, c, t, h, w = x.shape
    return x.transpose(1, 2).reshape(b * t, c, h, w)


def unfold_frames(x, batch: int):
    """[(B T), C, H, W] -> [B, C, T, H, W] for ``batch`` = B: the inverse of ``fold_frames``."""
    return x.reshape(batch, -1, *x.shape[1:]).transpose(1, 2)
