"""FLOPs of the models the GPU projection compares, counted on the meta device (no GPU, no memory):
STDiT3 as the stage configs build it (a training step with its backward and recompute), the Open-Sora
1.2 VAE along its encode stages, and the T5-v1.1-XXL encoder. torch's FlopCounterMode counts
matmuls, convolutions and attention. bench/bench_gpu_projection.py turns them into GPU-hours;
bench/gpu_parts.py divides measured times by them (MFU)."""

from __future__ import annotations

import functools
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CAPTION = 300  # caption tokens, as Open-Sora pads them
T5XXL = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    feed_forward_proj="gated-gelu",
    is_encoder_decoder=False,
    use_cache=False,
)


def stage_config(n: int) -> dict:
    return tomllib.loads((REPO / f"configs/train/opensora12/stage{n}.toml").read_text())


def count(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def build_dit(preset: str | None = None, **over):
    """STDiT3 on meta, in training mode, as the stage configs build it. ``preset`` is for tests
    (the tiny preset keeps its own caption size)."""
    import torch

    from reelcache.train.model import STDiT3, STDiT3Config

    doc = stage_config(1)["model"]
    over = {**({} if preset else doc.get("overrides", {})), "freeze_y_embedder": doc.get("freeze_y_embedder"), **over}
    with torch.device("meta"):
        model = STDiT3(STDiT3Config.preset(preset or doc["preset"], **over)).to(torch.bfloat16)
    model.set_grad_checkpointing(bool(doc.get("grad_checkpoint")))
    return model.train()


def dit_step(model, t: int, h: int, w: int, H: int, W: int, backward: bool = True) -> tuple[int, int]:
    """(forward, training step) FLOPs of one sample: latent (t, h, w), pixels (H, W)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    cfg = model.config
    with torch.device("meta"):
        x = torch.empty(1, cfg.in_channels, t, h, w, dtype=torch.bfloat16)
        y = torch.empty(1, 1, cfg.model_max_length, cfg.caption_channels, dtype=torch.bfloat16)
        s, hh, ww = torch.empty(1), torch.full((1,), float(H)), torch.full((1,), float(W))
    with torch.set_grad_enabled(backward), FlopCounterMode(display=False) as fc:
        out = model(x, s, y, fps=s, height=hh, width=ww)
        fwd = fc.get_total_flops()
        if backward:  # the checkpointed blocks' recompute runs in here, and is counted
            out[:, : cfg.in_channels].float().pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    return fwd, fc.get_total_flops()


def dit_extrapolated(pair, depth: int, *geo) -> tuple[int, int]:
    """Counts of the depth-``depth`` model from ``pair`` = its depth-1 and depth-2 versions: the block
    pairs are identical and all else (the adaLN t_block's backward too) is in both, so this is exact."""
    (f1, s1), (f2, s2) = (dit_step(m, *geo) for m in pair)
    return f1 + (depth - 1) * (f2 - f1), s1 + (depth - 1) * (s2 - s1)


def build_vae(tiny: bool = False):
    import torch

    from reelcache.cache.opensora_vae import OpenSoraVAE

    with torch.device("meta"):
        return OpenSoraVAE(tiny=tiny).to(torch.bfloat16).eval()


@functools.cache
def _vae_part(vae, part: str, shape: tuple) -> tuple[int, tuple]:
    """(FLOPs, output shape) of ``vae.<part>.encode`` on a meta input. Memoized: every length of a
    resolution shares the same per-frame and per-chunk counts."""
    import torch

    with torch.no_grad(), torch.device("meta"):
        x, out = torch.empty(shape, dtype=torch.bfloat16), []
        flops = count(lambda: out.append(getattr(vae, part).encode(x)))
    return flops, tuple(out[0].latent_dist.mean.shape if part == "spatial" else out[0][0].shape)


def vae_encode(vae, frames: int, H: int, W: int) -> int:
    """One clip along ``encode_stages``. The SDXL encoder runs per frame and frames are independent,
    so one frame is counted and multiplied; then each 17-frame chunk (the last may be shorter)
    goes through the temporal encoder."""
    from reelcache.cache.opensora_vae import MICRO_FRAMES

    spatial, (_, c, h, w) = _vae_part(vae, "spatial", (1, 3, H, W))
    chunks = [min(MICRO_FRAMES, frames - i) for i in range(0, frames, MICRO_FRAMES)]
    return frames * spatial + sum(_vae_part(vae, "temporal", (1, c, n, h, w))[0] for n in chunks)


def t5_encode() -> tuple[int, int]:
    """(FLOPs of one 300-token caption, parameters) of the T5-v1.1-XXL encoder on meta."""
    import torch
    from transformers import T5Config, T5EncoderModel

    with torch.device("meta"):
        model = T5EncoderModel(T5Config(**T5XXL)).to(torch.bfloat16).eval()
        ids = torch.zeros(1, CAPTION, dtype=torch.long)
    with torch.no_grad():  # padded to 300 tokens, as in Open-Sora; the attention mask changes no FLOPs
        return count(lambda: model(input_ids=ids)), sum(p.numel() for p in model.parameters())
