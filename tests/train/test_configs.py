"""The stage configs under configs/: they load, and they say what Open-Sora 1.2 and its replication did.

References are typed here from docs/OPENSORA12.md (section 3 mask ratios, section 5 bucket
tables B1-B3 and the verified lr values), never taken from the code under test.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import numpy as np
import pytest
from support import REPO

from reelcache.base.buckets import BucketConfig
from reelcache.cache.plan import CacheConfig
from reelcache.ingest.plan import IngestConfig
from reelcache.settings import build
from reelcache.train.config import load_config
from reelcache.train.flow import MaskGenerator
from reelcache.train.loader import weight_schedule
from reelcache.train.model import STDiT3Config
from reelcache.train.plan import Source, epoch_plan
from reelcache.train.schedule import lr_at

TRAIN = REPO / "configs" / "train"
CONFIGS = sorted(TRAIN.rglob("*.toml"))
FULL = {f"opensora12/stage{i}" for i in range(1, 8)} | {f"opensora12-original/stage{i}" for i in range(1, 4)}


def _id(p: Path) -> str:
    return str(p.relative_to(TRAIN).with_suffix(""))


def _load(name: str):
    return load_config(TRAIN / f"{name}.toml")


# ---------------------------------------------------------------------------------------------
# OPENSORA12.md section 5.2: bucket tables, p = (p_res, p_t) where upstream has a tuple.
# (0.0, None) entries (never kept: the clip is demoted) are written [0.0, 0].

B1 = {
    "144p": {1: (1.0, 475), 51: (1.0, 51), 102: ((1.0, 0.33), 27), 204: ((1.0, 0.1), 13), 408: ((1.0, 0.1), 6)},
    "256": {1: (0.4, 297), 51: (0.5, 20), 102: ((0.5, 0.33), 10), 204: ((0.5, 0.1), 5), 408: ((0.5, 0.1), 2)},
    "240p": {1: (0.3, 297), 51: (0.4, 20), 102: ((0.4, 0.33), 10), 204: ((0.4, 0.1), 5), 408: ((0.4, 0.1), 2)},
    "360p": {1: (0.2, 141), 51: (0.15, 8), 102: ((0.15, 0.33), 4), 204: ((0.15, 0.1), 2), 408: ((0.15, 0.1), 1)},
    "512": {1: (0.1, 141)},
    "480p": {1: (0.1, 89)},
    "720p": {1: (0.05, 36)},
    "1024": {1: (0.05, 36)},
    "1080p": {1: (0.1, 5)},
    "2048": {1: (0.1, 5)},
}
B2 = {
    "144p": {1: (1.0, 475), 51: (1.0, 51), 102: ((1.0, 0.33), 27), 204: ((1.0, 0.1), 13), 408: ((1.0, 0.1), 6)},
    "256": {1: (0.4, 297), 51: (0.5, 20), 102: ((0.5, 0.33), 10), 204: ((0.5, 1.0), 5), 408: ((0.5, 1.0), 2)},
    "240p": {1: (0.3, 297), 51: (0.4, 20), 102: ((0.4, 0.33), 10), 204: ((0.4, 1.0), 5), 408: ((0.4, 1.0), 2)},
    "360p": {1: (0.5, 141), 51: (0.15, 8), 102: ((0.3, 0.5), 4), 204: ((0.3, 1.0), 2), 408: ((0.5, 0.5), 1)},
    "512": {1: (0.4, 141), 51: (0.15, 8), 102: ((0.2, 0.4), 4), 204: ((0.2, 1.0), 2), 408: ((0.4, 0.5), 1)},
    "480p": {1: (0.5, 89), 51: (0.2, 5), 102: (0.2, 2), 204: (0.1, 1)},
    "720p": {1: (0.1, 36), 51: (0.03, 1)},
    "1024": {1: (0.1, 36), 51: (0.02, 1)},
    "1080p": {1: (0.01, 5)},
    "2048": {1: (0.01, 5)},
}
B3 = {
    "144p": {1: (1.0, 475), 51: (1.0, 51), 102: (1.0, 27), 204: (1.0, 13), 408: (1.0, 6)},
    "256": {1: (1.0, 297), 51: (0.5, 20), 102: (0.5, 10), 204: (0.5, 5), 408: ((0.5, 0.5), 2)},
    "240p": {1: (1.0, 297), 51: (0.5, 20), 102: (0.5, 10), 204: (0.5, 5), 408: ((0.5, 0.4), 2)},
    "360p": {1: (1.0, 141), 51: (0.5, 8), 102: (0.5, 4), 204: (0.5, 2), 408: ((0.5, 0.3), 1)},
    "512": {1: (1.0, 141), 51: (0.5, 8), 102: (0.5, 4), 204: (0.5, 2), 408: ((0.5, 0.2), 1)},
    "480p": {1: (1.0, 89), 51: (0.5, 5), 102: (0.5, 3), 204: ((0.5, 0.5), 1), 408: (0.0, 0)},
    "720p": {1: (0.3, 36), 51: (0.2, 2), 102: (0.1, 1), 204: (0.0, 0)},
    "1024": {1: (0.3, 36), 51: (0.1, 2), 102: (0.1, 1), 204: (0.0, 0)},
    "1080p": {1: (0.1, 5)},
    "2048": {1: (0.05, 5)},
}
TABLES = {"opensora12-stage1": B1, "opensora12-stage2": B2, "opensora12-stage3": B3}

# OPENSORA12.md section 3, in upstream's dict order (the draw is by cumulative probability in that order).
MASK_NAMES = [
    "random",
    "intepolate",
    "quarter_random",
    "quarter_head",
    "quarter_tail",
    "quarter_head_tail",
    "image_random",
    "image_head",
    "image_tail",
    "image_head_tail",
]
M1 = dict(zip(MASK_NAMES, [0.05, 0.005, 0.005, 0.005, 0.005, 0.005, 0.025, 0.05, 0.025, 0.025]))
M2 = dict(zip(MASK_NAMES, [0.005, 0.002, 0.007, 0.002, 0.002, 0.002, 0.0, 0.22, 0.005, 0.005]))
M3 = dict(zip(MASK_NAMES, [0.01, 0.002, 0.002, 0.002, 0.002, 0.002, 0.0, 0.22, 0.005, 0.005]))

# OPENSORA12.md section 5.2 and DATASETS.md's recipe:
# (bucket table, masks, lr, schedule, warmup, weight decay, epochs, ckpt_every)
STAGES = {
    "opensora12/stage1": ("opensora12-stage1", M1, 1.6e-4, "warmup", 400, 0.01, 5, 100),
    "opensora12/stage2": ("opensora12-stage2", M2, 1.6e-4, "warmup", 400, 0.01, 5, 100),
    "opensora12/stage3": ("opensora12-stage3", M3, 2e-4, "warmup", 1000, 0.01, 5, 100),
    "opensora12/stage4": ("opensora12-stage1", {}, 1.6e-4, "1cycle", 400, 0.01, 3, 100),
    "opensora12/stage5": ("opensora12-stage2", {}, 1.6e-4, "1cycle", 400, 0.01, 1, 100),
    "opensora12/stage6": ("opensora12-stage3", {}, 0.8e-4, "1cycle", 400, 0.01, 1, 100),
    "opensora12/stage7": ("opensora12-stage3", {}, 0.8e-4, "1cycle", 400, 0.01, 3, 100),
    "opensora12-original/stage1": ("opensora12-stage1", M1, 1e-4, "warmup", 1000, 0.0, 1000, 200),
    "opensora12-original/stage2": ("opensora12-stage2", M2, 1e-4, "constant", 0, 0.0, 1000, 200),
    "opensora12-original/stage3": ("opensora12-stage3", M3, 1e-4, "warmup", 1000, 0.0, 1000, 200),
}


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


# ---------------------------------------------------------------------------------------------


def test_every_stage_has_a_config_and_a_debug_twin():
    names = {_id(p) for p in CONFIGS}
    assert FULL <= names
    twins = {f"debug/stage{i}" for i in range(1, 8)} | {f"debug/original-stage{i}" for i in range(1, 4)}
    assert twins <= names


@pytest.mark.parametrize("path", CONFIGS, ids=_id)
def test_config_loads_and_its_parts_are_valid(path):
    cfg = load_config(path)
    assert cfg.run.name, "a run needs a name"
    BucketConfig.from_toml(REPO / cfg.data.buckets)  # the bucket file exists and parses
    MaskGenerator(cfg.flow.mask_ratios)  # names known, ratios sum <= 1
    STDiT3Config.preset(cfg.model.preset, **cfg.model.overrides)  # overrides are real model fields
    for m in cfg.data.manifests:
        assert weight_schedule(m.weight)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("[bci]*/*.toml")), ids=lambda p: p.stem)
def test_every_bucket_cache_and_ingest_config_reads_with_every_value_checked(path):
    kind = path.parent.name
    if kind == "buckets":
        BucketConfig.from_toml(path)
    elif kind == "cache":
        cfg = CacheConfig.from_toml(path)
        assert Path(cfg.buckets).is_file()
    else:  # what `ingest plan --config` adds to the command line's source, format and videos
        with open(path, "rb") as f:
            doc = tomllib.load(f)
        build(IngestConfig, {**doc, "source": "s", "format": "csv", "videos": "."})


def test_run_names_are_unique():
    # the run directory is ROOT/runs/<run.name>: two stages must never share one
    names = [load_config(p).run.name for p in CONFIGS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("name", sorted(TABLES))
def test_bucket_config_is_opensora_table(name):
    path = REPO / "configs" / "buckets" / f"{name}.toml"
    with open(path, "rb") as f:
        raw = tomllib.load(f)["buckets"]
    got = {res: {int(t): _tuples(spec) for t, spec in frames.items()} for res, frames in raw.items()}
    assert got == TABLES[name]
    # what base/buckets.py makes of it: (resolution, T, p_res, p_t, batch), p_t = 1 without a tuple
    rows = sorted(
        (res, t, *(p if isinstance(p, tuple) else (p, 1.0)), bs)
        for res, frames in TABLES[name].items()
        for t, (p, bs) in frames.items()
    )
    assert list(BucketConfig.from_toml(path).table) == rows


@pytest.mark.parametrize("name", sorted(STAGES))
def test_full_stage_matches_the_recipe(name):
    buckets, masks, lr, schedule, warmup, wd, epochs, ckpt_every = STAGES[name]
    cfg = _load(name)
    assert Path(cfg.data.buckets).name == f"{buckets}.toml"
    assert cfg.flow.mask_ratios == masks and list(cfg.flow.mask_ratios) == list(masks)
    o, r, m = cfg.optim, cfg.run, cfg.model
    assert (o.lr, o.schedule, o.warmup_steps, o.weight_decay) == (lr, schedule, warmup, wd)
    assert (o.adam_eps, cfg.parallel.grad_clip, o.betas) == (1e-15, 1.0, (0.9, 0.999))
    assert (r.epochs, r.seed, cfg.ema.decay) == (epochs, 42, 0.99)
    assert (cfg.checkpoint.every, cfg.log.wandb_mode) == (ckpt_every, "offline")
    assert (m.preset, cfg.parallel.dtype, m.grad_checkpoint, m.freeze_y_embedder) == ("STDiT3-XL/2", "bf16", True, True)
    upstream = {"pos_embed_bf16_freqs": True} if name.startswith("opensora12-original/") else {}
    assert m.overrides == {"caption_channels": 4096, "model_max_length": 300, **upstream}
    f = cfg.flow
    assert (f.sample_method, f.use_timestep_transform, f.caption_dropout) == ("logit-normal", True, 0.1)


def test_identity_share_of_the_masks():
    # section 3's last column: identity takes the rest
    for masks, identity in ((M1, 0.80), (M2, 0.75), (M3, 0.75)):
        assert MaskGenerator(masks).ratios["identity"] == pytest.approx(identity, abs=1e-9)


@pytest.mark.parametrize("name", ["opensora12/stage4", "opensora12/stage5"])
def test_one_cycle_bump_reproduces_open_soras_values(name):
    # verified by running Open-Sora's OneCycleScheduler (OPENSORA12.md section 5.2)
    o = _load(name).optim
    expected = {
        0: 1.6e-5,
        100: 1.074e-4,
        200: 3.28e-4,
        400: 6.4e-4,
        600: 4.0e-4,
        800: 1.6e-4,
        801: 1.6e-4,
        5000: 1.6e-4,
    }
    for k, lr in expected.items():
        assert lr_at(k, o) == pytest.approx(lr, rel=1e-3), k


@pytest.mark.parametrize("name", ["opensora12/stage6", "opensora12/stage7"])
def test_smaller_bump_of_stages_6_and_7(name):
    o = _load(name).optim
    assert lr_at(0, o) == pytest.approx(1.6e-5, rel=1e-9)
    assert lr_at(400, o) == pytest.approx(3.2e-4, rel=1e-9)  # the peak after the 400 rising steps
    assert lr_at(800, o) == pytest.approx(0.8e-4, rel=1e-9)  # down to the final lr after 400 more
    assert max(lr_at(k, o) for k in range(1000)) == pytest.approx(3.2e-4, rel=1e-9)


@pytest.mark.parametrize(
    "name,base,warmup",
    [("opensora12/stage1", 1.6e-4, 400), ("opensora12/stage3", 2e-4, 1000), ("opensora12-original/stage1", 1e-4, 1000)],
)
def test_linear_warmup_first_lr_is_base_over_w_plus_1(name, base, warmup):
    # Open-Sora's LinearWarmupLR: construction counts as k=0, so the first step runs at base/(W+1) (verified)
    o = _load(name).optim
    assert lr_at(0, o) == pytest.approx(base / (warmup + 1), rel=1e-12)
    assert lr_at(warmup - 1, o) == pytest.approx(base * warmup / (warmup + 1), rel=1e-12)
    assert lr_at(warmup, o) == lr_at(10 * warmup, o) == base


def test_original_stage2_is_constant():
    o = _load("opensora12-original/stage2").optim
    assert {lr_at(k, o) for k in (0, 1, 999, 10_000)} == {1e-4}


def _twin_of(name: str) -> str:
    stem = name.removeprefix("debug/")
    return (
        f"opensora12-original/{stem.removeprefix('original-')}"
        if stem.startswith("original-")
        else f"opensora12/{stem}"
    )


@pytest.mark.parametrize("name", sorted(_id(p) for p in CONFIGS if _id(p).startswith("debug/")))
def test_debug_twin_has_the_full_stages_shape(name):
    full, twin = _load(_twin_of(name)), _load(name)
    assert twin.optim.schedule == full.optim.schedule
    assert list(twin.flow.mask_ratios) == list(full.flow.mask_ratios)
    assert twin.flow.mask_ratios == full.flow.mask_ratios
    assert twin.step.loss_reduction == full.step.loss_reduction
    assert (twin.flow.sample_method, twin.flow.use_timestep_transform) == (
        full.flow.sample_method,
        full.flow.use_timestep_transform,
    )
    assert twin.model.freeze_y_embedder == full.model.freeze_y_embedder
    # Open-Sora's behaviours where the full stage asks for them (the opensora12-original configs)
    assert twin.model.stdit3().pos_embed_bf16_freqs == full.model.stdit3().pos_embed_bf16_freqs
    assert twin.conditioning.image_fps == full.conditioning.image_fps
    assert twin.checkpoint.at_start == full.checkpoint.at_start
    assert (twin.guard.spike_z, twin.guard.skip_nonfinite) == (full.guard.spike_z, full.guard.skip_nonfinite)
    # CPU-sized: the tiny model on the demo cache, a few steps of schedule, one or two epochs
    assert twin.model.preset == "tiny" and Path(twin.data.buckets).name == "demo.toml"
    assert [m.name for m in twin.data.manifests] == ["demo-stage1-tiny"]
    assert 1 <= twin.run.epochs <= 2 and 0 < twin.checkpoint.every <= 10
    assert twin.optim.warmup_steps + twin.optim.cooldown_steps <= 20
    if full.optim.schedule == "1cycle":  # the bump keeps its shape: min < final < max
        assert twin.optim.min_lr < twin.optim.lr < twin.optim.max_lr


# ---------------------------------------------------------------------------------------------
# the per-epoch weight ramp of stage 3


def _ramp_configs():
    out = []
    for p in CONFIGS:
        cfg = load_config(p)
        if any(isinstance(m.weight, list) for m in cfg.data.manifests):
            out.append(_id(p))
    return out


def test_the_ramp_is_where_level_5_enters():
    assert _ramp_configs() == ["opensora12/stage3"]


def test_ramp_schedules_parse_as_lists_and_finish_within_the_stage():
    cfg = _load("opensora12/stage3")
    schedules = {m.name: weight_schedule(m.weight) for m in cfg.data.manifests}
    hard = [n for n in schedules if "-l5-" in n]
    assert hard and all(isinstance(schedules[n], list) and len(schedules[n]) == cfg.run.epochs for n in hard)
    for n in hard:
        ws = schedules[n]
        assert ws[0] == 0.0 and all(a < b for a, b in zip(ws, ws[1:]))  # a ramp from nothing, not a switch
    last = [ws[-1] for ws in schedules.values()]
    assert math.isclose(sum(last), 1.0)  # the last epoch's shares cover the data


def test_ramp_through_the_real_planner():
    # manifests sized as stage3.toml's comment assumes (OpenVid : MiraData = 3 : 1, level 5 = 1/5 of
    # each): epoch 0 holds no level-5 clip, the last epoch every clip exactly once
    cfg = _load("opensora12/stage3")
    sizes = {"openvid-l4": 240, "miradata-l4": 80, "openvid-l5": 60, "miradata-l5": 20}
    buckets = BucketConfig.from_dict({"144p": {51: [1.0, 4]}})
    manifests = cfg.data.manifests
    assert [m.name.removesuffix("-os12-stage3") for m in manifests] == list(sizes)

    def sources(epoch):
        out = []
        for m, (key, n) in zip(manifests, sizes.items()):
            ws = weight_schedule(m.weight)
            out.append(
                Source(
                    f"fp-{key}",
                    np.array([f"{key}-{i:04d}" for i in range(n)], dtype=object),
                    np.array(["144p/51/0.56"] * n, dtype=object),
                    np.array(["s"] * n, dtype=object),
                    np.arange(n, dtype=np.int64),
                    ws[min(epoch, len(ws) - 1)],
                )
            )
        return out

    ids = np.concatenate([s.clip_id for s in sources(0)])
    level5 = np.array(["-l5-" in c for c in ids])
    hard_counts = []
    for epoch in range(cfg.run.epochs):
        plan = epoch_plan(sources(epoch), buckets, seed=42, epoch=epoch)
        assert len(plan.order) == len(ids)  # the epoch's length stays the same
        hard_counts.append(int(level5[plan.order].sum()))
    assert hard_counts[0] == 0
    assert all(a < b for a, b in zip(hard_counts, hard_counts[1:])) and hard_counts[-1] == level5.sum()
    assert sorted(plan.order.tolist()) == list(range(len(ids)))  # last epoch: every clip once


@pytest.mark.parametrize(
    "path",
    sorted((REPO / "configs/train").rglob("*.toml")),
    ids=lambda p: str(p.relative_to(REPO / "configs/train").with_suffix("")),
)
def test_every_stage_clips_gradients_at_1(path):
    """docs/TRAIN.md: grad clip 1.0, in every stage (opensora12/, opensora12-original/) and its debug twin."""
    from reelcache.train.config import load_config

    assert load_config(path).parallel.grad_clip == 1.0
