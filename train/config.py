"""The trainer's typed configuration: defaults, then a stage file, then ``--key.sub=value`` overrides.

    cfg = load_config("configs/train/opensora12/stage1.toml", ["optim.lr=2e-4", "run.name=try2"])

A stage file (``configs/train/**.toml``) has one table per section of ``TrainConfig`` (the sections
and what each builds: train/sections.py and the components' own modules). Unknown keys are
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
from reelcache.base.buckets import BucketConfig
from reelcache.settings import build, check, load_toml, read, setting
from reelcache.train.checkpoint import CheckpointConfig
from reelcache.train.guard import GuardConfig
from reelcache.train.runlog import LogConfig
from reelcache.train.sections import (
    ConditioningConfig,
    DataConfig,
    EMAConfig,
    FlowConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    StepConfig,
)
from reelcache.train.watchdog import WatchdogConfig

# what other stages may use (train/__init__.py: PUBLIC)
__all__ = ["TrainConfig", "from_dict", "load_config"]

# train.flow and train.model (torch) are imported by the checks that build them: importing this module
# loads no torch, pyarrow or wandb (nor do the section modules it imports). Reading a config does:
# validate() checks model.overrides and flow.mask_ratios by building them.

# config.json's format. 1: one [run] table held the checkpoint, log, guard and watchdog settings;
# 2: they are sections of their own; 3: [run] keeps the run's own settings (name, seed, epochs,
# max_steps), and the EMA, the step, the parallel plugin and the fps conditioning have sections.
# MOVED says where each key went, by the version that moved it: a config.json of an older version is
# migrated as it is read; a stage file or an override with an old key is one line naming its new place.
VERSION = 3
MOVED = {
    2: {
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
    },
    3: {
        "run.ema_decay": "ema.decay",
        "run.loss_reduction": "step.loss_reduction",
        "run.plugin": "parallel.plugin",
        "run.compile": "model.compile",
        "model.dtype": "parallel.dtype",
        "optim.grad_clip": "parallel.grad_clip",
        "data.default_fps": "conditioning.default_fps",
        "data.image_fps": "conditioning.image_fps",
    },
}


@dataclass
class TrainConfig:
    model: ModelConfig = setting(doc="[model]: which STDiT3 and how its weights train", factory=ModelConfig)
    data: DataConfig = setting(doc="[data]: the manifests, buckets and loader", factory=DataConfig)
    conditioning: ConditioningConfig = setting(doc="[conditioning]: the fps input", factory=ConditioningConfig)
    optim: OptimConfig = setting(doc="[optim]: AdamW and the lr schedule", factory=OptimConfig)
    flow: FlowConfig = setting(
        doc="[flow]: rectified flow's timesteps, caption dropout, frame masks", factory=FlowConfig
    )
    step: StepConfig = setting(doc="[step]: the loss over the ranks", factory=StepConfig)
    ema: EMAConfig = setting(doc="[ema]: the EMA of the weights", factory=EMAConfig)
    parallel: ParallelConfig = setting(doc="[parallel]: plugin, dtype, gradient clipping", factory=ParallelConfig)
    run: RunConfig = setting(doc="[run]: the run directory, its seed and length", factory=RunConfig)
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
            self.model.stdit3()
        except ValueError as e:
            raise UserError(f"model.overrides = {self.model.overrides!r}: {e}") from None
        try:
            MaskGenerator(self.flow.mask_ratios)
        except ValueError as e:
            raise UserError(f"flow.mask_ratios: {e}") from None

    def to_dict(self) -> dict:
        """config.json: every section, and the format's version (``from_dict`` reads older ones)."""
        return {"version": VERSION, **dataclasses.asdict(self)}

    def frame_interval(self) -> int:
        """The bucket config's frame interval (what the model's fps input is divided by)."""
        return self.data.bucket_config().frame_interval


def _build(doc: dict) -> TrainConfig:
    """A whole config table -> TrainConfig, every value checked (a manifest may be given by name alone)."""
    for moved in MOVED.values():
        for old, new in moved.items():
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
    for v in range(version + 1, VERSION + 1):
        for old, new in MOVED[v].items():
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
