"""The training parts of `make gpu-check` (bench/gpu_parts.py says what each measures): the ZeRO-2
step at the stage's batch sizes, cached vs online, the loader in front of the step, and what the
projection should assume."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import bench_gpu_projection as proj
import torch
from gpu_parts import (
    Ctx,
    Skip,
    bucket_name,
    build_vae,
    encode_text,
    peak_gib,
    pixels,
    reset_memory,
    sync,
    timed,
)
from interleave import Ratio, rounds

# The kernels are waited for while more than this is left: the training parts need about as much.
KERNEL_WAIT_LEFT = 210


def start_kernels(ctx: Ctx) -> None:
    """Build (or load) HybridAdam's two kernels with ColossalAI's own loaders, in a thread, while the
    GPU measures the encoders: cpu_adam_x86 (g++) and fused_optim_cuda (nvcc, for this GPU)."""
    if ctx.device.type != "cuda":
        return
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))  # ninja's parallel compile jobs

    def build():
        res = ctx.kernel_result
        try:
            from colossalai.kernel.kernel_loader import CPUAdamLoader, FusedOptimizerLoader

            t0 = time.perf_counter()
            CPUAdamLoader().load()
            res["cpu_adam_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            FusedOptimizerLoader().load()
            res["fused_optim_s"] = time.perf_counter() - t0
        except BaseException as e:  # recorded in the table by the kernels part
            res["error"] = f"{type(e).__name__}: {e}"

    ctx.kernels = threading.Thread(target=build, name="colossalai-kernels", daemon=True)
    ctx.kernels.start()


def kernels(ctx: Ctx) -> list[dict]:
    if ctx.kernels is None:
        raise Skip("no CUDA: the CPU ZeRO mode updates with ColossalAI's torch Adam (train/zero_cpu.py)")
    ctx.kernels.join(timeout=max(1.0, ctx.left() - KERNEL_WAIT_LEFT))
    if ctx.kernels.is_alive():
        raise RuntimeError(
            f"HybridAdam's kernels still compiling with {ctx.left():.0f} s left: the training parts run DDP; the "
            "build goes on while time is left, and a rerun on the same machine loads them"
        )
    if "error" in ctx.kernel_result:
        raise RuntimeError(ctx.kernel_result["error"])
    return [{"bucket": "", "numbers": dict(ctx.kernel_result)}]


class Trainer:
    """The trainer's model, optimizer, EMA and Step, built as train/trainer.py builds them (the
    zero2 branch of Parallel.setup, HybridAdam, the boost), without its data root and run folder."""

    def __init__(self, ctx: Ctx, plugin: str = "zero2"):
        from reelcache.train.model import STDiT3
        from reelcache.train.parallel import Parallel

        cfg = ctx.cfg
        t0 = time.perf_counter()
        self.par = par = Parallel.setup(dataclasses.replace(cfg.parallel, plugin=plugin))
        torch.manual_seed(cfg.run.seed)
        with torch.device(par.device):  # random init where it trains: seconds, not minutes, for 1.1B
            model = STDiT3(ctx.model_cfg)
        model.set_grad_checkpointing(bool(cfg.model.grad_checkpoint))
        opt = cfg.optim.build(par=par, params=[p for p in model.parameters() if p.requires_grad])
        self.model, self.optimizer = par.boost(model, opt)
        masters = par.master_chunks(self.model, self.optimizer)
        ema = cfg.ema.build(chunks=lambda: {n: c.detach().clone() for n, c in masters.items()})
        self.step = cfg.step.build(
            par=par,
            model=self.model,
            optimizer=self.optimizer,
            guard=cfg.guard.build(),
            ema=ema,
            cond=cfg.conditioning.build(frame_interval=cfg.frame_interval()),
            flow=cfg.flow,
            optim=cfg.optim,
            seed=cfg.run.seed,
        )
        self.state = SimpleNamespace(global_step=0, opt_steps=0)
        self.params = sum(p.numel() for p in model.parameters())
        self.build_s = time.perf_counter() - t0
        self.skipped = 0

    def __call__(self, batch) -> None:
        out = self.step(batch, self.state)
        self.state.global_step += 1
        self.skipped += out.skipped is not None


def trainer(ctx: Ctx) -> Trainer:
    """The zero2 Trainer; where it cannot be built (HybridAdam's kernels, ColossalAI on this torch), the
    DDP one (fp32, torch's AdamW), so that cached vs online and the loader are still measured: every
    row names its plugin, and ``ctx.fallback`` says why."""
    if ctx.trainer is None:
        try:
            if ctx.kernels is not None:  # HybridAdam loads the kernels the background thread builds
                ctx.kernels.join(timeout=max(0.0, ctx.left() - KERNEL_WAIT_LEFT))
                if ctx.kernels.is_alive():
                    raise RuntimeError("HybridAdam's kernels still compiling when the budget ran low")
                if "error" in ctx.kernel_result:
                    raise RuntimeError(f"HybridAdam's kernels: {ctx.kernel_result['error']}")
            ctx.trainer = Trainer(ctx)
        except Exception as e:
            ctx.fallback = f"ddp, as zero2 failed: {type(e).__name__}: {str(e)[:200]}"
            print(f"gpu-check: {ctx.fallback}", flush=True)
            ctx.trainer = Trainer(ctx, "ddp")
    return ctx.trainer


def latent_batch(ctx: Ctx, bucket: str, n: int, x=None, text=None) -> dict:
    """A micro-batch as the loader hands it to Step: latents (or ``x``), captions (or ``text``) of the
    model's caption length, all tokens real, fps unknown (the stage's default)."""
    *_, t, h, w = ctx.geometry(bucket)
    dev, c = ctx.device, ctx.model_cfg
    if x is None:
        x = torch.randn(n, c.in_channels, t, h, w, device=dev, dtype=ctx.dtype)
    if text is None:
        text = torch.randn(n, ctx.caption, c.caption_channels, device=dev, dtype=ctx.dtype)
    return {
        "x": x,
        "text": text,
        "text_mask": torch.ones(n, text.shape[1], dtype=torch.bool, device=dev),
        "fps": torch.full((n,), float("nan")),
        "bucket": bucket_name(bucket),
        "clip_id": [f"gpu-check-{i}" for i in range(n)],
        "weight": 1.0,
    }


def train(ctx: Ctx) -> list[dict]:
    tr, rows = trainer(ctx), []
    for b in ctx.p.buckets:
        n = ctx.batch[b]
        if ctx.left() < 30:
            rows.append({"bucket": b, "status": "skipped: budget", "numbers": {}})
            continue
        reset_memory(ctx.device)
        batch = latent_batch(ctx, b, n)
        tr(batch)  # warm-up: the first step allocates ZeRO's buckets and the optimizer state
        times = []
        for _ in range(ctx.p.reps):
            times.append(timed(lambda batch=batch: tr(batch), ctx.device))
            if ctx.left() < 20:
                break
        s = statistics.median(times)
        ctx.measured.setdefault(b, {})["dit_step_s"] = s / n
        rows.append(
            {
                "bucket": b,
                "numbers": {
                    "batch": n,
                    "step_s": s,
                    "samples_per_s": n / s,
                    "peak_gib": peak_gib(ctx.device),
                    "steps": len(times),
                    "skipped_steps": tr.skipped,
                    "plugin": f"{tr.par.plugin_name} on {tr.par.device.type}"
                    + (f" ({ctx.fallback})" if ctx.fallback else ""),
                    "params_m": tr.params / 1e6,
                    "build_s": tr.build_s,
                },
            }
        )
        ctx.mfu_later(rows[-1]["numbers"], "mfu_step", "dit", b, s / n)
        ctx.mfu_later(rows[-1]["numbers"], "mfu_trainer", "trainer", b, s / n)
    return rows


def online(ctx: Ctx) -> list[dict]:
    """Cached step vs Open-Sora's online step on the same Trainer, in interleaved rounds."""
    tr, vae, rows = trainer(ctx), build_vae(ctx), []
    for b in ctx.p.online:
        n = ctx.batch[b]
        if ctx.left() < 60:
            rows.append({"bucket": b, "status": "skipped: budget", "numbers": {}})
            continue
        reset_memory(ctx.device)
        res = rounds(contenders(ctx, tr, vae, b, n), reps=ctx.p.reps, warmup=1)
        a, o = res["cached"], res["online"]
        ratio = Ratio.of([n / r["s"] for r in a], [n / r["s"] for r in o])
        ctx.measured.setdefault(b, {})["ratio"] = ratio
        rows.append(
            {
                "bucket": b,
                "numbers": {
                    "batch": n,
                    "plugin": tr.par.plugin_name,
                    "cached_samples_per_s": n / statistics.median(r["s"] for r in a),
                    "online_samples_per_s": n / statistics.median(r["s"] for r in o),
                    "online_encode_share": statistics.median(r["encode_s"] / r["s"] for r in o),
                    "cached_over_online": ratio.short(),
                    "ratio": ratio.as_dict(),
                    "peak_gib": peak_gib(ctx.device),
                },
            }
        )
    return rows


def contenders(ctx: Ctx, tr: Trainer, vae, b: str, n: int) -> dict:
    """The cached step and Open-Sora's online step of bucket ``b`` (batch ``n``), for interleave.rounds."""
    cached_batch = latent_batch(ctx, b, n)

    def cached(_r):
        return {"s": timed(lambda: tr(cached_batch), ctx.device)}

    def online(_r):
        t0 = time.perf_counter()
        mean, logvar = vae.encode(pixels(ctx, b, n))
        x = mean + torch.exp(0.5 * logvar) * torch.randn_like(mean)  # the posterior sample, as Open-Sora
        text = encode_text(ctx, n)
        sync(ctx.device)
        t1 = time.perf_counter()
        tr(latent_batch(ctx, b, n, x=x, text=text))
        sync(ctx.device)
        return {"s": time.perf_counter() - t0, "encode_s": t1 - t0}

    return {"cached": cached, "online": online}


def write_shard(ctx: Ctx, root: Path, bucket: str, count: int) -> Path:
    """``count`` latent samples of ``bucket`` (posterior + caption, bf16) in the cache's format, and
    their loader manifest; returns the manifest's path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from reelcache.base.latents import LATENT_EXT, encode
    from reelcache.base.shards import ShardWriter

    *_, t, h, w = ctx.geometry(bucket)
    c = ctx.model_cfg
    g = torch.Generator().manual_seed(0)
    (root / "latents/gpu-check").mkdir(parents=True)
    writer, rows = ShardWriter(root / "latents/gpu-check", "000000", 1 << 30, fsync=False), []
    for i in range(count):
        clip = hashlib.blake2b(f"gpu-check/{i}".encode(), digest_size=10).hexdigest()
        tensors = {
            "mean": torch.randn(c.in_channels, t, h, w, generator=g).bfloat16(),
            "logvar": (torch.randn(c.in_channels, t, h, w, generator=g) - 3).bfloat16(),
            "text": torch.randn(ctx.caption, c.caption_channels, generator=g).bfloat16(),
        }
        full = bucket_name(bucket)
        shard, offsets = writer.write_sample(clip, [(LATENT_EXT, encode(tensors, clip_id=clip, bucket=full), None)])
        rows.append(
            {
                "clip_id": clip,
                "bucket": full,
                "shard": f"latents/gpu-check/{shard}",
                "shard_offset": offsets[LATENT_EXT],
            }
        )
    writer.close()
    path = root / "manifests/gpu-check.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def loader(ctx: Ctx) -> list[dict]:
    """The stage's loader (its workers and prefetch) feeding the cached step; the first batch (workers
    starting) is not counted."""
    from reelcache.base.buckets import BucketConfig
    from reelcache.train.loader import LatentLoader

    tr = trainer(ctx)
    b = ctx.p.online[0]
    n, (res, frames) = ctx.batch[b], b.split("/")
    root = Path(tempfile.mkdtemp(prefix="gpu-check-"))  # never under the output folder: that comes back
    try:
        t0 = time.perf_counter()
        manifest = write_shard(ctx, root, b, n * ctx.p.loader_batches)
        write_s = time.perf_counter() - t0
        workers = ctx.cfg.data.workers if ctx.p.workers is None else ctx.p.workers
        ld = LatentLoader(
            [str(manifest)],
            BucketConfig.from_dict({res: {frames: n}}),
            root=root,
            seed=ctx.cfg.run.seed,
            workers=workers,
            prefetch=ctx.cfg.data.prefetch,
        )
        waits, steps, samples = [], [], 0
        it = iter(ld)
        while ctx.left() > 15:
            t0 = time.perf_counter()
            batch = next(it, None)
            t1 = time.perf_counter()
            if batch is None:
                break
            tr(batch)
            sync(ctx.device)
            t2 = time.perf_counter()
            samples += len(batch["clip_id"])
            waits.append(t1 - t0)
            steps.append(t2 - t1)
        it.close()
        if len(steps) < 2:
            raise RuntimeError(f"{len(steps)} loader batches before the budget ran out")
        wait, step = sum(waits[1:]), sum(steps[1:])
        return [
            {
                "bucket": b,
                "numbers": {
                    "batch": n,
                    "plugin": tr.par.plugin_name,
                    "workers": workers,
                    "samples_read": samples,
                    "manifest_rows": n * ctx.p.loader_batches,
                    "data_wait_share": wait / (wait + step),
                    "wait_ms": 1e3 * wait / (len(waits) - 1),
                    "step_s": step / (len(steps) - 1),
                    "shard_mib": sum(f.stat().st_size for f in (root / "latents/gpu-check").glob("*.tar")) / 2**20,
                    "write_s": write_s,
                },
            }
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def projection(ctx: Ctx) -> list[dict]:
    """Per bucket: the projection's online/cached at its assumed MFUs and at the measured ones
    (its formula: per-sample time = sum over parts of FLOPs / (MFU x peak)), beside the measured ratio."""
    defaults = proj.parse([])
    assumed = {p: getattr(defaults, f"mfu_{p}") for p in proj.PARTS}
    t5_s = ctx.measured.get("t5_caption_s")
    if ctx.flops("t5") is None:
        raise RuntimeError(f"the FLOP counts failed: {ctx.flop_error}")
    rows = []
    for b in ctx.p.buckets:
        m = ctx.measured.get(b, {})
        f = {p: ctx.flops(p, b) for p in ("dit", "vae")} | {"t5": ctx.flops("t5")}
        secs = {"dit": m.get("dit_step_s"), "vae": m.get("vae_clip_s"), "t5": t5_s}
        # Measured MFU per part; on CPU (no peak) the projection's formula runs on the measured seconds.
        mfu = {p: (ctx.mfu(f[p], s) if s else None) for p, s in secs.items()}

        def ratio(per_sample_s):
            return sum(per_sample_s.values()) / per_sample_s["dit"]

        nums = {"projected_at_assumed_mfu": ratio({p: f[p] / assumed[p] for p in f})}
        if all(secs.values()):
            nums["projected_at_measured"] = ratio(secs)
        nums |= {f"mfu_{p}": v for p, v in mfu.items()}
        if "ratio" in m:
            nums["measured_interleaved"] = m["ratio"].short()
        rows.append({"bucket": b, "numbers": nums})
    if not any(len(r["numbers"]) > 1 for r in rows):
        raise Skip("no part measured any bucket")
    return rows


def quiet_colossalai() -> None:
    """Import ColossalAI once, in the main thread, without its notices (before the kernel thread)."""
    from reelcache.train.parallel import colossalai_classes

    colossalai_classes()
