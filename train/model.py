"""STDiT3, the Open-Sora 1.2 video diffusion transformer, as a plain torch module.

Same computation and the same parameter names as Open-Sora's ``opensora/models/stdit/stdit3.py``
(facts in docs/OPENSORA12.md §1), so an Open-Sora / published STDiT3 state dict loads with
``strict=True`` and the fixture outputs of Open-Sora's own class are reproduced (tests/train/test_model.py).
Here: the config, the block and the model that read it, and the FLOP count; the config-free
building blocks (embedders, attention, RoPE, norms, patch embedding, positions) are train/layers.py.

    x (B,4,T,H,W) -> PatchEmbed3D (Conv3d, zero-pad to the patch grid) -> tokens (B, T, S, C)
      + 2D sin-cos positions scaled by the picture size (height[0], width[0], as upstream)
    t = t_embedder(timestep) + fps_embedder(fps);  t_mlp = t_block(t)   (adaLN-single, (B, 6C))
    y = y_proj(caption)                                                  (B, L, C)
    depth x [spatial block over (B*T, S), temporal block over (B*S, T) with interleaved RoPE]
      block: x += gate * attn(mod(norm1 x)); x += cross_attn(x, y); x += gate * mlp(mod(norm2 x))
    final layer: mod(norm x) with (table + t) -> Linear -> unpatchify -> crop -> float32

Where this differs from upstream's implementation (not its result):
  * Attention is ``F.scaled_dot_product_attention`` everywhere. Cross-attention is one batched
    call with a boolean key mask (B,1,1,L) instead of xformers' packed block-diagonal mask; it
    computes the same thing (each sample attends only to its own valid tokens) without packing,
    so captions can be (B,L,D) trimmed to the batch's longest caption.
  * Frame masking (x_mask) selects the modulation *vectors* per frame (t or t=0) and modulates
    once, instead of modulating twice and selecting tokens; elementwise, so the result is the same.
  * Caption dropout is drawn by the caller (``caption_drop``; the trainer's probability is
    ``flow.caption_dropout``) so a run is reproducible and resumable; the model never draws
    random numbers. Upstream's ``class_dropout_prob`` config key is ignored on load.
  * ``mask=None`` means "every token of each sample is valid"; upstream then lets every sample
    attend to all samples' captions (an upstream quirk, never used by training).
  * The pos-embedding scale is computed with tensor ops (no ``.item()``, no host sync on GPU).
  * The pos-embedding frequencies are fp32: upstream's are a buffer that its bf16 cast rounds.
    ``pos_embed_bf16_freqs`` rounds them the same way (the opensora12-original configs set it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from reelcache.train.layers import (
    CaptionEmbedder,
    CrossAttention,
    FinalLayer,
    Mlp,
    PatchEmbed3D,
    Rope,
    ScalarEmbedder,
    SelfAttention,
    modulate,
    pos_embed_2d,
)

# what other stages may use (train/__init__.py: PUBLIC); the layers are train/layers.py's
__all__ = ["PRESETS", "STDiT3", "STDiT3Config", "flops_per_sample"]


@dataclass
class STDiT3Config:
    """STDiT3 hyper-parameters, Open-Sora's names and defaults (upstream's kernel flags dropped)."""

    input_sq_size: int = 512
    """Reference picture side in pixels: positions are scaled by sqrt(height*width)/input_sq_size."""
    in_channels: int = 4
    """Latent channels from the VAE."""
    patch_size: tuple[int, int, int] = (1, 2, 2)
    """(t, h, w) patch of the Conv3d patch embedder; latents are zero-padded to multiples of it."""
    hidden_size: int = 1152
    """Token width C."""
    depth: int = 28
    """Number of (spatial, temporal) block pairs."""
    num_heads: int = 16
    """Attention heads (head_dim = hidden_size / num_heads, must be even for RoPE)."""
    mlp_ratio: float = 4.0
    """MLP hidden width / hidden_size."""
    pred_sigma: bool = True
    """Output 2*in_channels channels (upstream's layout; only the first in_channels are used)."""
    drop_path: float = 0.0
    """Stochastic depth. Only 0.0 is supported (every Open-Sora 1.2 config uses 0.0)."""
    caption_channels: int = 4096
    """Text-encoder width (T5-XXL d_model)."""
    model_max_length: int = 300
    """Caption tokens of the null caption ``y_embedder.y_embedding`` (and the longest caption)."""
    qk_norm: bool = True
    """RMSNorm on per-head q and k of self-attention (not cross-attention), computed in fp32."""
    only_train_temporal: bool = False
    """Freeze everything but the temporal blocks."""
    freeze_y_embedder: bool = False
    """Freeze the caption projection (all Open-Sora 1.2 stages do)."""
    skip_y_embedder: bool = False
    """Captions arrive already projected to hidden_size (y_proj is not applied)."""
    pos_embed_bf16_freqs: bool = False
    """Round the 2D position embedding's frequencies to bf16, as upstream's ``model.to(bf16)`` rounds its
    ``inv_freq`` buffer (what Open-Sora's weights were trained with; up to 0.058 off the fp32 embedding).
    Not upstream's config key (its config.json lacks it); RoPE's freqs are a parameter, cast with the model."""

    def __post_init__(self):
        self.patch_size = tuple(int(p) for p in self.patch_size)
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise ValueError(f"patch_size must be three positive ints, got {self.patch_size}")
        for name in (
            "input_sq_size",
            "in_channels",
            "hidden_size",
            "depth",
            "num_heads",
            "caption_channels",
            "model_max_length",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("head_dim = hidden_size / num_heads must be even (interleaved RoPE pairs)")
        if self.hidden_size % 4:
            raise ValueError("hidden_size must be a multiple of 4 (2D sin-cos positions: sin|cos per axis)")
        if self.mlp_ratio <= 0:
            raise ValueError(f"mlp_ratio must be > 0, got {self.mlp_ratio}")
        if self.drop_path != 0.0:
            raise ValueError("drop_path > 0 is not supported (no Open-Sora 1.2 config uses it); set 0.0")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def out_channels(self) -> int:
        return 2 * self.in_channels if self.pred_sigma else self.in_channels

    @classmethod
    def preset(cls, name: str, **overrides) -> STDiT3Config:
        """A registered variant (``PRESETS``) with field overrides, e.g. ``preset("STDiT3-XL/2", qk_norm=True)``."""
        if name not in PRESETS:
            raise ValueError(f"unknown STDiT3 preset {name!r}; known: {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    @classmethod
    def from_open_sora(cls, d: dict) -> STDiT3Config:
        """From Open-Sora's config dict / config.json: unknown keys (kernel flags, input_size,
        model_type, transformers bookkeeping) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


PRESETS: dict[str, STDiT3Config] = {
    # train.py injects caption_channels=4096 (T5-XXL) and model_max_length=300 into both.
    "STDiT3-XL/2": STDiT3Config(hidden_size=1152, depth=28, num_heads=16),
    "STDiT3-3B/2": STDiT3Config(hidden_size=1872, depth=28, num_heads=26),
    # the fixture's config (tests/fixtures/opensora12/stdit3_config.json): CPU tests, debug runs
    "tiny": STDiT3Config(hidden_size=64, depth=2, num_heads=4, caption_channels=32, model_max_length=16),
}


class STDiT3Block(nn.Module):
    """One spatial or temporal block (adaLN-single modulation, self-attn, cross-attn, MLP).

    ``mod`` is the per-frame modulation (B, T|1, 6, C) already selected between t and t=0 frames;
    x is (B, T, S, C). It lives beside the model, not in train/layers.py, because it reads the config."""

    def __init__(self, cfg: STDiT3Config, temporal: bool):
        super().__init__()
        c = cfg.hidden_size
        self.temporal = temporal
        self.norm1 = nn.LayerNorm(c, eps=1e-6, elementwise_affine=False)
        self.attn = SelfAttention(c, cfg.num_heads, cfg.qk_norm)
        self.cross_attn = CrossAttention(c, cfg.num_heads)
        self.norm2 = nn.LayerNorm(c, eps=1e-6, elementwise_affine=False)
        self.mlp = Mlp(c, int(c * cfg.mlp_ratio), c)
        self.scale_shift_table = nn.Parameter(torch.randn(6, c) / c**0.5)

    def forward(self, x, y, mod, key_mask, has_keys, rope):
        b, t, s, c = x.shape
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (self.scale_shift_table + mod).unbind(
            2
        )  # each (B, T|1, C)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            m.unsqueeze(2) for m in (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp)
        )

        h = modulate(self.norm1(x), shift_msa, scale_msa)
        if self.temporal:
            h = h.transpose(1, 2).reshape(b * s, t, c)
            h = self.attn(h, rope).view(b, s, t, c).transpose(1, 2)
        else:
            h = self.attn(h.reshape(b * t, s, c)).view(b, t, s, c)
        x = x + gate_msa * h
        x = x + self.cross_attn(x.reshape(b, t * s, c), y, key_mask, has_keys).view(b, t, s, c)
        h = self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x + gate_mlp * h


class STDiT3(nn.Module):
    """Open-Sora 1.2's STDiT3 (see module docstring). ``forward`` returns (B, out_channels, T, H, W) fp32."""

    def __init__(self, cfg: STDiT3Config):
        super().__init__()
        self.config = cfg
        c = cfg.hidden_size
        self.x_embedder = PatchEmbed3D(cfg.patch_size, cfg.in_channels, c)
        self.t_embedder = ScalarEmbedder(c)
        self.fps_embedder = ScalarEmbedder(c)
        self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(c, 6 * c))
        self.y_embedder = CaptionEmbedder(cfg.caption_channels, c, cfg.model_max_length)
        self.rope = Rope(cfg.head_dim)
        self.spatial_blocks = nn.ModuleList(STDiT3Block(cfg, temporal=False) for _ in range(cfg.depth))
        self.temporal_blocks = nn.ModuleList(STDiT3Block(cfg, temporal=True) for _ in range(cfg.depth))
        self.final_layer = FinalLayer(c, math.prod(cfg.patch_size), cfg.out_channels)
        self.grad_checkpointing = False
        self.initialize_weights()
        if cfg.only_train_temporal:
            for p in self.parameters():
                p.requires_grad = False
            for p in self.temporal_blocks.parameters():
                p.requires_grad = True
        if cfg.freeze_y_embedder:
            for p in self.y_embedder.parameters():
                p.requires_grad = False

    def initialize_weights(self):
        """Open-Sora's init (OPENSORA12.md §1.7): xavier Linear, zero biases, fps embedder outputs
        0, temporal blocks start as exact identities (zero output projections)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.fps_embedder.mlp[0].weight, std=0.02)
        nn.init.zeros_(self.fps_embedder.mlp[2].weight)
        for blk in self.temporal_blocks:
            nn.init.zeros_(blk.attn.proj.weight)
            nn.init.zeros_(blk.cross_attn.proj.weight)
            nn.init.zeros_(blk.mlp.fc2.weight)

    def set_grad_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each of the 2*depth blocks in backward (non-reentrant), in training only."""
        self.grad_checkpointing = bool(enabled)

    def _captions(self, y, mask, caption_drop):
        """-> projected captions (B, L, C), SDPA key mask (B,1,1,L) or None, has-keys (B,1,1,1) or None."""
        cfg = self.config
        if y.dim() == 4:  # Open-Sora's (B, 1, L, D)
            y = y.squeeze(1)
        if y.dim() != 3:
            raise ValueError(f"y must be (B,1,L,D) or (B,L,D), got {tuple(y.shape)}")
        b, length, _ = y.shape
        if caption_drop is not None:
            if length > cfg.model_max_length:
                raise ValueError(f"caption length {length} > model_max_length {cfg.model_max_length}")
            null = self.y_embedder.y_embedding[:length].to(y.dtype)
            y = torch.where(caption_drop.to(y.device, torch.bool)[:, None, None], null[None], y)
        if not cfg.skip_y_embedder:
            y = self.y_embedder.y_proj(y)
        if mask is None:
            return y, None, None
        valid = mask.to(y.device).bool()
        if valid.shape != (b, length):
            raise ValueError(f"mask must be (B, L) = {(b, length)}, got {tuple(valid.shape)}")
        has = valid.any(dim=1)
        # an all-padding row would give softmax over nothing (NaN): let it see every key, zero its output
        key_mask = (valid | ~has[:, None])[:, None, None, :]
        return y, key_mask, has.to(y.dtype)[:, None, None, None]

    def forward(
        self, x, timestep, y, mask=None, x_mask=None, fps=None, height=None, width=None, caption_drop=None, **_upstream
    ):  # upstream's model_kwargs also carry num_frames, ar
        cfg = self.config
        if fps is None or height is None or width is None:
            raise ValueError("STDiT3.forward needs fps, height and width (B,) tensors (pixel size)")
        dtype = self.x_embedder.proj.weight.dtype
        b = x.shape[0]
        x = x.to(dtype)
        timestep = timestep.to(dtype)  # upstream rounds t to the weight dtype (bf16) too
        _, _, tx, hx, wx = x.shape

        # conditioning: adaLN-single vectors for the batch's t, and for t=0 (conditioning frames)
        fps_emb = self.fps_embedder(fps.to(x.device).reshape(b), dtype)
        t = self.t_embedder(timestep, dtype) + fps_emb
        t_mlp = self.t_block(t).view(b, 1, 6, cfg.hidden_size)
        t0 = None
        if x_mask is not None:
            x_mask = x_mask.to(x.device).bool()
            if x_mask.shape != (b, -(-tx // cfg.patch_size[0])):
                raise ValueError(
                    f"x_mask must be (B, T) = {(b, -(-tx // cfg.patch_size[0]))}, got {tuple(x_mask.shape)}"
                )
            t0 = self.t_embedder(torch.zeros_like(timestep), dtype) + fps_emb
            t0_mlp = self.t_block(t0).view(b, 1, 6, cfg.hidden_size)
            t_mlp = torch.where(x_mask[:, :, None, None], t_mlp, t0_mlp)  # (B, T, 6, C)

        y, key_mask, has_keys = self._captions(y.to(dtype), mask, caption_drop)

        x = self.x_embedder(x)  # (B, C, T, H', W')
        _, c, t_, h_, w_ = x.shape
        x = x.flatten(3).transpose(1, 2).transpose(2, 3)  # (B, T, S, C)
        x = x + pos_embed_2d(c, h_, w_, height, width, cfg.input_sq_size, x.device, dtype, cfg.pos_embed_bf16_freqs)
        rope = self.rope.cos_sin(t_, dtype)

        ckpt = self.grad_checkpointing and self.training and torch.is_grad_enabled()
        for spatial, temporal in zip(self.spatial_blocks, self.temporal_blocks):
            for blk in (spatial, temporal):
                if ckpt:
                    x = checkpoint(blk, x, y, t_mlp, key_mask, has_keys, rope, use_reentrant=False)
                else:
                    x = blk(x, y, t_mlp, key_mask, has_keys, rope)

        x = self.final_layer(x, t, t0, x_mask)  # (B, T, S, p*out)
        pt, ph, pw = cfg.patch_size
        co = cfg.out_channels
        # tokens (T, H', W') x patch (pt, ph, pw, C_out) -> (C_out, T*pt, H'*ph, W'*pw)
        x = x.view(b, t_, h_, w_, pt, ph, pw, co).permute(0, 7, 1, 4, 2, 5, 3, 6)
        x = x.reshape(b, co, t_ * pt, h_ * ph, w_ * pw)[:, :, :tx, :hx, :wx]
        return x.float()


def flops_per_sample(cfg: STDiT3Config, T: int, H: int, W: int, L: int) -> float:
    """Forward FLOPs of one sample (a matmul of (m,k)x(k,n) counts 2mkn), for MFU.

    T, H, W are LATENT sizes, L caption tokens. With N = T'*S tokens (patch grid T' x S, S=H'*W'),
    C = hidden, r = mlp_ratio, D = caption_channels, per block pair (spatial + temporal):
      linear  2 * [(12 + 4r) N C^2 + 4 L C^2]    qkv 6, proj 2, cross q 2 / proj 2, MLP 4r; kv of y
      attn    4 T' S^2 C  +  4 S T'^2 C           QK^T and AV, spatial over S, temporal over T'
      cross   2 * 4 N L C                         QK^T and AV against L caption tokens
    plus the patch embedder 2 N C (in*p), the final linear 2 N C (out*p) and y_proj 2 L (D C + C^2).
    Timestep/fps embedders, norms, softmax and elementwise ops are left out (< 0.1%).
    A training step costs about 3x this (4x with gradient checkpointing).
    """
    pt, ph, pw = cfg.patch_size
    t_, s = -(-T // pt), (-(-H // ph)) * (-(-W // pw))
    n, c, r, p = t_ * s, cfg.hidden_size, cfg.mlp_ratio, pt * ph * pw
    pair = 2 * ((12 + 4 * r) * n * c * c + 4 * L * c * c) + 4 * t_ * s * s * c + 4 * s * t_ * t_ * c + 2 * 4 * n * L * c
    embed = 2 * n * c * cfg.in_channels * p + 2 * n * c * cfg.out_channels * p
    y_proj = 0 if cfg.skip_y_embedder else 2 * L * (cfg.caption_channels * c + c * c)
    return float(cfg.depth * pair + embed + y_proj)
