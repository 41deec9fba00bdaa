"""The Open-Sora 1.2 VAE: a per-frame SDXL image VAE, then a causal temporal VAE; encode and decode.

Written from the published architecture (hpcai-tech/OpenSora-VAE-v1.2) so that its public
``model.safetensors`` loads by name, every key consumed: ``spatial_vae.module.*`` is a diffusers
``AutoencoderKL`` (SDXL layout, latents x 0.18215), ``temporal_vae.{encoder,decoder,quant_conv,
post_quant_conv}.*`` the temporal VAE below, and ``scale``/``shift`` the normalization buffers
(checked against the published constants). Encoding, as Open-Sora 1.2 does it:

1. every frame through the SDXL VAE (micro-batches of 4 frames), latents x 0.18215;
2. the frames in chunks of 17 through the temporal encoder: each chunk is padded at the front to
   a multiple of 4 and compressed 4x in time by causal 3-D convolutions (17 -> 5 latent frames;
   51 -> 15, 102 -> 30, 204 -> 60);
3. normalization with the published per-channel shift (-0.10, 0.34, 0.27, 0.98) and scale
   (3.85, 2.32, 2.33, 3.06): z' = (z - shift) / scale.

Decoding inverts it: z x scale + shift, 5-latent chunks through the temporal decoder (causal
convolutions, depth-to-time x2 twice, the front padding cropped), then the SDXL decoder on z / 0.18215.

Open-Sora samples both posteriors. ``encode`` returns the temporal posterior (mean and
log-variance, which the cache samples at load time) of the image stage's posterior MEAN, whose
spread is negligible next to the temporal one: the trade-off keeps cached latents
bit-reproducible. ``encode_stages`` exposes every intermediate and takes injected noise, so the
exact sampling path can be compared with Open-Sora's own outputs (tests/cache/test_opensora_vae.py).

Sizes are arguments (defaults: the published ones), so tiny seeded configurations, and
Open-Sora's own tiny reference fixtures, use the same code.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL
from safetensors.torch import load_file
from torch import nn

from reelcache.cache.frames import fold_frames, unfold_frames

SHIFT = (-0.10, 0.34, 0.27, 0.98)
SCALE = (3.85, 2.32, 2.33, 3.06)
MICRO_FRAMES = 17
MICRO_BATCH = 4
SPATIAL_SCALE = 0.18215  # VideoAutoencoderKL's own factor, not the SDXL config's 0.13025
SDXL_VAE = dict(
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=2,
    latent_channels=4,
    sample_size=1024,
)
TINY_SPATIAL = dict(
    block_out_channels=(16, 32),
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=4,
)
# VAE_Temporal_SD: filters 128, 4 res blocks per level, GroupNorm(32).
TEMPORAL = dict(filters=128, num_res_blocks=4, multipliers=(1, 2, 2, 4), temporal_down=(False, True, True), groups=32)
TINY_TEMPORAL = dict(filters=8, num_res_blocks=1, multipliers=(1, 2, 2, 4), temporal_down=(False, True, True), groups=4)


class CausalConv3d(nn.Module):
    """Conv3d padded in time on the past side only, so frame t never sees frames after t."""

    def __init__(self, cin, cout, kernel=3, stride=(1, 1, 1), bias=True):
        super().__init__()
        kt, kh, kw = (kernel,) * 3 if isinstance(kernel, int) else kernel
        self.pad = (kw // 2, kw // 2, kh // 2, kh // 2, kt - 1 + 1 - stride[0], 0)
        self.conv = nn.Conv3d(cin, cout, (kt, kh, kw), stride=stride, bias=bias)

    def forward(self, x):
        return self.conv(F.pad(x, self.pad))


class ResBlock(nn.Module):
    def __init__(self, cin, cout, groups):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin)
        self.conv1 = CausalConv3d(cin, cout, bias=False)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.conv2 = CausalConv3d(cout, cout, bias=False)
        self.conv3 = CausalConv3d(cin, cout, kernel=1, bias=False) if cin != cout else None

    def forward(self, x):
        h = self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(x))))))
        return h + (self.conv3(x) if self.conv3 is not None else x)


class TemporalEncoder(nn.Module):
    def __init__(self, filters, num_res_blocks, multipliers, temporal_down, groups, in_channels=4, latent=4):
        super().__init__()
        self.conv_in = CausalConv3d(in_channels, filters, bias=False)
        self.block_res_blocks = nn.ModuleList()
        self.conv_blocks = nn.ModuleList()
        prev = filters
        for i, m in enumerate(multipliers):
            f = filters * m
            blocks = nn.ModuleList()
            for _ in range(num_res_blocks):
                blocks.append(ResBlock(prev, f, groups))
                prev = f
            self.block_res_blocks.append(blocks)
            if i < len(multipliers) - 1:  # time-strided conv where the layout downsamples, else nothing
                self.conv_blocks.append(CausalConv3d(prev, f, stride=(2, 1, 1)) if temporal_down[i] else nn.Identity())
        self.res_blocks = nn.ModuleList(ResBlock(prev, prev, groups) for _ in range(num_res_blocks))
        self.norm1 = nn.GroupNorm(groups, prev)
        self.conv2 = CausalConv3d(prev, 2 * latent, kernel=1)

    def forward(self, x):
        x = self.conv_in(x)
        for i, blocks in enumerate(self.block_res_blocks):
            for b in blocks:
                x = b(x)
            if i < len(self.conv_blocks):
                x = self.conv_blocks[i](x)
        for b in self.res_blocks:
            x = b(x)
        return self.conv2(F.silu(self.norm1(x)))


class TemporalDecoder(nn.Module):
    """The mirror of the encoder: levels deepest first; where the encoder halved time, a conv to
    twice the channels followed by depth-to-time ("B (C t) T H W -> B C (T t) H W")."""

    def __init__(self, filters, num_res_blocks, multipliers, temporal_down, groups, out_channels=4, latent=4):
        super().__init__()
        prev = filters * multipliers[-1]
        self.conv1 = CausalConv3d(latent, prev)
        self.res_blocks = nn.ModuleList(ResBlock(prev, prev, groups) for _ in range(num_res_blocks))
        levels, convs = [], []
        for i in reversed(range(len(multipliers))):
            f = filters * multipliers[i]
            blocks = nn.ModuleList()
            for _ in range(num_res_blocks):
                blocks.append(ResBlock(prev, f, groups))
                prev = f
            levels.insert(0, blocks)
            if i > 0:
                convs.insert(0, CausalConv3d(prev, 2 * prev) if temporal_down[i - 1] else nn.Identity())
        self.block_res_blocks = nn.ModuleList(levels)
        self.conv_blocks = nn.ModuleList(convs)
        self.temporal_down = tuple(temporal_down)
        self.norm1 = nn.GroupNorm(groups, prev)
        self.conv_out = CausalConv3d(prev, out_channels)

    def forward(self, z):
        x = self.conv1(z)
        for b in self.res_blocks:
            x = b(x)
        for i in reversed(range(len(self.block_res_blocks))):
            for b in self.block_res_blocks[i]:
                x = b(x)
            if i > 0:
                x = self.conv_blocks[i - 1](x)
                if self.temporal_down[i - 1]:  # channel c*2 + s becomes time step t*2 + s
                    b_, c2, t, h, w = x.shape
                    x = x.reshape(b_, c2 // 2, 2, t, h, w).permute(0, 1, 3, 2, 4, 5).reshape(b_, c2 // 2, 2 * t, h, w)
        return self.conv_out(F.silu(self.norm1(x)))


class TemporalVAE(nn.Module):
    """VAE_Temporal_SD (module names as in the public checkpoint)."""

    def __init__(self, **layout):
        super().__init__()
        self.encoder = TemporalEncoder(**layout)
        self.decoder = TemporalDecoder(**layout)
        self.quant_conv = CausalConv3d(8, 8, kernel=1)
        self.post_quant_conv = CausalConv3d(4, 4, kernel=1)
        self.time_factor = 2 ** sum(layout["temporal_down"])

    def encode(self, x):
        pad = (-x.shape[2]) % self.time_factor
        x = F.pad(x, (0, 0, 0, 0, pad, 0))
        mean, logvar = self.quant_conv(self.encoder(x)).chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    def decode(self, z, num_frames: int):
        x = self.decoder(self.post_quant_conv(z))
        return x[:, :, (-num_frames) % self.time_factor :]


class OpenSoraVAE(nn.Module):
    def __init__(self, tiny: bool = False, spatial: dict | None = None, temporal: dict | None = None):
        super().__init__()
        self.spatial = AutoencoderKL(**(spatial or (TINY_SPATIAL if tiny else SDXL_VAE)))
        self.temporal = TemporalVAE(**(temporal or (TINY_TEMPORAL if tiny else TEMPORAL)))
        self.register_buffer("shift", torch.tensor(SHIFT).view(1, 4, 1, 1, 1), persistent=False)
        self.register_buffer("scale", torch.tensor(SCALE).view(1, 4, 1, 1, 1), persistent=False)

    @classmethod
    def from_checkpoint(cls, path, spatial: dict | None = None, temporal: dict | None = None) -> OpenSoraVAE:
        """Load hpcai-tech/OpenSora-VAE-v1.2's model.safetensors (a file, or the folder holding it)."""
        p = Path(path)
        files = [p] if p.is_file() else sorted(p.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        state = {}
        for f in files:
            state.update(load_file(str(f)))
        model = cls(spatial=spatial, temporal=temporal)
        model.load_upstream(state, source=str(path))
        return model

    def load_upstream(self, state: dict, source: str = "checkpoint") -> None:
        """Load a state dict in Open-Sora's own key layout; every key must be consumed.

        ``scale``/``shift`` are not learned: Open-Sora's ``from_pretrained`` would use whatever the
        file stores, this module uses the published constants, so a file that stores other values
        is refused rather than silently normalized differently.
        """
        for name, const in (("scale", SCALE), ("shift", SHIFT)):
            if name in state and not torch.allclose(state[name].float().flatten(), torch.tensor(const), atol=1e-6):
                raise ValueError(
                    f"{source}: stored {name} {state[name].flatten().tolist()} differs from Open-Sora "
                    f"1.2's {list(const)}; latents would be normalized differently"
                )
        spatial = {
            k.removeprefix("spatial_vae.module."): v for k, v in state.items() if k.startswith("spatial_vae.module.")
        }
        temporal = {k.removeprefix("temporal_vae."): v for k, v in state.items() if k.startswith("temporal_vae.")}
        if extra := sorted(
            set(state)
            - {"scale", "shift"}
            - {f"spatial_vae.module.{k}" for k in spatial}
            - {f"temporal_vae.{k}" for k in temporal}
        ):
            raise ValueError(f"{source}: unexpected keys {extra[:8]}")
        self.spatial.load_state_dict(spatial, strict=True)
        self.temporal.load_state_dict(temporal, strict=True)

    def encode_stages(self, x, spatial_eps=None, temporal_eps=None) -> dict:
        """Every stage of Open-Sora's encode for x [B, 3, T, H, W] in [-1, 1].

        Without noise the posteriors' modes are used; with ``spatial_eps`` [B, 4, T, h, w] and
        ``temporal_eps`` [B, 4, t, h, w] the sampling path is followed with that noise.
        """
        b, t = x.shape[0], x.shape[2]
        frames = fold_frames(x)
        dists = [
            self.spatial.encode(frames[i : i + MICRO_BATCH]).latent_dist for i in range(0, len(frames), MICRO_BATCH)
        ]
        out = {
            "spatial_mean": unfold_frames(torch.cat([d.mean for d in dists]), b),
            "spatial_logvar": unfold_frames(torch.cat([d.logvar for d in dists]), b),
        }
        z = out["spatial_mean"]
        if spatial_eps is not None:
            z = z + torch.exp(0.5 * out["spatial_logvar"]) * spatial_eps
        out["x_z"] = z = z * SPATIAL_SCALE
        parts = [self.temporal.encode(z[:, :, i : i + MICRO_FRAMES]) for i in range(0, t, MICRO_FRAMES)]
        out["temporal_mean"] = mean = torch.cat([m for m, _ in parts], dim=2)
        out["temporal_logvar"] = logvar = torch.cat([lv for _, lv in parts], dim=2)
        zt = mean if temporal_eps is None else mean + torch.exp(0.5 * logvar) * temporal_eps
        scale, shift = self.scale.to(mean.dtype), self.shift.to(mean.dtype)
        out["z"] = (zt - shift) / scale
        return out

    @torch.inference_mode()
    def encode(self, x):
        """x: [B, 3, T, H, W] in [-1, 1] -> normalized temporal posterior (mean, logvar) [B, 4, t, H/8, W/8]."""
        s = self.encode_stages(x)
        scale = self.scale.to(s["z"].dtype)
        return s["z"], s["temporal_logvar"] - 2 * torch.log(scale)

    @torch.inference_mode()
    def decode(self, z, num_frames: int):
        """Normalized latents [B, 4, t, h, w] -> video [B, 3, num_frames, 8h, 8w] in about [-1, 1]."""
        z = z * self.scale.to(z.dtype) + self.shift.to(z.dtype)
        chunk = latent_frames(MICRO_FRAMES)
        parts, left = [], num_frames
        for i in range(0, z.shape[2], chunk):
            parts.append(self.temporal.decode(z[:, :, i : i + chunk], num_frames=min(MICRO_FRAMES, left)))
            left -= MICRO_FRAMES
        flat = fold_frames(torch.cat(parts, dim=2) / SPATIAL_SCALE)
        img = torch.cat(
            [self.spatial.decode(flat[i : i + MICRO_BATCH]).sample for i in range(0, len(flat), MICRO_BATCH)]
        )
        return unfold_frames(img, len(z))


def latent_frames(t: int) -> int:
    """51 -> 15, 102 -> 30, 204 -> 60, 17 -> 5."""
    return sum(-(-min(MICRO_FRAMES, t - i) // 4) for i in range(0, t, MICRO_FRAMES))
