"""The trainer's typed configuration: defaults, then a stage file, then ``--key.sub=value`` overrides.

    cfg = load_config("configs/train/opensora12/stage1.toml", ["optim.lr=2e-4", "run.name=try2"])

A stage file (``configs/train/**.toml``) has one table per dataclass below. Unknown keys are
errors (a typo must not silently train with a default). Every field is documented where it is
declared; ``validate`` checks the whole. The resolved config is written into the run directory
as ``config.json`` and is what a resumed run compares against.

Overrides take TOML literals (``optim.lr=2e-4``, ``data.manifests=[{name="a", weight=0.5}]``,
``run.name="x"``); a value that does not parse as TOML is taken as a string (``run.name=x``).
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from reelcache import UserError


@dataclass
class ModelConfig:
    preset: str = "STDiT3-XL/2"        # train/model.py PRESETS: STDiT3-XL/2, STDiT3-3B/2, tiny
    overrides: dict = field(default_factory=dict)   # STDiT3Config fields over the preset (caption_channels, ...)
    freeze_y_embedder: bool = True     # Open-Sora 1.2 stages freeze the caption projection
    grad_checkpoint: bool = True       # recompute each block in backward (56 blocks at XL/2)
    dtype: str = "bf16"                # zero2's working dtype: bf16 (fp32 masters) | fp32; ddp always trains fp32


@dataclass
class Manifest:
    name: str                          # catalog manifest name (ROOT/manifests) or a path; made with --cache
    weight: float | list = 1.0         # mixing weight, or one per epoch (a ramp; the last value holds)


@dataclass
class DataConfig:
    manifests: list = field(default_factory=list)   # [{name, weight}] mixed per epoch by weight
    buckets: str = ""                  # bucket config TOML: batch size per (resolution, frames)
    workers: int = 4                   # DataLoader processes per rank
    prefetch: int = 2                  # batches in flight per worker
    block: int = 64                    # block-shuffle size (samples read close together on disk)
    default_fps: float = 24.0          # fps for clips whose manifest carries none


@dataclass
class OptimConfig:
    lr: float = 1.6e-4                 # base lr; with schedule=1cycle, the final lr
    weight_decay: float = 0.01         # AdamW, one param group (biases and norms included, as Open-Sora)
    adam_eps: float = 1e-15
    betas: tuple = (0.9, 0.999)
    grad_clip: float = 1.0             # global L2 norm; 0 = off
    schedule: str = "warmup"           # constant | warmup (Open-Sora's LinearWarmupLR) | 1cycle (the "bump")
    warmup_steps: int = 0              # warmup: lr = (k+1)/(W+1)*lr for k < W. 1cycle: the rising phase
    min_lr: float = 0.0                # 1cycle: start
    max_lr: float = 0.0                # 1cycle: peak after warmup_steps
    cooldown_steps: int = 0            # 1cycle: cosine from max_lr down to lr


@dataclass
class FlowConfig:
    sample_method: str = "logit-normal"    # timestep draw: logit-normal | uniform
    use_timestep_transform: bool = True    # Open-Sora 1.2's resolution/length shift
    caption_dropout: float = 0.1           # per-sample probability of the null caption (classifier-free guidance)
    mask_ratios: dict = field(default_factory=dict)   # MaskGenerator ratios (train/flow.py); {} = no frame masks


@dataclass
class RunConfig:
    name: str = ""                     # run directory ROOT/runs/<name>; default: the config file's stem
    seed: int = 42                     # data order, noise, timesteps, masks: all derived from it
    epochs: int = 1
    max_steps: int = 0                 # stop after this many optimizer steps in total (0 = all epochs)
    ema_decay: float = 0.99            # fp32 EMA of the master weights; 0 = no EMA
    loss_reduction: str = "sample"     # sample: mean over all ranks' real samples | rank: mean of rank means (Open-Sora)
    plugin: str = "auto"               # auto (zero2 on CUDA, ddp on CPU) | zero2 (on CPU: train/zero_cpu.py) | ddp
    ckpt_every: int = 100              # steps between checkpoints (0 = only at the end)
    keep_last: int = 3                 # newest checkpoints kept ...
    keep_every: int = 0                # ... plus every checkpoint whose step is a multiple of this (0 = none)
    log_every: int = 1                 # steps between metric rows (console, wandb, metrics parquet)
    wandb_project: str = "reelcache"
    wandb_mode: str = "offline"        # offline | online | disabled
    spike_z: float = 6.0               # a loss this many std above the running window is a spike (0 = off)
    spike_window: int = 100            # steps in the running loss window (spike detection starts when full)
    max_bad_steps: int = 5             # consecutive skipped steps before the run stops with a message
    compile: bool = False              # torch.compile the blocks (GPU)
    watchdog_factor: float = 10.0      # a step slower than this x the median step time is a hang ...
    watchdog_floor_s: float = 600.0    # ... and slower than this many seconds: every rank dumps its stacks
    watchdog_limit_s: float = 0.0      # a step this long ends the run with a message (0 = wait for NCCL)


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def validate(self) -> "TrainConfig":
        o, r, d = self.optim, self.run, self.data
        if not d.manifests:
            raise UserError("data.manifests is empty: name at least one loader manifest (catalog manifest --cache)")
        if not d.buckets:
            raise UserError("data.buckets: give the bucket config TOML the stage trains with")
        if o.schedule not in ("constant", "warmup", "1cycle"):
            raise UserError(f"optim.schedule {o.schedule!r}: constant, warmup or 1cycle")
        if o.schedule == "1cycle" and not (o.max_lr > 0 and o.warmup_steps > 0 and o.cooldown_steps > 0):
            raise UserError("optim.schedule = 1cycle needs max_lr, warmup_steps and cooldown_steps")
        if r.loss_reduction not in ("sample", "rank"):
            raise UserError(f"run.loss_reduction {r.loss_reduction!r}: sample or rank")
        if r.plugin not in ("auto", "zero2", "ddp"):
            raise UserError(f"run.plugin {r.plugin!r}: auto, zero2 or ddp")
        if r.wandb_mode not in ("offline", "online", "disabled"):
            raise UserError(f"run.wandb_mode {r.wandb_mode!r}: offline, online or disabled")
        if self.flow.sample_method not in ("logit-normal", "uniform"):
            raise UserError(f"flow.sample_method {self.flow.sample_method!r}: logit-normal or uniform")
        if not 0 <= r.ema_decay < 1:
            raise UserError("run.ema_decay must be in [0, 1)")
        if self.model.dtype not in ("bf16", "fp32"):
            raise UserError(f"model.dtype {self.model.dtype!r}: bf16 or fp32")
        schedules = []
        for m in d.manifests:
            ws = m.weight if isinstance(m.weight, list) else [m.weight]
            if not ws or any(not isinstance(w, (int, float)) or w < 0 for w in ws):
                raise UserError(f"data.manifests {m.name!r}: weight must be a number >= 0 or a list of them")
            schedules.append(ws)
        for epoch in range(max(len(ws) for ws in schedules)):
            if sum(ws[min(epoch, len(ws) - 1)] for ws in schedules) <= 0:
                raise UserError(f"data.manifests: every mixing weight is 0 in epoch {epoch}: nothing to train on")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def model_config(self):
        """The STDiT3Config this stage trains: the preset, its overrides, the frozen caption projection."""
        from reelcache.train.model import STDiT3Config

        return STDiT3Config.preset(self.model.preset, **{**self.model.overrides,
                                                         "freeze_y_embedder": self.model.freeze_y_embedder})

    def frame_interval(self) -> int:
        """The bucket config's frame interval (what the model's fps input is divided by)."""
        from reelcache.catalog.buckets import BucketConfig

        return BucketConfig.from_toml(self.data.buckets).frame_interval


def _build(cls, doc: dict, where: str):
    known = {f.name: f for f in dataclasses.fields(cls)}
    if unknown := set(doc) - set(known):
        raise UserError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    kw = {}
    for k, v in doc.items():
        sub = _SECTIONS.get(known[k].type) if cls is TrainConfig else None
        if sub is not None:
            kw[k] = _build(sub, v, f"{where}.{k}")
        elif cls is DataConfig and k == "manifests":
            kw[k] = [_build(Manifest, m if isinstance(m, dict) else {"name": m}, f"{where}.manifests") for m in v]
        elif cls is OptimConfig and k == "betas":
            kw[k] = tuple(v)
        else:
            kw[k] = v
    try:
        return cls(**kw)
    except TypeError as e:
        raise UserError(f"{where}: {e}") from e


_SECTIONS = {"ModelConfig": ModelConfig, "DataConfig": DataConfig, "OptimConfig": OptimConfig,
             "FlowConfig": FlowConfig, "RunConfig": RunConfig}


def _parse_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set(doc: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        doc = doc.setdefault(k, {})
        if not isinstance(doc, dict):
            raise UserError(f"override {dotted!r}: {k} is not a table")
    doc[keys[-1]] = value


def load_config(path, overrides: list[str] = ()) -> TrainConfig:
    """Stage file + ``key.sub=value`` overrides -> a validated TrainConfig."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"no config file {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: {e}") from e
    for o in overrides:
        key, sep, value = o.partition("=")
        if not sep:
            raise UserError(f"override {o!r}: write key.sub=value, e.g. optim.lr=2e-4")
        _set(doc, key.strip().removeprefix("--"), _parse_value(value.strip()))
    cfg = _build(TrainConfig, doc, path.name)
    if not cfg.run.name:
        cfg.run.name = path.stem
    from reelcache.catalog.buckets import BucketConfig

    cfg.data.buckets = BucketConfig.path_from(path, cfg.data.buckets)
    return cfg.validate()


def from_dict(doc: dict) -> TrainConfig:
    """The inverse of ``to_dict`` (a run directory's config.json)."""
    return _build(TrainConfig, json.loads(json.dumps(doc)), "config.json").validate()
