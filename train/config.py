"""The trainer's typed configuration: defaults, then a stage file, then ``--key.sub=value`` overrides.

    cfg = load_config("configs/train/opensora12/stage1.toml", ["optim.lr=2e-4", "run.name=try2"])

A stage file (``configs/train/**.toml``) has one table per dataclass below. Unknown keys are
errors (a typo must not silently train with a default). Every field declares its type, range and
meaning where it is declared (``reelcache.settings.setting``), and each value is checked as the
file and the overrides are read, so a bad value is one line before any process group, model or
file exists; ``validate`` then checks the rules that relate fields, the model overrides and the
bucket file. The resolved config is written into the run directory as ``config.json`` and is
what a resumed run compares against.

Overrides take TOML literals (``optim.lr=2e-4``, ``data.manifests=[{name="a", weight=0.5}]``,
``run.name="x"``); a value that does not parse as TOML is taken as a string (``run.name=x``).
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from reelcache import UserError
from reelcache.catalog.buckets import BucketConfig
from reelcache.settings import NAME, TEXT, Pattern, build, check, load_toml, read, setting
from reelcache.train.checkpoint import CheckpointConfig
from reelcache.train.guard import GuardConfig
from reelcache.train.runlog import LogConfig
from reelcache.train.watchdog import WatchdogConfig

# train.flow and train.model (torch) are imported by the checks that build them: importing this module
# loads no torch, pyarrow or wandb (nor do checkpoint, guard, runlog and watchdog, which it imports).
# Reading a config does: validate() checks model.overrides and flow.mask_ratios by building them.

# config.json's format. 1: one [run] table held the checkpoint, log, guard and watchdog settings
# (MOVED says where each went); 2: they are sections of their own.
VERSION = 2
MOVED = {
    "run.ckpt_every": "checkpoint.every",
    "run.keep_last": "checkpoint.keep_last",
    "run.keep_every": "checkpoint.keep_every",
    "run.log_every": "log.every",
    "run.wandb_project": "log.wandb_project",
    "run.wandb_mode": "log.wandb_mode",
    "run.spike_z": "guard.spike_z",
    "run.spike_window": "guard.window",
    "run.max_bad_steps": "guard.max_bad_steps",
    "run.watchdog_factor": "watchdog.factor",
    "run.watchdog_floor_s": "watchdog.floor_s",
    "run.watchdog_limit_s": "watchdog.limit_s",
}

# train/model.py PRESETS (named here so that reading a config imports no torch; a test compares them)
MODEL_PRESETS = ("STDiT3-XL/2", "STDiT3-3B/2", "tiny")


@dataclass
class ModelConfig:
    preset: str = setting("STDiT3-XL/2", "train/model.py PRESETS", choices=MODEL_PRESETS)
    overrides: dict = setting(doc="STDiT3Config fields over the preset (caption_channels, ...)", factory=dict)
    freeze_y_embedder: bool = setting(True, "Open-Sora 1.2 stages freeze the caption projection")
    grad_checkpoint: bool = setting(True, "recompute each block in backward (56 blocks at XL/2)")
    dtype: str = setting(
        "bf16", "zero2's working dtype: bf16 (fp32 masters) | fp32; ddp always trains fp32", choices=("bf16", "fp32")
    )


@dataclass
class Manifest:
    name: str = setting(doc="catalog manifest name (ROOT/manifests) or a path; made with --cache", pattern=TEXT)
    weight: float | list[float] = setting(1.0, "mixing weight, or one per epoch (a ramp; the last value holds)", ge=0)


@dataclass
class DataConfig:
    manifests: list[Manifest] = setting(doc="[{name, weight}] mixed per epoch by weight", factory=list)
    buckets: str = setting("", "bucket config TOML: batch size per (resolution, frames)")
    workers: int = setting(4, "DataLoader processes per rank (0: read in the training process)", ge=0)
    prefetch: int = setting(2, "batches in flight per worker", ge=1)
    block: int = setting(64, "block-shuffle size (samples read close together on disk)", ge=1)
    default_fps: float = setting(24.0, "fps for clips whose manifest carries none", gt=0)
    image_fps: float = setting(
        0.0,
        "the fps input of image buckets (T = 1); 0 = as a video's (manifest, else default_fps); Open-Sora: 120",
        ge=0,
    )


@dataclass
class OptimConfig:
    lr: float = setting(1.6e-4, "base lr; with schedule=1cycle, the final lr (0: weights stay as loaded)", ge=0)
    weight_decay: float = setting(0.01, "AdamW, one param group (biases and norms included, as Open-Sora)", ge=0)
    adam_eps: float = setting(1e-15, "AdamW's epsilon", gt=0)
    betas: tuple[float, float] = setting((0.9, 0.999), "AdamW's moment decays", ge=0, lt=1)
    grad_clip: float = setting(1.0, "global L2 norm; 0 = off", ge=0)
    schedule: str = setting(
        "warmup",
        'constant | warmup (Open-Sora\'s LinearWarmupLR) | 1cycle (the "bump")',
        choices=("constant", "warmup", "1cycle"),
    )
    warmup_steps: int = setting(0, "warmup: lr = (k+1)/(W+1)*lr for k < W. 1cycle: the rising phase", ge=0)
    min_lr: float = setting(0.0, "1cycle: start", ge=0)
    max_lr: float = setting(0.0, "1cycle: peak after warmup_steps", ge=0)
    cooldown_steps: int = setting(0, "1cycle: cosine from max_lr down to lr", ge=0)


@dataclass
class FlowConfig:
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
class RunConfig:
    name: str = setting(
        "",
        "run directory ROOT/runs/<name>; default: the config file's stem",
        pattern=Pattern(f"({NAME.regex})?", f"{NAME.text} (empty: the file's stem)"),
    )
    seed: int = setting(42, "data order, noise, timesteps, masks: all derived from it", ge=0)
    epochs: int = setting(1, "passes over the manifests", ge=1)
    max_steps: int = setting(0, "stop after this many optimizer steps in total (0 = all epochs)", ge=0)
    ema_decay: float = setting(0.99, "fp32 EMA of the master weights; 0 = no EMA", ge=0, lt=1)
    loss_reduction: str = setting(
        "sample",
        "sample: mean over all ranks' real samples | rank: mean of rank means (Open-Sora)",
        choices=("sample", "rank"),
    )
    plugin: str = setting(
        "auto",
        "auto (zero2 on CUDA, ddp on CPU) | zero2 (on CPU: train/zero_cpu.py) | ddp",
        choices=("auto", "zero2", "ddp"),
    )
    compile: bool = setting(False, "torch.compile the blocks (GPU)")


@dataclass
class TrainConfig:
    model: ModelConfig = setting(doc="[model]: which STDiT3 and how its weights train", factory=ModelConfig)
    data: DataConfig = setting(doc="[data]: the manifests, buckets and loader", factory=DataConfig)
    optim: OptimConfig = setting(doc="[optim]: AdamW and the lr schedule", factory=OptimConfig)
    flow: FlowConfig = setting(
        doc="[flow]: rectified flow's timesteps, caption dropout, frame masks", factory=FlowConfig
    )
    run: RunConfig = setting(doc="[run]: the run directory, its length, seed, EMA and parallelism", factory=RunConfig)
    checkpoint: CheckpointConfig = setting(doc="[checkpoint]: train/checkpoint.py", factory=CheckpointConfig)
    log: LogConfig = setting(doc="[log]: train/runlog.py", factory=LogConfig)
    guard: GuardConfig = setting(doc="[guard]: train/guard.py", factory=GuardConfig)
    watchdog: WatchdogConfig = setting(doc="[watchdog]: train/watchdog.py", factory=WatchdogConfig)

    def validate(self) -> TrainConfig:
        """Every field against its own rule (settings.check), then the rules that relate fields."""
        check(self)
        o, d = self.optim, self.data
        if not d.manifests:
            raise UserError("data.manifests is empty: name at least one loader manifest (catalog manifest --cache)")
        if not d.buckets:
            raise UserError("data.buckets: give the bucket config TOML the stage trains with")
        if o.schedule == "1cycle" and not (o.max_lr > 0 and o.warmup_steps > 0 and o.cooldown_steps > 0):
            raise UserError("optim.schedule = 1cycle needs max_lr, warmup_steps and cooldown_steps")
        schedules = []
        for m in d.manifests:
            ws = m.weight if isinstance(m.weight, list) else [m.weight]
            if not ws:
                raise UserError(f"data.manifests {m.name!r}: weight must be a number >= 0 or a list of them")
            schedules.append(ws)
        for epoch in range(max(len(ws) for ws in schedules)):
            if sum(ws[min(epoch, len(ws) - 1)] for ws in schedules) <= 0:
                raise UserError(f"data.manifests: every mixing weight is 0 in epoch {epoch}: nothing to train on")
        self._check_model_and_masks()
        return self

    def _check_model_and_masks(self) -> None:
        """model.overrides are STDiT3Config fields of their types that make a valid model with the
        preset; flow.mask_ratios name known masks and sum to at most 1 (imports torch)."""
        from reelcache.train.flow import MaskGenerator
        from reelcache.train.model import STDiT3Config

        read(STDiT3Config, self.model.overrides, "model.overrides")
        try:
            self.model_config()
        except ValueError as e:
            raise UserError(f"model.overrides = {self.model.overrides!r}: {e}") from None
        try:
            MaskGenerator(self.flow.mask_ratios)
        except ValueError as e:
            raise UserError(f"flow.mask_ratios: {e}") from None

    def to_dict(self) -> dict:
        """config.json: every section, and the format's version (``from_dict`` reads older ones)."""
        return {"version": VERSION, **dataclasses.asdict(self)}

    def model_config(self):
        """The STDiT3Config this stage trains: the preset, its overrides, the frozen caption projection."""
        from reelcache.train.model import STDiT3Config

        return STDiT3Config.preset(
            self.model.preset, **{**self.model.overrides, "freeze_y_embedder": self.model.freeze_y_embedder}
        )

    def frame_interval(self) -> int:
        """The bucket config's frame interval (what the model's fps input is divided by)."""
        return BucketConfig.from_toml(self.data.buckets).frame_interval


def _build(doc: dict) -> TrainConfig:
    """A whole config table -> TrainConfig, every value checked (a manifest may be given by name alone)."""
    for old, new in MOVED.items():
        section, key = old.split(".")
        if isinstance(doc.get(section), dict) and key in doc[section]:
            raise UserError(f"{old} is now {new} (the [{new.split('.')[0]}] section): rename it")
    data = doc.get("data")
    if isinstance(data, dict) and isinstance(data.get("manifests"), list):
        data["manifests"] = [{"name": m} if isinstance(m, str) else m for m in data["manifests"]]
    return build(TrainConfig, doc)


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
    """Stage file + ``key.sub=value`` overrides -> a validated TrainConfig, its bucket file read."""
    path = Path(path)
    doc = load_toml(path)
    for o in overrides:
        key, sep, value = o.partition("=")
        if not sep:
            raise UserError(f"override {o!r}: write key.sub=value, e.g. optim.lr=2e-4")
        _set(doc, key.strip().removeprefix("--"), _parse_value(value.strip()))
    run = doc.setdefault("run", {})
    if isinstance(run, dict) and run.get("name", "") == "":
        run["name"] = path.stem
    cfg = _build(doc)
    cfg.data.buckets = BucketConfig.path_from(path, cfg.data.buckets)
    cfg.validate()
    try:
        BucketConfig.from_toml(cfg.data.buckets)
    except FileNotFoundError:
        raise UserError(f"data.buckets = {cfg.data.buckets!r}: no such file") from None
    return cfg


def from_dict(doc: dict) -> TrainConfig:
    """The inverse of ``to_dict`` (a run directory's or a checkpoint's config.json), any version."""
    doc = json.loads(json.dumps(doc))
    version = doc.pop("version", 1)
    if version > VERSION:
        raise UserError(f"config.json has version {version}; this reelcache reads up to {VERSION}: upgrade it")
    if version == 1:
        for old, new in MOVED.items():
            section, key = old.split(".")
            if key in doc.get(section, {}):
                to, name = new.split(".")
                doc.setdefault(to, {})[name] = doc[section].pop(key)
    return _build(doc).validate()


# A resumed run (--load) may change anything but the model's architecture: the saved weights would
# load into another model, or, where a field changes no tensor shape (model.overrides.input_sq_size),
# silently change what they compute. The data position is guarded by the loader, which compares the
# manifests' contents, weights, batch sizes, block and seed (a fingerprint), not their names or paths.
FIXED_ON_RESUME = ("model.preset", "model.overrides", "model.freeze_y_embedder")


def _flat(cfg: TrainConfig) -> dict:
    """{"section.key": value} (a table-valued key such as model.overrides stays one value)."""
    return {f"{s}.{k}": v for s, table in dataclasses.asdict(cfg).items() for k, v in table.items()}


def resume_changes(saved: TrainConfig, now: TrainConfig) -> list[str]:
    """What differs between a checkpoint's config and this run's, as ``key: old -> new`` lines;
    a UserError if a FIXED_ON_RESUME key differs."""
    old, new = _flat(saved), _flat(now)
    changed = [k for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k) and k != "run.name"]
    fixed = [k for k in changed if k in FIXED_ON_RESUME]
    if fixed:
        k = fixed[0]
        raise UserError(
            f"{k} = {new.get(k)!r}, but the checkpoint was trained with {old.get(k)!r}: a resumed run keeps its "
            f"model (start a new run with --init-from <checkpoint> to train the weights as another model)"
        )
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed]
