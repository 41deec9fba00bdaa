"""Rectified flow as Open-Sora 1.2 trains and samples it (OPENSORA12.md §2, §3).

t in [0, 1000] is continuous, 1000 = pure noise. x_t = (1 - t/1000) x0 + t/1000 eps, and the
model predicts the velocity x0 - eps (its first in_channels output channels).

Training, per sample:  t = timestep_transform(sample_timesteps(B, gen), height, width, num_frames)
                       loss = training_losses(model, x0, kwargs, eps, t, x_mask)
``timestep_transform`` shifts t towards noise for bigger pictures and longer clips, the way
upstream does it, including its quirks: the latent frame count is ``num_frames // 17 * 5`` from
the PIXEL frame count, only ``num_frames[0] == 1`` is treated as an image (so 2..16 frames give
ratio 0 and t' = 0, NaN at t = 1000). Stage configs never produce those lengths; the quirk is
kept because checkpoints were trained with it and the fixture pins it.

Frame masks (``MaskGenerator``): False frames are conditioning frames, kept clean in x_t,
modulated with t = 0 inside the model and excluded from the loss, which is averaged over the
True frames of each sample.

Randomness is always drawn from a generator the caller passes (timesteps from a CPU
torch.Generator, masks from a numpy or torch Generator) instead of the global RNGs upstream
uses, so a resumed run draws the same values.

``euler_sample`` is upstream's RFLOW.sample for evaluation: N shifted timesteps, Euler steps,
classifier-free guidance with the batch doubled as [cond; null].
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm.auto import tqdm

from reelcache.base.buckets import bucket_geometry

if TYPE_CHECKING:  # the section module builds a Conditioning (lazily): annotations only, no import cycle
    from reelcache.train.sections import ConditioningConfig

__all__ = [
    "MASK_NAMES",
    "NUM_TIMESTEPS",
    "MaskGenerator",
    "add_noise",
    "Conditioning",
    "euler_sample",
    "sample_timesteps",
    "stable_seed",
    "timestep_transform",
    "training_losses",
]

NUM_TIMESTEPS = 1000


def stable_seed(*parts) -> int:
    """A 63-bit seed from a hash of the parts (the same on every node, in every process): a training
    step's draws are seeded by (run seed, global step, clip id, index), validation noise by
    ("val-noise", clip id, k)."""
    h = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") & 0x7FFF_FFFF_FFFF_FFFF


@dataclass(frozen=True)
class Conditioning:
    """The model's size and rate inputs, as Open-Sora 1.2 builds them; one object for training, the
    validation loss (eval/valloss.py) and the sampler (eval/samples.py).

    For a batch of one bucket (``__call__``): ``fps`` (NaN: ``default_fps``) divided by the bucket
    table's ``frame_interval`` and floored, ``height`` and ``width`` the bucket's pixel size,
    ``num_frames`` its pixel frame count (what ``timestep_transform`` shifts by; not a model input).
    ``image_fps`` > 0: the fps of an image bucket (T = 1, single-frame clips only), as given (not
    divided by the frame interval): Open-Sora's images carry IMG_FPS = 120. 0: an image's fps is
    found as a video's. The sampler gives its sizes and fps as they are (``inputs``)."""

    cfg: ConditioningConfig  # [conditioning]: the fps defaults (``ConditioningConfig.build``)
    frame_interval: int = field(kw_only=True)  # the bucket table's

    def __call__(self, bucket: str, fps) -> dict:
        frames, height, width = bucket_geometry(bucket)
        fps = torch.nan_to_num(torch.as_tensor(fps).float(), nan=self.cfg.default_fps)
        if frames == 1 and self.cfg.image_fps > 0:
            fps = torch.full(fps.shape, float(self.cfg.image_fps))
        else:
            fps = torch.floor(fps / self.frame_interval)
        return self.inputs(fps.shape[0], frames, height, width, fps)

    @staticmethod
    def inputs(b: int, frames: int, height: int, width: int, fps) -> dict:
        """Float32 tensors of the batch size, on CPU: fps, height, width, num_frames."""
        return {
            "fps": torch.as_tensor(fps, dtype=torch.float32).expand(b).clone(),
            "height": torch.full((b,), float(height)),
            "width": torch.full((b,), float(width)),
            "num_frames": torch.full((b,), float(frames)),
        }


def timestep_transform(
    t,
    height,
    width,
    num_frames,
    scale: float = 1.0,
    num_timesteps: int = NUM_TIMESTEPS,
    base_resolution: int = 512 * 512,
    base_num_frames: int = 1,
) -> torch.Tensor:
    """Resolution- and length-dependent shift of t (per-sample float tensors, pixel sizes).

    ratio = sqrt(h*w / 512^2) * sqrt(T_lat) * scale, T_lat = 1 if num_frames[0] == 1 else
    num_frames // 17 * 5;  t' = ratio * tn / (1 + (ratio - 1) * tn) * num_timesteps, tn = t/num_timesteps.
    Same operation order as upstream so float32 results are bit-identical."""
    t = torch.as_tensor(t, dtype=torch.float32) / num_timesteps
    height = torch.as_tensor(height, device=t.device)
    width = torch.as_tensor(width, device=t.device)
    num_frames = torch.as_tensor(num_frames, device=t.device)
    ratio_space = (height * width / base_resolution).sqrt()
    if num_frames.reshape(-1)[0] == 1:  # upstream special-cases images by the FIRST sample only
        frames = torch.ones_like(num_frames)
    else:
        frames = num_frames // 17 * 5  # the VAE's 17 -> 5 latent frames, floor: 2..16 frames -> 0
    ratio = ratio_space * (frames / base_num_frames).sqrt() * scale
    t = ratio * t / (1 + (ratio - 1) * t)
    return t * num_timesteps


def sample_timesteps(
    n: int, generator: torch.Generator | None = None, method: str = "logit-normal", num_timesteps: int = NUM_TIMESTEPS
) -> torch.Tensor:
    """n training timesteps on CPU: logit-normal = sigmoid(N(0,1)) * 1000 (upstream's
    LogisticNormal([0],[1]) first coordinate), or uniform in [0, 1000)."""
    if method == "logit-normal":
        return torch.sigmoid(torch.randn(n, generator=generator)) * num_timesteps
    if method == "uniform":
        return torch.rand(n, generator=generator) * num_timesteps
    raise ValueError(f"unknown timestep sampling method {method!r}: use 'logit-normal' or 'uniform'")


def _bcast(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.to(x.device).reshape(-1, *([1] * (x.dim() - 1)))


def add_noise(x0: torch.Tensor, noise: torch.Tensor, t, num_timesteps: int = NUM_TIMESTEPS) -> torch.Tensor:
    """x_t = (1 - t/1000) x0 + (t/1000) noise, per sample (upstream's order of operations)."""
    s = _bcast(1 - torch.as_tensor(t).float() / num_timesteps, x0)
    return s * x0 + (1 - s) * noise


def training_losses(
    model,
    x0: torch.Tensor,
    model_kwargs: dict,
    noise: torch.Tensor,
    t: torch.Tensor,
    x_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sample velocity MSE, (B,). With x_mask (B,T) bool, False frames are fed clean (the
    t = 0 value, i.e. x0), get the t = 0 modulation (x_mask is passed to the model as well, as
    upstream's train.py does) and are left out of the mean."""
    if noise.shape != x0.shape:
        raise ValueError(f"noise {tuple(noise.shape)} and x0 {tuple(x0.shape)} differ")
    x_t = add_noise(x0, noise, t)
    kwargs = dict(model_kwargs)
    if x_mask is not None:
        x_mask = x_mask.to(x0.device).bool()
        x_t = torch.where(x_mask[:, None, :, None, None], x_t, x0)  # add_noise at t = 0 is x0
        kwargs["x_mask"] = x_mask
    out = model(x_t, t, **kwargs)
    sq = (out[:, : x0.shape[1]] - (x0 - noise)).pow(2)
    if x_mask is None:
        return sq.mean(dim=tuple(range(1, sq.dim())))
    per_frame = sq.transpose(1, 2).flatten(2)  # (B, T, C*H*W)
    denom = x_mask.sum(dim=1) * per_frame.shape[-1]
    return (per_frame * x_mask[:, :, None]).sum(dim=1).sum(dim=1) / denom


# ---------------------------------------------------------------------------------------------
# frame masks

MASK_NAMES = (
    "identity",
    "quarter_random",
    "quarter_head",
    "quarter_tail",
    "quarter_head_tail",
    "image_random",
    "image_head",
    "image_tail",
    "image_head_tail",
    "random",
    "intepolate",
)


class Draw:
    """uniform() in [0,1), randint(a, b) inclusive, rand(n) from a numpy or torch Generator."""

    def __init__(self, generator):
        self.g = generator
        self.numpy = isinstance(generator, np.random.Generator)
        if not self.numpy and not isinstance(generator, torch.Generator):
            raise TypeError(f"need a numpy.random.Generator or torch.Generator, got {type(generator).__name__}")

    def uniform(self, lo: float = 0.0, hi: float = 1.0) -> float:
        u = self.g.random() if self.numpy else torch.rand((), generator=self.g).item()
        return lo + (hi - lo) * u

    def randint(self, a: int, b: int) -> int:
        if self.numpy:
            return int(self.g.integers(a, b + 1))
        return int(torch.randint(a, b + 1, (), generator=self.g).item())

    def rand(self, n: int) -> torch.Tensor:
        if self.numpy:
            return torch.from_numpy(self.g.random(n))
        return torch.rand(n, generator=self.g)


class MaskGenerator:
    """Open-Sora's frame-mask mixture (``train_utils.MaskGenerator``), one mask type per sample.

    ``ratios`` maps mask names (``MASK_NAMES``, upstream's spelling incl. "intepolate") to
    probabilities; "identity" (all frames generated) gets 1 - sum(others) when absent. Types are
    drawn by cumulative probability in dict order, as upstream. Masks are over LATENT frames,
    True = generate, False = condition; cond_max = T // 4.

    Two deliberate differences, for lengths Open-Sora 1.2 never trains on (its latent T is 1 or
    >= 15): quarter_* with T < 4 use k = 1 where upstream's randint(1, 0) raises, and a mask
    left with no True frame (T = 2, head_tail) gets its last frame set True as "random" does,
    instead of a 0/0 loss.
    """

    def __init__(self, ratios: dict[str, float]):
        ratios = {str(k): float(v) for k, v in ratios.items()}
        unknown = sorted(set(ratios) - set(MASK_NAMES))
        if unknown:
            raise ValueError(f"unknown mask names {unknown}; valid: {list(MASK_NAMES)}")
        bad = {k: v for k, v in ratios.items() if not 0.0 <= v <= 1.0}
        if bad:
            raise ValueError(f"mask ratios must be in [0, 1]: {bad}")
        if "identity" not in ratios:
            ratios["identity"] = 1.0 - sum(ratios.values())
            if ratios["identity"] < -1e-6:
                raise ValueError(f"mask ratios sum to {sum(ratios.values()) - ratios['identity']:.6f} > 1")
            ratios["identity"] = max(ratios["identity"], 0.0)
        if not math.isclose(sum(ratios.values()), 1.0, abs_tol=1e-6):
            raise ValueError(f"mask ratios must sum to 1 (identity included), got {sum(ratios.values()):.6f}")
        self.ratios = ratios
        self._names = list(ratios)
        self._cum = np.cumsum([ratios[n] for n in self._names])

    def _pick(self, u: float) -> str:
        i = int(np.searchsorted(self._cum, u, side="right"))
        return self._names[i] if i < len(self._names) else "identity"

    def get_mask(self, num_frames: int, draw: Draw) -> tuple[str, torch.Tensor]:
        name = self._pick(draw.uniform())
        t = num_frames
        mask = torch.ones(t, dtype=torch.bool)
        if t <= 1 or name == "identity":
            return name, mask
        cond_max = max(1, t // 4)
        if name == "quarter_random":
            k = draw.randint(1, cond_max)
            pos = draw.randint(0, t - k)
            mask[pos : pos + k] = False
        elif name == "image_random":
            pos = draw.randint(0, t - 1)
            mask[pos] = False
        elif name in ("quarter_head", "quarter_tail", "quarter_head_tail"):
            k = draw.randint(1, cond_max)
            if name != "quarter_tail":
                mask[:k] = False
            if name != "quarter_head":
                mask[-k:] = False
        elif name in ("image_head", "image_head_tail"):
            mask[0] = False
            if name == "image_head_tail":
                mask[-1] = False
        elif name == "image_tail":
            mask[-1] = False
        elif name == "intepolate":
            mask[draw.randint(0, 1) :: 2] = False
        elif name == "random":
            ratio = draw.uniform(0.1, 0.9)
            mask = draw.rand(t) > ratio
        if not mask.any():
            mask[-1] = True
        return name, mask

    def get_masks(self, num_samples: int, num_latent_frames: int, generator) -> torch.Tensor:
        """(num_samples, num_latent_frames) bool, drawn from ``generator`` (numpy or torch)."""
        draw = Draw(generator)
        return torch.stack([self.get_mask(num_latent_frames, draw)[1] for _ in range(num_samples)])


# ---------------------------------------------------------------------------------------------
# sampling


def _double(v):
    return None if v is None else torch.cat([v, v], dim=0)


@torch.no_grad()
def euler_sample(
    model,
    z: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    null_y=None,
    height,
    width,
    num_frames,
    fps,
    steps: int = 30,
    cfg_scale: float | None = 7.0,
    use_timestep_transform: bool = True,
    x_mask: torch.Tensor | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """Upstream's RFLOW.sample with a boolean frame mask: returns the denoised latents (B,C,T,H,W).

    t_i = (1 - i/N) * 1000 for i < N, shifted by ``timestep_transform``; z <- z + v * dt with
    dt = (t_i - t_{i+1}) / 1000 and the last dt = t_{N-1} / 1000. With ``cfg_scale`` the batch
    is doubled as [cond; null] (null = ``y_embedder.y_embedding[:L]`` per sample unless
    ``null_y`` is given; the cond caption mask is reused) and v = v_u + s (v_c - v_u);
    ``cfg_scale=None`` runs the conditional model alone. Frames where ``x_mask`` is False are
    conditioning frames: held at their values in ``z`` and given the t = 0 modulation.
    """
    b = z.shape[0]
    if y.dim() == 4:
        y = y.squeeze(1)
    guided = cfg_scale is not None
    if guided:
        if null_y is None:
            null_y = model.y_embedder.y_embedding[: y.shape[1]].to(y)[None].expand(b, -1, -1)
        elif null_y.dim() == 4:
            null_y = null_y.squeeze(1)
        y = torch.cat([y, null_y.to(y)], dim=0)
    dev = z.device
    height, width, num_frames, fps = (
        torch.as_tensor(v, dtype=torch.float32, device=dev).reshape(b) for v in (height, width, num_frames, fps)
    )
    kwargs = dict(
        y=y,
        mask=_double(mask) if guided else mask,
        fps=_double(fps) if guided else fps,
        height=_double(height) if guided else height,
        width=_double(width) if guided else width,
    )
    if x_mask is not None:
        x_mask = x_mask.to(dev).bool()
        kwargs["x_mask"] = _double(x_mask) if guided else x_mask
        x_ref = z  # z is rebound below, never changed in place

    ts = [torch.full((b,), (1.0 - i / steps) * NUM_TIMESTEPS, dtype=torch.float32, device=dev) for i in range(steps)]
    if use_timestep_transform:
        ts = [timestep_transform(t, height, width, num_frames) for t in ts]
    it = range(steps)
    if progress:
        it = tqdm(it, desc="sampling")
    for i in it:
        t = ts[i]
        if guided:
            v = model(torch.cat([z, z], 0), torch.cat([t, t], 0), **kwargs)[:, : z.shape[1]]
            v_c, v_u = v.chunk(2, dim=0)
            v = v_u + cfg_scale * (v_c - v_u)
        else:
            v = model(z, t, **kwargs)[:, : z.shape[1]]
        dt = (ts[i] - ts[i + 1] if i < steps - 1 else ts[i]) / NUM_TIMESTEPS
        z = z + v * dt[:, None, None, None, None]
        if x_mask is not None:
            z = torch.where(x_mask[:, None, :, None, None], z, x_ref)
    return z
