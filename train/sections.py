"""The trainer's config sections, each with the one ``build(**runtime)`` that makes its component.

Every component gets its settings one way: its section, and as keyword arguments only what is
known at run time (the ``Parallel``, the model, the run directory, ...):

    par = cfg.parallel.build()
    loader = cfg.data.build(root=root, par=par, seed=cfg.run.seed)
    model = cfg.model.build(seed=cfg.run.seed)

``[run]`` holds what is the run's (name, seed, epochs, max_steps); the checkpointer, the log, the
guard and the watchdog have their sections in their own modules (train/checkpoint.py, runlog.py,
guard.py, watchdog.py), which are as light as this one. ``train/config.py`` composes them into
``TrainConfig`` and reads files, overrides and old ``config.json`` versions.
"""

from __future__ import annotations

from dataclasses import dataclass

from reelcache import UserError
from reelcache.settings import NAME, TEXT, Pattern, setting

# what other stages may use (train/__init__.py: PUBLIC)
__all__ = [
    "MODEL_PRESETS",
    "ConditioningConfig",
    "DataConfig",
    "EMAConfig",
    "FlowConfig",
    "Manifest",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RunConfig",
    "StepConfig",
]

# Importing this module loads no torch, pyarrow or wandb (train/config.py imports it, and reading a
# config stays light): each build() imports the module of what it builds (torch, the loader).

# train/model.py PRESETS (named here so that reading a config imports no torch; a test compares them)
MODEL_PRESETS = ("STDiT3-XL/2", "STDiT3-3B/2", "tiny")


@dataclass
class ModelConfig:
    """[model]: which STDiT3, and how its weights train and run."""

    preset: str = setting("STDiT3-XL/2", "train/model.py PRESETS", choices=MODEL_PRESETS)
    overrides: dict = setting(doc="STDiT3Config fields over the preset (caption_channels, ...)", factory=dict)
    freeze_y_embedder: bool = setting(True, "Open-Sora 1.2 stages freeze the caption projection")
    grad_checkpoint: bool = setting(True, "recompute each block in backward (56 blocks at XL/2)")
    compile: bool = setting(False, "torch.compile the blocks (GPU)")

    def stdit3(self):
        """The STDiT3Config this stage trains: the preset, its overrides, the frozen caption projection."""
        from reelcache.train.model import STDiT3Config

        return STDiT3Config.preset(self.preset, **{**self.overrides, "freeze_y_embedder": self.freeze_y_embedder})

    def build(self, *, seed: int):
        """A fresh STDiT3, the same on every rank (initialised from ``seed``)."""
        import torch

        from reelcache.train.model import STDiT3

        torch.manual_seed(seed)
        model = STDiT3(self.stdit3())
        if self.grad_checkpoint:
            model.set_grad_checkpointing(True)
        return model


SHARD_ROOT = Pattern(
    r"(?!s3:).*|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?",
    "a folder, or s3://bucket/prefix (bucket: 3-63 lower-case letters, digits, '.' and '-')",
)


@dataclass
class Manifest:
    name: str = setting(doc="catalog manifest name (ROOT/manifests) or a path; made with --cache", pattern=TEXT)
    weight: float | list[float] = setting(1.0, "mixing weight, or one per epoch (a ramp; the last value holds)", ge=0)


@dataclass
class DataConfig:
    """[data]: the manifests, buckets and loader."""

    manifests: list[Manifest] = setting(doc="[{name, weight}] mixed per epoch by weight", factory=list)
    buckets: str = setting("", "bucket config TOML: batch size per (resolution, frames)")
    workers: int = setting(4, "DataLoader processes per rank (0: read in the training process)", ge=0)
    prefetch: int = setting(2, "batches in flight per worker", ge=1)
    block: int = setting(64, "block-shuffle size (samples read close together on disk)", ge=1)
    shard_root: str = setting(
        "",
        "where the manifests' relative shard paths are: a folder or s3://bucket/prefix (default: the run's root)",
        pattern=SHARD_ROOT,
    )
    fetch_ahead: int = setting(64, "shards in S3: samples read ahead of the step, per data process", ge=1, le=100000)
    fetch_threads: int = setting(8, "shards in S3: threads reading them ahead, per data process", ge=1, le=256)
    cache_dir: str = setting("", "shards in S3: a local folder keeping the members read (empty: none)")
    cache_gb: float = setting(100.0, "shards in S3: the most GB cache_dir holds (least recently used evicted)", gt=0)
    skip_withdrawn: bool = setting(
        False, "leave out clips a takedown withdrew (else a manifest holding one refuses to start); resume stays exact"
    )

    def bucket_config(self):
        from reelcache.base.buckets import BucketConfig

        return BucketConfig.from_toml(self.buckets)

    def build(self, *, root, par, seed: int, shard_root=None):
        """This rank's LatentLoader (its consumed log is opened by the trainer, once nothing can refuse
        the start); ``shard_root``: where shards are when ``data.shard_root`` is not set (a run in S3: its root;
        else ``root``)."""
        from reelcache.catalog.withdrawn import withdrawn_clips
        from reelcache.train.loader import LatentLoader

        manifests = [(m.name, m.weight) for m in self.manifests]
        gone = withdrawn_clips(root) if root else {}
        # withdrawn clips' shards are not checked (a `cache gc` after the takedown may have freed them): the
        # refusal below, or the skip, is what a start over them meets
        kw = dict(root=root, rank=par.rank, world_size=par.world, seed=seed, skip=gone.keys())
        kw.update(
            shard_root=self.shard_root or (str(shard_root) if shard_root else None),
            fetch_ahead=self.fetch_ahead,
            fetch_threads=self.fetch_threads,
        )
        kw.update(cache_dir=self.cache_dir or None, cache_gb=self.cache_gb)
        try:
            loader = LatentLoader(
                manifests, self.bucket_config(), **kw, workers=self.workers, prefetch=self.prefetch, block=self.block
            )
        except ValueError as e:
            raise UserError(str(e)) from e
        loader.skip = self.withdrawn(loader, gone)
        return loader

    def withdrawn(self, loader, gone: dict) -> frozenset:
        """The clips of the loader's manifests a takedown withdrew (`gone`: catalog/withdrawn.py): with
        skip_withdrawn, the ones to skip; without it, a start (new or resumed) over any is refused in one line."""
        hits = sorted(set(loader.clip_id.tolist()) & gone.keys()) if gone else []
        if hits and not self.skip_withdrawn:
            takedowns = sorted({gone[c] for c in hits})
            names = ", ".join(m.name for m in self.manifests)
            raise UserError(
                f"manifest(s) {names} hold {len(hits)} clip(s) withdrawn by takedown {', '.join(takedowns)} "
                f"(e.g. {hits[0]}; see ROOT/withdrawn/{takedowns[0]}.json): refusing to train on them. Pass "
                "--data.skip_withdrawn=true to leave them out (the order of the rest and resume stay exact)"
            )
        return frozenset(hits)


@dataclass
class ConditioningConfig:
    """[conditioning]: the model's fps input; with the bucket file's frame interval, one
    ``Conditioning`` (train/flow.py) that training, the validation loss and the sampler share."""

    default_fps: float = setting(24.0, "fps for clips whose manifest carries none", gt=0)
    image_fps: float = setting(
        0.0,
        "the fps input of image buckets (T = 1); 0 = as a video's (manifest, else default_fps); Open-Sora: 120",
        ge=0,
    )

    def build(self, *, frame_interval: int):
        from reelcache.train.flow import Conditioning

        return Conditioning(self, frame_interval=frame_interval)


@dataclass
class OptimConfig:
    """[optim]: AdamW and its lr schedule (train/schedule.py)."""

    lr: float = setting(1.6e-4, "base lr; with schedule=1cycle, the final lr (0: weights stay as loaded)", ge=0)
    weight_decay: float = setting(0.01, "AdamW, one param group (biases and norms included, as Open-Sora)", ge=0)
    adam_eps: float = setting(1e-15, "AdamW's epsilon", gt=0)
    betas: tuple[float, float] = setting((0.9, 0.999), "AdamW's moment decays", ge=0, lt=1)
    schedule: str = setting(
        "warmup",
        'constant | warmup (Open-Sora\'s LinearWarmupLR) | 1cycle (the "bump")',
        choices=("constant", "warmup", "1cycle"),
    )
    warmup_steps: int = setting(0, "warmup: lr = (k+1)/(W+1)*lr for k < W. 1cycle: the rising phase", ge=0)
    min_lr: float = setting(0.0, "1cycle: start", ge=0)
    max_lr: float = setting(0.0, "1cycle: peak after warmup_steps", ge=0)
    cooldown_steps: int = setting(0, "1cycle: cosine from max_lr down to lr", ge=0)

    def hyper(self) -> dict:
        """AdamW's hyper-parameters but the lr (which the schedule sets every step)."""
        return dict(weight_decay=self.weight_decay, eps=self.adam_eps, betas=tuple(self.betas))

    def build(self, *, par, params):
        """The optimizer of this plugin (HybridAdam under ZeRO, torch's AdamW under DDP)."""
        return par.optimizer(self, params=params)


@dataclass
class FlowConfig:
    """[flow]: rectified flow's timesteps, caption dropout and frame masks (read by the step)."""

    sample_method: str = setting("logit-normal", "timestep draw", choices=("logit-normal", "uniform"))
    use_timestep_transform: bool = setting(True, "Open-Sora 1.2's resolution/length shift")
    caption_dropout: float = setting(
        0.1,
        "per-sample probability of the null caption (classifier-free guidance); below 1: at 1 the text never "
        "reaches the model",
        ge=0,
        lt=1,
    )
    mask_ratios: dict[str, float] = setting(
        doc="MaskGenerator ratios (train/flow.py); {} = no frame masks", factory=dict, ge=0, le=1
    )


@dataclass
class ParallelConfig:
    """[parallel]: the plugin, its working dtype and its gradient clipping (train/parallel.py)."""

    plugin: str = setting(
        "auto",
        "auto (zero2 on CUDA, ddp on CPU) | zero2 (on CPU: train/zero_cpu.py) | ddp",
        choices=("auto", "zero2", "ddp"),
    )
    dtype: str = setting(
        "bf16", "zero2's working dtype: bf16 (fp32 masters) | fp32; ddp always trains fp32", choices=("bf16", "fp32")
    )
    grad_clip: float = setting(1.0, "global L2 norm; 0 = off", ge=0)

    def build(self):
        """Join the process group torchrun / ``colossalai run`` describe (or a 1-process one)."""
        from reelcache.train.parallel import Parallel

        return Parallel.setup(self)


@dataclass
class EMAConfig:
    """[ema]: the fp32 EMA of the master weights, sharded as ZeRO shards them (train/step.py)."""

    decay: float = setting(0.99, "ema = decay x ema + (1 - decay) x master after each step; 0 = no EMA", ge=0, lt=1)

    def build(self, *, chunks):
        """The EMA of this rank's master chunks, starting from ``chunks()`` (a checkpoint's EMA, or the
        weights themselves; called only with an EMA); None when decay = 0."""
        from reelcache.train.step import EMA

        return EMA(self, chunks=chunks()) if self.decay > 0 else None


@dataclass
class StepConfig:
    """[step]: how one optimizer step averages its loss over the ranks (train/step.py)."""

    loss_reduction: str = setting(
        "sample",
        "sample: mean over all ranks' real samples | rank: mean of rank means (Open-Sora)",
        choices=("sample", "rank"),
    )

    def build(self, **runtime):
        """``Step(self, par=, model=, optimizer=, guard=, ema=, cond=, flow=, optim=, seed=)``."""
        from reelcache.train.step import Step

        return Step(self, **runtime)


@dataclass
class RunConfig:
    """[run]: what is the run's: its directory, seed and length."""

    name: str = setting(
        "",
        "run directory ROOT/runs/<name>; default: the config file's stem",
        pattern=Pattern(f"({NAME.regex})?", f"{NAME.text} (empty: the file's stem)"),
    )
    seed: int = setting(42, "data order, noise, timesteps, masks: all derived from it", ge=0)
    epochs: int = setting(1, "passes over the manifests", ge=1)
    max_steps: int = setting(0, "stop after this many optimizer steps in total (0 = all epochs)", ge=0)
