"""The building blocks of STDiT3 (train/model.py), each a match of its Open-Sora 1.2 module.

They are kept apart from the model because none of them reads the model's config: each takes
plain sizes (widths, heads), so it reads as the upstream module it mirrors. Their attribute names ARE
the state-dict keys of a published STDiT3 checkpoint (``fc1``/``fc2`` from timm's Mlp, ``qkv``,
``q_norm``/``k_norm``, ``q_linear``/``kv_linear``, ``rope.freqs``, ``scale_shift_table``,
``y_embedding``...): renaming one breaks ``load_state_dict(strict=True)`` of released weights.

Numerics follow upstream where it is particular, since released checkpoints were trained with
them: RMSNorm's statistics in fp32, RoPE angles in the frequencies' dtype (bf16 once the model is
cast), the final layer's second normalisation of t=0 frames, positions scaled by the FIRST
sample's picture size. The 2D positions' frequencies are fp32 unless asked to be rounded to bf16
as upstream's cast buffer is (``STDiT3Config.pos_embed_bf16_freqs``): ours are computed, not a
buffer, so no cast reaches them. Where the implementation differs (SDPA with a boolean key mask instead of
xformers' packed block-diagonal mask, positions without a host sync), the result does not: see
train/model.py's docstring.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def sinusoid(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """[cos | sin] features of a continuous scalar per sample (upstream's layout: cos first), fp32."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ScalarEmbedder(nn.Module):
    """Sinusoid(256) -> Linear -> SiLU -> Linear: upstream's TimestepEmbedder and SizeEmbedder (fps)."""

    def __init__(self, hidden: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.mlp(sinusoid(s, self.freq_dim).to(dtype))


class Mlp(nn.Module):
    """timm's Mlp as upstream uses it: fc1 -> GELU(tanh) -> fc2 (names fc1/fc2 kept)."""

    def __init__(self, dim_in: int, dim_hidden: int, dim_out: int):
        super().__init__()
        self.fc1 = nn.Linear(dim_in, dim_hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(dim_hidden, dim_out)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class CaptionEmbedder(nn.Module):
    """y_proj (caption_channels -> C -> C) and the null caption ``y_embedding`` (a persistent,
    never-trained buffer, randn/sqrt(D): Open-Sora's unconditional caption for dropout and CFG)."""

    def __init__(self, caption_channels: int, hidden: int, max_length: int):
        super().__init__()
        self.y_proj = Mlp(caption_channels, hidden, hidden)
        self.register_buffer("y_embedding", torch.randn(max_length, caption_channels) / caption_channels**0.5)


class RMSNorm(nn.Module):
    """LlamaRMSNorm: statistics in fp32, weight applied in the input dtype (as upstream)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Rope(nn.Module):
    """rotary-embedding-torch 0.5.3 ``RotaryEmbedding(dim=head_dim)`` semantics: freqs
    1/10000^(2i/d) held in a requires_grad=False Parameter (so ``rope.freqs`` is in the state dict),
    positions arange(n), each frequency repeated for an interleaved pair (2i, 2i+1)."""

    def __init__(self, dim: int, theta: float = 10000.0):
        super().__init__()
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
        self.freqs = nn.Parameter(freqs, requires_grad=False)

    def cos_sin(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # upstream computes the angles in the freqs' dtype (bf16 when the model is cast)
        pos = torch.arange(n, device=self.freqs.device, dtype=self.freqs.dtype)
        ang = (pos[:, None] * self.freqs[None]).repeat_interleave(2, dim=-1)
        return ang.cos().to(dtype), ang.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
        rot = torch.stack((-x2, x1), dim=-1).flatten(-2)
        return x * cos + rot * sin


class SelfAttention(nn.Module):
    """qkv -> (qk RMSNorm) -> (RoPE) -> SDPA -> proj, over (batch, n, C)."""

    def __init__(self, dim: int, heads: int, qk_norm: bool):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = Rope.apply(q, *rope), Rope.apply(k, *rope)
        o = F.scaled_dot_product_attention(q, k, v)
        return self.proj(o.transpose(1, 2).reshape(b, n, c))


class CrossAttention(nn.Module):
    """Video tokens of each sample attend to that sample's valid caption tokens only (batched
    SDPA with a boolean key mask instead of upstream's packed xformers block-diagonal mask)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_linear = nn.Linear(dim, dim)
        self.kv_linear = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, y, key_mask, has_keys):
        b, n, c = x.shape
        q = self.q_linear(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_linear(y).view(b, y.shape[1], 2, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if has_keys is not None:  # a caption with no valid token contributes nothing (not NaN)
            v = v * has_keys
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return self.proj(o.transpose(1, 2).reshape(b, n, c))


def modulate(x, shift, scale):
    return x * (1 + scale) + shift


class FinalLayer(nn.Module):
    """T2IFinalLayer: LayerNorm, modulation by (table + t) with the PRE-t_block t, Linear."""

    def __init__(self, c: int, num_patch: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(c, eps=1e-6, elementwise_affine=False)
        self.linear = nn.Linear(c, num_patch * out_channels)
        self.scale_shift_table = nn.Parameter(torch.randn(2, c) / c**0.5)

    def forward(self, x, t, t0=None, x_mask=None):
        """x (B,T,S,C); t, t0 (B,C); x_mask (B,T) bool or None."""
        shift, scale = (self.scale_shift_table[None] + t[:, None]).unbind(1)
        h = modulate(self.norm_final(x), shift[:, None, None], scale[:, None, None])
        if x_mask is not None:
            # Upstream normalises the ALREADY-MODULATED x again for the t=0 frames
            # (``x = t2i_modulate(norm(x)); x_zero = t2i_modulate(norm(x), ...)``): kept, since
            # released checkpoints were trained with it and the fixture pins it.
            shift0, scale0 = (self.scale_shift_table[None] + t0[:, None]).unbind(1)
            h0 = modulate(self.norm_final(h), shift0[:, None, None], scale0[:, None, None])
            h = torch.where(x_mask[:, :, None, None], h, h0)
        return self.linear(h)


class PatchEmbed3D(nn.Module):
    """Zero-pad (T,H,W) to multiples of the patch, Conv3d with kernel = stride = patch."""

    def __init__(self, patch, cin: int, c: int):
        super().__init__()
        self.patch = patch
        self.proj = nn.Conv3d(cin, c, kernel_size=patch, stride=patch)

    def forward(self, x):
        pt, ph, pw = self.patch
        _, _, t, h, w = x.shape
        pad = (0, -w % pw, 0, -h % ph, 0, -t % pt)
        if any(pad):
            x = F.pad(x, pad)
        return self.proj(x)  # (B, C, T', H', W')


def pos_embed_2d(
    hidden: int, h: int, w: int, height, width, input_sq_size: int, device, dtype, bf16_freqs: bool = False
):
    """Sin-cos positions of the (h, w) patch grid, (h*w, C): first C/2 channels the column
    coordinate, last C/2 the row, each [sin | cos]; coord = idx / scale * base_size / n_axis with
    scale = sqrt(height*width)/input_sq_size (pixels of the FIRST sample) and base_size =
    round(sqrt(h*w)). Tensor arithmetic so a GPU batch needs no host sync.

    ``bf16_freqs``: the frequencies rounded to bf16, as upstream's are once ``model.to(bf16)`` has
    cast its ``inv_freq`` buffer (the angles and sin/cos stay fp32 there too: its einsum promotes
    the bf16 frequencies against the fp32 grid). Up to 0.058 away from the fp32 embedding at
    XL/2's width, for every picture size of the stage tables."""
    half = hidden // 2
    inv_freq = 1.0 / (10000 ** (torch.arange(0, half, 2, device=device).float() / half))
    if bf16_freqs:
        inv_freq = inv_freq.bfloat16().float()
    scale = torch.sqrt(height[0].to(device, torch.float64) * width[0].to(device, torch.float64)) / input_sq_size
    base = round((h * w) ** 0.5)
    gw = (torch.arange(w, device=device) / scale).float() * (base / w)
    gh = (torch.arange(h, device=device) / scale).float() * (base / h)

    def sincos(g):
        a = g[:, None] * inv_freq[None]
        return torch.cat([a.sin(), a.cos()], dim=-1)

    ew, eh = sincos(gw), sincos(gh)  # (w, C/2), (h, C/2)
    emb = torch.cat([ew[None, :, :].expand(h, w, half), eh[:, None, :].expand(h, w, half)], dim=-1)
    return emb.reshape(h * w, hidden).to(dtype)
