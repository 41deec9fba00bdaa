"""The Open-Sora 1.2 VAE, encoder side: a per-frame SDXL image VAE, then a causal temporal VAE.

Written from the published architecture (hpcai-tech/OpenSora-VAE-v1.2) so that its public
``model.safetensors`` loads by name: keys ``spatial_vae.module.*`` are a diffusers
``AutoencoderKL`` (SDXL layout, x0.18215 after encoding), keys ``temporal_vae.encoder.*`` and
``temporal_vae.quant_conv.*`` the temporal encoder below (decoder keys are not needed to build a
cache and are skipped). Encoding, as Open-Sora 1.2 does it:

1. every frame through the SDXL VAE (micro-batches of frames), latents x 0.18215;
2. the frames in chunks of 17 through the temporal encoder: each chunk is padded at the front to
   a multiple of 4 and compressed 4x in time by causal 3-D convolutions (17 -> 5 latent frames;
   51 -> 15, 102 -> 30, 204 -> 60);
3. normalization with the published per-channel shift (-0.10, 0.34, 0.27, 0.98) and scale
   (3.85, 2.32, 2.33, 3.06): z' = (z - shift) / scale.

Open-Sora samples both posteriors. The cache keeps the temporal posterior (mean and log-variance,
sampled at load time) and takes the image stage's posterior mean, whose spread is negligible
next to the temporal one; the trade-off keeps cached latents bit-reproducible.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SHIFT = (-0.10, 0.34, 0.27, 0.98)
SCALE = (3.85, 2.32, 2.33, 3.06)
MICRO_FRAMES = 17
SPATIAL_SCALE = 0.18215
SDXL_VAE = dict(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2, latent_channels=4, sample_size=1024)
TINY_SPATIAL = dict(block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                    up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4, norm_num_groups=4)
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
            if i < len(multipliers) - 1:     # time-strided conv where the layout downsamples, else nothing
                self.conv_blocks.append(CausalConv3d(prev, f, stride=(2, 1, 1)) if temporal_down[i] else nn.Identity())
        self.res_blocks = nn.ModuleList(ResBlock(prev, prev, groups) for _ in range(num_res_blocks))
        self.norm1 = nn.GroupNorm(groups, prev)
        self.conv2 = CausalConv3d(prev, 2 * latent, kernel=1)
        self.time_factor = 2 ** sum(temporal_down)

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


class TemporalVAE(nn.Module):
    """Encoder half of VAE_Temporal_SD (module names as in the public checkpoint)."""

    def __init__(self, **layout):
        super().__init__()
        self.encoder = TemporalEncoder(**layout)
        self.quant_conv = CausalConv3d(8, 8, kernel=1)

    def encode(self, x):
        pad = (-x.shape[2]) % self.encoder.time_factor
        x = F.pad(x, (0, 0, 0, 0, pad, 0))
        mean, logvar = self.quant_conv(self.encoder(x)).chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)


class OpenSoraVAE(nn.Module):
    def __init__(self, tiny: bool = False):
        super().__init__()
        from diffusers import AutoencoderKL

        self.spatial = AutoencoderKL(**(TINY_SPATIAL if tiny else SDXL_VAE))
        self.temporal = TemporalVAE(**(TINY_TEMPORAL if tiny else TEMPORAL))
        self.register_buffer("shift", torch.tensor(SHIFT).view(1, 4, 1, 1, 1), persistent=False)
        self.register_buffer("scale", torch.tensor(SCALE).view(1, 4, 1, 1, 1), persistent=False)

    @classmethod
    def from_checkpoint(cls, path) -> "OpenSoraVAE":
        """Load hpcai-tech/OpenSora-VAE-v1.2's model.safetensors (a file, or the folder holding it)."""
        from pathlib import Path

        from safetensors.torch import load_file

        p = Path(path)
        files = [p] if p.is_file() else sorted(p.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        state = {}
        for f in files:
            state.update(load_file(str(f)))
        model = cls()
        spatial = {k.removeprefix("spatial_vae.module."): v for k, v in state.items() if k.startswith("spatial_vae.module.")}
        temporal = {k.removeprefix("temporal_vae."): v for k, v in state.items()
                    if k.startswith(("temporal_vae.encoder.", "temporal_vae.quant_conv."))}
        model.spatial.load_state_dict(spatial, strict=True)
        model.temporal.load_state_dict(temporal, strict=True)
        return model

    @torch.inference_mode()
    def encode(self, x, micro_batch: int = 4):
        """x: [B, 3, T, H, W] in [-1, 1] -> normalized temporal posterior (mean, logvar) [B, 4, t, H/8, W/8]."""
        b, c, t, h, w = x.shape
        frames = x.transpose(1, 2).reshape(b * t, c, h, w)
        z = torch.cat([self.spatial.encode(frames[i:i + micro_batch]).latent_dist.mean
                       for i in range(0, len(frames), micro_batch)]) * SPATIAL_SCALE
        z = z.reshape(b, t, *z.shape[1:]).transpose(1, 2)
        parts = [self.temporal.encode(z[:, :, i:i + MICRO_FRAMES]) for i in range(0, t, MICRO_FRAMES)]
        mean = torch.cat([m for m, _ in parts], dim=2)
        logvar = torch.cat([lv for _, lv in parts], dim=2)
        scale, shift = self.scale.to(mean.dtype), self.shift.to(mean.dtype)
        return (mean - shift) / scale, logvar - 2 * torch.log(scale)


def latent_frames(t: int) -> int:
    """51 -> 15, 102 -> 30, 204 -> 60, 17 -> 5."""
    return sum(-(-min(MICRO_FRAMES, t - i) // 4) for i in range(0, t, MICRO_FRAMES))
