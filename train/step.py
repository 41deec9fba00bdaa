"""One training step on every rank: draws, rectified-flow loss, backward, guard, AdamW, EMA.

Per step, on every rank: a micro-batch from the streaming loader (one bucket; its latents are
already VAE posteriors and T5 embeddings), per-sample draws seeded by (seed, step, clip id)
(timestep, noise, frame mask, caption dropout), the rectified-flow loss, backward, the global
gradient norm, the divergence guard, the optimizer step, the EMA update.

The step's gradient is the mean over the real samples of all ranks (``step.loss_reduction =
"sample"``): rank r backpropagates R * sum(loss_i) / N, where N is the all-reduced count of real
samples and the data-parallel average divides by R again. Ranks hold different buckets and
batch sizes, and a rank with a padding batch (weight 0) contributes nothing, so it neither
shrinks nor skews the step. Open-Sora averages the ranks' means with equal weight (``"rank"``),
which weighs a 360p sample of a batch of 8 like 2.5 samples of a 240p batch of 20.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from reelcache.train.flow import (
    Conditioning,
    MaskGenerator,
    sample_timesteps,
    stable_seed,
    timestep_transform,
    training_losses,
)
from reelcache.train.schedule import lr_at

if TYPE_CHECKING:  # train/sections.py builds these lazily: annotations only, no import cycle
    from reelcache.train.sections import EMAConfig, FlowConfig, OptimConfig, StepConfig


@dataclass
class StepResult:
    """What one step did, the same on every rank except the ``local_``/shape fields."""

    loss: float  # mean loss over all ranks' real samples
    samples: float  # real samples over all ranks
    local_samples: float  # this rank's real samples (batch size x weight: 0 for a padding batch)
    bucket: str  # this rank's bucket
    latent_shape: tuple[int, int, int]  # this rank's (T, H, W) in latents
    text_len: int  # this rank's caption tokens
    losses: torch.Tensor  # this rank's per-sample losses
    grad_norm: float = math.nan
    lr: float | None = None  # None: skipped
    bad: str | None = None  # why the guard found the step bad (skipped or not), or None
    skipped: str | None = None  # why the guard skipped the step, or None


class EMA:
    """fp32 exponential moving average of this rank's master chunks (all of them under DDP)."""

    def __init__(self, cfg: EMAConfig, *, chunks: dict[str, torch.Tensor]):
        self.cfg, self.chunks = cfg, chunks

    @torch.no_grad()
    def update(self, masters: dict[str, torch.Tensor]) -> None:
        names = list(self.chunks)
        torch._foreach_lerp_([self.chunks[n] for n in names], [masters[n] for n in names], 1 - self.cfg.decay)


class Step:
    """The step function (``StepConfig.build``, train/sections.py); ``state`` (the trainer's
    TrainState) gives the global step the draws are seeded by and counts optimizer steps (the lr
    schedule's position). ``flow`` and ``optim`` are their [flow] and [optim] sections."""

    def __init__(
        self,
        cfg: StepConfig,
        *,
        par,
        model,
        optimizer,
        guard,
        ema: EMA | None,
        cond: Conditioning,
        flow: FlowConfig,
        optim: OptimConfig,
        seed: int,
    ):
        self.cfg, self.par, self.model, self.optimizer = cfg, par, model, optimizer
        self.guard, self.ema, self.cond = guard, ema, cond
        self.flow, self.optim, self.seed = flow, optim, seed
        self.masks = MaskGenerator(flow.mask_ratios) if flow.mask_ratios else None

    def __call__(self, batch, state) -> StepResult:
        """One optimizer step on this rank's micro-batch (a collective: every rank calls it)."""
        return self.update(self.forward_backward(batch, state.global_step), state)

    def draws(self, batch, global_step: int) -> dict:
        """The step's random draws, one generator per sample: (seed, step, clip id, index)."""
        dev, flow = self.par.device, self.flow
        x = batch["x"]
        t_lat = x.shape[2]
        ts, noise, drops, masks = [], [], [], []
        for i, clip in enumerate(batch["clip_id"]):
            s = stable_seed(self.seed, global_step, clip, i)
            g = torch.Generator().manual_seed(s)
            ts.append(sample_timesteps(1, g, method=flow.sample_method))
            drops.append(bool(torch.rand(1, generator=g).item() < flow.caption_dropout))
            if self.masks is not None:
                masks.append(torch.as_tensor(self.masks.get_masks(1, t_lat, np.random.default_rng(s))))
            gd = torch.Generator(device=dev).manual_seed(s)
            noise.append(torch.randn(x.shape[1:], generator=gd, device=dev, dtype=torch.float32))
        return {
            "t": torch.cat(ts).float(),
            "noise": torch.stack(noise),
            "caption_drop": torch.tensor(drops),
            "x_mask": torch.cat(masks).bool() if masks else None,
        }

    def forward_backward(self, batch, global_step: int) -> StepResult:
        """Loss and gradients of the step; gradients end up as the mean over all ranks' real samples."""
        par, dev = self.par, self.par.device
        x0 = batch["x"].to(dev, non_blocking=True).float()
        weight = float(batch["weight"])
        real = x0.shape[0] * weight
        # How many real samples (and real ranks) this step has: known before the forward.
        n_real, r_real = par.sum([real, 1.0 if weight > 0 else 0.0]).tolist()
        d = self.draws(batch, global_step)
        cond = self.cond(batch["bucket"], batch["fps"])
        frames = cond.pop("num_frames")
        t = d["t"]
        if self.flow.use_timestep_transform:
            t = timestep_transform(t, cond["height"], cond["width"], frames)
        kwargs = {
            "y": batch["text"].to(dev, non_blocking=True).to(x0.dtype),
            "mask": batch["text_mask"].to(dev, non_blocking=True),
            **{k: v.to(dev) for k, v in cond.items()},
            "caption_drop": d["caption_drop"].to(dev),
        }
        x_mask = d["x_mask"].to(dev) if d["x_mask"] is not None else None
        losses = training_losses(self.model, x0, kwargs, d["noise"], t.to(dev), x_mask=x_mask)
        if self.cfg.loss_reduction == "sample":
            loss = losses.sum() * (weight * par.world / max(n_real, 1.0))
        else:
            loss = losses.mean() * (weight * par.world / max(r_real, 1.0))
        par.backward(loss, self.optimizer)
        loss_sum = float(par.sum([float(losses.detach().sum()) * weight])[0])
        return StepResult(
            loss=loss_sum / max(n_real, 1.0),
            samples=n_real,
            local_samples=real,
            bucket=batch["bucket"],
            latent_shape=tuple(x0.shape[2:]),
            text_len=int(batch["text"].shape[1]),
            losses=losses.detach(),
        )

    def update(self, out: StepResult, state) -> StepResult:
        """Guard, optimizer step (unless the guard skips it), EMA; gradients cleared either way."""
        par = self.par
        guard = self.guard
        out.grad_norm = float(par.grad_norm(self.model, self.optimizer))
        reason = guard.verdict(out.loss, out.grad_norm)
        skip = reason is not None and guard.skips(out.loss, out.grad_norm)
        bad, skip = (par.max([1.0 if reason else 0.0, 1.0 if skip else 0.0]) > 0).tolist()
        if bad:
            out.bad = reason or "another rank found this step bad"
        if skip:
            out.skipped = out.bad
        else:  # a good step, or a non-finite one with guard.skip_nonfinite off (Open-Sora steps on it)
            out.lr = lr_at(state.opt_steps, self.optim)
            for group in self.optimizer.param_groups:
                group["lr"] = out.lr
            self.optimizer.step()
            state.opt_steps += 1
            if self.ema is not None:
                self.ema.update(par.master_chunks(self.model, self.optimizer))
        self.optimizer.zero_grad()
        guard.record(out.loss, bad, stepped_at=state.global_step if bad and not skip else None)
        return out
