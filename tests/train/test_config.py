"""train/config.py: config.json's versions (an old one as the trainer wrote it migrates on read), old
key names in a stage file or an override (one line naming the new place), and what a resumed run may
change. tests/fixtures/train-v2 is a checkpoint's config.json and state.json written by the trainer
of version 2 (a 2-step ddp run with non-default values in every key that moved since)."""

from __future__ import annotations

import json

import pytest
from support import REPO

from reelcache import UserError
from reelcache.train.config import MOVED, VERSION, from_dict, load_config, resume_changes

TRAIN = REPO / "configs" / "train"
V2 = REPO / "tests/fixtures/train-v2"
SECTIONS = {"version", "model", "data", "conditioning", "optim", "flow", "step", "ema", "parallel", "run"}
SECTIONS |= {"checkpoint", "log", "guard", "watchdog"}


def _load(name: str, *overrides: str):
    return load_config(TRAIN / f"{name}.toml", list(overrides))


def test_config_json_is_versioned_and_reads_back():
    cfg = _load("debug/stage1")
    doc = cfg.to_dict()
    assert doc["version"] == VERSION == 3
    assert set(doc) == SECTIONS
    assert set(doc["run"]) == {"name", "seed", "epochs", "max_steps"}  # the run's own, nothing else
    assert from_dict(doc) == cfg


def test_a_version_2_config_json_as_the_trainer_wrote_it_reads_into_the_new_sections():
    doc = json.loads((V2 / "config.json").read_text())
    assert doc["version"] == 2 and doc["run"]["plugin"] == "ddp"  # the fixture is the old layout
    cfg = from_dict(doc)
    assert (cfg.parallel.plugin, cfg.parallel.dtype, cfg.parallel.grad_clip) == ("ddp", "fp32", 0.5)
    assert (cfg.ema.decay, cfg.step.loss_reduction, cfg.model.compile) == (0.9, "rank", False)
    assert (cfg.conditioning.default_fps, cfg.conditioning.image_fps) == (25, 120)
    assert (cfg.run.name, cfg.run.max_steps, cfg.checkpoint.every, cfg.log.wandb_mode) == ("v2", 2, 2, "offline")
    assert cfg.model.overrides == {"caption_channels": 8, "model_max_length": 300}
    # what did not move reads as written; what moved is gone from its old section
    assert cfg.optim.lr == doc["optim"]["lr"] and cfg.flow.mask_ratios == doc["flow"]["mask_ratios"]
    again = cfg.to_dict()
    for old in MOVED[3]:
        section, key = old.split(".")
        assert key not in again[section], old


def test_a_version_1_config_json_still_reads():
    """Before version 2 one [run] table also held the checkpoint, log, guard and watchdog keys, and
    there was no version: the version-2 fixture written back that way, key by key."""
    doc = json.loads((V2 / "config.json").read_text())
    del doc["version"]
    for old, new in MOVED[2].items():
        section, key = new.split(".")
        doc["run"][old.split(".")[1]] = doc[section].pop(key)
    for section in ("checkpoint", "log", "guard", "watchdog"):
        doc.pop(section)  # what is left (checkpoint.at_start, guard.skip_nonfinite) came after version 1
    doc["run"]["ckpt_every"], doc["run"]["spike_window"] = 7, 50
    got = from_dict(doc)
    assert (got.checkpoint.every, got.guard.window, got.log.wandb_mode) == (7, 50, "offline")
    assert (got.parallel.plugin, got.ema.decay) == ("ddp", 0.9)
    assert got.model == from_dict(json.loads((V2 / "config.json").read_text())).model


@pytest.mark.parametrize(
    "override,line",
    [
        ("run.plugin=zero2", "run.plugin is now parallel.plugin (the [parallel] section): rename it"),
        ("run.ema_decay=0.9", "run.ema_decay is now ema.decay (the [ema] section): rename it"),
        ("model.dtype=fp32", "model.dtype is now parallel.dtype (the [parallel] section): rename it"),
        ("optim.grad_clip=0", "optim.grad_clip is now parallel.grad_clip (the [parallel] section): rename it"),
        ("data.image_fps=120", "data.image_fps is now conditioning.image_fps (the [conditioning] section): rename it"),
        ("run.ckpt_every=5", "run.ckpt_every is now checkpoint.every (the [checkpoint] section): rename it"),
    ],
)
def test_an_old_key_in_an_override_is_one_line_naming_where_it_lives_now(override, line):
    with pytest.raises(UserError) as e:
        _load("debug/stage1", override)
    assert str(e.value) == line


def test_an_old_key_in_a_stage_file_is_the_same_line(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text((TRAIN / "debug/stage1.toml").read_text().replace("[run]\n", '[run]\nplugin = "ddp"\n'))
    with pytest.raises(UserError, match=r"^run.plugin is now parallel.plugin \(the \[parallel\] section\)"):
        load_config(path)


def test_a_newer_config_json_is_one_line():
    doc = _load("debug/stage1").to_dict()
    with pytest.raises(UserError, match=r"^config.json has version 4; this reelcache reads up to 3: upgrade it$"):
        from_dict({**doc, "version": 4})


def test_resume_prints_what_changed_and_refuses_another_model():
    saved = _load("debug/stage1")
    now = _load("debug/stage1", "optim.lr=2e-3", "log.every=5", "data.workers=0", "parallel.plugin=ddp")
    assert resume_changes(saved, now) == [
        "data.workers: 1 -> 0",
        "log.every: 1 -> 5",
        "optim.lr: 0.0016 -> 0.002",
        "parallel.plugin: 'auto' -> 'ddp'",
    ]
    assert resume_changes(saved, _load("debug/stage1")) == []
    other = _load("debug/stage1", "model.overrides={caption_channels=32, input_sq_size=256}")
    with pytest.raises(UserError, match=r"^model.overrides = .*input_sq_size.*: a resumed run keeps its model"):
        resume_changes(saved, other)


def test_a_checkpoint_of_the_old_layout_is_compared_with_the_new_config_without_false_changes():
    """A run resumed from a version-2 checkpoint lists only what really changed, not the moved keys."""
    saved = from_dict(json.loads((V2 / "config.json").read_text()))
    now = from_dict(saved.to_dict())
    now.parallel.grad_clip = 1.0
    assert resume_changes(saved, now) == ["parallel.grad_clip: 0.5 -> 1.0"]
