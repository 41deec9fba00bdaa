"""The training loop: STDiT3 + rectified flow on the latent cache, one stage per run.

    reelcache train configs/train/opensora12/stage1.toml --root /data/rc --init-from PixArt-Sigma-XL-2-2K-MS.pth
    reelcache train configs/train/opensora12/stage1.toml --root /data/rc --load latest

Per step, on every rank: a micro-batch from the streaming loader (one bucket; its latents are
already VAE posteriors and T5 embeddings), per-sample draws seeded by (seed, step, clip id)
(timestep, noise, frame mask, caption dropout), the rectified-flow loss, backward, the global
gradient norm, the divergence guard, the optimizer step, the EMA update.

The step's gradient is the mean over the real samples of all ranks (``loss_reduction =
"sample"``): rank r backpropagates R * sum(loss_i) / N, where N is the all-reduced count of real
samples and the data-parallel average divides by R again. Ranks hold different buckets and
batch sizes, and a rank with a padding batch (weight 0) contributes nothing, so it neither
shrinks nor skews the step. Open-Sora averages the ranks' means with equal weight (``"rank"``),
which weighs a 360p sample of a batch of 8 like 2.5 samples of a 240p batch of 20.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import time
from pathlib import Path

import numpy as np
import torch

from reelcache import UserError
from reelcache.progress import say
from reelcache.train.config import TrainConfig

# Dense bf16 peak of the GPU, for MFU (FLOP/s). Unknown devices report no MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def stable_seed(*parts) -> int:
    """A 63-bit seed from a hash of the parts (the same on every node, in every process)."""
    h = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") & 0x7FFF_FFFF_FFFF_FFFF


def bucket_geometry(bucket: str) -> tuple[int, int, int]:
    """(pixel frames, pixel height, pixel width) of a bucket name "<resolution>/<T>/<ar key>"."""
    from reelcache.catalog.buckets import bucket_hw

    res, t, ar = bucket.split("/")
    h, w = bucket_hw(res, ar)
    return int(t), h, w


class Trainer:
    def __init__(
        self, cfg: TrainConfig, root, *, load=None, init_from=None, reset_data: bool = False, config_path=None
    ):
        from reelcache.train.parallel import Parallel

        self.cfg, self.root = cfg, Path(root)
        self.run_dir = self.root / "runs" / cfg.run.name
        self.par = Parallel.setup(cfg.run.plugin, cfg.model.dtype, cfg.optim.grad_clip)
        self.rank0 = self.par.rank == 0
        try:
            self._build(load, init_from, reset_data)
        except BaseException:
            self.par.close()
            raise

    # -- setup -----------------------------------------------------------------------------
    def _build(self, load, init_from, reset_data):
        from reelcache.catalog.buckets import BucketConfig
        from reelcache.train import checkpoint as ck
        from reelcache.train.flow import MaskGenerator
        from reelcache.train.guard import Guard
        from reelcache.train.loader import LatentLoader
        from reelcache.train.model import STDiT3

        cfg, par = self.cfg, self.par
        self.ckpt_path = None
        if load is not None:
            try:
                self.ckpt_path = ck.resolve(load, self.root, self.run_dir)
            except FileNotFoundError as e:
                raise UserError(str(e)) from None
        existing = ck.list_checkpoints(self.run_dir)
        if existing and self.ckpt_path is None:
            raise UserError(
                f"{self.run_dir} already has checkpoints up to {existing[-1].name}: resume with "
                f"--load latest (or --load {existing[-1]}), or train under another run.name"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._record_rank()

        # Data.
        self.buckets = BucketConfig.from_toml(cfg.data.buckets)
        manifests = [(m.name, m.weight) for m in cfg.data.manifests]
        try:
            self.loader = LatentLoader(
                manifests,
                self.buckets,
                root=self.root,
                rank=par.rank,
                world_size=par.world,
                seed=cfg.run.seed,
                workers=cfg.data.workers,
                prefetch=cfg.data.prefetch,
                block=cfg.data.block,
                consumed_log=self.run_dir / "consumed",
                log_every=max(1, cfg.run.ckpt_every or 100),
            )
        except ValueError as e:
            raise UserError(str(e)) from e

        # Model, EMA, optimizer.
        mcfg = self.model_cfg = cfg.model_config()
        torch.manual_seed(cfg.run.seed)  # the same fresh init on every rank
        model = STDiT3(mcfg)
        if cfg.model.grad_checkpoint:
            model.set_grad_checkpointing(True)
        self.loaded_from = None
        if self.ckpt_path is not None:
            self._load_weights(model, self.ckpt_path, strict=True)
        elif init_from is not None:
            self._load_weights(model, init_from, strict=None)
        self.shapes = {n: p.shape for n, p in model.named_parameters() if p.requires_grad}
        # fp32 values as initialised or loaded: ZeRO's boost casts the module to bf16 and would build
        # the fp32 masters from those rounded values; frozen entries are saved from here too.
        fp32 = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        self.frozen = {k: v for k, v in fp32.items() if k not in self.shapes}
        model = model.to(par.device)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = par.optimizer(
            params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, eps=cfg.optim.adam_eps, betas=cfg.optim.betas
        )
        self.model, self.optimizer = par.boost(model, opt)
        if par.zero:
            for n, m in par.master_chunks(self.model, self.optimizer).items():
                m.copy_(par.chunk(fp32[n].float().reshape(-1)))
        del fp32
        if cfg.run.compile:
            for blk in list(self.module.spatial_blocks) + list(self.module.temporal_blocks):
                blk.compile()
        self.masks = MaskGenerator(cfg.flow.mask_ratios) if cfg.flow.mask_ratios else None
        self.guard = Guard(cfg.run.spike_z, cfg.run.spike_window, cfg.run.max_bad_steps)
        self.global_step = self.opt_steps = 0
        self.wandb_id = None
        self.generation = 0

        if self.ckpt_path is not None:
            self._resume(self.ckpt_path, reset_data)
        if cfg.run.ema_decay > 0:
            if self.ckpt_path is not None and (self.ckpt_path / "ema").exists():
                from reelcache.train.weights import read_sharded

                full = read_sharded(self.ckpt_path / "ema")
                self.ema = {n: par.chunk(full[n].float().reshape(-1)).clone().to(par.device) for n in self.shapes}
            else:  # fresh, or --init-from: the EMA starts as the weights
                self.ema = {n: c.detach().clone() for n, c in par.master_chunks(self.model, self.optimizer).items()}
        else:
            self.ema = None

        from reelcache.train.checkpoint import Checkpointer
        from reelcache.train.runlog import RunLog

        self.ckpt = Checkpointer(self.run_dir, par, cfg.run.keep_last, cfg.run.keep_every)
        resolved = cfg.to_dict()
        if self.rank0:
            (self.run_dir / "config.json").write_text(json.dumps(resolved, indent=2, default=str))
        self.total_steps = self._total_steps()
        self.log = RunLog(
            self.run_dir,
            enabled=self.rank0,
            project=cfg.run.wandb_project,
            mode=cfg.run.wandb_mode,
            name=cfg.run.name,
            config=resolved,
            run_id=self.wandb_id,
            generation=self.generation,
            total_steps=self.total_steps,
        )
        if self.rank0 and self.log.run_id:
            (self.run_dir / "wandb_id").write_text(self.log.run_id)
        self.peak = next(
            (
                v
                for k, v in PEAK_FLOPS.items()
                if par.device.type == "cuda" and k in torch.cuda.get_device_name(par.device)
            ),
            None,
        )
        if self.rank0:
            n = sum(p.numel() for p in self.module.parameters())
            t = sum(p.numel() for p in self.module.parameters() if p.requires_grad)
            say(
                f"train {cfg.run.name}: {cfg.model.preset} ({n / 1e6:.1f}M parameters, {t / 1e6:.1f}M trainable) on "
                f"{par.world} x {par.device.type} with {par.plugin_name}; {self.loader.plan().num_batches} "
                f"micro-batches per epoch, {self.total_steps} steps; run dir {self.run_dir}"
            )

    @property
    def module(self):
        return self.model.unwrap()

    def _record_rank(self):
        """Who runs this rank: host, pid and the kernel's start time of that pid (so a dump or a stop
        reaches exactly this process, never a later one that reused the pid); SIGUSR1 dumps stacks."""
        from reelcache.catalog.lease import boot_id
        from reelcache.train.watchdog import install_stack_signal

        d = self.run_dir / "ranks"
        d.mkdir(parents=True, exist_ok=True)
        self._stacks = install_stack_signal(self.run_dir, self.par.rank)
        info = {
            "rank": self.par.rank,
            "world_size": self.par.world,
            "local_rank": self.par.local_rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "proc_start": proc_start(os.getpid()),
            "boot_id": boot_id(),
            "started": time.time(),
            "launcher_pid": os.getppid(),
            "launcher_proc_start": proc_start(os.getppid()),
            "stacks": str(Path(self._stacks.name).resolve()),
        }
        from reelcache.catalog.shards import atomic_path

        with atomic_path(d / f"rank{self.par.rank:05d}.json") as tmp:
            Path(tmp).write_text(json.dumps(info))
        if self.rank0:  # records of a launch with more ranks are not this run's
            for stale in d.glob("rank*.json"):
                if stale.stem[4:].isdigit() and int(stale.stem[4:]) >= self.par.world:
                    stale.unlink(missing_ok=True)

    def _load_weights(self, model, path, strict):
        from reelcache.train.weights import load_weights

        try:
            report = load_weights(model, path, strict=strict)
        except (FileNotFoundError, ValueError, KeyError, RuntimeError) as e:
            raise UserError(f"cannot load weights from {path}: {e}") from e
        self.loaded_from = str(path)
        if self.rank0:
            say(f"weights from {path}:\n{report.summary()}")

    def _resume(self, ckpt, reset_data):
        from reelcache.train import checkpoint as ck

        state = ck.read_state(ckpt)
        par, o = self.par, self.cfg.optim
        if (ckpt / "optimizer").exists():  # absent when saved before the first optimizer step
            par.load_optimizer(self.optimizer, self.model, str(ckpt / "optimizer"))
            for group in self.optimizer.param_groups:  # the config's hyper-parameters, not the saved ones
                group.update(weight_decay=o.weight_decay, eps=o.adam_eps, betas=tuple(o.betas))
        try:
            self.loader.load_state_dict(state["loader"], reset_data=reset_data)
        except ValueError as e:
            raise UserError(f"--load {ckpt}: {e}") from e
        self.global_step, self.opt_steps = int(state["global_step"]), int(state["opt_steps"])
        self.guard.load_state_dict(state.get("guard", {}))
        self.wandb_id = state.get("wandb_id")
        self.generation = self.loader.generation
        if self.rank0:
            say(
                f"resumed from {ckpt}: step {self.global_step}, epoch {self.loader.epoch}, position "
                f"{self.loader.consumed}" + (" (data position reset)" if reset_data else "")
            )

    def _total_steps(self) -> int:
        """Optimizer steps of the whole stage: the rest of this epoch plus the remaining epochs.

        One plan per distinct set of mixing weights, not per epoch (a plan costs about a second at
        1.3M clips, and upstream configs say epochs = 1000): for the ETA, epochs with the same
        weights are taken to have the same number of micro-batches."""
        total = self.global_step + self.loader.steps_remaining()
        per_weights: dict[tuple, int] = {}
        for e in range(self.loader.epoch + 1, self.cfg.run.epochs):
            key = tuple(s.weight for s in self.loader.epoch_sources(e))
            if key not in per_weights:
                per_weights[key] = math.ceil(self.loader.plan(e).num_batches / self.par.world)
            total += per_weights[key]
        if self.cfg.run.max_steps:
            total = min(total, self.cfg.run.max_steps)
        return total

    # -- one step --------------------------------------------------------------------------
    def draws(self, batch) -> dict:
        """The step's random draws, one generator per sample: (seed, step, clip id, index)."""
        from reelcache.train.flow import sample_timesteps

        dev = self.par.device
        x = batch["x"]
        b, _, t_lat = x.shape[:3]
        ts, noise, drops, masks = [], [], [], []
        for i, clip in enumerate(batch["clip_id"]):
            s = stable_seed(self.cfg.run.seed, self.global_step, clip, i)
            g = torch.Generator().manual_seed(s)
            ts.append(sample_timesteps(1, g, method=self.cfg.flow.sample_method))
            drops.append(bool(torch.rand(1, generator=g).item() < self.cfg.flow.caption_dropout))
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

    def step(self, batch) -> dict:
        """One optimizer step on this rank's micro-batch (a collective: every rank calls it)."""
        return self.update(self.forward_backward(batch))

    def forward_backward(self, batch) -> dict:
        """Loss and gradients of the step; gradients end up as the mean over all ranks' real samples."""
        from reelcache.train.flow import timestep_transform, training_losses

        cfg, par, dev = self.cfg, self.par, self.par.device
        frames, height, width = bucket_geometry(batch["bucket"])
        x0 = batch["x"].to(dev, non_blocking=True).float()
        b = x0.shape[0]
        weight = float(batch["weight"])
        real = b * weight
        # How many real samples (and real ranks) this step has: known before the forward.
        n_real, r_real = par.sum([real, 1.0 if weight > 0 else 0.0]).tolist()
        d = self.draws(batch)
        fps = torch.nan_to_num(batch["fps"].float(), nan=cfg.data.default_fps)
        fps = torch.floor(fps / self.buckets.frame_interval)
        hw = lambda v: torch.full((b,), float(v))  # noqa: E731
        t = d["t"]
        if cfg.flow.use_timestep_transform:
            t = timestep_transform(t, hw(height), hw(width), hw(frames))
        kwargs = {
            "y": batch["text"].to(dev, non_blocking=True).to(x0.dtype),
            "mask": batch["text_mask"].to(dev, non_blocking=True),
            "fps": fps.to(dev),
            "height": hw(height).to(dev),
            "width": hw(width).to(dev),
            "caption_drop": d["caption_drop"].to(dev),
        }
        x_mask = d["x_mask"].to(dev) if d["x_mask"] is not None else None
        losses = training_losses(self.model, x0, kwargs, d["noise"], t.to(dev), x_mask=x_mask)
        if cfg.run.loss_reduction == "sample":
            loss = losses.sum() * (weight * par.world / max(n_real, 1.0))
        else:
            loss = losses.mean() * (weight * par.world / max(r_real, 1.0))
        par.backward(loss, self.optimizer)
        loss_sum = float(par.sum([float(losses.detach().sum()) * weight])[0])
        return {
            "batch": batch,
            "losses": losses.detach(),
            "loss": loss_sum / max(n_real, 1.0),
            "samples": n_real,
            "local_samples": real,
            "frames": frames,
            "height": height,
            "width": width,
            "latent_shape": tuple(x0.shape[2:]),
            "text_len": int(batch["text"].shape[1]),
        }

    def update(self, out: dict) -> dict:
        """Guard, optimizer step, EMA; gradients cleared either way."""
        cfg, par = self.cfg, self.par
        batch, mean_loss = out.pop("batch"), out["loss"]
        gnorm = float(par.grad_norm(self.model, self.optimizer, cfg.optim.grad_clip))
        reason = self.guard.verdict(mean_loss, gnorm)
        bad = bool(par.max([1.0 if reason else 0.0])[0] > 0)
        if bad and reason is None:
            reason = "another rank found this step bad"
        lr = None
        if bad:
            self._record_bad(batch, mean_loss, gnorm, reason)
        else:
            from reelcache.train.schedule import lr_at

            lr = lr_at(self.opt_steps, cfg.optim)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.opt_steps += 1
            self._update_ema()
        self.optimizer.zero_grad()
        self.guard.record(mean_loss, bad)
        return {**out, "grad_norm": gnorm, "lr": lr, "skipped": reason if bad else None}

    @torch.no_grad()
    def _update_ema(self):
        if self.ema is None:
            return
        masters = self.par.master_chunks(self.model, self.optimizer)
        names = list(self.ema)
        torch._foreach_lerp_([self.ema[n] for n in names], [masters[n] for n in names], 1 - self.cfg.run.ema_decay)

    def _record_bad(self, batch, loss, gnorm, reason):
        clips = self.par.gather_objects(list(batch["clip_id"]) if batch["weight"] else [])
        if self.rank0:
            rec = {
                "step": self.global_step,
                "epoch": self.loader.epoch,
                "loss": loss,
                "grad_norm": gnorm,
                "reason": reason,
                "clip_ids": [c for r in clips for c in r],
            }
            with open(self.run_dir / "bad_steps.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            say(
                f"step {self.global_step}: skipped ({reason}); clips: {', '.join(rec['clip_ids'][:8])}"
                + (" ..." if len(rec["clip_ids"]) > 8 else "")
            )

    # -- checkpoints -----------------------------------------------------------------------
    def save(self) -> None:
        par = self.par
        masters = par.gather_full(par.master_chunks(self.model, self.optimizer), self.shapes)
        ema = par.gather_full(self.ema, self.shapes) if self.ema is not None else None
        model_state = {**self.frozen, **masters} if self.rank0 else None
        # The epoch and the data fingerprint are the loader's (its state says the next epoch at a boundary);
        # the learning rate follows from opt_steps and config.json's optim section.
        state = {
            "global_step": self.global_step,
            "opt_steps": self.opt_steps,
            "loader": self.loader.state_dict(),
            "guard": self.guard.state_dict(),
            "wandb_id": self.log.run_id if self.rank0 else None,
            "run": self.cfg.run.name,
            "world_size": par.world,
            "model_preset": self.cfg.model.preset,
            "init_from": self.loaded_from,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "versions": _versions(),
        }
        if self.rank0:
            self.log.flush()  # metrics up to this step exist before the checkpoint does
        if self.loader.log:
            self.loader.log.flush()
        optim = par.optimizer_state(self.optimizer, self.model) if self.opt_steps else None
        path = self.ckpt.save(self.global_step, model_state, ema, optim, state, self.cfg.to_dict())
        if self.rank0:
            say(f"checkpoint {path.name} (writing in the background)")

    # -- the loop --------------------------------------------------------------------------
    def train(self) -> None:
        from reelcache.train.guard import DivergedError
        from reelcache.train.model import flops_per_sample
        from reelcache.train.watchdog import Watchdog

        cfg, par = self.cfg, self.par
        self.model.train()
        last_saved = self.global_step if self.ckpt_path is not None else -1
        dog = Watchdog(
            self.run_dir,
            par.rank,
            cfg.run.watchdog_factor,
            cfg.run.watchdog_floor_s,
            cfg.run.watchdog_limit_s,
            alert=lambda m: say(f"WATCHDOG rank {par.rank}: {m}"),
        )
        try:
            while self.loader.epoch < cfg.run.epochs and not self._done():
                sched, k = self.loader.schedule(), 0
                dog.begin(self.global_step, **self._upcoming(sched, k))
                t_data = time.monotonic()
                for batch in self.loader:
                    dog.working_on(waiting_for_data=False, bucket=batch["bucket"], clip_ids=list(batch["clip_id"]))
                    t_step = time.monotonic()
                    out = self.step(batch)
                    if par.device.type == "cuda":
                        torch.cuda.synchronize()
                    t_end = time.monotonic()
                    self.global_step += 1
                    dog.end()
                    if out["skipped"] and self.guard.exhausted:
                        raise DivergedError(self._diverged_message())
                    if self.global_step % cfg.run.log_every == 0 or out["skipped"]:
                        self._log(batch, out, t_end - t_data, t_step - t_data, flops_per_sample)
                    if cfg.run.ckpt_every and self.global_step % cfg.run.ckpt_every == 0:
                        self.save()
                        last_saved = self.global_step
                    if self._done():
                        break
                    k += 1
                    dog.begin(self.global_step, **self._upcoming(sched, k))
                    t_data = time.monotonic()
                dog.end()
            if last_saved != self.global_step:
                self.save()
            self.ckpt.wait()
        finally:
            dog.close()
            self.log.finish()
            if self.loader.log:
                self.loader.log.flush()
            self.par.close()

    def _upcoming(self, sched, k: int) -> dict:
        """What step k of this epoch's schedule will train on (for the watchdog's report)."""
        info = {"epoch": self.loader.epoch, "waiting_for_data": True}
        if k < len(sched):
            _, index, pad = sched[k]
            plan = self.loader.plan()
            info.update(
                bucket=plan.buckets[plan.bucket[index]],
                padding=pad,
                clip_ids=[str(c) for c in self.loader.clip_id[plan.batch(index)]],
            )
        return info

    def _done(self) -> bool:
        return bool(self.cfg.run.max_steps) and self.global_step >= self.cfg.run.max_steps

    def _log(self, batch, out, step_s, wait_s, flops_per_sample):
        par = self.par
        # Ranks hold different buckets: tokens and FLOPs are summed over every rank's own shapes.
        local = out["local_samples"]
        ranks = par.gather_objects((batch["bucket"], local, out["latent_shape"], out["text_len"]))
        tokens = flops = 0.0
        hist = {}
        for bucket, n, (t, h, w), length in ranks:
            hist[bucket] = hist.get(bucket, 0) + 1
            tokens += n * t * math.ceil(h / 2) * math.ceil(w / 2)
            flops += 3 * flops_per_sample(self.model_cfg, t, h, w, length) * n
        with torch.no_grad():
            params = [p.detach() for p in self.module.parameters()]
            wnorm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(params))))
        self.log.log(
            {
                "step": self.global_step - 1,
                "epoch": self.loader.epoch,
                "epoch_step": int(batch["step"]),
                "loss": out["loss"],
                "lr": out["lr"] if out["lr"] is not None else float("nan"),
                "grad_norm": out["grad_norm"],
                "weight_norm": wnorm,
                "samples": out["samples"],
                "samples_per_s": out["samples"] / step_s,
                "tokens_per_s": tokens / step_s,
                "step_s": step_s,
                "data_wait_s": wait_s,
                "data_share": wait_s / step_s,
                "mfu": flops / step_s / (self.peak * par.world) if self.peak else None,
                "buckets": json.dumps(hist, sort_keys=True),
                "skipped": out["skipped"],
            }
        )

    def _diverged_message(self) -> str:
        from reelcache.train import checkpoint as ck

        found = ck.list_checkpoints(self.run_dir)
        last = found[-1] if found else None
        cmd = (
            f"reelcache train <config> --root {self.root} --load {last}"
            if last
            else "no checkpoint yet: start again with another seed or a lower lr"
        )
        return (
            f"stopping: {self.guard.bad} consecutive bad steps (non-finite or spiking loss/gradient) up to step "
            f"{self.global_step}; see {self.run_dir / 'bad_steps.jsonl'} for the clips. Last good checkpoint: "
            f"{last or 'none'}. Resume with: {cmd} (consider a lower optim.lr, or --reset-data)"
        )


def proc_start(pid: int) -> int | None:
    """The kernel's start time of a process (clock ticks after boot; /proc/<pid>/stat field 22), as
    the unit leases read it; an int, as `reelcache cluster` compares it."""
    from reelcache.catalog.lease import pid_start

    ticks = pid_start(pid)
    return int(ticks) if ticks else None


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for m in ("torch", "colossalai", "reelcache"):
        try:
            out[m] = version(m)
        except PackageNotFoundError:
            pass
    return out
