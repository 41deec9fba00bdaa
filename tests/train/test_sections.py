"""train/sections.py: each section builds its component with the section's values, and only with
what is known at run time as keywords (the Parallel, the root, the seed, the model ...)."""

from __future__ import annotations

import pytest
import torch
from latent_data import write_latents
from support import REPO, FakePar

from reelcache import UserError
from reelcache.train.config import load_config
from reelcache.train.flow import Conditioning
from reelcache.train.sections import ConditioningConfig, DataConfig, EMAConfig, Manifest, ModelConfig


def test_the_data_section_builds_this_ranks_loader(tmp_path):
    manifest = write_latents(tmp_path, 8, name="m")
    cfg = DataConfig([Manifest(str(manifest))], str(REPO / "configs/buckets/tiny.toml"), workers=0, prefetch=3, block=5)
    loader = cfg.build(root=tmp_path, par=FakePar(), seed=9)
    assert (loader.rank, loader.world_size, loader.seed) == (0, 1, 9)
    assert (loader.workers, loader.prefetch, loader.block) == (0, 3, 5)
    assert len(loader.clip_id) == 8
    missing = DataConfig([Manifest(str(tmp_path / "absent.parquet"))], cfg.buckets)
    with pytest.raises(UserError, match="absent"):  # a bad manifest is the user's one line, not a traceback
        missing.build(root=tmp_path, par=FakePar(), seed=9)


def test_the_model_section_builds_the_same_fresh_model_from_the_same_seed():
    cfg = ModelConfig("tiny", {"caption_channels": 8}, grad_checkpoint=True)
    a, b = cfg.build(seed=3), cfg.build(seed=3)
    assert a.config.caption_channels == 8 and a.grad_checkpointing
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not a.y_embedder.y_proj.fc1.weight.requires_grad  # freeze_y_embedder, the default


def test_the_conditioning_and_ema_sections():
    cfg = ConditioningConfig(25.0, 120.0)
    assert cfg.build(frame_interval=3) == Conditioning(cfg, frame_interval=3)
    assert cfg.build(frame_interval=3).cfg is cfg
    called = []
    assert EMAConfig(decay=0.0).build(chunks=lambda: called.append(1)) is None and not called  # no EMA: no copy
    ema = EMAConfig(decay=0.5).build(chunks=lambda: {"w": torch.zeros(2)})
    ema.update({"w": torch.ones(2)})
    assert ema.cfg.decay == 0.5 and ema.chunks["w"].tolist() == [0.5, 0.5]


def test_the_step_section_builds_the_step_with_its_reduction():
    cfg = load_config(REPO / "configs/train/debug/original-stage1.toml")
    model = torch.nn.Linear(2, 2)
    optimizer = cfg.optim.build(par=_Adam(), params=model.parameters())
    cond = cfg.conditioning.build(frame_interval=1)
    runtime = dict(par=FakePar(), model=model, optimizer=optimizer, guard=cfg.guard.build(), ema=None, cond=cond)
    step = cfg.step.build(**runtime, flow=cfg.flow, optim=cfg.optim, seed=cfg.run.seed)
    assert step.cfg.loss_reduction == "rank" and step.cond.cfg.image_fps == 120.0 and step.masks is not None
    group = step.optimizer.param_groups[0]
    assert (group["weight_decay"], group["eps"], group["betas"]) == (0.0, 1e-15, (0.9, 0.999))


class _Adam:
    """The part of Parallel the optimizer section calls: DDP's AdamW."""

    def optimizer(self, cfg, *, params):
        return torch.optim.AdamW(params, lr=cfg.lr, **cfg.hyper())
