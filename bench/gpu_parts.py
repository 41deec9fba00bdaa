"""The measurements of `make gpu-check` (bench/gpu_check.py runs them, each in its own try, and
writes the table). Sizes come from a ``Profile``: ``full`` is Open-Sora 1.2 stage 1 at real size
(STDiT3-XL/2, the published VAE architecture, T5-v1.1-XXL, bucket table B1), ``tiny`` the same
code at toy sizes for the CPU test. Weights are random everywhere; nothing is downloaded.

- ``vae``: cache/opensora_vae.py encoding one training batch of pixels per bucket: clips/s, memory.
- ``t5``: transformers' T5EncoderModel from a T5Config at the XXL sizes: 300-token captions/s.
- ``train``: the real train/parallel.py ZeRO-2 branch (LowLevelZeroPlugin stage 2, bf16, HybridAdam,
  gradient checkpointing and EMA as the stage config sets them) driven by train/step.py's Step, at
  the stage's batch sizes: step time, samples/s, MFU, peak memory.
- ``online``: the cached step (latents in) against Open-Sora's online step (pixels -> VAE -> posterior
  sample, token ids -> T5, then the same Step) on the same model, interleaved (bench/interleave.py).
- ``loader``: train/loader.py's LatentLoader feeding the cached step from a shard written on the spot.
- ``projection``: bench/bench_gpu_projection.py's FLOP counts give the measured MFUs it should assume,
  and its online/cached formula at its assumed and at the measured MFUs, beside the measured ratio.

MFU: "step" counts the training step's FLOPs as the projection does (torch's FlopCounterMode on the
meta model: forward + backward + the checkpointed blocks' recompute); "trainer" is what
train/metrics.py logs (3 x the analytic forward, no recompute).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import bench_gpu_projection as proj
import torch

REPO = Path(__file__).resolve().parents[1]
STAGE = REPO / "configs/train/opensora12/stage1.toml"
B1 = REPO / "configs/buckets/opensora12-stage1.toml"
GiB = 2**30


def bootstrap() -> str:
    """reelcache importable from this checkout also where it is not installed (the GPU machine): its
    stages live at the top level (pyproject's package-dir), so the checkout joins reelcache's path."""
    try:
        import reelcache.train  # noqa: F401

        return "installed"
    except ModuleNotFoundError:
        sys.path.insert(0, str(REPO))
        import reelcache

        reelcache.__path__.append(str(REPO))
        return "from the checkout"


def bucket_name(bucket: str) -> str:
    """ "res/T" -> the catalog's "res/T/<aspect key>" of a 9:16 clip, as the projection counts buckets."""
    from reelcache.base.buckets import nearest_ratio

    return f"{bucket}/{nearest_ratio(*proj.AR, bucket.split('/')[0])}"


class Skip(Exception):
    """A part that cannot run here; the message says why."""


@dataclass
class Profile:
    name: str
    overrides: list  # on configs/train/opensora12/stage1.toml
    buckets: list  # "res/T": measured by vae and train, with the stage's (or tiny) batch sizes
    online: list  # buckets of the cached-vs-online comparison, in order, while time lasts
    t5: dict
    vae_spatial: dict | None = None  # None: the published sizes
    vae_temporal: dict | None = None
    batch: dict = field(
        default_factory=dict
    )  # bucket -> batch size (empty: from configs/buckets/opensora12-stage1.toml)
    captions: int = 32  # captions per T5 call
    reps: int = 3  # timed repetitions (interleaved rounds for online)
    encode_reps: int = 3  # timed VAE and T5 calls
    loader_batches: int = 6
    workers: int | None = None  # loader workers (None: the stage config's)


def full() -> Profile:
    return Profile("full", [], ["240p/51", "360p/102", "240p/1"], ["240p/51", "360p/102"], dict(proj.T5XXL))


def tiny() -> Profile:
    """Toy sizes, same classes: a 4-level VAE (8x down, as the real one) of 4 to 8 channels, the 'tiny' STDiT3
    preset (captions of 16 x 32), a 2-layer T5 of width 32."""
    spatial = dict(
        block_out_channels=(4, 4, 8, 8),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
    )
    from reelcache.cache.opensora_vae import TINY_TEMPORAL

    t5 = dict(proj.T5XXL, vocab_size=512, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    return Profile(
        "tiny",
        ['model.preset="tiny"', "model.overrides={}", "data.workers=1", "data.prefetch=2"],
        ["144p/9", "144p/17", "144p/1"],
        ["144p/17"],
        t5,
        spatial,
        dict(TINY_TEMPORAL),
        batch={"144p/9": 1, "144p/17": 1, "144p/1": 2},
        captions=4,
        reps=2,
        encode_reps=1,
        loader_batches=3,
    )


class Ctx:
    """What the parts share: sizes, device, the deadline, the models built so far, FLOP counts."""

    def __init__(self, profile: Profile, device: torch.device, deadline: float):
        from reelcache.base.buckets import BucketConfig
        from reelcache.train.config import load_config

        self.p, self.device, self.deadline = profile, device, deadline
        # bf16 on the GPU; on the CPU (--tiny) the encoders run in fp32, whose convolutions CPUs do fast
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.cfg = load_config(STAGE, [*profile.overrides, 'parallel.plugin="zero2"', 'log.wandb_mode="disabled"'])
        table = BucketConfig.from_toml(B1)
        self.batch = {b: profile.batch.get(b) or table.batch_size(bucket_name(b)) for b in profile.buckets}
        self.model_cfg = self.cfg.model.stdit3()
        self.caption = self.model_cfg.model_max_length
        self.vae = self.t5 = self.trainer = None
        self.kernels: threading.Thread | None = None
        self.kernel_result: dict = {}
        self.fallback: str | None = None  # why the training parts run DDP instead of zero2
        self.measured: dict = {}  # bucket -> {"dit_step_s", "vae_clip_s", ...}; "t5_caption_s"
        self._flops: dict = {}
        self.flop_error: str | None = None
        self._pool = self._pending = None
        self._later: list = []
        from reelcache.train.metrics import peak_flops

        self.peak = peak_flops(device)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def geometry(self, bucket: str) -> tuple[int, int, int, int, int, int]:
        """(pixel frames, H, W, latent frames, latent h, latent w) of "res/T" for a 9:16 clip."""
        from reelcache.base.buckets import bucket_geometry
        from reelcache.cache.opensora_vae import latent_frames

        frames, H, W = bucket_geometry(bucket_name(bucket))
        return frames, H, W, latent_frames(frames), H // 8, W // 8

    # -- FLOPs, counted as bench_gpu_projection.py counts them --------------------------------
    def count_flops(self) -> None:
        """Start counting every FLOP figure the parts need, in a spawned process: the counts run the
        models on the meta device, and ColossalAI, once imported (here, for the training parts),
        registers meta kernels of its own that break the backward's count. The XL/2 counts (12 s of CPU here)
        overlap the GPU parts that way."""
        self._pool = mp.get_context("spawn").Pool(1, initializer=bootstrap)
        self._pending = self._pool.apply_async(count_all, (self.p, self.model_cfg))

    def flops(self, what: str, bucket: str | None = None, wait: bool = True) -> float | None:
        """A count; None where counting failed (the projection part says why; the measurements stand
        without their MFU) or, with ``wait`` off, is still running."""
        if not self._flops and self.flop_error is None and self._pending is not None:
            if not wait and not self._pending.ready():
                return None
            try:
                self._flops = self._pending.get(timeout=max(1.0, self.left()))
            except Exception as e:
                self.flop_error = f"{type(e).__name__}: {e}"
        return self._flops.get((what, bucket))

    def mfu_later(self, numbers: dict, key: str, what: str, bucket: str | None, seconds_per_sample: float) -> None:
        """``numbers[key]`` = the MFU, filled in by ``fill_mfu`` once the counts are there (a part never
        waits for them)."""
        numbers[key] = None
        self._later.append((numbers, key, what, bucket, seconds_per_sample))

    def fill_mfu(self, wait: bool) -> None:
        if self._later and self.flops("t5", None, wait=wait) is not None:
            for numbers, key, what, bucket, s in self._later:
                numbers[key] = self.mfu(self.flops(what, bucket), s)
            self._later = []

    def close(self) -> None:
        """Stop the counting process (if the budget ran out before it finished) and the process group."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
        if self.trainer is not None:
            self.trainer.par.close()

    def mfu(self, flops: float | None, seconds: float) -> float | None:
        return flops / seconds / self.peak if self.peak and flops else None


def count_all(p: Profile, model_cfg) -> dict:
    """{(part, bucket): FLOPs per sample}: "dit" the training step (recompute included), "trainer"
    train/metrics.py's 3 x analytic forward, "vae" one clip's encode, ("t5", None) one caption."""
    bootstrap()
    torch.set_num_threads(1)  # meta tensors: no arithmetic, so no threads to take from the measured parts
    from reelcache.base.buckets import bucket_geometry
    from reelcache.cache.opensora_vae import OpenSoraVAE, latent_frames
    from reelcache.train.model import flops_per_sample

    preset, caption = (None if p.name == "full" else "tiny"), model_cfg.model_max_length
    pair = (proj.build_dit(preset, depth=1), proj.build_dit(preset, depth=2))
    with torch.device("meta"):
        vae = OpenSoraVAE(spatial=p.vae_spatial, temporal=p.vae_temporal).to(torch.bfloat16).eval()
    out = {("t5", None): t5_flops(p.t5, caption)}
    for b in p.buckets:
        frames, H, W = bucket_geometry(bucket_name(b))
        t, h, w = latent_frames(frames), H // 8, W // 8
        out["dit", b] = proj.dit_extrapolated(pair, model_cfg.depth, t, h, w, H, W)[1]
        out["trainer", b] = 3 * flops_per_sample(model_cfg, t, h, w, caption)
        out["vae", b] = proj.vae_encode(vae, frames, H, W)
    return out


def t5_flops(config: dict, tokens: int) -> int:
    """One caption of ``tokens`` through the encoder, on meta (bench_gpu_projection.t5_encode's way)."""
    from transformers import T5Config, T5EncoderModel

    with torch.device("meta"):
        model = T5EncoderModel(T5Config(**config)).to(torch.bfloat16).eval()
        ids = torch.zeros(1, tokens, dtype=torch.long)
    with torch.no_grad():
        return proj.count(lambda: model(input_ids=ids))


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device) -> float | None:
    """Peak GPU memory allocated since the last reset (None on CPU)."""
    return torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None


def timed(fn, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


# -- parts -------------------------------------------------------------------------------------
def versions(ctx: Ctx) -> list[dict]:
    import platform
    import subprocess
    from importlib.metadata import PackageNotFoundError, version

    import reelcache

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("colossalai", "transformers", "diffusers", "duckdb", "pyarrow", "bitsandbytes", "peft"):
        try:
            info[name] = version(name)
        except PackageNotFoundError:
            info[name] = None
    if ctx.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(ctx.device)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(ctx.device)))
        info["gpu_gib"] = round(torch.cuda.get_device_properties(ctx.device).total_memory / GiB, 1)
        from torch.utils.cpp_extension import CUDA_HOME

        nvcc = Path(CUDA_HOME or "/nonexistent", "bin", "nvcc")
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout if nvcc.exists() else ""
        info["nvcc"] = out.strip().splitlines()[-1] if out else None
    info["peak_tflops"] = ctx.peak / 1e12 if ctx.peak else None
    info["reelcache_from"] = str(Path(reelcache.__file__).parent)
    return [{"bucket": "", "numbers": info}]


def build_vae(ctx: Ctx):
    from reelcache.cache.opensora_vae import OpenSoraVAE

    if ctx.vae is None:
        torch.manual_seed(0)
        with torch.device(ctx.device):
            ctx.vae = OpenSoraVAE(spatial=ctx.p.vae_spatial, temporal=ctx.p.vae_temporal).to(ctx.dtype).eval()
    return ctx.vae


def pixels(ctx: Ctx, bucket: str, n: int):
    frames, H, W, *_ = ctx.geometry(bucket)
    return torch.rand(n, 3, frames, H, W, device=ctx.device, dtype=ctx.dtype) * 2 - 1


def vae(ctx: Ctx) -> list[dict]:
    """One training batch of clips per call (Open-Sora's online encode), median of ``reps`` calls."""
    model, rows = build_vae(ctx), []
    for b in ctx.p.buckets:
        if ctx.left() < 20:
            rows.append({"bucket": b, "status": "skipped: budget", "numbers": {}})
            continue
        n = ctx.batch[b]
        reset_memory(ctx.device)
        x = pixels(ctx, b, n)
        mean, _ = model.encode(x)  # warm-up (cuDNN picks its convolution algorithms); its shape is reported
        s = statistics.median([timed(lambda x=x: model.encode(x), ctx.device) for _ in range(ctx.p.encode_reps)])
        ctx.measured.setdefault(b, {})["vae_clip_s"] = s / n
        rows.append(
            {
                "bucket": b,
                "numbers": {
                    "clips": n,
                    "clips_per_s": n / s,
                    "latent": "x".join(map(str, mean.shape[1:])),
                    "peak_gib": peak_gib(ctx.device),
                },
            }
        )
        ctx.mfu_later(rows[-1]["numbers"], "mfu", "vae", b, s / n)
        del x, mean
    return rows


def build_t5(ctx: Ctx):
    from transformers import T5Config, T5EncoderModel

    if ctx.t5 is None:
        torch.manual_seed(0)
        old = torch.get_default_dtype()
        torch.set_default_dtype(ctx.dtype)  # built in bf16 on the device: 9.5 GB, never an fp32 copy
        try:
            with torch.device(ctx.device):
                ctx.t5 = T5EncoderModel(T5Config(**ctx.p.t5)).eval()
        finally:
            torch.set_default_dtype(old)
    return ctx.t5


def encode_text(ctx: Ctx, n: int):
    model = build_t5(ctx)
    ids = torch.randint(0, ctx.p.t5["vocab_size"], (n, ctx.caption), device=ctx.device)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state


def t5(ctx: Ctx) -> list[dict]:
    n = ctx.p.captions
    reset_memory(ctx.device)
    build_t5(ctx)
    params = sum(p.numel() for p in ctx.t5.parameters())
    out = []
    encode_text(ctx, n)
    s = statistics.median(timed(lambda: out.append(encode_text(ctx, n)), ctx.device) for _ in range(ctx.p.encode_reps))
    ctx.measured["t5_caption_s"] = s / n
    numbers = {
        "params_b": params / 1e9,
        "captions": n,
        "captions_per_s": n / s,
        "hidden": "x".join(map(str, out[-1].shape[1:])),
        "peak_gib": peak_gib(ctx.device),
    }
    ctx.mfu_later(numbers, "mfu", "t5", None, s / n)
    return [{"bucket": f"{ctx.caption} tokens", "numbers": numbers}]
